#include "examples/builtins.h"

#include <stdexcept>

#include <ATen/TensorOperators.h>
#include <ATen/core/Dict.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>

#include "absl/strings/str_cat.h"
#include "autograd/dist_autograd.h"
#include "base/status_util.h"
#include "checkpoint/checkpoint.h"
#include "shards/cnn.h"
#include "shards/mlp.h"
#include "shards/resnet.h"
#include "optim/distributed_optimizer.h"
#include "parallel/gradient_group.h"
#include "pipeline/stage.h"
#include "ps/replica.h"
#include "rpc/agent.h"
#include "rpc/rref_args.h"
#include "runtime/process_stats.h"
#include "runtime/trace.h"

namespace remora::examples {
namespace {

c10::IValue Value(absl::StatusOr<c10::IValue> v) {
  if (!v.ok()) throw std::runtime_error(std::string(v.status().message()));
  return std::move(*v);
}

struct Scale {
  double factor;
};

struct Affine {
  at::Tensor weight;  // [out, in]
  at::Tensor bias;    // [out]
};

}  // namespace

absl::Status RegisterBuiltins(Registry& r) {
  RETURN_IF_ERROR(r.RegisterFunction("add", [](CallContext&, const Args& a) -> c10::IValue {
    if (a[0].isTensor() || a[1].isTensor()) {
      return TensorOrFetch(a[0]) + TensorOrFetch(a[1]);
    }
    if (a[0].isInt() && a[1].isInt()) return a[0].toInt() + a[1].toInt();
    return a[0].toDouble() + a[1].toDouble();
  }));
  RETURN_IF_ERROR(r.RegisterFunction(
      "echo", [](CallContext&, const Args& a) -> c10::IValue { return a[0]; }));
  RETURN_IF_ERROR(r.RegisterFunction("sink", [](CallContext&, const Args& a) -> c10::IValue {
    return at::full({1}, static_cast<double>(a[0].toTensor().numel()));
  }));
  RETURN_IF_ERROR(r.RegisterFunction("device_of", [](CallContext&, const Args& a) -> c10::IValue {
    return TensorOrFetch(a[0]).device().str();
  }));
  RETURN_IF_ERROR(r.RegisterFunction("rref_stats", [](CallContext& ctx, const Args&) -> c10::IValue {
    RRefStats s = ctx.agent->rref_stats();
    c10::Dict<std::string, int64_t> d;
    d.insert("owners", s.owners);
    d.insert("forks", s.forks);
    d.insert("live_users", s.live_users);
    d.insert("pending_users", s.pending_users);
    d.insert("pending_children", s.pending_children);
    d.insert("pending_messages", s.pending_messages);
    return d;
  }));
  RETURN_IF_ERROR(r.RegisterFunction("process_stats", [](CallContext&, const Args&) -> c10::IValue {
    const runtime::ProcessStats s = runtime::ReadProcessStats();
    c10::Dict<std::string, int64_t> d;
    d.insert("pid", s.pid);
    d.insert("threads", s.threads);
    d.insert("fds", s.fds);
    d.insert("rss_kb", s.rss_kb);
    return d;
  }));
  RETURN_IF_ERROR(r.RegisterFunction("to_here", [](CallContext&, const Args& a) -> c10::IValue {
    auto rref = RRef::FromIValue(a[0]);
    if (!rref.ok()) throw std::invalid_argument(std::string(rref.status().message()));
    return Value(rref->to_here());
  }));
  RETURN_IF_ERROR(r.RegisterFunction("make_rref", [](CallContext& ctx, const Args& a) -> c10::IValue {
    return ctx.agent->local_rref(a[0]).ToIValue();
  }));
  RETURN_IF_ERROR(r.RegisterFunction("rref_add", [](CallContext&, const Args& a) -> c10::IValue {
    return TensorOrFetch(a[0]) + TensorOrFetch(a[1]);
  }));

  RETURN_IF_ERROR(r.RegisterFunction("trace_enable", [](CallContext&, const Args& a) -> c10::IValue {
    trace::Enable(a[0].toBool());
    return c10::IValue();
  }));
  // Slices recorded here since the last call: (name, micro_batch, start_us, end_us).
  RETURN_IF_ERROR(r.RegisterFunction("trace_collect", [](CallContext&, const Args&) -> c10::IValue {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const auto& s : trace::Drain()) {
      out.push_back(
          c10::ivalue::Tuple::create({s.name, s.micro_batch, s.start_us, s.end_us, s.stage}));
    }
    return out;
  }));
  RETURN_IF_ERROR(r.RegisterModule<Scale>(
      "Scale",
      [](CallContext&, const Args& a) {
        return std::make_shared<Scale>(Scale{a.size() > 0 ? a[0].toDouble() : 1.0});
      },
      {{"forward",
        [](Scale& s, CallContext&, const Args& a) -> c10::IValue {
          return TensorOrFetch(a[0]) * s.factor;
        }},
       {"factor", [](Scale& s, CallContext&, const Args&) -> c10::IValue { return s.factor; }}}));

  RETURN_IF_ERROR(r.RegisterModule<Affine>(
      "Affine",
      [](CallContext&, const Args& a) {
        const int64_t in = a[0].toInt(), out = a[1].toInt();
        if (in <= 0 || out <= 0) throw std::invalid_argument("Affine: sizes must be positive");
        auto gen = at::make_generator<at::CPUGeneratorImpl>(a.size() > 2 ? a[2].toInt() : 0);
        auto m = std::make_shared<Affine>();
        m->weight = at::randn({out, in}, gen, at::TensorOptions()) / std::sqrt(double(in));
        m->bias = at::zeros({out});
        return m;
      },
      {{"forward",
        [](Affine& m, CallContext&, const Args& a) -> c10::IValue {
          return at::matmul(TensorOrFetch(a[0]), m.weight.t()) + m.bias;
        }},
       {"weight", [](Affine& m, CallContext&, const Args&) -> c10::IValue { return m.weight; }}}));
  return absl::OkStatus();
}

absl::Status RegisterStockStageTypes() {
  // Once per process: tests start several agents in one.
  static const absl::Status status = [] {
    RETURN_IF_ERROR(pipeline::RegisterStageModule<torch::nn::SequentialImpl>(
        "MLPStage", [](const std::vector<c10::IValue>& a, c10::Device) {
          shards::MLPStageOptions o;
          o.in = a.at(0).toInt();
          o.out = a.at(1).toInt();
          o.seed = a.size() > 2 ? a[2].toInt() : 0;
          o.relu = a.size() > 3 ? a[3].toBool() : true;
          o.batchnorm = a.size() > 4 ? a[4].toBool() : false;
          if (o.in <= 0 || o.out <= 0) throw std::invalid_argument("MLPStage: sizes must be positive");
          return shards::MakeMLPStage(o).ptr();
        }));
    RETURN_IF_ERROR(pipeline::RegisterStageModule<shards::SmallCnnImpl>(
        "SmallCnn", [](const std::vector<c10::IValue>& a, c10::Device) {
          return std::make_shared<shards::SmallCnnImpl>(static_cast<int>(a.at(0).toInt()),
                                                        static_cast<int>(a.at(1).toInt()),
                                                        a.size() > 2 ? a[2].toInt() : 0);
        }));
    return pipeline::RegisterStageModule<shards::ResNetShardImpl>(
        "ResNetShard", [](const std::vector<c10::IValue>& a, c10::Device device) {
          return std::make_shared<shards::ResNetShardImpl>(
              static_cast<int>(a.at(0).toInt()), static_cast<int>(a.at(1).toInt()),
              a.size() > 2 ? a[2].toInt() : 0, device);
        });
  }();
  return status;
}

absl::Status RegisterStockWorker(Registry& registry) {
  RETURN_IF_ERROR(RegisterBuiltins(registry));
  RETURN_IF_ERROR(shards::RegisterMLP(registry));
  RETURN_IF_ERROR(shards::RegisterResNet(registry));
  RETURN_IF_ERROR(dist_autograd::RegisterFunctions(registry));
  RETURN_IF_ERROR(optim::RegisterFunctions(registry));
  RETURN_IF_ERROR(pipeline::RegisterFunctions(registry));
  RETURN_IF_ERROR(parallel::RegisterFunctions(registry));
  RETURN_IF_ERROR(checkpoint::RegisterFunctions(registry));
  RETURN_IF_ERROR(ps::RegisterFunctions(registry));
  return RegisterStockStageTypes();
}

}  // namespace remora::examples
