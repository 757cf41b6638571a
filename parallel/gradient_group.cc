#include "parallel/gradient_group.h"

#include <algorithm>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

#include <ATen/ops/cat.h>
#include <c10/core/GradMode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "autograd/container.h"
#include "autograd/dist_autograd.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "optim/distributed_optimizer.h"
#include "optim/protocol.h"
#include "optim/state_dict.h"
#include "parallel/process_group.h"
#include "parallel/protocol.h"
#include "pipeline/runner.h"
#include "rpc/agent.h"
#include "runtime/compute_lane.h"
#include "trace/trace.h"

namespace remora::parallel {
namespace {

// One bucket in flight: its parameters, their gradients flattened (on the
// group's device: see Collectable), and the sum being computed.
struct Bucket {
  std::vector<at::Tensor> params;
  at::Tensor flat;
  Collective sum;
};

class GradientGroup final : public pipeline::StepParticipant,
                            public std::enable_shared_from_this<GradientGroup> {
 public:
  GradientGroup(rpc::Agent* agent, std::unique_ptr<ProcessGroup> group, int64_t bucket_bytes,
                bool overlap, std::map<int64_t, std::vector<at::Tensor>> stages)
      : agent_(agent),
        group_(std::move(group)),
        bucket_bytes_(bucket_bytes),
        overlap_(overlap),
        stages_(std::move(stages)) {}

  // ZeRO-1: the group's parameters are shared out among the ranks (whole
  // tensors, largest first, each to the least loaded rank: the same on
  // every rank); this rank keeps the optimizer state of its share only.
  void ShardOptimizer(const c10::impl::GenericDict& options) {
    std::vector<at::Tensor> all;
    for (const auto& [k, params] : stages_) all.insert(all.end(), params.begin(), params.end());
    std::vector<size_t> order(all.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&all](size_t a, size_t b) { return all[a].numel() > all[b].numel(); });
    const int size = group_->options().size;
    std::vector<int64_t> load(size, 0);
    std::vector<at::Tensor> mine;
    zero_owner_.assign(all.size(), 0);
    for (size_t i : order) {
      const int q = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      zero_owner_[i] = q;
      load[q] += all[i].numel();
    }
    for (size_t i = 0; i < all.size(); ++i) {
      if (zero_owner_[i] == group_->options().rank) mine.push_back(all[i]);
    }
    zero_params_ = std::move(all);
    if (!mine.empty()) zero_optimizer_ = optim::MakeOptimizer(options, std::move(mine));
    zero_ = true;
  }

  // ZeRO-1's checkpoint (a collective: every rank calls it): every rank's
  // share of the optimizer state, gathered on rank 0 into the state dict
  // of one optimizer over all the group's parameters (numbered in the
  // group's order: what a worker's own optimizer saves without ZeRO), kept
  // for save_state. One broadcast of each share's pickled state per rank.
  void Consolidate() {
    const int rank = group_->options().rank;
    const at::Tensor mine =
        optim::PickleBytes(zero_optimizer_ ? optim::OptimizerStateDict(*zero_optimizer_) : c10::IValue());
    std::vector<c10::IValue> shares(group_->options().size);
    for (int q = 0; q < group_->options().size; ++q) {
      at::Tensor length = at::zeros({1}, at::kLong);
      if (q == rank) length.fill_(mine.numel());
      at::Tensor n = Collectable(length);
      Check(group_->Broadcast(n, q));
      at::Tensor bytes = q == rank ? Collectable(mine) : Collectable(at::empty({n.cpu().item<int64_t>()}, at::kByte));
      Check(group_->Broadcast(bytes, q));
      if (rank == 0) shares[q] = optim::Unpickle(bytes.cpu());
    }
    if (rank != 0) return;
    c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
    c10::IValue group_options;
    std::vector<int64_t> next(shares.size(), 0);  // each share's next parameter
    for (size_t i = 0; i < zero_params_.size(); ++i) {
      const int q = zero_owner_[i];
      const int64_t j = next[q]++;
      if (shares[q].isNone()) continue;
      const auto share = shares[q].toGenericDict();
      if (group_options.isNone()) group_options = optim::OneParamGroup(shares[q], "consolidating ZeRO-1 shares");
      const auto share_state = share.at("state").toGenericDict();
      if (share_state.contains(j)) state.insert(static_cast<int64_t>(i), share_state.at(j));
    }
    consolidated_ = optim::OneGroupStateDict(state, group_options, static_cast<int64_t>(zero_params_.size()));
  }

  // save_state: the state Consolidate gathered (rank 0), once.
  c10::IValue SaveState() {
    if (consolidated_.isNone()) {
      throw std::logic_error("GradientGroup.save_state: only rank 0 after consolidate() holds the whole state");
    }
    return std::exchange(consolidated_, c10::IValue());
  }

  // load_state(state dict over all the group's parameters): this rank
  // keeps its share's.
  void LoadState(const c10::IValue& whole) {
    const auto d = whole.toGenericDict();
    const auto state = d.at("state").toGenericDict();
    const c10::impl::GenericDict group = optim::OneParamGroup(whole, "loading a ZeRO-1 group's state");
    const int64_t saved = static_cast<int64_t>(group.at("params").toListRef().size());
    if (saved != static_cast<int64_t>(zero_params_.size())) {
      throw std::invalid_argument(absl::StrCat("the checkpoint's optimizer state covers ", saved,
                                               " parameters; this ZeRO-1 group has ", zero_params_.size()));
    }
    if (!zero_optimizer_) return;  // no share here
    c10::impl::GenericDict share(c10::IntType::get(), c10::AnyType::get());
    int64_t j = 0;
    for (size_t i = 0; i < zero_params_.size(); ++i) {
      if (zero_owner_[i] != group_->options().rank) continue;
      if (state.contains(static_cast<int64_t>(i))) share.insert(j, state.at(static_cast<int64_t>(i)));
      ++j;
    }
    optim::LoadOptimizerStateDict(*zero_optimizer_, optim::OneGroupStateDict(share, group, j));
  }

  // `t` where the group's collectives take it: on this member's CUDA
  // device for an NCCL group (the stage's, where its tensors already are),
  // else in host memory, where Gloo's groups sum (a CUDA stage's tensors
  // are then staged through it).
  at::Tensor Collectable(const at::Tensor& t) const {
    return group_->on_device() ? t.to(c10::Device(c10::kCUDA, group_->options().cuda_device))
                               : t.cpu();
  }

  std::string Backend() const { return group_->on_device() ? "NCCL" : "Gloo"; }

  int64_t StateBytes() const {
    return zero_optimizer_ ? optim::StateBytes(*zero_optimizer_) : 0;
  }

  // Checks that every replica holds the same parameters (count, shapes,
  // dtypes), then copies rank 0's to all.
  void Synchronize() {
    std::vector<int64_t> sig = {0, 0, 0};
    uint64_t hash = 0;  // of shapes and types (unsigned: it wraps)
    for (const auto& [k, params] : stages_) {
      for (const at::Tensor& p : params) {
        sig[0] += 1;
        sig[1] += p.numel();
        for (int64_t d : p.sizes()) hash = hash * 1000003u + static_cast<uint64_t>(d);
        hash = hash * 31u + static_cast<uint64_t>(p.scalar_type());
      }
    }
    std::memcpy(&sig[2], &hash, sizeof(hash));
    at::Tensor mine = at::empty({3}, at::kLong);
    std::memcpy(mine.data_ptr<int64_t>(), sig.data(), sizeof(int64_t) * 3);
    at::Tensor broadcast = Collectable(mine);
    Check(group_->Broadcast(broadcast, 0));
    broadcast = broadcast.cpu();
    const int64_t* theirs = broadcast.data_ptr<int64_t>();
    if (!std::equal(sig.begin(), sig.end(), theirs)) {
      throw std::invalid_argument(absl::StrCat(
          "worker '", agent_->self().name, "' (", group_->Describe(), ") holds ", sig[0],
          " parameters of ", sig[1], " values; rank 0 holds ", theirs[0], " of ", theirs[1],
          (theirs[0] == sig[0] && theirs[1] == sig[1] ? " (of other shapes or types)" : ""),
          ": every replica must build the same stages"));
    }
    c10::NoGradGuard no_grad;
    for (auto& [k, params] : stages_) {
      for (at::Tensor& p : params) {
        at::Tensor copy = Collectable(p.detach().contiguous());
        Check(group_->Broadcast(copy, 0));
        if (copy.data_ptr() != p.data_ptr()) p.detach().copy_(copy);
      }
    }
  }

  void Begin(int64_t context, int64_t micro_batches) override {
    base::MutexLock lock(mu_);
    contexts_[context].micro_batches = micro_batches;
  }

  // From the backward hook: stage `stage`'s pass of one micro-batch is in.
  void OnBackward(int64_t context, int64_t stage) {
    if (!overlap_ || stages_.count(stage) == 0) return;
    base::MutexLock lock(mu_);
    auto it = contexts_.find(context);
    if (it == contexts_.end()) return;
    PerContext& c = it->second;
    if (++c.done[stage] == c.micro_batches) Launch(context, stage, c);
  }

  // pipeline::StepParticipant: the sum at the end of a step runner's
  // batch, and ZeRO-1's step after the runner's clipping.
  void Finish(int64_t context) override {
    const int64_t buckets = Sum(context, /*step=*/false);
    base::MutexLock lock(mu_);
    last_buckets_ = buckets;
  }
  void Step(int64_t context) override {
    auto dist = FindContext(context);
    if (zero_) StepShard(*dist);
  }
  bool Steps() const override { return zero_; }
  int64_t LastBuckets() const {
    base::MutexLock lock(mu_);
    return last_buckets_;
  }

  // Sums the context's gradients over the replicas (what has not started
  // yet starts now) and writes them into the context (ZeRO-1 with `step`:
  // then steps); returns the buckets.
  int64_t Sum(int64_t context, bool step = true) {
    PerContext c;
    {
      base::MutexLock lock(mu_);
      auto it = contexts_.find(context);
      if (it == contexts_.end()) {
        throw std::invalid_argument(absl::StrCat("finish: context ", context, " was not begun"));
      }
      // Stages in descending order: the order their last backward passes end.
      for (auto s = stages_.rbegin(); s != stages_.rend(); ++s) {
        if (!it->second.launched.count(s->first)) Launch(context, s->first, it->second);
      }
      c = std::move(it->second);
      contexts_.erase(it);
    }
    auto dist = FindContext(context);
    absl::Status status;
    for (Bucket& b : c.buckets) {
      status.Update(b.sum.Wait());
      if (!status.ok()) continue;
      int64_t offset = 0;
      for (const at::Tensor& p : b.params) {
        dist->SetGradient(p, b.flat.slice(0, offset, offset + p.numel()).view_as(p).to(p.device()));
        offset += p.numel();
      }
    }
    if (!status.ok()) {
      throw std::runtime_error(absl::StrCat("worker '", agent_->self().name, "': ", status.message()));
    }
    if (zero_ && step) StepShard(*dist);
    return static_cast<int64_t>(c.buckets.size());
  }

  // ZeRO-1's step: this rank steps its share with the summed gradients,
  // then every rank's share is copied to the others (one broadcast per
  // owner).
  void StepShard(const autograd::DistContext& context) {
    const int rank = group_->options().rank;
    if (zero_optimizer_) {
      runtime::ComputeTurn turn;
      trace::Scope scope("step", -1);
      for (size_t i = 0; i < zero_params_.size(); ++i) {
        if (zero_owner_[i] == rank) zero_params_[i].mutable_grad() = context.Gradient(zero_params_[i]);
      }
      zero_optimizer_->step();
      for (size_t i = 0; i < zero_params_.size(); ++i) {
        if (zero_owner_[i] == rank) zero_params_[i].mutable_grad() = at::Tensor();
      }
    }
    c10::NoGradGuard no_grad;
    for (int q = 0; q < group_->options().size; ++q) {
      std::vector<at::Tensor> owned;
      for (size_t i = 0; i < zero_params_.size(); ++i) {
        if (zero_owner_[i] == q) owned.push_back(zero_params_[i]);
      }
      if (owned.empty()) continue;
      std::vector<at::Tensor> flat_parts;
      for (const at::Tensor& p : owned) flat_parts.push_back(Collectable(p.detach().reshape({-1})));
      at::Tensor flat = at::cat(flat_parts);
      Check(group_->Broadcast(flat, q));
      if (q == rank) continue;
      int64_t offset = 0;
      for (const at::Tensor& p : owned) {
        p.detach().copy_(flat.slice(0, offset, offset + p.numel()).view_as(p));
        offset += p.numel();
      }
    }
  }

  void Discard(int64_t context) override {
    base::MutexLock lock(mu_);
    contexts_.erase(context);
  }

 private:
  struct PerContext {
    int64_t micro_batches = 0;
    std::map<int64_t, int64_t> done;  // stage -> backward passes in
    std::set<int64_t> launched;
    std::vector<Bucket> buckets;
  };

  static void Check(const absl::Status& s) {
    if (!s.ok()) throw std::runtime_error(std::string(s.message()));
  }

  std::shared_ptr<autograd::DistContext> FindContext(int64_t context) {
    auto* container = autograd::ContainerOf(agent_);
    std::shared_ptr<autograd::DistContext> c = container ? container->Find(context) : nullptr;
    if (!c) throw std::invalid_argument(absl::StrCat("unknown distributed autograd context ", context));
    return c;
  }

  // Starts summing stage `stage`'s gradients in `context`, bucket by bucket
  // (parameters in reverse order, as their gradients are made).
  void Launch(int64_t context, int64_t stage, PerContext& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    c.launched.insert(stage);
    auto dist = FindContext(context);
    const std::vector<at::Tensor>& params = stages_.at(stage);
    std::vector<at::Tensor> members, grads;
    int64_t bytes = 0;
    auto flush = [&] {
      if (members.empty()) return;
      Bucket b;
      b.params = std::move(members);
      b.flat = at::cat(grads);
      b.sum = group_->AllReduceSum(b.flat);
      c.buckets.push_back(std::move(b));
      members.clear();
      grads.clear();
      bytes = 0;
    };
    for (auto p = params.rbegin(); p != params.rend(); ++p) {
      const int64_t size = p->numel() * static_cast<int64_t>(p->element_size());
      if (!members.empty() && (bytes + size > bucket_bytes_ ||
                               p->scalar_type() != members.back().scalar_type())) {
        flush();
      }
      at::Tensor g = dist->Gradient(*p);
      // A parameter this replica's batch did not reach still takes part.
      grads.push_back(Collectable(g.defined() ? g.detach().reshape({-1})
                                              : at::zeros({p->numel()}, p->options())));
      members.push_back(*p);
      bytes += size;
    }
    flush();
  }

  rpc::Agent* agent_;
  const std::unique_ptr<ProcessGroup> group_;
  const int64_t bucket_bytes_;
  const bool overlap_;
  std::map<int64_t, std::vector<at::Tensor>> stages_;  // stage index -> parameters
  mutable absl::Mutex mu_;
  std::map<int64_t, PerContext> contexts_ ABSL_GUARDED_BY(mu_);
  int64_t last_buckets_ ABSL_GUARDED_BY(mu_) = 0;
  // ZeRO-1 (set before the group serves; read-only after): every parameter
  // of the group, its owning rank, this rank's optimizer over its share.
  bool zero_ = false;
  std::vector<at::Tensor> zero_params_;
  std::vector<int> zero_owner_;
  std::unique_ptr<torch::optim::Optimizer> zero_optimizer_;
  c10::IValue consolidated_;  // rank 0, between Consolidate and SaveState
};

// The CUDA device index of the group's parameters (all on the same one:
// an NCCL group has one device per member); -1 when on the CPU.
int CudaDeviceOf(const std::map<int64_t, std::vector<at::Tensor>>& stages,
                 const std::string& worker) {
  std::optional<c10::Device> device;
  for (const auto& [k, params] : stages) {
    for (const at::Tensor& p : params) {
      if (!device) device = p.device();
      if (p.device() != *device) {
        throw std::invalid_argument(absl::StrCat(
            "worker '", worker, "': a replicated stage's parameters are on ", device->str(), " and ",
            p.device().str(), "; the stages one worker hosts in a replica must share one device"));
      }
    }
  }
  if (!device || !device->is_cuda()) return -1;
  return device->has_index() ? device->index() : 0;
}

// The groups alive in this process, for the backward hook.
struct Groups {
  absl::Mutex mu;
  std::vector<std::weak_ptr<GradientGroup>> live ABSL_GUARDED_BY(mu);
};

Groups& TheGroups() {
  static Groups* groups = new Groups;  // never destroyed
  return *groups;
}

void OnMarkedBackward(int64_t context, const runtime::LaneAction& action) {
  std::vector<std::shared_ptr<GradientGroup>> groups;
  {
    Groups& g = TheGroups();
    base::MutexLock lock(g.mu);
    for (auto it = g.live.begin(); it != g.live.end();) {
      if (auto group = it->lock()) {
        groups.push_back(std::move(group));
        ++it;
      } else {
        it = g.live.erase(it);
      }
    }
  }
  for (auto& group : groups) group->OnBackward(context, action.stage);
}

// Makes a member of a gradient group (MakeGradientGroupRequest) and joins
// its process group.
std::shared_ptr<GradientGroup> MakeGradientGroup(rpc::CallContext& ctx, const rpc::Args& a) {
  const auto r = rpc::DecodeCallOrThrow<MakeGradientGroupRequest>(a);
  GroupOptions g;
  g.store_host = r.store_host;
  if (g.store_host.empty()) g.agent = ctx.agent;  // the master's keys, over the agents
  g.store_port = r.store_port;
  g.name = r.name;
  g.rank = r.rank;
  g.size = r.size;
  g.timeout = absl::Milliseconds(r.timeout_ms);
  std::map<int64_t, std::vector<at::Tensor>> stages;
  const std::vector<int64_t>& indices = r.stage_indices;
  const std::vector<c10::IValue>& lists = r.stage_params;
  if (indices.size() != lists.size()) {
    throw std::invalid_argument("GradientGroup: stage indices and parameter lists differ");
  }
  for (size_t i = 0; i < indices.size(); ++i) {
    stages[indices[i]] = optim::OwnedParameters(lists[i], "GradientGroup");
  }
  g.cuda_device = CudaDeviceOf(stages, ctx.worker_name());
  auto joined = ProcessGroup::Join(g);
  if (!joined.ok()) {
    throw std::runtime_error(absl::StrCat("worker '", ctx.worker_name(), "': ",
                                          joined.status().message()));
  }
  if (g.cuda_device >= 0 && !(*joined)->on_device() && g.rank == 0) {
    std::cerr << "remora: " << (*joined)->Describe() << ": the CUDA stages' gradients are "
              << "summed in host memory over Gloo ("
              << (HaveNcclGroups() ? "two members share a GPU, and NCCL needs one per member"
                                   : "this build's LibTorch has no NCCL groups")
              << ")\n";
  }
  if (r.zero && !r.optimizer_options.isGenericDict()) {
    throw std::invalid_argument(absl::StrCat(MakeGradientGroupRequest::kFunction,
                                             ": 'optimizer_options' must be a dict with 'zero', got a ",
                                             r.optimizer_options.tagKind()));
  }
  auto group = std::make_shared<GradientGroup>(ctx.agent, std::move(*joined), r.bucket_bytes, r.overlap,
                                               std::move(stages));
  group->Synchronize();
  if (r.zero) group->ShardOptimizer(r.optimizer_options.toGenericDict());
  Groups& all = TheGroups();
  base::MutexLock lock(all.mu);
  all.live.push_back(group);
  return group;
}

// The methods of a gradient group, by name.
std::map<std::string, rpc::Registry::TypedMethod<GradientGroup>> GroupMethods() {
  return {{GroupBeginRequest::kMethod,
           [](GradientGroup& g, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
             const auto r = rpc::DecodeCallOrThrow<GroupBeginRequest>(a);
             g.Begin(r.context, r.micro_batches);
             return c10::IValue();
           }},
          {GroupFinishRequest::kMethod,
           [](GradientGroup& g, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
             const int64_t context = rpc::DecodeCallOrThrow<GroupFinishRequest>(a).context;
             trace::Scope scope("allreduce", -1);
             return g.Sum(context);
           }},
          // Take part in that step runner's batches here (pipeline/runner.h);
          // the master stops calling begin and finish.
          {GroupAttachRequest::kMethod,
           [](GradientGroup& g, rpc::CallContext& ctx, const rpc::Args& a) -> c10::IValue {
             const int64_t runner = rpc::DecodeCallOrThrow<GroupAttachRequest>(a).runner;
             absl::Status s = pipeline::AttachToRunner(runner, g.shared_from_this());
             if (!s.ok()) {
               throw std::invalid_argument(absl::StrCat("worker '", ctx.worker_name(), "': ", s.message()));
             }
             return c10::IValue();
           }},
          {"last_buckets",
           [](GradientGroup& g, rpc::CallContext&, const rpc::Args&) -> c10::IValue { return g.LastBuckets(); }},
          {"backend",
           [](GradientGroup& g, rpc::CallContext&, const rpc::Args&) -> c10::IValue { return g.Backend(); }},
          {"state_bytes",
           [](GradientGroup& g, rpc::CallContext&, const rpc::Args&) -> c10::IValue { return g.StateBytes(); }},
          // ZeRO-1's checkpoints (checkpoint/checkpoint.h): consolidate() on
          // every rank, then save_state() on rank 0 gives the whole optimizer
          // state; load_state(that) on any rank keeps its share.
          {"consolidate",
           [](GradientGroup& g, rpc::CallContext&, const rpc::Args&) -> c10::IValue {
             g.Consolidate();
             return c10::IValue();
           }},
          {"save_state",
           [](GradientGroup& g, rpc::CallContext&, const rpc::Args&) -> c10::IValue { return g.SaveState(); }},
          {optim::LoadStateRequest::kMethod,
           [](GradientGroup& g, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
             g.LoadState(rpc::DecodeCallOrThrow<optim::LoadStateRequest>(a).state);
             return c10::IValue();
           }},
          {GroupDiscardRequest::kMethod, [](GradientGroup& g, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
             g.Discard(rpc::DecodeCallOrThrow<GroupDiscardRequest>(a).context);
             return c10::IValue();
           }}};
}

}  // namespace

absl::Status RegisterFunctions(rpc::Registry& registry) {
  autograd::SetMarkedBackwardHook(OnMarkedBackward);
  return registry.RegisterModule<GradientGroup>(MakeGradientGroupRequest::kFunction, MakeGradientGroup,
                                                GroupMethods());
}

}  // namespace remora::parallel
