// TorchScript stages that write their received input in place (torchvision's
// ReLU(inplace=True) first in a stage, after a cut): they train over real
// worker processes and match the same modules in one process, where the
// input they write is an activation, not a leaf (pipeline/stage.cc).
#include <string>
#include <utility>
#include <vector>

#include <ATen/ops/mse_loss.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/optim/sgd.h>

#include "pipeline/partition.h"
#include "pipeline/pipeline.h"
#include "pipeline/stage.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/script_models.h"
#include "tests/support/split_checks.h"
#include "tests/support/test_group.h"

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

using Batches = std::vector<std::pair<at::Tensor, at::Tensor>>;

// The TorchScript modules `bytes`, loaded and run one after another in
// this process, trained on `data` (MSE, SGD at 0.1): each step's loss; the
// modules' parameters after the last step in `params`.
std::vector<double> TrainHere(const std::vector<std::string>& bytes, const Batches& data,
                              std::vector<at::Tensor>* params) {
  std::vector<torch::jit::Module> chain;
  for (const std::string& b : bytes) chain.push_back(test_support::LoadFromBytes(b));
  for (torch::jit::Module& m : chain) {
    for (const at::Tensor& p : m.parameters()) params->push_back(p.requires_grad_(true));
  }
  torch::optim::SGD sgd(*params, torch::optim::SGDOptions(0.1));
  std::vector<double> losses;
  for (const auto& [x, t] : data) {
    sgd.zero_grad();
    c10::IValue y = x;
    for (torch::jit::Module& m : chain) y = m.forward({y});
    at::Tensor l = at::mse_loss(y.toTensor(), t);
    l.backward();
    sgd.step();
    losses.push_back(l.item<double>());
  }
  return losses;
}

// `stages` over workers w1, w2 trained on `data` as TrainHere trains them:
// each step's loss within 1e-5 of `want`'s; stage 0's first parameter
// after them as `first` (when given) has it.
void ExpectPipelineTrainsAlike(rpc::Agent& master, std::vector<StageSpec> stages, const std::string& schedule,
                               const Batches& data, const std::vector<double>& want, const at::Tensor& first) {
  PipelineOptions o;
  o.stages = std::move(stages);
  o.workers = {"w1", "w2"};
  o.schedule = schedule;
  o.micro_batches = 4;
  o.loss = MseLoss();
  o.optimizer = optim::OptimizerOptions::SGD(0.1);
  auto pipe = Pipeline::Create(master, o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  for (size_t i = 0; i < data.size(); ++i) {
    auto loss = (*pipe)->start_train_step(data[i].first, data[i].second).wait();
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_NEAR(*loss, want[i], 1e-5 * std::abs(want[i])) << "step " << i;
  }
  // (Stage 0's weights got their gradient through stage 1's copy.)
  if (first.defined()) {
    EXPECT_LT(RelativeError((*pipe)->stage_state(0).value()[0], first), 1e-5);
  }
  EXPECT_TRUE((*pipe)->eval_step(data[0].first).ok());
}

TEST(ScriptStage, AStageThatWritesItsReceivedInputInPlaceTrainsAsInOneProcess) {
  test_support::TestWorkers workers;
  const Batches data = test_support::RandomBatches(3, 8, 8, 4);
  for (bool through_view : {false, true}) {
    SCOPED_TRACE(through_view ? "through a view" : "in a submodule");
    torch::jit::Module first = test_support::ScriptLinear(8, 16, 1, false);
    torch::jit::Module head = InPlaceHead(16, 4, through_view);
    const std::string s0 = test_support::SaveToBytes(first), s1 = test_support::SaveToBytes(head);
    std::vector<at::Tensor> params;
    const std::vector<double> want = TrainHere({s0, s1}, data, &params);
    for (const std::string schedule : {"gpipe", "1f1b"}) {
      SCOPED_TRACE(schedule);
      ExpectPipelineTrainsAlike(workers.master(),
                                {StageSpec::TorchScript(s0, "linear.pt"), StageSpec::TorchScript(s1, "head.pt")},
                                schedule, data, want, params[0]);
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
  const Batches data = test_support::RandomBatches(3, 8, 8, 4);
  std::vector<at::Tensor> params;
  const std::vector<double> want = TrainHere({bytes}, data, &params);
  ExpectPipelineTrainsAlike(workers.master(), {*s0, *s1}, "1f1b", data, want, params[0]);
}

// Two stages over w1 and w2, two micro-batches, the MSE loss.
PipelineOptions TwoOver(StageSpec a, StageSpec b) {
  PipelineOptions o;
  o.stages = {std::move(a), std::move(b)};
  o.workers = {"w1", "w2"};
  o.micro_batches = 2;
  o.loss = MseLoss();
  return o;
}

// Several tensors across a cut that the next stage does not take: the
// error names the stage, each element it was given and what its forward
// declares, without the interpreter's traceback.
// On a CPU a TorchScript stage runs its graph as written: past the
// executor's profiling runs (which would fuse linear layers and their
// activations into one autograd node computing every gradient at once),
// a split backward still leaves the weights' gradients to W, and B then
// W equals one backward pass bitwise.
TEST(ScriptStage, AScriptStageLeavesItsWeightsToWOnACpu) {
  torch::jit::Module residual = test_support::ScriptSequential({6, 8, 8, 3}, /*residual=*/true);
  auto built = LoadScriptStage(test_support::SaveToBytes(residual), "residual", c10::Device(c10::kCPU));
  ASSERT_TRUE(built.ok()) << built.status();
  StageModule& stage = **built;
  const at::Tensor x = at::randn({4, 6});
  for (int warm = 0; warm < 3; ++warm) {
    stage.Forward(x.detach().requires_grad_(true)).toTensor().sum().backward();
  }
  const std::vector<at::Tensor> params = stage.Parameters();
  for (const at::Tensor& p : params) p.mutable_grad() = at::Tensor();
  // (The helper checks that B kept gradients for W: with the executor's
  // fused nodes it keeps none, the weights' gradients all computed in B.)
  test_support::ExpectSplitEqualsWhole(test_support::SplitCase{
      "residual", [&stage](const at::Tensor& in) { return stage.Forward(in).toTensor(); }, params, x});
}

TEST(Pipeline, InputsAStageDoesNotTakeAreNamedElementByElement) {
  test_support::TestWorkers workers;
  rpc::Agent& master = workers.master();
  // Stage 0 hands on its output and each row's largest column (int64).
  torch::jit::Module pair("Pair");
  pair.register_module("fc", test_support::ScriptLinear(8, 16, 1, false));
  pair.define("def forward(self, x):\n  y = self.fc.forward(x)\n  return y, torch.argmax(y, 1)\n");
  const StageSpec two_out = StageSpec::TorchScript(test_support::SaveToBytes(pair), "pair.pt");
  // One tensor only.
  torch::jit::Module one = test_support::ScriptLinear(16, 4, 2, false);
  auto one_in =
      Pipeline::Create(master, TwoOver(two_out, StageSpec::TorchScript(test_support::SaveToBytes(one), "one.pt")));
  ASSERT_TRUE(one_in.ok()) << one_in.status();
  absl::Status s = (*one_in)->start_train_step(at::randn({4, 8}), at::randn({4, 4})).wait().status();
  ExpectError(s, {"stage 1 (one.pt) on worker 'w2', forward of micro-batch ",
                  " given (a Float tensor of shape [2, 16], a Long tensor of shape [2]): its forward(x: Tensor) "
                  "takes 1 input, not 2 (a stage is given what the stage before it returns"});
  EXPECT_EQ(s.message().find("Traceback"), std::string::npos) << s.message();
  // Two, the second declared a float.
  torch::jit::Module scaled("Scaled");
  scaled.register_module("fc", test_support::ScriptLinear(16, 4, 2, false));
  scaled.define("def forward(self, x, scale: float):\n  return self.fc.forward(x) * scale\n");
  auto typed = Pipeline::Create(
      master, TwoOver(two_out, StageSpec::TorchScript(test_support::SaveToBytes(scaled), "scaled.pt")));
  ASSERT_TRUE(typed.ok()) << typed.status();
  ExpectError((*typed)->start_train_step(at::randn({4, 8}), at::randn({4, 4})).wait().status(),
              {"stage 1 (scaled.pt) on worker 'w2'", "its forward(x: Tensor, scale: float) declares input 1 "
               "(scale) float, not a Long tensor of shape [2] (a stage is given"});
  // A stage that takes both trains.
  torch::jit::Module both("Both");
  both.register_module("fc", test_support::ScriptLinear(16, 4, 2, false));
  both.define("def forward(self, x, top):\n  return self.fc.forward(x) + top.unsqueeze(1).float()\n");
  auto fine = Pipeline::Create(master,
                               TwoOver(two_out, StageSpec::TorchScript(test_support::SaveToBytes(both), "both.pt")));
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_TRUE((*fine)->start_train_step(at::randn({4, 8}), at::randn({4, 4})).wait().ok());
}

}  // namespace
}  // namespace remora::pipeline
