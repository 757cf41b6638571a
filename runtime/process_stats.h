// Resources of a process as Linux's /proc shows them: what the soak test
// and the process_stats function of a worker report.
//
// Thread-safe (reads /proc only).
#pragma once

#include <cstdint>

namespace remora::runtime {

struct ProcessStats {
  int64_t pid = 0;
  int64_t threads = 0;  // /proc/PID/task entries
  int64_t fds = 0;      // /proc/PID/fd entries: sockets, pipes, eventfds, files
  int64_t rss_kb = 0;   // VmRSS of /proc/PID/status
};

// `pid` 0: this process. Fields it cannot read stay 0.
ProcessStats ReadProcessStats(int64_t pid = 0);

}  // namespace remora::runtime
