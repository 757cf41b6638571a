// The frame layer (rpc/message.h) on its own: hand-built frames, call ids
// on streams, and frames whose lengths do not add up.
#include "rpc/codec.h"
#include "runtime/buffer_cache.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <ATen/TensorOperators.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <ATen/core/rref_interface.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/complex.h>
#include <ATen/ops/conj.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/imag.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <gmock/gmock.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rpc/future.h"
#include "rpc/message.h"
#include "tests/support/slices.h"
#include "proto/agent.pb.h"
#include "proto/request.h"
#include "proto/rref.pb.h"
namespace remora {
namespace {

using ::testing::HasSubstr;

// --- frame errors -----------------------------------------------------------

std::string Le32(uint32_t n) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return s;
}

// A frame whose header declares `sizes` and whose payload bytes are `body`.
std::string FrameBytes(const std::vector<uint64_t>& sizes, const std::string& body) {
  wire::Header h;
  h.mutable_request()->set_from(9);
  for (uint64_t n : sizes) h.add_payload_sizes(n);
  const std::string header = h.SerializeAsString();
  return Le32(static_cast<uint32_t>(header.size())) + header + body;
}

void ExpectFrameError(const grpc::ByteBuffer& b, const std::string& substr) {
  auto in = rpc::ParseMessage(b);
  EXPECT_EQ(in.status().code(), absl::StatusCode::kInvalidArgument) << in.status();
  EXPECT_THAT(std::string(in.status().message()), HasSubstr(substr));
}

TEST(Frame, HandBuiltFrameParses) {
  // The control for the error cases: two payloads, split across slices.
  const std::string bytes = FrameBytes({2, 3}, "abcde");
  auto in = rpc::ParseMessage(BufferOf(bytes));
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->header.request().from(), 9u);
  ASSERT_EQ(in->payloads.size(), 2u);
  EXPECT_EQ(std::string(static_cast<const char*>(in->payloads[0].data_ptr()), 2), "ab");
  EXPECT_EQ(std::string(static_cast<const char*>(in->payloads[1].data_ptr()), 3), "cde");
  EXPECT_EQ(in->payloads[1].scalar_type(), at::kByte);
  EXPECT_EQ(in->payloads[1].dim(), 1);

  auto split = rpc::ParseMessage(Reslice(BufferOf(bytes), 1));
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(std::string(static_cast<const char*>(split->payloads[1].data_ptr()), 3), "cde");
}

TEST(Frame, TooShort) {
  ExpectFrameError(BufferOf(""), "too short");
  ExpectFrameError(BufferOf(std::string("\x01\x00\x00", 3)), "too short");
  ExpectFrameError(grpc::ByteBuffer(nullptr, 0), "too short");
}

TEST(Frame, UninitializedBuffer) {
  auto in = rpc::ParseMessage(grpc::ByteBuffer());
  EXPECT_EQ(in.status().code(), absl::StatusCode::kInvalidArgument) << in.status();
}

// Frames on a stream travel behind their call's id (rpc/stream.h). Untagging
// gives back the frame's bytes however the message was sliced, and refuses
// a message too short to hold an id.
TEST(Frame, TaggedFrameGivesBackIdAndFrame) {
  const std::string bytes = FrameBytes({2, 3}, "abcde");
  for (size_t piece : {size_t{1}, size_t{3}, size_t{8}, size_t{1000}}) {
    grpc::ByteBuffer message = Reslice(rpc::TagFrame(0x0102030405060708ULL, BufferOf(bytes)), piece);
    auto id = rpc::UntagFrame(&message);
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(*id, 0x0102030405060708ULL);
    auto in = rpc::ParseMessage(message);
    ASSERT_TRUE(in.ok()) << "slices of " << piece << ": " << in.status();
    EXPECT_EQ(std::string(static_cast<const char*>(in->payloads[1].data_ptr()), 3), "cde");
  }
  grpc::ByteBuffer empty_frame = rpc::TagFrame(7, grpc::ByteBuffer());
  EXPECT_EQ(rpc::UntagFrame(&empty_frame).value(), 7u);
  EXPECT_EQ(empty_frame.Length(), 0u);
}

TEST(Frame, UntagRefusesShortMessages) {
  for (const std::string& bytes : {std::string(), std::string("1234567")}) {
    grpc::ByteBuffer message = Reslice(BufferOf(bytes), 2);
    auto id = rpc::UntagFrame(&message);
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << id.status();
    EXPECT_THAT(std::string(id.status().message()), HasSubstr("too short"));
  }
  grpc::ByteBuffer invalid;
  EXPECT_FALSE(rpc::UntagFrame(&invalid).ok());
}

TEST(Frame, HeaderLengthBeyondBuffer) {
  ExpectFrameError(BufferOf(Le32(100) + "abc"), "exceeds");
  ExpectFrameError(BufferOf(Le32(0xFFFFFFFF) + "abc"), "exceeds");
}

TEST(Frame, HeaderDoesNotParse) {
  // A truncated varint and a field with the invalid wire type 7.
  ExpectFrameError(BufferOf(Le32(3) + "\xff\xff\xff"), "does not parse");
  ExpectFrameError(BufferOf(Le32(1) + "\x0f"), "does not parse");
  ExpectFrameError(Reslice(BufferOf(Le32(3) + "\xff\xff\xff"), 1), "does not parse");
}

TEST(Frame, PayloadSizesMustAddUp) {
  ExpectFrameError(BufferOf(FrameBytes({10}, "abcde")), "exceed");      // too much
  ExpectFrameError(BufferOf(FrameBytes({2, 2}, "abcde")), "add up to");  // too little
  ExpectFrameError(BufferOf(FrameBytes({}, "abcde")), "add up to");      // none at all
  ExpectFrameError(BufferOf(FrameBytes({2, 0xFFFFFFFFFFFFFFFFull}, "abcde")), "exceed");
  ExpectFrameError(BufferOf(FrameBytes({4, 4}, "abcde")), "exceed");
}

// A received payload whose buffer cannot be had (the process is out of
// memory; here a size no process can have) is an error for its message,
// not an abort of the process on the thread that reads it.
TEST(ReceiveBuffers, MemoryThatIsNotThereIsAnErrorNotACrash) {
  auto small = runtime::AllocateReceiveBuffer(100);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->numel(), 100);
  auto cached = runtime::AllocateReceiveBuffer(size_t{2} << 20);
  ASSERT_TRUE(cached.ok()) << cached.status();
  EXPECT_EQ(cached->numel(), int64_t{2} << 20);
  auto absurd = runtime::AllocateReceiveBuffer(size_t{1} << 62);
  ASSERT_FALSE(absurd.ok());
  EXPECT_EQ(absurd.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(absurd.status().message()), ::testing::HasSubstr("bytes for a received payload"));
}

}  // namespace
}  // namespace remora
