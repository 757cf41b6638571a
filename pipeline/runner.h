// The step protocol's worker side: each worker runs its part of a pipeline's
// training step by itself, from one call of the master per batch.
//
// When a Pipeline with a named loss is created, the master gives every
// worker a step runner ("remora.pipeline.make_runner") holding what does not
// change from batch to batch: the worker's stages, its actions' order (the
// schedule), where every other stage lives, the loss and the worker's
// optimizer. A batch is then one call per worker ("remora.pipeline.run"):
// the batch's autograd context id, the batch before it (whose end here it
// waits for: the master may send the next batch's call while one runs, and
// the calls may arrive in any order), the inputs for the worker of stage 0
// and the targets for the worker of the last stage. The worker
//
//   - runs its actions in the schedule's order (runtime/compute_lane.h),
//     each forward pass as soon as its input is here;
//   - pushes each stage's output straight to the next stage's worker
//     ("remora.pipeline.push"), one message per micro-batch, recorded in the
//     batch's distributed autograd context like any RPC that carries
//     tensors that require grad, so that gradients go back the same way
//     ("remora.autograd.propagate");
//   - on the last stage, computes each micro-batch's loss (weighted by its
//     share of the batch's rows) on the stage's device and starts its
//     backward pass there;
//   - once its order's last action has ended, steps its optimizer with the
//     context's gradients, releases the context and replies: the last
//     stage's worker with the batch's loss.
//
// Evaluation ("remora.pipeline.eval") flows the same way, forward only
// ("remora.pipeline.eval_push"), and the last stage's worker replies with
// the outputs, or with labels with the count of rows classified right.
//
// A batch that fails anywhere fails on every worker once the master tells
// them ("remora.pipeline.abandon"): what waits for it is dropped and the
// next batch starts clean.
//
// Thread-safety: the registered functions may run on any thread.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "rpc/registry.h"

namespace remora::pipeline {

// What takes part in each batch beside a worker's step runner: data
// parallelism's gradient group (parallel/gradient_group.h), which sums the
// gradients over the replicas. Thread-safety: called from the runner's
// threads, one batch at a time; must be thread-safe against its own hooks.
class StepParticipant {
 public:
  virtual ~StepParticipant() = default;
  // Before the batch's first action.
  virtual void Begin(int64_t context_id, int64_t micro_batches) = 0;
  // After the batch's last action here, before the optimizer step: the
  // replicas' gradient sum; may block (on the other replicas). Throws on
  // failure, naming the worker.
  virtual void Finish(int64_t context_id) = 0;
  // With Steps(): the optimizer's step, after Finish and what the runner
  // does to the summed gradients (tied weights' sums, clipping). Throws
  // on failure, naming the worker.
  virtual void Step(int64_t context_id) = 0;
  // The batch failed: forget it.
  virtual void Discard(int64_t context_id) = 0;
  // Whether the participant steps the parameters itself (ZeRO-1: Step):
  // the runner then steps no optimizer of its own.
  virtual bool Steps() const = 0;
};

// Makes `participant` take part in every later batch of the step runner of
// pipeline `runner_id` in this process (one participant per runner).
// NotFound for an unknown runner, AlreadyExists when it has one.
absl::Status AttachToRunner(int64_t runner_id, std::shared_ptr<StepParticipant> participant);

// Registers make_runner, run, push, targets, eval, eval_targets, eval_push,
// abandon, drop_runner and seed (remora.pipeline.*) in a worker's registry; push, targets,
// eval_push and eval_targets as prompt (rpc::Registry::MarkPrompt).
absl::Status RegisterRunnerFunctions(rpc::Registry& registry);

}  // namespace remora::pipeline
