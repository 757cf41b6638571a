// Global gradient-norm clipping over a pipeline's workers
// (PipelineOptions::clip_grad_norm, pipeline/batch_end.h) against the same
// model trained in one process with torch::nn::utils::clip_grad_norm_
// (test_support::TrainMlpLocally).
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "pipeline/pipeline.h"
#include "tests/support/pipeline_fixtures.h"

namespace remora::pipeline {
namespace {

using test_support::Mlp;
using test_support::MlpSpec;
using test_support::RelativeError;
using ::testing::HasSubstr;
using Workers = test_support::TestWorkers;

// Two and four stages over two workers (1F1B, interleaved), the norm
// clipped in every step: the losses and parameters are one process's
// (within rounding: each worker adds up its own share of the norm). The
// same runs without clipping end elsewhere, so the clipping is what the
// comparison checks.
TEST(GradClip, APipelineClipsAsClipGradNormOverTheWholeModel) {
  Workers workers;
  const auto data = test_support::RandomBatches(4, 10, 8, 4);
  const double max_norm = 0.05;
  struct Case {
    std::string schedule;
    std::vector<shards::MLPStageOptions> stages;
  };
  const std::vector<Case> cases = {
      {"1f1b", {Mlp(8, 16, 1), Mlp(16, 4, 2, false)}},
      {"interleaved", {Mlp(8, 16, 1), Mlp(16, 12, 2), Mlp(12, 16, 3), Mlp(16, 4, 4, false)}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.schedule);
    const test_support::LocalRun local = test_support::TrainMlpLocally(c.stages, data, max_norm);
    for (double n : local.norms) EXPECT_GT(n, 2 * max_norm) << "every step is clipped";
    for (double clip : {max_norm, 0.0}) {
      PipelineOptions o;
      for (const auto& s : c.stages) o.stages.push_back(MlpSpec(s));
      o.workers = {"w1", "w2"};
      o.schedule = c.schedule;
      o.micro_batches = 4;
      o.loss = MseLoss();
      o.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);
      o.clip_grad_norm = clip;
      auto pipe = Pipeline::Create(workers.master(), o);
      ASSERT_TRUE(pipe.ok()) << pipe.status();
      for (size_t i = 0; i < data.size(); ++i) {
        auto loss = (*pipe)->start_train_step(data[i].first, data[i].second).wait();
        ASSERT_TRUE(loss.ok()) << loss.status();
        if (clip > 0) {
          EXPECT_NEAR(*loss, local.losses[i], 1e-5 * std::abs(local.losses[i])) << "step " << i;
        }
      }
      double farthest = 0;
      for (size_t k = 0; k < local.state.size(); ++k) {
        auto state = (*pipe)->stage_state(static_cast<int>(k));
        ASSERT_TRUE(state.ok()) << state.status();
        ASSERT_EQ(state->size(), local.state[k].size());
        for (size_t j = 0; j < state->size(); ++j) {
          const double e = RelativeError((*state)[j], local.state[k][j]);
          farthest = std::max(farthest, e);
          if (clip > 0) {
            EXPECT_LT(e, 1e-5) << "stage " << k << " tensor " << j;
          }
        }
      }
      if (clip == 0) {
        EXPECT_GT(farthest, 1e-3) << "without clipping the run ends elsewhere";
      }
    }
  }
  for (const char* w : {"w1", "w2"}) {
    EXPECT_EQ(workers.master().rpc_sync(w, "remora.autograd.num_contexts").value().toInt(), 0) << w;
  }
  PipelineOptions bad;
  bad.stages = {MlpSpec(Mlp(8, 4, 1))};
  bad.workers = {"w1"};
  bad.loss = MseLoss();
  bad.clip_grad_norm = -1;
  EXPECT_THAT(std::string(Pipeline::Create(workers.master(), bad).status().message()),
              HasSubstr("clip_grad_norm must be 0 or more"));
}

}  // namespace
}  // namespace remora::pipeline
