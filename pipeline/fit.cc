#include "pipeline/fit.h"

#include <algorithm>
#include <chrono>

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

absl::StatusOr<double> Accuracy(const EvalStep& eval_step, const data::Dataset& set,
                                int64_t batch_size) {
  if (set.size() == 0) return absl::InvalidArgumentError("accuracy: the set is empty");
  int64_t right = 0;
  for (int64_t at = 0; at < set.size(); at += batch_size) {
    const int64_t end = std::min(set.size(), at + batch_size);
    ASSIGN_OR_RETURN(at::Tensor logits, eval_step(set.images.slice(0, at, end)));
    if (logits.dim() != 2 || logits.size(0) != end - at) {
      return absl::InvalidArgumentError(absl::StrCat(
          "accuracy: the model's output for ", end - at, " images has shape ",
          c10::str(logits.sizes()), "; it should be [", end - at, ", classes]"));
    }
    right += logits.argmax(1).cpu().eq(set.labels.slice(0, at, end)).sum().item<int64_t>();
  }
  return static_cast<double>(right) / set.size();
}

absl::StatusOr<std::vector<EpochResult>> Fit(const TrainStep& train_step, const EvalStep& eval_step,
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
    for (size_t b = first; b < batches.size(); ++b) {
      const at::Tensor& rows = batches[b];
      auto loss = train_step(train.images.index_select(0, rows), train.labels.index_select(0, rows));
      if (!loss.ok()) {
        return Annotate(loss.status(), absl::StrCat("epoch ", e, ", batch ", b + 1, " of ", batches.size()));
      }
      loss_sum += *loss;
      r.images += rows.size(0);
      trained += rows.size(0);
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
        if (!s.ok()) return Annotate(s, absl::StrCat("after epoch ", e, ", batch ", b + 1));
      }
    }
    r.seconds = Now() - t0;
    r.train_loss = loss_sum / batches.size();
    if (o.progress_bar) out << "\n";
    auto accuracy = Accuracy(eval_step, test, o.eval_batch_size);
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
