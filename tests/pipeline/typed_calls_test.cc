// Tests of typed calls (rpc/call.h) and of the pipeline's calls written
// with them (pipeline/protocol.h): what one side encodes the other decodes
// field for field, and a call that does not match is an error naming the
// call and the field, from the real registered functions. No sockets.

#include "rpc/call.h"

#include <optional>
#include <string>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/ivalue.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "pipeline/protocol.h"
#include "pipeline/stage.h"
#include "pipeline/worker_data.h"
#include "rpc/registry.h"

namespace remora {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A request with a field of every kind rpc/call.h supports.
struct EveryKind {
  static constexpr char kFunction[] = "test.every_kind";
  int64_t id = 0;
  int small = 0;
  double share = 0;
  bool flag = false;
  std::string name;
  std::vector<int64_t> ints;
  std::vector<std::string> names;
  at::Tensor tensor;
  std::vector<at::Tensor> tensors;
  std::vector<c10::IValue> values;
  std::optional<int64_t> maybe;
  std::optional<at::Tensor> maybe_tensor;
  c10::IValue any;
  std::vector<double> shares;
  template <typename Fields>
  void Visit(Fields& f) {
    f("id", id)("small", small)("share", share)("flag", flag)("name", name)("ints", ints)("names", names)(
        "tensor", tensor)("tensors", tensors)("values", values)("maybe", maybe)("maybe_tensor", maybe_tensor)(
        "any", any)("shares", shares);
  }
};

EveryKind Filled() {
  EveryKind r;
  r.id = int64_t{1} << 40;
  r.small = -7;
  r.share = 0.25;
  r.flag = true;
  r.name = "w1";
  r.ints = {3, 1, 4};
  r.names = {"a", "b"};
  r.tensor = at::arange(6).reshape({2, 3});
  r.tensors = {at::ones({2}), at::zeros({1})};
  r.values = {c10::IValue(int64_t{5}), c10::IValue("x"), c10::IValue()};
  r.maybe = 9;
  r.any = c10::IValue(std::string("anything"));
  r.shares = {0.5, 0.25};
  return r;
}

TEST(TypedCall, WhatOneSideEncodesTheOtherDecodesFieldForField) {
  const EveryKind sent = Filled();
  const std::vector<c10::IValue> args = rpc::EncodeCall(sent);
  ASSERT_EQ(args.size(), 14u);
  absl::StatusOr<EveryKind> got = rpc::DecodeCall<EveryKind>(rpc::Args(args));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->id, sent.id);
  EXPECT_EQ(got->small, sent.small);
  EXPECT_EQ(got->share, sent.share);
  EXPECT_EQ(got->flag, sent.flag);
  EXPECT_EQ(got->name, sent.name);
  EXPECT_EQ(got->ints, sent.ints);
  EXPECT_EQ(got->names, sent.names);
  EXPECT_TRUE(got->tensor.equal(sent.tensor));
  ASSERT_EQ(got->tensors.size(), 2u);
  EXPECT_TRUE(got->tensors[1].equal(sent.tensors[1]));
  ASSERT_EQ(got->values.size(), 3u);
  EXPECT_EQ(got->values[0].toInt(), 5);
  EXPECT_TRUE(got->values[2].isNone());
  EXPECT_EQ(got->maybe, std::optional<int64_t>(9));
  EXPECT_FALSE(got->maybe_tensor.has_value());  // (sent as None)
  EXPECT_EQ(got->any.toStringRef(), "anything");
  EXPECT_EQ(got->shares, sent.shares);
}

TEST(TypedCall, EmptyListsAndAnIntForADoubleAreRead) {
  EveryKind sent = Filled();
  sent.ints.clear();
  sent.names.clear();
  sent.tensors.clear();
  std::vector<c10::IValue> args = rpc::EncodeCall(sent);
  args[2] = c10::IValue(int64_t{2});  // an int where a double is wanted
  args[5] = c10::impl::GenericList(c10::AnyType::get());  // an untyped empty list
  c10::impl::GenericList mixed(c10::AnyType::get());      // numbers, an int among them
  mixed.push_back(1.5);
  mixed.push_back(int64_t{2});
  args[13] = mixed;
  absl::StatusOr<EveryKind> got = rpc::DecodeCall<EveryKind>(rpc::Args(args));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->share, 2.0);
  EXPECT_EQ(got->shares, (std::vector<double>{1.5, 2.0}));
  EXPECT_TRUE(got->ints.empty());
  EXPECT_TRUE(got->names.empty());
  EXPECT_TRUE(got->tensors.empty());
}

TEST(TypedCall, AMissingArgumentIsAnErrorNamingTheCallAndTheField) {
  std::vector<c10::IValue> args = rpc::EncodeCall(Filled());
  args.resize(4);
  absl::StatusOr<EveryKind> got = rpc::DecodeCall<EveryKind>(rpc::Args(args));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(got.status().message()),
              AllOf(HasSubstr("test.every_kind"), HasSubstr("argument 4 ('name') is missing"),
                    HasSubstr("the call has 4 arguments")));
}

TEST(TypedCall, AnArgumentOfTheWrongTypeIsAnErrorNamingTheFieldAndBothTypes) {
  std::vector<c10::IValue> args = rpc::EncodeCall(Filled());
  args[7] = c10::IValue("not a tensor");
  absl::StatusOr<EveryKind> got = rpc::DecodeCall<EveryKind>(rpc::Args(args));
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(std::string(got.status().message()),
              AllOf(HasSubstr("test.every_kind: argument 7 ('tensor') must be a tensor, got a String")));
  args = rpc::EncodeCall(Filled());
  args[6] = c10::List<int64_t>({1, 2});
  got = rpc::DecodeCall<EveryKind>(rpc::Args(args));
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("argument 6 ('names') must be a list of strings"));
  args = rpc::EncodeCall(Filled());
  args[13] = c10::List<std::string>({"0.5"});
  got = rpc::DecodeCall<EveryKind>(rpc::Args(args));
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("argument 13 ('shares') must be a list of numbers"));
  args = rpc::EncodeCall(Filled());
  args[1] = c10::IValue(int64_t{1} << 40);  // too large for an int
  got = rpc::DecodeCall<EveryKind>(rpc::Args(args));
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("argument 1 ('small') is 1099511627776, out of range"));
}

TEST(TypedCall, AnArgumentMoreThanTheCallTakesIsAnError) {
  std::vector<c10::IValue> args = rpc::EncodeCall(Filled());
  args.emplace_back(int64_t{1});
  absl::StatusOr<EveryKind> got = rpc::DecodeCall<EveryKind>(rpc::Args(args));
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(std::string(got.status().message()),
              AllOf(HasSubstr("test.every_kind"), HasSubstr("15 arguments where 14 were expected")));
}

TEST(TypedCall, AReplysFieldsTravelAsATupleAndAnythingElseIsAnError) {
  const pipeline::EvalCorrectReply sent{7, 9, 12};
  absl::StatusOr<pipeline::EvalCorrectReply> got = rpc::DecodeTuple<pipeline::EvalCorrectReply>(rpc::EncodeTuple(sent));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->top1, 7);
  EXPECT_EQ(got->top5, 9);
  EXPECT_EQ(got->rows, 12);
  got = rpc::DecodeTuple<pipeline::EvalCorrectReply>(c10::IValue(int64_t{3}));
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("remora.pipeline.eval (reply): a Int where a tuple of its fields was expected"));
}

TEST(PipelineCalls, WorkerRowsTravelTaggedAndAnUntaggedTupleIsNotRows) {
  const pipeline::WorkerRows rows{42, at::arange(5), 3};
  std::optional<pipeline::WorkerRows> back = pipeline::WorkerRowsFrom(pipeline::ToIValue(rows));
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->source, 42);
  EXPECT_TRUE(back->rows.equal(rows.rows));
  EXPECT_EQ(back->epoch, 3);
  // A batch's own tuple of tensors is a batch, not rows.
  EXPECT_FALSE(pipeline::WorkerRowsFrom(c10::ivalue::Tuple::create({at::ones({2}), at::ones({2})})).has_value());
  EXPECT_FALSE(pipeline::WorkerRowsFrom(c10::IValue()).has_value());
}

// The real registered functions: a call that does not match its struct is
// the caller's error, naming the call and the field, before the worker looks
// for a runner or a source.
TEST(PipelineCalls, ACallThatDoesNotMatchItsStructFailsNamingTheCallAndTheField) {
  rpc::Registry registry;
  ASSERT_TRUE(pipeline::RegisterFunctions(registry).ok());
  rpc::CallContext ctx;
  auto call = [&](const std::string& name, std::vector<c10::IValue> args) {
    return registry.Invoke(name, ctx, rpc::Args(std::move(args))).wait_for(absl::Seconds(5));
  };
  // push(runner, context, stage, micro_batch, value) with a tensor for the stage.
  absl::StatusOr<c10::IValue> r = call(pipeline::PushRequest::kFunction,
                                       {int64_t{1}, int64_t{2}, at::ones({1}), int64_t{0}, at::ones({2})});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("remora.pipeline.push: argument 2 ('stage') must be an int, got a Tensor"));
  // run with the last field left off, as an older master would send it.
  pipeline::RunRequest run;
  std::vector<c10::IValue> args = rpc::EncodeCall(run);
  args.pop_back();
  r = call(pipeline::RunRequest::kFunction, args);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("remora.pipeline.run: argument 6 ('rows') is missing"));
  r = call(pipeline::OpenDataRequest::kFunction, {int64_t{1}, std::string("mnist")});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("remora.data.open: argument 2 ('train') is missing"));
  r = call(pipeline::SetOrderRequest::kFunction, {int64_t{1}, std::string("1,2,3")});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("remora.pipeline.set_order: argument 1 ('order') must be a list of ints"));
  // A stage built from a call without its index.
  r = call(pipeline::MakeStageRequest::kFunction,
           {std::string("mlp"), std::string("s0"), c10::impl::GenericList(c10::AnyType::get())});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("remora.pipeline.Stage: argument 3 ('index') is missing"));
}

}  // namespace
}  // namespace remora
