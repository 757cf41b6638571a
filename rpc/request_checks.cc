#include "rpc/request_checks.h"

#include "absl/strings/str_cat.h"
#include "rpc/rref_context.h"

namespace remora::rpc {

absl::Status CheckSender(const wire::Request& request, IsGroupMember member) {
  if (request.from() > base::kUnknownWorker || !member(static_cast<base::WorkerId>(request.from()))) {
    return absl::PermissionDeniedError(
        absl::StrCat("request from unknown worker id ", request.from()));
  }
  return absl::OkStatus();
}

absl::Status CheckIds(const char* what, std::initializer_list<base::GloballyUniqueId> ids,
                      IsGroupMember member) {
  for (const base::GloballyUniqueId& id : ids) {
    if (!member(id.worker)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": id ", id.ToString(),
                                                     " names worker id ", id.worker,
                                                     ", which is not in the group"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckContext(const wire::Request& request, IsGroupMember member) {
  if (!request.has_autograd()) return absl::OkStatus();
  // The creator releases a context everywhere; one that no member created
  // would never be released.
  const int64_t id = request.autograd().context_id();
  const int64_t creator = id >> 48;
  if (id == 0) {
    if (request.autograd().message_id() == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown distributed autograd context id 0: gradient message id ",
        request.autograd().message_id(), " without a context"));
  }
  if (id < 0 || creator >= base::kUnknownWorker || !member(static_cast<base::WorkerId>(creator))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown distributed autograd context id ", id, ": no worker of the group (id ", creator,
        ") created it"));
  }
  return absl::OkStatus();
}

absl::Status CheckCall(const wire::CallRequest& call, base::WorkerId from) {
  if (!base::IsValidRegisteredName(call.function())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid ", call.has_self() ? "method" : "function", " name '",
        call.function().substr(0, 64), call.function().size() > 64 ? "...' (" : "' (",
        call.function().size(), " bytes): names are 1 to 128 characters of [A-Za-z0-9_.:-]"));
  }
  return CheckResultRRef(call, from);
}

absl::Status CheckResultRRef(const wire::CallRequest& call, base::WorkerId from) {
  if (!call.has_result_rref()) return absl::OkStatus();
  const base::RRefId id = FromWire(call.result_rref());
  if (id.worker != from || FromWire(call.result_fork()) != id) {
    return absl::InvalidArgumentError("remote(): the result RRef id must be the caller's");
  }
  return absl::OkStatus();
}

}  // namespace remora::rpc
