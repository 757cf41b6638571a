// Buffers for received payloads: a process-wide cache of large byte buffers
// reused across messages, so that receiving a 64 MiB activation every step
// does not pay a page fault per 4 KiB page each time (it doubled the
// receive time in rpc_bench).
//
// Thread-safe. The cache lives until the process ends and keeps at most
// 512 MiB of free buffers; a buffer returns to it when its last tensor goes.
#pragma once

#include <cstddef>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace remora::runtime {

// A contiguous uint8 CPU tensor of `n` bytes; buffers of 1 MiB and more come
// from the cache. Where the memory is not there (after the cache's free
// buffers are given back and the allocation is tried again), a
// ResourceExhausted error naming the size.
absl::StatusOr<at::Tensor> AllocateReceiveBuffer(size_t n);

}  // namespace remora::runtime
