// Checks of a request that need nothing but the group's membership. The
// agent runs them before it acts on a request, and the fuzz target
// (tests/fuzz) runs the same code on arbitrary bytes.
//
// Stateless; thread-safe.
#pragma once

#include <initializer_list>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "proto/agent.pb.h"
#include "proto/rref.pb.h"
#include "base/ids.h"

namespace remora::rpc {

// Whether a worker id belongs to the group.
using IsGroupMember = absl::FunctionRef<bool(base::WorkerId)>;

// The sender is a member of the group (PermissionDenied otherwise).
absl::Status CheckSender(const wire::Request& request, IsGroupMember member);

// Every id received in `what` (e.g. "fork request") names a member.
absl::Status CheckIds(const char* what, std::initializer_list<base::GloballyUniqueId> ids,
                      IsGroupMember member);

// The distributed autograd context a request claims, if any, was created by
// a member: its id carries the creator in bits 48 and up. Context id 0
// means none, and then a gradient message id makes no sense either.
absl::Status CheckContext(const wire::Request& request, IsGroupMember member);

// A call names a valid function or method, and a remote()'s result RRef id
// is valid (CheckResultRRef).
absl::Status CheckCall(const wire::CallRequest& call, base::WorkerId from);

// A remote()'s result RRef id is the caller's own (its creator and first
// user); OK for a call that is not a remote(). Once it is, the callee can
// keep even a refusal as that RRef's value.
absl::Status CheckResultRRef(const wire::CallRequest& call, base::WorkerId from);

}  // namespace remora::rpc
