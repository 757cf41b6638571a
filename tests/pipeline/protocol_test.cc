// The step protocol on real worker processes, what is not the losses: the
// messages a batch sends, and the thread that runs a worker's passes.
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "pipeline/pipeline.h"
#include "rpc/thread_pool.h"
#include "shards/mlp.h"
#include "tests/support/pipeline_fixtures.h"

namespace remora::pipeline {
namespace {

using test_support::Mlp;
using test_support::StepMessagesBetween;
using Workers = test_support::TestWorkers;

TEST(Pipeline, AStepSendsOneCallPerWorkerAndOnePushEachWayPerBoundary) {
  Workers workers;
  struct Case {
    std::vector<shards::MLPStageOptions> stages;
    int m;
    std::string schedule;
  };
  const std::vector<Case> cases = {
      {{Mlp(8, 16, 1), Mlp(16, 4, 2, false)}, 1, "1f1b"},
      {{Mlp(8, 16, 1), Mlp(16, 4, 2, false)}, 8, "1f1b"},
      {{Mlp(8, 16, 1), Mlp(16, 12, 2), Mlp(12, 16, 3), Mlp(16, 4, 4, false)}, 8, "interleaved"},
  };
  constexpr int kSteps = 3;
  constexpr int64_t kW = 2;
  for (const Case& c : cases) {
    const int64_t S = static_cast<int64_t>(c.stages.size());
    SCOPED_TRACE(absl::StrCat("S=", S, " M=", c.m, " W=", kW));
    PipelineOptions o;
    for (const auto& st : c.stages) o.stages.push_back(test_support::MlpSpec(st));
    o.workers = {"w1", "w2"};
    o.schedule = c.schedule;
    o.micro_batches = c.m;
    o.loss = MseLoss();
    auto pipe = Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    ASSERT_TRUE((*pipe)->runs_on_workers());
    const auto data = test_support::RandomBatches(kSteps + 1, 16, 8, 4);
    ASSERT_TRUE((*pipe)->start_train_step(data[0].first, data[0].second).wait().ok());
    auto before = (*pipe)->sent_messages();
    ASSERT_TRUE(before.ok()) << before.status();
    for (int i = 1; i <= kSteps; ++i) {
      auto loss = (*pipe)->start_train_step(data[i].first, data[i].second).wait();
      ASSERT_TRUE(loss.ok()) << loss.status();
    }
    auto after = (*pipe)->sent_messages();
    ASSERT_TRUE(after.ok()) << after.status();
    std::map<std::string, int64_t> sent = StepMessagesBetween(*before, *after);
    int64_t total = 0;
    std::string listing;
    for (const auto& [kind, d] : sent) {
      total += d;
      absl::StrAppend(&listing, kind, ": ", d, "\n");
    }
    EXPECT_EQ(total, kSteps * (kW + 2 * c.m * (S - 1))) << listing;
    EXPECT_EQ(sent["function 'remora.pipeline.run'"], kSteps * kW) << listing;
    EXPECT_EQ(sent["function 'remora.pipeline.push'"], kSteps * c.m * (S - 1)) << listing;
    EXPECT_EQ(sent["function 'remora.autograd.propagate'"], kSteps * c.m * (S - 1)) << listing;
  }
}

// The threads that ran the passes of a 4-stage pipeline (interleaved over
// w1 and w2, 8 micro-batches, 4 batches) on worker `w`, as
// (name, thread id) pairs, each once; `passes`: the kinds of pass seen.
std::vector<std::pair<std::string, std::string>> PassThreadsOf(Workers& workers, const std::string& w,
                                                               std::set<std::string>* passes = nullptr) {
  std::vector<std::pair<std::string, std::string>> threads;
  auto seen = workers.master().rpc_sync(w, "pass_threads");
  EXPECT_TRUE(seen.ok()) << seen.status();
  if (!seen.ok()) return threads;
  std::set<std::pair<std::string, std::string>> distinct;
  for (const c10::IValue& v : seen->toListRef()) {
    const std::vector<std::string> parts = absl::StrSplit(v.toStringRef(), ' ');  // pass, name, id
    EXPECT_EQ(parts.size(), 3u) << v.toStringRef();
    if (parts.size() != 3) continue;
    distinct.emplace(parts[1], parts[2]);
    if (passes != nullptr) passes->insert(parts[0]);
  }
  return {distinct.begin(), distinct.end()};
}

void TrainFourPassThreadsStages(Workers& workers) {
  PipelineOptions o;
  for (int i = 0; i < 4; ++i) o.stages.push_back(StageSpec::Registered("PassThreads", {int64_t{6}}));
  o.workers = {"w1", "w2"};
  o.schedule = "interleaved";  // two stages a worker
  o.micro_batches = 8;
  o.loss = MseLoss();
  auto pipe = Pipeline::Create(workers.master(), o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  ASSERT_TRUE((*pipe)->runs_on_workers());
  for (const auto& [x, y] : test_support::RandomBatches(4, 16, 6, 6)) {
    auto loss = (*pipe)->start_train_step(x, y).wait();
    ASSERT_TRUE(loss.ok()) << loss.status();
  }
}

// A worker's forward and backward passes all run on one thread, its
// agent's lane (a GPU library's per-thread state is then built once), not
// on whichever pool thread is free.
TEST(Pipeline, EveryPassOnAWorkerRunsOnItsLaneThread) {
  Workers workers(2, "test_worker");  // for "PassThreads" and pass_threads
  TrainFourPassThreadsStages(workers);
  for (const char* w : {"w1", "w2"}) {
    std::set<std::string> passes;
    const auto threads = PassThreadsOf(workers, w, &passes);
    EXPECT_EQ(passes, (std::set<std::string>{"backward", "forward"})) << w;
    ASSERT_EQ(threads.size(), 1u) << w;
    EXPECT_EQ(threads[0].first, rpc::ThreadPool::kLaneThreadName) << w;
  }
}

// REMORA_LANE=0 (for comparing): the passes run on the pool's threads, as
// before the lane.
TEST(Pipeline, WithTheLaneOffPassesRunOnThePoolsThreads) {
  launch::WorkerProgram program("test_worker");
  program.env = {"REMORA_LANE=0"};
  Workers workers(2, program);
  TrainFourPassThreadsStages(workers);
  for (const char* w : {"w1", "w2"}) {
    const auto threads = PassThreadsOf(workers, w);
    ASSERT_FALSE(threads.empty()) << w;
    for (const auto& [name, id] : threads) EXPECT_EQ(name, rpc::ThreadPool::kThreadName) << w << " " << id;
  }
}

}  // namespace
}  // namespace remora::pipeline
