// Distributed autograd state of one process: its contexts and what each
// recorded. Internal to autograd/; users see dist_autograd.h.
//
// Thread-safety: all classes here are safe to use from any thread.
// Ownership: the agent owns the container (as its AutogradHooks); contexts
// are shared by the container and whoever is working in them, and die when
// released and no backward pass uses them any more.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "base/lines.h"
#include "rpc/agent.h"
#include "rpc/autograd_hooks.h"

namespace remora::autograd {

// Where a received tensor came from: the sender and the message.
struct RecvInfo {
  base::WorkerId from = base::kUnknownWorker;
  int64_t message_id = 0;
  size_t index = 0;  // among the message's tensors that require grad
  size_t count = 0;  // how many the message carried
};

class DistContext {
 public:
  explicit DistContext(int64_t id) : id_(id) {}
  int64_t id() const { return id_; }

  void AddSend(int64_t message_id, std::vector<at::Tensor> tensors);
  // The tensors a send recorded, or nullopt for an unknown message.
  std::optional<std::vector<at::Tensor>> Send(int64_t message_id) const;
  // The same, forgetting them (a backward pass without retain_graph frees
  // what they hold); `*taken_before` tells a message already taken.
  std::optional<std::vector<at::Tensor>> TakeSend(int64_t message_id, bool* taken_before);
  void AddRecv(int64_t message_id, base::WorkerId from, const std::vector<at::Tensor>& tensors);
  std::optional<RecvInfo> Recv(const at::Tensor& tensor) const;
  // The same, forgetting the tensor (its gradient has been sent back); a
  // later pass that reaches it again finds it in RecvTaken.
  std::optional<RecvInfo> TakeRecv(const at::Tensor& tensor);
  // The sender of a taken tensor, or nullopt.
  std::optional<base::WorkerId> RecvTaken(const at::Tensor& tensor) const;

  void AccumulateGrad(const at::Tensor& leaf, const at::Tensor& grad);
  // Replaces the gradient of `leaf` (parallel/: the replicas' sum).
  void SetGradient(const at::Tensor& leaf, const at::Tensor& grad);
  std::vector<std::pair<at::Tensor, at::Tensor>> Gradients() const;
  at::Tensor Gradient(const at::Tensor& leaf) const;

 private:
  const int64_t id_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int64_t, std::vector<at::Tensor>> sends_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<int64_t> taken_sends_ ABSL_GUARDED_BY(mu_);
  // Keyed by TensorImpl; the tensor is kept so that the key stays unique.
  absl::flat_hash_map<const void*, std::pair<at::Tensor, RecvInfo>> recvs_ ABSL_GUARDED_BY(mu_);
  // Taken received tensors, held weakly: their storage is freed, and their
  // addresses cannot be reused while the context lives.
  absl::flat_hash_map<const void*, std::pair<c10::weak_intrusive_ptr<c10::TensorImpl>, base::WorkerId>>
      taken_recvs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<const void*, std::pair<at::Tensor, at::Tensor>> grads_ ABSL_GUARDED_BY(mu_);
};

class Container final : public rpc::AutogradHooks {
 public:
  Container(rpc::Agent* agent, base::LineSink notes) : agent_(agent), notes_(std::move(notes)) {}

  rpc::Agent& agent() const { return *agent_; }
  // Hands `line` to Enable's sink, once per `key` over the container's life.
  void NoteOnce(const std::string& key, std::string_view line);
  // Ids with this worker's id in bits 48 and up.
  int64_t NewContextId();
  int64_t NewMessageId();

  std::shared_ptr<DistContext> GetOrCreate(int64_t context_id);
  std::shared_ptr<DistContext> Find(int64_t context_id) const;
  void Release(int64_t context_id);
  int64_t size() const;

  // AutogradHooks.
  int64_t RecordSend(int64_t context_id, base::WorkerId dst, std::vector<at::Tensor> tensors) override;
  void RecordRecv(int64_t context_id, int64_t message_id, base::WorkerId from,
                  const std::vector<at::Tensor>& tensors) override;

 private:
  int64_t NextId();

  rpc::Agent* const agent_;
  const base::LineSink notes_;
  std::atomic<int64_t> counter_{0};
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int64_t, std::shared_ptr<DistContext>> contexts_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> noted_ ABSL_GUARDED_BY(mu_);
};

// The container installed on `agent`, or null.
Container* ContainerOf(rpc::Agent* agent);

// The local step of a backward pass: runs this process's graph from `roots`
// seeded with `grads`, accumulates leaf gradients in `context`, and sends
// the gradients of received tensors back to their senders. Completes when
// every worker downstream finished. `retain_graph` keeps the graph (here
// and downstream) for another pass. A pipeline action's pass (its root
// marked, runtime/action_mark.h) returns a future whose callbacks run on
// `callbacks`; null: inline, on the lane or the pool thread that completes
// it, for short bookkeeping only. Other passes' futures run them inline.
rpc::Future<rpc::Empty> RunBackward(Container& container, std::shared_ptr<DistContext> context,
                          std::vector<at::Tensor> roots, std::vector<at::Tensor> grads,
                          bool retain_graph, rpc::Executor* callbacks);

}  // namespace remora::autograd
