#include "rpc/trace.h"

#include <time.h>

#include <atomic>

#include "absl/synchronization/mutex.h"

namespace remora::trace {
namespace {

std::atomic<bool> enabled{false};
thread_local int64_t current_micro_batch = -1;

struct Buffer {
  absl::Mutex mu;
  std::vector<Slice> slices ABSL_GUARDED_BY(mu);
};

Buffer& GetBuffer() {
  static Buffer* buffer = new Buffer;  // never destroyed
  return *buffer;
}

}  // namespace

int64_t NowUs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000 + ts.tv_nsec / 1000;
}

void Enable(bool on) { enabled.store(on); }
bool Enabled() { return enabled.load(std::memory_order_relaxed); }

void Record(const std::string& name, int64_t micro_batch, int64_t start_us, int64_t end_us) {
  if (!Enabled()) return;
  Buffer& b = GetBuffer();
  absl::MutexLock lock(&b.mu);
  b.slices.push_back(Slice{name, micro_batch, start_us, end_us});
}

void SetMicroBatch(int64_t micro_batch) { current_micro_batch = micro_batch; }
int64_t MicroBatch() { return current_micro_batch; }

std::vector<Slice> Drain() {
  Buffer& b = GetBuffer();
  absl::MutexLock lock(&b.mu);
  std::vector<Slice> out;
  out.swap(b.slices);
  return out;
}

}  // namespace remora::trace
