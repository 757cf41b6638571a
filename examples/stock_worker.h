// What the stock `worker` program offers: what a training group needs
// (train::RegisterWorkerFunctions, train/worker_functions.h), the stage
// types of shards/ (shards::RegisterStageTypes) and their modules for the
// RPC API (shards::RegisterMLP, shards::RegisterResNet). A worker of one's
// own registers this and adds its own (examples/custom_model).
//
// The small functions behind rpc_demo, rpc_bench and soak are not here
// (examples/demo_functions.h), nor the tests' (tests/support).
#pragma once

#include "rpc/registry.h"

namespace remora::examples {

// Everything the stock worker offers (above); fails if a name is already
// taken.
absl::Status RegisterStockWorker(rpc::Registry& registry);

}  // namespace remora::examples
