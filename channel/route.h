// Route selection, in one place: which channel the payloads of a message to
// a peer take, and what channel_to() reports for it.
//
//   CPU payloads    shared memory (channel/shm/) when both processes offer
//                   the same shared-memory domain (same boot, PID namespace
//                   and user) and the payload is at least `threshold` bytes;
//                   otherwise in the gRPC frame
//   CUDA payloads   the CUDA channel (channel/cuda/): CUDA IPC to another
//                   process on the same GPU, NCCL to another GPU, when the
//                   device map sends the tensor to a GPU of the peer;
//                   otherwise staged through host memory, then as a CPU
//                   payload
//
// A channel may still decline one payload (no segment to spare, a failed
// NCCL set-up); the payload then takes the next way down the list.
//
// Stateless; thread-safe. A Route holds pointers to channels the agent owns.
#pragma once

#include <cstddef>
#include <string>

#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "base/ids.h"
#include "channel/cuda/cuda_channel.h"
#include "channel/devices.h"
#include "channel/shm/shm.h"

namespace remora {

inline constexpr size_t kDefaultOobThresholdBytes = 64 * 1024;

// How the payloads of messages to one peer travel.
struct Route {
  ShmChannel* shm = nullptr;  // null: CPU payloads go in the frame
  size_t threshold = kDefaultOobThresholdBytes;  // smaller ones always do
  CudaChannel* cuda = nullptr;  // null: CUDA payloads are staged
  WorkerId peer = kUnknownWorker;
};

// The route from this process (whose shared-memory endpoint is `shm`'s) to
// `peer`.
Route SelectRoute(const WorkerInfo& peer, ShmChannel* shm, CudaChannel* cuda,
                  size_t threshold);

// What carries a tensor on `device` of this process to `peer` along
// `route`: for CPU tensors "shm" or "grpc"; for CUDA tensors "cuda_ipc",
// "nccl", or "staged:shm" / "staged:grpc"; or the device-map error that
// sending one would give.
absl::StatusOr<std::string> DescribeRoute(const Route& route, const DeviceMapper& devices,
                                          const WorkerInfo& peer, c10::Device device);

}  // namespace remora
