// How a pipeline step fails: alone (the next one, already started, still
// trains), within seconds when a worker stalls or dies, and leaving nothing
// behind on the workers (no pass waiting for the compute lane, no autograd
// context), also when the failure comes while a pass still runs.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <string>
#include <vector>

#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "pipeline/pipeline.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/test_group.h"

// (A named namespace: the test binary is a unity build.)
namespace remora::pipeline::failed_step_test {

using test_support::Mlp;
using Workers = test_support::TestWorkers;

StageSpec Spec(const shards::MLPStageOptions& o) { return test_support::MlpSpec(o); }

std::vector<std::pair<at::Tensor, at::Tensor>> Data(int steps, int rows, int in, int out) {
  return test_support::RandomBatches(steps, rows, in, out);
}

// Two stages on w1 and w2, MSE, 4 micro-batches under 1F1B, where a
// batch's later forward passes wait behind its backward passes.
PipelineOptions TwoStagesIn1F1B(StageSpec a, StageSpec b) {
  PipelineOptions o;
  o.stages = {std::move(a), std::move(b)};
  o.workers = {"w1", "w2"};
  o.micro_batches = 4;
  o.schedule = "1f1b";
  o.loss = MseLoss();
  return o;
}

// What `function` on worker `w` counts, polled every 100 ms for up to
// `tries` times until it is 0 (-1 when a call fails).
int64_t SettlesAt(rpc::Agent& master, const char* w, const char* function, int tries) {
  int64_t count = -1;
  for (int i = 0; i < tries && count != 0; ++i) {
    if (i > 0) absl::SleepFor(absl::Milliseconds(100));
    auto c = master.rpc_sync(w, function);
    if (!c.ok()) return int64_t{-1};
    count = c->toInt();
  }
  return count;
}

// A step that fails with the next one already started: the failure is the
// first step's, named; the next one, a good batch, still trains, and
// nothing is left waiting on the workers.
TEST(Pipeline, AFailedStepWithTheNextStartedFailsAloneAndLeavesNothingWaiting) {
  Workers workers(2, "test_worker");  // for lane_queued
  PipelineOptions o = TwoStagesIn1F1B(Spec(Mlp(8, 16, 1)), Spec(Mlp(16, 4, 2, false)));
  auto pipe = Pipeline::Create(workers.master(), o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  const auto data = Data(2, 8, 8, 4);
  // Targets of 3 columns: the loss fails on w2, after w1's forward passes.
  StartedStep bad = (*pipe)->start_train_step(data[0].first, at::randn({8, 3}));
  StartedStep good = (*pipe)->start_train_step(data[1].first, data[1].second);
  ExpectError(bad.wait().status(), {"stage 1 on worker 'w2', micro-batch ", ": the loss 'mse' of an output of [",
                                    " against targets of [", ", 3]"});
  auto loss = good.wait();
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_TRUE((*pipe)->start_train_step(data[0].first, data[0].second).wait().ok());
  for (const char* w : {"w1", "w2"}) {
    EXPECT_EQ(workers.master().rpc_sync(w, "lane_queued").value().toInt(), 0) << w;
    EXPECT_EQ(workers.master().rpc_sync(w, "remora.autograd.num_contexts").value().toInt(), 0) << w;
  }
}

// A batch that fails in stage 1 never sends the backward passes that its
// later forward passes are ordered behind (1F1B: F0 B0 F1 B1 ... on w2,
// F0 F1 B0 F2 ... on w1): the master abandons the batch's order, so that
// nothing is left waiting for the compute lane on either worker.
TEST(Pipeline, AFailedBatchLeavesNothingWaitingOnTheWorkers) {
  Workers workers(2, "test_worker");  // for lane_queued
  rpc::Agent& master = workers.master();
  PipelineOptions o = TwoStagesIn1F1B(Spec(Mlp(8, 16, 1)), Spec(Mlp(8, 4, 2, false)));  // 16 != 8
  auto pipe = Pipeline::Create(master, o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  EXPECT_FALSE((*pipe)->start_train_step(at::randn({8, 8}), at::randn({8, 4})).wait().ok());
  for (const char* w : {"w1", "w2"}) {
    EXPECT_EQ(SettlesAt(master, w, "lane_queued", 200), 0)
        << "passes still waiting for the compute lane on " << w;
    // Nor any of the batch's autograd contexts (late pushes make them anew).
    EXPECT_EQ(SettlesAt(master, w, "remora.autograd.num_contexts", 50), 0)
        << "autograd contexts left on " << w;
  }
}

// The master abandons a failed batch while a forward pass of it still runs
// on stage 0's worker (w2's loss fails on micro-batch 0's output while w1
// computes micro-batch 1's, 400 ms long). That pass's push, recorded in
// the batch's autograd context after the abandon released it, must not
// leave the context behind.
TEST(Pipeline, ABatchAbandonedWhileAPassRunsLeavesNoContextBehind) {
  Workers workers(2, "test_worker");  // for SlowScale
  PipelineOptions o = TwoStagesIn1F1B(StageSpec::Registered("SlowScale", {int64_t{400}, int64_t{8}}),
                                      Spec(Mlp(8, 4, 2, false)));
  o.micro_batches = 2;
  auto pipe = Pipeline::Create(workers.master(), o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  const auto data = Data(1, 4, 8, 4);
  EXPECT_FALSE((*pipe)->start_train_step(data[0].first, at::randn({4, 3})).wait().ok());
  // The next step's passes run on w1's lane after the running one's.
  auto loss = (*pipe)->start_train_step(data[0].first, data[0].second).wait();
  ASSERT_TRUE(loss.ok()) << loss.status();
  for (const char* w : {"w1", "w2"}) {
    EXPECT_EQ(SettlesAt(workers.master(), w, "remora.autograd.num_contexts", 50), 0)
        << "autograd contexts left on " << w;
  }
}

// `step`'s end, or a failure and the process's end when it takes over
// `seconds` (a step that never ends would hang the test binary).
absl::StatusOr<double> WaitAtMost(StartedStep& step, int seconds, const std::string& what) {
  auto waited = std::async(std::launch::async, [&step] { return step.wait(); });
  if (waited.wait_for(std::chrono::seconds(seconds)) != std::future_status::ready) {
    ADD_FAILURE() << what << ": the step did not end within " << seconds << " s";
    std::fflush(nullptr);
    std::_Exit(1);
  }
  return waited.get();
}

// A backward pass that throws, on any stage under every schedule, fails
// its step with the stage's message (not a hang: under interleaved and
// with a batch norm's recomputation, 2026-12-08, the step never ended),
// and leaves nothing waiting on the workers.
TEST(Pipeline, ABackwardThatThrowsFailsTheStepUnderEverySchedule) {
  Workers workers(2, "test_worker");  // for FailsInBackward, lane_queued
  const auto data = Data(1, 8, 8, 8);
  for (const auto& [schedule, stages] : std::vector<std::pair<std::string, int>>{
           {"1f1b", 2}, {"zb1p", 2}, {"interleaved", 4}, {"zbv", 4}}) {
    for (int failing = 0; failing < stages; ++failing) {
      const std::string what = absl::StrCat(schedule, ", stage ", failing, " of ", stages, " fails");
      SCOPED_TRACE(what);
      PipelineOptions o = TwoStagesIn1F1B(Spec(Mlp(8, 8, 1)), Spec(Mlp(8, 8, 2, false)));
      o.stages.clear();
      for (int k = 0; k < stages; ++k) {
        o.stages.push_back(k == failing ? StageSpec::Registered("FailsInBackward", {std::string("no way back"),
                                                                                    int64_t{8}})
                                        : StageSpec::Registered("SlowScale", {int64_t{0}, int64_t{8}}));
      }
      o.schedule = schedule;
      auto pipe = Pipeline::Create(workers.master(), o);
      ASSERT_TRUE(pipe.ok()) << pipe.status();
      StartedStep step = (*pipe)->start_train_step(data[0].first, data[0].second);
      absl::StatusOr<double> loss = WaitAtMost(step, 60, what);
      ASSERT_FALSE(loss.ok());
      EXPECT_THAT(std::string(loss.status().message()), ::testing::HasSubstr("no way back"));
      for (const char* w : {"w1", "w2"}) {
        EXPECT_EQ(SettlesAt(workers.master(), w, "lane_queued", 200), 0) << w;
        EXPECT_EQ(SettlesAt(workers.master(), w, "remora.autograd.num_contexts", 50), 0) << w;
      }
    }
  }
}

// A worker that stops (SIGSTOP) mid-batch fails the step within 10 s,
// named (the master probes the workers it waits for); once it runs again,
// the next batch starts clean. A worker that dies fails the step as fast.
TEST(Pipeline, AStalledOrDeadWorkerFailsTheStepWithinTenSecondsNamingIt) {
  Workers workers;
  workers.ExpectUncleanShutdown();  // w2 is killed at the end
  PipelineOptions o = TwoStagesIn1F1B(Spec(Mlp(8, 64, 1)), Spec(Mlp(64, 4, 2, false)));
  auto pipe = Pipeline::Create(workers.master(), o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  const auto data = Data(1, 64, 8, 4);
  const auto& [x, t] = data[0];
  ASSERT_TRUE((*pipe)->start_train_step(x, t).wait().ok());

  workers.worker(1).Signal(SIGSTOP);
  // (Stopped before the step starts: on a busy machine w2's link reader,
  // woken by the step's first message, could otherwise serve it first.)
  ASSERT_TRUE(AwaitStopped(workers.worker(1).pid()));
  absl::Time start = absl::Now();
  auto stalled = (*pipe)->start_train_step(x, t).wait();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_FALSE(stalled.ok());
  EXPECT_NE(stalled.status().message().find("w2"), std::string::npos) << stalled.status();
  workers.worker(1).Signal(SIGCONT);
  // A keepalive (gRPC's, or the local link's) may have closed the master's
  // connection to w2 during the stall, and a link opened meanwhile (the kernel accepts connections for
  // a stopped process) can fail its first call: the next batch is sent once
  // w2 answers twice in a row on a live link (a loaded CI machine took
  // seconds).
  int answered = 0;
  for (int i = 0; i < 200 && answered < 2; ++i) {
    answered = workers.master().rpc_sync("w2", "remora.pipeline.alive").ok() ? answered + 1 : 0;
    if (answered < 2) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_EQ(answered, 2) << "w2 does not answer after SIGCONT";
  auto again = (*pipe)->start_train_step(x, t).wait();
  EXPECT_TRUE(again.ok()) << again.status();

  workers.worker(1).Signal(SIGKILL);
  ASSERT_TRUE(workers.worker(1).Wait(absl::Seconds(10)).ok());
  start = absl::Now();
  auto dead = (*pipe)->start_train_step(x, t).wait();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_FALSE(dead.ok());
  EXPECT_NE(dead.status().message().find("w2"), std::string::npos) << dead.status();
  pipe->reset();  // (its runners cannot all be dropped now)
  workers.master().Shutdown(/*graceful=*/false).IgnoreError();
}

}  // namespace remora::pipeline::failed_step_test
