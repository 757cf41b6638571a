#include "shards/mlp.h"

#include <cmath>

#include <ATen/CPUGeneratorImpl.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>

#include "rpc/agent.h"
#include "base/status_util.h"
#include "rpc/rref_args.h"
#include "runtime/compute_lane.h"
#include "shards/protocol.h"

namespace remora::shards {

torch::nn::Sequential MakeMLPStage(const MLPStageOptions& o) {
  torch::nn::Linear linear(o.in, o.out);
  // LibTorch's own init draws from the process-wide generator, which other
  // threads use too; redraw from a private one seeded by `seed` (same
  // distribution as nn.Linear's default: U(-1/sqrt(in), 1/sqrt(in))).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(o.in));
  {
    at::NoGradGuard no_grad;
    linear->weight.uniform_(-bound, bound, gen);
    linear->bias.uniform_(-bound, bound, gen);
  }
  torch::nn::Sequential seq(linear);
  if (o.batchnorm) seq->push_back(torch::nn::BatchNorm1d(o.out));
  if (o.relu) seq->push_back(torch::nn::ReLU());
  return seq;
}

std::vector<at::Tensor> ModuleState(torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& p : module.parameters()) out.push_back(p.detach().clone());
  for (const auto& b : module.buffers()) out.push_back(b.detach().clone());
  return out;
}

c10::IValue ParameterRRefs(rpc::CallContext& ctx, torch::nn::Module& module) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (const auto& p : module.parameters()) list.push_back(ctx.agent->local_rref(p).ToIValue());
  return list;
}

absl::Status RegisterMLP(rpc::Registry& registry) {
  using Stage = torch::nn::SequentialImpl;
  RETURN_IF_ERROR(registry.RegisterModule<Stage>(
      MLPStageArgs::kFunction,
      [](rpc::CallContext&, const rpc::Args& a) {
        const auto r = rpc::DecodeCallOrThrow<MLPStageArgs>(a);
        MLPStageOptions o;
        o.in = r.in;
        o.out = r.out;
        o.seed = r.seed;
        o.relu = r.relu;
        o.batchnorm = r.batchnorm;
        if (o.in <= 0 || o.out <= 0) throw std::invalid_argument("MLPStage: sizes must be positive");
        return MakeMLPStage(o).ptr();
      },
      {{"forward",
        [](Stage& m, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
          at::Tensor x =
              rpc::TensorOrFetch(rpc::DecodeCallOrThrow<ModuleForwardArgs>(a).x);  // before taking the compute lane
          runtime::ComputeTurn compute;
          return m.forward(x);
        }},
       {"parameter_rrefs",
        [](Stage& m, rpc::CallContext& ctx, const rpc::Args&) -> c10::IValue { return ParameterRRefs(ctx, m); }},
       {"state",
        [](Stage& m, rpc::CallContext&, const rpc::Args&) -> c10::IValue {
          return c10::List<at::Tensor>(ModuleState(m));
        }},
       {"train", [](Stage& m, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
          m.train(rpc::DecodeCallOrThrow<ModuleTrainArgs>(a).on);
          return c10::IValue();
        }}}));
  return absl::OkStatus();
}

}  // namespace remora::shards
