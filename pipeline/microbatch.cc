#include "pipeline/microbatch.h"

#include <ATen/ops/cat.h>

#include "absl/strings/str_cat.h"

namespace remora::pipeline {

int64_t BatchRows(const c10::IValue& value) {
  if (value.isTensor()) return value.toTensor().dim() > 0 ? value.toTensor().size(0) : -1;
  if (value.isTuple()) {
    for (const auto& e : value.toTupleRef().elements()) {
      if (int64_t r = BatchRows(e); r >= 0) return r;
    }
  }
  if (value.isList()) {
    for (const auto& e : value.toListRef()) {
      if (int64_t r = BatchRows(e); r >= 0) return r;
    }
  }
  return -1;
}

absl::StatusOr<std::vector<c10::IValue>> SplitMicroBatches(const c10::IValue& batch, int m) {
  if (m < 1) return absl::InvalidArgumentError("micro-batches: the count must be at least 1");
  if (batch.isTensor()) {
    const at::Tensor& t = batch.toTensor();
    if (t.dim() == 0 || t.size(0) < m) {
      return absl::InvalidArgumentError(absl::StrCat(
          "micro-batches: a batch of ", t.dim() == 0 ? 0 : t.size(0),
          " rows cannot be split into ", m, " micro-batches (use a larger batch or fewer splits)"));
    }
    std::vector<c10::IValue> out;
    for (const at::Tensor& part : t.tensor_split(m, 0)) out.push_back(part);
    return out;
  }
  if (batch.isTuple() || batch.isList()) {
    std::vector<c10::IValue> elements;
    if (batch.isTuple()) {
      for (const auto& e : batch.toTupleRef().elements()) elements.push_back(e);
    } else {
      for (const auto& e : batch.toListRef()) elements.push_back(e);
    }
    if (BatchRows(batch) < 0) {
      return absl::InvalidArgumentError("micro-batches: the batch holds no tensor to split");
    }
    std::vector<std::vector<c10::IValue>> parts(m);
    for (const auto& e : elements) {
      if (BatchRows(e) < 0) {
        for (auto& p : parts) p.push_back(e);
        continue;
      }
      auto split = SplitMicroBatches(e, m);
      if (!split.ok()) return split.status();
      for (int i = 0; i < m; ++i) parts[i].push_back((*split)[i]);
    }
    std::vector<c10::IValue> out;
    for (auto& p : parts) {
      if (batch.isTuple()) {
        out.push_back(c10::ivalue::Tuple::create(std::move(p)));
      } else {
        c10::impl::GenericList list(batch.toList().elementType());
        for (auto& v : p) list.push_back(std::move(v));
        out.push_back(std::move(list));
      }
    }
    return out;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "micro-batches: cannot split a ", batch.tagKind(), " (a tensor, tuple or list is needed)"));
}

absl::StatusOr<c10::IValue> MergeMicroBatches(const std::vector<c10::IValue>& parts) {
  if (parts.empty()) return absl::InvalidArgumentError("micro-batches: nothing to merge");
  const c10::IValue& first = parts[0];
  if (first.isTensor()) {
    std::vector<at::Tensor> ts;
    for (const auto& p : parts) {
      if (!p.isTensor()) return absl::InvalidArgumentError("micro-batches: outputs differ in type");
      ts.push_back(p.toTensor());
    }
    return c10::IValue(at::cat(ts, 0));
  }
  if (first.isTuple() || first.isList()) {
    auto elements = [](const c10::IValue& v) {
      std::vector<c10::IValue> out;
      if (v.isTuple()) {
        for (const auto& e : v.toTupleRef().elements()) out.push_back(e);
      } else if (v.isList()) {
        for (const auto& e : v.toListRef()) out.push_back(e);
      }
      return out;
    };
    const size_t n = elements(first).size();
    std::vector<c10::IValue> merged;
    for (size_t j = 0; j < n; ++j) {
      std::vector<c10::IValue> column;
      for (const auto& p : parts) {
        auto e = elements(p);
        if (e.size() != n) return absl::InvalidArgumentError("micro-batches: outputs differ in length");
        column.push_back(e[j]);
      }
      if (BatchRows(column[0]) < 0) {
        merged.push_back(column[0]);
        continue;
      }
      auto m = MergeMicroBatches(column);
      if (!m.ok()) return m.status();
      merged.push_back(std::move(*m));
    }
    if (first.isTuple()) return c10::IValue(c10::ivalue::Tuple::create(std::move(merged)));
    c10::impl::GenericList list(first.toList().elementType());
    for (auto& v : merged) list.push_back(std::move(v));
    return c10::IValue(std::move(list));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("micro-batches: cannot merge outputs of type ", first.tagKind()));
}

}  // namespace remora::pipeline
