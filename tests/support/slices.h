// gRPC byte buffers for tests: made from and read into strings, and cut
// differently from how they were sent, for tests of code that must not
// care where one slice ends and the next begins.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <gtest/gtest.h>

namespace remora {

// `bytes` as a buffer of one slice.
inline grpc::ByteBuffer BufferOf(const std::string& bytes) {
  grpc::Slice slice(bytes.data(), bytes.size());
  return grpc::ByteBuffer(&slice, 1);
}

// The bytes of `buffer`, its slices joined.
inline std::string StringOf(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string flat;
  for (const auto& s : slices) flat.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return flat;
}

// Copies `buffer` into fresh slices of `piece` bytes each (the last one may
// be shorter), so that nothing received aliases what was sent and payloads
// may span slices.
inline grpc::ByteBuffer Reslice(const grpc::ByteBuffer& buffer, size_t piece) {
  const std::string flat = StringOf(buffer);
  std::vector<grpc::Slice> out;
  for (size_t at = 0; at < flat.size(); at += piece) {
    out.emplace_back(flat.data() + at, std::min(piece, flat.size() - at));
  }
  return grpc::ByteBuffer(out.data(), out.size());
}

}  // namespace remora
