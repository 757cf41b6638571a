// The step interface of a training run: one model in training, however it
// runs (a pipeline over workers, with or without replicas; a parameter
// server; this process alone). train::Fit (train/fit.h) runs epochs,
// evaluation, checkpoint cadence and resume on it, once for all of them.
//
//   std::unique_ptr<train::Trainer> t = ...;   // PipelineTrainer, LocalTrainer
//   train::StartedStep s = t->StartStep({x, y});
//   double loss = s.wait().value();
//   pipeline::Correct right = t->CountCorrect(test_x, test_y).value();  // .top1, .top5
//
// Thread-safety: a Trainer is driven by one thread (the training loop).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "pipeline/accuracy.h"
#include "pipeline/step.h"

namespace remora::train {

// The one handle every trainer's step returns (pipeline/step.h).
using pipeline::StartedStep;

// Where a run's checkpoints go (a run's --checkpoint-dir, --keep) and what
// they record of the run (a resume checks it).
struct SaveTarget {
  std::string dir;
  int keep = 3;
  checkpoint::RunIdentity identity;
  // Where the trainer can: the step waits only for the state to be copied
  // in memory, the files are written in the background and the checkpoint
  // committed once they are (Trainer::CommitSaved). The final one never.
  bool background = false;
};

// What one save wrote: the checkpoint's directory and its bytes; or, for
// a save in the background, that its files are still being written.
struct Saved {
  std::string dir;
  int64_t bytes = 0;
  int64_t step = 0;
  bool pending = false;  // written in the background: CommitSaved commits it
};

// What a training step trains on: a batch held here (x, y), or, for a
// trainer whose own workers read the data (Trainer::rows()), the numbers
// of the training set's rows they read (the master sends only those,
// pipeline/worker_data.h).
struct StepBatch {
  at::Tensor x;    // the inputs
  at::Tensor y;    // the targets
  at::Tensor rows{};  // or int64 [n]: rows of the training set (x, y undefined)
  int epoch = 0;    // the epoch the rows are read in (their augmentation)

  static StepBatch Rows(at::Tensor rows, int epoch) { return StepBatch{{}, {}, std::move(rows), epoch}; }
  bool is_rows() const { return rows.defined(); }
};

// What a trainer whose workers read the data also does (Trainer::rows()).
class WorkersRead {
 public:
  virtual ~WorkersRead() = default;
  // Of rows `rows` of the test set: how many classified right (top-1,
  // top-5) of how many read.
  virtual absl::StatusOr<pipeline::Correct> CountCorrectRows(const at::Tensor& rows) = 0;
  // Training rows the readers left out so far (unreadable files).
  virtual absl::StatusOr<int64_t> skipped() = 0;
};

class Trainer {
 public:
  virtual ~Trainer() = default;

  // Starts a training step on the batch: forward, loss (averaged over the
  // batch's rows), backward and the optimizer's step. `wait` gives the
  // loss; the next step may be started before it is called. Rows are
  // refused (FailedPrecondition, at wait) by a trainer without rows().
  virtual StartedStep StartStep(const StepBatch& batch) = 0;
  // How many rows of `x` the model (in eval mode, without gradients)
  // classifies as `labels` says (top-1 and top-5).
  virtual absl::StatusOr<pipeline::Correct> CountCorrect(const at::Tensor& x, const at::Tensor& labels) = 0;
  // Saves the parameters, buffers and optimizer state at `state` as a
  // checkpoint in `target.dir` (checkpoint/checkpoint.h's format), keeping
  // the newest target.keep; `final` marks the run's last one.
  virtual absl::StatusOr<Saved> Save(const SaveTarget& target, const checkpoint::TrainingState& state,
                                     bool final) = 0;
  // Loads a checkpoint's parameters, buffers and optimizer state (of the
  // same model); returns the bytes it read.
  virtual absl::StatusOr<int64_t> Load(const checkpoint::Checkpoint& ck) = 0;
  // Commits a save made in the background once its files are written
  // (with `wait`, waiting for them): what it committed, or nullopt when
  // nothing was ready (or none is pending).
  virtual absl::StatusOr<std::optional<Saved>> CommitSaved(bool /*wait*/) { return std::nullopt; }
  // Its workers read the data, when they do (StartStep takes rows then;
  // null: the batches are read here and passed to StartStep).
  virtual WorkersRead* rows() { return nullptr; }
};

}  // namespace remora::train
