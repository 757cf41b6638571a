// A bulk channel: moves a tensor's bytes between two processes outside the
// gRPC message. The frame carries a small descriptor of the channel's own
// kind (wire::ShmPayload for shared memory, wire::CudaPayload for CUDA IPC
// and NCCL; proto/channel.proto) in place of the bytes; the receiver turns
// it back into a tensor. Which channel a payload takes is decided in one
// place, channel/route.h.
//
// Every channel does five things:
//
//   Send     (sender) take a payload for a peer and describe it, or decline
//            (nullopt), in which case the bytes travel in the frame
//   Receive  (receiver) turn a peer's descriptor into the payload's bytes
//   Reclaim  (sender) take back a payload whose call failed, so that it is
//            never read; safe if the receiver reads it anyway (it then
//            sees the loss, never torn bytes)
//   Abandon  (receiver) give up on a payload it will not receive (an
//            earlier payload of the same frame failed), so that the sender
//            need not wait for it
//   Stop     accept nothing new and fail what waits; called once, when the
//            agent stops
//
// Thread-safety: implementations are thread-safe. Ownership: the agent owns
// its channels; a descriptor is a value.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "base/ids.h"

namespace remora::channel {

template <typename Descriptor>
class Channel {
 public:
  virtual ~Channel() = default;

  // `payload` is contiguous; `dst_device` is the receiver's GPU it should
  // land on (CUDA channels), -1 for host memory. The descriptor's payload
  // index is left for the caller to set.
  virtual std::optional<Descriptor> Send(base::WorkerId peer, const at::Tensor& payload,
                                         int dst_device) = 0;
  // The `length` bytes `d` describes, from `peer`, as a uint8 tensor.
  virtual absl::StatusOr<at::Tensor> Receive(base::WorkerId peer, const Descriptor& d,
                                             uint64_t length) = 0;
  virtual void Reclaim(base::WorkerId peer, const Descriptor& d) = 0;
  virtual void Abandon(base::WorkerId peer, const Descriptor& d, const std::string& why) = 0;
  virtual void Stop() = 0;
};

}  // namespace remora::channel
