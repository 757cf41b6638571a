// The workers' trace recorders (runtime/trace.h), from the master's side:
// the calls of train/protocol.h that master --trace and --timeline, and
// pipeline_bench --hops, make on the workers. Defined in
// worker_functions.cc, beside the functions they call.
//
// Thread-safety: as Agent::rpc_sync (any thread).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "rpc/agent.h"
#include "train/protocol.h"

namespace remora::train {

// Turns `workers`' trace recorders on, their older slices dropped.
void StartTracing(rpc::Agent& agent, const std::vector<std::string>& workers);

// Turns `workers`' trace recorders off, keeping what they recorded.
void StopTracing(rpc::Agent& agent, const std::vector<std::string>& workers);

// What `worker` recorded since its tracing started (or its slices were
// last taken); its tracing stops. An error names the worker.
absl::StatusOr<std::vector<TraceSliceValue>> TakeTrace(rpc::Agent& agent, const std::string& worker);

}  // namespace remora::train
