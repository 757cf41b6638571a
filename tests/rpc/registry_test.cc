// Tests of the registry (rpc/registry.h) and of worker-name validation.

#include "rpc/registry.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "rpc/future.h"
#include "base/ids.h"
#include "base/mutex_lock.h"
#include "rpc/rref_context.h"
#include "rpc/thread_pool.h"
#include "runtime/compute_lane.h"

namespace remora {
namespace {

using ::testing::HasSubstr;

c10::IValue ReturnNone(rpc::CallContext&, const rpc::Args&) { return c10::IValue(); }

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// Runs Invoke, which answers at once for everything but async functions.
absl::StatusOr<c10::IValue> InvokeNow(const rpc::Registry& registry,
                                      const std::string& name, rpc::CallContext& ctx,
                                      const rpc::Args& args) {
  rpc::Future<c10::IValue> f = registry.Invoke(name, ctx, args);
  EXPECT_TRUE(f.ready()) << name;
  return f.wait_for(absl::Seconds(5));
}

// A module with state: Invoke constructs it, methods change and read it.
struct Counter {
  explicit Counter(int64_t start) : value(start) {}
  int64_t value;
};

absl::Status RegisterCounter(rpc::Registry& registry, const std::string& name = "Counter") {
  return registry.RegisterModule<Counter>(
      name,
      [](rpc::CallContext&, const rpc::Args& args) {
        return std::make_shared<Counter>(args.size() > 0 ? args[0].toInt() : 0);
      },
      {{"add",
        [](Counter& c, rpc::CallContext&, const rpc::Args& args) {
          c.value += args[0].toInt();
          return c10::IValue(c.value);
        }},
       {"get", [](Counter& c, rpc::CallContext&, const rpc::Args&) { return c10::IValue(c.value); }},
       {"boom", [](Counter&, rpc::CallContext&, const rpc::Args&) -> c10::IValue {
          throw std::runtime_error("counter exploded");
        }}});
}

TEST(CallContext, DefaultConstructs) {
  rpc::CallContext ctx{nullptr, {}};
  EXPECT_EQ(ctx.agent, nullptr);
  EXPECT_EQ(ctx.caller.id, base::kUnknownWorker);
  EXPECT_TRUE(ctx.caller.name.empty());
  rpc::CallContext plain;
  EXPECT_EQ(plain.agent, nullptr);
}

// --- registration -----------------------------------------------------------

TEST(Registry, RegistersAndInvokesAFunction) {
  rpc::Registry registry;
  ASSERT_TRUE(registry
                  .RegisterFunction("math.add",
                                    [](rpc::CallContext&, const rpc::Args& args) {
                                      return c10::IValue(args[0].toInt() +
                                                         args[1].toInt());
                                    })
                  .ok());
  EXPECT_TRUE(registry.Contains("math.add"));
  EXPECT_FALSE(registry.Contains("math.sub"));
  rpc::CallContext ctx{nullptr, {}};
  auto r = InvokeNow(registry, "math.add", ctx, rpc::Args({int64_t{2}, int64_t{40}}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->toInt(), 42);
}

TEST(Registry, FunctionSeesItsCallContext) {
  rpc::Registry registry;
  ASSERT_TRUE(registry
                  .RegisterFunction("whoami",
                                    [](rpc::CallContext& ctx, const rpc::Args&) {
                                      return c10::IValue(ctx.caller.name);
                                    })
                  .ok());
  rpc::CallContext ctx;
  ctx.caller.name = "trainer0";
  auto r = InvokeNow(registry, "whoami", ctx, rpc::Args());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->toStringRef(), "trainer0");
}

TEST(Registry, RejectsInvalidNames) {
  rpc::Registry registry;
  for (const std::string& name :
       {std::string(), std::string(129, 'f'), std::string("has space"),
        std::string("a/b"), std::string("tab\t"), std::string("nul\0x", 5)}) {
    absl::Status s = registry.RegisterFunction(name, ReturnNone);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "'" << name << "'";
    EXPECT_THAT(Message(s), HasSubstr("invalid registered name"));
    EXPECT_FALSE(registry.Contains(name));
  }
  // The same rules hold for modules.
  EXPECT_EQ(RegisterCounter(registry, "bad name").code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Registry, AcceptsNamesAtTheLimits) {
  rpc::Registry registry;
  EXPECT_TRUE(registry.RegisterFunction(std::string(128, 'f'), ReturnNone).ok());
  EXPECT_TRUE(registry.RegisterFunction("a", ReturnNone).ok());
  EXPECT_TRUE(registry.RegisterFunction("A.b:c-d_9", ReturnNone).ok());
  EXPECT_TRUE(registry.Contains(std::string(128, 'f')));
}

TEST(Registry, RejectsDuplicates) {
  rpc::Registry registry;
  ASSERT_TRUE(registry.RegisterFunction("f", ReturnNone).ok());
  absl::Status again = registry.RegisterFunction("f", ReturnNone);
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(Message(again), HasSubstr("'f' is already registered"));

  // A module may not take a function's name, nor the other way round.
  EXPECT_EQ(RegisterCounter(registry, "f").code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(RegisterCounter(registry, "Counter").ok());
  EXPECT_EQ(registry.RegisterFunction("Counter", ReturnNone).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(RegisterCounter(registry, "Counter").code(),
            absl::StatusCode::kAlreadyExists);

  // The first registration is the one that stays.
  rpc::CallContext ctx;
  auto r = InvokeNow(registry, "Counter", ctx, rpc::Args({int64_t{5}}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->isCapsule());
}

TEST(Registry, RejectsEmptyFunction) {
  rpc::Registry registry;
  absl::Status s = registry.RegisterFunction("empty", rpc::Function());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(registry.Contains("empty"));
}

TEST(Registry, RejectsInvalidMethodNames) {
  rpc::Registry registry;
  absl::Status s = registry.RegisterModule<Counter>(
      "M", [](rpc::CallContext&, const rpc::Args&) { return std::make_shared<Counter>(0); },
      {{"bad method", [](Counter&, rpc::CallContext&, const rpc::Args&) { return c10::IValue(); }}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), HasSubstr("bad method"));
  EXPECT_FALSE(registry.Contains("M"));
}

// --- invocation errors ------------------------------------------------------

TEST(Registry, UnknownNameIsNotFound) {
  rpc::Registry registry;
  ASSERT_TRUE(registry.RegisterFunction("known", ReturnNone).ok());
  rpc::CallContext ctx;
  auto r = InvokeNow(registry, "unknown_fn", ctx, rpc::Args());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(r.status()), HasSubstr("unknown_fn"));
}

// A worker program that left out the training group's functions is told
// what to call.
TEST(Registry, AnUnknownRemoraNameSaysToRegisterTheWorkerFunctions) {
  rpc::Registry registry;
  rpc::CallContext ctx;
  auto r = InvokeNow(registry, "remora.pipeline.Stage", ctx, rpc::Args());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(r.status()), HasSubstr("call train::RegisterWorkerFunctions(registry)"));
  EXPECT_THAT(Message(InvokeNow(registry, "mine", ctx, rpc::Args()).status()),
              ::testing::Not(HasSubstr("RegisterWorkerFunctions")));
}

TEST(Registry, StdExceptionBecomesAnError) {
  rpc::Registry registry;
  ASSERT_TRUE(registry
                  .RegisterFunction("throws",
                                    [](rpc::CallContext&, const rpc::Args&) -> c10::IValue {
                                      throw std::runtime_error("disk on fire");
                                    })
                  .ok());
  rpc::CallContext ctx;
  auto r = InvokeNow(registry, "throws", ctx, rpc::Args());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(Message(r.status()), HasSubstr("disk on fire"));
  EXPECT_THAT(Message(r.status()), HasSubstr("throws"));
  // The registry keeps working afterwards.
  EXPECT_FALSE(InvokeNow(registry, "throws", ctx, rpc::Args()).ok());
}

TEST(Registry, C10ErrorBecomesAnError) {
  rpc::Registry registry;
  ASSERT_TRUE(registry
                  .RegisterFunction("checks",
                                    [](rpc::CallContext&, const rpc::Args&) -> c10::IValue {
                                      TORCH_CHECK(false, "shapes do not match: ", 3,
                                                  " vs ", 4);
                                      return c10::IValue();
                                    })
                  .ok());
  rpc::CallContext ctx;
  auto r = InvokeNow(registry, "checks", ctx, rpc::Args());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(Message(r.status()), HasSubstr("shapes do not match: 3 vs 4"));
}

TEST(Registry, NonStdExceptionBecomesAnError) {
  rpc::Registry registry;
  ASSERT_TRUE(registry
                  .RegisterFunction("throws_int",
                                    [](rpc::CallContext&, const rpc::Args&) -> c10::IValue {
                                      throw 17;
                                    })
                  .ok());
  rpc::CallContext ctx;
  auto r = InvokeNow(registry, "throws_int", ctx, rpc::Args());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(Message(r.status()), HasSubstr("unknown exception"));
}

TEST(Registry, MissingArgumentBecomesAnError) {
  rpc::Registry registry;
  ASSERT_TRUE(registry
                  .RegisterFunction("third",
                                    [](rpc::CallContext&, const rpc::Args& args) {
                                      return args[2];
                                    })
                  .ok());
  rpc::CallContext ctx;
  auto r = InvokeNow(registry, "third", ctx, rpc::Args({int64_t{1}}));
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(Message(r.status()), HasSubstr("argument 2"));
  EXPECT_THAT(Message(r.status()), HasSubstr("1 were given"));
  // With enough arguments it works.
  auto ok = InvokeNow(registry, "third", ctx, rpc::Args({int64_t{1}, int64_t{2}, int64_t{3}}));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->toInt(), 3);
}

// --- async functions --------------------------------------------------------

TEST(Registry, AsyncFunctionCompletesLater) {
  rpc::Registry registry;
  rpc::Future<c10::IValue> answer;
  ASSERT_TRUE(registry
                  .RegisterAsyncFunction("later",
                                         [answer](rpc::CallContext&, const rpc::Args&) {
                                           return answer;
                                         })
                  .ok());
  EXPECT_TRUE(registry.Contains("later"));
  rpc::CallContext ctx;
  rpc::Future<c10::IValue> f = registry.Invoke("later", ctx, rpc::Args());
  EXPECT_FALSE(f.ready());
  EXPECT_EQ(f.wait_for(absl::Milliseconds(10)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  answer.SetValue(c10::IValue(int64_t{99}));
  auto r = f.wait_for(absl::Seconds(5));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->toInt(), 99);
}

TEST(Registry, AsyncFunctionErrorsAndThrowsBecomeErrors) {
  rpc::Registry registry;
  ASSERT_TRUE(registry
                  .RegisterAsyncFunction("fails",
                                         [](rpc::CallContext&, const rpc::Args&) {
                                           return rpc::Future<c10::IValue>::Ready(
                                               absl::ResourceExhaustedError("full"));
                                         })
                  .ok());
  ASSERT_TRUE(registry
                  .RegisterAsyncFunction("throws",
                                         [](rpc::CallContext&, const rpc::Args& args) {
                                           return rpc::Future<c10::IValue>::Ready(args[3]);
                                         })
                  .ok());
  rpc::CallContext ctx;
  auto fails = InvokeNow(registry, "fails", ctx, rpc::Args());
  EXPECT_EQ(fails.status().code(), absl::StatusCode::kResourceExhausted);
  auto throws = InvokeNow(registry, "throws", ctx, rpc::Args());
  ASSERT_FALSE(throws.ok());
  EXPECT_THAT(Message(throws.status()), HasSubstr("argument 3"));
}

TEST(Registry, AsyncFunctionNamesFollowTheSameRules) {
  rpc::Registry registry;
  auto fn = [](rpc::CallContext&, const rpc::Args&) {
    return rpc::Future<c10::IValue>::Ready(c10::IValue());
  };
  EXPECT_EQ(registry.RegisterAsyncFunction("a b", fn).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterAsyncFunction("", fn).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterAsyncFunction("ok", rpc::AsyncFunction()).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry.RegisterAsyncFunction("ok", fn).ok());
  EXPECT_EQ(registry.RegisterAsyncFunction("ok", fn).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.RegisterFunction("ok", ReturnNone).code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(RegisterCounter(registry).ok());
  EXPECT_EQ(registry.RegisterAsyncFunction("Counter", fn).code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(Args, IndexingIsBoundsChecked) {
  rpc::Args args({c10::IValue(int64_t{1})});
  EXPECT_EQ(args.size(), 1u);
  EXPECT_EQ(args[0].toInt(), 1);
  EXPECT_THROW(args[1], std::out_of_range);
  EXPECT_THROW(rpc::Args()[0], std::out_of_range);
}

// --- modules ----------------------------------------------------------------

TEST(Registry, InvokeConstructsAModule) {
  rpc::Registry registry;
  ASSERT_TRUE(RegisterCounter(registry).ok());
  EXPECT_TRUE(registry.Contains("Counter"));
  rpc::CallContext ctx;
  auto obj = InvokeNow(registry, "Counter", ctx, rpc::Args({int64_t{10}}));
  ASSERT_TRUE(obj.ok()) << obj.status();
  ASSERT_TRUE(obj->isCapsule());
  rpc::RemoteObject* remote = rpc::AsRemoteObject(*obj);
  ASSERT_NE(remote, nullptr);
  EXPECT_EQ(remote->type(), "Counter");
  ASSERT_NE(remote->get<Counter>(), nullptr);
  EXPECT_EQ(remote->get<Counter>()->value, 10);
}

TEST(Registry, MethodStatePersistsAcrossCalls) {
  rpc::Registry registry;
  ASSERT_TRUE(RegisterCounter(registry).ok());
  rpc::CallContext ctx;
  auto obj = InvokeNow(registry, "Counter", ctx, rpc::Args({int64_t{1}}));
  ASSERT_TRUE(obj.ok()) << obj.status();
  auto other = InvokeNow(registry, "Counter", ctx, rpc::Args());
  ASSERT_TRUE(other.ok()) << other.status();

  auto a = registry.InvokeMethod(*obj, "add", ctx, rpc::Args({int64_t{2}}));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->toInt(), 3);
  auto b = registry.InvokeMethod(*obj, "add", ctx, rpc::Args({int64_t{4}}));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->toInt(), 7);
  auto got = registry.InvokeMethod(*obj, "get", ctx, rpc::Args());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->toInt(), 7);
  // Each instance has its own state.
  auto other_got = registry.InvokeMethod(*other, "get", ctx, rpc::Args());
  ASSERT_TRUE(other_got.ok()) << other_got.status();
  EXPECT_EQ(other_got->toInt(), 0);
}

TEST(Registry, MethodErrorsBecomeStatuses) {
  rpc::Registry registry;
  ASSERT_TRUE(RegisterCounter(registry).ok());
  rpc::CallContext ctx;
  auto obj = InvokeNow(registry, "Counter", ctx, rpc::Args());
  ASSERT_TRUE(obj.ok()) << obj.status();

  auto boom = registry.InvokeMethod(*obj, "boom", ctx, rpc::Args());
  ASSERT_FALSE(boom.ok());
  EXPECT_THAT(Message(boom.status()), HasSubstr("counter exploded"));
  EXPECT_THAT(Message(boom.status()), HasSubstr("Counter.boom"));

  auto missing_arg = registry.InvokeMethod(*obj, "add", ctx, rpc::Args());
  ASSERT_FALSE(missing_arg.ok());
  EXPECT_THAT(Message(missing_arg.status()), HasSubstr("argument 0"));

  // The object survives its methods' failures.
  auto got = registry.InvokeMethod(*obj, "get", ctx, rpc::Args());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->toInt(), 0);
}

TEST(Registry, UnknownMethodListsTheAvailableOnes) {
  rpc::Registry registry;
  ASSERT_TRUE(RegisterCounter(registry).ok());
  rpc::CallContext ctx;
  auto obj = InvokeNow(registry, "Counter", ctx, rpc::Args());
  ASSERT_TRUE(obj.ok()) << obj.status();
  auto r = registry.InvokeMethod(*obj, "reset", ctx, rpc::Args());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(r.status()), HasSubstr("reset"));
  EXPECT_THAT(Message(r.status()), HasSubstr("add, boom, get"));
}

TEST(Registry, InvokeMethodOnNonModuleIsInvalidArgument) {
  rpc::Registry registry;
  ASSERT_TRUE(RegisterCounter(registry).ok());
  rpc::CallContext ctx;
  for (const c10::IValue& v :
       {c10::IValue(int64_t{3}), c10::IValue(), c10::IValue("Counter")}) {
    auto r = registry.InvokeMethod(v, "get", ctx, rpc::Args());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << v.tagKind();
    EXPECT_THAT(Message(r.status()), HasSubstr("does not hold a module"));
  }
  EXPECT_EQ(rpc::AsRemoteObject(c10::IValue(int64_t{3})), nullptr);
}

struct OtherHolder : torch::CustomClassHolder {};

TEST(Registry, InvokeMethodOnForeignCapsuleIsInvalidArgument) {
  rpc::Registry registry;
  ASSERT_TRUE(RegisterCounter(registry).ok());
  rpc::CallContext ctx;
  const c10::IValue capsule =
      c10::IValue::make_capsule(c10::make_intrusive<OtherHolder>());
  EXPECT_EQ(rpc::AsRemoteObject(capsule), nullptr);
  auto r = registry.InvokeMethod(capsule, "get", ctx, rpc::Args());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Registry, InvokeMethodOnUnregisteredTypeIsAnError) {
  rpc::Registry registry;
  rpc::CallContext ctx;
  const c10::IValue obj = c10::IValue::make_capsule(
      c10::make_intrusive<rpc::RemoteObject>("Ghost", std::make_shared<int>(1)));
  auto r = registry.InvokeMethod(obj, "get", ctx, rpc::Args());
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(Message(r.status()), HasSubstr("Ghost"));
}

TEST(Registry, FactoryFailuresBecomeStatuses) {
  rpc::Registry registry;
  ASSERT_TRUE(registry
                  .RegisterModule<Counter>(
                      "Null",
                      [](rpc::CallContext&, const rpc::Args&) { return std::shared_ptr<Counter>(); },
                      {})
                  .ok());
  ASSERT_TRUE(registry
                  .RegisterModule<Counter>(
                      "Throws",
                      [](rpc::CallContext&, const rpc::Args&) -> std::shared_ptr<Counter> {
                        TORCH_CHECK(false, "bad config");
                        return nullptr;
                      },
                      {})
                  .ok());
  rpc::CallContext ctx;
  auto null = InvokeNow(registry, "Null", ctx, rpc::Args());
  EXPECT_EQ(null.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(Message(null.status()), HasSubstr("factory returned null"));
  auto throws = InvokeNow(registry, "Throws", ctx, rpc::Args());
  ASSERT_FALSE(throws.ok());
  EXPECT_THAT(Message(throws.status()), HasSubstr("bad config"));
  EXPECT_THAT(Message(throws.status()), HasSubstr("Throws"));
}

TEST(Registry, ModuleOutlivesTheIValueCopiesThatShareIt) {
  rpc::Registry registry;
  ASSERT_TRUE(RegisterCounter(registry).ok());
  rpc::CallContext ctx;
  c10::IValue copy;
  {
    auto obj = InvokeNow(registry, "Counter", ctx, rpc::Args({int64_t{4}}));
    ASSERT_TRUE(obj.ok()) << obj.status();
    copy = *obj;
  }
  auto got = registry.InvokeMethod(copy, "add", ctx, rpc::Args({int64_t{1}}));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->toInt(), 5);
}

// Records how many threads are inside a method at once.
struct Occupancy {
  std::atomic<int> inside{0};
  std::atomic<int> most{0};
  std::atomic<int> calls{0};
};

TEST(Registry, MethodsOfOneObjectRunOneAtATime) {
  rpc::Registry registry;
  ASSERT_TRUE(registry
                  .RegisterModule<Occupancy>(
                      "Occupancy",
                      [](rpc::CallContext&, const rpc::Args&) { return std::make_shared<Occupancy>(); },
                      {{"enter",
                        [](Occupancy& o, rpc::CallContext&, const rpc::Args&) {
                          int now = ++o.inside;
                          int most = o.most.load();
                          while (now > most && !o.most.compare_exchange_weak(most, now)) {
                          }
                          std::this_thread::sleep_for(std::chrono::microseconds(200));
                          --o.inside;
                          return c10::IValue(int64_t{++o.calls});
                        }}})
                  .ok());
  rpc::CallContext ctx;
  auto a = InvokeNow(registry, "Occupancy", ctx, rpc::Args());
  auto b = InvokeNow(registry, "Occupancy", ctx, rpc::Args());
  ASSERT_TRUE(a.ok() && b.ok());
  constexpr int kThreads = 4, kCalls = 25;
  std::vector<std::thread> threads;
  absl::Notification go;
  for (int t = 0; t < kThreads; ++t) {
    // Threads 0-2 share object a; thread 3 uses b, which may run alongside.
    const c10::IValue target = t < 3 ? *a : *b;
    threads.emplace_back([&registry, &go, target] {
      rpc::CallContext cctx;
      go.WaitForNotification();
      for (int i = 0; i < kCalls; ++i) {
        EXPECT_TRUE(registry.InvokeMethod(target, "enter", cctx, rpc::Args()).ok());
      }
    });
  }
  go.Notify();
  for (auto& t : threads) t.join();
  Occupancy* oa = rpc::AsRemoteObject(*a)->get<Occupancy>();
  Occupancy* ob = rpc::AsRemoteObject(*b)->get<Occupancy>();
  EXPECT_EQ(oa->calls.load(), 3 * kCalls);
  EXPECT_EQ(oa->most.load(), 1);
  EXPECT_EQ(ob->calls.load(), kCalls);
}

// --- worker names -----------------------------------------------------------

TEST(WorkerName, AcceptsValidNames) {
  for (const std::string& name :
       {std::string("worker1"), std::string("a:b-c_d"), std::string("W"),
        std::string(128, 'w')}) {
    EXPECT_TRUE(base::IsValidWorkerName(name)) << name;
  }
}

TEST(WorkerName, RejectsInvalidNames) {
  for (const std::string& name :
       {std::string(), std::string(129, 'w'), std::string("a b"),
        std::string("a.b"), std::string("w/1"), std::string("w\n"),
        std::string("w\0x", 3), std::string("wörker")}) {
    EXPECT_FALSE(base::IsValidWorkerName(name)) << "'" << name << "'";
  }
}

// Method-call lanes of an owner RRef (no sockets: RunInOrder directly).
class Lanes : public ::testing::Test {
 protected:
  rpc::OwnerRRef owner_{1, "w1", base::RRefId{1, 1}, {}, nullptr};
  const base::ForkId lane_{2, 7};
  std::vector<int> ran_;
  std::function<void()> Record(int seq) {
    return [this, seq] { ran_.push_back(seq); };
  }
};

TEST_F(Lanes, CallsRunInTheCallersOrder) {
  const absl::Time t = absl::Now();
  owner_.RunInOrder(0, lane_, 3, Record(3), absl::Seconds(60), t);
  owner_.RunInOrder(0, lane_, 2, Record(2), absl::Seconds(60), t);
  EXPECT_TRUE(ran_.empty());
  owner_.RunInOrder(0, lane_, 1, Record(1), absl::Seconds(60), t);
  EXPECT_THAT(ran_, ::testing::ElementsAre(1, 2, 3));
  owner_.RunInOrder(0, lane_, 0, Record(0), absl::Seconds(60), t);  // unordered: at once
  EXPECT_THAT(ran_, ::testing::ElementsAre(1, 2, 3, 0));
}

TEST_F(Lanes, AMissingCallStopsTheLaneOnlyUntilTheGapTimesOut) {
  const absl::Time t = absl::Now();
  const absl::Duration gap = absl::Seconds(10);
  owner_.RunInOrder(0, lane_, 1, Record(1), gap, t);
  // Call 2 never arrives (its request failed in transport).
  owner_.RunInOrder(0, lane_, 3, Record(3), gap, t + absl::Seconds(1));
  owner_.RunInOrder(0, lane_, 4, Record(4), gap, t + absl::Seconds(9));
  EXPECT_THAT(ran_, ::testing::ElementsAre(1));
  owner_.RunInOrder(0, lane_, 5, Record(5), gap, t + absl::Seconds(12));
  EXPECT_THAT(ran_, ::testing::ElementsAre(1, 3, 4, 5));
  // Call 2 after all: late, but it runs.
  owner_.RunInOrder(0, lane_, 2, Record(2), gap, t + absl::Seconds(13));
  EXPECT_THAT(ran_, ::testing::ElementsAre(1, 3, 4, 5, 2));
  // The lane goes on in order, and other lanes never waited.
  owner_.RunInOrder(0, base::ForkId{2, 8}, 1, Record(100), gap, t + absl::Seconds(13));
  owner_.RunInOrder(0, lane_, 6, Record(6), gap, t + absl::Seconds(14));
  EXPECT_THAT(ran_, ::testing::ElementsAre(1, 3, 4, 5, 2, 100, 6));
}

// The compute lane: one turn at a time, served in the order they were asked
// for (each thread below asks only after the previous one is waiting).

}  // namespace
}  // namespace remora
