// The run's settings on the workers, from the master's side: their trace
// recorders (runtime/trace.h; master --trace and --timeline, pipeline_bench
// --hops) and --deterministic's switch, the calls of train/protocol.h.
// Defined in worker_functions.cc, beside the functions they call.
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

// master --deterministic on each of `workers` (runtime::UseDeterministicAlgorithms
// there); an error names the worker that could not.
absl::Status UseDeterministicAlgorithmsOn(rpc::Agent& agent, const std::vector<std::string>& workers);

}  // namespace remora::train
