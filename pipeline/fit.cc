#include "pipeline/fit.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <utility>

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
  if (set.size() == 0) return absl::InvalidArgumentError("accuracy: the set is empty");
  int64_t right = 0;
  for (int64_t at = 0; at < set.size(); at += batch_size) {
    const int64_t end = std::min(set.size(), at + batch_size);
    ASSIGN_OR_RETURN(int64_t n, count_correct(set.images.slice(0, at, end), set.labels.slice(0, at, end)));
    right += n;
  }
  return static_cast<double>(right) / set.size();
}

absl::StatusOr<std::vector<EpochResult>> Fit(const TrainStep& train_step, const CountStep& count_correct,
                                             const data::Dataset& train, const data::Dataset& test,
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
                                             const data::Dataset& train, const data::Dataset& test,
                                             const FitOptions& o, std::ostream& out) {
  if (o.epochs < 1 || o.batch_size < 1) {
    return absl::InvalidArgumentError("fit: epochs and batch size must be at least 1");
  }
  std::vector<EpochResult> results;
  int64_t step = o.start.step;
  for (int e = std::max(1, o.start.epoch); e <= o.epochs; ++e) {
    const bool resumed = e == o.start.epoch;
    std::vector<at::Tensor> batches = data::EpochBatches(train.size(), o.batch_size, o.shuffle, o.seed, e);
    if (!batches.empty() && batches.back().size(0) < o.min_batch_rows) batches.pop_back();
    if (batches.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("fit: ", train.size(),
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
    const size_t first = resumed ? static_cast<size_t>(o.start.batch) : 0;
    // Resumed after its last batch (a run that ended with the epoch, now
    // given more epochs): the epoch was reported then.
    if (resumed && first == batches.size() && first > 0) continue;
    // Steps started and not yet waited for, oldest first: (batch, step).
    std::deque<std::pair<size_t, StartedStep>> started;
    auto drop_started = [&started] {
      for (auto& [b, s] : started) s.abandon();
      started.clear();
    };
    // Waits for the oldest step started and accounts for it.
    auto finish_oldest = [&]() -> absl::Status {
      auto [b, started_step] = std::move(started.front());
      started.pop_front();
      absl::StatusOr<double> loss = started_step.wait();
      if (!loss.ok()) {
        drop_started();
        return Annotate(loss.status(), absl::StrCat("epoch ", e, ", batch ", b + 1, " of ", batches.size()));
      }
      const int64_t rows = batches[b].size(0);
      loss_sum += *loss;
      r.images += rows;
      trained += rows;
      ++step;
      const double done = static_cast<double>(b + 1 - first) / (batches.size() - first);
      const double elapsed = Now() - t0;
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
      const at::Tensor& rows = batches[b];
      started.emplace_back(b, start_step(train.images.index_select(0, rows), train.labels.index_select(0, rows)));
      // One step ahead: the one before this is waited for now.
      while (started.size() > 1) RETURN_IF_ERROR(finish_oldest());
    }
    while (!started.empty()) RETURN_IF_ERROR(finish_oldest());
    r.seconds = Now() - t0;
    r.trained = trained;
    r.train_loss = loss_sum / batches.size();
    if (o.progress_bar) out << "\n";
    auto accuracy = Accuracy(count_correct, test, o.eval_batch_size);
    if (!accuracy.ok()) return Annotate(accuracy.status(), absl::StrCat("evaluating after epoch ", e));
    r.test_accuracy = *accuracy;
    out << absl::StrFormat("epoch=%d train_loss=%.4f test_accuracy=%.4f seconds=%.1f images_per_second=%.0f\n",
                           e, r.train_loss, r.test_accuracy, r.seconds,
                           trained / std::max(r.seconds, 1e-9))
        << std::flush;
    results.push_back(r);
  }
  return results;
}

}  // namespace remora::pipeline
