// Several agents in one process over loopback: calls, RRefs, reference
// counting, rendezvous errors and shutdown.
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
#include "rpc/rref_context.h"
#include "rpc/message.h"
#include "base/mutex_lock.h"
#include "rpc/stream.h"
#include "examples/demo_functions.h"
#include "tests/support/test_group.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

namespace remora {
namespace {

using ::testing::HasSubstr;

TEST(Agent, AddressBookHasStableIdsEverywhere) {
  Group g(2);
  for (rpc::Agent* a : g.all()) {
    auto book = a->workers();
    ASSERT_EQ(book.size(), 3u);
    EXPECT_EQ(book[0].name, "master");
    EXPECT_EQ(book[1].name, "w1");
    EXPECT_EQ(book[2].name, "w2");
    for (size_t i = 0; i < book.size(); ++i) EXPECT_EQ(book[i].id, i);
    EXPECT_EQ(book[1].host_id, book[2].host_id);
  }
  EXPECT_EQ(g.worker(2).self().id, 2);
}

TEST(Agent, RpcSyncAndAsyncReturnResults) {
  Group g(2);
  auto r = g.master().rpc_sync("w1", "add", {int64_t{2}, int64_t{3}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->toInt(), 5);
  at::Tensor x = at::randn({3, 4});
  auto f = g.master().rpc_async("w2", "add", {x, x});
  auto t = f.wait();
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(at::equal(t->toTensor(), x + x));
  // A worker calls another worker directly.
  auto w = g.worker(1).rpc_sync("w2", "echo", {std::string("hi")});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->toStringRef(), "hi");
}

TEST(Agent, RemoteFailureNamesWorkerAndWorkerKeepsServing) {
  Group g(1);
  auto r = g.master().rpc_sync("w1", "raise", {std::string("boom at stage 3")});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("worker 'w1'"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("boom at stage 3"));
  auto missing_arg = g.master().rpc_sync("w1", "add", {int64_t{1}});
  ASSERT_FALSE(missing_arg.ok());
  EXPECT_THAT(std::string(missing_arg.status().message()), HasSubstr("argument 1"));
  auto wrong_type = g.master().rpc_sync("w1", "sink", {std::string("not a tensor")});
  EXPECT_FALSE(wrong_type.ok());
  auto ok = g.master().rpc_sync("w1", "add", {int64_t{1}, int64_t{1}});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->toInt(), 2);
}

TEST(Agent, UnknownDestinationOrFunctionIsAClearError) {
  Group g(1);
  auto r = g.master().rpc_sync("nobody", "add", {});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("unknown worker 'nobody'"));
  EXPECT_FALSE(g.master().remote("nobody", "add", {}).ok());
  auto f = g.master().rpc_sync("w1", "no_such_function", {});
  ASSERT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(f.status().message()), HasSubstr("no_such_function"));
}

TEST(Agent, PerCallTimeoutFailsTheCall) {
  Group g(1);
  rpc::CallOptions opts;
  opts.timeout = absl::Milliseconds(200);
  const absl::Time start = absl::Now();
  auto r = g.master().rpc_sync("w1", "sleep_ms", {int64_t{1500}}, opts);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("timed out"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("w1"));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1400));
  auto f = g.master().rpc_async("w1", "sleep_ms", {int64_t{1500}}, opts).wait();
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDeadlineExceeded);
  absl::SleepFor(absl::Milliseconds(1500));  // let the sleeps end before shutdown
}

// rpc_sync polls for its reply before sleeping (AgentOptions::sync_spin;
// REMORA_SYNC_SPIN_US overrides it). Calls behave the same either way:
// quick replies, replies after the polling ended, and timeouts.
TEST(Agent, SyncCallsWorkWithAndWithoutPolling) {
  for (absl::Duration spin : {absl::ZeroDuration(), absl::Microseconds(200), absl::Seconds(1)}) {
    rpc::AgentOptions base;
    base.sync_spin = spin;
    Group g(1, base);
    EXPECT_EQ(g.master().sync_spin(), spin);
    auto quick = g.master().rpc_sync("w1", "add", {int64_t{2}, int64_t{3}});
    ASSERT_TRUE(quick.ok()) << quick.status();
    EXPECT_EQ(quick->toInt(), 5);
    auto slow = g.master().rpc_sync("w1", "sleep_ms", {int64_t{30}});
    EXPECT_TRUE(slow.ok()) << slow.status();
    rpc::CallOptions opts;
    opts.timeout = absl::Milliseconds(100);
    auto late = g.master().rpc_sync("w1", "sleep_ms", {int64_t{400}}, opts);
    EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
    absl::SleepFor(absl::Milliseconds(400));  // let the sleep end before shutdown
  }
  setenv("REMORA_SYNC_SPIN_US", "0", 1);
  Group g(1);
  unsetenv("REMORA_SYNC_SPIN_US");
  EXPECT_EQ(g.master().sync_spin(), absl::ZeroDuration());
  EXPECT_TRUE(g.master().rpc_sync("w1", "add", {int64_t{1}, int64_t{1}}).ok());
}

// rpc_sync rides a long-lived stream to the peer (rpc/stream.h): one stream
// carries a thread's calls one after another; a call that timed out takes
// its stream down with it, so its late reply cannot answer the next call;
// callers on several threads get streams of their own.
TEST(Agent, RpcSyncReusesStreamsAndDropsOneThatTimedOut) {
  Group g(1);
  for (int64_t i = 0; i < 50; ++i) {
    auto r = g.master().rpc_sync("w1", "add", {i, int64_t{1}});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->toInt(), i + 1);
  }
  EXPECT_EQ(g.master().streams_opened(), 1);

  rpc::CallOptions opts;
  opts.timeout = absl::Milliseconds(100);
  auto late = g.master().rpc_sync("w1", "sleep_ms", {int64_t{300}}, opts);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("w1"));
  auto next = g.master().rpc_sync("w1", "add", {int64_t{2}, int64_t{3}});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->toInt(), 5);
  EXPECT_EQ(g.master().streams_opened(), 2);

  std::vector<std::thread> callers;
  for (int64_t t = 0; t < 4; ++t) {
    callers.emplace_back([&g, t] {
      for (int64_t i = 0; i < 25; ++i) {
        auto r = g.master().rpc_sync("w1", "add", {t * 1000, i});
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ(r->toInt(), t * 1000 + i);
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_LE(g.master().streams_opened(), 2 + 4);

  // A burst of callers leaves at most 8 idle streams behind: after 12 at
  // once, 12 more at once find 8 and open the rest.
  auto burst = [&g] {
    std::vector<std::thread> callers;
    for (int t = 0; t < 12; ++t) {
      callers.emplace_back([&g] {
        EXPECT_TRUE(g.master().rpc_sync("w1", "sleep_ms", {int64_t{300}}).ok());
      });
    }
    for (auto& t : callers) t.join();
  };
  burst();
  const int64_t after_first = g.master().streams_opened();
  burst();
  EXPECT_GT(g.master().streams_opened() - after_first, 0);
  EXPECT_LE(g.master().streams_opened() - after_first, 12 - 8);
}

// The blocking calls on an RRef wait on streams too: rpc_sync of a method
// and to_here (a pipeline stage fetching its input); their async forms
// and remote() stay unary.
TEST(Agent, RRefRpcSyncAndToHereWaitOnStreams) {
  Group g(1);
  rpc::RRef m = g.master().remote("w1", "Scale", {2.0}).value();
  rpc::RRef v = g.master().remote("w1", "echo", {int64_t{7}}).value();
  EXPECT_EQ(g.master().streams_opened(), 0);
  for (int i = 0; i < 10; ++i) {
    auto y = m.rpc_sync("forward", {at::ones({2})});
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_TRUE(at::equal(y->toTensor(), at::ones({2}) * 2));
    auto x = v.to_here();
    ASSERT_TRUE(x.ok()) << x.status();
    EXPECT_EQ(x->toInt(), 7);
  }
  EXPECT_EQ(g.master().streams_opened(), 1);
  EXPECT_EQ(v.to_here_async().wait().value().toInt(), 7);
  EXPECT_TRUE(m.rpc_async("factor").wait().ok());
  EXPECT_EQ(g.master().streams_opened(), 1);
}

// AgentOptions::streams = false (REMORA_STREAMS=0 in the environment) sends
// every call as a unary gRPC call. Large requests and replies pass on
// streams too.
TEST(Agent, StreamsCanBeTurnedOffAndCarryLargeMessages) {
  rpc::AgentOptions no_streams;
  no_streams.streams = false;
  {
    Group g(1, no_streams);
    auto r = g.master().rpc_sync("w1", "add", {int64_t{2}, int64_t{3}});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->toInt(), 5);
    EXPECT_EQ(g.master().streams_opened(), 0);
  }
  rpc::AgentOptions inline_only;
  inline_only.shared_memory = false;  // tensors travel in the messages
  Group g(1, inline_only);
  at::Tensor big = at::rand({1 << 22});  // 16 MiB
  auto r = g.master().rpc_sync("w1", "add", {big, big});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(at::equal(r->toTensor(), big + big));
  EXPECT_EQ(g.master().streams_opened(), 1);
}

TEST(Agent, CallbacksNeverRunOnGrpcThreads) {
  Group g(1);
  std::vector<rpc::Future<std::string>> names;
  for (int i = 0; i < 20; ++i) {
    rpc::Future<std::string> name;
    g.master().rpc_async("w1", "echo", {int64_t{i}}).then(
        [name](const absl::StatusOr<c10::IValue>&) mutable {
          char buf[32] = {0};
          pthread_getname_np(pthread_self(), buf, sizeof(buf));
          name.SetValue(buf);
        });
    names.push_back(name);
  }
  for (auto& n : names) EXPECT_EQ(n.wait().value(), rpc::ThreadPool::kThreadName);
}

TEST(Agent, ManyConcurrentAsyncCallsAllComplete) {
  Group g(1);
  std::vector<rpc::Future<c10::IValue>> futures;
  for (int64_t i = 0; i < 3000; ++i) {
    futures.push_back(g.master().rpc_async("w1", "add", {i, int64_t{1}}));
  }
  for (int64_t i = 0; i < 3000; ++i) {
    auto r = futures[i].wait();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->toInt(), i + 1);
  }
}

TEST(Agent, LargeTensorsPassBothWays) {
  Group g(1);
  at::Tensor big = at::rand({40 << 20});  // 160 MB of float32
  auto r = g.master().rpc_sync("w1", "echo", {big});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(at::equal(r->toTensor(), big));
}

TEST(Agent, RemoteReturnsAtOnceAndToHereWaitsForTheValue) {
  Group g(1);
  const absl::Time start = absl::Now();
  auto rref = g.master().remote("w1", "sleep_ms", {int64_t{400}});
  ASSERT_TRUE(rref.ok()) << rref.status();
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_EQ(rref->owner_name(), "w1");
  EXPECT_EQ(rref->owner(), 1);
  EXPECT_FALSE(rref->is_owner());
  auto v = rref->to_here();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->toInt(), 400);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(390));
  // The owner's confirmation travels apart from the fetched value.
  EXPECT_TRUE(rref->impl()->isOwner() ||
              static_cast<rpc::UserRRef*>(rref->impl().get())->confirmed().wait_for(absl::Seconds(5)).ok());
  EXPECT_TRUE(rref->confirmed_by_owner());
}

TEST(Agent, CreationErrorIsRaisedByToHere) {
  Group g(1);
  auto rref = g.master().remote("w1", "raise", {std::string("cannot build")});
  ASSERT_TRUE(rref.ok());
  auto v = rref->to_here();
  ASSERT_FALSE(v.ok());
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("cannot build"));
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("w1"));
}

TEST(Agent, LocalValueOnlyOnTheOwner) {
  Group g(1);
  rpc::RRef local = g.master().local_rref(c10::IValue(int64_t{7}));
  EXPECT_TRUE(local.is_owner());
  EXPECT_EQ(local.local_value().value().toInt(), 7);
  EXPECT_EQ(local.to_here().value().toInt(), 7);
  auto user = g.master().remote("w1", "echo", {int64_t{8}}).value();
  auto lv = user.local_value();
  ASSERT_EQ(lv.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(lv.status().message()), HasSubstr("to_here"));
}

TEST(Agent, RRefPassedToAThirdProcessIsFetchedFromItsOwner) {
  Group g(2);
  at::Tensor x = at::randn({5});
  // The value does not exist yet when w2 asks for it: the owner waits.
  rpc::RRef slow = g.master().remote("w1", "sleep_ms", {int64_t{300}}).value();
  auto v = g.master().rpc_sync("w2", "to_here", {slow});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->toInt(), 300);
  rpc::RRef held = g.master().remote("w1", "echo", {x}).value();
  auto y = g.master().rpc_sync("w2", "rref_add", {held, x});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_TRUE(at::allclose(y->toTensor(), x + x));
}

TEST(Agent, CanonicalPipelineMatchesLocalComputation) {
  Group g(2);
  rpc::RRef s1 = g.master().remote("w1", "Affine", {int64_t{6}, int64_t{5}, int64_t{1}}).value();
  rpc::RRef s2 = g.master().remote("w2", "Affine", {int64_t{5}, int64_t{3}, int64_t{2}}).value();
  at::Tensor w1 = s1.rpc_sync("weight").value().toTensor();
  at::Tensor w2 = s2.rpc_sync("weight").value().toTensor();
  for (int step = 0; step < 5; ++step) {
    at::Tensor x = at::randn({4, 6});
    rpc::RRef x_rref = g.master().local_rref(x);
    rpc::RRef y_rref = s1.remote("forward", {x_rref}).value();
    EXPECT_EQ(y_rref.owner_name(), "w1");
    auto z = s2.rpc_async("forward", {y_rref}).wait();
    ASSERT_TRUE(z.ok()) << z.status();
    at::Tensor expected = at::matmul(at::matmul(x, w1.t()), w2.t());
    EXPECT_TRUE(at::allclose(z->toTensor(), expected, 1e-5, 1e-6));
  }
}

TEST(Agent, MethodErrorsAreClear) {
  Group g(1);
  rpc::RRef m = g.master().remote("w1", "Scale", {2.0}).value();
  auto bad = m.rpc_sync("nope");
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("forward"));
  rpc::RRef not_module = g.master().remote("w1", "echo", {int64_t{1}}).value();
  auto nm = not_module.rpc_sync("forward", {at::ones({1})});
  EXPECT_EQ(nm.status().code(), absl::StatusCode::kInvalidArgument);
  auto y = m.rpc_sync("forward", {at::ones({2})});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_TRUE(at::equal(y->toTensor(), at::ones({2}) * 2));
  EXPECT_DOUBLE_EQ(m.rpc_sync("factor").value().toDouble(), 2.0);
}

TEST(Agent, ThousandsOfRRefsLeaveEveryOwnerTableEmpty) {
  Group g(2);
  {
    std::vector<rpc::RRef> keep;
    std::vector<rpc::Future<c10::IValue>> pending;
    for (int64_t i = 0; i < 1500; ++i) {
      // remote on w1, forked to w2 which fetches it from w1.
      rpc::RRef r = g.master().remote("w1", "echo", {i}).value();
      pending.push_back(g.master().rpc_async("w2", "to_here", {r}));
      // the master's own value, forked to w1.
      rpc::RRef local = g.master().local_rref(c10::IValue(i));
      pending.push_back(g.master().rpc_async("w1", "to_here", {local}));
      // an RRef created by w2 and returned to the master.
      pending.push_back(g.master().rpc_async("w2", "make_rref", {i}));
      if (i % 100 == 0) keep.push_back(r);
    }
    for (auto& f : pending) ASSERT_TRUE(f.wait().ok());
    for (auto& f : pending) {
      auto v = f.wait().value();
      if (v.isRRef()) {
        EXPECT_EQ(rpc::RRef::FromIValue(v).value().owner_name(), "w2");
      }
    }
    rpc::RRefStats w1 = g.worker(1).rref_stats();
    EXPECT_GE(w1.owners, 15);  // the kept ones at least
  }
  std::string why;
  EXPECT_TRUE(g.WaitTablesEmpty(absl::Seconds(30), &why)) << why;
}

TEST(Rendezvous, InvalidNamesAreRejected) {
  rpc::Registry registry;
  rpc::AgentOptions o;
  o.name = "bad name";
  EXPECT_EQ(rpc::Agent::Start(o, &registry).status().code(), absl::StatusCode::kInvalidArgument);
  o.name = std::string(129, 'a');
  EXPECT_EQ(rpc::Agent::Start(o, &registry).status().code(), absl::StatusCode::kInvalidArgument);
  o.name = "master";
  o.is_master = true;
  o.workers = {"w1", "w1"};
  auto dup = rpc::Agent::Start(o, &registry);
  ASSERT_FALSE(dup.ok());
  EXPECT_THAT(std::string(dup.status().message()), HasSubstr("duplicate"));
  o.workers = {"w1", "no/slash"};
  EXPECT_FALSE(rpc::Agent::Start(o, &registry).ok());
}

// A worker agent named `name`, started (not joined) for `master`'s group.
std::unique_ptr<rpc::Agent> StartWorker(rpc::Registry& registry, const rpc::Agent& master, const std::string& name) {
  rpc::AgentOptions w;
  w.name = name;
  w.master_address = master.self().address;
  w.connect_timeout = absl::Seconds(20);
  return rpc::Agent::Start(w, &registry).value();
}

// Shuts `workers` down (each waiting on a thread of its own) and then the
// master, gracefully; every one must succeed.
void ShutdownAll(rpc::Agent& master, const std::vector<rpc::Agent*>& workers) {
  std::vector<std::thread> waits;
  for (rpc::Agent* w : workers) waits.emplace_back([w] { EXPECT_TRUE(w->Shutdown().ok()); });
  EXPECT_TRUE(master.Shutdown().ok());
  for (auto& t : waits) t.join();
}

// A master of w1 and w2 and the two workers, started with `registry` and
// joined.
struct Joined {
  std::unique_ptr<rpc::Agent> master, w1, w2;
};
Joined StartAndJoin(rpc::Registry& registry) {
  Joined g;
  g.master = rpc::Agent::Start(MasterOptions({"w1", "w2"}), &registry).value();
  g.w1 = StartWorker(registry, *g.master, "w1");
  g.w2 = StartWorker(registry, *g.master, "w2");
  std::thread j1([&] { EXPECT_TRUE(g.w1->Join().ok()); });
  std::thread j2([&] { EXPECT_TRUE(g.w2->Join().ok()); });
  EXPECT_TRUE(g.master->Join().ok());
  j1.join();
  j2.join();
  return g;
}

TEST(Rendezvous, DuplicateAndUnknownWorkerNamesAreRejected) {
  rpc::Registry registry;
  rpc::AgentOptions m = MasterOptions({"w1", "w2"});
  auto master = rpc::Agent::Start(m, &registry).value();
  auto start_worker = [&](const std::string& name) { return StartWorker(registry, *master, name); };
  // Two agents claim "w1"; whichever registers second is refused.
  auto first = start_worker("w1");
  auto second = start_worker("w1");
  absl::Notification refused;
  absl::Status statuses[2];
  std::thread joins[2];
  rpc::Agent* twins[2] = {first.get(), second.get()};
  for (int i = 0; i < 2; ++i) {
    joins[i] = std::thread([&, i] {
      statuses[i] = twins[i]->Join();
      if (!statuses[i].ok()) refused.Notify();
    });
  }
  ASSERT_TRUE(refused.WaitForNotificationWithTimeout(absl::Seconds(20)));
  const int loser = statuses[0].ok() ? 1 : 0;
  EXPECT_EQ(statuses[loser].code(), absl::StatusCode::kAlreadyExists) << statuses[loser];
  EXPECT_THAT(std::string(statuses[loser].message()), HasSubstr("duplicate worker name 'w1'"));
  joins[loser].join();
  std::thread& first_join = joins[1 - loser];
  if (loser == 0) std::swap(first, second);  // `first` is the one that joined
  auto w2 = start_worker("w2");
  std::thread w2_join([&] { EXPECT_TRUE(w2->Join().ok()); });
  EXPECT_TRUE(master->Join().ok());
  first_join.join();
  w2_join.join();
  // A name not listed is refused. (Before the group formed, it would end
  // the master's wait: w1 joined and one refused make the two it expects.)
  auto stranger = start_worker("w9");
  absl::Status unknown = stranger->Join();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("w9"));
  ShutdownAll(*master, {first.get(), w2.get()});
}

// Elastic membership: a new process under a worker's name is kept waiting
// while the member answers; once the master marks it lost, the new process
// takes its id, and the master and the other worker reach it, large
// payloads included (shared memory allows the new process).
TEST(Rendezvous, ALostWorkersNewProcessTakesItsPlaceAndEveryMemberReachesIt) {
  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  Joined g = StartAndJoin(registry);
  std::unique_ptr<rpc::Agent>& master = g.master;
  std::unique_ptr<rpc::Agent>& w1 = g.w1;
  std::unique_ptr<rpc::Agent>& w2 = g.w2;
  const base::WorkerId id = master->worker("w2")->id;

  // Early: w2 still answers, so its would-be successor is kept waiting.
  rpc::AgentOptions early_options;
  early_options.name = "w2";
  early_options.master_address = master->self().address;
  early_options.connect_timeout = absl::Seconds(1);
  auto early = rpc::Agent::Start(early_options, &registry).value();
  absl::Status kept = early->Join();
  EXPECT_EQ(kept.code(), absl::StatusCode::kDeadlineExceeded) << kept;
  EXPECT_THAT(std::string(kept.message()), HasSubstr("a live worker of the group holds the name"));
  early->Shutdown(false).IgnoreError();

  w2->Shutdown(/*graceful=*/false).IgnoreError();  // as a crash
  EXPECT_EQ(master->MarkLost("w9").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(master->MarkLost("w2").ok());
  EXPECT_TRUE(master->IsLost("w2"));
  auto again = StartWorker(registry, *master, "w2");
  std::thread j3([&] { EXPECT_TRUE(again->Join().ok()); });
  ASSERT_TRUE(master->AwaitRejoin("w2", absl::Seconds(20)).ok());
  j3.join();
  EXPECT_FALSE(master->IsLost("w2"));
  EXPECT_EQ(again->self().id, id);
  EXPECT_EQ(master->worker("w2")->address, again->self().address);
  EXPECT_EQ(w1->worker("w2")->address, again->self().address);

  auto sum = master->rpc_sync("w2", "add", {at::ones({2}), at::ones({2})});
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_TRUE(at::equal(sum->toTensor(), at::ones({2}) * 2));
  const at::Tensor big = at::rand({1 << 20});  // 4 MiB: out of band
  auto there = w1->rpc_sync("w2", "echo", {big});
  ASSERT_TRUE(there.ok()) << there.status();
  EXPECT_TRUE(at::equal(there->toTensor(), big));
  auto back = again->rpc_sync("w1", "echo", {big});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(at::equal(back->toTensor(), big));
  ShutdownAll(*master, {w1.get(), again.get()});
}

// A lost worker that does not come back: AwaitRejoin says so, and the
// graceful shutdown does not wait for it.
TEST(Rendezvous, AWorkerThatDoesNotComeBackIsNamedAndShutdownGoesOnWithoutIt) {
  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  Joined g = StartAndJoin(registry);
  std::unique_ptr<rpc::Agent>& master = g.master;
  std::unique_ptr<rpc::Agent>& w1 = g.w1;
  std::unique_ptr<rpc::Agent>& w2 = g.w2;
  w2->Shutdown(/*graceful=*/false).IgnoreError();
  ASSERT_TRUE(master->MarkLost("w2").ok());
  absl::Status gone = master->AwaitRejoin("w2", absl::Milliseconds(300));
  EXPECT_EQ(gone.code(), absl::StatusCode::kDeadlineExceeded) << gone;
  EXPECT_THAT(std::string(gone.message()), HasSubstr("worker 'w2' did not register again within 300ms"));
  std::thread s1([&] { EXPECT_TRUE(w1->Shutdown().ok()); });
  const absl::Time t0 = absl::Now();
  EXPECT_TRUE(master->Shutdown().ok());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  s1.join();
}

// The master stops waiting as soon as every worker it expects has joined
// or been refused, names the refused one and why, and tells the worker
// that joined that the group did not form.
TEST(Rendezvous, TheMasterStopsWaitingOnceEachExpectedWorkerJoinedOrWasRefused) {
  rpc::Registry registry;
  rpc::AgentOptions m = MasterOptions({"w1", "w2"});
  m.connect_timeout = absl::Seconds(60);
  auto master = rpc::Agent::Start(m, &registry).value();
  auto start_worker = [&](const std::string& name) { return StartWorker(registry, *master, name); };
  auto w1 = start_worker("w1");
  absl::Status w1_status;
  std::thread w1_join([&] { w1_status = w1->Join(); });
  auto typo = start_worker("w3");
  EXPECT_EQ(typo->Join().code(), absl::StatusCode::kNotFound);
  const absl::Time start = absl::Now();
  absl::Status joined = master->Join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_FALSE(joined.ok());
  EXPECT_THAT(std::string(joined.message()), HasSubstr("worker w2 did not register"));
  EXPECT_THAT(std::string(joined.message()), HasSubstr("'w3' at "));
  EXPECT_THAT(std::string(joined.message()), HasSubstr("was refused: not in --workers (w1,w2)"));
  w1_join.join();
  EXPECT_THAT(std::string(w1_status.message()), HasSubstr("the group did not form"));
  master->Shutdown(/*graceful=*/false).IgnoreError();
}

TEST(Rendezvous, WorkerStartedBeforeMasterRetriesUntilItAppears) {
  rpc::Registry registry;
  const int port = FreePort();
  rpc::AgentOptions w;
  w.name = "w1";
  w.master_address = absl::StrCat("127.0.0.1:", port);
  w.connect_timeout = absl::Seconds(20);
  auto worker = rpc::Agent::Start(w, &registry).value();
  std::thread join([&] { EXPECT_TRUE(worker->Join().ok()); });
  absl::SleepFor(absl::Milliseconds(700));
  rpc::AgentOptions m = MasterOptions({"w1"});
  m.listen_address = absl::StrCat("127.0.0.1:", port);
  auto master = rpc::Agent::Start(m, &registry).value();
  EXPECT_TRUE(master->Join().ok());
  join.join();
  std::thread stop([&] { EXPECT_TRUE(worker->Shutdown().ok()); });
  EXPECT_TRUE(master->Shutdown().ok());
  stop.join();
}

TEST(Rendezvous, TimeoutsGiveClearErrors) {
  rpc::Registry registry;
  rpc::AgentOptions w;
  w.name = "w1";
  w.master_address = absl::StrCat("127.0.0.1:", FreePort());
  w.connect_timeout = absl::Seconds(1);
  auto worker = rpc::Agent::Start(w, &registry).value();
  const absl::Time start = absl::Now();
  absl::Status s = worker->Join();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()), HasSubstr("unreachable"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));

  rpc::AgentOptions m = MasterOptions({"w1", "w2"});
  m.connect_timeout = absl::Seconds(1);
  auto master = rpc::Agent::Start(m, &registry).value();
  absl::Status ms = master->Join();
  EXPECT_EQ(ms.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(ms.message()), HasSubstr("w1, w2"));
}

TEST(Security, TokenIsRequiredOnEveryCall) {
  rpc::AgentOptions opts;
  opts.token = "s3cret-token";
  Group g(1, opts);
  EXPECT_EQ(g.master().rpc_sync("w1", "add", {int64_t{1}, int64_t{2}}).value().toInt(), 3);

  // A worker with the wrong token cannot join.
  rpc::Registry registry;
  rpc::AgentOptions intruder;
  intruder.name = "w1";
  intruder.master_address = g.master().self().address;
  intruder.token = "guess";
  intruder.connect_timeout = absl::Seconds(5);
  auto agent = rpc::Agent::Start(intruder, &registry).value();
  absl::Status s = agent->Join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;

  // A raw call without a token is rejected before anything runs.
  std::atomic<bool> ran{false};
  auto channel = grpc::CreateChannel(g.worker(1).self().address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  for (const std::string& token : {std::string(), std::string("wrong"), std::string("s3cret-toke")}) {
    rpc::OutMessage m;
    m.header.mutable_request()->set_from(0);
    wire::CallRequest sleep;
    sleep.set_function("sleep_ms");
    sleep.add_args()->set_i(1);
    *m.header.mutable_request() = wire::MakeRequest(sleep);
    m.header.mutable_request()->set_from(0);
    grpc::ByteBuffer request = rpc::SerializeMessage(std::move(m)), response;
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("remora-token", token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    rpc::Future<grpc::Status> done;
    stub.UnaryCall(&ctx, "/remora.Agent/Call", grpc::StubOptions(), &request, &response,
                   [done](grpc::Status st) mutable { done.SetValue(st); });
    grpc::Status st = done.wait().value();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
  }
  // The worker keeps serving its group.
  EXPECT_EQ(g.master().rpc_sync("w1", "add", {int64_t{2}, int64_t{2}}).value().toInt(), 4);
}

TEST(Shutdown, ReleasesOutstandingRRefsEverywhere) {
  Group g(2);
  rpc::RRef a = g.master().remote("w1", "echo", {at::ones({3})}).value();
  rpc::RRef b = g.master().remote("w2", "Scale", {3.0}).value();
  ASSERT_TRUE(a.to_here().ok());
  ASSERT_TRUE(g.master().rpc_sync("w2", "to_here", {a}).ok());
  EXPECT_GE(g.worker(1).rref_stats().owners, 1);
  ASSERT_TRUE(g.Shutdown().ok());
  // The handles are still alive here; the owners freed the values anyway.
  for (rpc::Agent* agent : g.all()) {
    rpc::RRefStats s = agent->rref_stats();
    EXPECT_EQ(s.owners, 0) << agent->self().name;
    EXPECT_EQ(s.forks, 0) << agent->self().name;
  }
}

TEST(Shutdown, StuckCallBecomesAnErrorNotAHang) {
  rpc::AgentOptions opts;
  opts.shutdown_timeout = absl::Seconds(1);
  Group g(1, opts);
  auto slow = g.master().rpc_async("w1", "sleep_ms", {int64_t{2500}});
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  absl::Status s = g.Shutdown();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("in flight")) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(6));
  EXPECT_FALSE(slow.wait().ok());  // cancelled by the stop
}

}  // namespace
}  // namespace remora
