// The benchmark programs run as a user runs them: rpc_bench and
// pipeline_bench (their figures are not checked: timings are not asserted
// in tests; what is checked is that they measure what they say).
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/time.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;


// rpc_bench's figures are not checked (timings are not asserted in tests),
// only that it measures what it says: sizes below the out-of-band threshold
// travel inline, sizes from it on through shared memory, and the bulk line
// names the channel.
TEST(RpcBench, SweepsSizesAcrossTheThresholdAndNamesTheChannels) {
  auto [code, out] = RunProgram({BinDir() + "/rpc_bench", "--calls", "100", "--warmup", "10",
                                 "--bulk-mib", "2", "--bulk-calls", "2", "--sizes", "4K,64K,1M"},
                                absl::Seconds(120));
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("size_bytes=4096 channel=inline calls=2000 gbps="));
  EXPECT_THAT(out, HasSubstr("size_bytes=65536 channel=shm calls=2000 gbps="));
  EXPECT_THAT(out, HasSubstr("size_bytes=1048576 channel=shm calls=256 gbps="));
  EXPECT_THAT(out, HasSubstr("\nchannel=shm\n"));
  EXPECT_THAT(out, HasSubstr("\nbulk_gbps="));
  EXPECT_THAT(out, HasSubstr("\nmemcpy_gbps="));
  EXPECT_THAT(out, HasSubstr("\nasync_latency_us_p10="));
  // The worker beside it is on this host: rpc_async takes the local link.
  EXPECT_THAT(out, HasSubstr("\nrpc_async_on=link\n"));

  for (const auto& [sizes, text] : {std::pair{"4K,0", "--sizes: '0' is not a size"}, {"2048M", "1 byte to 1 GiB"},
                                    {"4K,,8K", "has an empty size"}}) {
    auto [bad, bad_out] = RunProgram({BinDir() + "/rpc_bench", "--sizes", sizes});
    EXPECT_EQ(bad, 2) << bad_out;
    EXPECT_THAT(bad_out, HasSubstr(text));
  }
}

// pipeline_bench --hops traces a step's chain from the master's run call to
// its replies: each message's send, arrival and wait for the pool, each
// pass's wait for the compute lane, in the order they happen.
TEST(PipelineBench, HopsPrintTheChainOfAStepInTheOrderItRuns) {
  auto [code, out] = RunProgram({BinDir() + "/pipeline_bench", "--micro-batches", "1", "--steps", "4", "--warmup", "2",
                                 "--hops", "6", "--round-trips", "20"},
                                absl::Seconds(120));
  ASSERT_EQ(code, 0) << out;
  // The figures' line ends with the round trip measured beside them and
  // the overhead over it.
  EXPECT_THAT(out, ContainsRegex("overhead_us_per_mb_boundary +rtt_us overhead_over_rtt\n +2 +1 .* "
                                 "[0-9]+\\.[0-9] +[0-9]+\\.[0-9][0-9]\n"))
      << out;
  EXPECT_THAT(out, HasSubstr("the chain of a step at M=1, over 6 traced steps")) << out;
  // (Each call names where it went.)
  const std::vector<std::string> chain = {"master: call function 'remora.pipeline.run' to bench1 [",
                                          "bench1: recv remora.pipeline.run [",
                                          "bench1: turn F0@stage0 [",
                                          "bench1: forward [",
                                          "bench1: call function 'remora.pipeline.push' to bench2 [",
                                          "bench2: recv remora.pipeline.push [",
                                          "bench2: recv remora.pipeline.push ]",
                                          "bench2: turn F0@stage1 ]",
                                          "bench2: backward [",
                                          "bench2: call function 'remora.autograd.propagate' to bench1 [",
                                          "bench1: recv remora.autograd.propagate [",
                                          "bench1: turn B0@stage0 ]",
                                          "bench1: step ]",
                                          "master: step ends"};
  size_t at = 0;
  for (const std::string& event : chain) {
    const size_t found = out.find(event, at);
    ASSERT_NE(found, std::string::npos) << "'" << event << "' not after the events before it:\n" << out;
    at = found + event.size();
  }
  auto [bad, bad_out] = RunProgram({BinDir() + "/pipeline_bench", "--hops", "-1"});
  EXPECT_EQ(bad, 2) << bad_out;
  EXPECT_THAT(bad_out, HasSubstr("--hops"));
  auto [no_calls, no_calls_out] = RunProgram({BinDir() + "/pipeline_bench", "--round-trips", "0"});
  EXPECT_EQ(no_calls, 2) << no_calls_out;
  EXPECT_THAT(no_calls_out, HasSubstr("--round-trips"));
}

// --worker-cpus auto pins each worker to its share of the cores, and
// --busy-poll-us makes them busy-poll (they say both); --cold-mib times one
// process's step with cold caches beside warm.
TEST(PipelineBench, PinsItsWorkersAndTimesAColdStepWhenAsked) {
  auto [code, out] = RunProgram({BinDir() + "/pipeline_bench", "--micro-batches", "1", "--steps", "4", "--warmup", "2",
                                 "--worker-cpus", "auto", "--cold-mib", "8", "--busy-poll-us", "200"},
                                absl::Seconds(120));
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("worker 'bench1' (id 1) serving at")) << out;
  EXPECT_THAT(out, ContainsRegex("with 1 intra-op thread on core [0-9]+, busy-polling 200 us, shards on cpu")) << out;
  EXPECT_THAT(out, HasSubstr("one process's step at M=1: ")) << out;
  EXPECT_THAT(out, HasSubstr(" us after 8 MiB of other memory traffic (")) << out;
  auto [bad, bad_out] = RunProgram({BinDir() + "/pipeline_bench", "--worker-cpus", "9999", "--steps", "1"},
                                   absl::Seconds(60));
  EXPECT_NE(bad, 0) << bad_out;
  EXPECT_THAT(bad_out, HasSubstr("--cpus '9999': core 9999 is not one this process may run on")) << bad_out;
}

}  // namespace
}  // namespace remora
