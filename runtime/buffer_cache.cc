#include "runtime/buffer_cache.h"

#include <cstdlib>
#include <exception>
#include <map>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/mutex_lock.h"

namespace remora::runtime {
namespace {

// Received payloads too big for one gRPC slice (and payloads read from
// shared memory) are copied into buffers from this cache. Reusing buffers matters: a fresh 64 MiB allocation costs a page
// fault per 4 KiB page, which doubled the receive time in rpc_bench.
//
// Thread-safe. Process-wide, like any allocator cache; holds at most
// kMaxCachedBytes of free buffers.
class BufferCache {
 public:
  static constexpr size_t kMinBytes = 1 << 20;
  static constexpr size_t kMaxCachedBytes = size_t{512} << 20;

  static BufferCache& Get() {
    static BufferCache* cache = new BufferCache;  // never destroyed
    return *cache;
  }

  // A uint8 tensor of n bytes, over a recycled buffer when one fits.
  absl::StatusOr<at::Tensor> Allocate(size_t n) {
    if (n < kMinBytes) {
      try {
        return at::empty({static_cast<int64_t>(n)}, at::kByte);
      } catch (const std::exception&) {
        return OutOfMemory(n);
      }
    }
    void* data = nullptr;
    size_t capacity = n;
    {
      base::MutexLock lock(mu_);
      auto it = free_.lower_bound(n);
      if (it != free_.end() && it->first <= 2 * n) {
        capacity = it->first;
        data = it->second;
        cached_ -= capacity;
        free_.erase(it);
      }
    }
    if (data == nullptr && posix_memalign(&data, 64, n) != 0) {
      GiveBackFree();  // (the cache's free buffers may be what is missing)
      if (posix_memalign(&data, 64, n) != 0) return OutOfMemory(n);
    }
    return at::from_blob(data, {static_cast<int64_t>(n)},
                         [this, capacity](void* p) { Release(p, capacity); },
                         at::TensorOptions().dtype(at::kByte));
  }

 private:
  static absl::Status OutOfMemory(size_t n) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", n, " bytes for a received payload: more than this process can get"));
  }

  void GiveBackFree() {
    base::MutexLock lock(mu_);
    for (auto& [capacity, data] : free_) free(data);
    free_.clear();
    cached_ = 0;
  }

  void Release(void* data, size_t capacity) {
    {
      base::MutexLock lock(mu_);
      if (cached_ + capacity <= kMaxCachedBytes) {
        free_.emplace(capacity, data);
        cached_ += capacity;
        return;
      }
    }
    free(data);
  }

  absl::Mutex mu_;
  std::multimap<size_t, void*> free_ ABSL_GUARDED_BY(mu_);
  size_t cached_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

absl::StatusOr<at::Tensor> AllocateReceiveBuffer(size_t n) { return BufferCache::Get().Allocate(n); }

}  // namespace remora::runtime
