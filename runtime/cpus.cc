#include "runtime/cpus.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace remora::runtime {

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

absl::StatusOr<std::vector<int>> ParseCpuList(const std::string& text, const std::vector<int>& allowed) {
  const auto bad = [&text](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpus '", text, "': ", why, " (give cores as 0-3,8; 'auto' shares this host's cores among "
                     "its workers)"));
  };
  if (text.empty()) return bad("no cores");
  std::set<int> seen;
  std::vector<int> cpus;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    std::vector<absl::string_view> ends = absl::StrSplit(part, absl::MaxSplits('-', 1));
    int first = 0, last = 0;
    if (!absl::SimpleAtoi(ends[0], &first) || first < 0 ||
        !absl::SimpleAtoi(ends.size() > 1 ? ends[1] : ends[0], &last) || last < 0) {
      return bad(absl::StrCat("'", part, "' is not a core or a range of cores"));
    }
    if (last < first) return bad(absl::StrCat("the range ", part, " runs backwards"));
    for (int c = first; c <= last; ++c) {
      if (!seen.insert(c).second) return bad(absl::StrCat("core ", c, " is given twice"));
      if (std::find(allowed.begin(), allowed.end(), c) == allowed.end()) {
        return bad(absl::StrCat("core ", c, " is not one this process may run on (", CpuListText(allowed), ")"));
      }
      cpus.push_back(c);
    }
  }
  std::sort(cpus.begin(), cpus.end());
  return cpus;
}

std::string CpuListText(const std::vector<int>& cpus) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(cpus[i]) : absl::StrCat(cpus[i], "-", cpus[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ",");
}

std::vector<int> ShareOfCpus(const std::vector<int>& allowed, int index, int count) {
  const int n = static_cast<int>(allowed.size());
  if (n == 0 || index < 0 || index >= count) return {};
  if (count >= n) return {allowed[index % n]};
  const int begin = index * n / count, end = (index + 1) * n / count;
  return std::vector<int>(allowed.begin() + begin, allowed.begin() + end);
}

namespace {

// This process's thread ids (/proc/self/task).
std::vector<int> ThreadIds() {
  std::vector<int> tids;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return tids;
  while (dirent* e = readdir(dir)) {
    int tid = 0;
    if (absl::SimpleAtoi(e->d_name, &tid)) tids.push_back(tid);
  }
  closedir(dir);
  return tids;
}

}  // namespace

absl::Status PinProcessToCpus(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  // Twice: a thread started while the first pass ran inherited the old mask.
  for (int pass = 0; pass < 2; ++pass) {
    for (int tid : ThreadIds()) {
      if (sched_setaffinity(tid, sizeof(set), &set) != 0 && errno != ESRCH) {  // (ESRCH: it ended)
        return absl::InternalError(absl::StrCat("pinning thread ", tid, " to cores ", CpuListText(cpus),
                                                " failed: ", std::strerror(errno)));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace remora::runtime
