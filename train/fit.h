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
//   train::FitFunctions print;  // or an observer of one's own
//   print.step = [&out](const train::StepRecord& r) { out << r.loss << "\n"; };
//   o.observers = {&print};
//   auto epochs = train::Fit(*trainer, train_set, test_set, o, out);
//
// Output: a progress line every tenth of an epoch (or one redrawn in
// place), "epoch=E train_loss=L test_accuracy=A test_top5=T test_loss=X
// seconds=S images_per_second=I" after each epoch (without the test
// figures where nothing was evaluated), "fit: ..." notes on what it leaves
// out, and
// "resumed from DIR: step N, epoch E after batch B (X MiB loaded in S s)",
// "checkpoint: step N in DIR (X MiB, S s[, final])" (KiB below a MiB).
//
// Each batch's step is started before the last one is waited for, so that
// no worker idles between batches; except after a step that saves a
// checkpoint or evaluates (which must see the state after that step alone)
// and a step over at its start (StartedStep::over_at_start), accounted for
// at once.
//
// Thread-safety: runs on the calling thread, which drives the trainer.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "data/source.h"
#include "pipeline/accuracy.h"
#include "train/trainer.h"

namespace remora::train {

// Where a run is: the epoch (from 1), the next batch of it, that epoch's
// loss sum and images so far, and the steps taken in all.
struct FitPosition {
  int epoch = 1;
  int64_t batch = 0;
  double loss_sum = 0;
  int64_t images = 0;
  int64_t step = 0;
};

// One training step as Fit accounted for it (FitObserver::AfterStep).
struct StepRecord {
  int epoch = 0;
  int64_t step = 0;    // steps taken in all, this one included
  double loss = 0;
  int64_t rows = 0;
  // Since the step before it ended and what ran after that one was over
  // (observers, a checkpoint, an evaluation), or since its epoch began. A
  // step that ran within the call that started it (StartedStep::
  // over_at_start) ended the one before it when that call began.
  double seconds = 0;
  double grad_norm = -1;  // before clipping (StartedStep::grad_norm); -1: not clipped
};

// One epoch as Fit reports it.
struct EpochResult {
  int epoch = 0;             // from 1
  double train_loss = 0;     // mean over the epoch's batches
  bool evaluated = false;    // whether there was a test set to measure the two below on
  double test_accuracy = 0;  // fraction of the test set classified right (top-1)
  double test_top5 = 0;      // fraction whose label is among the five highest logits
  double test_loss = 0;      // mean cross-entropy of a label of the test set (a token's, for a language model)
  // Training time of the epoch (evaluation not included; an epoch gone on
  // with after a failure, FitOptions::gone_on, counts the failure's).
  double seconds = 0;
  int64_t images = 0;   // trained in the epoch (a resumed epoch's before the resume too)
  int64_t trained = 0;  // of them, trained by this call or since the epoch began (the images/s figures)
  int64_t skipped = 0;  // rows left out because their file could not be read
};

// How Fit goes over the training set and what it reports.
struct FitOptions {
  int epochs = 3;
  int64_t batch_size = 64;
  // A last batch with fewer rows is dropped (a pipeline needs at least one
  // row per micro-batch, a model with batch norm two).
  int64_t min_batch_rows = 1;
  bool shuffle = true;  // a permutation per epoch from (seed, epoch); else file order
  uint64_t seed = 0;
  int64_t eval_batch_size = 1000;
  // A progress line redrawn in place (for a terminal); otherwise a plain
  // line every tenth of an epoch.
  bool progress_bar = false;
  // Where to start: a resumed run's position (the epochs before
  // start.epoch are not run; its batches before start.batch neither).
  FitPosition start;
  // Set where this process goes on from `start` after a failure (an
  // elastic recovery), so that the failure's time counts: the time since
  // `lost_since` (the steps trained again and the recovery) in the first
  // epoch this call trains, and, where that is the epoch at `start`,
  // `epoch_seconds_before` (this process's steps of it before `start`) too,
  // their `epoch_images_before` then counted as trained. Unset: a run resumed in a new
  // process counts from this call.
  struct GoneOn {
    std::chrono::steady_clock::time_point lost_since;
    double epoch_seconds_before = 0;
    // The images of those steps (fewer than start's where this process
    // began within the epoch: a run resumed in it from a checkpoint).
    int64_t epoch_images_before = 0;
  };
  std::optional<GoneOn> gone_on;
  // Batches read ahead on other threads while a step runs (a source that
  // reads files, data/imagefolder.h); 0: each read when it is needed.
  int prefetch = 0;
  // A language model's tokens a row (rows are windows of text): the epoch
  // line then gives tokens_per_second and test_perplexity (exp of the
  // test loss) too. 0: not one.
  int64_t tokens_per_row = 0;
  // A run of batches, not of epochs (the demo's `--batches N`): the
  // training set is gone over once, in order, its steps numbered from 1
  // (epochs and shuffling do not apply); its checkpoints say epoch 0 and
  // keep every step's loss (checkpoint::TrainingState), and a resume goes
  // on at the step after the checkpoint's. Fit then writes no progress,
  // epoch or diverged-loss lines of its own: an observer writes what the
  // program shows.
  bool batch_run = false;
};

// Sees a Fit as it goes: what a run keeps or reports beside training (its
// record, TensorBoard's event files, a supervisor's count of steps, the
// workers' tracing). Fit calls its observers on its own thread, in the
// order given, after its own accounting of each step and before the
// step's checkpoint and evaluation; it does not own them.
class FitObserver {
 public:
  virtual ~FitObserver() = default;

  // Whether the step after `step` may start only once `step` has ended and
  // every AfterStep has run for it (Fit otherwise starts each step before
  // the one before it ends): for an observer that must see the state
  // after `step` alone.
  virtual bool Settles(int64_t step) const { return false; }
  // Where Fit's thread spent time on step `step` (from 1), for a trace:
  // `phase` is "take batch" (its batch read, or waited for where it was
  // read ahead), "send" (the call that starts the step) or "wait" (for its
  // end). Times are steady_clock's (CLOCK_MONOTONIC, trace::NowUs's).
  virtual void Spent(int64_t step, const char* phase, std::chrono::steady_clock::time_point begin,
                     std::chrono::steady_clock::time_point end) {}
  // After each step. An error stops the fit (naming the step). The time
  // observers, checkpoints and evaluations take after a step counts in
  // neither its StepRecord::seconds nor the next one's.
  virtual absl::Status AfterStep(const StepRecord& step) { return absl::OkStatus(); }
  // After an evaluation within an epoch (TrainOptions::eval_every).
  virtual void Evaluated(int64_t step, const pipeline::Correct& tested) {}
  // After each epoch, its evaluation included.
  virtual void EpochEnded(const EpochResult& epoch) {}
};

// An observer made of functions, each of which may be empty: a few lines
// of one's own without a class of one's own.
class FitFunctions final : public FitObserver {
 public:
  std::function<void(const StepRecord&)> step;
  std::function<void(int64_t step, const pipeline::Correct& tested)> evaluated;
  std::function<void(const EpochResult&)> epoch;

  absl::Status AfterStep(const StepRecord& s) override {
    if (step) step(s);
    return absl::OkStatus();
  }
  void Evaluated(int64_t at, const pipeline::Correct& tested) override {
    if (evaluated) evaluated(at, tested);
  }
  void EpochEnded(const EpochResult& e) override {
    if (epoch) epoch(e);
  }
};

struct TrainOptions {
  // Epochs (or a run of batches), batch size, shuffling and progress
  // lines (its `start` is Fit's own: set from `resume`).
  FitOptions fit;
  // Checkpoints (none when checkpoints.dir is empty): every
  // `checkpoint_every` steps (0: only the final one) and at the end.
  SaveTarget checkpoints;
  int64_t checkpoint_every = 0;
  // A checkpoint of this run to go on from: loaded into the trainer first
  // (checked against checkpoints.identity when that names a model).
  std::optional<checkpoint::Checkpoint> resume;
  // Whether `resume` is in the trainer already (train::Resume, called
  // before Fit so that the load is not in the run's trace): Fit goes on
  // from its state without loading it again.
  bool resume_loaded = false;
  // Every `eval_every` steps (0: only after each epoch) the test set is
  // evaluated within the epoch too: "step=S test_accuracy=A test_top5=T
  // test_loss=X[ test_perplexity=P] seconds=E" on `out` and each
  // observer's Evaluated called; the step after it starts only then.
  int64_t eval_every = 0;
  // Borrowed; each must outlive the Fit call.
  std::vector<FitObserver*> observers;
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
absl::StatusOr<std::vector<EpochResult>> Fit(Trainer& trainer, const data::Source& train, const data::Source& test,
                                             const TrainOptions& o, std::ostream& out);

}  // namespace remora::train
