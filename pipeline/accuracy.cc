#include "pipeline/accuracy.h"

#include <algorithm>
#include <string>
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
#include "base/status_util.h"

namespace remora::pipeline {
namespace {

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

}  // namespace remora::pipeline
