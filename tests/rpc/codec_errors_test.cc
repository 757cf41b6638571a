// The value codec (rpc/codec.h) on what it cannot take: values it cannot
// send are Unimplemented errors, and every malformed wire::Value it
// receives is an InvalidArgument error naming what is wrong, never a crash
// or a tensor over bytes it does not own.
#include "rpc/codec.h"

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
#include "base/status_util.h"
#include "rpc/future.h"
#include "rpc/message.h"
#include "proto/agent.pb.h"
#include "proto/request.h"
#include "proto/rref.pb.h"
namespace remora {
namespace {

using ::testing::HasSubstr;

constexpr base::WorkerId kDestination = 3;

// --- unsupported values -----------------------------------------------------

absl::Status EncodeAlone(const c10::IValue& v) {
  std::vector<at::Tensor> payloads;
  rpc::EncodeContext ectx{kDestination, nullptr, &payloads};
  wire::Value wv;
  return rpc::EncodeValue(v, ectx, &wv);
}

struct Holder : torch::CustomClassHolder {};

TEST(CodecErrors, UnsupportedValuesAreErrors) {
  const c10::IValue future(c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get()));
  const c10::IValue capsule = c10::IValue::make_capsule(c10::make_intrusive<Holder>());
  for (const auto& v : {future, capsule}) {
    absl::Status s = EncodeAlone(v);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("cannot send"));
  }
  // Also when nested.
  c10::impl::GenericList list(c10::AnyType::get());
  list.push_back(c10::IValue(int64_t{1}));
  list.push_back(capsule);
  EXPECT_EQ(EncodeAlone(list).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(EncodeAlone(c10::ivalue::Tuple::create(std::vector<c10::IValue>{future})).code(),
            absl::StatusCode::kUnimplemented);
}

TEST(CodecErrors, BytesThatDoNotFitTheDtypeAreAnError) {
  // 6 bytes are one and a half floats.
  auto v = rpc::ViewBytesAs(at::zeros({6}, at::kByte), at::kFloat, {2});
  EXPECT_FALSE(v.ok());
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("viewing 6 payload bytes as Float"));
  auto empty = rpc::ViewBytesAs(at::zeros({0}, at::kByte), at::kFloat, {0, 3});
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->sizes(), (std::vector<int64_t>{0, 3}));
}

TEST(CodecErrors, SparseTensorIsAnError) {
  const at::Tensor sparse = at::ones({2, 2}).to_sparse();
  absl::Status s = EncodeAlone(sparse);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
}

TEST(CodecErrors, TensorWithoutPayloadListIsAnError) {
  rpc::EncodeContext ectx{kDestination, nullptr, nullptr};
  wire::Value wv;
  EXPECT_EQ(rpc::EncodeValue(at::ones({1}), ectx, &wv).code(),
            absl::StatusCode::kInternal);
}

// --- corrupted input --------------------------------------------------------

class CodecDecodeError : public ::testing::Test {
 protected:
  absl::StatusOr<c10::IValue> Decode(const wire::Value& v) {
    rpc::DecodeContext dctx{nullptr, &payloads_, nullptr};
    return rpc::DecodeValue(v, dctx);
  }
  // A tensor value of `dtype` and `sizes` naming payload `payload`.
  static wire::Value TensorValue(int32_t dtype, std::vector<int64_t> sizes,
                                 uint32_t payload = 0) {
    wire::Value v;
    auto* t = v.mutable_tensor();
    t->set_dtype(dtype);
    for (int64_t s : sizes) t->add_sizes(s);
    t->set_payload(payload);
    return v;
  }
  void AddPayload(int64_t bytes) {
    payloads_.push_back(at::zeros({bytes}, at::kByte));
  }
  static void ExpectInvalid(const absl::StatusOr<c10::IValue>& v,
                            const std::string& substr) {
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
    EXPECT_THAT(std::string(v.status().message()), HasSubstr(substr));
  }

  std::vector<at::Tensor> payloads_;
};

TEST_F(CodecDecodeError, ValidTensorDecodes) {
  // The control for the cases below: 2x3 float32 over 24 bytes is fine.
  AddPayload(24);
  auto v = Decode(TensorValue(static_cast<int32_t>(at::kFloat), {2, 3}));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->toTensor().sizes(), (std::vector<int64_t>{2, 3}));
}

TEST_F(CodecDecodeError, UnknownDtype) {
  AddPayload(8);
  for (int32_t dtype : {999, -5, static_cast<int32_t>(at::ScalarType::Undefined),
                        static_cast<int32_t>(at::kQInt8),
                        static_cast<int32_t>(at::ScalarType::NumOptions),
                        // Numbers LibTorch 2.x gives new dtypes (Bits1x8, Float8_e5m2,
                        // UInt16): refused by processes of every version alike.
                        18, 23, 27}) {
    SCOPED_TRACE(dtype);
    ExpectInvalid(Decode(TensorValue(dtype, {8})), "unknown dtype");
  }
}

TEST_F(CodecDecodeError, NegativeSize) {
  AddPayload(0);
  ExpectInvalid(Decode(TensorValue(static_cast<int32_t>(at::kByte), {-1})),
                "negative size");
  ExpectInvalid(Decode(TensorValue(static_cast<int32_t>(at::kByte), {0, -4})),
                "negative size");
}

TEST_F(CodecDecodeError, SizesThatOverflow) {
  AddPayload(16);
  const int32_t byte = static_cast<int32_t>(at::kByte);
  const int32_t i64 = static_cast<int32_t>(at::kLong);
  const int64_t max = std::numeric_limits<int64_t>::max();
  for (const auto& [dtype, sizes] : std::vector<std::pair<int32_t, std::vector<int64_t>>>{
           {byte, {1LL << 40, 1LL << 40}},
           {byte, {max, max}},
           {byte, {1LL << 32, 1LL << 32, 16}},  // wraps to 0 in 64 bits
           {i64, {1LL << 62}},                  // elements fit, bytes do not
           {i64, {1LL << 61, 2}}}) {
    auto v = Decode(TensorValue(dtype, sizes));
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  }
}

TEST_F(CodecDecodeError, PayloadIndexOutOfRange) {
  AddPayload(4);
  ExpectInvalid(Decode(TensorValue(static_cast<int32_t>(at::kFloat), {1}, 1)),
                "payload 1 does not exist");
  ExpectInvalid(Decode(TensorValue(static_cast<int32_t>(at::kFloat), {1}, 0xFFFFFFFF)),
                "does not exist");
  // No payload list at all.
  rpc::DecodeContext none{nullptr, nullptr, nullptr};
  auto v = rpc::DecodeValue(TensorValue(static_cast<int32_t>(at::kFloat), {1}), none);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CodecDecodeError, PayloadSizeMismatch) {
  AddPayload(23);
  AddPayload(25);
  AddPayload(0);
  const int32_t f32 = static_cast<int32_t>(at::kFloat);
  ExpectInvalid(Decode(TensorValue(f32, {2, 3}, 0)), "do not match");
  ExpectInvalid(Decode(TensorValue(f32, {2, 3}, 1)), "do not match");
  ExpectInvalid(Decode(TensorValue(f32, {}, 2)), "do not match");  // 0-dim: 1 element
}

TEST_F(CodecDecodeError, RequiresGradOnIntegerTensor) {
  AddPayload(8);
  wire::Value v = TensorValue(static_cast<int32_t>(at::kLong), {1});
  v.mutable_tensor()->set_requires_grad(true);
  ExpectInvalid(Decode(v), "require grad");
}

TEST_F(CodecDecodeError, ValueWithNoKind) {
  ExpectInvalid(Decode(wire::Value()), "no kind");
  // Nested too.
  wire::Value list;
  list.mutable_list()->add_items()->set_i(1);
  list.mutable_list()->add_items();
  ExpectInvalid(Decode(list), "no kind");
}

TEST_F(CodecDecodeError, DictWithMismatchedCounts) {
  wire::Value v;
  auto* d = v.mutable_dict();
  d->set_key(wire::ELEM_STRING);
  d->set_value(wire::ELEM_INT);
  d->add_keys()->set_s("a");
  d->add_keys()->set_s("b");
  d->add_values()->set_i(1);
  ExpectInvalid(Decode(v), "counts differ");
}

TEST_F(CodecDecodeError, DictEntriesMustMatchTheirKinds) {
  wire::Value v;
  auto* d = v.mutable_dict();
  d->set_key(wire::ELEM_STRING);
  d->set_value(wire::ELEM_INT);
  d->add_keys()->set_i(1);  // an int where a string key belongs
  d->add_values()->set_i(1);
  ExpectInvalid(Decode(v), "does not match");

  // A list is not a valid key, whatever the declared kind.
  wire::Value any;
  auto* a = any.mutable_dict();
  a->add_keys()->mutable_list();
  a->add_values()->set_i(1);
  ExpectInvalid(Decode(any), "does not match");
}

TEST_F(CodecDecodeError, TypedListHoldingWrongElement) {
  wire::Value v;
  v.mutable_list()->set_elem(wire::ELEM_INT);
  v.mutable_list()->add_items()->set_i(1);
  v.mutable_list()->add_items()->set_s("not an int");
  ExpectInvalid(Decode(v), "does not match");

  wire::Value tensors;
  tensors.mutable_list()->set_elem(wire::ELEM_TENSOR);
  tensors.mutable_list()->add_items()->set_none(true);
  ExpectInvalid(Decode(tensors), "does not match");
}

TEST_F(CodecDecodeError, BadDeviceString) {
  wire::Value v;
  v.set_device("not-a-device:x");
  auto got = Decode(v);
  EXPECT_FALSE(got.ok());
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("device"));
}

TEST_F(CodecDecodeError, ErrorsInsideContainersPropagate) {
  wire::Value v;
  auto* t = v.mutable_tuple();
  t->add_items()->set_i(1);
  *t->add_items() = TensorValue(999, {1});
  ExpectInvalid(Decode(v), "unknown dtype");
}

// A prefix that names the worker already does not get the message's own
// "worker 'w1': " again (errors pass through several layers that each say
// where they come from).
TEST(Annotate, SaysTheWorkerOnce) {
  const absl::Status inner = absl::InternalError("worker 'w1': worker 'w1': reading a batch: bad file");
  EXPECT_EQ(base::Annotate(inner, "the training step on worker 'w1'").message(),
            "the training step on worker 'w1': reading a batch: bad file");
  EXPECT_EQ(base::Annotate(inner, "the training step on worker 'w2'").message(),
            "the training step on worker 'w2': worker 'w1': worker 'w1': reading a batch: bad file");
  EXPECT_EQ(base::Annotate(absl::InternalError("worker 'w1' hosts no stage 3"), "on worker 'w1'").message(),
            "on worker 'w1': worker 'w1' hosts no stage 3");
  EXPECT_EQ(base::Annotate(inner, "epoch 1").message(), "epoch 1: worker 'w1': worker 'w1': reading a batch: bad file");
}

}  // namespace
}  // namespace remora
