#include "shards/stage_types.h"

#include <stdexcept>
#include <vector>

#include "base/status_util.h"
#include "pipeline/stage.h"
#include "shards/cnn.h"
#include "shards/gpt.h"
#include "shards/mlp.h"
#include "shards/protocol.h"
#include "shards/resnet.h"

namespace remora::shards {

absl::Status RegisterStageTypes() {
  // Once per process: tests start several agents in one.
  static const absl::Status status = [] {
    RETURN_IF_ERROR(pipeline::RegisterStageModule<torch::nn::SequentialImpl>(
        MLPStageArgs::kFunction, [](const std::vector<c10::IValue>& a, c10::Device) {
          const auto r = rpc::DecodeCallOrThrow<MLPStageArgs>(a);
          MLPStageOptions o;
          o.in = r.in;
          o.out = r.out;
          o.seed = r.seed;
          o.relu = r.relu;
          o.batchnorm = r.batchnorm;
          if (o.in <= 0 || o.out <= 0) throw std::invalid_argument("MLPStage: sizes must be positive");
          return MakeMLPStage(o).ptr();
        }));
    RETURN_IF_ERROR(pipeline::RegisterStageModule<SmallCnnImpl>(
        SmallCnnArgs::kFunction, [](const std::vector<c10::IValue>& a, c10::Device) {
          const auto r = rpc::DecodeCallOrThrow<SmallCnnArgs>(a);
          return std::make_shared<SmallCnnImpl>(static_cast<int>(r.first), static_cast<int>(r.last), r.seed);
        }));
    RETURN_IF_ERROR(pipeline::RegisterStageModule<GptEmbedImpl>(
        GptEmbedArgs::kFunction, [](const std::vector<c10::IValue>& a, c10::Device) {
          const auto r = rpc::DecodeCallOrThrow<GptEmbedArgs>(a);
          return std::make_shared<GptEmbedImpl>(r.vocab, r.seq_len, r.d_model, r.seed);
        }));
    RETURN_IF_ERROR(pipeline::RegisterStageModule<GptBlocksImpl>(
        GptBlocksArgs::kFunction, [](const std::vector<c10::IValue>& a, c10::Device) {
          const auto r = rpc::DecodeCallOrThrow<GptBlocksArgs>(a);
          return std::make_shared<GptBlocksImpl>(r.d_model, r.heads, r.first, r.last, r.seed);
        }));
    RETURN_IF_ERROR(pipeline::RegisterStageModule<GptImpl>(
        GptArgs::kFunction, [](const std::vector<c10::IValue>& a, c10::Device) {
          const auto r = rpc::DecodeCallOrThrow<GptArgs>(a);
          return std::make_shared<GptImpl>(r.vocab, r.seq_len, r.d_model, r.heads, r.layers, r.first, r.last, r.seed,
                                           r.tie != 0);
        }));
    RETURN_IF_ERROR(pipeline::RegisterStageModule<GptHeadImpl>(
        GptHeadArgs::kFunction, [](const std::vector<c10::IValue>& a, c10::Device) {
          const auto r = rpc::DecodeCallOrThrow<GptHeadArgs>(a);
          return std::make_shared<GptHeadImpl>(r.d_model, r.vocab, r.seed);
        }));
    return pipeline::RegisterStageModule<ResNetShardImpl>(
        ResNetShardArgs::kFunction, [](const std::vector<c10::IValue>& a, c10::Device device) {
          const auto r = rpc::DecodeCallOrThrow<ResNetShardArgs>(a);
          return std::make_shared<ResNetShardImpl>(static_cast<int>(r.first), static_cast<int>(r.last), r.seed,
                                                   device);
        });
  }();
  return status;
}

}  // namespace remora::shards
