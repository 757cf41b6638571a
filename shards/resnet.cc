#include "shards/resnet.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

#include "absl/strings/str_cat.h"
#include "rpc/agent.h"
#include "base/status_util.h"
#include "rpc/rref_args.h"
#include "runtime/compute_lane.h"
#include "trace/trace.h"
#include "shards/mlp.h"
#include "shards/protocol.h"

namespace remora::shards {
namespace {

namespace nn = torch::nn;

nn::Conv2d Conv(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t pad) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(pad).bias(false));
}

class BottleneckImpl : public nn::Module {
 public:
  BottleneckImpl(int64_t inplanes, int64_t planes, int64_t stride) {
    conv1 = register_module("conv1", Conv(inplanes, planes, 1, 1, 0));
    bn1 = register_module("bn1", nn::BatchNorm2d(planes));
    conv2 = register_module("conv2", Conv(planes, planes, 3, stride, 1));
    bn2 = register_module("bn2", nn::BatchNorm2d(planes));
    conv3 = register_module("conv3", Conv(planes, planes * 4, 1, 1, 0));
    bn3 = register_module("bn3", nn::BatchNorm2d(planes * 4));
    if (stride != 1 || inplanes != planes * 4) {
      downsample = register_module(
          "downsample",
          nn::Sequential(Conv(inplanes, planes * 4, 1, stride, 0), nn::BatchNorm2d(planes * 4)));
    }
  }

  at::Tensor forward(const at::Tensor& x) {
    at::Tensor out = bn1(conv1(x)).relu_();
    out = bn2(conv2(out)).relu_();
    out = bn3(conv3(out));
    out = out + (downsample ? downsample->forward(x) : x);
    return out.relu_();
  }

  nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  nn::Sequential downsample{nullptr};
};
TORCH_MODULE(Bottleneck);

class StemImpl : public nn::Module {
 public:
  StemImpl() {
    conv1 = register_module("conv1", Conv(3, 64, 7, 2, 3));
    bn1 = register_module("bn1", nn::BatchNorm2d(64));
    pool = register_module("maxpool", nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(2).padding(1)));
  }
  at::Tensor forward(const at::Tensor& x) { return pool(bn1(conv1(x)).relu_()); }

  nn::Conv2d conv1{nullptr};
  nn::BatchNorm2d bn1{nullptr};
  nn::MaxPool2d pool{nullptr};
};
TORCH_MODULE(Stem);

class HeadImpl : public nn::Module {
 public:
  HeadImpl() { fc = register_module("fc", nn::Linear(2048, 1000)); }
  at::Tensor forward(const at::Tensor& x) { return fc(x.mean({2, 3})); }

  nn::Linear fc{nullptr};
};
TORCH_MODULE(Head);

// (inplanes, planes, stride) of Bottleneck block b (1..16).
std::tuple<int64_t, int64_t, int64_t> BottleneckShape(int b) {
  static const int kLayerStart[] = {1, 4, 8, 14, 17};
  static const int64_t kPlanes[] = {64, 128, 256, 512};
  int layer = 0;
  while (b >= kLayerStart[layer + 1]) ++layer;
  const int64_t planes = kPlanes[layer];
  const bool first = b == kLayerStart[layer];
  const int64_t inplanes = first ? (layer == 0 ? 64 : planes * 2) : planes * 4;
  const int64_t stride = first && layer > 0 ? 2 : 1;
  return {inplanes, planes, stride};
}

// torchvision's initialisation, from a generator private to the block.
void InitBlock(nn::Module& block, int64_t seed, int index) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000 + index);
  at::NoGradGuard no_grad;
  for (auto& m : block.modules(/*include_self=*/true)) {
    if (auto* conv = m->as<nn::Conv2d>()) {
      const auto& w = conv->weight;
      const double fan_out = static_cast<double>(w.size(0) * w.size(2) * w.size(3));
      w.normal_(0.0, std::sqrt(2.0 / fan_out), gen);
    } else if (auto* bn = m->as<nn::BatchNorm2d>()) {
      bn->weight.fill_(1.0);
      bn->bias.zero_();
    } else if (auto* fc = m->as<nn::Linear>()) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(fc->weight.size(1)));
      fc->weight.uniform_(-bound, bound, gen);
      fc->bias.uniform_(-bound, bound, gen);
    }
  }
}

// Identity in forward; in backward it tells the trace which micro-batch the
// backward pass running on this thread belongs to.
struct TraceMark : public torch::autograd::Function<TraceMark> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x,
                            int64_t micro_batch, std::string stage) {
    ctx->saved_data["mb"] = micro_batch;
    ctx->saved_data["stage"] = stage;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    trace::SetMicroBatch(ctx->saved_data["mb"].toInt(), ctx->saved_data["stage"].toStringRef());
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

// Where shards constructed by this call live: the agent's home device.
c10::Device HomeDevice(const rpc::CallContext& ctx) {
  return ctx.agent != nullptr ? c10::Device(ctx.agent->options().device) : c10::Device(c10::kCPU);
}

}  // namespace

ResNetShardImpl::ResNetShardImpl(int first, int last, int64_t seed, c10::Device device)
    : first_(first), last_(last), device_(device) {
  if (first < 0 || last > kResNetBlocks || first >= last) {
    throw std::invalid_argument(absl::StrCat("ResNetShard: blocks [", first, ", ", last,
                                             ") are not a range within [0, ", kResNetBlocks, ")"));
  }
  for (int b = first; b < last; ++b) {
    const std::string name = absl::StrCat("block", b);
    if (b == 0) {
      auto stem = register_module(name, Stem());
      blocks_.push_back(stem);
      forwards_.push_back([stem](const at::Tensor& x) mutable { return stem->forward(x); });
    } else if (b == kResNetBlocks - 1) {
      auto head = register_module(name, Head());
      blocks_.push_back(head);
      forwards_.push_back([head](const at::Tensor& x) mutable { return head->forward(x); });
    } else {
      auto [inplanes, planes, stride] = BottleneckShape(b);
      auto block = register_module(name, Bottleneck(inplanes, planes, stride));
      blocks_.push_back(block);
      forwards_.push_back([block](const at::Tensor& x) mutable { return block->forward(x); });
    }
    InitBlock(*blocks_.back(), seed, b);
  }
  if (!device_.is_cpu()) to(device_);
}

at::Tensor ResNetShardImpl::ForwardBlock(size_t i, const at::Tensor& x) { return forwards_[i](x); }

at::Tensor ResNetShardImpl::forward(at::Tensor x) {
  if (x.device() != device_) x = x.to(device_);  // differentiable: gradients go back
  for (auto& f : forwards_) x = f(x);
  return x;
}

std::vector<int> TutorialSplit() { return {0, 8, kResNetBlocks}; }

absl::Status RegisterResNet(rpc::Registry& registry) {
  return registry.RegisterModule<ResNetShardImpl>(
      ResNetShardArgs::kFunction,
      [](rpc::CallContext& ctx, const rpc::Args& a) {
        const auto r = rpc::DecodeCallOrThrow<ResNetShardArgs>(a);
        const c10::Device device = r.device.empty() ? HomeDevice(ctx) : c10::Device(r.device);
        return std::make_shared<ResNetShardImpl>(static_cast<int>(r.first), static_cast<int>(r.last), r.seed,
                                                 device);
      },
      {{"forward",
        [](ResNetShardImpl& m, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
          const auto r = rpc::DecodeCallOrThrow<ModuleForwardArgs>(a);
          const int64_t mb = r.micro_batch;
          at::Tensor x = rpc::TensorOrFetch(r.x);  // before taking the compute lane
          runtime::ComputeTurn compute;
          const std::string stage = absl::StrCat("blocks [", m.first(), ", ", m.last(), ")");
          trace::Scope scope("forward", mb, stage);
          at::Tensor y = m.forward(x);
          if (trace::Enabled() && y.requires_grad()) y = TraceMark::apply(y, mb, stage);
          return y;
        }},
       {"parameter_rrefs",
        [](ResNetShardImpl& m, rpc::CallContext& ctx, const rpc::Args&) -> c10::IValue {
          return ParameterRRefs(ctx, m);
        }},
       {"num_parameters", [](ResNetShardImpl& m, rpc::CallContext&, const rpc::Args&) -> c10::IValue {
          int64_t n = 0;
          for (const auto& p : m.parameters()) n += p.numel();
          return n;
        }}});
}

}  // namespace remora::shards
