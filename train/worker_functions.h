// What a worker of a training group offers, whatever its model: the
// functions of distributed autograd and the DistributedOptimizer, pipeline
// stages and their step runners (with the data they read), gradient groups,
// checkpoints, parameter-server replicas, and tracing (trace_enable,
// trace_collect: master --trace and --timeline). A worker program
// registers these and its model types (pipeline::RegisterStageModule):
//
//   absl::Status Register(remora::Registry& registry) {
//     RETURN_IF_ERROR(remora::train::RegisterWorkerFunctions(registry));
//     return remora::pipeline::RegisterStageModule<MyNetImpl>("MyNet", ...);
//   }
//
// Thread-safety: call before the agent starts (the registry is not
// thread-safe while it is filled).
#pragma once

#include "absl/status/status.h"
#include "base/lines.h"
#include "rpc/registry.h"

namespace remora::train {

// Registers the above; an error when a name is taken already. What the
// functions have to say (the first use_deterministic_algorithms: "worker
// 'w1': deterministic algorithms ...") goes to `say` (none: nowhere).
absl::Status RegisterWorkerFunctions(rpc::Registry& registry, base::LineSink say = nullptr);

}  // namespace remora::train
