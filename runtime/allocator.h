// Memory settings for remora processes: glibc's heap tuned for large
// messages, and a caching allocator for LibTorch's CPU tensors. Both are
// process-wide; call them once, early in main(), before any tensor work.
//
// Thread-safety: the functions are not meant to race with each other; the
// installed allocator itself is thread-safe and lives until the process ends.
#pragma once

#include <cstddef>
#include <cstdint>

namespace remora::runtime {

// Process-wide allocator settings for a remora program: keep freed heap
// memory instead of returning it to the kernel after every message. gRPC
// receives into fresh 64 KiB slices; with glibc's defaults each large
// message then pays a page fault per 4 KiB (measured: bulk_gbps 1.6 -> 2.0).
// REMORA_MALLOC=default in the environment leaves glibc's settings alone
// (and skips InstallCachingCpuAllocator), for comparisons.
void TuneAllocator();

// Installs a caching allocator for LibTorch's CPU tensors in this process:
// blocks of 1 MiB and more are kept after use and handed out again for the
// same size, so that training steps, which allocate the same activations
// every step, stop paying a page fault per 4 KiB of every large tensor
// (measured: about half of a ResNet50 step was kernel time before). Blocks
// of 2 MiB and more are mappings of their own on transparent huge pages
// (madvise; nothing changes where the kernel has them off), so that even
// their first use faults once per 2 MiB. Keeps at most `max_cached_bytes`
// of free blocks. Call once, before any tensor work.
void InstallCachingCpuAllocator(size_t max_cached_bytes = size_t{8} << 30);

// Bytes of LibTorch CPU tensors alive now, as the caching allocator counts
// them (tensors allocated before it was installed are not counted); -1 when
// it is not installed. Thread-safe.
int64_t CpuBytesInUse();

// Tags the CPU tensors this thread allocates in its scope (through the
// caching allocator), so that the bytes still alive of what one piece of
// work allocated can be counted wherever they are freed: a pipeline stage
// tags a forward pass's allocations to measure its saved activations.
// Scopes nest; tags are caller-chosen ids >= 0.
class ScopedAllocationTag {
 public:
  explicit ScopedAllocationTag(int64_t tag);
  ~ScopedAllocationTag();
  ScopedAllocationTag(const ScopedAllocationTag&) = delete;
  ScopedAllocationTag& operator=(const ScopedAllocationTag&) = delete;

 private:
  int64_t previous_;
};

// Bytes alive now of the allocations made under `tag`. Thread-safe.
int64_t TaggedBytes(int64_t tag);

}  // namespace remora::runtime
