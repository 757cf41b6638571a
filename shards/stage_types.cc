#include "shards/stage_types.h"

#include <stdexcept>
#include <vector>

#include "base/status_util.h"
#include "pipeline/stage.h"
#include "shards/cnn.h"
#include "shards/mlp.h"
#include "shards/resnet.h"

namespace remora::shards {

absl::Status RegisterStageTypes() {
  // Once per process: tests start several agents in one.
  static const absl::Status status = [] {
    RETURN_IF_ERROR(pipeline::RegisterStageModule<torch::nn::SequentialImpl>(
        "MLPStage", [](const std::vector<c10::IValue>& a, c10::Device) {
          MLPStageOptions o;
          o.in = a.at(0).toInt();
          o.out = a.at(1).toInt();
          o.seed = a.size() > 2 ? a[2].toInt() : 0;
          o.relu = a.size() > 3 ? a[3].toBool() : true;
          o.batchnorm = a.size() > 4 ? a[4].toBool() : false;
          if (o.in <= 0 || o.out <= 0) throw std::invalid_argument("MLPStage: sizes must be positive");
          return MakeMLPStage(o).ptr();
        }));
    RETURN_IF_ERROR(pipeline::RegisterStageModule<SmallCnnImpl>(
        "SmallCnn", [](const std::vector<c10::IValue>& a, c10::Device) {
          return std::make_shared<SmallCnnImpl>(static_cast<int>(a.at(0).toInt()),
                                                        static_cast<int>(a.at(1).toInt()),
                                                        a.size() > 2 ? a[2].toInt() : 0);
        }));
    return pipeline::RegisterStageModule<ResNetShardImpl>(
        "ResNetShard", [](const std::vector<c10::IValue>& a, c10::Device device) {
          return std::make_shared<ResNetShardImpl>(
              static_cast<int>(a.at(0).toInt()), static_cast<int>(a.at(1).toInt()),
              a.size() > 2 ? a[2].toInt() : 0, device);
        });
  }();
  return status;
}

}  // namespace remora::shards
