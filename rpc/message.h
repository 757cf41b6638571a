// Frames: how a remora message becomes a gRPC ByteBuffer and back.
//
// A message is a protobuf Header plus payloads (raw tensor bytes). Sending
// never copies a large payload: each becomes a gRPC slice over the tensor's
// own memory, kept alive until gRPC is done with it. Receiving builds each
// payload over the received slice when it arrived in one piece, and copies
// it once into a fresh buffer otherwise. See proto/remora.proto for the
// frame layout.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <grpcpp/support/byte_buffer.h>

#include "absl/status/statusor.h"
#include "remora.pb.h"

namespace remora {

// Payloads up to this size are copied into the header's slice instead of
// getting a slice of their own.
inline constexpr size_t kInlinePayloadBytes = 16 * 1024;

struct OutMessage {
  wire::Header header;
  // Contiguous CPU tensors; each is sent as its bytes [data_ptr, +nbytes).
  std::vector<at::Tensor> payloads;
};

struct InMessage {
  wire::Header header;
  // One-dimensional uint8 tensors, one per payload.
  std::vector<at::Tensor> payloads;
};

// Builds the frame. Fills header.payload_sizes.
grpc::ByteBuffer SerializeMessage(OutMessage message);

// Parses and checks a frame: the header must parse and the payload sizes
// must add up to exactly the bytes that follow it.
absl::StatusOr<InMessage> ParseMessage(const grpc::ByteBuffer& buffer);

}  // namespace remora
