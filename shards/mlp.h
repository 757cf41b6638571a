// Small trainable stages for examples and the parity tests of distributed
// autograd: Linear [-> BatchNorm1d] [-> ReLU], built deterministically from
// a seed so that a worker and a local reference build the same weights.
//
//   module "MLPStage"(in, out, seed, relu=true, batchnorm=false), methods:
//     forward(x or RRef x) -> tensor, parameter_rrefs() -> [RRef],
//     state() -> [parameters..., buffers...] (detached copies)
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include "rpc/registry.h"

namespace remora::shards {

struct MLPStageOptions {
  int64_t in = 1;
  int64_t out = 1;
  int64_t seed = 0;
  bool relu = true;
  bool batchnorm = false;
};

// Builds the stage; the same options give the same initial weights.
torch::nn::Sequential MakeMLPStage(const MLPStageOptions& options);

// Parameters then buffers, in registration order (what state() returns).
std::vector<at::Tensor> ModuleState(torch::nn::Module& module);

absl::Status RegisterMLP(rpc::Registry& registry);

// Every parameter of `module` as an RRef owned by this worker (for a
// module's "parameter_rrefs" method).
c10::IValue ParameterRRefs(rpc::CallContext& ctx, torch::nn::Module& module);

}  // namespace remora::shards
