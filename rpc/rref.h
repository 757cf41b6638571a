// RRef: a reference to a value that lives on one worker (PyTorch's RRef).
//
// An RRef names a value owned by one worker. The owner holds the value (or
// a pending value, or the error that creating it raised); every other
// process that holds the RRef holds one fork of it, and the owner frees the
// value when the last fork is gone. RRefs come from Agent::remote(),
// Agent::local_rref() and RRef::remote(), or arrive as call arguments;
// pass one on by putting it in a call's arguments (the receiver gets its
// own fork). The reference counting protocol is PyTorch's; it lives in
// rpc/rref_context.h, internal to rpc/.
//
//   RRef m = agent->remote("worker1", "Linear", {4, 2}).value();
//   auto y = m.rpc_sync("forward", {x});      // runs on worker1
//   at::Tensor w = m.to_here()->toTensor();   // a copy of the value (here: no)
//
// Thread-safety: an RRef may be copied and used from any thread. Ownership:
// copies share one fork; the owner is told when the last copy in this
// process is gone.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/rref_interface.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/ids.h"
#include "rpc/future.h"

namespace remora::rpc {

class Agent;
class RRefContext;

// Common base of owner and user RRefs; what an RRef IValue holds.
class RRefImpl : public c10::RRefInterface {
 public:
  RRefImpl(base::WorkerId owner, std::string owner_name, base::RRefId id,
           std::weak_ptr<RRefContext> ctx)
      : owner_(owner), owner_name_(std::move(owner_name)), rref_id_(id),
        weak_ctx_(std::move(ctx)) {}

  const base::RRefId& rref_id() const { return rref_id_; }
  c10::worker_id_t owner() const override { return owner_; }
  std::string ownerName() const override { return owner_name_; }
  const c10::TypePtr type() const override;
  // The agent this RRef belongs to; null once that agent stopped.
  Agent* agent() const;

 private:
  const base::WorkerId owner_;
  const std::string owner_name_;
  const base::RRefId rref_id_;
  const std::weak_ptr<RRefContext> weak_ctx_;
};

// Counts of the RRef tables; all zero on a worker with nothing outstanding.
struct RRefStats {
  int64_t owners = 0;            // owner RRefs reachable by other processes
  int64_t forks = 0;             // forks recorded on this owner
  int64_t live_users = 0;        // user RRefs alive in this process
  int64_t pending_users = 0;     // users waiting for the owner's confirmation
  int64_t pending_children = 0;  // forks sent, not yet accepted
  int64_t pending_messages = 0;  // control messages in flight
  int64_t waiting_requests = 0;  // calls and fetches waiting on an owner here
};

// Per-call options.
struct CallOptions {
  // Zero means the agent's rpc_timeout.
  absl::Duration timeout = absl::ZeroDuration();
  // Nonzero (0: none): CUDA tensors of the call that go GPU to GPU reach the callee's
  // handler before their copy has completed, and LibTorch's stream there
  // (the default one) waits for it on the GPU instead of the receiving
  // thread on the host. Only for handlers that queue their CUDA work on
  // that stream and call Agent::settle_cuda_receives(stream_group) before
  // the host reads a result (the pipeline's pushes and distributed
  // autograd's gradients, grouped by the batch's context id).
  int64_t stream_group = 0;
};

// CallOptions whose CUDA tensors are stream-ordered in `group` (nonzero).
inline CallOptions StreamOrdered(int64_t group) {
  CallOptions options;
  options.stream_group = group;
  return options;
}

// A reference to a value that lives on a worker.
//
// Copies refer to the same fork: the owner is told when the last copy in
// this process is gone. Pass an RRef to a call by putting it in the
// arguments (it converts to an IValue); the receiver gets its own fork.
class RRef {
 public:
  RRef() = default;
  explicit RRef(c10::intrusive_ptr<RRefImpl> impl) : impl_(std::move(impl)) {}

  // The RRef an IValue argument holds; an error when it holds none.
  static absl::StatusOr<RRef> FromIValue(const c10::IValue& value);

  bool valid() const { return static_cast<bool>(impl_); }
  bool is_owner() const { return impl_->isOwner(); }
  // The owner's name and id.
  std::string owner_name() const { return impl_->ownerName(); }
  base::WorkerId owner() const { return impl_->owner(); }
  const base::RRefId& id() const { return impl_->rref_id(); }
  // True once the owner confirmed this user (always true on the owner).
  bool confirmed_by_owner() const { return impl_->confirmedByOwner(); }
  // Waits until the owner confirmed this user: OK once the value exists
  // there, or the error that creating it raised (a remote() whose function
  // failed). OK at once on the owner. Surfaces a failed remote() before any
  // call is made on it.
  absl::Status WaitConfirmed() const;

  // Fetches a copy of the value (waits on the owner until it exists). On
  // the owner, returns the value itself. A creation error is returned here.
  absl::StatusOr<c10::IValue> to_here(CallOptions options = {}) const;
  Future<c10::IValue> to_here_async(CallOptions options = {}) const;
  // The value itself; only on the owner.
  absl::StatusOr<c10::IValue> local_value() const;

  // Runs registered method `method` of the module this RRef holds, on its
  // owner (PyTorch's rref.rpc_sync().method(...)).
  absl::StatusOr<c10::IValue> rpc_sync(const std::string& method,
                                       std::vector<c10::IValue> args = {},
                                       CallOptions options = {}) const;
  Future<c10::IValue> rpc_async(const std::string& method,
                                std::vector<c10::IValue> args = {},
                                CallOptions options = {}) const;
  // Same, with the result kept on the owner as a new RRef.
  absl::StatusOr<RRef> remote(const std::string& method,
                              std::vector<c10::IValue> args = {},
                              CallOptions options = {}) const;

  c10::IValue ToIValue() const;
  operator c10::IValue() const { return ToIValue(); }  // NOLINT: pass as an arg

  // Internal (rpc/rref_context.h holds the concrete kinds).
  const c10::intrusive_ptr<RRefImpl>& impl() const { return impl_; }

 private:
  // to_here(_async): `blocking` waits for the reply on this thread (on a
  // stream, as rpc_sync does) and returns a completed future.
  Future<c10::IValue> Fetch(CallOptions options, bool blocking) const;

  c10::intrusive_ptr<RRefImpl> impl_;
};

}  // namespace remora::rpc
