// The GPT's stages (shards/gpt.h): causal (no position sees a later token),
// the same wherever its stack of blocks is cut, and trained as a pipeline
// over worker processes with the causal language-model loss, as in one
// process.
#include "shards/gpt.h"

#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/roll.h>
#include <ATen/ops/randint.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/types.h>  // (the torch:: functions clip_grad.h calls)
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>

#include "checkpoint/checkpoint.h"
#include "checkpoint/owner_file.h"
#include "parallel/data_parallel.h"
#include "parallel/process_group.h"
#include "pipeline/pipeline.h"
#include "shards/protocol.h"
#include "tests/support/master_runs.h"
#include "tests/support/pipeline_fixtures.h"

namespace remora::shards {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kVocab = 64, kSeqLen = 16, kDModel = 32, kHeads = 4;

at::Tensor Tokens(int64_t rows, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(kVocab, {rows, kSeqLen}, gen, at::TensorOptions().dtype(at::kLong));
}

TEST(Gpt, NoPositionSeesALaterTokenAndTheStackIsTheSameWhereverItIsCut) {
  GptEmbedImpl embed(kVocab, kSeqLen, kDModel, 1);
  GptBlocksImpl blocks(kDModel, kHeads, 0, 3, 2), first(kDModel, kHeads, 0, 1, 2), rest(kDModel, kHeads, 1, 3, 2);
  GptHeadImpl head(kDModel, kVocab, 3);
  at::NoGradGuard no_grad;
  const at::Tensor x = Tokens(2, 4);
  const at::Tensor logits = head.forward(blocks.forward(embed.forward(x)));
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{2, kSeqLen, kVocab}));
  EXPECT_TRUE(rest.forward(first.forward(embed.forward(x))).equal(blocks.forward(embed.forward(x))));
  at::Tensor later = x.clone();
  later.narrow(1, 8, kSeqLen - 8).fill_(0);  // positions 8 on changed
  const at::Tensor changed = head.forward(blocks.forward(embed.forward(later)));
  EXPECT_LT((changed.narrow(1, 0, 8) - logits.narrow(1, 0, 8)).abs().max().item<double>(), 1e-6);
  EXPECT_GT((changed.narrow(1, 8, 8) - logits.narrow(1, 8, 8)).abs().max().item<double>(), 1e-4);
  // A shorter window is fine; a longer one than the model's is an error.
  EXPECT_EQ(embed.forward(x.narrow(1, 0, 5)).size(1), 5);
  try {
    embed.forward(Tokens(1, 5).repeat({1, 2}));
    ADD_FAILURE() << "32 tokens through a model of 16";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("at most the model's seq_len 16"));
  }
  EXPECT_THROW(GptBlocksImpl(30, 4, 0, 1, 0), std::invalid_argument);  // 30 is no multiple of 4 heads
}

// "Gpt" (master's stages): parts [first, last) of embedding, blocks and
// head are the three types' weights and outputs, bitwise, wherever cut.
TEST(Gpt, PartsOfTheWholeModelAreItsThreeStageTypesBitwise) {
  constexpr int64_t kLayers = 3, kSeed = 6;
  GptEmbedImpl embed(kVocab, kSeqLen, kDModel, kSeed);
  GptBlocksImpl blocks(kDModel, kHeads, 0, kLayers, kSeed);
  GptHeadImpl head(kDModel, kVocab, kSeed);
  at::NoGradGuard no_grad;
  const at::Tensor x = Tokens(2, 9);
  const at::Tensor want = head.forward(blocks.forward(embed.forward(x)));
  EXPECT_EQ(GptParts(kLayers), 5);
  GptImpl whole(kVocab, kSeqLen, kDModel, kHeads, kLayers, 0, GptParts(kLayers), kSeed);
  EXPECT_TRUE(whole.forward(x).equal(want));
  for (int64_t cut = 1; cut < GptParts(kLayers); ++cut) {
    GptImpl a(kVocab, kSeqLen, kDModel, kHeads, kLayers, 0, cut, kSeed);
    GptImpl b(kVocab, kSeqLen, kDModel, kHeads, kLayers, cut, GptParts(kLayers), kSeed);
    EXPECT_TRUE(b.forward(a.forward(x)).equal(want)) << "cut before part " << cut;
  }
  EXPECT_EQ(whole.parameters().size(),
            embed.parameters().size() + blocks.parameters().size() + head.parameters().size());
  EXPECT_THROW(GptImpl(kVocab, kSeqLen, kDModel, kHeads, kLayers, 2, 2, kSeed), std::invalid_argument);
  EXPECT_THROW(GptImpl(kVocab, kSeqLen, kDModel, kHeads, kLayers, 0, 6, kSeed), std::invalid_argument);
  // 6 training FLOPs a parameter of the matrix products, and attention's.
  EXPECT_DOUBLE_EQ(GptTrainFlopsPerToken(kVocab, kSeqLen, kDModel, kLayers),
                   6.0 * (kLayers * 12.0 * kDModel * kDModel + kDModel * kVocab) + 12.0 * kLayers * kSeqLen * kDModel);
}

TEST(Gpt, TrainsAsAPipelineWithTheCausalLmLossAsInOneProcess) {
  test_support::TestWorkers workers;
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (int s = 0; s < 3; ++s) {
    const at::Tensor window = Tokens(8, 10 + s);
    data.emplace_back(window, at::roll(window, -1, 1));  // (any targets will do)
  }
  // One process: the same modules, stage after stage.
  GptEmbedImpl embed(kVocab, kSeqLen, kDModel, 1);
  GptBlocksImpl b0(kDModel, kHeads, 0, 1, 2), b1(kDModel, kHeads, 1, 2, 2);
  GptHeadImpl head(kDModel, kVocab, 3);
  std::vector<at::Tensor> params;
  for (torch::nn::Module* m : std::vector<torch::nn::Module*>{&embed, &b0, &b1, &head}) {
    for (const at::Tensor& p : m->parameters()) params.push_back(p);
  }
  torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.1));
  std::vector<double> want;
  for (const auto& [x, t] : data) {
    sgd.zero_grad();
    const at::Tensor logits = head.forward(b1.forward(b0.forward(embed.forward(x))));
    at::Tensor l = at::cross_entropy_loss(logits.reshape({-1, kVocab}), t.reshape({-1}));
    l.backward();
    sgd.step();
    want.push_back(l.item<double>());
  }
  pipeline::PipelineOptions o;
  auto blocks = [](int64_t first, int64_t last) {
    return pipeline::StageSpec::Registered(GptBlocksArgs::kFunction, {kDModel, kHeads, first, last, int64_t{2}});
  };
  o.stages = {pipeline::StageSpec::Registered(GptEmbedArgs::kFunction, {kVocab, kSeqLen, kDModel, int64_t{1}}),
              blocks(0, 1), blocks(1, 2),
              pipeline::StageSpec::Registered(GptHeadArgs::kFunction, {kDModel, kVocab, int64_t{3}})};
  o.workers = {"w1", "w2"};
  o.schedule = "interleaved";
  o.micro_batches = 2;
  o.loss = pipeline::LossFn::Named("causal_lm");
  ASSERT_TRUE(o.loss);
  o.optimizer = optim::OptimizerOptions::SGD(0.1);
  auto pipe = pipeline::Pipeline::Create(workers.master(), o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  for (size_t i = 0; i < data.size(); ++i) {
    auto loss = (*pipe)->start_train_step(data[i].first, data[i].second).wait();
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_NEAR(*loss, want[i], 1e-5 * want[i]) << "step " << i;
  }
}

// Tied embeddings: in one module the head's weight is the embedding's (one
// parameter); cut over workers each end holds a copy, built equal, whose
// gradients the step runners sum, so the copies stay bitwise equal and
// train as the one weight of one process (momentum SGD, the norm clipped
// over the whole model counting the weight once), also as replicas.
// Without the sum the copies drift apart.
TEST(Gpt, TiedEmbeddingAndHeadTrainOverWorkersAsTheOneWeightOfOneProcess) {
  constexpr int64_t kLayers = 2, kSeed = 5;
  const int64_t parts = GptParts(kLayers);
  const double max_norm = 0.3;
  GptImpl whole(kVocab, kSeqLen, kDModel, kHeads, kLayers, 0, parts, kSeed, /*tie=*/true);
  EXPECT_EQ(whole.parameters().size() + 1,
            GptImpl(kVocab, kSeqLen, kDModel, kHeads, kLayers, 0, parts, kSeed).parameters().size());
  test_support::TestWorkers workers(4);
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (int s = 0; s < 4; ++s) {
    const at::Tensor window = Tokens(8, 20 + s);
    data.emplace_back(window, at::roll(window, -1, 1));
  }
  torch::optim::SGD sgd(whole.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  std::vector<double> want;
  for (const auto& [x, t] : data) {
    sgd.zero_grad();
    at::Tensor l = at::cross_entropy_loss(whole.forward(x).reshape({-1, kVocab}), t.reshape({-1}));
    l.backward();
    EXPECT_GT(torch::nn::utils::clip_grad_norm_(whole.parameters(), max_norm), 2 * max_norm) << "clipped";
    sgd.step();
    want.push_back(l.item<double>());
  }
  const at::Tensor want_weight = whole.named_parameters()[kGptTiedFirst];
  const GptArgs shape = test_support::SmallGpt();  // (these sizes, seed 5, tied)
  auto part = [&shape](int64_t first, int64_t last) { return test_support::GptPart(shape, first, last); };
  struct Case {
    std::string schedule;
    std::vector<int64_t> cuts;
    bool tie;
  };
  for (const Case& c : {Case{"1f1b", {0, 2, parts}, true}, Case{"interleaved", {0, 1, 2, 3, parts}, true},
                        Case{"1f1b", {0, 2, parts}, false}}) {
    SCOPED_TRACE(c.schedule + (c.tie ? " tied" : " not summed"));
    pipeline::PipelineOptions o;
    for (size_t i = 0; i + 1 < c.cuts.size(); ++i) o.stages.push_back(part(c.cuts[i], c.cuts[i + 1]));
    o.workers = {"w1", "w2"};
    o.schedule = c.schedule;
    o.micro_batches = 2;
    o.loss = pipeline::LossFn::Named("causal_lm");
    o.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);
    o.clip_grad_norm = max_norm;
    if (c.tie) {
      o.tied_first = kGptTiedFirst;
      o.tied_last = kGptTiedLast;
    }
    auto pipe = pipeline::Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    for (size_t i = 0; i < data.size(); ++i) {
      auto loss = (*pipe)->start_train_step(data[i].first, data[i].second).wait();
      ASSERT_TRUE(loss.ok()) << loss.status();
      if (c.tie) {
        EXPECT_NEAR(*loss, want[i], 1e-5 * want[i]) << "step " << i;
      }
    }
    auto first = (*pipe)->stage_state(0);
    auto last = (*pipe)->stage_state(static_cast<int>(o.stages.size()) - 1);
    ASSERT_TRUE(first.ok() && last.ok());
    const at::Tensor embedding = first->front(), head = last->back();  // (the first and the last parameter)
    ASSERT_EQ(head.sizes(), want_weight.sizes());
    if (c.tie) {
      EXPECT_TRUE(embedding.equal(head)) << "the copies stay bitwise equal";
      EXPECT_LT(test_support::RelativeError(embedding, want_weight), 1e-5);
      // A checkpoint stores the weight once (the last stage's owner file leaves
      // its copy out); restored into a new pipeline, and loaded into this
      // process, the copy is the first stage's again.
      const std::string dir = test_support::FreshDir("tied_" + c.schedule);
      auto saver = checkpoint::Checkpointer::Create(workers.master(), dir, 1);
      ASSERT_TRUE(saver.ok()) << saver.status();
      checkpoint::TrainingState at;
      at.step = static_cast<int64_t>(data.size());
      ASSERT_TRUE((*saver)->Save(**pipe, o.stages, checkpoint::RunIdentity{}, at).ok());
      auto ck = checkpoint::Latest(dir);
      ASSERT_TRUE(ck.ok()) << ck.status();
      EXPECT_EQ(ck->manifest.tied_last, kGptTiedLast);
      const checkpoint::ManifestFile& tail_file = ck->manifest.files.back();
      auto saved = checkpoint::ReadOwnerFile(ck->dir + "/" + tail_file.file, tail_file.bytes, tail_file.crc32);
      ASSERT_TRUE(saved.ok()) << saved.status();
      EXPECT_THAT(saved->names.back(), Not(Contains(std::string(kGptTiedLast))));
      EXPECT_THAT(saved->names.back(), Contains(std::string("head.norm.weight")));
      auto again = pipeline::Pipeline::Create(workers.master(), o);
      ASSERT_TRUE(again.ok()) << again.status();
      ASSERT_TRUE(checkpoint::Restore(**again, *ck).ok());
      const at::Tensor restored = (*again)->stage_state(static_cast<int>(o.stages.size()) - 1).value().back();
      EXPECT_TRUE(restored.equal(embedding));
      auto loaded = checkpoint::LoadModel(*ck, c10::kCPU);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      EXPECT_TRUE(loaded->back()->Parameters().back().equal(embedding));
    } else {
      EXPECT_FALSE(embedding.equal(head)) << "without the sum each copy trains alone";
    }
  }
  // Two replicas of two stages (the replicas' sum overlapping the backward
  // passes), with ZeRO-1 or not: each copy gets the replicas' sum of its
  // own gradient, then the copies' sum, then the step.
  for (int zero : {0, 1}) {
    SCOPED_TRACE(zero == 1 ? "replicas, ZeRO-1" : "replicas");
    if (!parallel::HaveGloo()) continue;  // (the replicas' sums need it)
    parallel::DataParallelOptions dp;
    dp.pipeline.stages = {part(0, 2), part(2, parts)};
    dp.pipeline.workers = {"w1", "w2", "w3", "w4"};
    dp.pipeline.micro_batches = 2;
    dp.pipeline.loss = pipeline::LossFn::Named("causal_lm");
    dp.pipeline.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);
    dp.pipeline.clip_grad_norm = max_norm;
    dp.pipeline.tied_first = kGptTiedFirst;
    dp.pipeline.tied_last = kGptTiedLast;
    dp.replicas = 2;
    dp.overlap = true;
    dp.zero = zero;
    auto replicas = parallel::DataParallelPipeline::Create(workers.master(), dp);
    ASSERT_TRUE(replicas.ok()) << replicas.status();
    for (size_t i = 0; i < data.size(); ++i) {
      auto loss = (*replicas)->start_train_step(data[i].first, data[i].second).wait();
      ASSERT_TRUE(loss.ok()) << loss.status();
      EXPECT_NEAR(*loss, want[i], 1e-5 * want[i]) << "replicas, step " << i;
    }
    for (int r = 0; r < 2; ++r) {
      const at::Tensor embedding = (*replicas)->replica(r).stage_state(0).value().front();
      EXPECT_TRUE(embedding.equal((*replicas)->replica(r).stage_state(1).value().back())) << "replica " << r;
      EXPECT_LT(test_support::RelativeError(embedding, want_weight), 1e-5) << "replica " << r;
    }
  }

  pipeline::PipelineOptions bad;
  bad.stages = {part(0, 2), part(2, parts)};
  bad.workers = {"w1", "w2"};
  bad.loss = pipeline::LossFn::Named("causal_lm");
  bad.tied_first = kGptTiedFirst;
  bad.tied_last = "head.nothing";
  auto refused = pipeline::Pipeline::Create(workers.master(), bad);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("has no parameter 'head.nothing'"));
  bad.tied_last = "";
  EXPECT_THAT(std::string(pipeline::Pipeline::Create(workers.master(), bad).status().message()),
              HasSubstr("give both or neither"));
}

}  // namespace
}  // namespace remora::shards
