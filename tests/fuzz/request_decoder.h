// What a worker does with the bytes of a request before any handler logic
// runs, without a network: parse the frame (rpc/message.h) and decode every
// value it carries with the codec (rpc/codec.h), RRefs included, for every
// request kind and for responses. Shared by the libFuzzer target
// (request_fuzzer.cc) and the test that checks the seed corpus.
//
// Thread-compatible: each call builds its own RRef context.
#pragma once

#include <string>

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/status.h"

namespace remora::fuzz {

// The worker id the decoding side plays (the group has workers 0..3).
inline constexpr int kSelf = 1;
inline constexpr int kGroupSize = 4;

// Parses `frame` and decodes all of it as worker kSelf would; OK when every
// part is valid, else the first error.
absl::Status DecodeRequestFrame(const grpc::ByteBuffer& frame);

// The same over `bytes` cut into slices of at most `slice_bytes` (0: one
// slice), as gRPC may deliver them.
absl::Status DecodeRequestBytes(const std::string& bytes, size_t slice_bytes = 0);

}  // namespace remora::fuzz
