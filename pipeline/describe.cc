#include "pipeline/describe.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace remora::pipeline {

std::string DescribeValue(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return "an undefined tensor";
    return absl::StrCat("a ", c10::toString(t.scalar_type()), " tensor of shape ", c10::str(t.sizes()));
  }
  if (v.isTuple()) {
    std::vector<std::string> parts;
    for (const auto& e : v.toTupleRef().elements()) parts.push_back(DescribeValue(e));
    return absl::StrCat("(", absl::StrJoin(parts, ", "), ")");
  }
  if (v.isNone()) return "None";
  if (v.isInt()) return absl::StrCat("the int ", v.toInt());
  if (v.isDouble()) return absl::StrCat("the float ", v.toDouble());
  if (v.isBool()) return v.toBool() ? "the bool True" : "the bool False";
  return absl::StrCat("a ", v.tagKind());
}

}  // namespace remora::pipeline
