#include "ps/replica.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/List.h>
#include <ATen/ops/zeros_like.h>

#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "pipeline/microbatch.h"
#include "pipeline/recompute.h"
#include "pipeline/stage.h"
#include "pipeline/worker_data.h"
#include "ps/protocol.h"
#include "ps/partitions.h"
#include "rpc/agent.h"
#include "runtime/compute_lane.h"
#include "trace/trace.h"

namespace remora::ps {
namespace {

std::atomic<int64_t> compute_delay_us{0};

// A copy of the model on a worker, and what it is called.
struct Replica {
  std::string where;  // "the replica on worker 'w1'"
  std::vector<std::unique_ptr<pipeline::StageModule>> stages;
  std::vector<at::Tensor> params;  // every stage's, in order
  pipeline::LossFn loss;
  // With --ps-partitions: the partitions (ps/partitions.h) and each one's parameter
  // indices; empty when the server sends the parameters with each call.
  std::vector<rpc::RRef> partitions;
  std::vector<std::vector<int64_t>> partition_params;
  bool bf16 = false;  // each stage under bf16 autocast, bf16 between them
};

std::shared_ptr<Replica> MakeReplica(rpc::CallContext& ctx, const rpc::Args& a) {
  auto r = std::make_shared<Replica>();
  r->where = absl::StrCat("the parameter server's replica on worker '", ctx.worker_name(), "'");
  const auto request = rpc::DecodeCallOrThrow<MakeReplicaRequest>(a);
  auto specs = DecodeStageList(request.stages);
  if (!specs.ok()) throw std::invalid_argument(absl::StrCat(r->where, ": ", specs.status().message()));
  auto loss = LossByName(request.loss);
  if (!loss.ok()) throw std::invalid_argument(absl::StrCat(r->where, ": ", loss.status().message()));
  r->loss = std::move(*loss);
  r->bf16 = request.bf16;
  for (const pipeline::StageSpec& spec : *specs) {
    const c10::Device device(spec.device.empty() ? ctx.agent->options().device : spec.device);
    auto stage = pipeline::BuildStage(spec, device);
    if (!stage.ok()) throw std::invalid_argument(absl::StrCat(r->where, ": ", stage.status().message()));
    for (const at::Tensor& p : (*stage)->Parameters()) r->params.push_back(p);
    r->stages.push_back(std::move(*stage));
  }
  if (r->params.empty()) throw std::invalid_argument(absl::StrCat(r->where, ": the model has no parameters"));
  if (!request.partitions.empty()) {
    for (const c10::IValue& v : request.partitions) {
      auto rref = rpc::RRef::FromIValue(v);
      if (!rref.ok()) throw std::invalid_argument(absl::StrCat(r->where, ": ", rref.status().message()));
      r->partitions.push_back(std::move(*rref));
    }
    for (const c10::IValue& v : request.partition_params) {
      if (!v.isIntList()) {
        throw std::invalid_argument(absl::StrCat(r->where, ": a partition's parameter indices are a ", v.tagKind(),
                                                 ", not a list of ints"));
      }
      r->partition_params.push_back(v.toIntVector());
    }
    size_t count = 0;
    for (const auto& indices : r->partition_params) {
      for (int64_t i : indices) {
        if (i < 0 || i >= static_cast<int64_t>(r->params.size())) {
          throw std::invalid_argument(absl::StrCat(r->where, ": a partition holds parameter ", i, " of ",
                                                   r->params.size()));
        }
      }
      count += indices.size();
    }
    if (r->partitions.size() != r->partition_params.size() || count != r->params.size()) {
      throw std::invalid_argument(absl::StrCat(r->where, ": ", r->partitions.size(), " partitions holding ", count,
                                               " parameters for a model of ", r->params.size()));
    }
  }
  return r;
}

void SlowDown() {
  if (const int64_t us = compute_delay_us.load(std::memory_order_relaxed); us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(us));  // --slow-ms, outside the lane
  }
}

// Copies `params` into the replica, runs the forward and backward passes on
// `inputs` with the loss weighted by their rows over `total_rows`, and
// returns the gradients (CPU) and the weighted loss.
std::pair<std::vector<at::Tensor>, double> Gradients(Replica& r, const std::vector<at::Tensor>& params,
                                                    const at::Tensor& inputs, const at::Tensor& targets,
                                                    int64_t total_rows) {
  if (params.size() != r.params.size()) {
    throw std::invalid_argument(absl::StrCat(r.where, ": got ", params.size(), " parameters; the model has ",
                                             r.params.size()));
  }
  runtime::ComputeTurn turn;
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
  c10::IValue out = inputs.to(device);
  for (auto& stage : r.stages) stage->Train(true);
  for (auto& stage : r.stages) {
    if (!r.bf16) {
      out = stage->Forward(out);
      continue;
    }
    // (As a pipeline's bf16 stages: train::LocalTrainer does the same.)
    {
      pipeline::Bf16Autocast autocast(true);
      out = stage->Forward(pipeline::ToFloat32(out));
    }
    out = pipeline::ToBf16(out);
  }
  at::Tensor loss = r.loss(pipeline::ToFloat32(out), targets.to(device)) *
                    pipeline::RowsShare(inputs.size(0), static_cast<double>(total_rows));
  loss.backward();
  std::vector<at::Tensor> grads;
  for (at::Tensor& p : r.params) {
    at::Tensor g = p.grad().defined() ? p.grad() : at::zeros_like(p);
    grads.push_back(g.cpu());
    p.mutable_grad() = at::Tensor();
  }
  return {std::move(grads), loss.item<double>()};
}

// A call's share of the batch: the inputs and targets it carries, or the
// rows this worker reads itself (pipeline::WorkerRows; targets None).
std::pair<at::Tensor, at::Tensor> Share(Replica& r, rpc::CallContext& ctx, const c10::IValue& inputs,
                                        const c10::IValue& targets) {
  std::optional<pipeline::WorkerRows> rows = pipeline::WorkerRowsFrom(inputs);
  if (!rows) return {inputs.toTensor(), targets.toTensor()};
  absl::StatusOr<data::Batch> b = pipeline::ReadRows(ctx.worker_name(), rows->source, rows->rows, rows->epoch);
  if (!b.ok()) throw std::runtime_error(absl::StrCat(r.where, ": ", b.status().message()));
  if (b->labels.size(0) == 0) {
    throw std::runtime_error(absl::StrCat(r.where, ": none of its ", rows->rows.numel(), " rows could be read"));
  }
  return {b->images, b->labels};
}

// ComputeRequest -> ComputeReply.
c10::IValue Compute(Replica& r, rpc::CallContext& ctx, const rpc::Args& a) {
  const auto request = rpc::DecodeCallOrThrow<ComputeRequest>(a);
  SlowDown();
  auto [inputs, targets] = Share(r, ctx, request.inputs, request.targets);
  auto [grads, loss] = Gradients(r, request.params, inputs, targets, request.total_rows);
  return rpc::EncodeTuple(ComputeReply{std::move(grads), loss});
}

// Waits for every partition's reply to `calls`; an error names the server.
std::vector<c10::IValue> WaitForPartitions(Replica& r, std::vector<rpc::Future<c10::IValue>>& calls,
                                       const std::string& what) {
  std::vector<c10::IValue> out;
  for (size_t k = 0; k < calls.size(); ++k) {
    auto got = calls[k].wait();
    if (!got.ok()) {
      throw std::runtime_error(absl::StrCat(r.where, ": ", what, " parameter server '", r.partitions[k].owner_name(),
                                            "': ", got.status().message()));
    }
    out.push_back(*got);
  }
  return out;
}

// ComputePartitionedRequest -> ComputeReply (no gradients): pulls the
// parameters from every partition, computes, and pushes each partition the
// gradients of its parameters for the round.
c10::IValue ComputePartitioned(Replica& r, rpc::CallContext& ctx, const rpc::Args& a) {
  const auto request = rpc::DecodeCallOrThrow<ComputePartitionedRequest>(a);
  if (r.partitions.empty()) throw std::invalid_argument(absl::StrCat(r.where, ": it has no partitions to pull from"));
  SlowDown();
  std::vector<rpc::Future<c10::IValue>> pulls;
  for (const rpc::RRef& partition : r.partitions) pulls.push_back(partition.rpc_async("pull"));
  const std::vector<c10::IValue> pulled = WaitForPartitions(r, pulls, "pulling the parameters from");
  std::vector<at::Tensor> params(r.params.size());
  for (size_t k = 0; k < pulled.size(); ++k) {
    const std::vector<at::Tensor> part = pulled[k].toTensorVector();
    if (part.size() != r.partition_params[k].size()) {
      throw std::runtime_error(absl::StrCat(r.where, ": parameter server '", r.partitions[k].owner_name(), "' sent ",
                                            part.size(), " parameters; its partition holds ",
                                            r.partition_params[k].size()));
    }
    for (size_t j = 0; j < part.size(); ++j) params[r.partition_params[k][j]] = part[j];
  }
  auto [inputs, targets] = Share(r, ctx, request.inputs, request.targets);
  auto [grads, loss] = Gradients(r, params, inputs, targets, request.total_rows);
  std::vector<rpc::Future<c10::IValue>> pushes;
  for (size_t k = 0; k < r.partitions.size(); ++k) {
    PartitionPushRequest push{request.round, ctx.worker_name(), {}};
    for (int64_t i : r.partition_params[k]) push.grads.push_back(grads[i]);
    pushes.push_back(r.partitions[k].rpc_async(PartitionPushRequest::kMethod, rpc::EncodeCall(push)));
  }
  WaitForPartitions(r, pushes, "pushing the gradients to");
  return rpc::EncodeTuple(ComputeReply{{}, loss});
}

// A compute method whose exception names the replica.
rpc::Registry::TypedMethod<Replica> Computing(c10::IValue (*fn)(Replica&, rpc::CallContext&, const rpc::Args&)) {
  return [fn](Replica& r, rpc::CallContext& ctx, const rpc::Args& a) -> c10::IValue {
    try {
      return fn(r, ctx, a);
    } catch (...) {
      absl::Status s = base::StatusFromCurrentException(absl::StrCat(r.where, ": computing gradients"));
      throw std::runtime_error(std::string(s.message()));
    }
  };
}

}  // namespace

absl::StatusOr<pipeline::LossFn> LossByName(const std::string& name) {
  if (pipeline::LossFn loss = pipeline::LossFn::Named(name)) return loss;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown loss '", name, "' (mse, cross_entropy, or one registered with pipeline::RegisterLoss)"));
}

c10::IValue EncodeStages(const std::vector<pipeline::StageSpec>& stages) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (const auto& s : stages) list.push_back(rpc::EncodeTuple(StageSpecValue{s.kind, s.name, s.Payload(), s.device}));
  return list;
}

absl::StatusOr<std::vector<pipeline::StageSpec>> DecodeStages(const c10::IValue& encoded) {
  if (!encoded.isList()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the parameter server's stage specs: a ", encoded.tagKind(), ", not a list"));
  }
  return DecodeStageList(encoded.toListRef());
}

absl::StatusOr<std::vector<pipeline::StageSpec>> DecodeStageList(c10::ArrayRef<c10::IValue> encoded) {
  std::vector<pipeline::StageSpec> specs;
  try {
    for (const c10::IValue& e : encoded) {
      absl::StatusOr<StageSpecValue> t = rpc::DecodeTuple<StageSpecValue>(e);
      if (!t.ok()) return base::Annotate(t.status(), "the parameter server's stage specs");
      pipeline::StageSpec spec;
      if (t->kind == "script" && t->payload.isTensor()) {
        const at::Tensor b = t->payload.toTensor().contiguous();
        spec = pipeline::StageSpec::TorchScript(std::string(static_cast<const char*>(b.data_ptr()), b.numel()),
                                                t->name);
      } else if (t->kind == "type" && t->payload.isList()) {
        spec = pipeline::StageSpec::Registered(t->name, t->payload.toListRef().vec());
      } else {
        throw std::invalid_argument(absl::StrCat("unknown stage kind '", t->kind, "' (with a ",
                                                 t->payload.tagKind(), ")"));
      }
      spec.device = t->device;
      specs.push_back(std::move(spec));
    }
  } catch (...) {
    return base::StatusFromCurrentException("the parameter server's stage specs");
  }
  if (specs.empty()) return absl::InvalidArgumentError("the parameter server's model has no stages");
  return specs;
}

void SetComputeDelay(absl::Duration delay) {
  compute_delay_us.store(absl::ToInt64Microseconds(delay), std::memory_order_relaxed);
}

absl::Duration ComputeDelay() { return absl::Microseconds(compute_delay_us.load(std::memory_order_relaxed)); }

absl::Status RegisterFunctions(rpc::Registry& registry) {
  RETURN_IF_ERROR(RegisterPartition(registry));
  return registry.RegisterModule<Replica>(
      MakeReplicaRequest::kFunction, MakeReplica,
      {{ComputeRequest::kMethod, Computing(Compute)},
       {ComputePartitionedRequest::kMethod, Computing(ComputePartitioned)},
       {"shapes", [](Replica& r, rpc::CallContext&, const rpc::Args&) -> c10::IValue {
          c10::impl::GenericList out(c10::ListType::ofInts());
          for (const at::Tensor& p : r.params) out.push_back(c10::List<int64_t>(p.sizes().vec()));
          return out;
        }}});
}

}  // namespace remora::ps
