// The two ends of rpc/link.h without an agent around them, and the agent's
// use of links: which calls take them, and what happens when a link cannot
// be had or breaks.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/mutex_lock.h"
#include "rpc/agent.h"
#include "rpc/link.h"
#include "tests/support/slices.h"
#include "tests/support/test_group.h"

namespace remora {
namespace link_test {  // unity builds: the helpers' names stay this file's
namespace {

using ::testing::HasSubstr;

// A name no other test process uses.
std::string UniqueName() {
  base::ShmEndpoint e;
  e.pid = static_cast<uint32_t>(getpid());
  e.incarnation = base::RandomIncarnation();
  return rpc::LinkName(e);
}

// The requests a server received, and their reply slots, for the test to
// answer when and how it likes.
struct Inbox {
  absl::Mutex mu;
  std::vector<std::string> frames ABSL_GUARDED_BY(mu);
  std::vector<std::shared_ptr<rpc::ReplySlot>> slots ABSL_GUARDED_BY(mu);

  rpc::LinkServer::Dispatch dispatch() {
    return [this](grpc::ByteBuffer frame, std::shared_ptr<rpc::ReplySlot> slot) {
      base::MutexLock lock(mu);
      frames.push_back(StringOf(frame));
      slots.push_back(std::move(slot));
    };
  }
  // Replies `text` to request `i`; false when its slot says it could not.
  bool Reply(size_t i, const std::string& text) {
    base::MutexLock lock(mu);
    return slots[i]->Reply(BufferOf(text));
  }
  void AwaitCount(size_t n) {
    base::MutexLock lock(mu);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return frames.size() >= n; };
    mu.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  }
};

// A link server on a fresh name handing its requests to `inbox`, and a
// client connected to it (null, the failure reported, when either failed).
struct Linked {
  std::string name = UniqueName();
  std::unique_ptr<rpc::LinkServer> server;
  std::shared_ptr<rpc::LinkClient> client;

  explicit Linked(Inbox& inbox) {
    auto s = rpc::LinkServer::Listen(name, "", inbox.dispatch());
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return;
    server = std::move(*s);
    auto c = rpc::LinkClient::Connect(name, "", absl::Seconds(5));
    EXPECT_TRUE(c.ok()) << c.status();
    if (c.ok()) client = std::move(*c);
  }
};

// One call's outcome, waited for.
struct Outcome {
  absl::Notification done;
  absl::StatusOr<std::string> reply = absl::UnknownError("no reply yet");
  rpc::LinkClient::Done callback() {
    return [this](absl::StatusOr<grpc::ByteBuffer> r) {
      reply = r.ok() ? absl::StatusOr<std::string>(StringOf(*r)) : r.status();
      done.Notify();
    };
  }
  bool Wait() { return done.WaitForNotificationWithTimeout(absl::Seconds(10)); }
};

TEST(LocalLink, RepliesFindTheirCallsInAnyOrder) {
  Inbox inbox;
  Linked link(inbox);
  ASSERT_NE(link.client, nullptr);
  // An empty frame, a short one (held inline by gRPC's slices) and 8 MiB.
  const std::vector<std::string> sent = {"", "abc", std::string(8 << 20, 'x')};
  std::vector<Outcome> outcomes(sent.size());
  for (size_t i = 0; i < sent.size(); ++i) {
    link.client->Send(BufferOf(sent[i]), absl::Now() + absl::Seconds(30), outcomes[i].callback());
  }
  inbox.AwaitCount(sent.size());
  {
    base::MutexLock lock(inbox.mu);
    ASSERT_EQ(inbox.frames.size(), sent.size());
    for (size_t i = 0; i < sent.size(); ++i) EXPECT_EQ(inbox.frames[i], sent[i]);
    // Answered last to first, each with its request backwards.
    for (size_t i = sent.size(); i-- > 0;) {
      EXPECT_TRUE(inbox.slots[i]->Reply(BufferOf(std::string(sent[i].rbegin(), sent[i].rend()))));
      EXPECT_FALSE(inbox.slots[i]->Reply(BufferOf("again")));  // one reply per call
    }
  }
  for (size_t i = 0; i < sent.size(); ++i) {
    ASSERT_TRUE(outcomes[i].Wait());
    ASSERT_TRUE(outcomes[i].reply.ok()) << outcomes[i].reply.status();
    EXPECT_EQ(*outcomes[i].reply, std::string(sent[i].rbegin(), sent[i].rend()));
  }
}

TEST(LocalLink, AWrongTokenOrNoServerIsRefusedAtConnect) {
  const std::string name = UniqueName();
  EXPECT_FALSE(rpc::LinkClient::Connect(name, "", absl::Seconds(1)).ok());  // nobody listens
  Inbox inbox;
  auto server = rpc::LinkServer::Listen(name, "secret", inbox.dispatch());
  ASSERT_TRUE(server.ok()) << server.status();
  auto wrong = rpc::LinkClient::Connect(name, "guess", absl::Seconds(5));
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("refused"));
  EXPECT_FALSE(rpc::LinkClient::Connect(name, "", absl::Seconds(5)).ok());
  EXPECT_TRUE(rpc::LinkClient::Connect(name, "secret", absl::Seconds(5)).ok());
  // A second server cannot take the same name.
  EXPECT_FALSE(rpc::LinkServer::Listen(name, "", inbox.dispatch()).ok());
}

TEST(LocalLink, CallsInFlightFailWhenTheServerGoesAndPastTheirDeadline) {
  Inbox inbox;
  Linked link(inbox);
  ASSERT_NE(link.client, nullptr);
  Outcome late, unanswered;
  const absl::Time start = absl::Now();
  link.client->Send(BufferOf("late"), start + absl::Milliseconds(300), late.callback());
  link.client->Send(BufferOf("never"), start + absl::Seconds(60), unanswered.callback());
  inbox.AwaitCount(2);
  ASSERT_TRUE(late.Wait());
  EXPECT_EQ(late.reply.status().code(), absl::StatusCode::kDeadlineExceeded) << late.reply.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_FALSE(unanswered.done.HasBeenNotified());
  // A reply after the deadline is dropped; the link still works.
  inbox.Reply(0, "too late");
  EXPECT_TRUE(link.client->alive());
  // The server stops without answering (a process that ended): the call
  // fails at once, not at its deadline, and so does every later one.
  link.server->Stop(absl::ZeroDuration());
  ASSERT_TRUE(unanswered.Wait());
  EXPECT_EQ(unanswered.reply.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_FALSE(link.client->alive());
  Outcome after;
  link.client->Send(BufferOf("after"), absl::Now() + absl::Seconds(60), after.callback());
  ASSERT_TRUE(after.Wait());
  EXPECT_FALSE(after.reply.ok());
  EXPECT_FALSE(inbox.Reply(1, "gone"));  // the link is closed
}

// A link server written by hand, on a thread: it says hello as a real one
// does, takes the first request's header if `take_request`, then writes
// `then` and reads nothing more until the test is over: a peer stopped
// (SIGSTOP) or hung there.
class StoppedPeer {
 public:
  StoppedPeer(bool take_request, std::string then) : name_(UniqueName()) {
    listener_ = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, name_.data(), name_.size());
    const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name_.size());
    EXPECT_EQ(bind(listener_, reinterpret_cast<sockaddr*>(&addr), len), 0);
    EXPECT_EQ(listen(listener_, 1), 0);
    thread_ = std::thread([this, take_request, then = std::move(then)] {
      const int fd = accept(listener_, nullptr, nullptr);
      char record[24];
      EXPECT_EQ(read(fd, record, sizeof(record)), 24);  // the hello, no token
      const uint32_t hello_ok[6] = {0x524c4b02, 0, 0, 0, 0, 0};
      EXPECT_EQ(write(fd, hello_ok, sizeof(hello_ok)), 24);
      if (take_request) {
        EXPECT_GE(read(fd, record, sizeof(record)), 1);
      }
      if (!then.empty()) {
        EXPECT_EQ(write(fd, then.data(), then.size()), static_cast<ssize_t>(then.size()));
      }
      over_.WaitForNotificationWithTimeout(absl::Seconds(30));
      close(fd);
    });
  }
  ~StoppedPeer() {
    over_.Notify();
    thread_.join();
    close(listener_);
  }
  const std::string& name() const { return name_; }

 private:
  const std::string name_;
  int listener_ = -1;
  absl::Notification over_;
  std::thread thread_;
};

TEST(LocalLink, APeerStoppedMidReplyHoldsUpNoDeadline) {
  StoppedPeer peer(/*take_request=*/true, "\x04\x4b\x4c\x52");  // a reply's first bytes
  auto client = rpc::LinkClient::Connect(peer.name(), "", absl::Seconds(5));
  ASSERT_TRUE(client.ok()) << client.status();
  Outcome outcome;
  const absl::Time start = absl::Now();
  (*client)->Send(BufferOf("q"), start + absl::Milliseconds(300), outcome.callback());
  ASSERT_TRUE(outcome.Wait());
  EXPECT_EQ(outcome.reply.status().code(), absl::StatusCode::kDeadlineExceeded) << outcome.reply.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

// The keepalive: a call whose deadline is a minute away fails within
// seconds when its peer stops answering anything, also its pings; the link
// closes, as when the process ends.
TEST(LocalLink, ACallToAPeerThatAnswersNoPingFailsWithinSeconds) {
  StoppedPeer peer(/*take_request=*/true, "");
  auto client = rpc::LinkClient::Connect(peer.name(), "", absl::Seconds(5));
  ASSERT_TRUE(client.ok()) << client.status();
  Outcome outcome;
  const absl::Time start = absl::Now();
  (*client)->Send(BufferOf("q"), start + absl::Seconds(60), outcome.callback());
  ASSERT_TRUE(outcome.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(outcome.reply.status().code(), absl::StatusCode::kUnavailable) << outcome.reply.status();
  EXPECT_THAT(outcome.reply.status().message(),
              HasSubstr("answered no keepalive ping within 2s (is its process stopped or hung?)"));
  EXPECT_GE(took, rpc::LinkClient::kKeepaliveTime + rpc::LinkClient::kKeepaliveTimeout);
  EXPECT_LT(took, absl::Seconds(20));
  EXPECT_FALSE((*client)->alive());
}

// A request too large for the socket's buffer, to a peer that reads
// nothing: the write is stuck, no ping can go, and the call fails as
// soon as one would have gone unanswered; the writer is let go.
TEST(LocalLink, AWriteStuckOnAPeerThatReadsNothingFailsWithinSeconds) {
  StoppedPeer peer(/*take_request=*/false, "");
  auto client = rpc::LinkClient::Connect(peer.name(), "", absl::Seconds(5));
  ASSERT_TRUE(client.ok()) << client.status();
  Outcome outcome;
  const absl::Time start = absl::Now();
  std::thread writer([&client, &outcome, start] {
    (*client)->Send(BufferOf(std::string(16 << 20, 'x')), start + absl::Seconds(60), outcome.callback());
  });
  const bool failed = outcome.done.WaitForNotificationWithTimeout(absl::Seconds(30));
  if (!failed) (*client)->Close(absl::CancelledError("the test gave up"));  // lets the writer go
  writer.join();
  ASSERT_TRUE(failed) << "the stuck write held its call for 30 s";
  EXPECT_EQ(outcome.reply.status().code(), absl::StatusCode::kUnavailable) << outcome.reply.status();
  EXPECT_THAT(outcome.reply.status().message(), HasSubstr("took no byte of a request for"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

// A peer that is alive but slow to reply answers the pings meanwhile: its
// call outlives the keepalive's timeout and gets its reply.
TEST(LocalLink, ASlowButLivePeerKeepsItsCallsPastTheKeepalive) {
  Inbox inbox;
  Linked link(inbox);
  ASSERT_NE(link.client, nullptr);
  Outcome slow;
  link.client->Send(BufferOf("q"), absl::Now() + absl::Seconds(60), slow.callback());
  inbox.AwaitCount(1);
  absl::SleepFor(rpc::LinkClient::kKeepaliveTime + rpc::LinkClient::kKeepaliveTimeout + absl::Seconds(1));
  EXPECT_FALSE(slow.done.HasBeenNotified()) << slow.reply.status();
  inbox.Reply(0, "at last");
  ASSERT_TRUE(slow.Wait());
  ASSERT_TRUE(slow.reply.ok()) << slow.reply.status();
  EXPECT_EQ(*slow.reply, "at last");
  EXPECT_TRUE(link.client->alive());
}

TEST(LocalLink, StopWaitsForTheRepliesInHand) {
  Inbox inbox;
  Linked link(inbox);
  ASSERT_NE(link.client, nullptr);
  Outcome answered;
  link.client->Send(BufferOf("q"), absl::Now() + absl::Seconds(60), answered.callback());
  inbox.AwaitCount(1);
  std::thread late_reply([&inbox] {
    absl::SleepFor(absl::Milliseconds(200));
    inbox.Reply(0, "a");
  });
  link.server->Stop(absl::Seconds(5));
  late_reply.join();
  ASSERT_TRUE(answered.Wait());
  ASSERT_TRUE(answered.reply.ok()) << answered.reply.status();
  EXPECT_EQ(*answered.reply, "a");
  EXPECT_FALSE(rpc::LinkClient::Connect(link.name, "", absl::Seconds(1)).ok());  // no new links
}

TEST(LocalLink, TheAgentSendsAsynchronousCallsOnLinks) {
  Group g(2);
  const int64_t before = g.master().calls_on_links();
  auto r = g.master().rpc_async("w1", "add", {int64_t{2}, int64_t{3}}).wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->toInt(), 5);
  EXPECT_GT(g.master().calls_on_links(), before);
  // rpc_sync keeps its pooled streams.
  const int64_t async_calls = g.master().calls_on_links();
  auto s = g.master().rpc_sync("w2", "add", {int64_t{1}, int64_t{1}});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(g.master().calls_on_links(), async_calls);
  // A worker calls another on its link too.
  auto nested = g.worker(1).rpc_async("w2", "add", {int64_t{4}, int64_t{4}}).wait();
  ASSERT_TRUE(nested.ok()) << nested.status();
  EXPECT_EQ(nested->toInt(), 8);
  EXPECT_GT(g.worker(1).calls_on_links(), 0);
}

TEST(LocalLink, AnIdleRpcSyncStreamDoesNotHoldUpTheShutdown) {
  // The master's rpc_sync leaves a stream to w1 idle; the shutdown's own
  // messages then go on links, and w1 stops while that stream is still
  // open. Its server closes the stream: the read waiting on it for the
  // next request must not hold the server's shutdown to its 2 s deadline.
  auto g = std::make_unique<Group>(1);
  auto s = g->master().rpc_sync("w1", "add", {int64_t{1}, int64_t{1}});
  ASSERT_TRUE(s.ok()) << s.status();
  const absl::Time start = absl::Now();
  g.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(LocalLink, PromptFunctionsRunWhereTheLinkReceivesThem) {
  Group g(1);
  auto prompt = g.master().rpc_async("w1", "prompt").wait();
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  EXPECT_TRUE(prompt->toBool());
  auto other = g.master().rpc_async("w1", "not_prompt").wait();
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_FALSE(other->toBool());
  // Over gRPC (rpc_sync's stream) every function runs on the pool.
  auto over_grpc = g.master().rpc_sync("w1", "prompt");
  ASSERT_TRUE(over_grpc.ok()) << over_grpc.status();
  EXPECT_FALSE(over_grpc->toBool());
  rpc::Registry registry;
  EXPECT_EQ(registry.MarkPrompt("nothing").code(), absl::StatusCode::kNotFound);
}

TEST(LocalLink, OffByOptionCallsGoOverGrpc) {
  rpc::AgentOptions off;
  off.local_links = false;
  Group g(1, off);
  auto r = g.master().rpc_async("w1", "add", {int64_t{2}, int64_t{3}}).wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(g.master().calls_on_links(), 0);
}

TEST(LocalLink, ATokenTravelsOnTheLink) {
  rpc::AgentOptions secret;
  secret.token = "s3cret";
  Group g(1, secret);
  auto r = g.master().rpc_async("w1", "add", {int64_t{2}, int64_t{3}}).wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->toInt(), 5);
  EXPECT_GT(g.master().calls_on_links(), 0);
}

// AgentOptions::busy_poll: the links' readers and the lanes look for the
// next message before they sleep. Calls that come while they look and
// after they slept are answered, and the group stops at once; an
// out-of-range setting is refused, named.
TEST(LocalLink, BusyPollingAgentsAnswerAndStopAtOnce) {
  rpc::AgentOptions busy;
  busy.busy_poll = absl::Milliseconds(2);
  auto g = std::make_unique<Group>(2, busy);
  for (int i = 0; i < 20; ++i) {
    if (i % 5 == 0) absl::SleepFor(absl::Milliseconds(10));  // past the poll: the readers slept
    auto r = g->master().rpc_async(i % 2 == 0 ? "w1" : "w2", "add", {int64_t{i}, int64_t{1}}).wait();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->toInt(), i + 1);
  }
  EXPECT_GE(g->master().calls_on_links(), 20);
  const absl::Time start = absl::Now();
  g.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));

  rpc::Registry registry;
  rpc::AgentOptions too_long;
  too_long.name = "w9";
  too_long.busy_poll = absl::Milliseconds(20);
  auto refused = rpc::Agent::Start(too_long, &registry);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("'w9': busy_poll 20ms is not within 0 and 10ms"));
}

}  // namespace
}  // namespace link_test
}  // namespace remora
