#include "ps/partitions.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <stdexcept>

#include <ATen/core/grad_mode.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/List.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_util.h"
#include "ps/protocol.h"
#include "runtime/compute_lane.h"

namespace remora::ps {
namespace {

int64_t Bytes(const at::Tensor& t) { return static_cast<int64_t>(t.numel() * t.element_size()); }

// A partition of the parameters, as one server holds it.
struct Partition {
  std::string where;  // "the parameter-server partition on worker 'w1'"
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  int64_t applied = 0;  // the last round applied
  // Round -> worker -> its gradients, not yet applied.
  std::map<int64_t, std::map<std::string, std::vector<at::Tensor>>> pending;
};

std::vector<at::Tensor> Copies(const std::vector<at::Tensor>& ts) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : ts) out.push_back(t.detach().cpu().clone());
  return out;
}

// Checks that `ts` match the partition's parameters' count and shapes.
void CheckShapes(const Partition& s, const std::vector<at::Tensor>& ts, const std::string& what) {
  if (ts.size() != s.params.size()) {
    throw std::invalid_argument(absl::StrCat(s.where, ": ", what, " holds ", ts.size(), " tensors for its ",
                                             s.params.size(), " parameters"));
  }
  for (size_t i = 0; i < ts.size(); ++i) {
    if (ts[i].sizes() != s.params[i].sizes()) {
      throw std::invalid_argument(absl::StrCat(s.where, ": ", what, "'s tensor ", i, " is ",
                                               c10::str(ts[i].sizes()), "; the parameter is ",
                                               c10::str(s.params[i].sizes())));
    }
  }
}

std::shared_ptr<Partition> MakePartition(rpc::CallContext& ctx, const rpc::Args& a) {
  auto s = std::make_shared<Partition>();
  s->where = absl::StrCat("the parameter-server partition on worker '", ctx.worker_name(), "'");
  const c10::Device device(ctx.agent->options().device);
  c10::NoGradGuard no_grad;
  const auto r = rpc::DecodeCallOrThrow<MakePartitionRequest>(a);
  for (const at::Tensor& t : r.params) {
    s->params.push_back(t.detach().to(device).clone().requires_grad_(true));
  }
  if (s->params.empty()) throw std::invalid_argument(absl::StrCat(s->where, ": no parameters"));
  if (!r.optimizer_options.isGenericDict()) {
    throw std::invalid_argument(absl::StrCat(s->where, ": 'optimizer_options' must be a dict, got a ",
                                             r.optimizer_options.tagKind()));
  }
  s->optimizer = optim::MakeOptimizer(r.optimizer_options.toGenericDict(), s->params);
  return s;
}

// PartitionPushRequest.
c10::IValue Push(Partition& s, const rpc::Args& a) {
  auto r = rpc::DecodeCallOrThrow<PartitionPushRequest>(a);
  if (r.round <= s.applied) return false;  // late: that round was applied without it
  CheckShapes(s, r.grads, absl::StrCat("the gradients of worker '", r.worker, "'"));
  s.pending[r.round][r.worker] = std::move(r.grads);
  return true;
}

// The gradients of `workers` for `round`, summed in that order and scaled:
// what a step applies.
std::vector<at::Tensor> Summed(Partition& s, int64_t round, const std::vector<std::string>& workers, double scale) {
  std::vector<at::Tensor> sum(s.params.size());
  auto& got = s.pending[round];
  for (const std::string& w : workers) {
    auto it = got.find(w);
    if (it == got.end()) {
      throw std::runtime_error(absl::StrCat(s.where, ": round ", round, " has no gradients from worker '",
                                            w, "'"));
    }
    for (size_t j = 0; j < sum.size(); ++j) sum[j] = sum[j].defined() ? sum[j] + it->second[j] : it->second[j];
  }
  c10::NoGradGuard no_grad;
  for (size_t j = 0; j < s.params.size(); ++j) {
    at::Tensor g = sum[j].to(s.params[j].device());
    sum[j] = scale == 1.0 ? g : g * scale;
  }
  return sum;
}

// PartitionNormRequest.
c10::IValue Norm(Partition& s, const rpc::Args& a) {
  const auto r = rpc::DecodeCallOrThrow<PartitionNormRequest>(a);
  double squared = 0;
  for (const at::Tensor& g : Summed(s, r.round, r.workers, r.scale)) {
    const double n = g.norm().item<double>();  // (in the gradient's dtype, as PyTorch's)
    squared += n * n;
  }
  return squared;
}

// PartitionApplyRequest.
c10::IValue Apply(Partition& s, const rpc::Args& a) {
  const auto r = rpc::DecodeCallOrThrow<PartitionApplyRequest>(a);
  const int64_t round = r.round;
  std::vector<at::Tensor> grads = Summed(s, round, r.workers, r.scale);
  runtime::ComputeTurn turn;
  c10::NoGradGuard no_grad;
  for (size_t j = 0; j < s.params.size(); ++j) {
    // (As clip_grad_norm_: the coefficient in the gradient's float.)
    s.params[j].mutable_grad() = r.clip == 1.0 ? grads[j] : grads[j] * static_cast<float>(r.clip);
  }
  s.optimizer->step();
  for (at::Tensor& p : s.params) p.mutable_grad() = at::Tensor();
  s.applied = round;
  s.pending.erase(s.pending.begin(), s.pending.upper_bound(round));
  return c10::IValue();
}

// PartitionLoadRequest.
c10::IValue Load(Partition& s, const rpc::Args& a) {
  const auto r = rpc::DecodeCallOrThrow<PartitionLoadRequest>(a);
  const std::vector<at::Tensor>& params = r.params;
  CheckShapes(s, params, "the saved parameters");
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) s.params[i].copy_(params[i]);
  if (r.optimizer) optim::LoadOptimizerState(*s.optimizer, *r.optimizer);
  s.pending.clear();
  return c10::IValue();
}

// Wraps a partition method: an exception's message names the partition.
rpc::Registry::TypedMethod<Partition> Named(const std::string& what, c10::IValue (*fn)(Partition&, const rpc::Args&)) {
  return [what, fn](Partition& s, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
    try {
      return fn(s, a);
    } catch (...) {
      throw std::runtime_error(
          std::string(base::StatusFromCurrentException(absl::StrCat(s.where, ": ", what)).message()));
    }
  };
}

}  // namespace

std::vector<std::vector<int64_t>> PartitionByBytes(const std::vector<int64_t>& bytes, int k) {
  std::vector<int64_t> order(bytes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return bytes[a] > bytes[b]; });
  std::vector<std::vector<int64_t>> out(k);
  std::vector<int64_t> load(k, 0);
  for (int64_t i : order) {
    const auto lightest = std::min_element(load.begin(), load.end()) - load.begin();
    out[lightest].push_back(i);
    load[lightest] += bytes[i];
  }
  for (auto& v : out) std::sort(v.begin(), v.end());
  return out;
}

at::Tensor PackPartitionStates(const std::vector<at::Tensor>& states) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("ps_shards", static_cast<int64_t>(states.size()));
  c10::impl::GenericList list(c10::AnyType::get());
  for (const at::Tensor& state : states) list.push_back(optim::Unpickle(state));
  d.insert("shards", list);
  return optim::PickleBytes(d);
}

namespace {

// A record read once: how many partitions' states it holds (0: a single
// server's own state) and where they are: a pickled dict
// ({"ps_shards": k, "shards": [...]}), or for records written before
// optimizer states were state dicts, a LibTorch archive holding
// "ps_shards" and "shard_<i>". Throws for bytes that are neither.
struct Record {
  int partitions = 0;
  c10::IValue dict;
  std::unique_ptr<torch::serialize::InputArchive> archive;
};

Record ReadRecord(const at::Tensor& bytes) {
  Record r;
  if (optim::IsModuleArchive(bytes)) {
    r.archive = std::make_unique<torch::serialize::InputArchive>();
    optim::ReadArchive(bytes, *r.archive);
    at::Tensor k;
    if (r.archive->try_read("ps_shards", k)) r.partitions = static_cast<int>(k.item<int64_t>());
    return r;
  }
  const c10::IValue v = optim::Unpickle(bytes);
  if (v.isGenericDict() && v.toGenericDict().contains("ps_shards")) {
    r.partitions = static_cast<int>(v.toGenericDict().at("ps_shards").toInt());
    r.dict = v;
  }
  return r;
}

// The record read; an empty one (0 partitions) for undefined or unreadable bytes.
Record ReadRecordOrNone(const at::Tensor& bytes) {
  if (!bytes.defined()) return Record{};
  try {
    return ReadRecord(bytes);
  } catch (...) {
    return Record{};
  }
}

}  // namespace

int SavedPartitions(const at::Tensor& record) { return ReadRecordOrNone(record).partitions; }

absl::StatusOr<std::vector<at::Tensor>> UnpackPartitionStates(const at::Tensor& record, int k) {
  const Record r = ReadRecordOrNone(record);
  const int saved = r.partitions;
  if (saved != k) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the checkpoint's optimizer state comes from ",
        saved == 0 ? std::string("a parameter server in the master (--ps-partitions 0 or 1)")
                   : absl::StrCat(saved, " parameter-server partitions (--ps-partitions ", saved, ")"),
        ", not ", k, " partitions: resume with --ps-partitions ", saved == 0 ? 1 : saved,
        " (the optimizer's state is split as the parameters are)"));
  }
  std::vector<at::Tensor> out(k);
  try {
    if (r.archive != nullptr) {
      for (int i = 0; i < k; ++i) r.archive->read(absl::StrCat("shard_", i), out[i]);
    } else {
      const c10::IValue partitions = r.dict.toGenericDict().at("shards");
      const c10::ArrayRef<c10::IValue> states = partitions.toListRef();
      if (static_cast<int>(states.size()) != k) throw std::invalid_argument("a record of the wrong length");
      for (int i = 0; i < k; ++i) out[i] = optim::PickleBytes(states[i]);
    }
  } catch (...) {
    return base::StatusFromCurrentException("reading the partitions' optimizer states");
  }
  return out;
}

absl::StatusOr<std::unique_ptr<PartitionSet>> PartitionSet::Create(rpc::Agent& agent, const std::vector<std::string>& servers,
                                                           const std::vector<at::Tensor>& params,
                                                           const optim::OptimizerOptions& optimizer) {
  std::vector<int64_t> bytes;
  for (const at::Tensor& p : params) bytes.push_back(Bytes(p));
  const auto parts = PartitionByBytes(bytes, static_cast<int>(servers.size()));
  std::vector<PartitionPlacement> placement(servers.size());
  std::vector<rpc::RRef> partitions;
  const c10::IValue options(optim::OptionsToDict(optimizer));  // (each partition's request holds a copy)
  for (size_t k = 0; k < servers.size(); ++k) {
    placement[k].server = servers[k];
    placement[k].params = parts[k];
    std::vector<at::Tensor> mine;
    for (int64_t i : parts[k]) {
      mine.push_back(params[i]);
      placement[k].bytes += bytes[i];
    }
    if (mine.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter server: ", servers.size(), " partitions for a model of ", params.size(),
          " parameter tensors leave server '", servers[k], "' none: give at most ", params.size(), " partitions"));
    }
    auto partition =
        agent.remote(servers[k], MakePartitionRequest::kFunction, rpc::EncodeCall(MakePartitionRequest{Copies(mine), options}));
    if (!partition.ok()) {
      return base::Annotate(partition.status(), absl::StrCat("parameter server: placing partition ", k, " on server '",
                                                   servers[k], "'"));
    }
    partitions.push_back(std::move(*partition));
  }
  // The first calls through the partitions may overtake their creation: the
  // server holds them until the partition exists, or fails them with the error
  // that refused it.
  auto set = std::unique_ptr<PartitionSet>(new PartitionSet(std::move(placement), std::move(partitions)));
  RETURN_IF_ERROR(set->CallAll("ping", {}, "building its partition").status());
  return set;
}


absl::StatusOr<std::vector<c10::IValue>> PartitionSet::CallAll(const std::string& method,
                                                           const std::vector<std::vector<c10::IValue>>& args,
                                                           const std::string& what, rpc::CallOptions options) const {
  std::vector<rpc::Future<c10::IValue>> calls;
  for (size_t k = 0; k < partitions_.size(); ++k) {
    calls.push_back(partitions_[k].rpc_async(method, args.empty() ? std::vector<c10::IValue>{} : args[k], options));
  }
  return rpc::WaitAll(calls, [&](size_t k) {
    return absl::StrCat("parameter server '", placement_[k].server, "' (partition ", k, ") failed ", what,
                        "; its parameters live there only, so the job cannot go on: restart it and resume "
                        "from the last checkpoint");
  });
}

absl::StatusOr<double> PartitionSet::GradNorm(int64_t round, const std::vector<std::string>& workers,
                                          double scale) const {
  const std::vector<c10::IValue> args = rpc::EncodeCall(PartitionNormRequest{round, workers, scale});
  ASSIGN_OR_RETURN(std::vector<c10::IValue> shares,
                   CallAll(PartitionNormRequest::kMethod, std::vector<std::vector<c10::IValue>>(partitions_.size(), args),
                           "taking its share of the gradients' norm"));
  double squared = 0;
  for (const c10::IValue& share : shares) squared += share.toDouble();  // (in partition order)
  return std::sqrt(squared);
}

absl::Status PartitionSet::Apply(int64_t round, const std::vector<std::string>& workers, double scale, double clip) {
  const std::vector<c10::IValue> args = rpc::EncodeCall(PartitionApplyRequest{round, workers, scale, clip});
  return CallAll(PartitionApplyRequest::kMethod, std::vector<std::vector<c10::IValue>>(partitions_.size(), args),
                 "applying the step")
      .status();
}

absl::StatusOr<std::vector<std::vector<at::Tensor>>> PartitionSet::Parameters() const {
  ASSIGN_OR_RETURN(std::vector<c10::IValue> got, CallAll("pull", {}, "sending its parameters"));
  std::vector<std::vector<at::Tensor>> out;
  for (size_t k = 0; k < got.size(); ++k) {
    out.push_back(got[k].toTensorVector());
    if (out.back().size() != placement_[k].params.size()) {
      return absl::DataLossError(absl::StrCat("parameter server '", placement_[k].server, "' sent ",
                                              out.back().size(), " parameters; its partition holds ",
                                              placement_[k].params.size()));
    }
  }
  return out;
}

absl::Status PartitionSet::Gather(std::vector<at::Tensor>& params) const {
  ASSIGN_OR_RETURN(auto partitions, Parameters());
  c10::NoGradGuard no_grad;
  for (size_t k = 0; k < partitions.size(); ++k) {
    for (size_t j = 0; j < partitions[k].size(); ++j) params[placement_[k].params[j]].copy_(partitions[k][j]);
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> PartitionSet::OptimizerState() const {
  ASSIGN_OR_RETURN(std::vector<c10::IValue> got, CallAll("optimizer_state", {}, "sending its optimizer state"));
  std::vector<at::Tensor> archives;
  for (const c10::IValue& v : got) archives.push_back(v.toTensor());
  return PackPartitionStates(archives);
}

absl::Status PartitionSet::Load(const std::vector<at::Tensor>& params, const at::Tensor& optimizer) {
  std::vector<at::Tensor> archives(partitions_.size());
  if (optimizer.defined()) {
    ASSIGN_OR_RETURN(archives, UnpackPartitionStates(optimizer, static_cast<int>(partitions_.size())));
  }
  std::vector<std::vector<c10::IValue>> args;
  for (size_t k = 0; k < partitions_.size(); ++k) {
    std::vector<at::Tensor> mine;
    for (int64_t i : placement_[k].params) mine.push_back(params[i]);
    PartitionLoadRequest load{Copies(mine), std::nullopt};
    if (archives[k].defined()) load.optimizer = archives[k];
    args.push_back(rpc::EncodeCall(load));
  }
  return CallAll(PartitionLoadRequest::kMethod, args, "loading the saved state").status();
}

absl::Status PartitionSet::Check() const {
  rpc::CallOptions o;
  o.timeout = absl::Seconds(4);
  return CallAll("ping", {}, "to answer", o).status();
}

absl::Status RegisterPartition(rpc::Registry& registry) {
  return registry.RegisterModule<Partition>(
      MakePartitionRequest::kFunction, MakePartition,
      {{"pull",
        Named("sending its parameters",
              [](Partition& s, const rpc::Args&) -> c10::IValue { return c10::List<at::Tensor>(Copies(s.params)); })},
       {PartitionPushRequest::kMethod, Named("taking gradients", Push)},
       {PartitionApplyRequest::kMethod, Named("applying a step", Apply)},
       {PartitionNormRequest::kMethod, Named("taking its share of the gradients' norm", Norm)},
       {"optimizer_state",
        Named("saving its optimizer state",
              [](Partition& s, const rpc::Args&) -> c10::IValue { return optim::SaveOptimizerState(*s.optimizer); })},
       {PartitionLoadRequest::kMethod, Named("loading the saved state", Load)},
       {"ping", Named("answering", [](Partition& s, const rpc::Args&) -> c10::IValue {
          return static_cast<int64_t>(s.params.size());
        })}});
}

}  // namespace remora::ps
