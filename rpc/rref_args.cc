#include "rpc/rref_args.h"

#include <stdexcept>
#include <string>

#include "absl/strings/str_cat.h"
#include "rpc/agent.h"

namespace remora::rpc {

at::Tensor TensorOrFetch(const c10::IValue& value) {
  if (value.isTensor()) return value.toTensor();
  if (value.isRRef()) {
    auto rref = RRef::FromIValue(value);
    if (!rref.ok()) throw std::runtime_error(std::string(rref.status().message()));
    auto fetched = rref->to_here();
    if (!fetched.ok()) throw std::runtime_error(std::string(fetched.status().message()));
    c10::IValue v = std::move(*fetched);
    if (!v.isTensor()) throw std::invalid_argument("the RRef does not hold a tensor");
    return v.toTensor();
  }
  throw std::invalid_argument(
      absl::StrCat("expected a tensor or an RRef to one, got a ", value.tagKind()));
}

c10::IValue ValueOrFetch(const c10::IValue& value) {
  if (!value.isRRef()) return value;
  auto rref = RRef::FromIValue(value);
  if (!rref.ok()) throw std::runtime_error(std::string(rref.status().message()));
  auto fetched = rref->to_here();
  if (!fetched.ok()) throw std::runtime_error(std::string(fetched.status().message()));
  return std::move(*fetched);
}

}  // namespace remora::rpc
