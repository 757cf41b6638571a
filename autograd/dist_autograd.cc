#include "autograd/dist_autograd.h"

#include <iostream>
#include <map>
#include <optional>
#include <unordered_set>

#include <ATen/core/grad_mode.h>
#include <ATen/core/List.h>
#include <ATen/ops/ones_like.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "absl/strings/str_cat.h"
#include "autograd/container.h"
#include "autograd/protocol.h"
#include "autograd/split_backward.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "runtime/action_mark.h"
#include "runtime/allocator.h"
#include "runtime/compute_lane.h"
#include "trace/trace.h"

namespace remora::autograd {

// --- DistContext -------------------------------------------------------------

void DistContext::AddSend(int64_t message_id, std::vector<at::Tensor> tensors) {
  base::MutexLock lock(mu_);
  sends_[message_id] = std::move(tensors);
}

std::optional<std::vector<at::Tensor>> DistContext::Send(int64_t message_id) const {
  base::MutexLock lock(mu_);
  auto it = sends_.find(message_id);
  if (it == sends_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::vector<at::Tensor>> DistContext::TakeSend(int64_t message_id,
                                                             bool* taken_before) {
  base::MutexLock lock(mu_);
  auto it = sends_.find(message_id);
  *taken_before = it == sends_.end() && taken_sends_.contains(message_id);
  if (it == sends_.end()) return std::nullopt;
  std::vector<at::Tensor> out = std::move(it->second);
  sends_.erase(it);
  taken_sends_.insert(message_id);
  return out;
}

void DistContext::AddRecv(int64_t message_id, base::WorkerId from,
                          const std::vector<at::Tensor>& tensors) {
  base::MutexLock lock(mu_);
  for (size_t i = 0; i < tensors.size(); ++i) {
    recvs_[tensors[i].unsafeGetTensorImpl()] = {
        tensors[i], RecvInfo{from, message_id, i, tensors.size()}};
  }
}

std::optional<RecvInfo> DistContext::Recv(const at::Tensor& tensor) const {
  base::MutexLock lock(mu_);
  auto it = recvs_.find(tensor.unsafeGetTensorImpl());
  if (it == recvs_.end()) return std::nullopt;
  return it->second.second;
}

std::optional<RecvInfo> DistContext::TakeRecv(const at::Tensor& tensor) {
  base::MutexLock lock(mu_);
  auto it = recvs_.find(tensor.unsafeGetTensorImpl());
  if (it == recvs_.end()) return std::nullopt;
  RecvInfo info = it->second.second;
  taken_recvs_.try_emplace(
      it->first, c10::weak_intrusive_ptr<c10::TensorImpl>(tensor.getIntrusivePtr()), info.from);
  recvs_.erase(it);
  return info;
}

std::optional<base::WorkerId> DistContext::RecvTaken(const at::Tensor& tensor) const {
  base::MutexLock lock(mu_);
  auto it = taken_recvs_.find(tensor.unsafeGetTensorImpl());
  if (it == taken_recvs_.end()) return std::nullopt;
  return it->second.second;
}

void DistContext::AccumulateGrad(const at::Tensor& leaf, const at::Tensor& grad) {
  at::NoGradGuard no_grad;
  base::MutexLock lock(mu_);
  auto [it, inserted] = grads_.try_emplace(leaf.unsafeGetTensorImpl(), leaf, grad);
  if (!inserted) it->second.second = it->second.second + grad;
}

void DistContext::SetGradient(const at::Tensor& leaf, const at::Tensor& grad) {
  base::MutexLock lock(mu_);
  grads_.insert_or_assign(leaf.unsafeGetTensorImpl(), std::make_pair(leaf, grad));
}

std::vector<std::pair<at::Tensor, at::Tensor>> DistContext::Gradients() const {
  base::MutexLock lock(mu_);
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  out.reserve(grads_.size());
  for (const auto& [key, entry] : grads_) out.push_back(entry);
  return out;
}

at::Tensor DistContext::Gradient(const at::Tensor& leaf) const {
  base::MutexLock lock(mu_);
  auto it = grads_.find(leaf.unsafeGetTensorImpl());
  return it == grads_.end() ? at::Tensor() : it->second.second;
}

// --- Container -----------------------------------------------------------------

int64_t Container::NextId() {
  const int64_t worker = agent_->self().id;
  return (worker << 48) | (counter_.fetch_add(1) + 1);
}

int64_t Container::NewContextId() { return NextId(); }
int64_t Container::NewMessageId() { return NextId(); }

std::shared_ptr<DistContext> Container::GetOrCreate(int64_t context_id) {
  base::MutexLock lock(mu_);
  auto& slot = contexts_[context_id];
  if (!slot) slot = std::make_shared<DistContext>(context_id);
  return slot;
}

std::shared_ptr<DistContext> Container::Find(int64_t context_id) const {
  base::MutexLock lock(mu_);
  auto it = contexts_.find(context_id);
  return it == contexts_.end() ? nullptr : it->second;
}

void Container::Release(int64_t context_id) {
  agent_->forget_cuda_receives(context_id);  // its receives' failures, if any
  std::shared_ptr<DistContext> released;  // freed outside the lock
  base::MutexLock lock(mu_);
  auto it = contexts_.find(context_id);
  if (it == contexts_.end()) return;
  released = std::move(it->second);
  contexts_.erase(it);
}

int64_t Container::size() const {
  base::MutexLock lock(mu_);
  return contexts_.size();
}

int64_t Container::RecordSend(int64_t context_id, base::WorkerId dst,
                              std::vector<at::Tensor> tensors) {
  const int64_t message_id = NewMessageId();
  GetOrCreate(context_id)->AddSend(message_id, std::move(tensors));
  return message_id;
}

void Container::RecordRecv(int64_t context_id, int64_t message_id, base::WorkerId from,
                           const std::vector<at::Tensor>& tensors) {
  GetOrCreate(context_id)->AddRecv(message_id, from, tensors);
}

Container* ContainerOf(rpc::Agent* agent) {
  return agent == nullptr ? nullptr : dynamic_cast<Container*>(agent->autograd());
}

// --- the backward pass ---------------------------------------------------------

namespace {

// The leaves (parameters, received tensors) that gradients from `roots`
// reach, in a deterministic order.
std::vector<at::Tensor> CollectLeaves(const std::vector<at::Tensor>& roots) {
  std::vector<at::Tensor> leaves;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::unordered_set<const void*> seen_leaves;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& r : roots) {
    if (r.grad_fn()) {
      stack.push_back(r.grad_fn().get());
    } else if (r.requires_grad() && seen_leaves.insert(r.unsafeGetTensorImpl()).second) {
      leaves.push_back(r);
    }
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      if (seen_leaves.insert(acc->variable.unsafeGetTensorImpl()).second) {
        leaves.push_back(acc->variable);
      }
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
  return leaves;
}

// The local part of a backward pass, holding the compute turn: gradients of
// `leaves` from `roots`. The slice is labelled with the marked action.
absl::Status ComputeGradients(rpc::Agent& agent, const std::vector<at::Tensor>& roots,
                              const std::vector<at::Tensor>& grads,
                              const std::vector<at::Tensor>& leaves, bool retain_graph,
                              const std::optional<runtime::ActionMarkInfo>& mark,
                              std::vector<at::Tensor>* results) {
  if (mark) {
    trace::SetMicroBatch(mark->action.micro_batch, mark->stage);
  } else {
    trace::SetMicroBatch(-1);
  }
  const int64_t start_us = trace::NowUs();
  try {
    *results = torch::autograd::grad(roots, leaves, grads, retain_graph,
                                     /*create_graph=*/false, /*allow_unused=*/true);
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat("backward on worker '", agent.self().name, "'"));
  }
  // A mark deeper in the graph (models' own) may have told this thread more.
  trace::Record("backward", trace::MicroBatch(), start_us, trace::NowUs(), trace::Stage());
  return absl::OkStatus();
}

// Gradients of received tensors go back to their senders, per message;
// the others accumulate in the context.
rpc::Future<rpc::Empty> Deliver(rpc::Agent& agent, DistContext& context, const std::vector<at::Tensor>& leaves,
                      const std::vector<at::Tensor>& results, bool retain_graph) {
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (!results[i].defined()) continue;
    if (auto from = context.RecvTaken(leaves[i])) {
      return rpc::Future<rpc::Empty>::Ready(absl::FailedPreconditionError(absl::StrCat(
          "backward on worker '", agent.self().name, "' reached a tensor received from worker '",
          agent.NameOf(*from), "' whose gradient an earlier pass already sent back, freeing "
          "its graph there: Trying to backward through the graph a second time (run the "
          "earlier passes with retain_graph=true)")));
    }
  }
  std::map<std::pair<base::WorkerId, int64_t>, std::vector<at::Tensor>> outgoing;
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (!results[i].defined()) continue;
    // Without retain_graph no later pass can reach this tensor again: the
    // context lets go of it (under 1F1B that frees a micro-batch's input
    // as soon as its backward pass is through).
    if (auto recv = retain_graph ? context.Recv(leaves[i]) : context.TakeRecv(leaves[i])) {
      auto& grads_out = outgoing[{recv->from, recv->message_id}];
      grads_out.resize(recv->count);
      grads_out[recv->index] = results[i];
    } else {
      context.AccumulateGrad(leaves[i], results[i]);
    }
  }
  std::vector<rpc::Future<c10::IValue>> sent;
  for (auto& [key, grads_out] : outgoing) {
    // The receiver's backward queues its kernels behind the copies on the
    // GPU; whoever reads or applies the gradients settles first.
    sent.push_back(agent.rpc_async(agent.NameOf(key.first), PropagateRequest::kFunction,
                                   rpc::EncodeCall(PropagateRequest{context.id(), key.second, grads_out, retain_graph}),
                                   rpc::StreamOrdered(context.id())));
  }
  return rpc::WhenAll(sent);
}

// Hands a closure to an executor (see runtime::ComputeTurn::RunInTurn).
using Post = std::function<void(std::function<void()>)>;

// Runs `run`, one part of a split pass, as `name` in traces; its error
// names the worker.
template <typename Run>
auto RunPart(rpc::Agent& agent, const runtime::ActionMarkInfo& mark, const char* name, Run&& run) {
  trace::SetMicroBatch(mark.action.micro_batch, mark.stage);
  const int64_t start_us = trace::NowUs();
  auto result = run();
  trace::Record(name, trace::MicroBatch(), start_us, trace::NowUs(), trace::Stage());
  return result.ok() ? result
                     : decltype(result)(base::Annotate(result.status(), absl::StrCat("on worker '", agent.self().name,
                                                                              "'")));
}

// W, in its turn: accumulates the parameters' gradients in the context;
// `done` ends when that has and B's gradients are `delivered`.
void RunWeights(rpc::Agent& agent, const std::shared_ptr<DistContext>& context,
                const std::shared_ptr<SplitBackward>& pass, const std::vector<at::Tensor>& params,
                const runtime::ActionMarkInfo& mark, rpc::Future<rpc::Empty> done,
                const rpc::Future<rpc::Empty>& delivered) {
  absl::StatusOr<std::vector<at::Tensor>> dw = RunPart(agent, mark, "weight", [&pass] { return pass->Weights(); });
  if (!dw.ok()) {
    done.SetError(dw.status());
    return;
  }
  try {
    for (size_t i = 0; i < params.size(); ++i) {
      if ((*dw)[i].defined()) context->AccumulateGrad(params[i], (*dw)[i]);
    }
    // The pass's gradients are in the context now.
    if (MarkedBackwardHook hook = GetMarkedBackwardHook()) hook(context->id(), mark.action);
  } catch (...) {
    done.SetError(base::StatusFromCurrentException(
        absl::StrCat("adding W's gradients on worker '", agent.self().name, "'")));
    return;
  }
  delivered.then([done](const absl::StatusOr<rpc::Empty>& r) mutable {
    if (r.ok()) {
      done.SetValue(rpc::Empty{});
    } else {
      done.SetError(r.status());
    }
  });
}

// B, in its turn: computes the received tensors' gradients and sends them
// back, then puts W in its turn (or skips W's turn and fails `done`).
void RunInputs(rpc::Agent& agent, const std::shared_ptr<DistContext>& context,
               const std::shared_ptr<SplitBackward>& pass, const std::vector<at::Tensor>& received,
               std::vector<at::Tensor> params, bool retain_graph, const runtime::ActionMarkInfo& mark,
               rpc::Future<rpc::Empty> done, const Post& post) {
  absl::StatusOr<std::vector<at::Tensor>> dx = RunPart(agent, mark, "backward", [&pass, &mark] {
    std::optional<runtime::ScopedAllocationTag> held;  // (what B keeps for W, metered)
    if (mark.hold_tag >= 0) held.emplace(mark.hold_tag);
    return pass->Inputs();
  });
  if (dx.ok() && !pass->split()) {
    if (Container* c = ContainerOf(&agent)) {
      c->NoteOnce(absl::StrCat("whole ", mark.stage),
                  absl::StrCat("worker '", agent.self().name, "': ", mark.stage, "'s backward pass does not "
                               "split into B and W (", pass->why_not_split(), "): B runs it whole and W has "
                               "nothing left to do, so its weight gradients fill no bubble; said once"));
    }
  }
  std::optional<rpc::Future<rpc::Empty>> delivered;
  if (dx.ok()) {
    try {
      delivered = Deliver(agent, *context, received, *dx, retain_graph);
    } catch (...) {
      dx = base::StatusFromCurrentException(
          absl::StrCat("sending B's gradients from worker '", agent.self().name, "'"));
    }
  }
  if (!dx.ok()) {
    runtime::ComputeTurn::Skip(mark.action.Weight());
    done.SetError(dx.status());
    return;
  }
  // A failed delivery (a pass further back failed) fails the pass now, not
  // after W, whose turn may wait behind actions that the failure stopped.
  delivered->then([done](const absl::StatusOr<rpc::Empty>& r) mutable { if (!r.ok()) done.SetError(r.status()); });
  runtime::ComputeTurn::RunInTurn(
      mark.action.Weight(),
      [&agent, context, pass, params = std::move(params), mark, done, delivered = *std::move(delivered)]() mutable {
        RunWeights(agent, context, pass, params, mark, done, delivered);
      },
      post);
}

// A pipeline stage's backward pass split in two (autograd/split_backward.h),
// each part in its action's turn: B sends the received tensors' gradients
// back at once; W, later, accumulates the parameters' in the context. The
// future ends when both have and B's gradients are delivered.
rpc::Future<rpc::Empty> RunSplitBackward(rpc::Agent& agent, std::shared_ptr<DistContext> context,
                                         std::vector<at::Tensor> roots, std::vector<at::Tensor> grads,
                                         const std::vector<at::Tensor>& leaves, bool retain_graph,
                                         const runtime::ActionMarkInfo& mark, rpc::Executor* callbacks) {
  // (A received tensor whose gradient an earlier pass sent back is one
  // too: Deliver refuses it.)
  std::vector<at::Tensor> received, params;
  for (const at::Tensor& leaf : leaves) {
    (context->Recv(leaf) || context->RecvTaken(leaf) ? received : params).push_back(leaf);
  }
  auto pass = std::make_shared<SplitBackward>(std::move(roots), std::move(grads), received, params);
  rpc::Future<rpc::Empty> done(callbacks);
  rpc::Executor* executor = agent.lane();  // (every pass on one thread)
  Post post = [executor](std::function<void()> fn) { executor->Schedule(std::move(fn)); };
  runtime::ComputeTurn::RunInTurn(
      mark.action,
      [&agent, context, pass, received = std::move(received), params = std::move(params), retain_graph, mark, done,
       post]() mutable {
        RunInputs(agent, context, pass, received, std::move(params), retain_graph, mark, done, post);
      },
      post);
  return done;
}

}  // namespace

rpc::Future<rpc::Empty> RunBackward(Container& container, std::shared_ptr<DistContext> context,
                          std::vector<at::Tensor> roots, std::vector<at::Tensor> grads,
                          bool retain_graph, rpc::Executor* callbacks) {
  rpc::Agent& agent = container.agent();
  std::vector<at::Tensor> leaves = CollectLeaves(roots);
  if (leaves.empty()) return rpc::Future<rpc::Empty>::Ready(rpc::Empty{});
  // A pipeline stage's output carries its action: the pass then runs in the
  // schedule's order, without a thread waiting for its turn.
  std::optional<runtime::ActionMarkInfo> mark;
  if (!roots.empty()) mark = runtime::MarkedAction(roots[0]);
  if (!mark) {
    std::vector<at::Tensor> results;
    absl::Status status;
    {
      runtime::ComputeTurn compute;
      status = ComputeGradients(agent, roots, grads, leaves, retain_graph, mark, &results);
    }
    if (!status.ok()) return rpc::Future<rpc::Empty>::Ready(status);
    return Deliver(agent, *context, leaves, results, retain_graph);
  }
  if (mark->split) {
    return RunSplitBackward(agent, std::move(context), std::move(roots), std::move(grads), leaves, retain_graph,
                            *mark, callbacks);
  }
  rpc::Future<rpc::Empty> done(callbacks);
  rpc::Executor* executor = agent.lane();  // (every pass on one thread)
  runtime::ComputeTurn::RunInTurn(
      mark->action,
      [&agent, context, roots = std::move(roots), grads = std::move(grads),
       leaves = std::move(leaves), retain_graph, mark, done]() mutable {
        std::vector<at::Tensor> results;
        absl::Status status =
            ComputeGradients(agent, roots, grads, leaves, retain_graph, mark, &results);
        roots.clear();  // the graph is freed with the turn
        grads.clear();
        if (!status.ok()) {
          done.SetError(status);
          return;
        }
        rpc::Future<rpc::Empty> delivered = Deliver(agent, *context, leaves, results, retain_graph);
        // The pass's gradients are in the context now.
        if (MarkedBackwardHook hook = GetMarkedBackwardHook()) hook(context->id(), mark->action);
        delivered.then([done](const absl::StatusOr<rpc::Empty>& r) mutable {
              if (r.ok()) {
                done.SetValue(rpc::Empty{});
              } else {
                done.SetError(r.status());
              }
            });
      },
      [executor](std::function<void()> fn) { executor->Schedule(std::move(fn)); });
  return done;
}

// --- public API ---------------------------------------------------------------

namespace {

struct HookSlot {
  absl::Mutex mu;
  MarkedBackwardHook hook ABSL_GUARDED_BY(mu);
};

HookSlot& TheHook() {
  static HookSlot* slot = new HookSlot;  // never destroyed
  return *slot;
}

}  // namespace

void SetMarkedBackwardHook(MarkedBackwardHook hook) {
  HookSlot& slot = TheHook();
  base::MutexLock lock(slot.mu);
  slot.hook = std::move(hook);
}

MarkedBackwardHook GetMarkedBackwardHook() {
  HookSlot& slot = TheHook();
  base::MutexLock lock(slot.mu);
  return slot.hook;
}

void Enable(rpc::Agent& agent, base::LineSink notes) {
  agent.set_autograd(std::make_unique<Container>(&agent, std::move(notes)));
}

void Container::NoteOnce(const std::string& key, std::string_view line) {
  {
    base::MutexLock lock(mu_);
    if (!noted_.insert(key).second) return;
  }
  base::Say(notes_, line);
}

absl::Status CheckEnabled(const rpc::Agent& agent, const std::string& before) {
  if (dynamic_cast<const Container*>(agent.autograd()) != nullptr) return absl::OkStatus();
  const std::string who = agent.self().id == 0 ? absl::StrCat("the master (agent '", agent.self().name, "')")
                                                 : absl::StrCat("worker '", agent.self().name, "'");
  return absl::FailedPreconditionError(absl::StrCat(
      "distributed autograd is not enabled on ", who, ": call autograd::Enable(agent) (autograd/dist_autograd.h) "
      "after Agent::Start", before.empty() ? " and before Join()" : absl::StrCat(", before Join() and before ", before),
      "; launch::StartLocalGroup and launch::WorkerMain call it for the agents they start"));
}

namespace {

// The container of the agent that serves a call; throws CheckEnabled's
// error (inside a registered function: the caller's future fails with it).
Container& Require(rpc::Agent* agent) {
  Container* c = ContainerOf(agent);
  if (c == nullptr) {
    if (agent == nullptr) throw std::runtime_error("distributed autograd: the call has no agent");
    throw std::runtime_error(std::string(CheckEnabled(*agent).message()));
  }
  return *c;
}

// remora.autograd.propagate: the gradients of a message this process sent, from its receiver.
rpc::Future<c10::IValue> HandlePropagate(rpc::CallContext& ctx, const rpc::Args& args) {
  auto request = rpc::DecodeCallOrThrow<PropagateRequest>(args);
  Container& container = Require(ctx.agent);
  const int64_t context_id = request.context;
  const int64_t message_id = request.message;
  std::vector<at::Tensor> grads = std::move(request.grads);
  const bool retain_graph = request.retain_graph;
  auto context = container.Find(context_id);
  if (!context) throw std::invalid_argument(absl::StrCat("unknown distributed autograd context ", context_id));
  // Without retain_graph the pass frees the graph behind the sent
  // tensors, and the context lets go of them too.
  bool taken_before = false;
  auto sent = retain_graph ? context->Send(message_id)
                           : context->TakeSend(message_id, &taken_before);
  if (!sent && taken_before) {
    throw std::invalid_argument(absl::StrCat(
        "gradients for message ", message_id, " of context ", context_id,
        " came a second time, after the first pass freed its graph: Trying to backward "
        "through the graph a second time (run the earlier passes with retain_graph=true)"));
  }
  if (!sent) throw std::invalid_argument(absl::StrCat("context ", context_id, " recorded no message ", message_id));
  if (grads.size() != sent->size()) {
    throw std::invalid_argument(absl::StrCat("message ", message_id, " sent ", sent->size(),
                                             " tensors but ", grads.size(),
                                             " gradients came back"));
  }
  std::vector<at::Tensor> roots, seeds;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    if (!grads[i].sizes().equals((*sent)[i].sizes())) {
      throw std::invalid_argument("gradient shape does not match the sent tensor");
    }
    roots.push_back((*sent)[i]);
    // A gradient may come back on another device than the tensor
    // left from (device maps); autograd wants it on the tensor's.
    seeds.push_back(grads[i].to((*sent)[i].device()));
  }
  rpc::Future<c10::IValue> done(ctx.agent->executor());
  // A pass that is not a pipeline action's waits here for its turn on
  // the compute lane: not on a local link's reader (a prompt call).
  const bool waits = !roots.empty() && !runtime::MarkedAction(roots[0]).has_value();
  auto run = [&container, context, roots = std::move(roots), seeds = std::move(seeds), retain_graph,
              done]() mutable {
    // (Its callback only completes `done`, whose own callbacks run on the
    // pool: the ack leaves without a second trip through the pool's queue,
    // ahead of whatever the pass's end put there, as the batch's step.)
    RunBackward(container, context, std::move(roots), std::move(seeds), retain_graph, /*callbacks=*/nullptr)
        .then([done](const absl::StatusOr<rpc::Empty>& r) mutable {
          if (r.ok()) {
            done.SetValue(c10::IValue());
          } else {
            done.SetError(r.status());
          }
        });
  };
  if (ctx.prompt && waits) {
    ctx.agent->executor()->Schedule(std::move(run));
  } else {
    run();
  }
  return done;
}

}  // namespace

absl::Status RegisterFunctions(rpc::Registry& registry) {
  RETURN_IF_ERROR(registry.RegisterAsyncFunction(PropagateRequest::kFunction, HandlePropagate));
  // Its pass queues itself on the compute lane (see above).
  RETURN_IF_ERROR(registry.MarkPrompt(PropagateRequest::kFunction));
  RETURN_IF_ERROR(registry.RegisterFunction(
      ReleaseRequest::kFunction, [](rpc::CallContext& ctx, const rpc::Args& args) -> c10::IValue {
        const int64_t context = rpc::DecodeCallOrThrow<ReleaseRequest>(args).context;
        Require(ctx.agent).Release(context);
        return c10::IValue();
      }));
  RETURN_IF_ERROR(registry.RegisterFunction(
      "remora.autograd.num_contexts", [](rpc::CallContext& ctx, const rpc::Args&) -> c10::IValue {
        return Require(ctx.agent).size();
      }));
  return absl::OkStatus();
}

namespace {

// A fresh context id, or kNoContext when distributed autograd is not enabled.
int64_t NewIdOrNone(rpc::Agent& agent) {
  Container* container = ContainerOf(&agent);
  return container == nullptr ? rpc::kNoContext : container->NewContextId();
}

}  // namespace

Context::Context(rpc::Agent& agent)
    : agent_(agent), status_(CheckEnabled(agent)), id_(NewIdOrNone(agent)), current_(id_) {
  if (Container* container = ContainerOf(&agent)) container->GetOrCreate(id_);
}

Context::~Context() {
  Container* container = ContainerOf(&agent_);
  if (container == nullptr || id_ == rpc::kNoContext) return;
  container->Release(id_);
  std::vector<std::pair<std::string, rpc::Future<c10::IValue>>> releases;
  for (const auto& w : agent_.workers()) {
    if (w.id == agent_.self().id) continue;
    releases.emplace_back(w.name,
                          agent_.rpc_async(w.name, ReleaseRequest::kFunction, rpc::EncodeCall(ReleaseRequest{id_})));
  }
  for (auto& [name, f] : releases) {
    auto r = f.wait();
    // One retry: releasing is idempotent.
    if (!r.ok() && r.status().code() == absl::StatusCode::kUnavailable) {
      r = agent_.rpc_sync(name, ReleaseRequest::kFunction, rpc::EncodeCall(ReleaseRequest{id_}));
    }
    if (!r.ok()) {
      std::cerr << "remora: releasing autograd context " << id_ << " on worker '" << name
                << "' failed: " << r.status().message() << "\n";
    }
  }
}

rpc::Future<rpc::Empty> backward_async(rpc::Agent& agent, int64_t context_id,
                             const std::vector<at::Tensor>& roots, bool retain_graph) {
  Container* container = ContainerOf(&agent);
  if (container == nullptr) return rpc::Future<rpc::Empty>::Ready(CheckEnabled(agent, "backward"));
  auto context = container->Find(context_id);
  if (!context) {
    return rpc::Future<rpc::Empty>::Ready(absl::NotFoundError(
        absl::StrCat("backward: unknown distributed autograd context ", context_id)));
  }
  std::vector<at::Tensor> seeds;
  for (const auto& r : roots) {
    if (!r.requires_grad()) {
      return rpc::Future<rpc::Empty>::Ready(absl::InvalidArgumentError(
          "backward: a root does not require grad (was it computed inside the context?)"));
    }
    seeds.push_back(at::ones_like(r));
  }
  return RunBackward(*container, context, roots, std::move(seeds), retain_graph, agent.executor());
}

absl::Status backward(rpc::Agent& agent, int64_t context_id, const std::vector<at::Tensor>& roots,
                      bool retain_graph) {
  return backward_async(agent, context_id, roots, retain_graph).wait().status();
}

absl::StatusOr<std::vector<std::pair<at::Tensor, at::Tensor>>> get_gradients(
    rpc::Agent& agent, int64_t context_id) {
  Container* container = ContainerOf(&agent);
  if (container == nullptr) return CheckEnabled(agent);
  auto context = container->Find(context_id);
  if (!context) {
    return absl::NotFoundError(absl::StrCat("unknown distributed autograd context ", context_id));
  }
  RETURN_IF_ERROR(agent.settle_cuda_receives(context_id));
  return context->Gradients();
}

absl::StatusOr<at::Tensor> get_gradient(rpc::Agent& agent, int64_t context_id,
                                        const at::Tensor& parameter) {
  Container* container = ContainerOf(&agent);
  if (container == nullptr) return CheckEnabled(agent);
  auto context = container->Find(context_id);
  if (!context) {
    return absl::NotFoundError(absl::StrCat("unknown distributed autograd context ", context_id));
  }
  RETURN_IF_ERROR(agent.settle_cuda_receives(context_id));
  return context->Gradient(parameter);
}

absl::StatusOr<int64_t> NewContextId(rpc::Agent& agent) {
  Container* container = ContainerOf(&agent);
  if (container == nullptr) return CheckEnabled(agent);
  return container->NewContextId();
}

absl::Status EnsureContext(rpc::Agent& agent, int64_t context_id) {
  Container* container = ContainerOf(&agent);
  if (container == nullptr) return CheckEnabled(agent);
  container->GetOrCreate(context_id);
  return absl::OkStatus();
}

void ReleaseHere(rpc::Agent& agent, int64_t context_id) {
  if (Container* container = ContainerOf(&agent)) container->Release(context_id);
}

int64_t num_contexts(rpc::Agent& agent) {
  Container* container = ContainerOf(&agent);
  return container == nullptr ? 0 : container->size();
}

}  // namespace remora::autograd
