#include "ps/replica.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>

#include <ATen/TensorOperators.h>
#include <ATen/core/List.h>
#include <ATen/ops/zeros_like.h>

#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "pipeline/stage.h"
#include "rpc/agent.h"
#include "runtime/compute_lane.h"
#include "runtime/trace.h"

namespace remora::ps {
namespace {

std::atomic<int64_t> compute_delay_us{0};

// A copy of the model on a worker, and what it is called.
struct Replica {
  std::string where;  // "the replica on worker 'w1'"
  std::vector<std::unique_ptr<pipeline::StageModule>> stages;
  std::vector<at::Tensor> params;  // every stage's, in order
  pipeline::LossFn loss;
};

std::shared_ptr<Replica> MakeReplica(CallContext& ctx, const Args& a) {
  auto r = std::make_shared<Replica>();
  r->where = absl::StrCat("the parameter server's replica on worker '", ctx.agent->self().name, "'");
  auto specs = DecodeStages(a[0]);
  if (!specs.ok()) throw std::invalid_argument(absl::StrCat(r->where, ": ", specs.status().message()));
  auto loss = LossByName(a[1].toStringRef());
  if (!loss.ok()) throw std::invalid_argument(absl::StrCat(r->where, ": ", loss.status().message()));
  r->loss = std::move(*loss);
  for (const pipeline::StageSpec& spec : *specs) {
    const c10::Device device(spec.device.empty() ? ctx.agent->options().device : spec.device);
    auto stage = pipeline::BuildStage(spec, device);
    if (!stage.ok()) throw std::invalid_argument(absl::StrCat(r->where, ": ", stage.status().message()));
    for (const at::Tensor& p : (*stage)->Parameters()) r->params.push_back(p);
    r->stages.push_back(std::move(*stage));
  }
  if (r->params.empty()) throw std::invalid_argument(absl::StrCat(r->where, ": the model has no parameters"));
  return r;
}

// compute(params, inputs, targets, total_rows) -> (grads, weighted loss).
c10::IValue Compute(Replica& r, const Args& a) {
  if (const int64_t us = compute_delay_us.load(std::memory_order_relaxed); us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(us));  // --slow-ms, outside the lane
  }
  const std::vector<at::Tensor> params = a[0].toTensorVector();
  if (params.size() != r.params.size()) {
    throw std::invalid_argument(absl::StrCat(r.where, ": got ", params.size(), " parameters; the model has ",
                                             r.params.size()));
  }
  const double total_rows = static_cast<double>(a[3].toInt());
  ComputeTurn turn;
  trace::Scope scope("ps compute", -1);
  {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].sizes() != r.params[i].sizes()) {
        throw std::invalid_argument(absl::StrCat(r.where, ": parameter ", i, " is ", c10::str(params[i].sizes()),
                                                 "; the model's is ", c10::str(r.params[i].sizes())));
      }
      r.params[i].copy_(params[i]);
      r.params[i].mutable_grad() = at::Tensor();
    }
  }
  const c10::Device device = r.params[0].device();
  c10::IValue out = a[1].toTensor().to(device);
  const at::Tensor targets = a[2].toTensor().to(device);
  const double rows = static_cast<double>(a[1].toTensor().size(0));
  for (auto& stage : r.stages) stage->Train(true);
  for (auto& stage : r.stages) out = stage->Forward(out);
  at::Tensor loss = r.loss(out, targets) * (rows / total_rows);
  loss.backward();
  c10::List<at::Tensor> grads;
  for (at::Tensor& p : r.params) {
    at::Tensor g = p.grad().defined() ? p.grad() : at::zeros_like(p);
    grads.push_back(g.cpu());
    p.mutable_grad() = at::Tensor();
  }
  return c10::ivalue::Tuple::create({grads, loss.item<double>()});
}

}  // namespace

absl::StatusOr<pipeline::LossFn> LossByName(const std::string& name) {
  if (name == "mse") return pipeline::MseLoss();
  if (name == "cross_entropy") return pipeline::CrossEntropyLoss();
  return absl::InvalidArgumentError(absl::StrCat("unknown loss '", name, "' (mse or cross_entropy)"));
}

c10::IValue EncodeStages(const std::vector<pipeline::StageSpec>& stages) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (const auto& s : stages) {
    list.push_back(c10::ivalue::Tuple::create({s.kind, s.name, s.Payload(), s.device}));
  }
  return list;
}

absl::StatusOr<std::vector<pipeline::StageSpec>> DecodeStages(const c10::IValue& encoded) {
  std::vector<pipeline::StageSpec> specs;
  try {
    for (const c10::IValue& e : encoded.toListRef()) {
      const auto& t = e.toTupleRef().elements();
      if (t.size() != 4) throw std::invalid_argument("a stage is (kind, name, payload, device)");
      pipeline::StageSpec spec;
      if (t[0].toStringRef() == "script") {
        const at::Tensor b = t[2].toTensor().contiguous();
        spec = pipeline::StageSpec::TorchScript(
            std::string(static_cast<const char*>(b.data_ptr()), b.numel()), t[1].toStringRef());
      } else if (t[0].toStringRef() == "type") {
        std::vector<c10::IValue> args;
        for (const c10::IValue& v : t[2].toListRef()) args.push_back(v);
        spec = pipeline::StageSpec::Registered(t[1].toStringRef(), std::move(args));
      } else {
        throw std::invalid_argument(absl::StrCat("unknown stage kind '", t[0].toStringRef(), "'"));
      }
      spec.device = t[3].toStringRef();
      specs.push_back(std::move(spec));
    }
  } catch (...) {
    return StatusFromCurrentException("the parameter server's stage specs");
  }
  if (specs.empty()) return absl::InvalidArgumentError("the parameter server's model has no stages");
  return specs;
}

void SetComputeDelay(absl::Duration delay) {
  compute_delay_us.store(absl::ToInt64Microseconds(delay), std::memory_order_relaxed);
}

absl::Duration ComputeDelay() { return absl::Microseconds(compute_delay_us.load(std::memory_order_relaxed)); }

absl::Status RegisterFunctions(Registry& registry) {
  return registry.RegisterModule<Replica>(
      kReplicaType, MakeReplica,
      {{"compute", [](Replica& r, CallContext&, const Args& a) -> c10::IValue {
          try {
            return Compute(r, a);
          } catch (...) {
            absl::Status s = StatusFromCurrentException(absl::StrCat(r.where, ": computing gradients"));
            throw std::runtime_error(std::string(s.message()));
          }
        }},
       {"shapes", [](Replica& r, CallContext&, const Args&) -> c10::IValue {
          c10::impl::GenericList out(c10::ListType::ofInts());
          for (const at::Tensor& p : r.params) out.push_back(c10::List<int64_t>(p.sizes().vec()));
          return out;
        }}});
}

}  // namespace remora::ps
