// ps::ParameterServer: the parameter-server mode of training. This process
// holds the model and its optimizer; every step, each worker pulls the
// current parameters, computes the gradient of its share of the batch and
// pushes it; the server sums the gradients and steps.
//
//   ps::PsOptions o;
//   o.stages = {pipeline::StageSpec::Registered("SmallCnn", {0, 4, 0})};
//   o.workers = {"worker1", "worker2"};
//   o.loss = "cross_entropy";
//   o.optimizer = optim::OptimizerOptions::SGD(0.01).set_momentum(0.9);
//   auto trainer = train::PsTrainer::Create(*agent, o).value();
//   trainer->set_on_step([](const ps::StepReport& r, double seconds) { ... });
//   double loss = trainer->StartStep({images, labels}).wait().value();
//   // or each worker reads its share itself (PsTrainer::ReadOnWorkers; the
//   // master sends row numbers). train::Fit runs the epochs.
//
// Steps are taken through train::PsTrainer, a train::Trainer like every
// other way of training; the server itself serves its state (save, load,
// eval, who is live).
//
// Synchronous by default: the batch's rows are shared out contiguously
// (tensor_split) among the workers, each loss weighted by its rows over
// the batch's, and the gradients summed: one step equals a step of the
// model in one process on the whole batch. With `backup_workers` k > 0,
// the step goes on with the first n - k gradient sets to arrive (the
// others' rows are left out of the step and the gradient rescaled to the
// mean over the rows used); a worker still busy with an earlier step is
// not sent a share and counts as dropped. A late reply is ignored: each
// step waits only on its own calls. The report of each step names the
// workers used, dropped and lost.
//
// Failures: a worker whose call timed out or could not reach it is lost;
// one whose call failed otherwise is probed, and one that does not answer
// (killed, stopped, cut off) is lost too: it fails the step, naming it, without
// backup workers; with them, it is dropped for good and reported, and
// training goes on while at least n - k workers remain (the step is redone
// over those left when its round can no longer collect n - k). One that
// answers failed in its own computation (an exception in its stage, bad
// rows): that fails the step, naming it, with or without backup workers,
// and it stays in the group (a straggler's late error fails the step that
// finds it). A worker is never dropped for an error that is not a loss.
//
// Parameters and gradients travel as tensors in the calls: between
// processes on one host through shared memory (channel/shm), else in the
// gRPC messages.
//
// With `servers` (master --ps-partitions K >= 2) the parameters live on those
// server processes instead, partitioned by bytes (ps/partitions.h): the
// workers pull from and push to the partitions directly, and this process
// sends the rows, learns which gradient sets came first (as above) and
// tells the partitions whose gradients to apply. It keeps a copy of the model
// that eval, stage_state and Load bring up to date from (or send to) the
// partitions. A server whose call fails fails the step naming it (it is never
// a dropped straggler): when a worker's call fails, the servers are
// checked first.
//
// Thread-safety: one step (or eval) at a time; the completion
// signal the calls' callbacks share is thread-safe. Ownership: the server
// owns its model and optimizer (or its PartitionSet) and holds RRefs to the
// workers' replicas (freed on the workers when it is destroyed); the agent
// must outlive it.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "optim/distributed_optimizer.h"
#include "pipeline/pipeline.h"
#include "pipeline/stage.h"
#include "ps/partitions.h"
#include "rpc/agent.h"

namespace remora::train {
class PsTrainer;
}  // namespace remora::train

namespace remora::ps {

struct PsOptions {
  std::vector<pipeline::StageSpec> stages;  // the model, in order
  std::vector<std::string> workers;
  std::string loss = "cross_entropy";  // or "mse" (ps/replica.h)
  optim::OptimizerOptions optimizer = optim::OptimizerOptions::SGD(0.01);
  int backup_workers = 0;  // k, 0 <= k < workers
  // Each worker's forward under bf16 autocast, bf16 between stages
  // (pipeline::StageSpec::bf16's); the server steps float32 parameters.
  bool bf16 = false;
  // Above 0: each step's gradients (the workers' mean) clipped to this
  // norm over the whole model, as torch.nn.utils.clip_grad_norm_ (with
  // servers: each partition's squared share asked for first, "norm").
  double clip_grad_norm = 0;
  // Server processes holding a partition of the parameters each (not
  // among `workers`); empty: the parameters live in this process.
  std::vector<std::string> servers;
  std::string device = "cpu";  // where the server's model lives
  // When set, the workers' random generators are seeded from it
  // (pipeline::SeedWorkers) before their replicas are placed.
  std::optional<uint64_t> seed;
};

// What one step did.
struct StepReport {
  int64_t step = 0;  // from 1
  double loss = 0;   // the mean loss over the rows used
  int64_t rows = 0;  // rows whose gradients the step used
  int64_t batch_rows = 0;
  std::vector<std::string> used;     // workers whose gradients the step used
  std::vector<std::string> dropped;  // stragglers: not waited for, or still busy
  std::vector<std::string> lost;     // failed in this step (backup workers only)
  int64_t pull_bytes = 0;  // parameters sent to workers
  int64_t push_bytes = 0;  // gradients received from the workers used
  int rounds = 1;          // > 1 when a lost worker made the step start again
  double grad_norm = -1;   // with clip_grad_norm: the gradients' norm before clipping
};

class ParameterServer {
 public:
  // Builds the model here and a replica on every worker (checking that
  // its parameters have the model's shapes) and creates the optimizer. An
  // error names the worker that failed.
  static absl::StatusOr<std::unique_ptr<ParameterServer>> Create(rpc::Agent& agent, PsOptions options);
  // Waits for the workers' calls still in flight (stragglers'): with
  // partitions until they end; without, up to 10 s each, and marks a worker
  // whose call failed and that does not answer (Failed) lost, so that the
  // agent's shutdown waits for nothing of it.
  ~ParameterServer();

  // The model's outputs for `inputs`, in eval mode, in this process.
  absl::StatusOr<at::Tensor> eval(const at::Tensor& inputs);

  // Per stage, its parameters then buffers (copies on the CPU); the
  // optimizer's state (optim::SaveOptimizerState's bytes; with partitions,
  // theirs packed, ps/partitions.h); and their reverse (an error when the
  // saved optimizer state comes from another number of partitions). Load's
  // `steps_done` is the steps the saved state had taken: the next step is
  // numbered steps_done + 1, as in the run that saved it.
  absl::StatusOr<std::vector<std::vector<at::Tensor>>> stage_state();
  absl::StatusOr<at::Tensor> optimizer_state() const;
  // Each stage's state names (pipeline::StateNames), in stage_state's order.
  std::vector<std::vector<std::string>> stage_names() const;
  absl::Status Load(const std::vector<std::vector<at::Tensor>>& stages, const at::Tensor& optimizer,
                    int64_t steps_done = 0);

  // With servers: which holds which parameters (empty without); and each
  // partition's parameters as it holds them.
  std::vector<PartitionPlacement> placement() const;
  absl::StatusOr<std::vector<std::vector<at::Tensor>>> partition_parameters() const;

  // Workers not lost so far, in --workers order.
  std::vector<std::string> live_workers() const;
  // Worker `name`'s call outside a step (say, a count its data source
  // keeps) failed with `why`: when it does not answer a probe, it is lost
  // as a step would lose it, when backup workers allow that (true); false
  // without them, when it answers (its own error), or when a server is
  // lost too (then the failure is the caller's error).
  bool Lost(const std::string& name, const absl::Status& why);
  int64_t parameter_bytes() const;
  int64_t steps() const { return step_; }

 private:
  friend class train::PsTrainer;  // takes the steps

  // One step on the batch (see above).
  absl::StatusOr<StepReport> train_step(const at::Tensor& inputs, const at::Tensor& targets);
  // The same where each worker reads its share of the rows itself, from a
  // source opened on every worker (pipeline::WorkerData::Open over
  // live_workers()); shared out as above, by rows.
  absl::StatusOr<StepReport> train_step(const pipeline::WorkerRows& rows);

  // Shared with the calls' callbacks, which may outlive the server.
  struct Signal {
    absl::Mutex mu;
    int64_t completions ABSL_GUARDED_BY(mu) = 0;
  };
  // One worker, as seen from the training thread.
  struct Slot {
    std::string name;
    rpc::RRef replica;
    bool busy = false;          // `call` not yet settled
    rpc::Future<c10::IValue> call;   // its latest compute call
    int64_t call_step = 0;      // the step (round) it belongs to
    int64_t rows = 0;
    bool lost = false;
    std::string lost_reason;
  };

  // A step's batch: tensors sent to the workers, or the rows they read.
  struct Batch {
    at::Tensor inputs, targets;
    const pipeline::WorkerRows* rows = nullptr;

    int64_t size() const { return rows != nullptr ? rows->rows.numel() : inputs.size(0); }
  };

  ParameterServer(rpc::Agent& agent, PsOptions options, std::vector<std::unique_ptr<pipeline::StageModule>> model,
                  std::vector<at::Tensor> params, std::vector<Slot> slots, std::unique_ptr<PartitionSet> partitions);

  // The step on `batch`, checked: rounds until enough gradient sets came,
  // then the optimizer's step.
  absl::StatusOr<StepReport> Step(const Batch& batch, StepReport report);
  // Sends every idle live worker its share of the batch; returns their slots.
  std::vector<size_t> Send(const Batch& batch, int64_t round, StepReport* report);
  // Marks slot i lost with `status` (and its worker lost to the agent:
  // dropped for good), unless a server is lost: then the error naming it
  // (the job cannot go on).
  absl::Status Lose(size_t i, const absl::Status& status);
  // With servers: the error naming one that is lost (checked after slot i's
  // call failed with `status`); OK without servers or when all answer.
  absl::Status CheckServers(size_t i, const absl::Status& status) const;
  // Slot i's call failed with `failure`: when it timed out or could not
  // reach the worker (DEADLINE_EXCEEDED, UNAVAILABLE), or the worker does
  // not answer a probe, Lose(i) (OK: lost); else the worker's own error,
  // for the step `where` to fail with (the worker stays).
  absl::Status Failed(size_t i, const absl::Status& failure, const std::string& where);
  // Settles the calls of earlier rounds (a failed one loses its worker)
  // until `needed` live workers are idle; `seen` as WaitForCompletion's.
  absl::Status AwaitIdle(int needed, const std::string& where, int64_t* seen, StepReport* report);
  // Waits for `needed` gradient sets of this round's calls to the slots
  // `sent` (into `done`, by slot); false when too many of those workers
  // were lost for that (the step starts again over the workers left).
  absl::StatusOr<bool> AwaitRound(const std::vector<size_t>& sent, int needed, const std::string& where,
                                  int64_t* seen, std::map<size_t, c10::IValue>* done, StepReport* report);
  // The error of a step left with `live` workers where it needs `needed`.
  absl::Status TooFew(int live, int needed, const std::string& where) const;
  // Steps with the gradients in `done` (this round's, by slot), filling
  // the report's used, dropped, rows, loss and push_bytes.
  absl::Status Apply(const std::map<size_t, c10::IValue>& done, StepReport& report);
  // Waits until the calls' completion count differs from `seen`; returns
  // the count now.
  int64_t WaitForCompletion(int64_t seen);

  rpc::Agent& agent_;
  const PsOptions options_;
  std::vector<std::unique_ptr<pipeline::StageModule>> model_;
  std::vector<at::Tensor> params_;  // the model's, in order
  std::unique_ptr<torch::optim::Optimizer> optimizer_;  // null with partitions_
  std::unique_ptr<PartitionSet> partitions_;  // null without servers
  std::vector<Slot> slots_;
  std::shared_ptr<Signal> signal_;
  int64_t step_ = 0;
  int64_t round_ = 0;  // every round of every step, for tagging calls
  int64_t step_first_round_ = 1;  // the first round of the step under way
};

}  // namespace remora::ps
