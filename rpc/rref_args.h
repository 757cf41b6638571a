// Arguments of registered functions that may be RRefs: a stage's forward
// takes either a tensor or an RRef to one (a micro-batch still on the
// previous stage's worker) and fetches it.
//
// Thread-safe; call inside a registered function (it throws, which the
// registry turns into the caller's error).
#pragma once

#include <ATen/core/ivalue.h>

namespace remora::rpc {

// The tensor an argument holds, fetching it first when it is an RRef.
// Throws with a clear message otherwise.
at::Tensor TensorOrFetch(const c10::IValue& value);

// The value an argument holds (any type), fetching it first when it is an
// RRef.
c10::IValue ValueOrFetch(const c10::IValue& value);

}  // namespace remora::rpc
