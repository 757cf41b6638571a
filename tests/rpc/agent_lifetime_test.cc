// Futures that outlive their agent: made while it ran, so that they name
// its pool (or the pool's lane) as their executor, then completed or given
// a callback after the agent is gone. The stopped pool stays a valid
// object for the rest of the process and drops what is scheduled on it;
// under AddressSanitizer a freed one would be a use after free here.
#include <atomic>
#include <memory>

#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#include "rpc/future.h"
#include "rpc/thread_pool.h"
#include "tests/support/test_group.h"

namespace remora {
namespace agent_lifetime_test {
namespace {

TEST(AgentLifetime, AFutureThatOutlivesItsAgentDropsItsCallbacksWithoutTouchingFreedMemory) {
  std::atomic<int> ran{0};
  rpc::Future<int> pending, completed;
  {
    auto g = std::make_unique<Group>(1);
    rpc::Executor* pool = g->master().executor();
    ASSERT_NE(pool, nullptr);
    pending = rpc::Future<int>(pool);
    pending.then([&ran](const absl::StatusOr<int>&) { ran.fetch_add(1); });
    completed = rpc::Future<int>::Ready(7, pool);
    // While the agent runs, its pool runs callbacks.
    rpc::Future<int> now(pool);
    absl::Notification done;
    now.then([&done](const absl::StatusOr<int>&) { done.Notify(); });
    now.SetValue(1);
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  }  // both agents stopped and destroyed
  EXPECT_TRUE(pending.SetValue(3));  // its callback goes to the stopped pool
  completed.then([&ran](const absl::StatusOr<int>&) { ran.fetch_add(1); });
  EXPECT_EQ(ran.load(), 0);  // dropped, as a stopped pool drops tasks
  EXPECT_EQ(*pending.wait(), 3);
  EXPECT_EQ(*completed.wait(), 7);
}

}  // namespace
}  // namespace agent_lifetime_test
}  // namespace remora
