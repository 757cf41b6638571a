// Ending a process that is told to stop (SIGINT from Ctrl-C, SIGTERM from
// a scheduler) in its own words: while an InterruptHook is alive, the first
// such signal runs its function on a thread of its own (a master tells its
// workers that the group is over), then the process ends by the signal's
// own action: its parent sees it killed by the signal (a shell says 128 +
// the signal's number), as if there were no hook but for the function. A
// second signal kills the process at once, but for the same signal again
// within 2 s of the first: the one request passed on twice (a terminal's
// Ctrl-C reaches both a program and remora-launch, which passes it on).
//
//   launch::InterruptHook hook([&agent](int signo) {
//     agent->TellGroupEnded(absl::CancelledError(absl::StrCat("stopped by ", strsignal(signo))), signo);
//   });
//
// Thread-safety: one hook at a time; making and destroying it is safe
// against a signal arriving meanwhile (the destructor waits for a function
// under way to return).
#pragma once

#include <functional>

namespace remora::launch {

class InterruptHook {
 public:
  explicit InterruptHook(std::function<void(int signo)> on_signal);
  ~InterruptHook();
  InterruptHook(const InterruptHook&) = delete;
  InterruptHook& operator=(const InterruptHook&) = delete;
};

}  // namespace remora::launch
