// Micro-batches: splitting a batch into micro-batches and merging outputs
// back, for tensors, tuples and lists of tensors (dimension 0 is the batch
// dimension), in one place.
//
// Thread-safety: pure functions.
#pragma once

#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"

namespace remora::pipeline {

// `batch` cut into exactly `m` micro-batches along dimension 0, sizes
// differing by at most one (a tuple or list is cut element by element;
// non-tensor elements are copied into every micro-batch). InvalidArgument
// when a tensor has fewer than `m` rows or the batch holds no tensor.
absl::StatusOr<std::vector<c10::IValue>> SplitMicroBatches(const c10::IValue& batch, int m);

// The micro-batches' outputs joined along dimension 0 (tuples and lists
// element by element).
absl::StatusOr<c10::IValue> MergeMicroBatches(const std::vector<c10::IValue>& parts);

// Rows (dimension 0) of the first tensor in `value`; -1 when none.
int64_t BatchRows(const c10::IValue& value);

// The weight of a part of a batch (a micro-batch, a replica's or a worker's
// share) of `rows` rows in the batch's mean loss over `total_rows`: the
// part's mean loss times this, summed over the parts, is the whole batch's
// mean loss, also when the parts differ in size. Every mode weights by it.
inline double RowsShare(int64_t rows, double total_rows) { return static_cast<double>(rows) / total_rows; }

}  // namespace remora::pipeline
