// The zero-bubble schedule zb1p (ZB-H1) over worker processes' step
// runners: each backward pass split into B, whose input gradient goes to
// the previous stage at once, and W, run later in its own turn. It trains
// bit for bit as 1F1B does (the same gradients, summed in the same order),
// over two and three workers and as replicas, with tied embeddings,
// clipping and AdamW; what it cannot run yet is a clear error.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/roll.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint/checkpoint.h"
#include "parallel/data_parallel.h"
#include "parallel/process_group.h"
#include "pipeline/pipeline.h"
#include "shards/gpt.h"
#include "tests/support/master_runs.h"
#include "tests/support/pipeline_fixtures.h"

namespace remora::pipeline {
namespace {

using ::testing::AllOf;
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

Trained TrainWith(rpc::Agent& agent, const PipelineOptions& o) {
  Trained t;
  auto pipe = Pipeline::Create(agent, o);
  EXPECT_TRUE(pipe.ok()) << pipe.status();
  if (!pipe.ok()) return t;
  for (const auto& [x, y] : Windows()) {
    auto loss = (*pipe)->start_train_step(x, y).wait();
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
    const Trained one_f_one_b = TrainWith(workers.master(), Options(stages, names, "1f1b"));
    const Trained zero_bubble = TrainWith(workers.master(), Options(stages, names, "zb1p"));
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
      auto loss = (*replicas)->start_train_step(x, y).wait();
      ASSERT_TRUE(loss.ok()) << loss.status();
      losses[z].push_back(*loss);
    }
  }
  EXPECT_EQ(losses[1], losses[0]);
}

TEST(ZeroBubble, ZbvTrainsBitForBitAsOneFOneBOverTwiceTheWorkers) {
  // ZB-V over two workers: stages 0 and 3 on w1, 1 and 2 on w2, so that
  // stage 1's output goes to stage 2 on its own worker and the tied
  // weight's two copies are on one worker. 1F1B runs the same four stages
  // over four workers. Without clipping every gradient is summed in the
  // same order; with it, the norm's squares are added per worker, so in
  // another order.
  test_support::TestWorkers workers(4);
  const int64_t parts = shards::GptParts(kLayers);
  const std::vector<StageSpec> stages = {Part(0, 1), Part(1, 2), Part(2, 3), Part(3, parts)};
  for (double clip : {0.0, 0.5}) {
    SCOPED_TRACE(::testing::Message() << "clip_grad_norm " << clip);
    PipelineOptions v = Options(stages, {"w1", "w2"}, "zbv"), one = Options(stages, {"w1", "w2", "w3", "w4"}, "1f1b");
    v.clip_grad_norm = one.clip_grad_norm = clip;
    const Trained zero_bubble = TrainWith(workers.master(), v);
    const Trained one_f_one_b = TrainWith(workers.master(), one);
    ASSERT_EQ(one_f_one_b.losses.size(), 3u);
    if (clip == 0) {
      ExpectBitwise(zero_bubble, one_f_one_b);
    } else {
      ASSERT_EQ(zero_bubble.losses.size(), 3u);
      for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(zero_bubble.losses[i], one_f_one_b.losses[i], 1e-6) << "step " << i;
    }
  }
  // Two replicas of the V: each worker's gradient group holds its two stages.
  if (!parallel::HaveGloo()) return;
  parallel::DataParallelOptions dp;
  dp.pipeline = Options(stages, {"w1", "w2", "w3", "w4"}, "zbv");
  dp.pipeline.clip_grad_norm = 0;
  dp.replicas = 2;
  dp.overlap = true;
  auto replicas = parallel::DataParallelPipeline::Create(workers.master(), dp);
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  EXPECT_THAT((*replicas)->Placement(), HasSubstr("w3           1        0, 3"));
  std::vector<double> losses;
  for (const auto& [x, y] : Windows()) {
    auto loss = (*replicas)->start_train_step(x, y).wait();
    ASSERT_TRUE(loss.ok()) << loss.status();
    losses.push_back(*loss);
  }
  // The same batches as one pipeline of the V: the replicas' mean of the
  // halves' gradients differs from the whole's in its last bits only.
  const Trained whole = TrainWith(workers.master(), [&] {
    PipelineOptions o = Options(stages, {"w1", "w2"}, "zbv");
    o.clip_grad_norm = 0;
    return o;
  }());
  ASSERT_EQ(whole.losses.size(), losses.size());
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], whole.losses[i], 1e-5) << "step " << i;
}

// A zbv run (w1 holds stages 0 and 3, and with them both copies of the
// tied embedding) resumes from its checkpoint bit for bit; its owner files keep
// the V's stages, and restoring them into the interleaved placement is
// refused naming both.
TEST(ZeroBubble, AZbvCheckpointResumesBitwiseAndOnlyUnderItsOwnPlacement) {
  test_support::TestWorkers workers;
  const int64_t parts = shards::GptParts(kLayers);
  const std::vector<StageSpec> four = {Part(0, 1), Part(1, 2), Part(2, 3), Part(3, parts)};
  const std::string dir = test_support::FreshDir("zbv_checkpoint");
  auto saver = checkpoint::Checkpointer::Create(workers.master(), dir, /*keep=*/1);
  ASSERT_TRUE(saver.ok()) << saver.status();
  checkpoint::RunIdentity id;
  id.model = "small-gpt";
  id.micro_batches = 4;
  const auto data = Windows();
  auto pipe = Pipeline::Create(workers.master(), Options(four, {"w1", "w2"}, "zbv"));
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  std::vector<double> losses;
  for (size_t i = 0; i < data.size(); ++i) {
    losses.push_back((*pipe)->start_train_step(data[i].first, data[i].second).wait().value());
    checkpoint::TrainingState at;
    at.step = static_cast<int64_t>(i + 1);
    if (i == 1) {
      ASSERT_TRUE((*saver)->Save(**pipe, four, id, at).ok());
    }
  }
  std::vector<at::Tensor> want;
  for (int k = 0; k < 4; ++k) {
    const std::vector<at::Tensor> state = (*pipe)->stage_state(k).value();
    want.insert(want.end(), state.begin(), state.end());
  }
  pipe->reset();
  auto ck = checkpoint::Latest(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  ASSERT_EQ(ck->manifest.files.size(), 2u);
  EXPECT_EQ(ck->manifest.files[0].stages, (std::vector<int>{0, 3}));
  EXPECT_EQ(ck->manifest.files[1].stages, (std::vector<int>{1, 2}));
  auto resumed = Pipeline::Create(workers.master(), Options(four, {"w1", "w2"}, "zbv"));
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  const absl::Status restored = checkpoint::Restore(**resumed, *ck);
  ASSERT_TRUE(restored.ok()) << restored;
  EXPECT_EQ((*resumed)->start_train_step(data[2].first, data[2].second).wait().value(), losses[2]);
  std::vector<at::Tensor> got;
  for (int k = 0; k < 4; ++k) {
    const std::vector<at::Tensor> state = (*resumed)->stage_state(k).value();
    got.insert(got.end(), state.begin(), state.end());
  }
  ASSERT_EQ(got.size(), want.size());
  for (size_t j = 0; j < want.size(); ++j) EXPECT_TRUE(got[j].equal(want[j])) << "tensor " << j;
  auto interleaved = Pipeline::Create(workers.master(), Options(four, {"w1", "w2"}, "interleaved"));
  ASSERT_TRUE(interleaved.ok()) << interleaved.status();
  EXPECT_THAT(std::string(checkpoint::Restore(**interleaved, *ck).message()),
              AllOf(HasSubstr("keeps stages 0, 3 in owner file 0, but this run places stages 0, 2 on its worker 'w1'"),
                    HasSubstr("resume with the schedule the checkpoint was written under")));
}

// The saved-activations meter counts what B keeps for W (the gradient
// arriving at the linear layer's product) as the stage's own until W runs.
// The last of two MLP stages keeps its ReLU output (64 rows x 1024 floats,
// 256 KiB) per micro-batch until its backward: under 1F1B one micro-batch
// at a time. Under zb1p, W(i) runs after B(i + 1): as F(i + 2) ends, the
// stage holds F(i + 2)'s ReLU output, micro-batch i + 1's (its graph is
// W's until W) and what B(i + 1) kept for W, another 256 KiB (uncounted,
// the peak was two micro-batches' worth).
TEST(ZeroBubble, WhatBKeepsForWCountsAsSavedActivations) {
  test_support::TestWorkers workers;
  std::map<std::string, std::vector<int64_t>> peaks;
  for (const std::string schedule : {"1f1b", "zb1p"}) {
    PipelineOptions o;
    o.stages = {test_support::MlpSpec(test_support::Mlp(64, 1024, 1)),
                test_support::MlpSpec(test_support::Mlp(1024, 1024, 2))};
    o.workers = {"w1", "w2"};
    o.schedule = schedule;
    o.micro_batches = 8;
    o.loss = MseLoss();
    auto pipe = Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    for (const auto& [x, y] : test_support::RandomBatches(2, 512, 64, 1024)) {
      ASSERT_TRUE((*pipe)->start_train_step(x, y).wait().ok());
    }
    auto p = (*pipe)->peak_activation_bytes();
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_EQ(p->size(), 2u);
    if ((*p)[1] < 0) GTEST_SKIP() << "the saved-activations meter needs remora's caching allocator";
    peaks[schedule] = *p;
  }
  constexpr int64_t kMicroBatch = 64 * 1024 * 4;
  EXPECT_GE(peaks["1f1b"][1], kMicroBatch);
  EXPECT_GE(peaks["zb1p"][1], peaks["1f1b"][1] + 2 * kMicroBatch)
      << "zb1p " << peaks["zb1p"][1] << " bytes against 1f1b " << peaks["1f1b"][1];
}

// With activation recomputation each stage's forward runs again once, at
// B, whose graph is split in turn: W takes the weights' gradients from it.
// The same bits as 1F1B with recomputation, over 2 workers (zb1p) and in
// the V (zbv against 1F1B over four).
TEST(ZeroBubble, RecomputedStagesSplitTheirBackwardAndTrainAsOneFOneB) {
  test_support::TestWorkers workers(4);
  const int64_t parts = shards::GptParts(kLayers);
  auto recomputed = [](PipelineOptions o) {
    for (StageSpec& s : o.stages) s.recompute = true;
    return o;
  };
  const std::vector<StageSpec> two = {Part(0, 2), Part(2, parts)};
  ExpectBitwise(TrainWith(workers.master(), recomputed(Options(two, {"w1", "w2"}, "zb1p"))),
                TrainWith(workers.master(), recomputed(Options(two, {"w1", "w2"}, "1f1b"))));
  const std::vector<StageSpec> four = {Part(0, 1), Part(1, 2), Part(2, 3), Part(3, parts)};
  PipelineOptions v = recomputed(Options(four, {"w1", "w2"}, "zbv"));
  PipelineOptions one = recomputed(Options(four, {"w1", "w2", "w3", "w4"}, "1f1b"));
  v.clip_grad_norm = one.clip_grad_norm = 0;
  const Trained zero_bubble = TrainWith(workers.master(), v);
  const Trained one_f_one_b = TrainWith(workers.master(), one);
  ASSERT_EQ(one_f_one_b.losses.size(), 3u);
  ExpectBitwise(zero_bubble, one_f_one_b);
  // And as without recomputation (bit for bit: LibTorch's modules).
  PipelineOptions plain = Options(four, {"w1", "w2"}, "zbv");
  plain.clip_grad_norm = 0;
  ExpectBitwise(zero_bubble, TrainWith(workers.master(), plain));
}

TEST(ZeroBubble, WhatZeroBubbleSchedulesDoNotRunAreClearErrors) {
  test_support::TestWorkers workers;
  const int64_t parts = shards::GptParts(kLayers);
  PipelineOptions interleaved =
      Options({Part(0, 1), Part(1, 2), Part(2, 3), Part(3, parts)}, {"w1", "w2"}, "zb1p");
  EXPECT_THAT(std::string(Pipeline::Create(workers.master(), interleaved).status().message()),
              HasSubstr("schedule zb1p runs one stage per worker, not 2"));
}

}  // namespace
}  // namespace remora::pipeline
