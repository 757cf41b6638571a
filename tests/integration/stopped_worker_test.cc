// A worker process stopped (SIGSTOP) while the master's calls to it are
// in flight on a local link: the link's keepalive fails them within
// seconds, whatever their deadline, naming the worker; once it runs again
// its calls take a link again.
#include <csignal>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "rpc/agent.h"
#include "rpc/link.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/test_group.h"

namespace remora {
namespace stopped_worker_test {
namespace {

using ::testing::HasSubstr;

TEST(LinkKeepalive, ACallToAStoppedWorkerFailsWithinSecondsAndItsLinkComesBack) {
  test_support::TestWorkers workers;
  rpc::Agent& master = workers.master();
  auto warm = master.rpc_async("w2", "remora.pipeline.alive").wait();
  ASSERT_TRUE(warm.ok()) << warm.status();
  ASSERT_GT(master.calls_on_links(), 0) << "the call did not take a link";

  workers.worker(1).Signal(SIGSTOP);
  ASSERT_TRUE(AwaitStopped(workers.worker(1).pid()));
  rpc::CallOptions minutes;
  minutes.timeout = absl::Minutes(5);
  const absl::Time start = absl::Now();
  auto stalled = master.rpc_async("w2", "remora.pipeline.alive", {}, minutes).wait();
  const absl::Duration took = absl::Now() - start;
  // Still stopped: a new link's hello goes unanswered, and the call goes
  // over gRPC, whose own keepalive fails it.
  rpc::CallOptions briefly;
  briefly.timeout = absl::Seconds(10);
  auto over_grpc = master.rpc_async("w2", "remora.pipeline.alive", {}, briefly).wait();
  workers.worker(1).Signal(SIGCONT);

  ASSERT_FALSE(stalled.ok());
  EXPECT_EQ(stalled.status().code(), absl::StatusCode::kUnavailable) << stalled.status();
  EXPECT_THAT(stalled.status().message(), HasSubstr("w2")) << stalled.status();
  EXPECT_THAT(stalled.status().message(), HasSubstr("answered no keepalive ping")) << stalled.status();
  EXPECT_GE(took, rpc::LinkClient::kKeepaliveTime + rpc::LinkClient::kKeepaliveTimeout);
  EXPECT_LT(took, absl::Seconds(30));
  EXPECT_FALSE(over_grpc.ok());

  // Running again: within seconds its calls are answered, on a link.
  bool on_link = false;
  for (int i = 0; i < 300 && !on_link; ++i) {
    const int64_t before = master.calls_on_links();
    on_link = master.rpc_async("w2", "remora.pipeline.alive").wait().ok() && master.calls_on_links() > before;
    if (!on_link) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(on_link) << "w2's calls went on over gRPC after it ran again";
}

}  // namespace
}  // namespace stopped_worker_test
}  // namespace remora
