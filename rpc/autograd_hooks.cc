#include "rpc/autograd_hooks.h"

namespace remora::rpc {
namespace {
thread_local int64_t current_context = kNoContext;
}  // namespace

int64_t CurrentContextId() { return current_context; }

ContextIdGuard::ContextIdGuard(int64_t context_id) : previous_(current_context) {
  current_context = context_id;
}

ContextIdGuard::~ContextIdGuard() { current_context = previous_; }

}  // namespace remora::rpc
