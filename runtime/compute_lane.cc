#include "runtime/compute_lane.h"

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "base/mutex_lock.h"

namespace remora {

namespace {

// A ticket lock: tickets in arrival order, served one at a time.
struct ComputeLane {
  absl::Mutex mu;
  uint64_t next ABSL_GUARDED_BY(mu) = 0;
  uint64_t serving ABSL_GUARDED_BY(mu) = 0;
};

ComputeLane& Lane() {
  static ComputeLane* lane = new ComputeLane;  // never destroyed
  return *lane;
}

}  // namespace

ComputeTurn::ComputeTurn() {
  ComputeLane& lane = Lane();
  MutexLock lock(lane.mu);
  ticket_ = lane.next++;
  auto my_turn = [&lane, this]() ABSL_SHARED_LOCKS_REQUIRED(lane.mu) {
    return lane.serving == ticket_;
  };
  lane.mu.Await(absl::Condition(&my_turn));
}

int64_t ComputeTurn::Queued() {
  ComputeLane& lane = Lane();
  MutexLock lock(lane.mu);
  return static_cast<int64_t>(lane.next - lane.serving);
}

ComputeTurn::~ComputeTurn() {
  ComputeLane& lane = Lane();
  MutexLock lock(lane.mu);
  ++lane.serving;
}

}  // namespace remora
