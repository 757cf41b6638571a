// What /proc says of a process's threads, for tests that check where they
// run (affinity) or whether a signal has stopped them.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace remora::test_support {

// For each thread of process `pid`, by thread id: the value of the line of
// its /proc status file that starts with `field` (e.g. "Cpus_allowed_list:",
// "State:"), trimmed. Threads that end meanwhile are left out.
inline std::map<int, std::string> ThreadStatus(pid_t pid, const std::string& field) {
  std::map<int, std::string> out;
  std::error_code error;
  for (const auto& task : std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"), error)) {
    int tid = 0;
    if (!absl::SimpleAtoi(task.path().filename().string(), &tid)) continue;
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);) {
      if (absl::StartsWith(line, field)) {
        out[tid] = std::string(absl::StripAsciiWhitespace(absl::string_view(line).substr(field.size())));
        break;
      }
    }
  }
  return out;
}

}  // namespace remora::test_support
