// pipeline::StartedStep: a training step started and not yet waited for,
// the one handle every step call returns: Pipeline::start_train_step,
// parallel::DataParallelPipeline::start_train_step and every
// train::Trainer's StartStep.
//
//   pipeline::StartedStep s = pipe->start_train_step(x, y);
//   // ... start the next batch, read data ...
//   double loss = s.wait().value();
//
// wait() gives the step's loss, or the error that ended it (called once);
// abandon() drops it instead (a step before it failed; its workers are told
// to drop it). A step that is over_at_start() ran within the call that
// started it (the master-centred protocol's steps, a step in this process,
// the parameter server's, or one that failed to start): a caller timing
// steps accounts for it at once, not after the next one has started. After
// wait(), grad_norm() is the whole model's gradient norm before clipping
// (-1 without clipping).
//
// Thread-safety: used by the thread that started it. Movable. Whatever
// started it (the pipeline, the trainer) must outlive it.
#pragma once

#include <functional>
#include <utility>

#include "absl/status/statusor.h"

namespace remora::pipeline {

class StartedStep {
 public:
  StartedStep(std::function<absl::StatusOr<double>()> wait, std::function<void()> abandon, bool over_at_start,
              std::function<double()> grad_norm = nullptr)
      : wait_(std::move(wait)),
        abandon_(std::move(abandon)),
        grad_norm_(std::move(grad_norm)),
        over_at_start_(over_at_start) {}
  // A step over already: its loss (or the error that ended it) and norm.
  static StartedStep Done(absl::StatusOr<double> loss, double grad_norm = -1) {
    return StartedStep([loss = std::move(loss)] { return loss; }, nullptr, /*over_at_start=*/true,
                       [grad_norm] { return grad_norm; });
  }

  absl::StatusOr<double> wait() { return wait_(); }
  void abandon() {
    if (abandon_) abandon_();
  }
  bool over_at_start() const { return over_at_start_; }
  double grad_norm() const { return grad_norm_ ? grad_norm_() : -1; }

 private:
  std::function<absl::StatusOr<double>()> wait_;
  std::function<void()> abandon_;
  std::function<double()> grad_norm_;
  bool over_at_start_;
};

}  // namespace remora::pipeline
