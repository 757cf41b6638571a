// How many labels a model predicts right: top-1 and top-5 counts and the
// cross-entropy of a batch's logits (on their device, or here), and of a
// whole set through any evaluation step (a pipeline's, a trainer's, a
// model in this process). The training loop that reports them is
// train::Fit (train/fit.h).
//
//   pipeline::Correct c = pipeline::CountCorrect(logits, labels).value();
//   double top1 = c.accuracy(), top5 = c.top5_accuracy();
//
// Thread-safety: free functions; the steps are called from the calling
// thread.
#pragma once

#include <functional>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "data/datasets.h"
#include "data/source.h"

namespace remora::pipeline {

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

// How many of the rows `rows` (int64 [n]) of a set read where they are
// used are classified right, of how many were read (Correct::rows).
using CountRowsStep = std::function<absl::StatusOr<Correct>(const at::Tensor& rows)>;
// How much of `set` `count_correct` counts as classified right, of the
// rows read (a source may skip unreadable files); an error when the set is
// empty or none of it could be read.
absl::StatusOr<Correct> Accuracy(const CountStep& count_correct, const data::Dataset& set,
                                 int64_t batch_size);
absl::StatusOr<Correct> Accuracy(const CountStep& count_correct, const data::Source& set, int64_t batch_size);
absl::StatusOr<Correct> Accuracy(const CountRowsStep& count_correct, int64_t rows, int64_t batch_size);

}  // namespace remora::pipeline
