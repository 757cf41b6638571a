// Bad requests, handler by handler: hand-built frames sent to an in-process
// worker (over loopback, as a buggy or hostile peer would send them), and
// bad arguments through the API. Every case must answer with an error the
// caller sees, and the worker must go on serving.
#include <atomic>
#include <functional>
#include <limits>
#include <thread>

#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "rpc/rref_context.h"
#include "tests/support/test_group.h"
#include "tests/support/wire_values.h"

namespace remora {
namespace {

using ::testing::HasSubstr;

class BadInput : public ::testing::Test, protected WireValues {
 protected:
  BadInput() : group_(2), client_(group_.worker(1).self().address) {}

  // Worker w1's id (the master is 0).
  base::WorkerId w1() { return group_.worker(1).self().id; }

  // A call frame from the master to w1.
  static rpc::OutMessage Call(const std::string& function, std::vector<wire::Value> args = {},
                         std::vector<at::Tensor> payloads = {}) {
    rpc::OutMessage m;
    m.header.mutable_request()->set_from(0);
    wire::CallRequest call;
    call.set_function(function);
    for (auto& a : args) *call.add_args() = std::move(a);
    SetBody(m.header.mutable_request(), call);
    m.payloads = std::move(payloads);
    return m;
  }

  static wire::Value Tensor(int32_t dtype, std::vector<int64_t> sizes, uint32_t payload = 0,
                            bool requires_grad = false) {
    wire::Value v;
    auto* t = v.mutable_tensor();
    t->set_dtype(dtype);
    for (int64_t s : sizes) t->add_sizes(s);
    t->set_payload(payload);
    t->set_requires_grad(requires_grad);
    return v;
  }
  static at::Tensor Bytes(int64_t n) { return at::zeros({n}, at::kByte); }

  // Sends `m` to w1 and expects an error reply from w1 that contains `text`
  // within `timeout`.
  void ExpectError(rpc::OutMessage m, const std::string& text,
                   absl::Duration timeout = absl::Seconds(10)) {
    ExpectErrorBytes(RawClient::FrameBytes(std::move(m)), text, timeout);
  }
  void ExpectErrorBytes(const std::string& frame, const std::string& text,
                        absl::Duration timeout = absl::Seconds(10)) {
    auto reply = client_.CallBytesParsed(frame, timeout);
    ASSERT_TRUE(reply.ok()) << "no reply within " << timeout << ": " << reply.status();
    const wire::Response& r = reply->header.response();
    ASSERT_TRUE(r.has_error()) << "expected an error containing '" << text << "'";
    EXPECT_EQ(r.error().worker(), "w1");
    EXPECT_NE(r.error().code(), 0);
    EXPECT_THAT(r.error().message(), HasSubstr(text));
    ExpectServing();
  }
  // Sends `m` to w1 and expects a reply without an error.
  rpc::InMessage ExpectOk(rpc::OutMessage m) {
    auto reply = client_.Call(std::move(m));
    EXPECT_TRUE(reply.ok()) << reply.status();
    if (!reply.ok()) return {};
    EXPECT_FALSE(reply->header.response().has_error())
        << reply->header.response().error().message();
    return std::move(*reply);
  }
  // A good call still works.
  void ExpectServing() {
    auto r = group_.master().rpc_sync("w1", "add", {int64_t{20}, int64_t{22}});
    ASSERT_TRUE(r.ok()) << "w1 stopped serving: " << r.status();
    EXPECT_EQ(r->toInt(), 42);
  }

  Group group_;
  RawClient client_;
};

const int32_t kFloat = static_cast<int32_t>(at::kFloat);
const int32_t kLong = static_cast<int32_t>(at::kLong);

TEST_F(BadInput, UnknownFunctionModuleAndMethodNames) {
  ExpectError(Call("no_such_function"), "no function or module named 'no_such_function'");
  rpc::Agent& master = group_.master();
  auto module = master.remote("w1", "NoSuchModule", {int64_t{1}}).value();
  auto fetched = module.to_here();
  ASSERT_FALSE(fetched.ok());
  EXPECT_THAT(std::string(fetched.status().message()), HasSubstr("'NoSuchModule'"));
  rpc::RRef affine = master.remote("w1", "Affine", {int64_t{2}, int64_t{2}}).value();
  auto method = affine.rpc_sync("no_such_method");
  ASSERT_FALSE(method.ok());
  EXPECT_THAT(std::string(method.status().message()), HasSubstr("has no method 'no_such_method'"));
  ExpectServing();
  // A method call on a value that is not a module.
  rpc::RRef tensor = master.remote("w1", "echo", {at::ones({2})}).value();
  auto not_module = tensor.rpc_sync("forward", {at::ones({2})});
  ASSERT_FALSE(not_module.ok());
  EXPECT_THAT(std::string(not_module.status().message()), HasSubstr("does not hold a module"));
  ExpectServing();
}

TEST_F(BadInput, InvalidNames) {
  ExpectError(Call(""), "invalid function name ''");
  ExpectError(Call("bad name!"), "invalid function name 'bad name!'");
  ExpectError(Call(std::string("a\0b", 3)), "invalid function name");
  // A megabyte-long name is refused without echoing it back.
  rpc::OutMessage huge = Call(std::string(1 << 20, 'x'));
  auto reply = client_.Call(std::move(huge));
  ASSERT_TRUE(reply.ok()) << reply.status();
  ASSERT_TRUE(reply->header.response().has_error());
  EXPECT_THAT(reply->header.response().error().message(), HasSubstr("(1048576 bytes)"));
  EXPECT_LT(reply->header.response().error().message().size(), 400u);
  // Join requests go to the master only, and name valid workers.
  rpc::OutMessage join;
  join.header.mutable_request()->set_from(base::kUnknownWorker);
  wire::JoinRequest bad_name;
  bad_name.set_name("bad name");
  SetBody(join.header.mutable_request(), bad_name);
  ExpectError(std::move(join), "is a worker, not the master");
  RawClient to_master(group_.master().self().address);
  rpc::OutMessage bad_join;
  bad_join.header.mutable_request()->set_from(base::kUnknownWorker);
  SetBody(bad_join.header.mutable_request(), bad_name);
  auto refused = to_master.Call(std::move(bad_join));
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_THAT(refused->header.response().error().message(), HasSubstr("invalid worker name"));
  ExpectServing();
}

TEST_F(BadInput, WrongArgumentCountsAndTypes) {
  ExpectError(Call("add", {Int(1)}), "function 'add': (a, b): argument 1 ('b') is missing: the call has 1 arguments");
  ExpectError(Call("add"), "argument 0 ('a') is missing: the call has 0 arguments");
  ExpectError(Call("add", {Str("x"), Int(1)}), "function 'add'");
  ExpectError(Call("sleep_ms", {Str("soon")}), "function 'sleep_ms'");
  ExpectError(Call("sink", {Int(3)}), "function 'sink'");
  ExpectError(Call("remora.autograd.propagate", {Int(1)}), "remora.autograd.propagate");
  ExpectError(Call("remora.autograd.propagate", {Str("a"), Str("b"), Str("c")}),
              "remora.autograd.propagate");
  ExpectError(Call("rref_add", {Int(1), Int(2)}), "expected a tensor or an RRef to one");
  rpc::Agent& master = group_.master();
  rpc::RRef affine = master.remote("w1", "Affine", {std::string("four"), int64_t{2}}).value();
  auto created = affine.to_here();
  ASSERT_FALSE(created.ok());
  EXPECT_THAT(std::string(created.status().message()), HasSubstr("constructing module 'Affine'"));
  rpc::RRef good = master.remote("w1", "Affine", {int64_t{3}, int64_t{2}}).value();
  auto wrong_shape = good.rpc_sync("forward", {at::ones({5, 7})});
  ASSERT_FALSE(wrong_shape.ok());
  auto no_args = good.rpc_sync("forward");
  ASSERT_FALSE(no_args.ok());
  EXPECT_THAT(std::string(no_args.status().message()),
              HasSubstr("method 'Affine.forward': (x): argument 0 ('x') is missing"));
  ExpectServing();
}

TEST_F(BadInput, TensorDescriptorsThatDoNotMatchTheirBytes) {
  const int64_t max = std::numeric_limits<int64_t>::max();
  // 2x3 float32 needs 24 bytes.
  ExpectError(Call("echo", {Tensor(kFloat, {2, 3})}, {Bytes(23)}), "payload bytes do not match");
  ExpectError(Call("echo", {Tensor(kFloat, {2, 3})}, {Bytes(25)}), "payload bytes do not match");
  ExpectError(Call("echo", {Tensor(kFloat, {2, -3})}, {Bytes(24)}), "negative size");
  ExpectError(Call("echo", {Tensor(kFloat, {max, max})}, {Bytes(16)}), "sizes overflow");
  ExpectError(Call("echo", {Tensor(kLong, {1LL << 32, 1LL << 32, 16})}, {Bytes(16)}),
              "sizes overflow");
  ExpectError(Call("echo", {Tensor(kLong, {1LL << 61})}, {Bytes(16)}),
              "payload bytes do not match");
  ExpectError(Call("echo", {Tensor(kFloat, {1LL << 40})}, {Bytes(16)}),
              "payload bytes do not match");
  ExpectError(Call("echo", {Tensor(kFloat, {2}, /*payload=*/1)}, {Bytes(8)}),
              "payload 1 does not exist");
  ExpectError(Call("echo", {Tensor(kFloat, {2}, /*payload=*/std::numeric_limits<uint32_t>::max())}),
              "does not exist");
  ExpectError(Call("echo", {Tensor(999, {2})}, {Bytes(8)}), "unknown dtype 999");
  ExpectError(Call("echo", {Tensor(kLong, {1}, 0, /*requires_grad=*/true)}, {Bytes(8)}),
              "only floating point tensors can require grad");
  // The same descriptor with the right bytes works.
  rpc::InMessage ok = ExpectOk(Call("echo", {Tensor(kFloat, {2, 3})}, {Bytes(24)}));
  EXPECT_EQ(ok.header.response().value().tensor().sizes_size(), 2);
}

TEST_F(BadInput, BrokenFrames) {
  // Payload sizes that do not add up to the bytes that follow the header.
  wire::Header header;
  header.mutable_request()->set_from(0);
  wire::CallRequest echo;
  echo.set_function("echo");
  SetBody(header.mutable_request(), echo);
  header.add_payload_sizes(100);
  std::string h = header.SerializeAsString();
  uint32_t len = static_cast<uint32_t>(h.size());
  std::string frame(reinterpret_cast<const char*>(&len), 4);
  frame += h + std::string(10, 'x');
  ExpectErrorBytes(frame, "bad request: frame: payload sizes exceed");
  ExpectErrorBytes(std::string("\xff\xff\xff\x7f", 4) + "abc", "header length");
  ExpectErrorBytes("ab", "too short");
  ExpectErrorBytes(std::string("\x05\x00\x00\x00", 4) + "\xff\xff\xff\xff\xff",
                   "header does not parse");
  ExpectErrorBytes("", "too short");
  // A header without a request body, a response sent as a request, a kind
  // no subsystem registered, and a body that is not its kind's message.
  rpc::OutMessage empty;
  empty.header.mutable_request()->set_from(0);
  ExpectError(std::move(empty), "unknown request kind ''");
  rpc::OutMessage response;
  response.header.mutable_response()->mutable_value()->set_i(1);
  ExpectError(std::move(response), "unknown request kind ''");
  rpc::OutMessage unknown;
  unknown.header.mutable_request()->set_from(0);
  unknown.header.mutable_request()->set_kind("remora.wire.NoSuchRequest");
  ExpectError(std::move(unknown), "unknown request kind 'remora.wire.NoSuchRequest'");
  rpc::OutMessage garbled = Call("echo");
  garbled.header.mutable_request()->set_body("\xff\xff\xff");
  ExpectError(std::move(garbled), "malformed body of a remora.wire.CallRequest request");
  // Senders that are not in the group.
  for (uint32_t from : {77u, 65535u, 65536u + 1u, 0xffffffffu}) {
    rpc::OutMessage m = Call("add", {Int(1), Int(2)});
    m.header.mutable_request()->set_from(from);
    ExpectError(std::move(m), "request from unknown worker id");
  }
}

TEST_F(BadInput, UnknownRRefIds) {
  // to_here of values that do not exist.
  for (const auto& [rref, fork] : {std::pair{Guid(w1(), 123456), Guid(w1(), 123456)},
                                   std::pair{Guid(0, 99999), Guid(0, 88888)},
                                   std::pair{Guid(999, 1), Guid(999, 1)}}) {
    rpc::OutMessage m;
    m.header.mutable_request()->set_from(0);
    SetBody(m.header.mutable_request(), Fetch(rref, fork));
    ExpectError(std::move(m), "to_here: no RRef");
  }
  // A method call on an RRef w1 should own but does not.
  rpc::OutMessage self_call = Call("forward", {Tensor(kFloat, {1})}, {Bytes(4)});
  wire::CallRequest forward = wire::RequestBody<wire::CallRequest>(self_call.header.request()).value();
  auto* self = forward.mutable_self()->mutable_rref();
  self->set_owner(w1());
  *self->mutable_rref_id() = Guid(w1(), 777777);
  *self->mutable_fork_id() = Guid(0, 777778);
  self->set_parent(0);
  SetBody(self_call.header.mutable_request(), forward);
  ExpectError(std::move(self_call), "no RRef G(1,777777) on its owner 'w1'");
  // RRef arguments naming workers outside the group.
  for (const auto& [owner, parent, rref_worker] :
       {std::tuple{77u, 0u, 0u}, std::tuple{0u, 70000u, 0u}, std::tuple{0u, 0u, 999u}}) {
    wire::Value v;
    v.mutable_rref()->set_owner(owner);
    v.mutable_rref()->set_parent(parent);
    *v.mutable_rref()->mutable_rref_id() = Guid(rref_worker, 5);
    *v.mutable_rref()->mutable_fork_id() = Guid(0, 6);
    ExpectError(Call("echo", {v}), "decoding the arguments");
  }
  // Fork requests naming workers outside the group.
  rpc::OutMessage fork;
  fork.header.mutable_request()->set_from(0);
  SetBody(fork.header.mutable_request(), Fork(Guid(4242, 1), Guid(0, 2)));
  ExpectError(std::move(fork), "fork request: id G(4242,1) names worker id 4242");
  // Deleting or accepting unknown users is harmless (both are idempotent).
  rpc::OutMessage del;
  del.header.mutable_request()->set_from(0);
  SetBody(del.header.mutable_request(), Delete(Guid(0, 31337), Guid(0, 31338)));
  ExpectOk(std::move(del));
  rpc::OutMessage accept;
  accept.header.mutable_request()->set_from(0);
  wire::ChildAccept child;
  *child.mutable_fork_id() = Guid(3, 4);
  SetBody(accept.header.mutable_request(), child);
  ExpectOk(std::move(accept));
  ExpectServing();
  std::string why;
  EXPECT_TRUE(group_.WaitTablesEmpty(absl::Seconds(20), &why)) << why;
}

// A remote() that w1 refuses, however far it got, leaves w1 an owner RRef
// that holds the refusal: a later method call on that RRef or a to_here()
// from its creator gets the creation error at once. (w1 used to create the
// owner only once the call passed every check, and then such a user waited
// for a value that would never come.)
TEST_F(BadInput, RefusedRemoteLeavesAnRRefThatFailsItsLaterUsers) {
  // Makes the call in `m` a remote() from the master whose result is
  // G(0, local).
  auto remote = [](rpc::OutMessage m, uint64_t local) {
    wire::CallRequest call = wire::RequestBody<wire::CallRequest>(m.header.request()).value();
    *call.mutable_result_rref() = Guid(0, local);
    *call.mutable_result_fork() = Guid(0, local);
    SetBody(m.header.mutable_request(), call);
    return m;
  };
  struct Refused {
    uint64_t local;     // the result's id: G(0, local)
    std::string frame;  // the remote() request
    std::string error;  // what its refusal says
  };
  std::vector<Refused> refused;
  refused.push_back({6000001, RawClient::FrameBytes(remote(Call("bad name!"), 6000001)),
                     "invalid function name 'bad name!'"});
  refused.push_back(
      {6000002,
       RawClient::FrameBytes(remote(Call("echo", {Tensor(kFloat, {2, 3})}, {Bytes(23)}), 6000002)),
       "payload bytes do not match"});
  rpc::OutMessage in_no_context = remote(Call("echo", {Int(1)}), 6000003);
  in_no_context.header.mutable_request()->mutable_autograd()->set_context_id((999LL << 48) | 5);
  refused.push_back({6000003, RawClient::FrameBytes(std::move(in_no_context)),
                     "unknown distributed autograd context id"});
  // A method call on an RRef that w1 should own but does not.
  rpc::OutMessage on_missing = remote(Call("forward"), 6000004);
  wire::CallRequest forward = wire::RequestBody<wire::CallRequest>(on_missing.header.request()).value();
  *forward.mutable_self() = RRefValue(w1(), Guid(w1(), 777777), Guid(0, 777778), 0);
  SetBody(on_missing.header.mutable_request(), forward);
  refused.push_back({6000004, RawClient::FrameBytes(std::move(on_missing)),
                     "no RRef G(1,777777) on its owner 'w1'"});
  // A frame whose payloads w1 cannot receive (as when a shared-memory
  // payload is refused), so its request never reaches the call's handler.
  {
    wire::Header header = remote(Call("echo"), 6000005).header;
    header.add_payload_sizes(100);
    const std::string h = header.SerializeAsString();
    const uint32_t len = static_cast<uint32_t>(h.size());
    refused.push_back(
        {6000005, std::string(reinterpret_cast<const char*>(&len), 4) + h + std::string(10, 'x'),
         "bad request: frame: payload sizes exceed"});
  }

  for (const Refused& r : refused) {
    SCOPED_TRACE(r.error);
    ExpectErrorBytes(r.frame, r.error);
    // Each later user gets the creation error well before its deadline.
    rpc::OutMessage fetch;
    fetch.header.mutable_request()->set_from(0);
    SetBody(fetch.header.mutable_request(), Fetch(Guid(0, r.local), Guid(0, r.local)));
    ExpectError(std::move(fetch), r.error, absl::Seconds(5));
    rpc::OutMessage method = Call("forward", {Tensor(kFloat, {1})}, {Bytes(4)});
    wire::CallRequest call = wire::RequestBody<wire::CallRequest>(method.header.request()).value();
    *call.mutable_self() = RRefValue(w1(), Guid(0, r.local), Guid(0, r.local + 500000), 0);
    SetBody(method.header.mutable_request(), call);
    ExpectError(std::move(method), r.error, absl::Seconds(5));
  }
  // A result id that is not the caller's own gets no owner at all.
  const int64_t owners = group_.worker(1).rref_stats().owners;
  rpc::OutMessage not_own = remote(Call("echo", {Int(1)}), 6000006);
  wire::CallRequest stolen = wire::RequestBody<wire::CallRequest>(not_own.header.request()).value();
  *stolen.mutable_result_rref() = Guid(w1(), 6000006);
  *stolen.mutable_result_fork() = Guid(w1(), 6000006);
  SetBody(not_own.header.mutable_request(), stolen);
  ExpectError(std::move(not_own), "the result RRef id must be the caller's");
  EXPECT_EQ(group_.worker(1).rref_stats().owners, owners);
  // The creator's user deletes free the failed values.
  for (const Refused& r : refused) {
    rpc::OutMessage del;
    del.header.mutable_request()->set_from(0);
    SetBody(del.header.mutable_request(), Delete(Guid(0, r.local), Guid(0, r.local)));
    ExpectOk(std::move(del));
  }
  std::string why;
  EXPECT_TRUE(group_.WaitTablesEmpty(absl::Seconds(20), &why)) << why;
}

// Waits up to 10 s until `done` holds; false when it never did.
bool WaitUntil(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

// A method call on an RRef that overtakes the remote() creating it (as when
// the remote()'s arguments travel through shared memory and the call does
// not) waits on the owner until the value exists, then runs; a to_here()
// that overtakes it likewise.
TEST_F(BadInput, CallsThatOvertakeTheRemoteCreatingTheirRRefWaitForItAndRun) {
  const uint64_t module = 6100001, tensor = 6100002;  // G(0, module), G(0, tensor)
  rpc::OutMessage method = Call("forward", {Tensor(kFloat, {1, 2})}, {at::ones({1, 2})});
  wire::CallRequest call = wire::RequestBody<wire::CallRequest>(method.header.request()).value();
  *call.mutable_self() = RRefValue(w1(), Guid(0, module), Guid(0, module), 0);
  SetBody(method.header.mutable_request(), call);
  rpc::OutMessage fetch;
  fetch.header.mutable_request()->set_from(0);
  SetBody(fetch.header.mutable_request(), Fetch(Guid(0, tensor), Guid(0, tensor)));
  RawClient other(group_.worker(1).self().address);
  absl::StatusOr<rpc::InMessage> method_reply, fetch_reply;
  std::atomic<int> answered{0};
  std::thread early_method([&] {
    method_reply = client_.Call(std::move(method), absl::Seconds(20));
    ++answered;
  });
  std::thread early_fetch([&] {
    fetch_reply = other.Call(std::move(fetch), absl::Seconds(20));
    ++answered;
  });
  // Both reach w1 first and wait there, each on an owner made for it.
  EXPECT_TRUE(WaitUntil([&] { return group_.worker(1).rref_stats().owners >= 2; }));
  EXPECT_EQ(answered.load(), 0) << "answered before their values existed";
  // The remote()s that create the two values.
  auto remote = [](rpc::OutMessage m, uint64_t local) {
    wire::CallRequest make = wire::RequestBody<wire::CallRequest>(m.header.request()).value();
    *make.mutable_result_rref() = Guid(0, local);
    *make.mutable_result_fork() = Guid(0, local);
    SetBody(m.header.mutable_request(), make);
    return m;
  };
  RawClient creator(group_.worker(1).self().address);
  for (auto made : {creator.Call(remote(Call("Affine", {Int(2), Int(2)}), module)),
                    creator.Call(remote(Call("echo", {Tensor(kFloat, {3})}, {at::ones({3})}), tensor))}) {
    ASSERT_TRUE(made.ok()) << made.status();
    EXPECT_FALSE(made->header.response().has_error()) << made->header.response().error().message();
  }
  early_method.join();
  early_fetch.join();
  for (const auto* reply : {&method_reply, &fetch_reply}) {
    ASSERT_TRUE(reply->ok()) << reply->status();
    EXPECT_FALSE((*reply)->header.response().has_error()) << (*reply)->header.response().error().message();
  }
  // (Payloads arrive as bytes.)
  ASSERT_EQ(method_reply->payloads.size(), 1u);
  EXPECT_EQ(method_reply->payloads[0].numel(), 2 * 4);  // the [1, 2] output
  ASSERT_EQ(fetch_reply->payloads.size(), 1u);
  EXPECT_TRUE(at::equal(fetch_reply->payloads[0].view(at::kFloat), at::ones({3})));
  for (uint64_t local : {module, tensor}) {
    rpc::OutMessage del;
    del.header.mutable_request()->set_from(0);
    SetBody(del.header.mutable_request(), Delete(Guid(0, local), Guid(0, local)));
    ExpectOk(std::move(del));
  }
  std::string why;
  EXPECT_TRUE(group_.WaitTablesEmpty(absl::Seconds(20), &why)) << why;
}

// Calls that wait on an owner do not keep it from stopping, and stopping
// answers them with an error: a method call and a to_here() waiting for
// values whose remote() never came (their creator died before sending
// them) get the cause, naming the RRef; a method call waiting behind a
// gap in its caller's order (its predecessor never came) is dropped with
// an error reply.
TEST(RRefOwner, StoppingAnswersCallsWaitingForAValueThatNeverCame) {
  using W = WireValues;
  Group group(1);
  rpc::Agent& w1 = group.worker(1);
  const uint64_t never = 6200001, never_fetched = 6200002, made = 6200003;  // G(0, ...)
  auto call_on = [&](uint64_t local, uint64_t seq) {
    rpc::OutMessage m;
    m.header.mutable_request()->set_from(0);
    wire::CallRequest call;
    call.set_function("forward");
    *call.mutable_self() = W::RRefValue(w1.self().id, W::Guid(0, local), W::Guid(0, local), 0);
    if (seq > 0) {
      *call.mutable_caller_fork() = W::Guid(0, local);
      call.set_seq(seq);
    }
    W::SetBody(m.header.mutable_request(), call);
    return m;
  };
  // The value of G(0, made) exists; a call on it with seq 2 waits for seq 1.
  {
    rpc::OutMessage remote;
    remote.header.mutable_request()->set_from(0);
    wire::CallRequest make;
    make.set_function("Affine");
    *make.add_args() = W::Int(2);
    *make.add_args() = W::Int(2);
    *make.mutable_result_rref() = W::Guid(0, made);
    *make.mutable_result_fork() = W::Guid(0, made);
    W::SetBody(remote.header.mutable_request(), make);
    auto reply = RawClient(w1.self().address).Call(std::move(remote));
    ASSERT_TRUE(reply.ok() && !reply->header.response().has_error());
  }
  rpc::OutMessage fetch;
  fetch.header.mutable_request()->set_from(0);
  W::SetBody(fetch.header.mutable_request(), W::Fetch(W::Guid(0, never_fetched), W::Guid(0, never_fetched)));
  std::vector<rpc::OutMessage> requests;
  requests.push_back(call_on(never, 0));
  requests.push_back(std::move(fetch));
  requests.push_back(call_on(made, 2));
  std::vector<absl::StatusOr<rpc::InMessage>> replies(requests.size());
  std::atomic<int> answered{0};
  std::vector<std::thread> callers;
  for (size_t k = 0; k < requests.size(); ++k) {
    callers.emplace_back([&, k] {
      replies[k] = RawClient(w1.self().address).Call(std::move(requests[k]), absl::Seconds(60));
      ++answered;
    });
  }
  // All three are on w1, waiting: two owners made for them, three requests
  // waiting on owners. (Not active_calls(): it counts w1's own child
  // accepts to the master too, and under load the third call was not in
  // yet, then met a stopped server.)
  EXPECT_TRUE(WaitUntil([&] { return w1.rref_stats().owners >= 3 && w1.rref_stats().waiting_requests >= 3; }))
      << "owners " << w1.rref_stats().owners << ", waiting " << w1.rref_stats().waiting_requests;
  EXPECT_EQ(answered.load(), 0) << "the calls should wait";
  const absl::Time t0 = absl::Now();
  group.StopNow();
  for (auto& t : callers) t.join();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(20)) << "stopping waited for the calls";
  // Answered by w1, not cut off by the server's stop.
  const std::vector<std::string> why = {
      "RRef G(0,6200001): its value was not made before worker 'w1' stopped",
      "RRef G(0,6200002): its value was not made before worker 'w1' stopped",
      "the request was dropped without a reply"};
  for (size_t k = 0; k < replies.size(); ++k) {
    ASSERT_TRUE(replies[k].ok()) << k << ": " << replies[k].status();
    ASSERT_TRUE(replies[k]->header.response().has_error()) << k;
    EXPECT_THAT(replies[k]->header.response().error().message(), HasSubstr(why[k]));
  }
}

TEST_F(BadInput, DoubleDeleteOfAnRRefUserFreesNothingTwice) {
  rpc::Agent& master = group_.master();
  rpc::RRef value = master.remote("w1", "echo", {at::ones({3})}).value();
  ASSERT_TRUE(value.to_here().ok());
  // A second user of the value that the owner knows of (as after a fork).
  const wire::Guid rref = rpc::ToWire(value.id());
  const wire::Guid extra = Guid(0, 4000000);
  rpc::OutMessage fork;
  fork.header.mutable_request()->set_from(0);
  SetBody(fork.header.mutable_request(), Fork(rref, extra));
  ExpectOk(std::move(fork));
  EXPECT_EQ(group_.worker(1).rref_stats().forks, 2);
  // That user is deleted twice: the second delete changes nothing, and the
  // master's own user still reaches the value.
  for (int i = 0; i < 2; ++i) {
    rpc::OutMessage del;
    del.header.mutable_request()->set_from(0);
    SetBody(del.header.mutable_request(), Delete(rref, extra));
    ExpectOk(std::move(del));
    EXPECT_EQ(group_.worker(1).rref_stats().forks, 1);
    EXPECT_EQ(group_.worker(1).rref_stats().owners, 1);
  }
  auto again = value.to_here();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->toTensor().numel(), 3);
  value = rpc::RRef();  // the real delete frees the value
  std::string why;
  EXPECT_TRUE(group_.WaitTablesEmpty(absl::Seconds(20), &why)) << why;
  ExpectServing();
}

TEST_F(BadInput, UnknownAutogradContextIds) {
  // Tensors that require grad, in a context no worker of the group created.
  for (int64_t context : {int64_t{-7}, int64_t{0}, (int64_t{999} << 48) | 5,
                          std::numeric_limits<int64_t>::max()}) {
    rpc::OutMessage m = Call("echo", {Tensor(kFloat, {2}, 0, true)}, {Bytes(8)});
    m.header.mutable_request()->mutable_autograd()->set_context_id(context);
    m.header.mutable_request()->mutable_autograd()->set_message_id(12);
    ExpectError(std::move(m), "unknown distributed autograd context id");
    if (context == 0) continue;  // 0 means "no context" without a message id
    rpc::OutMessage fetch;
    fetch.header.mutable_request()->set_from(0);
    fetch.header.mutable_request()->mutable_autograd()->set_context_id(context);
    SetBody(fetch.header.mutable_request(), Fetch(Guid(0, 1), Guid(0, 1)));
    ExpectError(std::move(fetch), "unknown distributed autograd context id");
  }
  // Gradients for a context this worker does not have.
  wire::Value grads;
  grads.mutable_list()->set_elem(wire::ELEM_TENSOR);
  *grads.mutable_list()->add_items() = Tensor(kFloat, {2});
  ExpectError(Call("remora.autograd.propagate", {Int(123), Int(4), grads}, {Bytes(8)}),
              "unknown distributed autograd context 123");
  EXPECT_EQ(autograd::num_contexts(group_.worker(1)), 0);
  // A gradient message for a real context but a message it never recorded.
  {
    autograd::Context context(group_.master());
    at::Tensor x = at::ones({2});
    x.set_requires_grad(true);
    ASSERT_TRUE(group_.master().rpc_sync("w1", "add", {x, at::ones({2})}).ok());
    EXPECT_EQ(autograd::num_contexts(group_.worker(1)), 1);
    ExpectError(Call("remora.autograd.propagate", {Int(context.id()), Int(987654), grads},
                     {Bytes(8)}),
                "recorded no message 987654");
  }
  ExpectServing();
}

}  // namespace
}  // namespace remora
