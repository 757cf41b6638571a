// Activation recomputation (pipeline::StageSpec::recompute) over real
// worker processes: the same training as without it, and less held
// between a stage's forward and backward passes (pipeline/stage.cc,
// Recompute).
#include <string>
#include <vector>

#include <ATen/ops/equal.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include "absl/strings/str_cat.h"
#include "pipeline/pipeline.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/script_models.h"

namespace remora::pipeline {
namespace {

using test_support::Mlp;
using test_support::MlpSpec;
using test_support::RelativeError;
using Workers = test_support::TestWorkers;

// Activation recomputation (StageSpec::recompute), under GPipe and 1F1B:
// stages of LibTorch modules (MLPs) train bit for bit as without it; a
// TorchScript stage (three linear layers, 64 -> 1024 -> 1024 -> 64) to
// rounding (TorchScript's executor plans a graph run with autograd and one
// without differently), and holds only its output between the passes,
// not its hidden layers' (two of 256 KiB a micro-batch; the output stays,
// the root of the stage's backward).
TEST(Pipeline, RecomputedStagesTrainAsWithoutAndHoldLess) {
  Workers workers;
  const auto data = test_support::RandomBatches(3, 512, 64, 8);
  torch::jit::Module three = test_support::ScriptSequential({64, 1024, 1024, 64});
  const std::vector<StageSpec> scripted = {StageSpec::TorchScript(test_support::SaveToBytes(three), "three layers"),
                                           MlpSpec(Mlp(64, 8, 2, false))};
  const std::vector<StageSpec> modules = {MlpSpec(Mlp(64, 256, 1)), MlpSpec(Mlp(256, 8, 2, false))};
  for (const std::string schedule : {"gpipe", "1f1b"}) {
    for (bool script : {false, true}) {
      SCOPED_TRACE(absl::StrCat(schedule, script ? ", TorchScript" : ", modules"));
      std::vector<std::vector<double>> losses(2);
      std::vector<std::vector<std::vector<at::Tensor>>> states(2);
      std::vector<std::vector<int64_t>> peaks(2);
      for (int recompute = 0; recompute < 2; ++recompute) {
        PipelineOptions o;
        o.stages = script ? scripted : modules;
        for (StageSpec& s : o.stages) s.recompute = recompute == 1;
        o.workers = {"w1", "w2"};
        o.schedule = schedule;
        o.micro_batches = 8;
        o.loss = MseLoss();
        o.optimizer = optim::OptimizerOptions::SGD(1e-5).set_momentum(0.9);
        auto pipe = Pipeline::Create(workers.master(), o);
        ASSERT_TRUE(pipe.ok()) << pipe.status();
        for (const auto& [x, y] : data) {
          auto loss = (*pipe)->train_step(x, y);
          ASSERT_TRUE(loss.ok()) << loss.status();
          losses[recompute].push_back(*loss);
        }
        for (int k = 0; k < 2; ++k) {
          auto state = (*pipe)->stage_state(k);
          ASSERT_TRUE(state.ok()) << state.status();
          states[recompute].push_back(*state);
        }
        auto p = (*pipe)->peak_activation_bytes();
        ASSERT_TRUE(p.ok()) << p.status();
        peaks[recompute] = *p;
      }
      for (size_t i = 0; i < losses[0].size(); ++i) {
        if (script) {
          EXPECT_NEAR(losses[1][i], losses[0][i], 1e-6 * losses[0][i]) << "step " << i;
        } else {
          EXPECT_EQ(losses[1][i], losses[0][i]) << "step " << i;
        }
      }
      for (int k = 0; k < 2; ++k) {
        ASSERT_EQ(states[1][k].size(), states[0][k].size());
        for (size_t j = 0; j < states[0][k].size(); ++j) {
          if (script) {
            EXPECT_LT(RelativeError(states[1][k][j], states[0][k][j]), 1e-6) << "stage " << k << " tensor " << j;
          } else {
            EXPECT_TRUE(at::equal(states[1][k][j], states[0][k][j])) << "stage " << k << " tensor " << j;
          }
        }
      }
      if (script) {
        EXPECT_GE(peaks[0][0], 2 * 2 * 64 * 1024 * 4) << "without recomputation the hidden layers stay";
        EXPECT_LT(peaks[1][0], peaks[0][0] / 4) << "recomputed " << peaks[1][0] << " bytes against " << peaks[0][0];
      }
    }
  }
  for (const char* w : {"w1", "w2"}) {
    EXPECT_EQ(workers.master().rpc_sync(w, "remora.autograd.num_contexts").value().toInt(), 0) << w;
  }
}

}  // namespace
}  // namespace remora::pipeline
