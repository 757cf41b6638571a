// The seam between the RPC layer and distributed autograd (autograd/).
//
// The RPC layer knows nothing about gradients. It asks these hooks to record
// a send when a message leaving this process carries tensors that require
// grad inside a distributed autograd context, and a recv when such a message
// arrives. It also carries the current context across processes: a request
// handled here runs with the caller's context as this thread's current
// context, so nested calls belong to it too.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "base/ids.h"

namespace remora::rpc {

inline constexpr int64_t kNoContext = -1;

class AutogradHooks {
 public:
  virtual ~AutogradHooks() = default;
  // `tensors` (requiring grad, in message order) leave for `dst` in context
  // `context_id`. Returns the message id of the recorded send.
  virtual int64_t RecordSend(int64_t context_id, base::WorkerId dst,
                             std::vector<at::Tensor> tensors) = 0;
  // `tensors` (requiring grad, in message order) arrived from `from` in
  // message `message_id` of context `context_id`.
  virtual void RecordRecv(int64_t context_id, int64_t message_id, base::WorkerId from,
                          const std::vector<at::Tensor>& tensors) = 0;
};

// This thread's current distributed autograd context, or kNoContext.
int64_t CurrentContextId();

// Sets this thread's current context for its scope, then restores it.
class ContextIdGuard {
 public:
  explicit ContextIdGuard(int64_t context_id);
  ~ContextIdGuard();
  ContextIdGuard(const ContextIdGuard&) = delete;
  ContextIdGuard& operator=(const ContextIdGuard&) = delete;

 private:
  int64_t previous_;
};

}  // namespace remora::rpc
