// What the stock `worker` program offers: what a training group needs
// (train::RegisterWorkerFunctions, train/worker_functions.h), the stage
// types of shards/ (shards::RegisterStageTypes) and their modules for the
// RPC API, and the small functions and modules behind the RPC example and
// rpc_bench:
//
//   functions: add(a, b), echo(x), sink(t) -> [numel], device_of(t or RRef t)
//              -> "cpu" or "cuda:N", rref_stats(), to_here(rref),
//              make_rref(value), rref_add(rref, t), process_stats() ->
//              {pid, threads, fds, rss_kb} of the worker's process
//   modules:   Scale(factor) with forward(x or RRef x) and factor();
//              Affine(in, out, seed) with forward(x or RRef x) and weight()
//
// Test-only functions (raise, sleep_ms, BackwardFails) are not here:
// tests/support has them.
#pragma once

#include "rpc/registry.h"

namespace remora::examples {

// Registers the builtins above; fails if a name is already taken.
absl::Status RegisterBuiltins(Registry& registry);

// Everything the stock worker offers (above).
absl::Status RegisterStockWorker(Registry& registry);

}  // namespace remora::examples
