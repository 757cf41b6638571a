// A backward pass split in two (autograd/split_backward.h): B, the inputs'
// gradients, then W, the parameters', equal one backward pass bitwise on
// every built-in stage type and on TorchScript stages; a graph that does not
// split runs whole at B and still equals it.
#include "autograd/split_backward.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/randn_like.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "autograd/container.h"
#include "shards/cnn.h"
#include "shards/gpt.h"
#include "shards/mlp.h"
#include "shards/resnet.h"
#include "tests/support/script_models.h"
#include "tests/support/split_checks.h"

namespace remora::autograd {
namespace {

using test_support::ExpectSplitEqualsWhole;
using Case = test_support::SplitCase;

template <typename M>
Case ModuleCase(const std::string& name, std::shared_ptr<M> m, at::Tensor input) {
  return Case{name, [m](const at::Tensor& x) { return m->forward(x); }, m->parameters(), std::move(input)};
}

TEST(SplitBackward, BThenWEqualsOneBackwardOnEveryBuiltInStageType) {
  // Both passes convolve without oneDNN: Debian 13's oneDNN 3.7.2 dies of
  // SIGFPE in LibTorch 2.6's convolution backward on the 2-core VM
  // (docs/cuda-and-libtorch2.md, "Known trap"). The split is the autograd
  // graph's, the same whichever kernel a node runs.
  const bool mkldnn = at::globalContext().userEnabledMkldnn();
  at::globalContext().setUserEnabledMkldnn(false);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const auto floats = [&gen](std::vector<int64_t> shape) { return at::randn(shape, gen, at::TensorOptions()); };
  std::vector<Case> cases;
  cases.push_back(ModuleCase("SmallCnn", std::make_shared<shards::SmallCnnImpl>(0, shards::kSmallCnnBlocks, 2),
                             floats({4, 1, 28, 28})));
  cases.push_back(ModuleCase("ResNetShard (stem, two bottlenecks)", std::make_shared<shards::ResNetShardImpl>(0, 3, 2),
                             floats({2, 3, 32, 32})));
  cases.push_back(ModuleCase("ResNetShard (bottlenecks, head)",
                             std::make_shared<shards::ResNetShardImpl>(14, shards::kResNetBlocks, 2),
                             floats({2, 1024, 2, 2})));
  shards::MLPStageOptions mlp;
  mlp.in = 6;
  mlp.out = 5;
  mlp.batchnorm = true;
  torch::nn::Sequential seq = shards::MakeMLPStage(mlp);
  cases.push_back(Case{"MLP", [seq](const at::Tensor& x) mutable { return seq->forward(x); }, seq->parameters(),
                       floats({4, 6})});
  cases.push_back(ModuleCase("GptBlocks", std::make_shared<shards::GptBlocksImpl>(16, 4, 0, 2, 2), floats({2, 8, 16})));
  cases.push_back(ModuleCase("GptHead", std::make_shared<shards::GptHeadImpl>(16, 32, 2), floats({2, 8, 16})));
  // Token ids need no gradient: B has nothing to do, W is the whole pass.
  cases.push_back(ModuleCase("GptEmbed", std::make_shared<shards::GptEmbedImpl>(32, 8, 16, 2),
                             at::randint(32, {2, 8}, gen, at::TensorOptions(at::kLong))));
  for (const Case& c : cases) ExpectSplitEqualsWhole(c);
  at::globalContext().setUserEnabledMkldnn(mkldnn);
}

TEST(SplitBackward, BThenWEqualsOneBackwardOnTorchScriptStages) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  const std::vector<std::pair<torch::jit::Module, at::Tensor>> stages = {
      {test_support::ScriptSmallCnn(10, 3), at::randn({2, 3, 8, 8}, gen, at::TensorOptions())},
      {test_support::ScriptSequential({6, 8, 8, 3}, /*residual=*/true), at::randn({4, 6}, gen, at::TensorOptions())}};
  for (const auto& [m, input] : stages) {
    auto module = std::make_shared<torch::jit::Module>(m);
    std::vector<at::Tensor> params;
    for (const at::Tensor& p : module->parameters()) params.push_back(p.requires_grad_(true));
    // (Past the profiling executor's first runs, its graph is an optimised
    // one whose backward node computes every gradient at once.)
    for (int warm = 0; warm < 3; ++warm) {
      module->forward({input.detach().requires_grad_(true)}).toTensor().sum().backward();
    }
    for (const at::Tensor& p : params) p.mutable_grad() = at::Tensor();
    // (What the executor fused into one node runs once, in B: whether W
    // has work left depends on what it fused.)
    ExpectSplitEqualsWhole(Case{module->type()->name()->qualifiedName(),
                                [module](const at::Tensor& x) { return module->forward({x}).toTensor(); }, params,
                                input, /*splits=*/true, /*kept=*/false});
  }
}

// Counts the times a node runs.
class CountRuns : public torch::autograd::FunctionPreHook {
 public:
  explicit CountRuns(int* runs) : runs_(runs) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    ++*runs_;
    return grads;
  }

 private:
  int* runs_;
};

// A matrix product's weight gradient is left to W, so its node runs in B
// (the input's part) and again in W (the weight's); a normalization's
// weights come from the reductions its input's gradient needs anyway, so
// B computes them and its node runs once.
TEST(SplitBackward, NormalizationsWeightsComeFromBAndProductsFromW) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  torch::nn::Linear linear(6, 6);
  torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({6}));
  const at::Tensor x = at::randn({4, 6}, gen, at::TensorOptions()).requires_grad_(true);
  const at::Tensor y = norm->forward(linear->forward(x));
  int norm_runs = 0, product_runs = 0;
  y.grad_fn()->add_pre_hook(std::make_unique<CountRuns>(&norm_runs));
  torch::autograd::Node* product = y.grad_fn()->next_edges()[0].function.get();
  ASSERT_NE(product, nullptr);
  product->add_pre_hook(std::make_unique<CountRuns>(&product_runs));
  std::vector<at::Tensor> params = linear->parameters();
  for (const at::Tensor& p : norm->parameters()) params.push_back(p);
  SplitBackward pass({y}, {at::ones({4, 6})}, {x}, params);
  ASSERT_TRUE(pass.split()) << pass.why_not_split();
  ASSERT_TRUE(pass.Inputs().ok());
  EXPECT_EQ(norm_runs, 1);
  EXPECT_EQ(product_runs, 1);
  EXPECT_GT(pass.held_bytes(), 0) << "B keeps the product's gradient for W";
  auto dw = pass.Weights();
  ASSERT_TRUE(dw.ok()) << dw.status();
  EXPECT_EQ(norm_runs, 1) << "the normalization's weights came from B";
  EXPECT_EQ(product_runs, 2) << "the product's weights came from W";
  for (const at::Tensor& g : *dw) EXPECT_TRUE(g.defined());
  ExpectSplitEqualsWhole(Case{"Linear, LayerNorm",
                              [linear, norm](const at::Tensor& in) mutable { return norm->forward(linear->forward(in)); },
                              params, x.detach()});
}

// A weight used twice in a row (h = x W, y = h W): its gradient arrives
// through two nodes B runs, the second below the first, so the pass does
// not split and B computes everything; the results are still one pass's.
TEST(SplitBackward, AGraphThatDoesNotSplitRunsWholeAtB) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  const at::Tensor w = at::randn({4, 4}, gen, at::TensorOptions()).requires_grad_(true);
  const at::Tensor b = at::randn({4}, gen, at::TensorOptions()).requires_grad_(true);
  Case twice{"twice", [w, b](const at::Tensor& x) { return at::mm(at::mm(x, w), w) + b; }, {w, b},
             at::randn({3, 4}, gen, at::TensorOptions()), /*splits=*/false};
  ExpectSplitEqualsWhole(twice);
  {
    const at::Tensor x = twice.input.detach().requires_grad_(true);
    SplitBackward pass({twice.forward(x)}, {at::ones({3, 4})}, {x}, twice.params);
    EXPECT_EQ(pass.why_not_split(),
              "a parameter's gradient flows through two nodes that B runs, one after the other");
  }
  // The same weights once each split.
  const at::Tensor w2 = at::randn({4, 4}, gen, at::TensorOptions()).requires_grad_(true);
  ExpectSplitEqualsWhole(Case{"once each", [w, w2, b](const at::Tensor& x) { return at::mm(at::mm(x, w), w2) + b; },
                              {w, w2, b}, at::randn({3, 4}, gen, at::TensorOptions())});
  // A stage that returns a parameter: not split, its gradient the one given.
  const at::Tensor given = at::randn({4, 4}, gen, at::TensorOptions());
  SplitBackward handed({w}, {given}, {}, {w, b});
  EXPECT_FALSE(handed.split());
  EXPECT_EQ(handed.why_not_split(), "it returns a parameter or its input as they are");
  ASSERT_TRUE(handed.Inputs().ok());
  auto weights = handed.Weights();
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_TRUE((*weights)[0].equal(given));
  EXPECT_FALSE((*weights)[1].defined());
  // A stage that returns its input unchanged: not split, and the input's
  // gradient is the one given.
  const at::Tensor x = at::randn({3, 4}, gen, at::TensorOptions()).requires_grad_(true);
  const at::Tensor g = at::randn({3, 4}, gen, at::TensorOptions());
  SplitBackward same({x}, {g}, {x}, {w});
  EXPECT_FALSE(same.split());
  EXPECT_EQ(same.why_not_split(), "it returns a parameter or its input as they are");
  auto dx = same.Inputs();
  ASSERT_TRUE(dx.ok()) << dx.status();
  EXPECT_TRUE((*dx)[0].equal(g));
  auto dw = same.Weights();
  ASSERT_TRUE(dw.ok()) << dw.status();
  EXPECT_FALSE((*dw)[0].defined());
}

// The engine's note of a stage that does not split (RunSplitBackward)
// reaches Enable's sink once per stage, however many passes fall back.
TEST(SplitBackward, AFallbackIsSaidOncePerStage) {
  std::vector<std::string> lines;
  Container container(nullptr, [&lines](std::string_view line) { lines.emplace_back(line); });
  for (int pass = 0; pass < 3; ++pass) {
    container.NoteOnce("whole stage 1", "stage 1 whole");
    container.NoteOnce("whole stage 2", "stage 2 whole");
  }
  EXPECT_EQ(lines, (std::vector<std::string>{"stage 1 whole", "stage 2 whole"}));
  Container silent(nullptr, base::LineSink());
  silent.NoteOnce("whole stage 1", "dropped");  // (no sink: nothing, no crash)
}

}  // namespace
}  // namespace remora::autograd
