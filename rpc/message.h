// Frames: how a remora message becomes a gRPC ByteBuffer and back.
//
// A message is a protobuf Header plus payloads (raw tensor bytes). Sending
// never copies a large payload: each becomes a gRPC slice over the tensor's
// own memory, kept alive until gRPC is done with it. Receiving builds each
// payload over the received slice when it arrived in one piece, and copies
// it once into a fresh buffer otherwise. Between processes on one host,
// payloads from a threshold up go through shared memory instead (see
// channel/shm/shm.h) and the frame carries their descriptors. CUDA payloads of any
// size go through the CUDA channel (channel/cuda/cuda_channel.h) where it offers a
// route to the peer, and are otherwise staged: copied to the CPU, then sent
// like any CPU payload. See proto/agent.proto for the frame layout.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <grpcpp/support/byte_buffer.h>

#include "absl/status/statusor.h"
#include "proto/agent.pb.h"
#include "channel/cuda/cuda_channel.h"
#include "base/ids.h"
#include "channel/route.h"
#include "channel/shm/shm.h"

namespace remora::rpc {

// Payloads up to this size are copied into the header's slice instead of
// getting a slice of their own.
inline constexpr size_t kInlinePayloadBytes = 16 * 1024;

struct OutMessage {
  wire::Header header;
  // Contiguous tensors, CPU or CUDA; each is sent as its bytes
  // [data_ptr, +nbytes).
  std::vector<at::Tensor> payloads;
  // By payload index: the receiver's GPU for a CUDA payload that should
  // arrive on one (-1 or missing: stage it through host memory).
  std::vector<int> cuda_destinations;
  // CallOptions::stream_group: set on every CUDA payload's descriptor.
  int64_t stream_group = 0;
};

struct InMessage {
  wire::Header header;
  // One-dimensional uint8 tensors, one per payload: on the CPU, or on the
  // receiver's GPU for payloads that came through the CUDA channel.
  std::vector<at::Tensor> payloads;
};

// Default size from which a payload leaves the frame for an out-of-band
// channel (AgentOptions::oob_threshold_bytes).
// A payload still to be copied into its shared-memory segment, once the
// frame that describes it has been handed to gRPC (see ShmChannel::Fill).
struct ShmFill {
  wire::ShmPayload descriptor;
  at::Tensor payload;
};

// Builds the frame. Fills header.payload_sizes, header.shm_payloads and
// header.cuda_payloads. With `fills`, shared-memory payloads are only
// reserved and appended there: the caller sends the frame, then calls
// FillAll(route, *fills) and keeps the descriptors to reclaim if the call
// fails. Without, they are copied before this returns. CUDA payloads used
// are appended to `cuda_sent` (to reclaim if the call fails).
grpc::ByteBuffer SerializeMessage(OutMessage message, const channel::Route& route = {},
                                  std::vector<ShmFill>* fills = nullptr,
                                  std::vector<wire::CudaPayload>* cuda_sent = nullptr);

// Copies every reserved payload in; keeps only the descriptors in `fills`.
void FillAll(const channel::Route& route, std::vector<ShmFill>& fills);

// Parses and checks a frame: the header must parse and the sizes of the
// in-frame payloads must add up to exactly the bytes that follow it.
// Shared-memory payloads are read through `shm`, CUDA payloads through
// `cuda` as coming from worker `from` (default: the request's sender); a
// frame that has some is refused when the channel is null.
absl::StatusOr<InMessage> ParseMessage(const grpc::ByteBuffer& buffer,
                                       channel::ShmChannel* shm = nullptr, channel::CudaChannel* cuda = nullptr,
                                       base::WorkerId from = base::kUnknownWorker);

// The header of a frame alone, payloads not read: what a frame that
// ParseMessage refused asked for. An error when the header does not parse.
absl::StatusOr<wire::Header> ReadFrameHeader(const grpc::ByteBuffer& buffer);

// Frames on a stream (rpc/stream.h) travel behind the id of their call:
// [u64 little-endian id][frame]. Tagging adds a slice; untagging drops the
// id's bytes and leaves the frame's own slices untouched (no copy).
grpc::ByteBuffer TagFrame(uint64_t id, const grpc::ByteBuffer& frame);
// Reads the id and removes it from `message`; an error when the message is
// too short to hold one.
absl::StatusOr<uint64_t> UntagFrame(grpc::ByteBuffer* message);

// Whether a frame's header lists CUDA payloads (false for a frame that does
// not parse: ParseMessage says why). Receiving those waits for transfers,
// which callers keep off threads that other transfers may need.
bool CarriesCudaPayloads(const grpc::ByteBuffer& buffer);

}  // namespace remora::rpc
