#include "base/status_util.h"

#include <c10/util/Exception.h>

#include "absl/strings/match.h"

namespace remora {

absl::Status StatusFromCurrentException(const std::string& context) {
  try {
    throw;
  } catch (const c10::Error& e) {
    // what_without_backtrace keeps the message and drops C++ frames.
    return absl::InternalError(
        absl::StrCat(context, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(context, ": ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(context, ": unknown exception"));
  }
}

absl::string_view WithoutLeadingWorker(absl::string_view message, absl::string_view said) {
  const size_t at = said.rfind("worker '");
  if (at == absl::string_view::npos || said.empty() || said.back() != '\'') return message;
  const std::string who = absl::StrCat(said.substr(at), ": ");
  while (absl::StartsWith(message, who)) message.remove_prefix(who.size());
  return message;
}

absl::Status Annotate(const absl::Status& status, const std::string& prefix) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(prefix, ": ", WithoutLeadingWorker(status.message(), prefix)));
}

}  // namespace remora
