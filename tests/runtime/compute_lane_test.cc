// The compute lane without sockets: plain turns one at a time in arrival
// order; a schedule's actions in the schedule's order, whatever order they
// arrive in; plain turns while the next action has not arrived; a new
// order releases the old one's waiters; skipped actions are not waited for;
// an abandoned order (a failed batch) releases its waiters, and an action
// that outlives its order does not count in the next one.
#include "runtime/compute_lane.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "base/mutex_lock.h"

namespace remora {
namespace {

TEST(ComputeTurn, OneAtATimeInArrivalOrder) {
  auto first = std::make_unique<runtime::ComputeTurn>();
  ASSERT_EQ(runtime::ComputeTurn::Queued(), 1);
  absl::Mutex mu;
  std::vector<int> order;
  std::atomic<int> inside{0}, most{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      runtime::ComputeTurn turn;
      const int now = inside.fetch_add(1) + 1;
      for (int seen = most.load(); seen < now && !most.compare_exchange_weak(seen, now);) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      {
        base::MutexLock lock(mu);
        order.push_back(i);
      }
      inside.fetch_sub(1);
    });
    while (runtime::ComputeTurn::Queued() < i + 2) std::this_thread::yield();
  }
  {
    base::MutexLock lock(mu);
    EXPECT_TRUE(order.empty());  // all wait behind the first turn
  }
  first.reset();
  for (auto& t : threads) t.join();
  EXPECT_THAT(order, ::testing::ElementsAre(0, 1, 2, 3));
  EXPECT_EQ(most.load(), 1);
  EXPECT_EQ(runtime::ComputeTurn::Queued(), 0);
}


// Records what ran, in order; runs async turns on threads of its own.
class Recorder {
 public:
  ~Recorder() {
    for (auto& t : threads_) t.join();
  }
  void Add(const std::string& what) {
    base::MutexLock lock(mu_);
    order_.push_back(what);
  }
  std::vector<std::string> order() {
    base::MutexLock lock(mu_);
    return order_;
  }
  // A sync turn for `a` on a thread of its own.
  void Sync(const runtime::LaneAction& a) {
    threads_.emplace_back([this, a] {
      runtime::ComputeTurn turn(a);
      Add(a.ToString());
    });
  }
  void Plain(const std::string& name) {
    threads_.emplace_back([this, name] {
      runtime::ComputeTurn turn;
      Add(name);
    });
  }
  // An async turn for `a` (then `then`, holding it); `post` starts a thread.
  void Async(const runtime::LaneAction& a, std::function<void()> then = nullptr) {
    runtime::ComputeTurn::RunInTurn(
        a,
        [this, a, then] {
          Add(a.ToString());
          if (then) then();
        },
        [this](std::function<void()> fn) {
          base::MutexLock lock(mu_);
          posted_.emplace_back(std::move(fn));
        });
  }
  // Runs posted closures until `n` entries are recorded.
  void Drive(size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (order().size() < n && std::chrono::steady_clock::now() < deadline) {
      std::vector<std::function<void()>> ready;
      {
        base::MutexLock lock(mu_);
        ready.swap(posted_);
      }
      for (auto& fn : ready) threads_.emplace_back(std::move(fn));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> order_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;  // touched by the test's thread only
};

void WaitQueued(int64_t n) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (runtime::ComputeTurn::Queued() < n && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  ASSERT_EQ(runtime::ComputeTurn::Queued(), n);
}

runtime::LaneAction F(int64_t context_id, int64_t mb) { return runtime::LaneAction{context_id, 0, mb, false}; }
runtime::LaneAction B(int64_t context_id, int64_t mb) { return runtime::LaneAction{context_id, 0, mb, true}; }

TEST(ComputeTurn, ActionsRunInTheirOrderWhateverOrderTheyArriveIn) {
  runtime::ComputeTurn::SetOrder(1, {F(1, 0), F(1, 1), B(1, 0), F(1, 2), B(1, 1), B(1, 2)});
  {
    Recorder r;
    // Arrivals in reverse order; backwards wait without a thread.
    r.Async(B(1, 2));
    r.Async(B(1, 1));
    r.Sync(F(1, 2));
    WaitQueued(3);
    r.Async(B(1, 0));
    r.Sync(F(1, 1));
    WaitQueued(5);
    EXPECT_TRUE(r.order().empty());  // F0 has not come: nothing of the order runs
    r.Sync(F(1, 0));
    r.Drive(6);
    EXPECT_THAT(r.order(), ::testing::ElementsAre("F0@stage0", "F1@stage0", "B0@stage0",
                                                  "F2@stage0", "B1@stage0", "B2@stage0"));
  }
  EXPECT_EQ(runtime::ComputeTurn::Queued(), 0);
}

TEST(ComputeTurn, PlainTurnsRunWhileTheNextActionHasNotArrived) {
  runtime::ComputeTurn::SetOrder(2, {F(2, 0), F(2, 1)});
  {
    Recorder r;
    r.Sync(F(2, 1));  // waits for F0
    WaitQueued(1);
    r.Plain("plain");
    r.Drive(1);
    EXPECT_THAT(r.order(), ::testing::ElementsAre("plain"));
    r.Sync(runtime::LaneAction{99, 0, 0, false});  // another context's: a plain turn
    r.Drive(2);
    r.Sync(F(2, 0));
    r.Drive(4);
    EXPECT_THAT(r.order(), ::testing::ElementsAre("plain", "F0@stage0", "F0@stage0", "F1@stage0"));
  }
  EXPECT_EQ(runtime::ComputeTurn::Queued(), 0);
}

TEST(ComputeTurn, ANewOrderLetsTheOldOrdersWaitersRun) {
  runtime::ComputeTurn::SetOrder(3, {F(3, 0), F(3, 1)});
  {
    Recorder r;
    r.Sync(F(3, 1));  // F0 never comes: a failed batch
    r.Async(B(3, 1));
    WaitQueued(2);
    runtime::ComputeTurn::SetOrder(4, {F(4, 0)});
    r.Drive(2);
    EXPECT_EQ(r.order().size(), 2u);
  }
  EXPECT_EQ(runtime::ComputeTurn::Queued(), 0);
}

TEST(ComputeTurn, SkippedActionsAreNotWaitedFor) {
  runtime::ComputeTurn::SetOrder(5, {F(5, 0), B(5, 0), F(5, 1), B(5, 1)});
  {
    Recorder r;
    r.Sync(F(5, 1));  // waits for B0, which will never come
    r.Sync(F(5, 0));
    r.Drive(1);
    EXPECT_THAT(r.order(), ::testing::ElementsAre("F0@stage0"));
    WaitQueued(1);
    runtime::ComputeTurn::Skip(B(5, 0));
    runtime::ComputeTurn::Skip(B(5, 1));
    runtime::ComputeTurn::Skip(B(99, 0));  // not of this order: nothing happens
    r.Drive(2);
    EXPECT_THAT(r.order(), ::testing::ElementsAre("F0@stage0", "F1@stage0"));
  }
  EXPECT_EQ(runtime::ComputeTurn::Queued(), 0);
}

TEST(ComputeTurn, AnAbandonedOrderServesItsWaitersAndLaterArrivalsAsPlainTurns) {
  runtime::ComputeTurn::SetOrder(6, {F(6, 0), B(6, 0), F(6, 1), B(6, 1), F(6, 2)});
  {
    Recorder r;
    r.Sync(F(6, 0));
    r.Drive(1);
    r.Sync(F(6, 1));  // waits for B0, which a failed batch never sends
    WaitQueued(1);
    runtime::ComputeTurn::Abandon(99);  // another context's: nothing happens
    runtime::ComputeTurn::Abandon(5);
    EXPECT_THAT(r.order(), ::testing::ElementsAre("F0@stage0"));
    WaitQueued(1);
    runtime::ComputeTurn::Abandon(6);
    r.Drive(2);
    r.Sync(F(6, 2));  // arrives after: a plain turn
    r.Drive(3);
    EXPECT_THAT(r.order(), ::testing::ElementsAre("F0@stage0", "F1@stage0", "F2@stage0"));
  }
  EXPECT_EQ(runtime::ComputeTurn::Queued(), 0);
}

// A batch fails in one of its actions and the next batch's order is set
// while that action still holds the lane (the step runner does so): the
// action's end must not count in the new order, whose first action would
// then wait forever (seen as a hung step in CI).
TEST(ComputeTurn, AnActionEndingAfterItsOrderWasReplacedDoesNotAdvanceTheNewOne) {
  runtime::ComputeTurn::SetOrder(7, {F(7, 0), F(7, 1)});
  std::atomic<bool> done{false};
  {
    Recorder r;
    r.Async(F(7, 0), [&] {
      runtime::ComputeTurn::Abandon(7);
      runtime::ComputeTurn::SetOrder(8, {F(8, 0), F(8, 1)});
      runtime::ComputeTurn::WhenOrderDone(8, [&done] { done = true; });
      r.Async(F(8, 0));  // waits: F0 of batch 7 still holds the lane
    });
    r.Drive(2);
    EXPECT_THAT(r.order(), ::testing::ElementsAre("F0@stage0", "F0@stage0"));
    EXPECT_FALSE(done) << "batch 8's F1 has not run";
    r.Async(F(8, 1));
    r.Drive(3);
    EXPECT_THAT(r.order(), ::testing::ElementsAre("F0@stage0", "F0@stage0", "F1@stage0"));
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(runtime::ComputeTurn::Queued(), 0);
}

}  // namespace
}  // namespace remora
