// ResNet50 in torchvision's layout, cut into 18 blocks that a worker can
// host any contiguous range of:
//
//   block 0        stem: conv 7x7/2 (3->64), BatchNorm, ReLU, max-pool 3x3/2
//   blocks 1-3     layer1: 3 Bottlenecks (planes 64)
//   blocks 4-7     layer2: 4 Bottlenecks (planes 128, first stride 2)
//   blocks 8-13    layer3: 6 Bottlenecks (planes 256, first stride 2)
//   blocks 14-16   layer4: 3 Bottlenecks (planes 512, first stride 2)
//   block 17       head: adaptive average pool, flatten, fc 2048->1000
//
// 25,557,032 parameters in all. Initialisation is torchvision's (convs:
// Kaiming normal, fan_out, ReLU gain; BatchNorm weight 1, bias 0; fc:
// U(-1/sqrt(2048), 1/sqrt(2048))), drawn from a generator seeded by
// (seed, block), so a shard's weights equal the same blocks of the full
// model whichever range a worker builds.
//
// Registered module "ResNetShard"(first, last, seed[, device]): blocks
// [first, last) on `device` (default: the hosting agent's home device,
// worker --device), methods forward(x or RRef x[, micro_batch]) -> tensor
// (x is moved to the shard's device first), parameter_rrefs(),
// num_parameters(). As a stage type (shards/stage_types.h) its first two
// arguments are a block range, so pipeline::SequentialModel::Registered
// ("ResNetShard", kResNetBlocks, {seed}) cuts it (pipeline/partition.h).
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "rpc/registry.h"

namespace remora::shards {

inline constexpr int kResNetBlocks = 18;

// Blocks [first, last) of ResNet50 as one module.
class ResNetShardImpl : public torch::nn::Module {
 public:
  // Weights are drawn on the CPU (the same on every device), then moved.
  ResNetShardImpl(int first, int last, int64_t seed, c10::Device device = c10::kCPU);
  at::Tensor forward(at::Tensor x);
  // Forward of block `i` (relative to `first`) alone.
  at::Tensor ForwardBlock(size_t i, const at::Tensor& x);
  size_t num_blocks() const { return blocks_.size(); }
  int first() const { return first_; }
  int last() const { return last_; }
  c10::Device device() const { return device_; }

 private:
  int first_, last_;
  c10::Device device_;
  std::vector<std::shared_ptr<torch::nn::Module>> blocks_;
  std::vector<std::function<at::Tensor(const at::Tensor&)>> forwards_;
};

// torchvision's two-part split: stem + layer1 + layer2 | layer3 + layer4 + head.
std::vector<int> TutorialSplit();

absl::Status RegisterResNet(rpc::Registry& registry);

}  // namespace remora::shards
