#include "runtime/process_stats.h"

#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace remora::runtime {
namespace {

int64_t CountEntries(const std::string& dir) {
  int64_t n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

}  // namespace

ProcessStats ReadProcessStats(int64_t pid) {
  ProcessStats s;
  s.pid = pid == 0 ? getpid() : pid;
  const std::string proc = absl::StrCat("/proc/", s.pid);
  s.threads = CountEntries(proc + "/task");
  s.fds = CountEntries(proc + "/fd");
  std::ifstream status(proc + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) s.rss_kb = std::atoll(line.c_str() + 6);
  }
  return s;
}

}  // namespace remora::runtime
