// Fit: epochs of training over a dataset in memory, with the test set's
// accuracy after every epoch and progress output, for any training and
// evaluation step (a pipeline's train_step and eval_step, or training in
// one process).
//
//   auto epochs = pipeline::Fit(
//       [&](const at::Tensor& x, const at::Tensor& y) { return pipe->train_step(x, y); },
//       [&](const at::Tensor& x, const at::Tensor& y) { return pipe->eval_correct(x, y); },
//       train, test, options, std::cout);
//
// Thread-safety: runs on the calling thread; the steps are called from it.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <ostream>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "data/datasets.h"
#include "data/source.h"

namespace remora::pipeline {

// Where a run is: the epoch (from 1), the next batch of it, that epoch's
// loss sum and images so far, and the steps taken in all.
struct FitPosition {
  int epoch = 1;
  int64_t batch = 0;
  double loss_sum = 0;
  int64_t images = 0;
  int64_t step = 0;
};

// One training step as Fit accounted for it (FitOptions::on_step).
struct StepRecord {
  int epoch = 0;
  int64_t step = 0;    // steps taken in all, this one included
  double loss = 0;
  int64_t rows = 0;
  double seconds = 0;  // since the step before it ended (or its epoch began)
  double grad_norm = -1;  // before clipping (StartedStep::grad_norm); -1: not clipped
};

struct EpochResult;

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
  // Runs after every step with the position after it (a checkpoint);
  // an error stops the fit.
  std::function<absl::Status(const FitPosition&)> after_step;
  // Called after every step (before after_step), and after every epoch's
  // evaluation: what a run reports as it goes (TensorBoard event files).
  std::function<void(const StepRecord&)> on_step;
  std::function<void(const EpochResult&)> on_epoch;
  // With a step that can be started before the last one is waited for
  // (StartTrainStep), the next batch's step is started first, then the
  // last one waited for, so that no worker idles between batches; except
  // after a step for which this says true (its after_step saves a
  // checkpoint, which must see the state after that step alone).
  std::function<bool(int64_t step)> settle_after;
  // Batches read ahead on other threads while a step runs (a source that
  // reads files, data/imagefolder.h); 0: each read when it is needed.
  int prefetch = 0;
  // A language model's tokens a row (rows are windows of text): the epoch
  // line then gives tokens_per_second and test_perplexity (exp of the
  // test loss) too. 0: not one.
  int64_t tokens_per_row = 0;
};

// How many labels a model predicts right, of `items`: top-1 (the highest
// logit is the label's) and top-5 (the label's logit is among the five
// highest; with fewer than five classes, every one), and the cross-entropy
// summed over them. A classifier has one label a row (items = rows); a
// language model one a position (items = rows x tokens, each the next
// token). `rows`: the rows read (a source may skip unreadable files).
// Counted by CountCorrect, where `items` 0 means one label a row.
struct Correct {
  int64_t top1 = 0;
  int64_t top5 = 0;
  int64_t rows = 0;
  int64_t items = 0;    // labels counted; 0: `rows` (one a row)
  double loss_sum = 0;  // cross-entropy summed over the labels (0 where not measured)

  Correct& operator+=(const Correct& o) {
    items = counted() + o.counted();
    top1 += o.top1;
    top5 += o.top5;
    rows += o.rows;
    loss_sum += o.loss_sum;
    return *this;
  }
  int64_t counted() const { return items > 0 ? items : rows; }
  double accuracy() const { return counted() > 0 ? static_cast<double>(top1) / counted() : 0; }
  double top5_accuracy() const { return counted() > 0 ? static_cast<double>(top5) / counted() : 0; }
  // The mean cross-entropy of a label (a language model's perplexity is
  // its exp).
  double loss() const { return counted() > 0 ? loss_sum / counted() : 0; }
};

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

using TrainStep = std::function<absl::StatusOr<double>(const at::Tensor& x, const at::Tensor& y)>;
// A training step started and not waited for: `wait` returns its loss
// (called once); `abandon` drops it (a step before it failed). `ran`: the
// step ran within its start (a step in this process), so it is accounted
// for at once, not after the next one has started (which would time it
// with the next step's work).
struct StartedStep {
  std::function<absl::StatusOr<double>()> wait;
  std::function<void()> abandon;
  bool ran = false;
  // After wait(): the gradients' norm before clipping (-1 without
  // clipping); null: -1.
  std::function<double()> grad_norm;
};
using StartTrainStep = std::function<StartedStep(const at::Tensor& x, const at::Tensor& y)>;
using EvalStep = std::function<absl::StatusOr<at::Tensor>(const at::Tensor& x)>;  // logits [N, C]
// How many rows of `x` are classified as `labels` says.
using CountStep = std::function<absl::StatusOr<Correct>(const at::Tensor& x, const at::Tensor& labels)>;

// How many rows of `logits` ([rows, classes], or [rows, T, vocab] with
// labels [rows, T]: a language model's, a label a position) have their
// label first, and among the first five, and their cross-entropy summed;
// an error for logits of another shape.
absl::StatusOr<Correct> CountCorrect(const at::Tensor& logits, const at::Tensor& labels);
// The same counted where `logits` are, without waiting for them: a double
// tensor [top1, top5, cross-entropy sum, labels] on their device.
// `logits` must fit `labels` (FitsLabels).
at::Tensor CountCorrectOnDevice(const at::Tensor& logits, const at::Tensor& labels);
// Whether `logits` are labels' shape and one dimension more (the classes,
// at least one): [rows, classes] for labels [rows].
bool FitsLabels(const at::Tensor& logits, const at::Tensor& labels);
// Correct from CountCorrectOnDevice's tensor (on the CPU), of `rows` rows.
Correct CorrectFromCounts(const at::Tensor& counts, int64_t rows);
// A CountStep that counts `eval_step`'s logits here.
CountStep CountFromLogits(EvalStep eval_step);

// Trains `options.epochs` epochs over `train`, evaluating on `test` after
// each (an empty `test`: no evaluation); prints the progress and one line
// per epoch ("epoch=E train_loss=L test_accuracy=A test_top5=T test_loss=X seconds=S
// images_per_second=I", without the test figures where nothing was
// evaluated) to `out`. An error names the epoch and batch it happened in.
absl::StatusOr<std::vector<EpochResult>> Fit(const TrainStep& train_step, const CountStep& count_correct,
                                             const data::Dataset& train, const data::Dataset& test,
                                             const FitOptions& options, std::ostream& out);
// The same with steps that run ahead: batch b + 1's step is started before
// batch b's is waited for (see FitOptions::settle_after).
absl::StatusOr<std::vector<EpochResult>> Fit(const StartTrainStep& start_step, const CountStep& count_correct,
                                             const data::Dataset& train, const data::Dataset& test,
                                             const FitOptions& options, std::ostream& out);

// The same over any sources (read from disk as batches need them).
absl::StatusOr<std::vector<EpochResult>> Fit(const TrainStep& train_step, const CountStep& count_correct,
                                             const data::Source& train, const data::Source& test,
                                             const FitOptions& options, std::ostream& out);
absl::StatusOr<std::vector<EpochResult>> Fit(const StartTrainStep& start_step, const CountStep& count_correct,
                                             const data::Source& train, const data::Source& test,
                                             const FitOptions& options, std::ostream& out);

// A training step of a batch that is read where it is used: started with
// the batch's rows (int64 [n]) and epoch, e.g. Pipeline::start_train_step
// with the WorkerRows of a WorkerData (pipeline/worker_data.h).
using StartRowsStep = std::function<StartedStep(const at::Tensor& rows, int epoch)>;
// How many of the rows `rows` (int64 [n]) of a set read where they are
// used are classified right, of how many were read (Correct::rows).
using CountRowsStep = std::function<absl::StatusOr<Correct>(const at::Tensor& rows)>;
// Fit over the `train_rows` rows of a training set and the `test_rows`
// rows of a test set that the steps read themselves; `skipped` (may be
// empty) says how many training rows the readers have left out so far
// (unreadable files), counted after each epoch.
absl::StatusOr<std::vector<EpochResult>> FitRows(const StartRowsStep& start_step, int64_t train_rows,
                                                 const CountRowsStep& count_correct, int64_t test_rows,
                                                 const std::function<absl::StatusOr<int64_t>()>& skipped,
                                                 const FitOptions& options, std::ostream& out);

// How much of `set` `count_correct` counts as classified right, of the
// rows read (a source may skip unreadable files); an error when the set is
// empty or none of it could be read.
absl::StatusOr<Correct> Accuracy(const CountStep& count_correct, const data::Dataset& set,
                                 int64_t batch_size);
absl::StatusOr<Correct> Accuracy(const CountStep& count_correct, const data::Source& set, int64_t batch_size);
absl::StatusOr<Correct> Accuracy(const CountRowsStep& count_correct, int64_t rows, int64_t batch_size);

}  // namespace remora::pipeline
