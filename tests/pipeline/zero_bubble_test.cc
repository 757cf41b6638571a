// The zero-bubble schedule zb1p (ZB-H1) over worker processes' step
// runners: each backward pass split into B, whose input gradient goes to
// the previous stage at once, and W, run later in its own turn. It trains
// bit for bit as 1F1B does (the same gradients, summed in the same order),
// over two and three workers and as replicas, with tied embeddings,
// clipping and AdamW; what it cannot run yet is a clear error.
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/roll.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "parallel/data_parallel.h"
#include "parallel/process_group.h"
#include "pipeline/pipeline.h"
#include "shards/gpt.h"
#include "tests/support/pipeline_fixtures.h"

namespace remora::pipeline {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kVocab = 64, kSeqLen = 16, kLayers = 2;  // (test_support::SmallGpt's)

// The small GPT's parts [first, last) as one stage, tied.
StageSpec Part(int64_t first, int64_t last) { return test_support::GptPart(test_support::SmallGpt(), first, last); }

std::vector<std::pair<at::Tensor, at::Tensor>> Windows() {
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (int s = 0; s < 3; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(30 + s);
    const at::Tensor window = at::randint(kVocab, {8, kSeqLen}, gen, at::TensorOptions().dtype(at::kLong));
    data.emplace_back(window, at::roll(window, -1, 1));
  }
  return data;
}

PipelineOptions Options(std::vector<StageSpec> stages, std::vector<std::string> workers, const std::string& schedule) {
  PipelineOptions o;
  o.stages = std::move(stages);
  o.workers = std::move(workers);
  o.schedule = schedule;
  o.micro_batches = 4;
  o.loss = LossFn::Named("causal_lm");
  o.optimizer = optim::OptimizerOptions::AdamW(1e-3);
  o.clip_grad_norm = 0.5;
  o.tied_first = shards::kGptTiedFirst;
  o.tied_last = shards::kGptTiedLast;
  return o;
}

// Each step's loss and every stage's final state.
struct Trained {
  std::vector<double> losses;
  std::vector<std::vector<at::Tensor>> states;
};

Trained Train(Agent& agent, const PipelineOptions& o) {
  Trained t;
  auto pipe = Pipeline::Create(agent, o);
  EXPECT_TRUE(pipe.ok()) << pipe.status();
  if (!pipe.ok()) return t;
  for (const auto& [x, y] : Windows()) {
    auto loss = (*pipe)->train_step(x, y);
    EXPECT_TRUE(loss.ok()) << loss.status();
    if (!loss.ok()) return t;
    t.losses.push_back(*loss);
  }
  for (int k = 0; k < static_cast<int>(o.stages.size()); ++k) t.states.push_back((*pipe)->stage_state(k).value());
  return t;
}

void ExpectBitwise(const Trained& got, const Trained& want) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) EXPECT_EQ(got.losses[i], want.losses[i]) << "step " << i;
  ASSERT_EQ(got.states.size(), want.states.size());
  for (size_t k = 0; k < want.states.size(); ++k) {
    ASSERT_EQ(got.states[k].size(), want.states[k].size());
    for (size_t i = 0; i < want.states[k].size(); ++i) {
      EXPECT_TRUE(got.states[k][i].equal(want.states[k][i])) << "stage " << k << ", tensor " << i;
    }
  }
}

TEST(ZeroBubble, Zb1pTrainsBitForBitAsOneFOneB) {
  test_support::TestWorkers workers(4);
  const int64_t parts = shards::GptParts(kLayers);
  for (const auto& [stages, names] :
       std::vector<std::pair<std::vector<StageSpec>, std::vector<std::string>>>{
           {{Part(0, 2), Part(2, parts)}, {"w1", "w2"}},
           {{Part(0, 1), Part(1, 2), Part(2, parts)}, {"w1", "w2", "w3"}}}) {
    SCOPED_TRACE(::testing::Message() << stages.size() << " stages");
    const Trained one_f_one_b = Train(workers.master(), Options(stages, names, "1f1b"));
    const Trained zero_bubble = Train(workers.master(), Options(stages, names, "zb1p"));
    ASSERT_EQ(one_f_one_b.losses.size(), 3u);
    ExpectBitwise(zero_bubble, one_f_one_b);
  }
  // Two replicas of two stages: each stage's replicas' sum starts after
  // its last W.
  if (!parallel::HaveGloo()) return;
  std::vector<double> losses[2];
  for (int z = 0; z < 2; ++z) {
    parallel::DataParallelOptions dp;
    dp.pipeline = Options({Part(0, 2), Part(2, parts)}, {"w1", "w2", "w3", "w4"}, z == 0 ? "1f1b" : "zb1p");
    dp.replicas = 2;
    dp.overlap = true;
    auto replicas = parallel::DataParallelPipeline::Create(workers.master(), dp);
    ASSERT_TRUE(replicas.ok()) << replicas.status();
    for (const auto& [x, y] : Windows()) {
      auto loss = (*replicas)->train_step(x, y);
      ASSERT_TRUE(loss.ok()) << loss.status();
      losses[z].push_back(*loss);
    }
  }
  EXPECT_EQ(losses[1], losses[0]);
}

TEST(ZeroBubble, WhatZb1pDoesNotRunYetIsAClearError) {
  test_support::TestWorkers workers;
  const int64_t parts = shards::GptParts(kLayers);
  PipelineOptions recomputed = Options({Part(0, 2), Part(2, parts)}, {"w1", "w2"}, "zb1p");
  for (StageSpec& s : recomputed.stages) s.recompute = true;
  EXPECT_THAT(std::string(Pipeline::Create(workers.master(), recomputed).status().message()),
              HasSubstr("schedule zb1p with activation recomputation is not supported yet"));
  PipelineOptions interleaved =
      Options({Part(0, 1), Part(1, 2), Part(2, 3), Part(3, parts)}, {"w1", "w2"}, "zb1p");
  EXPECT_THAT(std::string(Pipeline::Create(workers.master(), interleaved).status().message()),
              HasSubstr("schedule zb1p runs one stage per worker, not 2"));
}

}  // namespace
}  // namespace remora::pipeline
