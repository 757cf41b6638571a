#include "pipeline/fit.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <deque>
#include <future>
#include <utility>

#include <ATen/ops/arange.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/ge.h>
#include <ATen/ops/logical_and.h>
#include <ATen/ops/lt.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/full.h>
#include <ATen/ops/eq.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/topk.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/numbers.h"
#include "base/status_util.h"

namespace remora::pipeline {
namespace {

double Seconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

double Now() { return Seconds(std::chrono::steady_clock::now()); }

std::string Duration(double s) {
  const int total = static_cast<int>(s + 0.5);
  return total >= 60 ? absl::StrFormat("%dm%02ds", total / 60, total % 60) : absl::StrCat(total, "s");
}

// Reads a batch's rows (here, or only names them where a worker reads them).
using RowReader = std::function<absl::StatusOr<data::Batch>(const at::Tensor& rows, int epoch)>;
// Starts the step of a batch read (its rows and epoch too).
using BatchStarter = std::function<StartedStep(const data::Batch& batch, const at::Tensor& rows, int epoch)>;
// Measures the test set's accuracy (empty: there is no test set).
using AccuracyOf = std::function<absl::StatusOr<Correct>()>;

// The epochs of Fit and FitRows over `train_size` rows; `skipped` (may be
// empty) counts rows left out where they were read.
absl::StatusOr<std::vector<EpochResult>> FitLoop(int64_t train_size, const RowReader& read_rows,
                                                 const BatchStarter& start_step,
                                                 const std::function<absl::StatusOr<int64_t>()>& skipped,
                                                 const AccuracyOf& accuracy,
                                                 const FitOptions& o, std::ostream& out);

// "[rows, classes]" for labels [rows]; "[rows, T, classes]" for [rows, T].
std::string WithClasses(const at::Tensor& labels) {
  std::string shape = c10::str(labels.sizes());
  shape.pop_back();
  return absl::StrCat(shape, labels.dim() > 0 ? ", " : "", "classes]");
}

}  // namespace

bool FitsLabels(const at::Tensor& logits, const at::Tensor& labels) {
  if (logits.dim() != labels.dim() + 1 || logits.size(-1) == 0) return false;
  for (int64_t d = 0; d < labels.dim(); ++d) {
    if (logits.size(d) != labels.size(d)) return false;
  }
  return true;
}

at::Tensor CountCorrectOnDevice(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t classes = logits.size(-1);
  const at::Tensor z = logits.reshape({-1, classes});
  const at::Tensor l = labels.to(logits.device()).reshape({-1});
  const int64_t k = std::min<int64_t>(5, classes);
  const at::Tensor first_k = std::get<1>(z.topk(k, 1));
  // (A label outside the classes, a model with too few outputs, counts as
  // wrong and adds no loss, rather than failing the evaluation.)
  const at::Tensor known = l.ge(0).logical_and(l.lt(classes));
  const at::Tensor loss =
      at::cross_entropy_loss(z.to(at::kFloat), l.clamp(0, classes - 1), {}, at::Reduction::None).mul(known).sum();
  return at::stack({z.argmax(1).eq(l).sum().to(at::kDouble), first_k.eq(l.view({-1, 1})).any(1).sum().to(at::kDouble),
                    loss.to(at::kDouble), at::full({}, static_cast<double>(l.numel()), z.options().dtype(at::kDouble))});
}

Correct CorrectFromCounts(const at::Tensor& counts, int64_t rows) {
  const at::Tensor c = counts.to(at::kDouble).contiguous();
  const double* v = c.data_ptr<double>();
  return Correct{static_cast<int64_t>(v[0]), static_cast<int64_t>(v[1]), rows, static_cast<int64_t>(v[3]), v[2]};
}

absl::StatusOr<Correct> CountCorrect(const at::Tensor& logits, const at::Tensor& labels) {
  if (!FitsLabels(logits, labels)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "accuracy: the model's output for ", labels.size(0), " rows has shape ",
        c10::str(logits.sizes()), "; it should be ", WithClasses(labels)));
  }
  return CorrectFromCounts(CountCorrectOnDevice(logits, labels).cpu(), labels.size(0));
}

CountStep CountFromLogits(EvalStep eval_step) {
  return [eval_step = std::move(eval_step)](const at::Tensor& x,
                                            const at::Tensor& labels) -> absl::StatusOr<Correct> {
    ASSIGN_OR_RETURN(at::Tensor logits, eval_step(x));
    return CountCorrect(logits, labels);
  };
}

absl::StatusOr<Correct> Accuracy(const CountStep& count_correct, const data::Dataset& set,
                                 int64_t batch_size) {
  return Accuracy(count_correct, data::InMemory(set), batch_size);
}

absl::StatusOr<Correct> Accuracy(const CountStep& count_correct, const data::Source& set, int64_t batch_size) {
  if (set.size() == 0) return absl::InvalidArgumentError("accuracy: the set is empty");
  Correct total;
  for (int64_t at = 0; at < set.size(); at += batch_size) {
    const int64_t end = std::min(set.size(), at + batch_size);
    ASSIGN_OR_RETURN(data::Batch b, set.Get(at::arange(at, end, at::kLong), /*epoch=*/0));
    if (b.labels.size(0) == 0) continue;  // every file of it skipped
    ASSIGN_OR_RETURN(Correct n, count_correct(b.images, b.labels));
    n.rows = b.labels.size(0);
    total += n;
  }
  if (total.rows == 0) return absl::InvalidArgumentError("accuracy: no row of the set could be read");
  return total;
}

absl::StatusOr<Correct> Accuracy(const CountRowsStep& count_correct, int64_t n, int64_t batch_size) {
  if (n <= 0) return absl::InvalidArgumentError("accuracy: the set is empty");
  Correct total;
  for (int64_t at = 0; at < n; at += batch_size) {
    ASSIGN_OR_RETURN(Correct counted, count_correct(at::arange(at, std::min(n, at + batch_size), at::kLong)));
    total += counted;
  }
  if (total.rows == 0) return absl::InvalidArgumentError("accuracy: no row of the set could be read");
  return total;
}

absl::StatusOr<std::vector<EpochResult>> Fit(const TrainStep& train_step, const CountStep& count_correct,
                                             const data::Dataset& train, const data::Dataset& test,
                                             const FitOptions& o, std::ostream& out) {
  return Fit(train_step, count_correct, data::InMemory(train), data::InMemory(test), o, out);
}

absl::StatusOr<std::vector<EpochResult>> Fit(const StartTrainStep& start_step, const CountStep& count_correct,
                                             const data::Dataset& train, const data::Dataset& test,
                                             const FitOptions& o, std::ostream& out) {
  return Fit(start_step, count_correct, data::InMemory(train), data::InMemory(test), o, out);
}

absl::StatusOr<std::vector<EpochResult>> Fit(const TrainStep& train_step, const CountStep& count_correct,
                                             const data::Source& train, const data::Source& test,
                                             const FitOptions& o, std::ostream& out) {
  // Each step runs as it is started.
  return Fit(
      [&train_step](const at::Tensor& x, const at::Tensor& y) {
        absl::StatusOr<double> loss = train_step(x, y);
        return StartedStep{[loss] { return loss; }, [] {}, /*ran=*/true, nullptr};
      },
      count_correct, train, test, o, out);
}

absl::StatusOr<std::vector<EpochResult>> Fit(const StartTrainStep& start_step, const CountStep& count_correct,
                                             const data::Source& train, const data::Source& test,
                                             const FitOptions& o, std::ostream& out) {
  return FitLoop(
      train.size(), [&train](const at::Tensor& rows, int e) { return train.Get(rows, e); },
      [&start_step](const data::Batch& b, const at::Tensor&, int) { return start_step(b.images, b.labels); },
      nullptr,
      test.size() == 0 ? AccuracyOf(nullptr) : [&] { return Accuracy(count_correct, test, o.eval_batch_size); },
      o, out);
}

absl::StatusOr<std::vector<EpochResult>> FitRows(const StartRowsStep& start_step, int64_t train_rows,
                                                 const CountRowsStep& count_correct, int64_t test_rows,
                                                 const std::function<absl::StatusOr<int64_t>()>& skipped,
                                                 const FitOptions& o, std::ostream& out) {
  FitOptions rows_only = o;
  rows_only.prefetch = 0;  // nothing to read here
  return FitLoop(
      train_rows,
      [](const at::Tensor& rows, int) -> absl::StatusOr<data::Batch> { return data::Batch{{}, rows, 0}; },
      [&start_step](const data::Batch&, const at::Tensor& rows, int e) { return start_step(rows, e); }, skipped,
      test_rows == 0 ? AccuracyOf(nullptr) : [&] { return Accuracy(count_correct, test_rows, o.eval_batch_size); },
      rows_only, out);
}

namespace {

// One FitLoop call: the options, the steps taken, and the epoch under way.
// Used by the calling thread only (reads ahead run on threads of their own
// and touch only their rows).
class Loop {
 public:
  Loop(int64_t train_size, const RowReader& read_rows, const BatchStarter& start_step,
       const std::function<absl::StatusOr<int64_t>()>& skipped,
       const AccuracyOf& accuracy, const FitOptions& o, std::ostream& out)
      : train_size_(train_size), read_rows_(read_rows), start_step_(start_step), skipped_(skipped),
        accuracy_(accuracy), o_(o), out_(out), step_(o.start.step) {}

  absl::StatusOr<std::vector<EpochResult>> Run() {
    if (o_.epochs < 1 || o_.batch_size < 1 || o_.prefetch < 0) {
      return absl::InvalidArgumentError("fit: epochs and batch size must be at least 1, prefetch at least 0");
    }
    if (skipped_) {
      ASSIGN_OR_RETURN(skipped_before_, skipped_());
    }
    std::vector<EpochResult> results;
    for (int e = std::max(1, o_.start.epoch); e <= o_.epochs; ++e) {
      ASSIGN_OR_RETURN(const bool trained, TrainEpoch(e));
      if (!trained) continue;
      RETURN_IF_ERROR(EndEpoch());
      if (o_.on_epoch) o_.on_epoch(r_);
      results.push_back(r_);
    }
    if (results.empty() && o_.start.step > 0) {  // (resumed)
      out_ << "fit: resumed at the run's end (epoch " << o_.start.epoch << " of --epochs " << o_.epochs
           << "): nothing left to train (give more --epochs to train on)\n"
           << std::flush;
    }
    return results;
  }

 private:
  // A step started and not yet waited for.
  struct Started {
    size_t batch;
    int64_t rows;
    StartedStep step;
  };

  // Trains epoch e's batches (from the resumed position in the resumed
  // epoch); false when there was none left to train (a run resumed after
  // the epoch's last batch, which reported the epoch then).
  absl::StatusOr<bool> TrainEpoch(int e) {
    const bool resumed = e == o_.start.epoch;
    batches_ = data::EpochBatches(train_size_, o_.batch_size, o_.shuffle, o_.seed, e);
    if (!batches_.empty() && batches_.back().size(0) < o_.min_batch_rows) {
      if (!said_dropped_ && batches_.size() > 1) {
        said_dropped_ = true;  // (the same each epoch)
        out_ << "fit: the last batch of each epoch, " << batches_.back().size(0) << " of " << train_size_
             << " rows, is left out: its micro-batches need at least " << o_.min_batch_rows << " rows\n"
             << std::flush;
      }
      batches_.pop_back();
    }
    if (batches_.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("fit: ", train_size_,
                                                     " training rows make no batch of ", o_.min_batch_rows));
    }
    if (resumed && o_.start.batch > static_cast<int64_t>(batches_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("fit: resuming at batch ", o_.start.batch, " of epoch ", e,
                                                     ", which has ", batches_.size(), " batches"));
    }
    first_ = resumed ? static_cast<size_t>(o_.start.batch) : 0;
    if (resumed && first_ == batches_.size() && first_ > 0) return false;
    r_ = EpochResult{};
    r_.epoch = e;
    r_.images = resumed ? o_.start.images : 0;
    loss_sum_ = resumed ? o_.start.loss_sum : 0;
    next_line_ = 0;
    call_t0_ = last_end_ = Now();
    t0_ = call_t0_;
    trained_ = 0;
    if (o_.gone_on && !counted_loss_) {  // (the first epoch this call trains)
      counted_loss_ = true;
      t0_ = std::min(t0_, Seconds(o_.gone_on->lost_since));
      if (resumed) {
        t0_ -= o_.gone_on->epoch_seconds_before;
        trained_ = o_.gone_on->epoch_images_before;
      }
    }
    read_.clear();
    next_read_ = first_;
    for (size_t b = first_; b < batches_.size(); ++b) {
      // The step before this one (step_ + started_.size()) may need the
      // workers to itself until after_step has run.
      if (!started_.empty() && o_.settle_after && o_.settle_after(step_ + static_cast<int64_t>(started_.size()))) {
        while (!started_.empty()) RETURN_IF_ERROR(FinishOldest());
      }
      ReadAhead();
      absl::StatusOr<data::Batch> batch = read_.front().get();
      read_.pop_front();
      ReadAhead();  // the next batches are read while this one trains
      if (!batch.ok()) {
        DropStarted();
        return base::Annotate(batch.status(),
                              absl::StrCat("reading epoch ", e, ", batch ", b + 1, " of ", batches_.size()));
      }
      r_.skipped += batch->skipped;
      if (batch->labels.size(0) == 0) continue;  // every file of it skipped
      started_.push_back(Started{b, batch->labels.size(0), start_step_(*batch, batches_[b], e)});
      // One step ahead: the one before this is waited for now (a step
      // that ran within its start at once).
      while (started_.size() > 1 || (!started_.empty() && started_.back().step.ran)) {
        RETURN_IF_ERROR(FinishOldest());
      }
    }
    while (!started_.empty()) RETURN_IF_ERROR(FinishOldest());
    r_.seconds = Now() - t0_;
    return true;
  }

  // Batches read ahead (o_.prefetch of them while a step runs), in order
  // from batch next_read_.
  void ReadAhead() {
    while (next_read_ < batches_.size() && static_cast<int>(read_.size()) <= o_.prefetch) {
      read_.push_back(std::async(o_.prefetch > 0 ? std::launch::async : std::launch::deferred,
                                 [read_rows = &read_rows_, rows = batches_[next_read_], e = r_.epoch] {
                                   return (*read_rows)(rows, e);
                                 }));
      ++next_read_;
    }
  }

  void DropStarted() {
    for (auto& s : started_) s.step.abandon();
    started_.clear();
  }

  // Waits for the oldest step started and accounts for it.
  absl::Status FinishOldest() {
    Started oldest = std::move(started_.front());
    started_.pop_front();
    const size_t b = oldest.batch;
    const int e = r_.epoch;
    absl::StatusOr<double> loss = oldest.step.wait();
    if (!loss.ok()) {
      DropStarted();
      return base::Annotate(loss.status(), absl::StrCat("epoch ", e, ", batch ", b + 1, " of ", batches_.size()));
    }
    *loss = base::UnsignedNan(*loss);
    if (!std::isfinite(*loss) && !said_not_finite_) {
      said_not_finite_ = true;  // (once: every later loss is likely the same)
      out_ << "fit: warning: the loss is " << *loss << " at epoch " << e << ", batch " << b + 1
           << ": the training diverged (a lower --lr?); it goes on\n"
           << std::flush;
    }
    loss_sum_ += *loss;
    r_.images += oldest.rows;
    trained_ += oldest.rows;
    ++step_;
    const double ended = Now();
    const double norm = oldest.step.grad_norm ? oldest.step.grad_norm() : -1;
    if (o_.on_step) o_.on_step(StepRecord{e, step_, *loss, oldest.rows, ended - last_end_, norm});
    if (norm >= 0) last_norm_ = norm;
    last_end_ = ended;
    Progress(b, ended);
    if (o_.after_step) {
      absl::Status s = o_.after_step(FitPosition{e, static_cast<int64_t>(b + 1), loss_sum_, r_.images, step_});
      if (!s.ok()) {
        DropStarted();
        return base::Annotate(s, absl::StrCat("after epoch ", e, ", batch ", b + 1));
      }
    }
    return absl::OkStatus();
  }

  // The progress line after batch b: redrawn in place, or every tenth of
  // the epoch.
  void Progress(size_t b, double now) {
    const double done = static_cast<double>(b + 1 - first_) / (batches_.size() - first_);
    const double elapsed = now - t0_, in_call = now - call_t0_;
    // (Rows of a text are windows of tokens: the tokens a second then.)
    const double rate = trained_ / std::max(elapsed, 1e-9);
    const std::string speed = o_.tokens_per_row > 0
                                  ? absl::StrFormat("%.0f tokens/s", rate * static_cast<double>(o_.tokens_per_row))
                                  : absl::StrFormat("%.0f images/s", rate);
    // (With clipping, the last step's gradient norm before it.)
    const std::string norm = last_norm_ >= 0 ? absl::StrFormat("  grad_norm=%.3g", last_norm_) : "";
    const std::string line =
        absl::StrFormat("epoch %d/%d  %zu/%zu batches  loss=%.4f%s  %s  ETA %s", r_.epoch, o_.epochs, b + 1,
                        batches_.size(), loss_sum_ / (b + 1), norm, speed, Duration(in_call / done - in_call));
    if (o_.progress_bar) {
      out_ << "\r" << line << "   " << std::flush;
    } else if (done >= next_line_ && b + 1 < batches_.size()) {
      out_ << line << "\n" << std::flush;
      next_line_ += 0.1;
    }
  }

  // The epoch's rows left out where they were read, its loss, its test
  // accuracy and its line.
  absl::Status EndEpoch() {
    const int e = r_.epoch;
    if (skipped_) {
      auto now = skipped_();
      if (!now.ok()) return base::Annotate(now.status(), absl::StrCat("after epoch ", e));
      const int64_t epoch_skipped = *now - skipped_before_;
      skipped_before_ = *now;
      r_.skipped += epoch_skipped;
      r_.images -= epoch_skipped;
      trained_ -= epoch_skipped;
    }
    if (r_.images <= 0 && r_.skipped > 0) {
      // (Its loss would print as 0: a perfect fit to the eye.)
      return absl::FailedPreconditionError(absl::StrCat(
          "epoch ", e, " trained no image: all ", r_.skipped,
          " of its images were skipped as unreadable (--skip-bad-images); check the dataset's files"));
    }
    r_.trained = trained_;
    r_.train_loss = loss_sum_ / batches_.size();
    if (o_.progress_bar) out_ << "\n";
    std::string tested;
    if (accuracy_) {  // else no test set
      auto accuracy = accuracy_();
      if (!accuracy.ok()) return base::Annotate(accuracy.status(), absl::StrCat("evaluating after epoch ", e));
      r_.evaluated = true;
      r_.test_accuracy = accuracy->accuracy();
      r_.test_top5 = accuracy->top5_accuracy();
      r_.test_loss = accuracy->loss();
      tested = absl::StrFormat(" test_accuracy=%.4f test_top5=%.4f test_loss=%.4f", r_.test_accuracy, r_.test_top5,
                               r_.test_loss);
      if (o_.tokens_per_row > 0) absl::StrAppendFormat(&tested, " test_perplexity=%.3f", std::exp(r_.test_loss));
    }
    const double rows_per_second = trained_ / std::max(r_.seconds, 1e-9);
    out_ << absl::StrFormat("epoch=%d train_loss=%.4f%s seconds=%.1f images_per_second=%.0f%s%s\n", e,
                            r_.train_loss, tested, r_.seconds, rows_per_second,
                            o_.tokens_per_row > 0
                                ? absl::StrFormat(" tokens_per_second=%.0f", rows_per_second * o_.tokens_per_row)
                                : "",
                            r_.skipped > 0 ? absl::StrCat(" skipped_images=", r_.skipped) : "")
         << std::flush;
    return absl::OkStatus();
  }

  const int64_t train_size_;
  const RowReader& read_rows_;
  const BatchStarter& start_step_;
  const std::function<absl::StatusOr<int64_t>()>& skipped_;
  const AccuracyOf& accuracy_;
  const FitOptions& o_;
  std::ostream& out_;
  int64_t step_;
  int64_t skipped_before_ = 0;
  // The epoch under way.
  std::vector<at::Tensor> batches_;
  size_t first_ = 0;  // the first batch this call trains
  EpochResult r_;
  // When the epoch began (earlier where it counts FitOptions::gone_on) and
  // when this call began it.
  double t0_ = 0, call_t0_ = 0, last_end_ = 0, loss_sum_ = 0, next_line_ = 0;
  double last_norm_ = -1;  // the last step's gradient norm before clipping, or -1
  // Images of the epoch trained by this call (and, going on after a
  // recovery, before it).
  int64_t trained_ = 0;
  bool counted_loss_ = false;  // whether an epoch counts FitOptions::gone_on already
  bool said_not_finite_ = false;
  bool said_dropped_ = false;
  std::deque<std::future<absl::StatusOr<data::Batch>>> read_;
  size_t next_read_ = 0;
  std::deque<Started> started_;
};

absl::StatusOr<std::vector<EpochResult>> FitLoop(int64_t train_size, const RowReader& read_rows,
                                                 const BatchStarter& start_step,
                                                 const std::function<absl::StatusOr<int64_t>()>& skipped,
                                                 const AccuracyOf& accuracy,
                                                 const FitOptions& o, std::ostream& out) {
  return Loop(train_size, read_rows, start_step, skipped, accuracy, o, out).Run();
}

}  // namespace
}  // namespace remora::pipeline
