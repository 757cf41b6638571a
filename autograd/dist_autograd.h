// Distributed autograd: backward across processes, as PyTorch's
// torch.distributed.autograd does it (FAST mode).
//
//   autograd::Enable(*agent);                  // every process, before Join()
//   {
//     autograd::Context context(*agent);       // with dist_autograd.context()
//     at::Tensor out = stage2.rpc_sync("forward", {stage1.remote("forward", {x})})->toTensor();
//     at::Tensor loss = mse(out, target);
//     autograd::backward(*agent, context.id(), {loss});
//     optimizer.step(context.id());
//   }                                               // released on every worker
//
// Inside a context, every call whose arguments or result carry tensors that
// require grad records a send/recv pair on both sides (also to_here()
// fetches). backward() runs the local graph from the roots; gradients that
// reach a received tensor travel back to its sender as a message keyed by
// the recorded message id, and the sender continues from there. Gradients
// of leaves (parameters) accumulate in the context on each worker, never in
// .grad: read them with get_gradients() on that worker. Micro-batches of one
// context may run backward concurrently; their gradients sum.
#pragma once

#include <cstdint>
#include <vector>

#include <functional>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "base/lines.h"
#include "rpc/agent.h"
#include "runtime/compute_lane.h"

namespace remora::autograd {

// Installs distributed autograd on `agent`. Call after Agent::Start and
// before Join() on every participant. launch::StartLocalGroup does it for
// its master and launch::WorkerMain for a worker; a master made with
// Agent::Start (a cluster's) must call it itself. `notes`: where the
// engine's notes go, each said once (a stage whose backward pass does not
// split into B and W under a zero-bubble schedule); none by default.
void Enable(rpc::Agent& agent, base::LineSink notes = {});

// OK when Enable(agent) was called; else FailedPrecondition naming the
// agent ("the master (agent 'master')" or "worker 'w1'") and what to call,
// `before` saying what needs it ("making a trainer"). What a trainer or a
// pipeline checks up front, so that a master that forgot Enable gets this
// error where it starts, not later in a step.
absl::Status CheckEnabled(const rpc::Agent& agent, const std::string& before = "");

// Registers the functions distributed autograd calls on peers
// (remora.autograd.*). Every participant's registry needs them.
absl::Status RegisterFunctions(rpc::Registry& registry);

// A distributed autograd context, current on this thread for its scope.
// Context ids carry the creating worker's id in bits 48 and up. Destroying
// it releases the context on every worker of the group (best effort,
// retried); release errors are logged, not raised. Never throws: on an
// agent without Enable() it holds no context (id() is kNoContext, calls
// inside it record nothing) and status() says so (CheckEnabled), as does
// backward() with its id.
//
// Thread-safety: current on the thread that made it; id() and status()
// from any thread. Ownership: borrows the agent, which must outlive it.
class Context {
 public:
  explicit Context(rpc::Agent& agent);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int64_t id() const { return id_; }
  // OK, or why there is no context (distributed autograd not enabled).
  const absl::Status& status() const { return status_; }

 private:
  rpc::Agent& agent_;
  absl::Status status_;
  int64_t id_;
  rpc::ContextIdGuard current_;
};

// For code that drives a context's lifetime itself (the pipeline's step
// protocol, pipeline/runner.h): a fresh context id of this process, with no
// state created anywhere (CheckEnabled's error without Enable); the context
// on this process (created if absent); and releasing it on this process
// only (no message).
absl::StatusOr<int64_t> NewContextId(rpc::Agent& agent);
absl::Status EnsureContext(rpc::Agent& agent, int64_t context_id);
void ReleaseHere(rpc::Agent& agent, int64_t context_id);

// Runs backward from `roots` (each seeded with ones) in context
// `context_id`, across every worker the gradients reach. Returns when all
// of them finished; an error names the worker that failed and its message.
// As in PyTorch, each worker frees the graph it ran (its saved activations)
// unless `retain_graph`. A pass that reaches one graph twice (a tensor sent
// in two messages of one context) needs retain_graph = true, and so does a
// pass that another pass over the same graph follows.
absl::Status backward(rpc::Agent& agent, int64_t context_id, const std::vector<at::Tensor>& roots,
                      bool retain_graph = false);
rpc::Future<rpc::Empty> backward_async(rpc::Agent& agent, int64_t context_id,
                             const std::vector<at::Tensor>& roots, bool retain_graph = false);

// Parameter -> accumulated gradient, on this worker, for `context_id`.
absl::StatusOr<std::vector<std::pair<at::Tensor, at::Tensor>>> get_gradients(
    rpc::Agent& agent, int64_t context_id);

// The accumulated gradient of `parameter` (undefined when none).
absl::StatusOr<at::Tensor> get_gradient(rpc::Agent& agent, int64_t context_id,
                                        const at::Tensor& parameter);

// Contexts alive on this worker (zero after training, when all released).
int64_t num_contexts(rpc::Agent& agent);

// Called on this process after a backward pass marked with a pipeline
// action (runtime/action_mark.h) has added its gradients to context
// `context_id`, on the thread that ran it; must not block (parallel/
// launches the replicas' gradient all-reduce from here). One per process;
// an empty function removes it. Thread-safe.
using MarkedBackwardHook = std::function<void(int64_t context_id, const runtime::LaneAction& action)>;
void SetMarkedBackwardHook(MarkedBackwardHook hook);
MarkedBackwardHook GetMarkedBackwardHook();

}  // namespace remora::autograd
