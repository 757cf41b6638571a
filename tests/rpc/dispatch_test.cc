// The dispatch table (rpc/dispatch.h) and requests by kind
// (proto/request.h): registering, finding and running handlers without
// sockets, and a request kind that a subsystem above rpc/ adds to real
// agents through Agent::requests().
#include <atomic>
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "proto/request.h"
#include "proto/rref.pb.h"
#include "rpc/agent_impl.h"
#include "rpc/dispatch.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;

// A Responder::Server that keeps what would be sent.
class FakeServer final : public rpc::Responder::Server {
 public:
  void SendReply(rpc::ReplySlot& slot, base::WorkerId to, rpc::OutMessage message) override {
    replies.push_back(std::move(message));
    reply_to.push_back(to);
  }
  absl::Status EncodeReplyValue(base::WorkerId to, int64_t context_id, const c10::IValue& value,
                                rpc::OutMessage* message) override {
    if (!value.isInt()) return absl::UnimplementedError("the fake encodes ints only");
    message->header.mutable_response()->mutable_value()->set_i(value.toInt());
    return absl::OkStatus();
  }
  const std::string& server_name() const override { return name; }

  std::string name = "fake";
  std::vector<rpc::OutMessage> replies;
  std::vector<base::WorkerId> reply_to;
};

// A reply slot that is never used (FakeServer keeps the replies).
class NoSlot final : public rpc::ReplySlot {
 public:
  bool Reply(grpc::ByteBuffer) override { return true; }
};

// `body` as a received message from worker `from`.
rpc::InMessage Inbound(const google::protobuf::Message& body, base::WorkerId from) {
  rpc::InMessage m;
  *m.header.mutable_request() = wire::MakeRequest(body);
  m.header.mutable_request()->set_from(from);
  return m;
}

// Runs the handler that `table` has for `message`'s kind.
void Serve(const rpc::DispatchTable& table, rpc::InMessage message, FakeServer* server) {
  const base::WorkerId from = static_cast<base::WorkerId>(message.header.request().from());
  const rpc::DispatchTable::Entry* entry = table.Find(message.header.request().kind());
  ASSERT_NE(entry, nullptr) << message.header.request().kind();
  entry->handler(std::move(message),
                 std::make_shared<rpc::Responder>(std::make_shared<NoSlot>(), server, from));
}

TEST(RequestKinds, MakeRequestNamesTheBodysMessageAndRequestBodyReadsItBack) {
  wire::FetchRequest fetch;
  fetch.mutable_rref_id()->set_worker(2);
  fetch.mutable_rref_id()->set_local(7);
  const wire::Request r = wire::MakeRequest(fetch);
  EXPECT_EQ(r.kind(), "remora.wire.FetchRequest");
  auto back = wire::RequestBody<wire::FetchRequest>(r);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->rref_id().local(), 7u);
  // Another kind, or bytes that do not parse, are errors that say so.
  auto wrong = wire::RequestBody<wire::ForkRequest>(r);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.status().message()),
              HasSubstr("'remora.wire.FetchRequest' is not a remora.wire.ForkRequest"));
  wire::Request garbled = r;
  garbled.set_body("\xff\xff\xff");
  EXPECT_THAT(std::string(wire::RequestBody<wire::FetchRequest>(garbled).status().message()),
              HasSubstr("malformed body of a remora.wire.FetchRequest request"));
}

TEST(DispatchTable, RunsTheHandlerOfEachKindWithItsParsedBody) {
  rpc::DispatchTable table;
  std::atomic<int> forks{0}, deletes{0};
  ASSERT_TRUE(table
                  .Register<wire::ForkRequest>(
                      [&](rpc::Incoming<wire::ForkRequest> in, std::shared_ptr<rpc::Responder> r) {
                        EXPECT_EQ(in.from, 3);
                        EXPECT_EQ(in.body.fork_id().local(), 41u);
                        ++forks;
                        r->ReplyValue(c10::IValue(int64_t{41}));
                      })
                  .ok());
  ASSERT_TRUE(table
                  .Register<wire::UserDelete>(
                      [&](rpc::Incoming<wire::UserDelete>, std::shared_ptr<rpc::Responder> r) {
                        ++deletes;
                        r->ReplyStatus(absl::OkStatus());
                      })
                  .ok());
  FakeServer server;
  wire::ForkRequest fork;
  fork.mutable_fork_id()->set_local(41);
  Serve(table, Inbound(fork, 3), &server);
  Serve(table, Inbound(wire::UserDelete(), 3), &server);
  EXPECT_EQ(forks.load(), 1);
  EXPECT_EQ(deletes.load(), 1);
  ASSERT_EQ(server.replies.size(), 2u);
  EXPECT_EQ(server.replies[0].header.response().value().i(), 41);
  EXPECT_EQ(server.reply_to[0], 3);
  EXPECT_FALSE(server.replies[1].header.response().has_error());
  EXPECT_EQ(table.Find("remora.wire.ChildAccept"), nullptr);
  EXPECT_EQ(table.Find(""), nullptr);
}

TEST(DispatchTable, AKindHasOneHandler) {
  rpc::DispatchTable table;
  auto handler = [](rpc::Incoming<wire::ChildAccept>, std::shared_ptr<rpc::Responder> r) {
    r->Reply(rpc::OutMessage{});
  };
  ASSERT_TRUE(table.Register<wire::ChildAccept>(handler).ok());
  absl::Status again = table.Register<wire::ChildAccept>(handler);
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(again.message()), HasSubstr("remora.wire.ChildAccept"));
}

TEST(DispatchTable, AMalformedBodyIsAnErrorReplyAndTheHandlerNeverRuns) {
  rpc::DispatchTable table;
  bool ran = false;
  ASSERT_TRUE(table
                  .Register<wire::CallRequest>(
                      [&](rpc::Incoming<wire::CallRequest>, std::shared_ptr<rpc::Responder> r) {
                        ran = true;
                        r->Reply(rpc::OutMessage{});
                      })
                  .ok());
  FakeServer server;
  server.name = "w7";
  rpc::InMessage m = Inbound(wire::CallRequest(), 1);
  m.header.mutable_request()->set_body("\x0a\xff");  // a string field whose length runs off
  Serve(table, std::move(m), &server);
  EXPECT_FALSE(ran);
  ASSERT_EQ(server.replies.size(), 1u);
  const wire::Error& e = server.replies[0].header.response().error();
  EXPECT_EQ(e.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(e.worker(), "w7");
  EXPECT_THAT(e.message(), HasSubstr("malformed body"));
}

TEST(DispatchTable, AResponderDroppedWithoutAReplyAnswersWithAnError) {
  rpc::DispatchTable table;
  ASSERT_TRUE(
      table.Register<wire::Ping>([](rpc::Incoming<wire::Ping>, std::shared_ptr<rpc::Responder>) {}).ok());
  FakeServer server;
  Serve(table, Inbound(wire::Ping(), 2), &server);
  ASSERT_EQ(server.replies.size(), 1u);
  EXPECT_THAT(server.replies[0].header.response().error().message(),
              HasSubstr("dropped without a reply"));
}

// A subsystem above rpc/ (data parallelism, checkpoints, ...) adds its own
// request kind without touching the agent: here wire::Guid stands in for
// its message.
TEST(DispatchTable, ASubsystemAddsARequestKindToRealAgents) {
  std::atomic<int> served{0};
  Group g(2, {}, [&served](rpc::Agent& agent) {
    ASSERT_TRUE(agent.requests()
                    .Register<wire::Guid>(
                        [&served, &agent](rpc::Incoming<wire::Guid> in, std::shared_ptr<rpc::Responder> r) {
                          ++served;
                          if (in.body.local() == 0) {
                            return r->ReplyError(absl::InvalidArgumentError(
                                absl::StrCat("no id from ", agent.NameOf(in.from))));
                          }
                          r->Reply(rpc::OutMessage{});
                        })
                    .ok());
  });
  wire::Guid id;
  id.set_worker(0);
  id.set_local(5);
  for (int w = 1; w <= 2; ++w) {
    absl::StatusOr<rpc::Empty> done =
        g.master().impl().SendControl(g.worker(w).self().id, wire::MakeRequest(id)).wait();
    EXPECT_TRUE(done.ok()) << done.status();
  }
  EXPECT_EQ(served.load(), 2);
  // Its errors reach the sender naming the worker, as any request's do.
  absl::StatusOr<rpc::Empty> refused =
      g.worker(1).impl().SendControl(g.worker(2).self().id, wire::MakeRequest(wire::Guid())).wait();
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("worker 'w2'"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("no id from w1"));
}

}  // namespace
}  // namespace remora
