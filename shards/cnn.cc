#include "shards/cnn.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include "absl/strings/str_cat.h"

namespace remora::shards {
namespace {

// LibTorch's default init for conv and linear layers (U(-1/sqrt(fan_in),
// 1/sqrt(fan_in)) for weight and bias), from a private generator.
void Init(torch::nn::Module& m, int64_t fan_in, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.uniform_(-bound, bound, gen);
}

}  // namespace

SmallCnnImpl::SmallCnnImpl(int first, int last, int64_t seed) {
  if (first < 0 || last > kSmallCnnBlocks || first >= last) {
    throw std::invalid_argument(absl::StrCat("SmallCnn: blocks [", first, ", ", last,
                                             ") are not a range of [0, ", kSmallCnnBlocks, ")"));
  }
  namespace F = torch::nn::functional;
  for (int b = first; b < last; ++b) {
    const int64_t block_seed = seed * 1000 + b;
    switch (b) {
      case 0: {
        auto conv = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)));
        Init(*conv, 1 * 9, block_seed);
        forwards_.push_back([conv](const at::Tensor& x) {
          return F::max_pool2d(conv->forward(x).relu(), F::MaxPool2dFuncOptions(2));
        });
        break;
      }
      case 1: {
        auto conv = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)));
        Init(*conv, 32 * 9, block_seed);
        forwards_.push_back([conv](const at::Tensor& x) {
          return F::max_pool2d(conv->forward(x).relu(), F::MaxPool2dFuncOptions(2));
        });
        break;
      }
      case 2: {
        auto fc = register_module("fc1", torch::nn::Linear(64 * 5 * 5, 128));
        Init(*fc, 64 * 5 * 5, block_seed);
        forwards_.push_back([fc](const at::Tensor& x) { return fc->forward(x.flatten(1)).relu(); });
        break;
      }
      default: {
        auto fc = register_module("fc2", torch::nn::Linear(128, 10));
        Init(*fc, 128, block_seed);
        forwards_.push_back([fc](const at::Tensor& x) { return fc->forward(x); });
        break;
      }
    }
  }
}

at::Tensor SmallCnnImpl::forward(at::Tensor x) {
  for (const auto& f : forwards_) x = f(x);
  return x;
}

}  // namespace remora::shards
