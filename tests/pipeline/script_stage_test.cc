// TorchScript stages that write their received input in place (torchvision's
// ReLU(inplace=True) first in a stage, after a cut): they train over real
// worker processes and match the same modules in one process, where the
// input they write is an activation, not a leaf (pipeline/stage.cc).
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ops/mse_loss.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/optim/sgd.h>

#include "pipeline/partition.h"
#include "pipeline/pipeline.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/script_models.h"

namespace remora::pipeline {
namespace {

using test_support::RelativeError;

// A head whose forward first writes its input in place: in a submodule
// (ReLU(inplace=True), as torchvision has it) or through a view of it.
torch::jit::Module InPlaceHead(int64_t in, int64_t out, bool through_view) {
  torch::jit::Module act("ReLU");
  act.define("def forward(self, x):\n  x.relu_()\n  return x\n");
  torch::jit::Module m("Head");
  m.register_module("act", act);
  m.register_module("fc", test_support::ScriptLinear(in, out, 7, false));
  m.define(through_view ? "def forward(self, x):\n  x[:, :2].mul_(2.0)\n  return self.fc.forward(x)\n"
                        : "def forward(self, x):\n  x = self.act.forward(x)\n  return self.fc.forward(x)\n");
  return m;
}

TEST(ScriptStage, AStageThatWritesItsReceivedInputInPlaceTrainsAsInOneProcess) {
  test_support::TestWorkers workers;
  const auto data = test_support::RandomBatches(3, 8, 8, 4);
  for (bool through_view : {false, true}) {
    SCOPED_TRACE(through_view ? "through a view" : "in a submodule");
    torch::jit::Module first = test_support::ScriptLinear(8, 16, 1, false);
    torch::jit::Module head = InPlaceHead(16, 4, through_view);
    const std::string s0 = test_support::SaveToBytes(first), s1 = test_support::SaveToBytes(head);
    // One process: the same modules, loaded from the same bytes.
    torch::jit::Module l0 = test_support::LoadFromBytes(s0), l1 = test_support::LoadFromBytes(s1);
    std::vector<at::Tensor> params;
    for (auto* m : {&l0, &l1}) {
      for (const at::Tensor& p : m->parameters()) params.push_back(p.requires_grad_(true));
    }
    torch::optim::SGD local(params, torch::optim::SGDOptions(0.1));
    std::vector<double> local_losses;
    for (const auto& [x, t] : data) {
      local.zero_grad();
      at::Tensor l = at::mse_loss(l1.forward({l0.forward({x})}).toTensor(), t);
      l.backward();
      local.step();
      local_losses.push_back(l.item<double>());
    }
    for (const std::string schedule : {"gpipe", "1f1b"}) {
      SCOPED_TRACE(schedule);
      PipelineOptions o;
      o.stages = {StageSpec::TorchScript(s0, "linear.pt"), StageSpec::TorchScript(s1, "head.pt")};
      o.workers = {"w1", "w2"};
      o.schedule = schedule;
      o.micro_batches = 4;
      o.loss = MseLoss();
      o.optimizer = optim::OptimizerOptions::SGD(0.1);
      auto pipe = Pipeline::Create(workers.master(), o);
      ASSERT_TRUE(pipe.ok()) << pipe.status();
      for (size_t i = 0; i < data.size(); ++i) {
        auto loss = (*pipe)->train_step(data[i].first, data[i].second);
        ASSERT_TRUE(loss.ok()) << loss.status();
        EXPECT_NEAR(*loss, local_losses[i], 1e-5 * std::abs(local_losses[i])) << "step " << i;
      }
      // The first stage's weights got their gradient through the copy.
      auto w0 = (*pipe)->stage_state(0).value();
      EXPECT_LT(RelativeError(w0[0], params[0]), 1e-5);
      auto out = (*pipe)->eval_step(data[0].first);
      ASSERT_TRUE(out.ok()) << out.status();
    }
  }
}

// A one-file sequential model cut by the partitioner right before its
// in-place ReLU (where the partitioner may well cut torchvision's models):
// the cut stage begins by writing its received input.
TEST(ScriptStage, ACutBeforeAnInPlaceLayerTrainsAsTheWholeModelInOneProcess) {
  test_support::TestWorkers workers;
  torch::jit::Module act("ReLU");
  act.define("def forward(self, x):\n  x.relu_()\n  return x\n");
  torch::jit::Module seq("Sequential");
  seq.register_module("l0", test_support::ScriptLinear(8, 16, 1, false));
  seq.register_module("act", act);
  seq.register_module("l1", test_support::ScriptLinear(16, 4, 2, false));
  seq.define("def forward(self, x):\n  x = self.l0.forward(x)\n  x = self.act.forward(x)\n"
             "  return self.l1.forward(x)\n");
  const std::string bytes = test_support::SaveToBytes(seq);
  auto model = SequentialModel::TorchScript(bytes, "seq.pt");
  ASSERT_TRUE(model.ok()) << model.status();
  auto s0 = model->Stage(0, 1), s1 = model->Stage(1, 3);
  ASSERT_TRUE(s0.ok() && s1.ok());
  const auto data = test_support::RandomBatches(3, 8, 8, 4);
  torch::jit::Module whole = test_support::LoadFromBytes(bytes);
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : whole.parameters()) params.push_back(p.requires_grad_(true));
  torch::optim::SGD local(params, torch::optim::SGDOptions(0.1));
  PipelineOptions o;
  o.stages = {*s0, *s1};
  o.workers = {"w1", "w2"};
  o.micro_batches = 2;
  o.loss = MseLoss();
  o.optimizer = optim::OptimizerOptions::SGD(0.1);
  auto pipe = Pipeline::Create(workers.master(), o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  for (size_t i = 0; i < data.size(); ++i) {
    local.zero_grad();
    at::Tensor l = at::mse_loss(whole.forward({data[i].first}).toTensor(), data[i].second);
    l.backward();
    local.step();
    auto loss = (*pipe)->train_step(data[i].first, data[i].second);
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_NEAR(*loss, l.item<double>(), 1e-5 * std::abs(l.item<double>())) << "step " << i;
  }
}

}  // namespace
}  // namespace remora::pipeline
