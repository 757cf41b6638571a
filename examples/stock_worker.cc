#include "examples/stock_worker.h"

#include <iostream>

#include "base/lines.h"
#include "base/status_util.h"
#include "shards/mlp.h"
#include "shards/resnet.h"
#include "shards/stage_types.h"
#include "train/worker_functions.h"

namespace remora::examples {

absl::Status RegisterStockWorker(rpc::Registry& registry) {
  RETURN_IF_ERROR(shards::RegisterMLP(registry));
  RETURN_IF_ERROR(shards::RegisterResNet(registry));
  RETURN_IF_ERROR(train::RegisterWorkerFunctions(registry, base::LinesTo(std::cout)));
  return shards::RegisterStageTypes();
}

}  // namespace remora::examples
