#include "base/status_util.h"

#include <c10/util/Exception.h>

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

absl::Status Annotate(const absl::Status& status, const std::string& prefix) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(prefix, ": ", status.message()));
}

}  // namespace remora
