#include "trace/trace.h"

#include <time.h>

#include <atomic>

#include "absl/synchronization/mutex.h"
#include "base/mutex_lock.h"

namespace remora::trace {
namespace {

std::atomic<bool> enabled{false};
thread_local int64_t current_micro_batch = -1;
thread_local std::string current_stage;

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

void Record(const std::string& name, int64_t micro_batch, int64_t start_us, int64_t end_us,
            const std::string& stage) {
  if (!Enabled()) return;
  Buffer& b = GetBuffer();
  base::MutexLock lock(b.mu);
  b.slices.push_back(Slice{name, micro_batch, start_us, end_us, stage});
}

void SetMicroBatch(int64_t micro_batch, std::string stage) {
  current_micro_batch = micro_batch;
  current_stage = std::move(stage);
}
int64_t MicroBatch() { return current_micro_batch; }
const std::string& Stage() { return current_stage; }

std::vector<Slice> Drain() {
  Buffer& b = GetBuffer();
  base::MutexLock lock(b.mu);
  std::vector<Slice> out;
  out.swap(b.slices);
  return out;
}

}  // namespace remora::trace
