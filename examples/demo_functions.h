// The small functions and modules behind rpc_demo, rpc_bench and soak (and
// the tests' workers): examples of the RPC API, not part of a training
// worker.
//
//   functions: add(a, b), echo(x), sink(t) -> [numel], device_of(t or RRef t)
//              -> "cpu" or "cuda:N", rref_stats(), to_here(rref),
//              make_rref(value), rref_add(rref, t), process_stats() ->
//              {pid, threads, fds, rss_kb} of the worker's process
//   modules:   Scale(factor) with forward(x or RRef x) and factor();
//              Affine(in, out, seed) with forward(x or RRef x) and weight()
//
// Those programs start their own workers: `PROGRAM worker --name N
// --master ADDR [worker flags]` serves the stock worker's registrations
// (examples/stock_worker.h) plus these.
#pragma once

#include <string>

#include "launch/local_group.h"
#include "rpc/registry.h"

namespace remora::examples {

// Registers the functions and modules above; fails if a name is already
// taken.
absl::Status RegisterDemoFunctions(rpc::Registry& registry);

// The stock worker's registrations plus the demo functions.
absl::Status RegisterDemoWorker(rpc::Registry& registry);

// True when argv asks for the worker role (`PROGRAM worker ...`).
bool IsDemoWorker(int argc, char** argv);

// Runs the worker role of `program` (argv as main got it); returns the
// exit code.
int DemoWorkerMain(int argc, char** argv, const std::string& program);

// How launch::StartLocalGroup spawns `program`'s worker role.
launch::WorkerProgram DemoWorkerProgram(const std::string& program);

}  // namespace remora::examples
