// A checkpoint waits for its workers' owner files with the step's liveness
// probes: a worker stopped meanwhile (a call's own timeout is minutes)
// fails the save within seconds, naming it, so that elastic recovery can
// put a spare in its place. (The local link's keepalive finds a stopped
// process too; the probes also find one whose handlers hang.)
#include <signal.h>

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
#include "tests/support/master_runs.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/test_group.h"

namespace remora::checkpoint {
namespace stalled_save_test {

using ::testing::HasSubstr;

TEST(Checkpoint, ASaveWithAStoppedWorkerFailsWithinSecondsNamingIt) {
  test_support::TestWorkers workers;
  workers.ExpectUncleanShutdown();
  const std::vector<pipeline::StageSpec> stages = {test_support::MlpSpec(test_support::Mlp(8, 16, 1)),
                                                   test_support::MlpSpec(test_support::Mlp(16, 4, 2, false))};
  pipeline::PipelineOptions o;
  o.stages = stages;
  o.workers = {"w1", "w2"};
  o.schedule = "1f1b";
  o.micro_batches = 2;
  o.loss = pipeline::MseLoss();
  o.optimizer = optim::OptimizerOptions::SGD(0.1);
  auto pipe = pipeline::Pipeline::Create(workers.master(), o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  const auto data = test_support::RandomBatches(1, 8, 8, 4);
  ASSERT_TRUE((*pipe)->start_train_step(data[0].first, data[0].second).wait().ok());
  auto saver = Checkpointer::Create(workers.master(), test_support::FreshDir("stalled_save"), /*keep=*/2);
  ASSERT_TRUE(saver.ok()) << saver.status();
  RunIdentity id;
  id.model = "mlp";
  id.micro_batches = 2;
  TrainingState state;
  state.step = 1;

  workers.worker(1).Signal(SIGSTOP);
  ASSERT_TRUE(AwaitStopped(workers.worker(1).pid()));
  const absl::Time start = absl::Now();
  const absl::Status saved = (*saver)->Save(**pipe, stages, id, state, /*final=*/false, /*background=*/false);
  const absl::Duration took = absl::Now() - start;
  workers.worker(1).Signal(SIGCONT);
  ASSERT_FALSE(saved.ok());
  EXPECT_THAT(saved.message(), HasSubstr("saving owner file 1 on worker 'w2'")) << saved;
  EXPECT_THAT(saved.message(), HasSubstr("worker 'w2' did not answer a liveness probe")) << saved;
  EXPECT_LT(took, absl::Seconds(30)) << saved;
}

}  // namespace stalled_save_test
}  // namespace remora::checkpoint
