// The training loop on any Trainer (train/trainer.h): epochs over a
// dataset with progress and the test accuracy after each, checkpoints
// every N steps and at the end, and a resume from a checkpoint that goes on
// at the batch after it, written once for pipelines, data parallelism, the
// parameter server and training in one process.
//
//   train::TrainOptions o;
//   o.fit.epochs = 3;
//   o.checkpoints.dir = "/ckpt";  o.checkpoint_every = 100;
//   o.resume = checkpoint::Latest("/ckpt").value();   // to go on
//   auto epochs = train::Fit(*trainer, train_set, test_set, o, std::cout);
//
// Output: Fit's progress and epoch lines (pipeline/fit.h), and
// "resumed from DIR: step N, epoch E after batch B (X MiB loaded in S s)",
// "checkpoint: step N in DIR (X MiB, S s[, final])" (KiB below a MiB).
//
// Thread-safety: runs on the calling thread, which drives the trainer.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "data/source.h"
#include "pipeline/fit.h"
#include "train/trainer.h"

namespace remora::train {

struct TrainOptions {
  // Epochs, batch size, shuffling, progress, per-step and per-epoch
  // reports (its `start`, `after_step` and `settle_after` are Fit's own).
  pipeline::FitOptions fit;
  // Checkpoints (none when checkpoints.dir is empty): every
  // `checkpoint_every` steps (0: only the final one) and at the end.
  SaveTarget checkpoints;
  int64_t checkpoint_every = 0;
  // A checkpoint of this run to go on from: loaded into the trainer first
  // (checked against checkpoints.identity when that names a model).
  std::optional<checkpoint::Checkpoint> resume;
  // Every `eval_every` steps (0: only after each epoch) the test set is
  // evaluated within the epoch too: "step=S test_accuracy=A test_top5=T
  // test_loss=X[ test_perplexity=P] seconds=E" on `out` and `on_eval`
  // called (a run's TensorBoard); the step after it starts only then.
  int64_t eval_every = 0;
  std::function<void(int64_t step, const pipeline::Correct& tested)> on_eval;
};

// A run's checkpoint cadence on a trainer, for loops of their own (a run of
// N batches without epochs) as for Fit. Used by the training loop's thread.
class Checkpoints {
 public:
  Checkpoints(SaveTarget target, int64_t every) : target_(std::move(target)), every_(every) {}

  bool active() const { return !target_.dir.empty(); }
  // Makes the directory if needed (when active); an error says why it
  // cannot, before any step is trained.
  absl::Status Prepare() const;
  // Whether step `step` saves: a multiple of `every`, or the final one.
  bool Due(int64_t step, bool final) const;
  // Commits a save that was made in the background once its files are
  // written (saying so on `out`), then saves when Due and says so.
  absl::Status MaybeSave(Trainer& trainer, const checkpoint::TrainingState& state, bool final,
                         std::ostream& out) const;

 private:
  SaveTarget target_;
  int64_t every_;
};

// Loads `ck` into `trainer` (after checking it matches `identity`, when
// that names a model) and says so on `out`; an error names the checkpoint.
absl::Status Resume(Trainer& trainer, const checkpoint::Checkpoint& ck,
                    const checkpoint::RunIdentity& identity, std::ostream& out);

// Trains o.fit.epochs epochs over `train` (read here; or, for a trainer
// whose workers read, rows of it), evaluating on `test` after each; saves
// and resumes as `o` says. An error names the epoch and batch, or the
// checkpoint.
absl::StatusOr<std::vector<pipeline::EpochResult>> Fit(Trainer& trainer, const data::Source& train,
                                                       const data::Source& test, const TrainOptions& o,
                                                       std::ostream& out);

}  // namespace remora::train
