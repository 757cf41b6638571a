// Small functions and modules every worker offers: the building blocks of
// the RPC example, the tests and rpc_bench.
//
//   functions: add(a, b), echo(x), sink(t) -> [numel], device_of(t or RRef t)
//              -> "cpu" or "cuda:N", raise(message),
//              sleep_ms(ms), rref_stats(), to_here(rref), make_rref(value),
//              rref_add(rref, t), process_stats() -> {pid, threads, fds,
//              rss_kb} of the worker's process (ReadProcessStats)
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

// Resources of a process as Linux's /proc shows them.
struct ProcessStats {
  int64_t pid = 0;
  int64_t threads = 0;  // /proc/PID/task entries
  int64_t fds = 0;      // /proc/PID/fd entries: sockets, pipes, eventfds, files
  int64_t rss_kb = 0;   // VmRSS of /proc/PID/status
};
// `pid` 0: this process. Fields it cannot read stay 0.
ProcessStats ReadProcessStats(int64_t pid = 0);

// The tensor an argument holds, fetching it first when it is an RRef.
// Throws with a clear message otherwise (inside a registered function).
at::Tensor TensorOrFetch(const c10::IValue& value);

}  // namespace remora::shards
