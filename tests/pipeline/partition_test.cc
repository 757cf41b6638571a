// pipeline/partition.h: the split arithmetic (no sockets), cutting a
// TorchScript sequential model into stage modules, and Partition with real
// worker processes: measured and explicit cuts train like one process.
#include "pipeline/partition.h"

#include <set>

#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/optim/sgd.h>

#include "pipeline/stage.h"
#include "shards/cnn.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/script_models.h"

namespace remora::pipeline {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(Partition, BalancedSplitMinimisesTheLargestPart) {
  EXPECT_EQ(BalancedSplit({1, 1, 1, 1}, 2).value(), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(BalancedSplit({5, 1, 1, 1, 1, 1}, 2).value(), (std::vector<int>{0, 1, 6}));
  EXPECT_EQ(BalancedSplit({1, 2, 3, 4, 5, 6}, 3).value(), (std::vector<int>{0, 3, 5, 6}));
  EXPECT_EQ(BalancedSplit({3, 3, 3}, 3).value(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_THAT(BalancedSplit({1, 2}, 3).status().message(), HasSubstr("cannot cut 2 layers into 3"));
}

TEST(Partition, InterleavedSplitBalancesWorkersThenChunks) {
  // Chunk k runs on worker k % workers.
  EXPECT_EQ(InterleavedSplit(std::vector<double>(8, 1.0), 2, 2, 8).value(),
            (std::vector<int>{0, 2, 4, 6, 8}));
  // 5 | 1 1 1 1 | 1 1 1 1 | 5: each worker carries 9 although the chunks
  // are uneven; the largest chunk (5) cannot be smaller.
  EXPECT_EQ(InterleavedSplit({5, 1, 1, 1, 1, 1, 1, 1, 1, 5}, 2, 2, 8).value(),
            (std::vector<int>{0, 1, 5, 9, 10}));
  // Three workers, two chunks each (6 9 6 | 7 8 9): the workers carry 13, 17
  // and 15; no cut beats 4 x 17 + 2 x 9 (the largest chunk).
  EXPECT_EQ(InterleavedSplit({1, 2, 3, 4, 5, 6, 7, 8, 9}, 3, 2, 4).value(),
            (std::vector<int>{0, 3, 5, 6, 7, 8, 9}));
  // One chunk per worker is the plain balanced split.
  EXPECT_EQ(InterleavedSplit({1, 2, 3, 4, 5, 6}, 3, 1, 8).value(),
            BalancedSplit({1, 2, 3, 4, 5, 6}, 3).value());
  EXPECT_FALSE(InterleavedSplit({1, 2, 3}, 2, 2, 8).ok());
  EXPECT_FALSE(InterleavedSplit({1, 2, 3}, 1, 1, 0).ok());
}

TEST(Partition, SplitPointsAreCheckedAndBecomeBounds) {
  EXPECT_EQ(SplitAt(6, {2, 5}, 3).value(), (std::vector<int>{0, 2, 5, 6}));
  EXPECT_THAT(SplitAt(6, {2}, 3).status().message(), HasSubstr("make 2 stages; 3 are wanted"));
  EXPECT_THAT(SplitAt(6, {3, 3}, 3).status().message(), HasSubstr("increase strictly"));
  EXPECT_THAT(SplitAt(6, {0, 3}, 3).status().message(), HasSubstr("lie in 1..5"));
  EXPECT_THAT(SplitAt(6, {3, 6}, 3).status().message(), HasSubstr("the model has 6 layers"));
}

using test_support::LoadFromBytes;
using test_support::SaveToBytes;
using test_support::ScriptLinear;

std::string ScriptSequential(const std::vector<int64_t>& widths, bool residual = false) {
  torch::jit::Module m = test_support::ScriptSequential(widths, residual);
  return SaveToBytes(m);
}

TEST(Partition, TorchScriptSequentialCutsIntoStagesThatChainToTheWhole) {
  const std::string bytes = ScriptSequential({6, 8, 8, 5, 3});
  auto model = SequentialModel::TorchScript(bytes, "seq.pt");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->num_layers(), 4);
  const at::Tensor x = at::randn({5, 6});
  EXPECT_TRUE(model->Check(x).ok()) << model->Check(x);
  torch::jit::Module whole = LoadFromBytes(bytes);
  c10::IValue y = x;
  for (auto [first, last] : std::vector<std::pair<int, int>>{{0, 1}, {1, 3}, {3, 4}}) {
    auto stage = model->Stage(first, last);
    ASSERT_TRUE(stage.ok()) << stage.status();
    EXPECT_EQ(stage->kind, "script");
    EXPECT_THAT(stage->name, HasSubstr("seq.pt layers ["));
    torch::jit::Module m = LoadFromBytes(stage->script);
    EXPECT_EQ(m.parameters().size(), 2u * (last - first));
    y = m.forward({y});
  }
  EXPECT_TRUE(at::allclose(y.toTensor(), whole.forward({x}).toTensor()));
  EXPECT_THAT(model->Stage(2, 5).status().message(), HasSubstr("which has 4"));
  EXPECT_FALSE(model->Stage(2, 2).ok());
}

// What torch.jit.script(nn.Sequential(...)) saves: children named "0", "1",
// ... (or an OrderedDict's names, not all identifiers), one without
// parameters, one with a buffer.
torch::jit::Module ScriptTorchSequential() {
  torch::jit::Module m("Sequential");
  torch::jit::Module relu("ReLU"), shift("Shift");
  relu.define("def forward(self, x):\n  return torch.relu(x)\n");
  shift.register_buffer("offset", at::full({3}, 0.5));
  shift.define("def forward(self, x):\n  return x - self.offset\n");
  m.register_module("0", ScriptLinear(4, 6, 1, false));
  m.register_module("1", relu);
  m.register_module("2", ScriptLinear(6, 3, 2, false));
  m.register_module("out-shift", shift);
  m.define(R"(def forward(self, x):
  x = getattr(self, "0").forward(x)
  x = getattr(self, "1").forward(x)
  x = getattr(self, "2").forward(x)
  return getattr(self, "out-shift").forward(x)
)");
  return m;
}

// The stages' state dicts, merged, are the whole module's: a checkpoint of
// a cut one-file model loads into the file it came from (load_state_dict).
TEST(Partition, StagesKeepTheChildrensNamesSoTheirStateIsTheWholeModules) {
  torch::jit::Module whole = ScriptTorchSequential();
  auto model = SequentialModel::TorchScript(SaveToBytes(whole), "model.pt");
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ(model->num_layers(), 4);
  std::set<std::string> want;
  for (const auto& p : whole.named_parameters()) want.insert(p.name);
  for (const auto& b : whole.named_buffers()) want.insert(b.name);
  ASSERT_EQ(want, (std::set<std::string>{"0.weight", "0.bias", "2.weight", "2.bias", "out-shift.offset"}));
  std::set<std::string> merged;
  const at::Tensor x = at::randn({2, 4});
  c10::IValue y = x;
  for (auto [first, last] : std::vector<std::pair<int, int>>{{0, 1}, {1, 3}, {3, 4}}) {
    auto spec = model->Stage(first, last);
    ASSERT_TRUE(spec.ok()) << spec.status();
    auto stage = BuildStage(*spec, c10::Device(c10::kCPU));
    ASSERT_TRUE(stage.ok()) << stage.status();
    for (const std::string& name : StateNames(**stage)) EXPECT_TRUE(merged.insert(name).second) << name;
    y = LoadFromBytes(spec->script).forward({y});
  }
  EXPECT_EQ(merged, want);
  EXPECT_TRUE(at::allclose(y.toTensor(), whole.forward({x}).toTensor()));
}

TEST(Partition, ModelsThatAreNotSequentialAreClearErrors) {
  auto residual = SequentialModel::TorchScript(ScriptSequential({4, 4, 2}, true), "res.pt");
  ASSERT_TRUE(residual.ok());
  EXPECT_THAT(residual->Check(at::randn({2, 4})).message(),
              HasSubstr("is not its 2 child modules run one after another"));
  torch::jit::Module flat = ScriptLinear(4, 2, 1, false);
  EXPECT_THAT(SequentialModel::TorchScript(SaveToBytes(flat), "flat.pt").status().message(),
              HasSubstr("flat.pt has no child modules"));
  EXPECT_THAT(SequentialModel::TorchScript("not a zip", "junk.pt").status().message(),
              HasSubstr("cannot load TorchScript from junk.pt"));
  // Shapes that do not chain: layer 1 takes 8 features, the sample has 5.
  auto seq = SequentialModel::TorchScript(ScriptSequential({6, 8, 3}), "seq.pt");
  // The layer that refuses, the input's shape and PyTorch's line with the
  // shapes it wanted; no interpreter traceback.
  const std::string refused(seq->Check(at::randn({2, 5})).message());
  EXPECT_THAT(refused, HasSubstr("seq.pt: layer 0 ('l0', Linear) does not take the input, a Float tensor of shape "
                                 "[2, 5]: "));
  EXPECT_THAT(refused, HasSubstr("(2x5 and 6x8)"));
  EXPECT_THAT(refused, Not(HasSubstr("Traceback")));
}

using Workers = test_support::TestWorkers;

// One SGD step's losses for `steps` batches through the pipeline.
std::vector<double> Train(Agent& agent, std::vector<StageSpec> stages, const at::Tensor& x,
                          const at::Tensor& t, int steps) {
  PipelineOptions o;
  o.stages = std::move(stages);
  o.workers = {"w1", "w2"};
  o.micro_batches = 4;
  o.loss = CrossEntropyLoss();
  o.optimizer = optim::OptimizerOptions::SGD(0.05);
  auto pipe = Pipeline::Create(agent, o);
  EXPECT_TRUE(pipe.ok()) << pipe.status();
  std::vector<double> losses;
  for (int i = 0; pipe.ok() && i < steps; ++i) losses.push_back((*pipe)->train_step(x, t).value());
  return losses;
}

TEST(Partition, MeasuredAndExplicitCutsTrainLikeOneProcess) {
  Workers workers;
  const std::string bytes = ScriptSequential({6, 16, 16, 16, 16, 16, 16, 4});
  auto model = SequentialModel::TorchScript(bytes, "seq.pt").value();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor x = at::randn({16, 6}, gen, at::TensorOptions());
  const at::Tensor t = at::randint(4, {16}, gen, at::TensorOptions(at::kLong));
  // The same steps in one process.
  torch::jit::Module whole = LoadFromBytes(bytes);
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : whole.parameters()) params.push_back(p.requires_grad_(true));
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05));
  std::vector<double> want;
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    at::Tensor l = at::cross_entropy_loss(whole.forward({x}).toTensor(), t);
    l.backward();
    opt.step();
    want.push_back(l.item<double>());
  }
  PartitionOptions measured;
  measured.stages_per_worker = 2;
  measured.sample = x.slice(0, 0, 4);
  measured.micro_batches = 4;
  auto cut = Partition(workers.master(), model, {"w1", "w2"}, measured);
  ASSERT_TRUE(cut.ok()) << cut.status();
  ASSERT_EQ(cut->bounds.size(), 5u);
  EXPECT_EQ(cut->bounds.front(), 0);
  EXPECT_EQ(cut->bounds.back(), 7);
  ASSERT_EQ(cut->layer_ms.size(), 7u);
  for (double ms : cut->layer_ms) EXPECT_GT(ms, 0.0);
  EXPECT_THAT(cut->Describe({"w1", "w2"}), HasSubstr("of the measured cost"));
  PartitionOptions given;
  given.split_at = {2, 4, 6};
  given.stages_per_worker = 2;
  auto explicit_cut = Partition(workers.master(), model, {"w1", "w2"}, given);
  ASSERT_TRUE(explicit_cut.ok()) << explicit_cut.status();
  EXPECT_EQ(explicit_cut->bounds, (std::vector<int>{0, 2, 4, 6, 7}));
  EXPECT_TRUE(explicit_cut->layer_ms.empty());
  for (const auto* c : {&*cut, &*explicit_cut}) {
    const std::vector<double> got = Train(workers.master(), c->stages, x, t, 3);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]) << i;
  }
  // More stages than layers; a split point outside the model.
  PartitionOptions many;
  many.stages_per_worker = 4;
  EXPECT_THAT(Partition(workers.master(), model, {"w1", "w2"}, many).status().message(),
              HasSubstr("into 8 stages (2 workers x 4 per worker)"));
  PartitionOptions outside;
  outside.split_at = {9};
  EXPECT_THAT(Partition(workers.master(), model, {"w1", "w2"}, outside).status().message(),
              HasSubstr("lie in 1..6"));
  // A registered layered type: the small CNN's blocks, measured on the workers.
  PartitionOptions cnn;
  cnn.sample = at::randn({2, 1, 28, 28});
  auto cnn_cut = Partition(workers.master(),
                           SequentialModel::Registered("SmallCnn", shards::kSmallCnnBlocks, {int64_t{5}}),
                           {"w1", "w2"}, cnn);
  ASSERT_TRUE(cnn_cut.ok()) << cnn_cut.status();
  ASSERT_EQ(cnn_cut->stages.size(), 2u);
  EXPECT_EQ(cnn_cut->stages[0].args[0].toInt(), 0);
  EXPECT_EQ(cnn_cut->stages[1].args[1].toInt(), shards::kSmallCnnBlocks);
  EXPECT_EQ(cnn_cut->stages[0].args[1].toInt(), cnn_cut->stages[1].args[0].toInt());
  EXPECT_EQ(cnn_cut->stages[1].args[2].toInt(), 5);
}

}  // namespace
}  // namespace remora::pipeline
