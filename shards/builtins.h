// Small functions and modules every worker offers: the building blocks of
// the RPC example, the tests and rpc_bench.
//
//   functions: add(a, b), echo(x), sink(t) -> [numel], device_of(t or RRef t)
//              -> "cpu" or "cuda:N", raise(message),
//              sleep_ms(ms), rref_stats(), to_here(rref), make_rref(value),
//              rref_add(rref, t)
//   modules:   Scale(factor) with forward(x or RRef x) and factor();
//              Affine(in, out, seed) with forward(x or RRef x) and weight()
#pragma once

#include "rpc/registry.h"

namespace remora::shards {

// Registers the builtins above; fails if a name is already taken.
absl::Status RegisterBuiltins(Registry& registry);

// Everything a remora worker offers: the builtins, the MLP stages, and the
// functions of distributed autograd and the DistributedOptimizer.
absl::Status RegisterAll(Registry& registry);

// The tensor an argument holds, fetching it first when it is an RRef.
// Throws with a clear message otherwise (inside a registered function).
at::Tensor TensorOrFetch(const c10::IValue& value);

}  // namespace remora::shards
