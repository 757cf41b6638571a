// pipeline::PendingStep (internal): the step protocol's replies owed by
// the workers, behind the StartedStep that Pipeline::start_train_step and
// parallel::DataParallelPipeline::start_train_step return (Started()).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "pipeline/step.h"
#include "rpc/agent.h"

namespace remora::pipeline {

// A training step started on the workers and not waited for yet
// (Pipeline::start_train_step, DataParallelPipeline::start_train_step).
// The master may start the next step before waiting for this one: each
// worker runs its batches in the order they were started.
//
// Thread-safety: one thread at a time. Ownership: holds the replies; the
// pipeline that started it must outlive it. A step never waited for still
// runs to its end on the workers (or is dropped there by abandon()).
class PendingStep {
 public:
  // Where a failure of the reply owed by worker i is reported from.
  using Where = std::function<std::string(int i)>;
  // A step already over (run on this process, or failed to start).
  static PendingStep Done(absl::StatusOr<double> loss);
  // `replies[i]` owed by `workers[i]`; the loss is the sum of the replies
  // at `loss_replies`; `abandon` tells every worker to drop the step.
  // `over` runs once wait() has its outcome.
  PendingStep(rpc::Agent& agent, std::vector<std::string> workers, std::vector<rpc::Future<c10::IValue>> replies,
              std::vector<int> loss_replies, std::function<void()> abandon, Where where,
              std::function<void()> over);

  // Blocks until the step has ended on every worker (WaitForReplies) and
  // returns its loss, or the failure to report (the others told to drop
  // the step). Called once.
  absl::StatusOr<double> wait();
  // Tells the workers to drop the step, not waiting for them (after an
  // earlier step failed).
  void abandon();
  // The step was over when it was returned (Done: it ran within the call
  // that started it, as the master-centred protocol's steps do, or did not
  // start), so that a caller timing steps accounts it at once.
  bool over_at_start() const { return done_.has_value(); }
  // After wait(): the whole model's gradient norm before clipping, as the
  // workers measured it (PipelineOptions::clip_grad_norm); -1 without
  // clipping.
  double grad_norm() const { return grad_norm_; }

 private:
  explicit PendingStep(absl::StatusOr<double> loss) : done_(std::move(loss)) {}

  std::optional<absl::StatusOr<double>> done_;
  rpc::Agent* agent_ = nullptr;
  std::vector<std::string> workers_;
  std::vector<rpc::Future<c10::IValue>> replies_;
  std::vector<int> loss_replies_;
  std::function<void()> abandon_;
  Where where_;
  std::function<void()> over_;
  double grad_norm_ = -1;
};

// The handle for `pending`, which it owns from then on.
StartedStep Started(PendingStep pending);

}  // namespace remora::pipeline
