// Tensors that cross a cut of a scripted model beside the residual stream:
// an attention mask made once at the top and given to every block.
// (partition_test.cc cuts GPTs where the token ids and positions cross.)
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include "pipeline/partition.h"
#include "pipeline/pipeline.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/script_models.h"

namespace remora::pipeline {
namespace {

using ::testing::HasSubstr;
using Workers = test_support::TestWorkers;

// An attention mask made once at the top and given to every block, as
// GPT implementations do: cut between the blocks, the boolean mask (no
// gradient) crosses beside the residual stream, and the two stages train
// as one process.
TEST(ScriptCut, AnAttentionMaskCrossesACutBesideTheResidualStream) {
  Workers workers;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  torch::jit::Module m("MaskedGpt");
  torch::jit::Module wte("Embedding");
  wte.register_parameter("weight", at::randn({11, 6}, gen, at::TensorOptions()), false);
  wte.define("def forward(self, idx):\n  return torch.embedding(self.weight, idx)\n");
  m.register_module("wte", wte);
  for (int i = 0; i < 2; ++i) {
    torch::jit::Module block("Block");
    block.register_module("mlp", test_support::ScriptLinear(6, 6, 60 + i, true));
    block.define(R"(def forward(self, x, mask):
  att = torch.matmul(x, x.transpose(1, 2)).masked_fill(torch.logical_not(mask), -1e9).softmax(-1)
  return x + self.mlp.forward(torch.matmul(att, x))
)");
    m.register_module("h" + std::to_string(i), block);
  }
  m.register_module("head", test_support::ScriptLinear(6, 11, 70, false));
  m.define(R"(def forward(self, idx):
  t = idx.size(1)
  mask = torch.ones(t, t).tril() > 0.5
  x = self.wte.forward(idx)
  x = self.h0.forward(x, mask)
  x = self.h1.forward(x, mask)
  return self.head.forward(x)
)");
  const std::string bytes = test_support::SaveToBytes(m);
  auto model = SequentialModel::TorchScript(bytes, "masked.pt").value();
  const at::Tensor x = at::randint(11, {4, 8}, gen, at::TensorOptions(at::kLong));
  const at::Tensor t = at::randint(11, {4, 8}, gen, at::TensorOptions(at::kLong));
  const std::vector<double> want = test_support::ScriptedLossesInOneProcess(bytes, x, t, 3);
  auto before_h1 = model.LayerNamed("h1");
  ASSERT_TRUE(before_h1.ok()) << before_h1.status();
  PartitionOptions given;
  given.split_at = {*before_h1};
  auto cut = Partition(workers.master(), model, {"w1", "w2"}, given);
  ASSERT_TRUE(cut.ok()) << cut.status();
  ASSERT_EQ(cut->stages.size(), 2u);
  const std::string second =
      toString(test_support::LoadFromBytes(cut->stages[1].script).get_method("forward").function().getSchema());
  EXPECT_THAT(second, HasSubstr("(remora.cut.Stage self, Tensor x0, Tensor x1) -> Tensor")) << second;  // x, mask
  PipelineOptions o;
  o.stages = cut->stages;
  o.workers = {"w1", "w2"};
  o.micro_batches = 2;
  o.loss = LossFn::Named("causal_lm");
  o.optimizer = optim::OptimizerOptions::SGD(0.05);
  auto pipe = Pipeline::Create(workers.master(), o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  for (size_t i = 0; i < want.size(); ++i) {
    auto loss = (*pipe)->start_train_step(x, t).wait();
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_NEAR(*loss, want[i], 1e-5 * want[i]) << "step " << i;
  }
}

}  // namespace
}  // namespace remora::pipeline
