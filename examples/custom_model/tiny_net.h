// The user's model: a small two-layer network, cut into two stages.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl(int64_t in, int64_t out, bool relu)
      : fc(register_module("fc", torch::nn::Linear(in, out))), relu(relu) {}
  at::Tensor forward(at::Tensor x) {
    x = fc->forward(x);
    return relu ? x.relu() : x;
  }
  torch::nn::Linear fc;
  bool relu;
};
