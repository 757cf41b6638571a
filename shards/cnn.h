// A small CNN for 28x28 single-channel images (Fashion-MNIST, MNIST), in
// four blocks that a worker can host any contiguous range of:
//
//   block 0  conv 3x3 (1->32), ReLU, max-pool 2x2      28x28 -> 13x13
//   block 1  conv 3x3 (32->64), ReLU, max-pool 2x2     13x13 -> 5x5
//   block 2  flatten, fc 1600->128, ReLU
//   block 3  fc 128->10 (logits)
//
// 225,034 parameters. Weights are LibTorch's default initialisation drawn
// from a generator seeded by (seed, block), so a range of blocks equals
// the same blocks of the whole model whichever worker builds it.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <torch/nn/module.h>

namespace remora::shards {

inline constexpr int kSmallCnnBlocks = 4;

class SmallCnnImpl : public torch::nn::Module {
 public:
  // Blocks [first, last); throws std::invalid_argument for a bad range.
  SmallCnnImpl(int first, int last, int64_t seed);
  at::Tensor forward(at::Tensor x);

 private:
  std::vector<std::function<at::Tensor(const at::Tensor&)>> forwards_;
};

}  // namespace remora::shards
