// Counters of the out-of-band channels, as an agent reports them
// (Agent::shm_stats, Agent::cuda_stats). Plain structs: this header is part
// of the public API and includes nothing of the channels themselves.
#pragma once

#include <cstdint>

namespace remora::channel {

// Shared memory between processes on one host (channel/shm/shm.h).
struct ShmStats {
  int64_t segments = 0;        // segments this process created
  int64_t segment_bytes = 0;   // their capacity in total
  int64_t busy = 0;            // written and not yet read
  int64_t mapped_peers = 0;    // peer segments mapped here
  int64_t writes = 0;          // payloads sent through segments
  int64_t reads = 0;           // payloads received through segments
};

// CUDA IPC and NCCL (channel/cuda/cuda_channel.h).
struct CudaStats {
  int64_t ipc_sends = 0;
  int64_t ipc_receives = 0;
  int64_t nccl_sends = 0;
  int64_t nccl_receives = 0;
  int64_t held_buffers = 0;     // IPC buffers not yet released by receivers
  int64_t opened_handles = 0;   // peers' allocations opened here
  int64_t communicators = 0;    // live NCCL communicators, both directions
  int64_t aborted = 0;          // communicators aborted after a failure
  int64_t stream_ordered = 0;   // receives whose copy a stream waited for on the GPU
};

}  // namespace remora::channel
