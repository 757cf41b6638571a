// Activation recomputation (pipeline::StageSpec::recompute) over real
// worker processes: the same training as without it, and less held
// between a stage's forward and backward passes (pipeline/stage.cc,
// Recompute). And mixed precision (StageSpec::bf16, Bf16Autocast), which
// shares its home (pipeline/recompute.h).
#include <string>
#include <vector>

#include <ATen/ops/equal.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/nn/modules/linear.h>

#include "absl/strings/str_cat.h"
#include "pipeline/pipeline.h"
#include "pipeline/protocol.h"
#include "pipeline/recompute.h"
#include "shards/stage_types.h"
#include "train/local_trainer.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/script_models.h"
#include "tests/support/split_checks.h"

namespace remora::pipeline {
namespace {

using test_support::Mlp;
using test_support::MlpSpec;
using Workers = test_support::TestWorkers;

// Activation recomputation (StageSpec::recompute), under GPipe and 1F1B:
// stages of LibTorch modules (MLPs, one with a batch norm) and a
// TorchScript stage (three linear layers, 64 -> 1024 -> 1024 -> 64) train
// bit for bit as without it (a TorchScript graph runs as written on a
// CPU, the same with autograd and without); the TorchScript stage holds
// only its output between the passes, not its hidden layers' (two of 256
// KiB a micro-batch; the output stays, the root of the stage's backward).
TEST(Pipeline, RecomputedStagesTrainBitwiseAsWithoutAndHoldLess) {
  Workers workers;
  const auto data = test_support::RandomBatches(3, 512, 64, 8);
  torch::jit::Module three = test_support::ScriptSequential({64, 1024, 1024, 64});
  const std::vector<StageSpec> scripted = {StageSpec::TorchScript(test_support::SaveToBytes(three), "three layers"),
                                           MlpSpec(Mlp(64, 8, 2, false))};
  // (A batch norm: the graph the backward pass recomputes saves its
  // running statistics, which the pass then puts back.)
  shards::MLPStageOptions normed = Mlp(64, 256, 1);
  normed.batchnorm = true;
  const std::vector<StageSpec> modules = {MlpSpec(normed), MlpSpec(Mlp(256, 8, 2, false))};
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
          auto loss = (*pipe)->start_train_step(x, y).wait();
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
        EXPECT_EQ(losses[1][i], losses[0][i]) << "step " << i;
      }
      for (int k = 0; k < 2; ++k) {
        ASSERT_EQ(states[1][k].size(), states[0][k].size());
        for (size_t j = 0; j < states[0][k].size(); ++j) {
          EXPECT_TRUE(at::equal(states[1][k][j], states[0][k][j])) << "stage " << k << " tensor " << j;
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

// Under a split backward a recomputed stage is one autograd node that
// leads to both its input and its parameters: B keeps the gradient
// arriving at it and W takes the parameters' from the pass B recomputed,
// even where the stage holds a batch norm (whose own node, seen directly,
// B computes whole); the gradients are one backward pass's.
TEST(Recompute, ARecomputedStageLeavesItsWeightsToW) {
  shards::MLPStageOptions options = Mlp(6, 5, 3);
  options.batchnorm = true;
  ASSERT_TRUE(shards::RegisterStageTypes().ok());
  auto built = BuildStage(MlpSpec(options), c10::Device(c10::kCPU));
  ASSERT_TRUE(built.ok()) << built.status();
  StageModule* stage = built->get();
  test_support::ExpectSplitEqualsWhole(test_support::SplitCase{
      "a recomputed MLP stage with a batch norm",
      [stage](const at::Tensor& x) { return RecomputedForward(*stage, x).toTensor(); }, stage->Parameters(),
      at::randn({4, 6})});
}

// Bf16Autocast: matrix products in bf16 while it lives (the parameters
// stay float32), the thread as it was after; off changes nothing.
TEST(Bf16, AutocastComputesMatrixProductsInBf16AndRestoresTheThread) {
  torch::nn::Linear linear(4, 3);
  const at::Tensor x = at::randn({2, 4});
  {
    Bf16Autocast on(true);
    EXPECT_EQ(linear(x).scalar_type(), at::kBFloat16);
    EXPECT_EQ(linear->weight.scalar_type(), at::kFloat);
    {
      Bf16Autocast nested_off(false);
      EXPECT_EQ(linear(x).scalar_type(), at::kBFloat16);
    }
    EXPECT_EQ(linear(x).scalar_type(), at::kBFloat16);
  }
  EXPECT_EQ(linear(x).scalar_type(), at::kFloat);
  const c10::IValue pair = c10::ivalue::Tuple::create({x, at::arange(3)});
  const c10::IValue half = ToBf16(pair);
  EXPECT_EQ(half.toTupleRef().elements()[0].toTensor().scalar_type(), at::kBFloat16);
  EXPECT_EQ(half.toTupleRef().elements()[1].toTensor().scalar_type(), at::kLong);
  EXPECT_EQ(ToFloat32(half).toTupleRef().elements()[0].toTensor().scalar_type(), at::kFloat);
}

// bf16 stages over workers: a stage's output leaves it in bf16 (half the
// bytes across the boundary); the losses are one process's under the same
// autocast and casts (train::LocalTrainer with bf16) to rounding, near the
// float32 run's and not equal to them; with recomputation (the second
// forward under autocast too) the same as without.
TEST(Pipeline, Bf16StagesTrainAsOneProcessUnderAutocastAndSendBf16) {
  Workers workers;
  const auto data = test_support::RandomBatches(4, 16, 32, 4);
  const std::vector<shards::MLPStageOptions> mlp = {Mlp(32, 64, 1), Mlp(64, 4, 2, false)};
  train::LocalOptions lo;
  for (const auto& s : mlp) lo.stages.push_back(MlpSpec(s));
  lo.loss = MseLoss();
  lo.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);
  lo.micro_batches = 4;
  lo.bf16 = true;
  auto local = train::LocalTrainer::Create(lo);
  ASSERT_TRUE(local.ok()) << local.status();
  std::vector<double> want;
  for (const auto& [x, y] : data) want.push_back((*local)->StartStep({x, y}).wait().value());
  const test_support::LocalRun fp32 = test_support::TrainMlpLocally(mlp, data);
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recomputed" : "kept");
    PipelineOptions o;
    for (const auto& s : mlp) o.stages.push_back(MlpSpec(s));
    for (StageSpec& s : o.stages) {
      s.bf16 = true;
      s.recompute = recompute;
    }
    o.workers = {"w1", "w2"};
    o.schedule = "1f1b";
    o.micro_batches = 4;
    o.loss = MseLoss();
    o.optimizer = lo.optimizer;
    auto pipe = Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    const c10::IValue out =
        (*pipe)
            ->stages()[0]
            .rpc_sync(StageEvalRequest::kMethod, rpc::EncodeCall(StageEvalRequest{data[0].first, 0}))
            .value();
    EXPECT_EQ(out.toTensor().scalar_type(), at::kBFloat16);
    bool differs = false;
    for (size_t i = 0; i < data.size(); ++i) {
      const double loss = (*pipe)->start_train_step(data[i].first, data[i].second).wait().value();
      EXPECT_NEAR(loss, want[i], 1e-5 * std::abs(want[i])) << "step " << i;
      EXPECT_NEAR(loss, fp32.losses[i], 2e-2 * std::abs(fp32.losses[i])) << "step " << i;
      differs |= loss != fp32.losses[i];
    }
    EXPECT_TRUE(differs) << "bf16 rounds otherwise than float32";
    EXPECT_EQ((*pipe)->stage_state(0).value().front().scalar_type(), at::kFloat) << "float32 parameters";
  }
}

}  // namespace
}  // namespace remora::pipeline
