// Small helpers for absl::Status: the return-if-error macros that Debian's
// Abseil (20220623) does not ship, and the one place where c10 and gRPC
// errors become absl::Status.
#pragma once

#include <exception>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#define REMORA_CONCAT_INNER(a, b) a##b
#define REMORA_CONCAT(a, b) REMORA_CONCAT_INNER(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) fails.
#define RETURN_IF_ERROR(expr)                         \
  do {                                                \
    ::absl::Status remora_status_ = (expr);           \
    if (!remora_status_.ok()) return remora_status_;  \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr), or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr)                                       \
  auto REMORA_CONCAT(remora_statusor_, __LINE__) = (expr);                \
  if (!REMORA_CONCAT(remora_statusor_, __LINE__).ok())                    \
    return REMORA_CONCAT(remora_statusor_, __LINE__).status();            \
  lhs = std::move(REMORA_CONCAT(remora_statusor_, __LINE__)).value()

namespace remora::base {

// Converts the exception currently being handled (call only inside a catch
// block) into a status whose message starts with `context`.
absl::Status StatusFromCurrentException(const std::string& context);

// Returns `status` with `prefix: ` in front of its message (same code).
// A prefix that ends naming a worker ("... on worker 'w1'") drops the
// message's own leading "worker 'w1': " (said once, not twice).
absl::Status Annotate(const absl::Status& status, const std::string& prefix);

// `message` without the leading "worker 'NAME': " (repeated or not) when
// `said` already ends naming worker 'NAME'.
absl::string_view WithoutLeadingWorker(absl::string_view message, absl::string_view said);

// The bytes of the file `path`; never throws. Errors say "cannot read
// <what> <path> (why)": NotFound when it does not exist, InvalidArgument
// when it is a directory, PermissionDenied, DataLoss when a read fails.
// `what` names it for the user ("--token-file"; may be empty).
absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const std::string& what = "");

}  // namespace remora::base
