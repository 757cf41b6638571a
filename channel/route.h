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

namespace remora::channel {

inline constexpr size_t kDefaultOobThresholdBytes = 64 * 1024;

// How the payloads of messages to one peer travel.
struct Route {
  ShmChannel* shm = nullptr;  // null: CPU payloads go in the frame
  size_t threshold = kDefaultOobThresholdBytes;  // smaller ones always do
  CudaChannel* cuda = nullptr;  // null: CUDA payloads are staged
  base::WorkerId peer = base::kUnknownWorker;
};

// This process's host identity, which every participant sends at
// rendezvous: `explicit_id` when not empty (worker --host-id, or
// REMORA_HOST_ID: for containers), else "<hostname>/<boot id>/<network
// namespace>", e.g. "n1/5c0e.../net:[4026531840]". Processes in different
// network namespaces count as different hosts, as they would be on a
// cluster: they reach each other only through the network.
std::string HostIdentity(const std::string& explicit_id = "");

// Checks an explicit host id: 1 to 255 printable characters, no spaces.
absl::Status CheckHostId(const std::string& id);

// Whether `self` may send `peer` payloads through shared memory: the same
// host identity (not empty), the same shared-memory domain (boot, PID
// namespace, user; not empty) and another agent (incarnation).
bool SharesMemory(const base::WorkerInfo& self, const base::WorkerInfo& peer);

// The route from this process (`self`, whose shared-memory endpoint is
// `shm`'s) to `peer`.
Route SelectRoute(const base::WorkerInfo& self, const base::WorkerInfo& peer, ShmChannel* shm,
                  CudaChannel* cuda, size_t threshold);

// What carries a tensor on `device` of this process to `peer` along
// `route`: for CPU tensors "shm" or "grpc"; for CUDA tensors "cuda_ipc",
// "nccl", or "staged:shm" / "staged:grpc"; or the device-map error that
// sending one would give.
absl::StatusOr<std::string> DescribeRoute(const Route& route, const DeviceMapper& devices,
                                          const base::WorkerInfo& peer, c10::Device device);

}  // namespace remora::channel
