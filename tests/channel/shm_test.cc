// The shared-memory channel: segments and descriptors without sockets, the
// frame format with out-of-band payloads, then agents that choose it by
// themselves (in one process and across real worker processes).
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <thread>

#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "launch/local_group.h"
#include "rpc/message.h"
#include "channel/route.h"
#include "channel/shm/shm.h"
#include "tests/support/test_functions.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;


at::Tensor Bytes(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), {static_cast<int64_t>(t.nbytes())}, at::kByte);
}

at::Tensor Alloc(size_t n) { return at::empty({static_cast<int64_t>(n)}, at::kByte); }

// Two channels in one process that may read each other's segments.
struct Pair {
  channel::ShmChannel a{channel::ShmChannel::Options{}};
  channel::ShmChannel b{channel::ShmChannel::Options{}};
  Pair() {
    a.Allow({b.endpoint()});
    b.Allow({a.endpoint()});
  }
};

TEST(ShmChannel, OffersItselfOnThisHost) {
  channel::ShmChannel c{channel::ShmChannel::Options{}};
  EXPECT_FALSE(c.endpoint().domain.empty());
  EXPECT_EQ(c.endpoint().domain, channel::ShmDomain());
  EXPECT_NE(c.endpoint().incarnation, channel::ShmChannel(channel::ShmChannel::Options{}).endpoint().incarnation);
  channel::ShmChannel off{channel::ShmChannel::Options{/*enabled=*/false}};
  EXPECT_TRUE(off.endpoint().domain.empty());
  EXPECT_FALSE(off.Write(at::rand({1 << 16})).has_value());
}

TEST(ShmChannel, WriteThenReadCopiesTheBytesAndReusesTheSegment) {
  Pair p;
  at::Tensor x = at::rand({1 << 18});  // 1 MiB
  auto d = p.a.Write(Bytes(x));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(p.a.stats().busy, 1);
  auto got = p.b.Read(*d, x.nbytes(), Alloc);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(at::equal(*got, Bytes(x)));
  EXPECT_EQ(p.a.stats().busy, 0);
  EXPECT_EQ(p.b.stats().reads, 1);
  EXPECT_EQ(p.b.stats().mapped_peers, 1);

  // The freed segment carries the next payload; the receiver's mapping too.
  at::Tensor y = at::rand({1 << 18});
  auto d2 = p.a.Write(Bytes(y));
  ASSERT_TRUE(d2.has_value());
  EXPECT_EQ(d2->segment(), d->segment());
  EXPECT_GT(d2->seq(), d->seq());
  auto got2 = p.b.Read(*d2, y.nbytes(), Alloc);
  ASSERT_TRUE(got2.ok()) << got2.status();
  EXPECT_TRUE(at::equal(*got2, Bytes(y)));
  EXPECT_EQ(p.a.stats().segments, 1);
  EXPECT_EQ(p.b.stats().mapped_peers, 1);
}

TEST(ShmChannel, PayloadsInFlightTakeSeparateSegments) {
  Pair p;
  at::Tensor x = at::rand({1 << 18}), y = at::rand({1 << 18});
  auto dx = p.a.Write(Bytes(x));
  auto dy = p.a.Write(Bytes(y));
  ASSERT_TRUE(dx && dy);
  EXPECT_NE(dx->segment(), dy->segment());
  auto gy = p.b.Read(*dy, y.nbytes(), Alloc);
  auto gx = p.b.Read(*dx, x.nbytes(), Alloc);
  ASSERT_TRUE(gx.ok() && gy.ok());
  EXPECT_TRUE(at::equal(*gx, Bytes(x)));
  EXPECT_TRUE(at::equal(*gy, Bytes(y)));
}

TEST(ShmChannel, AReadTwiceOrAfterReclaimIsALossNotTornData) {
  Pair p;
  at::Tensor x = at::rand({1 << 18});
  auto d = p.a.Write(Bytes(x));
  ASSERT_TRUE(d.has_value());
  ASSERT_TRUE(p.b.Read(*d, x.nbytes(), Alloc).ok());
  auto again = p.b.Read(*d, x.nbytes(), Alloc);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kDataLoss);

  auto d2 = p.a.Write(Bytes(x));
  ASSERT_TRUE(d2.has_value());
  p.a.Reclaim(*d2);  // the call failed: the sender takes the segment back
  EXPECT_EQ(p.a.stats().busy, 0);
  auto late = p.b.Read(*d2, x.nbytes(), Alloc);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("took it back"));
}

TEST(ShmChannel, TheReaderCopiesWhileTheSenderFills) {
  Pair p;
  at::Tensor x = at::rand({1 << 22});  // 16 MiB: 16 published chunks
  auto d = p.a.Reserve(x.nbytes());
  ASSERT_TRUE(d.has_value());
  absl::StatusOr<at::Tensor> got;
  std::thread reader([&] { got = p.b.Read(*d, x.nbytes(), Alloc); });
  absl::SleepFor(absl::Milliseconds(5));
  p.a.Fill(*d, Bytes(x));
  reader.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(at::equal(*got, Bytes(x)));
  EXPECT_EQ(p.a.stats().busy, 0);
}

TEST(ShmChannel, ASenderThatNeverFillsFailsTheReadInTime) {
  channel::ShmChannel::Options quick;
  quick.stall_timeout = absl::Milliseconds(200);
  channel::ShmChannel a{channel::ShmChannel::Options{}}, b{quick};
  b.Allow({a.endpoint()});
  auto d = a.Reserve(1 << 20);
  ASSERT_TRUE(d.has_value());
  auto r = b.Read(*d, 1 << 20, Alloc);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("no progress"));
  // A failed call's segment filled late is still taken back.
  a.Reclaim(*d);
  a.Fill(*d, at::zeros({1 << 20}, at::kByte));
  EXPECT_EQ(a.stats().busy, 0);
}

// A sender killed while it writes (its process gone, or a zombie not yet
// reaped) fails the read at once, not after stall_timeout; so does a stop
// of the reader's agent.
TEST(ShmChannel, ASenderThatEndedOrAStopFailsTheReadAtOnce) {
  Pair p;
  at::Tensor x = at::rand({1 << 18});
  auto first = p.a.Write(Bytes(x));
  ASSERT_TRUE(first.has_value());
  ASSERT_TRUE(p.b.Read(*first, x.nbytes(), Alloc).ok());  // (maps the segment)
  auto d = p.a.Reserve(x.nbytes());
  ASSERT_TRUE(d.has_value());
  ASSERT_EQ(d->segment(), first->segment()) << "the test needs a segment the reader has mapped";
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);  // (a process that has ended)
  // The sender as the group knows it, now that process (the segment stays
  // mapped: the same incarnation).
  base::ShmEndpoint ended = p.a.endpoint();
  ended.pid = static_cast<uint32_t>(child);
  p.b.Allow({ended});
  wire::ShmPayload from_ended = *d;
  from_ended.set_pid(child);
  const absl::Time start = absl::Now();
  auto r = p.b.Read(from_ended, x.nbytes(), Alloc);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("the sender ended before it had written it all"));
  std::thread stop([&] {
    absl::SleepFor(absl::Milliseconds(100));
    p.b.Stop();
  });
  p.b.Allow({p.a.endpoint()});
  auto stopped = p.b.Read(*d, x.nbytes(), Alloc);  // (the sender lives, and never fills it)
  stop.join();
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the stall timeout is 30 s";
}

TEST(ShmChannel, RefusesStrangersAndBadDescriptors) {
  Pair p;
  channel::ShmChannel stranger{channel::ShmChannel::Options{}};
  at::Tensor x = at::rand({1 << 18});
  auto from_stranger = stranger.Write(Bytes(x));
  ASSERT_TRUE(from_stranger.has_value());
  EXPECT_EQ(p.b.Read(*from_stranger, x.nbytes(), Alloc).status().code(),
            absl::StatusCode::kPermissionDenied);

  auto d = p.a.Write(Bytes(x));
  ASSERT_TRUE(d.has_value());
  auto expect_error = [&](wire::ShmPayload bad, uint64_t length) {
    auto r = p.b.Read(bad, length, Alloc);
    EXPECT_FALSE(r.ok()) << bad.DebugString();
  };
  wire::ShmPayload bad = *d;
  bad.set_capacity(d->capacity() * 2);  // does not match the file
  expect_error(bad, x.nbytes());
  bad = *d;
  bad.set_fd(-1);
  expect_error(bad, x.nbytes());
  bad = *d;
  bad.set_fd(0);  // not a sealed segment
  bad.set_segment(99);
  expect_error(bad, x.nbytes());
  bad = *d;
  bad.set_pid(d->pid() + 1);
  expect_error(bad, x.nbytes());
  expect_error(*d, d->capacity() + 1);  // longer than the segment
  bad = *d;
  bad.set_seq(d->seq() + 7);
  expect_error(bad, x.nbytes());
  // After all that, the real descriptor still reads.
  auto good = p.b.Read(*d, x.nbytes(), Alloc);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE(at::equal(*good, Bytes(x)));
}

TEST(ShmChannel, StaysWithinItsBudgetAndForgetsPeersThatLeft) {
  channel::ShmChannel a{channel::ShmChannel::Options{true, size_t{2} << 20}};
  channel::ShmChannel b{channel::ShmChannel::Options{}};
  b.Allow({a.endpoint()});
  auto d1 = a.Write(at::zeros({1 << 20}, at::kByte));
  auto d2 = a.Write(at::zeros({1 << 20}, at::kByte));
  EXPECT_TRUE(d1 && d2);
  EXPECT_FALSE(a.Write(at::zeros({1 << 20}, at::kByte)).has_value());  // budget spent
  ASSERT_TRUE(b.Read(*d1, 1 << 20, Alloc).ok());
  EXPECT_TRUE(a.Write(at::zeros({1 << 20}, at::kByte)).has_value());  // one came back
  EXPECT_EQ(b.stats().mapped_peers, 1);
  b.Allow({});
  EXPECT_EQ(b.stats().mapped_peers, 0);
  EXPECT_EQ(b.Read(*d2, 1 << 20, Alloc).status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(ShmFrame, LargePayloadsLeaveTheFrameAndComeBack) {
  Pair p;
  rpc::OutMessage m;
  m.header.mutable_request()->set_from(3);
  at::Tensor small = at::arange(100, at::kFloat);
  at::Tensor big = at::rand({100000});  // 400 KB
  m.payloads = {Bytes(small), Bytes(big)};
  std::vector<rpc::ShmFill> fills;
  grpc::ByteBuffer frame = rpc::SerializeMessage(m, channel::Route{&p.a, 64 << 10}, &fills);
  ASSERT_EQ(fills.size(), 1u);
  EXPECT_EQ(fills[0].descriptor.payload(), 1u);
  EXPECT_LT(frame.Length(), 4096u);  // only the small payload is in the frame

  // The receiver may start before the sender fills in: it copies as the
  // bytes arrive.
  absl::StatusOr<rpc::InMessage> in;
  std::thread receiver([&] { in = rpc::ParseMessage(frame, &p.b); });
  rpc::FillAll(channel::Route{&p.a, 64 << 10}, fills);
  receiver.join();
  ASSERT_TRUE(in.ok()) << in.status();
  ASSERT_EQ(in->payloads.size(), 2u);
  EXPECT_TRUE(at::equal(in->payloads[0], Bytes(small)));
  EXPECT_TRUE(at::equal(in->payloads[1], Bytes(big)));
  EXPECT_EQ(in->header.request().from(), 3u);

  // A receiver without the channel refuses such a frame clearly.
  grpc::ByteBuffer again = rpc::SerializeMessage(m, channel::Route{&p.a, 64 << 10});
  auto refused = rpc::ParseMessage(again, nullptr);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("shared-memory"));
}

TEST(ShmFrame, BadIndicesAreRejected) {
  Pair p;
  rpc::OutMessage m;
  m.payloads = {at::zeros({1 << 17}, at::kByte)};
  m.header.add_shm_payloads()->set_payload(5);  // names no payload
  auto r = rpc::ParseMessage(rpc::SerializeMessage(m), &p.b);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

// --- agents --------------------------------------------------------------

TEST(ShmAgents, PeersInOneProcessUseSharedMemory) {
  Group g(2);
  EXPECT_EQ(g.master().channel_to("w1").value(), "shm");
  EXPECT_EQ(g.worker(1).channel_to("w2").value(), "shm");
  at::Tensor x = at::randn({512, 512});  // 1 MiB each way
  auto y = g.master().rpc_sync("w1", "echo", {x});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_TRUE(at::equal(y->toTensor(), x));
  EXPECT_GE(g.master().shm_stats().writes, 1);
  EXPECT_GE(g.master().shm_stats().reads, 1);
  // Small tensors stay in the frame.
  const int64_t before = g.master().shm_stats().writes;
  ASSERT_TRUE(g.master().rpc_sync("w1", "echo", {at::ones({16})}).ok());
  EXPECT_EQ(g.master().shm_stats().writes, before);
  EXPECT_FALSE(g.master().channel_to("nobody").ok());
}

TEST(ShmAgents, TurnedOffMeansGrpc) {
  rpc::AgentOptions opts;
  opts.shared_memory = false;
  Group g(1, opts);
  EXPECT_EQ(g.master().channel_to("w1").value(), "grpc");
  at::Tensor x = at::randn({512, 512});
  auto y = g.master().rpc_sync("w1", "echo", {x});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_TRUE(at::equal(y->toTensor(), x));
  EXPECT_EQ(g.master().shm_stats().writes, 0);
}

TEST(ShmAgents, ThresholdIsConfigurable) {
  rpc::AgentOptions opts;
  opts.oob_threshold_bytes = 1024;
  Group g(1, opts);
  ASSERT_TRUE(g.master().rpc_sync("w1", "echo", {at::ones({1024})}).ok());  // 4 KiB
  EXPECT_EQ(g.master().shm_stats().writes, 1);
}

// Processes of different hosts never share memory: the host identity sent
// at rendezvous holds the network namespace (or an explicit --host-id).
TEST(HostIdentity, HoldsTheNetworkNamespaceUnlessGivenExplicitly) {
  char net[128] = {0};
  ASSERT_GT(readlink("/proc/self/ns/net", net, sizeof(net) - 1), 0);
  const std::string detected = channel::HostIdentity();
  EXPECT_THAT(detected, HasSubstr(channel::BootId()));
  EXPECT_THAT(detected, ::testing::EndsWith(absl::StrCat("/", net)));
  EXPECT_EQ(channel::HostIdentity("rack4-box7"), "rack4-box7");
  EXPECT_TRUE(channel::CheckHostId("rack4-box7").ok());
  EXPECT_THAT(channel::CheckHostId("two words").message(), HasSubstr("without spaces"));
  EXPECT_FALSE(channel::CheckHostId("").ok());
  EXPECT_FALSE(channel::CheckHostId(std::string(256, 'x')).ok());
}

TEST(HostIdentity, SharedMemoryOnlyBetweenEqualHostsAndDomains) {
  base::WorkerInfo a, b;
  a.host_id = b.host_id = "host/boot/net:[1]";
  a.shm = base::ShmEndpoint{"boot/pid:[2]/uid0", 10, 1};
  b.shm = base::ShmEndpoint{"boot/pid:[2]/uid0", 11, 2};
  EXPECT_TRUE(channel::SharesMemory(a, b));
  base::WorkerInfo other_netns = b;
  other_netns.host_id = "host/boot/net:[3]";
  EXPECT_FALSE(channel::SharesMemory(a, other_netns));
  base::WorkerInfo unknown = b;
  unknown.host_id.clear();
  EXPECT_FALSE(channel::SharesMemory(unknown, unknown));
  base::WorkerInfo other_domain = b;
  other_domain.shm.domain = "boot/pid:[4]/uid0";
  EXPECT_FALSE(channel::SharesMemory(a, other_domain));
  base::WorkerInfo off = b;
  off.shm.domain.clear();
  EXPECT_FALSE(channel::SharesMemory(off, off));
  EXPECT_FALSE(channel::SharesMemory(a, a));  // the same agent: its own incarnation
  // The route follows the same rule.
  channel::ShmChannel shm{channel::ShmChannel::Options{}};
  base::WorkerInfo self;
  self.host_id = "h1";
  base::WorkerInfo peer;
  peer.host_id = "h1";
  peer.shm = channel::ShmChannel(channel::ShmChannel::Options{}).endpoint();
  if (shm.endpoint().domain.empty()) GTEST_SKIP() << "no sealed memfd segments on this kernel";
  EXPECT_EQ(channel::SelectRoute(self, peer, &shm, nullptr, 1024).shm, &shm);
  peer.host_id = "h2";
  EXPECT_EQ(channel::SelectRoute(self, peer, &shm, nullptr, 1024).shm, nullptr);
}

// Agents in one process given different host ids talk through gRPC, as
// separate hosts do; those with the same id through shared memory.
TEST(ShmAgents, AnotherHostIdMeansGrpc) {
  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  rpc::AgentOptions m = MasterOptions({"w1", "w2"});
  m.host_id = "host-a";
  auto master = rpc::Agent::Start(m, &registry).value();
  std::vector<std::unique_ptr<rpc::Agent>> workers;
  for (const char* host : {"host-b", "host-a"}) {
    rpc::AgentOptions w;
    w.name = absl::StrCat("w", workers.size() + 1);
    w.master_address = master->self().address;
    w.host_id = host;
    workers.push_back(rpc::Agent::Start(w, &registry).value());
  }
  std::vector<std::thread> joins;
  for (auto& w : workers) joins.emplace_back([&w] { EXPECT_TRUE(w->Join().ok()); });
  ASSERT_TRUE(master->Join().ok());
  for (auto& t : joins) t.join();
  EXPECT_EQ(master->self().host_id, "host-a");
  EXPECT_EQ(master->channel_to("w1").value(), "grpc");
  EXPECT_EQ(master->channel_to("w2").value(), "shm");
  EXPECT_EQ(workers[0]->channel_to("w2").value(), "grpc");
  at::Tensor x = at::randn({512, 512});  // 1 MiB
  auto y = master->rpc_sync("w1", "echo", {x});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_TRUE(at::equal(y->toTensor(), x));
  EXPECT_EQ(master->shm_stats().writes, 0);
  EXPECT_EQ(workers[0]->shm_stats().reads, 0);
  ASSERT_TRUE(master->rpc_sync("w2", "echo", {x}).ok());
  EXPECT_GE(master->shm_stats().writes, 1);
  std::vector<std::thread> stops;
  for (auto& w : workers) stops.emplace_back([&w] { EXPECT_TRUE(w->Shutdown().ok()); });
  EXPECT_TRUE(master->Shutdown().ok());
  for (auto& t : stops) t.join();
  rpc::AgentOptions bad = MasterOptions({"w1"});
  bad.host_id = "a b";
  EXPECT_THAT(rpc::Agent::Start(bad, &registry).status().message(), HasSubstr("--host-id"));
}

int CountRemoraFilesInDevShm() {
  int n = 0;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) n += std::strstr(e->d_name, "remora") != nullptr;
    closedir(d);
  }
  return n;
}

// The worker maps segments while it serves, and nothing is left anywhere
// once it is gone, killed or not.
TEST(ShmAgents, RealWorkersExchangeActivationsThroughSegments) {
  const int files_before = CountRemoraFilesInDevShm();
  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  auto group = launch::StartLocalGroup({"worker1", "worker2"}, &registry, {}, {}, "test_worker");
  ASSERT_TRUE(group.ok()) << group.status();
  rpc::Agent& master = *group->master;
  EXPECT_EQ(master.channel_to("worker1").value(), "shm");
  {
    // worker2 fetches worker1's 2 MiB outputs with to_here(): worker to
    // worker through shared memory; the master's input and result too.
    rpc::RRef s1 = master.remote("worker1", "Affine", {int64_t{512}, int64_t{512}, int64_t{3}}).value();
    rpc::RRef s2 = master.remote("worker2", "Affine", {int64_t{512}, int64_t{512}, int64_t{4}}).value();
    at::Tensor w1 = s1.rpc_sync("weight").value().toTensor();
    at::Tensor w2 = s2.rpc_sync("weight").value().toTensor();
    std::vector<at::Tensor> inputs;
    std::vector<rpc::Future<c10::IValue>> outs;
    for (int i = 0; i < 8; ++i) {
      inputs.push_back(at::randn({1024, 512}));
      rpc::RRef y = s1.remote("forward", {master.local_rref(inputs.back())}).value();
      outs.push_back(s2.rpc_async("forward", {y}));
    }
    for (int i = 0; i < 8; ++i) {
      auto z = outs[i].wait();
      ASSERT_TRUE(z.ok()) << z.status();
      EXPECT_TRUE(at::allclose(z->toTensor(), at::matmul(at::matmul(inputs[i], w1.t()), w2.t()),
                               1e-4, 1e-5));
    }
  }
  EXPECT_GE(master.shm_stats().reads, 8);
  const std::string maps = ReadFile(absl::StrCat("/proc/", group->workers[1]->pid(), "/maps"));
  EXPECT_THAT(maps, HasSubstr("memfd:remora-shm"));
  // Kill one worker outright: its segments die with it.
  group->workers[0]->Signal(SIGKILL);
  EXPECT_EQ(group->workers[0]->Wait(absl::Seconds(10)).value(), 128 + SIGKILL);
  EXPECT_EQ(CountRemoraFilesInDevShm(), files_before);
  group->master.reset();
  group->workers.clear();  // kills the other one
  EXPECT_EQ(CountRemoraFilesInDevShm(), files_before);
}

}  // namespace
}  // namespace remora
