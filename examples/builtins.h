// What the stock `worker` program offers, and the small functions and
// modules behind the RPC example and rpc_bench. The worker program decides
// what it registers (RegisterStockWorker); models/ only defines models.
//
//   functions: add(a, b), echo(x), sink(t) -> [numel], device_of(t or RRef t)
//              -> "cpu" or "cuda:N", rref_stats(), to_here(rref),
//              make_rref(value), rref_add(rref, t), process_stats() ->
//              {pid, threads, fds, rss_kb} of the worker's process,
//              trace_enable(on), trace_collect()
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

// The stock worker's pipeline stage types (pipeline/stage.h): "MLPStage"
// (in, out, seed, relu, batchnorm), "SmallCnn" (first, last, seed) and
// "ResNetShard" (first, last, seed).
// Registered once per process; later calls return the first result.
absl::Status RegisterStockStageTypes();

// Everything the stock worker offers: the builtins, the MLP and ResNet50
// stages, and the functions of distributed autograd and the
// DistributedOptimizer, the pipeline stage wrapper, checkpoints, the
// parameter server's replica (ps/replica.h) and the stock stage types.
absl::Status RegisterStockWorker(Registry& registry);

}  // namespace remora::examples
