#include "pipeline/fit.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <future>
#include <utility>

#include <ATen/ops/arange.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/eq.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_util.h"

namespace remora::pipeline {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Duration(double s) {
  const int total = static_cast<int>(s + 0.5);
  return total >= 60 ? absl::StrFormat("%dm%02ds", total / 60, total % 60) : absl::StrCat(total, "s");
}

// Reads a batch's rows (here, or only names them where a worker reads them).
using RowReader = std::function<absl::StatusOr<data::Batch>(const at::Tensor& rows, int epoch)>;
// Starts the step of a batch read (its rows and epoch too).
using BatchStarter = std::function<StartedStep(const data::Batch& batch, const at::Tensor& rows, int epoch)>;

// The epochs of Fit and FitRows over `train_size` rows; `skipped` (may be
// empty) counts rows left out where they were read.
absl::StatusOr<std::vector<EpochResult>> FitLoop(int64_t train_size, const RowReader& read_rows,
                                                 const BatchStarter& start_step,
                                                 const std::function<absl::StatusOr<int64_t>()>& skipped,
                                                 const std::function<absl::StatusOr<double>()>& accuracy,
                                                 const FitOptions& o, std::ostream& out);

}  // namespace

absl::StatusOr<int64_t> CountCorrect(const at::Tensor& logits, const at::Tensor& labels) {
  if (logits.dim() != 2 || logits.size(0) != labels.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "accuracy: the model's output for ", labels.size(0), " rows has shape ",
        c10::str(logits.sizes()), "; it should be [", labels.size(0), ", classes]"));
  }
  return logits.argmax(1).cpu().eq(labels.cpu()).sum().item<int64_t>();
}

CountStep CountFromLogits(EvalStep eval_step) {
  return [eval_step = std::move(eval_step)](const at::Tensor& x,
                                            const at::Tensor& labels) -> absl::StatusOr<int64_t> {
    ASSIGN_OR_RETURN(at::Tensor logits, eval_step(x));
    return CountCorrect(logits, labels);
  };
}

absl::StatusOr<double> Accuracy(const CountStep& count_correct, const data::Dataset& set,
                                int64_t batch_size) {
  return Accuracy(count_correct, data::InMemory(set), batch_size);
}

absl::StatusOr<double> Accuracy(const CountStep& count_correct, const data::Source& set, int64_t batch_size) {
  if (set.size() == 0) return absl::InvalidArgumentError("accuracy: the set is empty");
  int64_t right = 0, rows = 0;
  for (int64_t at = 0; at < set.size(); at += batch_size) {
    const int64_t end = std::min(set.size(), at + batch_size);
    ASSIGN_OR_RETURN(data::Batch b, set.Get(at::arange(at, end, at::kLong), /*epoch=*/0));
    if (b.labels.size(0) == 0) continue;  // every file of it skipped
    ASSIGN_OR_RETURN(int64_t n, count_correct(b.images, b.labels));
    right += n;
    rows += b.labels.size(0);
  }
  if (rows == 0) return absl::InvalidArgumentError("accuracy: no row of the set could be read");
  return static_cast<double>(right) / rows;
}

absl::StatusOr<double> Accuracy(const CountRowsStep& count_correct, int64_t n, int64_t batch_size) {
  if (n <= 0) return absl::InvalidArgumentError("accuracy: the set is empty");
  int64_t right = 0, rows = 0;
  for (int64_t at = 0; at < n; at += batch_size) {
    ASSIGN_OR_RETURN(auto counted, count_correct(at::arange(at, std::min(n, at + batch_size), at::kLong)));
    right += counted.first;
    rows += counted.second;
  }
  if (rows == 0) return absl::InvalidArgumentError("accuracy: no row of the set could be read");
  return static_cast<double>(right) / rows;
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
        return StartedStep{[loss] { return loss; }, [] {}};
      },
      count_correct, train, test, o, out);
}

absl::StatusOr<std::vector<EpochResult>> Fit(const StartTrainStep& start_step, const CountStep& count_correct,
                                             const data::Source& train, const data::Source& test,
                                             const FitOptions& o, std::ostream& out) {
  return FitLoop(
      train.size(), [&train](const at::Tensor& rows, int e) { return train.Get(rows, e); },
      [&start_step](const data::Batch& b, const at::Tensor&, int) { return start_step(b.images, b.labels); },
      nullptr, [&] { return Accuracy(count_correct, test, o.eval_batch_size); }, o, out);
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
      [&] { return Accuracy(count_correct, test_rows, o.eval_batch_size); }, rows_only, out);
}

namespace {

absl::StatusOr<std::vector<EpochResult>> FitLoop(int64_t train_size, const RowReader& read_rows,
                                                 const BatchStarter& start_step,
                                                 const std::function<absl::StatusOr<int64_t>()>& skipped,
                                                 const std::function<absl::StatusOr<double>()>& accuracy_fn,
                                                 const FitOptions& o, std::ostream& out) {
  if (o.epochs < 1 || o.batch_size < 1 || o.prefetch < 0) {
    return absl::InvalidArgumentError("fit: epochs and batch size must be at least 1, prefetch at least 0");
  }
  std::vector<EpochResult> results;
  int64_t step = o.start.step;
  int64_t skipped_before = 0;
  if (skipped) {
    ASSIGN_OR_RETURN(skipped_before, skipped());
  }
  for (int e = std::max(1, o.start.epoch); e <= o.epochs; ++e) {
    const bool resumed = e == o.start.epoch;
    std::vector<at::Tensor> batches = data::EpochBatches(train_size, o.batch_size, o.shuffle, o.seed, e);
    if (!batches.empty() && batches.back().size(0) < o.min_batch_rows) batches.pop_back();
    if (batches.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("fit: ", train_size,
                                                     " training rows make no batch of ", o.min_batch_rows));
    }
    if (resumed && o.start.batch > static_cast<int64_t>(batches.size())) {
      return absl::InvalidArgumentError(absl::StrCat("fit: resuming at batch ", o.start.batch, " of epoch ", e,
                                                     ", which has ", batches.size(), " batches"));
    }
    EpochResult r;
    r.epoch = e;
    const double t0 = Now();
    double loss_sum = resumed ? o.start.loss_sum : 0, next_line = 0;
    r.images = resumed ? o.start.images : 0;
    int64_t trained = 0;  // images of this epoch trained by this call
    double last_end = t0;  // when the step before ended
    const size_t first = resumed ? static_cast<size_t>(o.start.batch) : 0;
    // Resumed after its last batch (a run that ended with the epoch, now
    // given more epochs): the epoch was reported then.
    if (resumed && first == batches.size() && first > 0) continue;
    // Batches read ahead (o.prefetch of them while a step runs), in order
    // from batch `next_read`.
    std::deque<std::future<absl::StatusOr<data::Batch>>> read;
    size_t next_read = first;
    auto read_ahead = [&] {
      while (next_read < batches.size() && static_cast<int>(read.size()) <= o.prefetch) {
        read.push_back(std::async(o.prefetch > 0 ? std::launch::async : std::launch::deferred,
                                  [&read_rows, rows = batches[next_read], e] { return read_rows(rows, e); }));
        ++next_read;
      }
    };
    // Steps started and not yet waited for, oldest first.
    struct Started {
      size_t batch;
      int64_t rows;
      StartedStep step;
    };
    std::deque<Started> started;
    auto drop_started = [&started] {
      for (auto& s : started) s.step.abandon();
      started.clear();
    };
    // Waits for the oldest step started and accounts for it.
    auto finish_oldest = [&]() -> absl::Status {
      Started oldest = std::move(started.front());
      started.pop_front();
      const size_t b = oldest.batch;
      absl::StatusOr<double> loss = oldest.step.wait();
      if (!loss.ok()) {
        drop_started();
        return Annotate(loss.status(), absl::StrCat("epoch ", e, ", batch ", b + 1, " of ", batches.size()));
      }
      const int64_t rows = oldest.rows;
      loss_sum += *loss;
      r.images += rows;
      trained += rows;
      ++step;
      const double ended = Now();
      if (o.on_step) o.on_step(StepRecord{e, step, *loss, rows, ended - last_end});
      last_end = ended;
      const double done = static_cast<double>(b + 1 - first) / (batches.size() - first);
      const double elapsed = ended - t0;
      const std::string line = absl::StrFormat(
          "epoch %d/%d  %zu/%zu batches  loss=%.4f  %.0f images/s  ETA %s", e, o.epochs, b + 1,
          batches.size(), loss_sum / (b + 1), trained / std::max(elapsed, 1e-9),
          Duration(elapsed / done - elapsed));
      if (o.progress_bar) {
        out << "\r" << line << "   " << std::flush;
      } else if (done >= next_line && b + 1 < batches.size()) {
        out << line << "\n" << std::flush;
        next_line += 0.1;
      }
      if (o.after_step) {
        absl::Status s = o.after_step(FitPosition{e, static_cast<int64_t>(b + 1), loss_sum, r.images, step});
        if (!s.ok()) {
          drop_started();
          return Annotate(s, absl::StrCat("after epoch ", e, ", batch ", b + 1));
        }
      }
      return absl::OkStatus();
    };
    for (size_t b = first; b < batches.size(); ++b) {
      // The step before this one (step + started.size()) may need the
      // workers to itself until after_step has run.
      if (!started.empty() && o.settle_after &&
          o.settle_after(step + static_cast<int64_t>(started.size()))) {
        while (!started.empty()) RETURN_IF_ERROR(finish_oldest());
      }
      read_ahead();
      absl::StatusOr<data::Batch> batch = read.front().get();
      read.pop_front();
      read_ahead();  // the next batches are read while this one trains
      if (!batch.ok()) {
        drop_started();
        return Annotate(batch.status(), absl::StrCat("reading epoch ", e, ", batch ", b + 1, " of ", batches.size()));
      }
      r.skipped += batch->skipped;
      if (batch->labels.size(0) == 0) continue;  // every file of it skipped
      const int64_t rows = batch->labels.size(0);
      started.push_back(Started{b, rows, start_step(*batch, batches[b], e)});
      // One step ahead: the one before this is waited for now.
      while (started.size() > 1) RETURN_IF_ERROR(finish_oldest());
    }
    while (!started.empty()) RETURN_IF_ERROR(finish_oldest());
    r.seconds = Now() - t0;
    if (skipped) {  // left out where the rows were read
      auto now = skipped();
      if (!now.ok()) return Annotate(now.status(), absl::StrCat("after epoch ", e));
      const int64_t epoch_skipped = *now - skipped_before;
      skipped_before = *now;
      r.skipped += epoch_skipped;
      r.images -= epoch_skipped;
      trained -= epoch_skipped;
    }
    r.trained = trained;
    r.train_loss = loss_sum / batches.size();
    if (o.progress_bar) out << "\n";
    auto accuracy = accuracy_fn();
    if (!accuracy.ok()) return Annotate(accuracy.status(), absl::StrCat("evaluating after epoch ", e));
    r.test_accuracy = *accuracy;
    out << absl::StrFormat("epoch=%d train_loss=%.4f test_accuracy=%.4f seconds=%.1f images_per_second=%.0f%s\n",
                           e, r.train_loss, r.test_accuracy, r.seconds, trained / std::max(r.seconds, 1e-9),
                           r.skipped > 0 ? absl::StrCat(" skipped_images=", r.skipped) : "")
        << std::flush;
    if (o.on_epoch) o.on_epoch(r);
    results.push_back(r);
  }
  return results;
}

}  // namespace
}  // namespace remora::pipeline
