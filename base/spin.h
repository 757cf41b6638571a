// base::SpinUntil: busy-polling, for a thread that would otherwise sleep on
// something due within microseconds (rpc::AgentOptions::busy_poll: the
// links' readers, the pool's threads, a caller polling its replies).
//
// Thread-safety: a plain function; `done` is called on the calling thread.
#pragma once

#include <sched.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace remora::base {

// Calls `done()` until it returns true or `how_long` has passed, yielding
// the core between calls (so that the thread bringing what this one waits
// for can run on it); true when `done()` did. Calls it not at all when
// `how_long` is not positive.
template <typename Done>
bool SpinUntil(absl::Duration how_long, Done&& done) {
  if (how_long <= absl::ZeroDuration()) return false;
  const absl::Time until = absl::Now() + how_long;
  while (true) {
    if (done()) return true;
    if (absl::Now() >= until) return false;
    sched_yield();
  }
}

}  // namespace remora::base
