// The two ends of rpc/stream.h without an agent around them: a bare gRPC
// server whose streams hand requests to a function, and SyncStream calls
// to it.
#include <pthread.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <set>
#include <thread>

#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "autograd/dist_autograd.h"
#include "proto/request.h"
#include "proto/rref.pb.h"
#include "rpc/agent.h"
#include "rpc/message.h"
#include "base/mutex_lock.h"
#include "rpc/stream.h"
#include "examples/stock_worker.h"
#include "tests/support/slices.h"
#include "tests/support/test_group.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

namespace remora {
namespace {

using ::testing::HasSubstr;

// A bare gRPC server whose streams hand each request to `dispatch`: the
// two ends of rpc/stream.h without an agent around them.
class StreamServer final : public grpc::CallbackGenericService {
 public:
  explicit StreamServer(rpc::ServerStream::Dispatch dispatch) : dispatch_(std::move(dispatch)) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterCallbackGenericService(this);
    server_ = builder.BuildAndStart();
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials());
    stub_ = std::make_unique<grpc::GenericStub>(channel_);
  }
  ~StreamServer() override {
    CloseAll(grpc::Status(grpc::StatusCode::UNAVAILABLE, "test over"));
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    auto* stream = new rpc::ServerStream(dispatch_, [this](const std::shared_ptr<rpc::ServerStream::State>& s) {
      base::MutexLock lock(mu_);
      open_.erase(s);
    });
    base::MutexLock lock(mu_);
    open_.insert(stream->state());
    return stream;
  }

  void CloseAll(const grpc::Status& status) {
    std::vector<std::shared_ptr<rpc::ServerStream::State>> open;
    {
      base::MutexLock lock(mu_);
      open.assign(open_.begin(), open_.end());
    }
    for (const auto& s : open) rpc::ServerStream::Close(s, status);
  }

  std::unique_ptr<rpc::SyncStream> Open() { return rpc::SyncStream::Open(stub_.get(), ""); }

 private:
  const rpc::ServerStream::Dispatch dispatch_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::GenericStub> stub_;
  absl::Mutex mu_;
  std::set<std::shared_ptr<rpc::ServerStream::State>> open_ ABSL_GUARDED_BY(mu_);
};

// Requests a handler holds on to, to answer (or drop) when the test says.
struct HeldRequests {
  absl::Mutex mu;
  std::vector<std::pair<std::string, std::shared_ptr<rpc::ReplySlot>>> held ABSL_GUARDED_BY(mu);
  rpc::ServerStream::Dispatch Dispatch() {
    return [this](grpc::ByteBuffer frame, std::shared_ptr<rpc::ReplySlot> slot) {
      base::MutexLock lock(mu);
      held.emplace_back(StringOf(frame), std::move(slot));
    };
  }
  size_t count() {
    base::MutexLock lock(mu);
    return held.size();
  }
  bool WaitFor(size_t n) {
    base::MutexLock lock(mu);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return held.size() >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  }
};

const absl::Duration kNoSpin = absl::ZeroDuration();

TEST(Stream, CallsGoOneAfterAnotherOnOneStream) {
  StreamServer server([](grpc::ByteBuffer frame, std::shared_ptr<rpc::ReplySlot> slot) {
    slot->Reply(BufferOf(StringOf(frame) + "!"));
  });
  auto stream = server.Open();
  for (int i = 0; i < 100; ++i) {
    bool sent = false;
    auto reply = stream->Call(BufferOf(absl::StrCat("call ", i)), [&sent] { sent = true; },
                              absl::Now() + absl::Seconds(10), i % 2 ? kNoSpin : absl::Microseconds(200));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(StringOf(*reply), absl::StrCat("call ", i, "!"));
    EXPECT_TRUE(sent);
    EXPECT_TRUE(stream->usable());
  }
}

TEST(Stream, TimedOutOrCancelledCallLeavesTheStreamUnusable) {
  HeldRequests handler;
  StreamServer server(handler.Dispatch());
  auto stream = server.Open();
  const absl::Time start = absl::Now();
  auto late = stream->Call(BufferOf("a"), nullptr, absl::Now() + absl::Milliseconds(100), kNoSpin);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_FALSE(stream->usable());
  EXPECT_EQ(stream->Call(BufferOf("b"), nullptr, absl::Now() + absl::Seconds(1), kNoSpin)
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);

  auto other = server.Open();
  const size_t held = handler.count();  // "a" may or may not have arrived
  std::thread canceller([&] {
    handler.WaitFor(held + 1);
    other->Cancel();
  });
  auto cancelled = other->Call(BufferOf("c"), nullptr, absl::Now() + absl::Seconds(60), kNoSpin);
  canceller.join();
  EXPECT_EQ(cancelled.status().code(), absl::StatusCode::kCancelled) << cancelled.status();
  EXPECT_FALSE(other->usable());
}

// Close() (an agent stopping) lets the request in hand have its reply, then
// ends the stream; an idle stream that the callee ended is seen as unusable
// before a call is sent on it.
TEST(Stream, CloseAnswersTheRequestInHandThenEndsTheStream) {
  HeldRequests handler;
  StreamServer server(handler.Dispatch());
  auto stream = server.Open();
  absl::StatusOr<grpc::ByteBuffer> reply;
  std::thread caller([&] {
    reply = stream->Call(BufferOf("q"), nullptr, absl::Now() + absl::Seconds(10), kNoSpin);
  });
  EXPECT_TRUE(handler.WaitFor(1));
  server.CloseAll(grpc::Status(grpc::StatusCode::UNAVAILABLE, "stopping"));
  {
    base::MutexLock lock(handler.mu);
    if (handler.held.empty()) {
      stream->Cancel();  // fails the call below instead of hanging the test
    } else {
      EXPECT_TRUE(handler.held[0].second->Reply(BufferOf("answer")));
    }
  }
  caller.join();
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(StringOf(*reply), "answer");
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (stream->usable() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_FALSE(stream->usable());
}

// A request dropped without a reply fails its call instead of leaving the
// caller waiting for its deadline.
TEST(Stream, RequestDroppedWithoutAReplyFailsTheCall) {
  StreamServer server([](grpc::ByteBuffer, std::shared_ptr<rpc::ReplySlot>) {});
  auto stream = server.Open();
  const absl::Time start = absl::Now();
  auto r = stream->Call(BufferOf("x"), nullptr, absl::Now() + absl::Seconds(30), kNoSpin);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

}  // namespace
}  // namespace remora
