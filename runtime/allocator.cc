#include "runtime/allocator.h"

#include <atomic>

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace remora::runtime {

void TuneAllocator() {
  if (const char* v = std::getenv("REMORA_MALLOC"); v != nullptr && std::string(v) == "default") {
    return;
  }
  // Setting the trim threshold turns off glibc's adaptive mmap threshold, so
  // set that too, to its maximum: blocks up to 32 MiB (most activations of
  // a micro-batch) then come from the heap and are reused without faults.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 256 << 20);
}

namespace {

// Bytes of LibTorch CPU tensors alive (headers included); -1 until the
// caching allocator is installed.
std::atomic<int64_t> bytes_in_use{-1};

// Allocation tags: this thread's current tag, and the bytes alive per tag.
thread_local int64_t current_tag = -1;
struct Tags {
  std::mutex mu;
  std::unordered_map<int64_t, int64_t> bytes;  // guarded by mu
};
Tags& TagTable() {
  static Tags* tags = new Tags;  // never destroyed
  return *tags;
}
void CountTag(int64_t tag, int64_t delta) {
  Tags& t = TagTable();
  std::lock_guard<std::mutex> lock(t.mu);
  int64_t& b = t.bytes[tag];
  b += delta;
  if (b == 0) t.bytes.erase(tag);
}

// See InstallCachingCpuAllocator. Thread-safe; never destroyed.
class CachingCpuAllocator final : public c10::Allocator {
 public:
  explicit CachingCpuAllocator(size_t max_cached) : max_cached_(max_cached) {}

  // LibTorch 1.13 declares allocate() const; 2.x (2.3 on) declares it
  // non-const and adds a pure copy_data(). Defining both forms of
  // allocate(), and copy_data(), without `override` builds against either:
  // each overrides the virtual its LibTorch declares.
  c10::DataPtr allocate(size_t n) { return Allocate(n); }
  c10::DataPtr allocate(size_t n) const { return Allocate(n); }
  void copy_data(void* dest, const void* src, size_t count) const {
    std::memcpy(dest, src, count);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Release; }

 private:
  c10::DataPtr Allocate(size_t n) const {
    if (n == 0) n = 1;
    // A 64-byte header in front of the data records the block's size, so
    // that the data pointer alone identifies the block (LibTorch's
    // raw_allocate needs context == data).
    const size_t total = n + kHeader;
    void* base = nullptr;
    if (n >= kMinCached) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(total);
      if (it != free_.end() && !it->second.empty()) {
        base = it->second.back();
        it->second.pop_back();
        cached_ -= total;
      }
    }
    if (base == nullptr) {
      base = total >= kHugeMin && kMapHuge ? MapHuge(total) : nullptr;
      const bool mapped = base != nullptr;
      // (As LibTorch's own CPU allocator says it: a c10::Error naming the
      // size, which the layers above turn into a status.)
      TORCH_CHECK(mapped || posix_memalign(&base, kHeader, total) == 0, "not enough memory: tried to allocate ", n,
                  " bytes (", n / double(1 << 30), " GiB) on the CPU");
      static_cast<Header*>(base)->size = total;
      static_cast<Header*>(base)->owner = this;
      static_cast<Header*>(base)->mapped = mapped;
    }
    bytes_in_use.fetch_add(static_cast<int64_t>(total), std::memory_order_relaxed);
    static_cast<Header*>(base)->tag = current_tag;
    if (current_tag >= 0) CountTag(current_tag, static_cast<int64_t>(total));
    void* data = static_cast<char*>(base) + kHeader;
    return c10::DataPtr(data, data, &Release, c10::Device(c10::DeviceType::CPU));
  }

  static constexpr size_t kMinCached = 1 << 20;
  static constexpr size_t kHeader = 64;
  // Blocks of 2 MiB and more are mappings of their own, 2 MiB-aligned and
  // advised onto transparent huge pages: touching a fresh one then faults
  // once per 2 MiB, not once per 4 KiB (a ResNet50 step's first pass over
  // its parameters, gradients and activations faulted 80,000 times).
  static constexpr size_t kHugeMin = size_t{2} << 20;
#if defined(__SANITIZE_ADDRESS__)
  // (Under AddressSanitizer every block stays its allocator's, redzones
  // and all: an overrun of a large tensor is still caught.)
  static constexpr bool kMapHuge = false;
#else
  static constexpr bool kMapHuge = true;
#endif
  struct Header {
    size_t size;  // header included
    const CachingCpuAllocator* owner;
    int64_t tag;  // the allocating thread's tag, or -1
    bool mapped;  // MapHuge's, else posix_memalign's
  };

  // `total` bytes on a mapping of their own that starts on a 2 MiB
  // boundary, advised onto huge pages (where the kernel has them off, the
  // advice changes nothing); nullptr when the kernel refuses the mapping.
  static void* MapHuge(size_t total) {
    const size_t length = PageRound(total);
    void* raw = mmap(nullptr, length + kHugeMin, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHugeMin - 1) & ~(kHugeMin - 1);
    if (aligned > start) munmap(raw, aligned - start);
    const uintptr_t end = start + length + kHugeMin;
    if (end > aligned + length) munmap(reinterpret_cast<void*>(aligned + length), end - aligned - length);
    void* base = reinterpret_cast<void*>(aligned);
    madvise(base, length, MADV_HUGEPAGE);
    return base;
  }
  // (The system's page: 64 KiB on some ARM machines, where a 4 KiB
  // rounding would leave each mapping's trimmed tail behind.)
  static size_t PageRound(size_t bytes) {
    static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return (bytes + page - 1) / page * page;
  }

  static void Release(void* data) {
    void* base = static_cast<char*>(data) - kHeader;
    auto* header = static_cast<Header*>(base);
    if (header->tag >= 0) CountTag(header->tag, -static_cast<int64_t>(header->size));
    header->owner->Free(base, header->size, header->mapped);
  }

  void Free(void* base, size_t total, bool mapped) const {
    bytes_in_use.fetch_sub(static_cast<int64_t>(total), std::memory_order_relaxed);
    if (total >= kMinCached) {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_ + total <= max_cached_) {
        free_[total].push_back(base);
        cached_ += total;
        return;
      }
    }
    if (mapped) {
      munmap(base, PageRound(total));
    } else {
      free(base);
    }
  }

  const size_t max_cached_;
  mutable std::mutex mu_;
  mutable std::unordered_map<size_t, std::vector<void*>> free_;  // guarded by mu_
  mutable size_t cached_ = 0;                                     // guarded by mu_
};

}  // namespace

void InstallCachingCpuAllocator(size_t max_cached_bytes) {
  if (const char* v = std::getenv("REMORA_MALLOC"); v != nullptr && std::string(v) == "default") {
    return;
  }
  static CachingCpuAllocator* allocator = [max_cached_bytes] {
    bytes_in_use.store(0);
    return new CachingCpuAllocator(max_cached_bytes);
  }();
  c10::SetCPUAllocator(allocator, /*priority=*/10);
}

int64_t CpuBytesInUse() { return bytes_in_use.load(std::memory_order_relaxed); }

ScopedAllocationTag::ScopedAllocationTag(int64_t tag) : previous_(current_tag) { current_tag = tag; }
ScopedAllocationTag::~ScopedAllocationTag() { current_tag = previous_; }

int64_t TaggedBytes(int64_t tag) {
  Tags& t = TagTable();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.bytes.find(tag);
  return it == t.bytes.end() ? 0 : it->second;
}

}  // namespace remora::runtime
