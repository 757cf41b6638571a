// Tests of Future<T>, WhenAll and their interplay with ThreadPool.

#include "rpc/future.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/mutex_lock.h"
#include "rpc/thread_pool.h"
#include "tests/support/proc.h"

namespace remora {
namespace {

std::string CurrentThreadName() {
  char name[16] = {};
  EXPECT_EQ(pthread_getname_np(pthread_self(), name, sizeof(name)), 0);
  return name;
}

// Where and how often a callback ran.
struct Record {
  absl::Mutex mu;
  int calls ABSL_GUARDED_BY(mu) = 0;
  std::thread::id thread ABSL_GUARDED_BY(mu);
  std::string thread_name ABSL_GUARDED_BY(mu);
  absl::StatusOr<int> result ABSL_GUARDED_BY(mu) = absl::UnknownError("unset");

  rpc::Future<int>::Callback Callback() {
    return [this](const absl::StatusOr<int>& r) {
      std::string name = CurrentThreadName();
      base::MutexLock lock(mu);
      ++calls;
      thread = std::this_thread::get_id();
      thread_name = name;
      result = r;
    };
  }
  int Calls() {
    base::MutexLock lock(mu);
    return calls;
  }
  void AwaitCalls(int n) {
    base::MutexLock lock(mu);
    auto reached = [this, n]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return calls >= n; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(5)));
  }
};

TEST(Future, StartsPending) {
  rpc::Future<int> f;
  EXPECT_FALSE(f.ready());
  EXPECT_EQ(f.executor(), nullptr);
}

TEST(Future, CompletesExactlyOnceWithValue) {
  rpc::Future<int> f;
  EXPECT_TRUE(f.SetValue(1));
  EXPECT_TRUE(f.ready());
  EXPECT_FALSE(f.SetValue(2));
  EXPECT_FALSE(f.SetError(absl::InternalError("late")));
  EXPECT_FALSE(f.Complete(3));
  auto r = f.wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, 1);
}

TEST(Future, CompletesExactlyOnceWithError) {
  rpc::Future<std::string> f;
  EXPECT_TRUE(f.SetError(absl::NotFoundError("first")));
  EXPECT_FALSE(f.SetValue("value"));
  EXPECT_FALSE(f.SetError(absl::InternalError("second")));
  auto r = f.wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(), "first");
}

TEST(Future, SetErrorWithOkBecomesAnError) {
  rpc::Future<int> f;
  EXPECT_TRUE(f.SetError(absl::OkStatus()));
  auto r = f.wait();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
}

TEST(Future, CopiesShareOneState) {
  rpc::Future<int> a;
  rpc::Future<int> b = a;
  EXPECT_TRUE(b.SetValue(5));
  EXPECT_TRUE(a.ready());
  EXPECT_FALSE(a.SetValue(6));
  EXPECT_EQ(*a.wait(), 5);
}

TEST(Future, WaitBlocksUntilAnotherThreadCompletes) {
  rpc::Future<int> f;
  std::atomic<bool> set{false};
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(30));
    set = true;
    f.SetValue(42);
  });
  auto r = f.wait();
  EXPECT_TRUE(set.load());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 42);
  t.join();
}

TEST(Future, WaitReturnsTheError) {
  rpc::Future<int> f;
  std::thread t([&] { f.SetError(absl::UnavailableError("down")); });
  auto r = f.wait();
  t.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(r.status().message(), "down");
}

TEST(Future, WaitForTimesOutOnPendingFuture) {
  rpc::Future<int> f;
  const absl::Time start = absl::Now();
  auto r = f.wait_for(absl::Milliseconds(50));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(45));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(f.ready());
  // The future is still usable afterwards.
  EXPECT_TRUE(f.SetValue(1));
  auto later = f.wait_for(absl::Milliseconds(50));
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ(*later, 1);
}

TEST(Future, WaitForReturnsOnceCompleted) {
  rpc::Future<int> f;
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(20));
    f.SetValue(8);
  });
  auto r = f.wait_for(absl::Seconds(10));
  t.join();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, 8);
  // And with an error.
  rpc::Future<int> e = rpc::Future<int>::Ready(absl::AbortedError("x"));
  EXPECT_EQ(e.wait_for(absl::Seconds(1)).status().code(), absl::StatusCode::kAborted);
}

TEST(Future, ThenBeforeAndAfterCompletionRunOnceInlineWithoutExecutor) {
  rpc::Future<int> f;
  Record before, after;
  f.then(before.Callback());
  EXPECT_EQ(before.Calls(), 0);
  f.SetValue(7);
  EXPECT_EQ(before.Calls(), 1);  // inline: already ran
  f.then(after.Callback());
  EXPECT_EQ(after.Calls(), 1);
  f.SetValue(8);  // no effect
  EXPECT_EQ(before.Calls(), 1);
  EXPECT_EQ(after.Calls(), 1);
  base::MutexLock lock(before.mu);
  EXPECT_EQ(before.thread, std::this_thread::get_id());
  EXPECT_EQ(*before.result, 7);
}

TEST(Future, ThenSeesTheError) {
  rpc::Future<int> f;
  Record rec;
  f.then(rec.Callback());
  f.SetError(absl::PermissionDeniedError("no"));
  base::MutexLock lock(rec.mu);
  EXPECT_EQ(rec.result.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(Future, ThenRunsOnExecutorThreadsOnly) {
  Record before, after, late;
  {
    rpc::ThreadPool pool(2);
    rpc::Future<int> f(&pool);
    EXPECT_EQ(f.executor(), &pool);
    f.then(before.Callback());
    f.SetValue(3);  // completed on this (the test's) thread
    f.then(after.Callback());
    // Completed by a thread that is neither the test's nor the pool's.
    rpc::Future<int> g(&pool);
    g.then(late.Callback());
    std::thread other([&] { g.SetValue(4); });
    other.join();
  }  // the pool runs every scheduled task before it joins
  for (Record* r : {&before, &after, &late}) {
    base::MutexLock lock(r->mu);
    EXPECT_EQ(r->calls, 1);
    EXPECT_NE(r->thread, std::this_thread::get_id());
    EXPECT_EQ(r->thread_name, rpc::ThreadPool::kThreadName);
  }
  base::MutexLock lock(late.mu);
  EXPECT_EQ(*late.result, 4);
}

TEST(Future, ThenAfterCompletionDoesNotRunOnCallerWithExecutor) {
  Record rec;  // outlives the pool
  rpc::ThreadPool pool(1);
  auto f = rpc::Future<int>::Ready(9, &pool);
  f.then(rec.Callback());
  rec.AwaitCalls(1);
  base::MutexLock lock(rec.mu);
  EXPECT_NE(rec.thread, std::this_thread::get_id());
  EXPECT_EQ(rec.thread_name, rpc::ThreadPool::kThreadName);
  EXPECT_EQ(*rec.result, 9);
}

TEST(Future, CallbackKeepsStateAliveAfterFutureIsGone) {
  Record rec;
  {
    absl::Notification block;  // outlives the pool, which waits on it
    rpc::ThreadPool pool(1);
    pool.Schedule([&] { block.WaitForNotification(); });  // hold the pool
    {
      rpc::Future<int> f(&pool);
      f.then(rec.Callback());
      f.SetValue(11);
    }  // every copy of the future is gone; the callback is still queued
    block.Notify();
  }
  base::MutexLock lock(rec.mu);
  EXPECT_EQ(rec.calls, 1);
  EXPECT_EQ(*rec.result, 11);
}

TEST(Future, RacingCompletersExactlyOneWins) {
  constexpr int kThreads = 8;
  for (int round = 0; round < 50; ++round) {
    rpc::Future<int> f;
    std::atomic<int> wins{0};
    std::atomic<int> callbacks{0};
    std::atomic<int> seen{-1};
    f.then([&](const absl::StatusOr<int>& r) {
      ++callbacks;
      seen = r.ok() ? *r : -2;
    });
    absl::Notification go;
    std::vector<std::thread> threads;
    std::atomic<int> won_by{-1};
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] {
        go.WaitForNotification();
        bool w = (i % 2 == 0) ? f.SetValue(i)
                              : f.SetError(absl::InternalError(std::to_string(i)));
        if (w) {
          ++wins;
          won_by = i;
        }
      });
    }
    go.Notify();
    for (auto& t : threads) t.join();
    ASSERT_EQ(wins.load(), 1) << "round " << round;
    ASSERT_EQ(callbacks.load(), 1) << "round " << round;
    const int winner = won_by.load();
    ASSERT_GE(winner, 0);
    auto r = f.wait();
    if (winner % 2 == 0) {
      ASSERT_TRUE(r.ok());
      EXPECT_EQ(*r, winner);
      EXPECT_EQ(seen.load(), winner);
    } else {
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().message(), std::to_string(winner));
      EXPECT_EQ(seen.load(), -2);
    }
  }
}

TEST(Future, ReadyIsCompleted) {
  auto ok = rpc::Future<int>::Ready(5);
  EXPECT_TRUE(ok.ready());
  EXPECT_FALSE(ok.SetValue(6));
  EXPECT_EQ(*ok.wait(), 5);

  auto err = rpc::Future<int>::Ready(absl::CancelledError("c"));
  EXPECT_TRUE(err.ready());
  EXPECT_EQ(err.wait().status().code(), absl::StatusCode::kCancelled);

  rpc::ThreadPool pool(1);
  auto with_executor = rpc::Future<rpc::Empty>::Ready(rpc::Empty{}, &pool);
  EXPECT_EQ(with_executor.executor(), &pool);
  EXPECT_TRUE(with_executor.wait().ok());
}

// --- WhenAll ----------------------------------------------------------------

TEST(WhenAll, EmptyIsReady) {
  auto all = rpc::WhenAll(std::vector<rpc::Future<int>>{});
  EXPECT_TRUE(all.ready());
  EXPECT_TRUE(all.wait().ok());
}

TEST(WhenAll, CompletesOnlyAfterEveryInput) {
  std::vector<rpc::Future<int>> fs(3);
  auto all = rpc::WhenAll(fs);
  EXPECT_FALSE(all.ready());
  fs[1].SetValue(1);
  fs[0].SetValue(0);
  EXPECT_FALSE(all.ready());
  fs[2].SetValue(2);
  EXPECT_TRUE(all.ready());
  EXPECT_TRUE(all.wait().ok());
}

TEST(WhenAll, OverReadyFutures) {
  std::vector<rpc::Future<int>> fs = {rpc::Future<int>::Ready(1), rpc::Future<int>::Ready(2)};
  auto all = rpc::WhenAll(fs);
  EXPECT_TRUE(all.ready());
  EXPECT_TRUE(all.wait().ok());
}

TEST(WhenAll, ErrorWaitsForTheRestThenPropagates) {
  std::vector<rpc::Future<int>> fs(3);
  auto all = rpc::WhenAll(fs);
  fs[0].SetError(absl::DataLossError("first failure"));
  EXPECT_FALSE(all.ready());  // an error does not short-circuit
  fs[1].SetError(absl::InternalError("second failure"));
  EXPECT_FALSE(all.ready());
  fs[2].SetValue(2);
  ASSERT_TRUE(all.ready());
  auto r = all.wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(r.status().message(), "first failure");
}

TEST(WhenAll, CompletedFromManyThreads) {
  constexpr int kInputs = 64;
  std::vector<rpc::Future<int>> fs(kInputs);
  auto all = rpc::WhenAll(fs);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < kInputs; i += 4) {
        if (i == 37) {
          fs[i].SetError(absl::OutOfRangeError("37"));
        } else {
          fs[i].SetValue(i);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(all.ready());
  EXPECT_EQ(all.wait().status().code(), absl::StatusCode::kOutOfRange);
}

TEST(WhenAll, ResultCallbacksRunOnItsExecutor) {
  std::atomic<int> calls{0};
  std::string name;
  std::thread::id id;
  {
    rpc::ThreadPool pool(1);
    std::vector<rpc::Future<int>> fs(2);
    auto all = rpc::WhenAll(fs, &pool);
    EXPECT_EQ(all.executor(), &pool);
    all.then([&](const absl::StatusOr<rpc::Empty>& r) {
      name = CurrentThreadName();
      id = std::this_thread::get_id();
      EXPECT_TRUE(r.ok());
      ++calls;
    });
    fs[0].SetValue(0);
    fs[1].SetValue(1);
    EXPECT_TRUE(all.wait_for(absl::Seconds(5)).ok());
  }
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(name, rpc::ThreadPool::kThreadName);
  EXPECT_NE(id, std::this_thread::get_id());
}

// --- ThreadPool -------------------------------------------------------------

TEST(ThreadPool, DestructorRunsEveryScheduledTask) {
  std::atomic<int> ran{0};
  {
    rpc::ThreadPool pool(2);
    for (int i = 0; i < 100; ++i) pool.Schedule([&] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 100);
}

TEST(ThreadPool, TasksMayScheduleMoreTasks) {
  std::atomic<int> ran{0};
  {
    absl::Notification done;  // outlives the pool
    rpc::ThreadPool pool(1);
    pool.Schedule([&] {
      ++ran;
      pool.Schedule([&] {
        ++ran;
        done.Notify();
      });
    });
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  }
  EXPECT_EQ(ran.load(), 2);
}

TEST(ThreadPool, TheLaneRunsItsTasksInOrderOnOneThreadOfItsOwn) {
  absl::Mutex mu;  // these outlive the pool
  std::vector<int> order;
  std::set<std::thread::id> threads;
  std::set<std::string> names;
  absl::Notification done;
  rpc::ThreadPool pool(4);
  for (int i = 0; i < 50; ++i) {
    pool.lane()->Schedule([&, i] {
      char name[16] = {};
      pthread_getname_np(pthread_self(), name, sizeof(name));
      base::MutexLock lock(mu);
      order.push_back(i);
      threads.insert(std::this_thread::get_id());
      names.insert(name);
      if (i == 49) done.Notify();
    });
  }
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  base::MutexLock lock(mu);
  std::vector<int> expected(50);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
  EXPECT_EQ(threads.size(), 1u);
  EXPECT_EQ(names, std::set<std::string>{rpc::ThreadPool::kLaneThreadName});
  EXPECT_EQ(threads.count(std::this_thread::get_id()), 0u);
}

// A lane that busy-polls for its next task (AgentOptions::busy_poll) runs
// what comes while it polls and what comes after it went to sleep, in
// order, and does not hold up the pool's stop beyond its poll.
TEST(ThreadPool, ABusyPollingLaneRunsItsTasksInOrderAndStops) {
  absl::Mutex mu;
  std::vector<int> order;
  auto pool = std::make_unique<rpc::ThreadPool>(2, absl::Milliseconds(5));
  for (int i = 0; i < 20; ++i) {
    // Every fourth task after a gap longer than the poll: the lane slept.
    if (i % 4 == 0) absl::SleepFor(absl::Milliseconds(i % 8 == 0 ? 1 : 12));
    pool->lane()->Schedule([&mu, &order, i] {
      base::MutexLock lock(mu);
      order.push_back(i);
    });
  }
  const absl::Time start = absl::Now();
  pool->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  base::MutexLock lock(mu);
  std::vector<int> expected(20);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
  EXPECT_EQ(pool->busy(), 0);
}

// PollForOutcome, how a caller busy-polls replies: still pending at once
// without a spin, or while one is; all succeeded once every one has come
// (one of them late); a failure's index and error as soon as it is seen.
TEST(Future, PollForOutcomeSaysAllSucceededAFailureOrStillPending) {
  std::vector<rpc::Future<int>> replies(3);
  absl::Status failure;
  EXPECT_EQ(rpc::PollForOutcome(replies, absl::ZeroDuration(), &failure), rpc::kPollStillPending);
  replies[0].SetValue(1);
  replies[2].SetValue(3);
  EXPECT_EQ(rpc::PollForOutcome(replies, absl::Milliseconds(5), &failure), rpc::kPollStillPending);
  std::thread late([reply = replies[1]]() mutable {
    absl::SleepFor(absl::Milliseconds(20));
    reply.SetValue(2);
  });
  EXPECT_EQ(rpc::PollForOutcome(replies, absl::Seconds(30), &failure), rpc::kPollAllSucceeded);
  late.join();
  EXPECT_TRUE(failure.ok());
  std::vector<rpc::Future<int>> some_failed(2);
  some_failed[1].SetError(absl::DataLossError("lost on the way"));
  EXPECT_EQ(rpc::PollForOutcome(some_failed, absl::Seconds(30), &failure), 1);
  EXPECT_EQ(failure, absl::DataLossError("lost on the way"));
}

// A busy-polling pool keeps one idle thread spinning, so that a task
// scheduled finds it awake, never more than one (the others sleep); it runs
// every task, and stops at once though a thread spins.
TEST(ThreadPool, OneIdleThreadOfABusyPollingPoolSpinsAndItStopsAtOnce) {
  auto pool = std::make_unique<rpc::ThreadPool>(4, absl::Seconds(30));
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i) pool->Schedule([&ran] { ++ran; });
  for (int i = 0; i < 1000 && (ran.load() < 50 || pool->busy() > 0); ++i) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(ran.load(), 50);
  // Pool threads running or runnable (a sleeper shows S): a thread counts
  // as spinning when it shows so in two samples in a row (not one that was
  // on its way to sleep when a sample was taken).
  auto running = [] {
    const std::map<int, std::string> names = test_support::ThreadStatus(getpid(), "Name:");
    const std::map<int, std::string> states = test_support::ThreadStatus(getpid(), "State:");
    std::set<int> tids;
    for (const auto& [tid, name] : names) {
      auto state = states.find(tid);
      if (name == rpc::ThreadPool::kThreadName && state != states.end() && absl::StartsWith(state->second, "R")) {
        tids.insert(tid);
      }
    }
    return tids;
  };
  int most = 0, samples_with_one = 0;
  std::set<int> before = running();
  for (int sample = 0; sample < 20; ++sample) {
    absl::SleepFor(absl::Milliseconds(5));
    const std::set<int> now = running();
    int spinning = 0;
    for (int tid : now) spinning += before.count(tid);
    most = std::max(most, spinning);
    if (spinning == 1) ++samples_with_one;
    before = now;
  }
  EXPECT_LE(most, 1);
  EXPECT_GT(samples_with_one, 0) << "no pool thread was seen spinning";
  const absl::Time start = absl::Now();
  pool->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "Stop waited for the spin (30 s) to run out";
  EXPECT_EQ(pool->busy(), 0);
}

// What the pool's tasks schedule on the lane, and the lane's on the pool,
// still runs when the pool stops: whichever side drains first.
TEST(ThreadPool, StopRunsWhatThePoolAndTheLaneScheduleOnEachOther) {
  std::atomic<int> ran{0};
  {
    rpc::ThreadPool pool(2);
    for (int i = 0; i < 20; ++i) {
      pool.Schedule([&] {
        ++ran;
        pool.lane()->Schedule([&] {
          ++ran;
          absl::SleepFor(absl::Milliseconds(1));
          pool.Schedule([&] { ++ran; });
        });
      });
    }
    pool.Stop();
    EXPECT_EQ(ran.load(), 60);
    EXPECT_EQ(pool.busy(), 0);
  }
  EXPECT_EQ(ran.load(), 60);
}

TEST(ThreadPool, BusyCountsQueuedAndRunningTasks) {
  absl::Notification release, started;  // outlive the pool
  rpc::ThreadPool pool(1);
  pool.Schedule([&] {
    started.Notify();
    release.WaitForNotification();
  });
  pool.Schedule([] {});
  started.WaitForNotification();
  EXPECT_EQ(pool.busy(), 2);
  release.Notify();
}

// A task or a callback that throws is reported on stderr and the process
// goes on (it would otherwise end in std::terminate): the pool's threads,
// the lane and a callback run inline on the completing thread.
TEST(ThreadPool, ATaskOrCallbackThatThrowsIsReportedAndEverythingGoesOn) {
  testing::internal::CaptureStderr();
  std::atomic<int> ran{0};
  {
    rpc::ThreadPool pool(1);
    pool.Schedule([] { throw std::runtime_error("task bug"); });
    pool.lane()->Schedule([] { throw std::logic_error("lane bug"); });
    rpc::Future<int> on_pool(&pool);
    on_pool.then([](const absl::StatusOr<int>&) { throw std::runtime_error("callback bug"); });
    on_pool.SetValue(1);
    pool.Schedule([&ran] { ++ran; });
    pool.lane()->Schedule([&ran] { ++ran; });
  }
  rpc::Future<int> inline_callbacks;
  inline_callbacks.then([](const absl::StatusOr<int>&) { throw std::runtime_error("inline bug"); });
  inline_callbacks.then([&ran](const absl::StatusOr<int>&) { ++ran; });
  EXPECT_TRUE(inline_callbacks.SetValue(2));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(ran.load(), 3);
  for (const char* what : {"a task on the agent's thread pool threw: task bug",
                           "a task on the agent's lane threw: lane bug", "a future's callback threw: callback bug",
                           "a future's callback threw: inline bug"}) {
    EXPECT_NE(err.find(what), std::string::npos) << what << " not in:\n" << err;
  }
}

}  // namespace
}  // namespace remora
