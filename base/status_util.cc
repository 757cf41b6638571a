#include "base/status_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>

#include "absl/strings/match.h"

namespace remora::base {

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

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const std::string& what) {
  const std::string named = what.empty() ? path : absl::StrCat(what, " ", path);
  auto failed = [&](int error) {
    const std::string message = absl::StrCat("cannot read ", named, " (", std::strerror(error), ")");
    switch (error) {
      case ENOENT: return absl::NotFoundError(message);
      case EACCES:
      case EPERM: return absl::PermissionDeniedError(message);
      case EISDIR: return absl::InvalidArgumentError(absl::StrCat(named, " is a directory; give a file"));
      default: return absl::DataLossError(message);
    }
  };
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return failed(errno);
  struct stat st {};
  if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    close(fd);
    return failed(EISDIR);
  }
  std::string bytes;
  char chunk[1 << 16];
  for (;;) {
    const ssize_t n = read(fd, chunk, sizeof(chunk));
    if (n == 0) break;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      close(fd);
      return failed(error);
    }
    bytes.append(chunk, static_cast<size_t>(n));
  }
  close(fd);
  return bytes;
}

}  // namespace remora::base
