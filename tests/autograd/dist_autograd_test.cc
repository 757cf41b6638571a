// Distributed autograd and the DistributedOptimizer: gradients across
// agents, release, failures, and exact parity with single-process training
// (the parity tests run the real `worker` program).
#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "absl/strings/str_cat.h"
#include "autograd/dist_autograd.h"
#include "launch/local_group.h"
#include "optim/distributed_optimizer.h"
#include "shards/mlp.h"
#include "tests/support/test_functions.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;

// Largest |a - b| relative to the largest |b|.
double RelativeError(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-12);
  return (a - b).abs().max().item<double>() / scale;
}

shards::MLPStageOptions Stage(int64_t in, int64_t out, int64_t seed, bool relu, bool bn = false) {
  shards::MLPStageOptions o;
  o.in = in;
  o.out = out;
  o.seed = seed;
  o.relu = relu;
  o.batchnorm = bn;
  return o;
}

rpc::RRef RemoteStage(rpc::Agent& agent, const std::string& worker, const shards::MLPStageOptions& o) {
  return agent
      .remote(worker, "MLPStage", {o.in, o.out, o.seed, o.relu, o.batchnorm})
      .value();
}

TEST(DistAutograd, ContextIdsCarryTheWorkerIdAndAreCurrent) {
  Group g(1);
  EXPECT_EQ(rpc::CurrentContextId(), rpc::kNoContext);
  {
    autograd::Context outer(g.worker(1));
    EXPECT_EQ(outer.id() >> 48, 1);
    EXPECT_EQ(rpc::CurrentContextId(), outer.id());
    {
      autograd::Context inner(g.master());
      EXPECT_EQ(inner.id() >> 48, 0);
      EXPECT_EQ(rpc::CurrentContextId(), inner.id());
    }
    EXPECT_EQ(rpc::CurrentContextId(), outer.id());
  }
  EXPECT_EQ(rpc::CurrentContextId(), rpc::kNoContext);
}

// As in PyTorch: backward frees the graph on every worker it ran on, unless
// retain_graph; then a second pass runs and its gradients add up.
TEST(DistAutograd, RetainGraphKeepsTheRemoteGraphForAnotherPass) {
  Group g(1);
  const auto o = Stage(4, 3, 21, false);
  rpc::RRef stage = RemoteStage(g.master(), "w1", o);
  const at::Tensor x = at::randn({5, 4});
  {
    autograd::Context context(g.master());
    at::Tensor out = stage.rpc_sync("forward", {x}).value().toTensor().sum();
    ASSERT_TRUE(autograd::backward(g.master(), context.id(), {out}, true).ok());
    const auto once = autograd::get_gradients(g.worker(1), context.id()).value();
    ASSERT_FALSE(once.empty());
    std::vector<at::Tensor> first;
    for (const auto& [param, grad] : once) first.push_back(grad.clone());
    ASSERT_TRUE(autograd::backward(g.master(), context.id(), {out}).ok());
    const auto twice = autograd::get_gradients(g.worker(1), context.id()).value();
    ASSERT_EQ(twice.size(), first.size());
    for (size_t i = 0; i < first.size(); ++i) {
      EXPECT_LT(RelativeError(twice[i].second, 2 * first[i]), 1e-6);
    }
    // The second pass did not retain it: a third reaches freed buffers on w1.
    absl::Status third = autograd::backward(g.master(), context.id(), {out});
    EXPECT_FALSE(third.ok());
    EXPECT_THAT(std::string(third.message()), HasSubstr("w1"));
    EXPECT_THAT(std::string(third.message()), HasSubstr("second time"));
  }
}

TEST(DistAutograd, GradientsFlowThroughRRefsAndToHere) {
  Group g(2);
  const auto o1 = Stage(4, 3, 11, true), o2 = Stage(3, 2, 12, false);
  rpc::RRef s1 = RemoteStage(g.master(), "w1", o1);
  rpc::RRef s2 = RemoteStage(g.master(), "w2", o2);
  at::Tensor x = at::randn({5, 4});
  auto local1 = shards::MakeMLPStage(o1), local2 = shards::MakeMLPStage(o2);
  local2->forward(local1->forward(x)).sum().backward();

  autograd::Context context(g.master());
  rpc::RRef x_rref = g.master().local_rref(x);
  rpc::RRef y = s1.remote("forward", {x_rref}).value();  // stays on w1
  at::Tensor out = s2.rpc_sync("forward", {y}).value().toTensor();  // w2 fetches y from w1
  ASSERT_TRUE(out.requires_grad());
  ASSERT_TRUE(autograd::backward(g.master(), context.id(), {out.sum()}).ok());

  // Each worker holds the gradients of its own parameters, not .grad.
  for (auto [agent, local] : {std::pair{&g.worker(1), &local1}, std::pair{&g.worker(2), &local2}}) {
    auto grads = autograd::get_gradients(*agent, context.id()).value();
    ASSERT_EQ(grads.size(), 2u) << agent->self().name;
    for (const auto& [param, grad] : grads) EXPECT_FALSE(param.grad().defined());
    auto params = (*local)->parameters();
    for (const auto& p : params) {
      bool matched = false;
      for (const auto& [param, grad] : grads) {
        if (param.sizes() == p.sizes()) {
          EXPECT_LT(RelativeError(grad, p.grad()), 1e-5) << agent->self().name;
          matched = true;
        }
      }
      EXPECT_TRUE(matched);
    }
  }
  EXPECT_TRUE(autograd::get_gradients(g.master(), context.id()).value().empty());
}

TEST(DistAutograd, ConcurrentMicroBatchesSumTheirGradients) {
  Group g(2);
  const auto o1 = Stage(6, 5, 21, true), o2 = Stage(5, 3, 22, false);
  rpc::RRef s1 = RemoteStage(g.master(), "w1", o1);
  rpc::RRef s2 = RemoteStage(g.master(), "w2", o2);
  auto local1 = shards::MakeMLPStage(o1), local2 = shards::MakeMLPStage(o2);
  std::vector<at::Tensor> xs;
  for (int i = 0; i < 6; ++i) xs.push_back(at::randn({3, 6}));
  for (const auto& x : xs) local2->forward(local1->forward(x)).pow(2).sum().backward();

  int64_t id;
  {
    autograd::Context context(g.master());
    id = context.id();
    std::vector<rpc::Future<c10::IValue>> outs;
    for (const auto& x : xs) {
      rpc::RRef y = s1.remote("forward", {g.master().local_rref(x)}).value();
      outs.push_back(s2.rpc_async("forward", {y}));
    }
    std::vector<rpc::Future<rpc::Empty>> backwards;
    for (auto& f : outs) {
      at::Tensor out = f.wait().value().toTensor();
      backwards.push_back(autograd::backward_async(g.master(), id, {out.pow(2).sum()}));
    }
    for (auto& b : backwards) ASSERT_TRUE(b.wait().ok());
    auto grads = autograd::get_gradients(g.worker(1), id).value();
    ASSERT_EQ(grads.size(), 2u);
    for (const auto& [param, grad] : grads) {
      for (const auto& p : local1->parameters()) {
        if (p.sizes() == param.sizes()) {
          EXPECT_LT(RelativeError(grad, p.grad()), 1e-5);
        }
      }
    }
  }
  // Leaving the context released it on every worker.
  for (rpc::Agent* a : g.all()) EXPECT_EQ(autograd::num_contexts(*a), 0) << a->self().name;
}

TEST(DistAutograd, FailingStageFailsBackwardWithItsNameAndKeepsServing) {
  Group g(2);
  rpc::RRef s1 = RemoteStage(g.master(), "w1", Stage(4, 4, 1, true));
  rpc::RRef bad = g.master().remote("w2", "BackwardFails", {std::string("stage exploded")}).value();
  {
    autograd::Context context(g.master());
    rpc::RRef y = s1.remote("forward", {g.master().local_rref(at::randn({2, 4}))}).value();
    at::Tensor out = bad.rpc_sync("forward", {y}).value().toTensor();
    absl::Status s = autograd::backward(g.master(), context.id(), {out.sum()});
    ASSERT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()), HasSubstr("worker 'w2'"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("stage exploded"));
  }
  for (rpc::Agent* a : g.all()) EXPECT_EQ(autograd::num_contexts(*a), 0) << a->self().name;
  EXPECT_EQ(g.master().rpc_sync("w2", "add", {int64_t{1}, int64_t{2}}).value().toInt(), 3);
}

TEST(DistAutograd, BackwardErrorsAreClear) {
  Group g(1);
  EXPECT_EQ(autograd::backward(g.master(), 12345, {at::randn({1}).set_requires_grad(true)}).code(),
            absl::StatusCode::kNotFound);
  autograd::Context context(g.master());
  EXPECT_EQ(autograd::backward(g.master(), context.id(), {at::randn({1})}).code(),
            absl::StatusCode::kInvalidArgument);
  auto unknown = g.master().rpc_sync("w1", "remora.autograd.propagate",
                                     {context.id(), int64_t{99}, c10::List<at::Tensor>()});
  EXPECT_THAT(std::string(unknown.status().message()),
              HasSubstr(absl::StrCat("unknown distributed autograd context ", context.id())));
  // Once w1 took part in the context, a bad message id is named as such.
  ASSERT_TRUE(g.master().rpc_sync("w1", "echo", {at::randn({2}).set_requires_grad(true)}).ok());
  ASSERT_EQ(autograd::num_contexts(g.worker(1)), 1);
  auto bad = g.master().rpc_sync("w1", "remora.autograd.propagate",
                                 {context.id(), int64_t{99}, c10::List<at::Tensor>()});
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("no message 99"));
}

// --- parity with single-process training, real worker processes ----------------

struct ParityCase {
  optim::OptimizerOptions options;
  bool batchnorm = false;
  bool concurrent_backward = true;
  std::vector<double> lrs = {};  // the reference's rate at each step, where scheduled
};

void ExpectParity(const ParityCase& c) {
  constexpr int kSteps = 5, kMicroBatches = 4, kMicroBatchSize = 6;
  const auto o1 = Stage(8, 16, 31, true, c.batchnorm), o2 = Stage(16, 4, 32, false);

  // Reference: one process, LibTorch's optimizer, the same micro-batching.
  auto local1 = shards::MakeMLPStage(o1), local2 = shards::MakeMLPStage(o2);
  std::vector<at::Tensor> local_params = local1->parameters();
  for (const auto& p : local2->parameters()) local_params.push_back(p);
  std::unique_ptr<torch::optim::Optimizer> local_opt;
  const auto& o = c.options;
  if (o.kind == optim::OptimizerOptions::Kind::kSGD) {
    local_opt = std::make_unique<torch::optim::SGD>(
        local_params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).dampening(o.dampening)
                          .weight_decay(o.weight_decay).nesterov(o.nesterov));
  } else if (o.kind == optim::OptimizerOptions::Kind::kAdamW) {
    // Without decay_all, as nanoGPT: two groups, the matrices decaying.
    const auto adamw = torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps);
    std::vector<at::Tensor> matrices, vectors;
    for (const at::Tensor& p : local_params) (p.dim() >= 2 || o.decay_all ? matrices : vectors).push_back(p);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(matrices, std::make_unique<torch::optim::AdamWOptions>(
                                      torch::optim::AdamWOptions(adamw).weight_decay(o.weight_decay)));
    if (!vectors.empty()) {
      groups.emplace_back(vectors, std::make_unique<torch::optim::AdamWOptions>(
                                       torch::optim::AdamWOptions(adamw).weight_decay(0)));
    }
    local_opt = std::make_unique<torch::optim::AdamW>(std::move(groups), adamw);
  } else {
    local_opt = std::make_unique<torch::optim::Adam>(
        local_params, torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps)
                          .weight_decay(o.weight_decay));
  }
  std::vector<std::vector<std::pair<at::Tensor, at::Tensor>>> data(kSteps);
  for (auto& step : data) {
    for (int m = 0; m < kMicroBatches; ++m) {
      step.emplace_back(at::randn({kMicroBatchSize, 8}), at::randn({kMicroBatchSize, 4}));
    }
  }
  for (size_t k = 0; k < data.size(); ++k) {
    local_opt->zero_grad();
    for (const auto& [x, t] : data[k]) at::mse_loss(local2->forward(local1->forward(x)), t).backward();
    if (!c.lrs.empty()) {
      for (auto& group : local_opt->param_groups()) group.options().set_lr(c.lrs.at(k));
    }
    local_opt->step();
  }

  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  auto group = launch::StartLocalGroup({"worker1", "worker2"}, &registry);
  ASSERT_TRUE(group.ok()) << group.status();
  rpc::Agent& master = *group->master;
  {
    rpc::RRef s1 = RemoteStage(master, "worker1", o1);
    rpc::RRef s2 = RemoteStage(master, "worker2", o2);
    std::vector<rpc::RRef> params = optim::parameter_rrefs(s1).value();
    std::vector<rpc::RRef> params2 = optim::parameter_rrefs(s2).value();
    params.insert(params.end(), params2.begin(), params2.end());
    auto opt = optim::DistributedOptimizer::Create(master, c.options, params);
    ASSERT_TRUE(opt.ok()) << opt.status();
    for (const auto& step : data) {
      autograd::Context context(master);
      std::vector<rpc::Future<c10::IValue>> outs;
      for (const auto& [x, t] : step) {
        rpc::RRef y = s1.remote("forward", {master.local_rref(x)}).value();
        outs.push_back(s2.rpc_async("forward", {y}));
      }
      std::vector<at::Tensor> losses;
      std::vector<rpc::Future<rpc::Empty>> backwards;
      for (int m = 0; m < kMicroBatches; ++m) {
        auto out = outs[m].wait();
        ASSERT_TRUE(out.ok()) << out.status();
        losses.push_back(at::mse_loss(out->toTensor(), step[m].second));
        if (c.concurrent_backward) {
          backwards.push_back(autograd::backward_async(master, context.id(), {losses.back()}));
        }
      }
      if (!c.concurrent_backward) {
        backwards.push_back(autograd::backward_async(master, context.id(), losses));
      }
      for (auto& b : backwards) ASSERT_TRUE(b.wait().ok()) << b.wait().status();
      ASSERT_TRUE((*opt)->step(context.id()).ok());
    }
    auto remote_state1 = s1.rpc_sync("state").value().toTensorVector();
    auto remote_state2 = s2.rpc_sync("state").value().toTensorVector();
    auto local_state1 = shards::ModuleState(*local1), local_state2 = shards::ModuleState(*local2);
    ASSERT_EQ(remote_state1.size(), local_state1.size());
    ASSERT_EQ(remote_state2.size(), local_state2.size());
    for (size_t i = 0; i < local_state1.size(); ++i) {
      EXPECT_LT(RelativeError(remote_state1[i], local_state1[i]), 1e-5) << "stage 1 tensor " << i;
    }
    for (size_t i = 0; i < local_state2.size(); ++i) {
      EXPECT_LT(RelativeError(remote_state2[i], local_state2[i]), 1e-5) << "stage 2 tensor " << i;
    }
    // Training moved the weights (the comparison is not trivially equal).
    EXPECT_GT(RelativeError(local_state1[0], shards::ModuleState(*shards::MakeMLPStage(o1))[0]),
              1e-3);
    for (const char* w : {"worker1", "worker2"}) {
      EXPECT_EQ(master.rpc_sync(w, "remora.autograd.num_contexts").value().toInt(), 0) << w;
    }
  }
  EXPECT_TRUE(group->Shutdown().ok());
}

TEST(Parity, SgdWithMomentumMatchesLocalTraining) {
  ExpectParity({optim::OptimizerOptions::SGD(0.05).set_momentum(0.9).set_weight_decay(1e-4)});
}

TEST(Parity, NesterovSgdWithOneBackwardPerStepMatchesLocalTraining) {
  ParityCase c{optim::OptimizerOptions::SGD(0.05).set_momentum(0.9).set_nesterov(true)};
  c.concurrent_backward = false;
  ExpectParity(c);
}

TEST(Parity, AdamMatchesLocalTraining) {
  ExpectParity({optim::OptimizerOptions::Adam(0.01)});
}

// Biases and norm weights do not decay (the reference: two groups), unless
// decay_all (one group).
TEST(Parity, AdamWMatchesLocalTraining) {
  ExpectParity({optim::OptimizerOptions::AdamW(0.01).set_weight_decay(0.1)});
  ExpectParity({optim::OptimizerOptions::AdamW(0.01).set_weight_decay(0.1).set_decay_all(true)});
}

// Warm-up over two steps, then half a cosine down to min_lr at step 4:
// each owner sets its rate by its own step count.
TEST(Parity, ACosineScheduleWithWarmUpMatchesLocalTrainingStepByStep) {
  const double lr = 0.01, min_lr = 0.001;
  ParityCase c{optim::OptimizerOptions::AdamW(lr).set_schedule(
      {optim::LrSchedule::Kind::kCosine, /*warmup_steps=*/2, /*decay_steps=*/4, min_lr})};
  c.lrs = {lr / 2, lr, lr, (lr + min_lr) / 2, min_lr};
  ExpectParity(c);
}

TEST(LrSchedule, WarmsUpThenDecaysToTheFloorAndStays) {
  using Kind = optim::LrSchedule::Kind;
  const optim::LrSchedule cosine{Kind::kCosine, 4, 14, 0.1};
  EXPECT_DOUBLE_EQ(optim::ScheduledLr(1.0, cosine, 0), 0.25);
  EXPECT_DOUBLE_EQ(optim::ScheduledLr(1.0, cosine, 3), 1.0);
  EXPECT_DOUBLE_EQ(optim::ScheduledLr(1.0, cosine, 4), 1.0);
  EXPECT_NEAR(optim::ScheduledLr(1.0, cosine, 9), 0.55, 1e-12);  // halfway: cos(pi/2) = 0
  EXPECT_DOUBLE_EQ(optim::ScheduledLr(1.0, cosine, 14), 0.1);
  EXPECT_DOUBLE_EQ(optim::ScheduledLr(1.0, cosine, 1000), 0.1);
  const optim::LrSchedule linear{Kind::kLinear, 0, 10, 0.0};
  EXPECT_DOUBLE_EQ(optim::ScheduledLr(2.0, linear, 0), 2.0);
  EXPECT_DOUBLE_EQ(optim::ScheduledLr(2.0, linear, 5), 1.0);
  EXPECT_DOUBLE_EQ(optim::ScheduledLr(2.0, linear, 12), 0.0);
  const optim::LrSchedule warm{Kind::kConstant, 2, 0, 0.0};
  EXPECT_TRUE(warm.scheduled());
  EXPECT_FALSE(optim::LrSchedule{}.scheduled());
  EXPECT_DOUBLE_EQ(optim::ScheduledLr(0.5, warm, 0), 0.25);
  EXPECT_DOUBLE_EQ(optim::ScheduledLr(0.5, warm, 7), 0.5);
  EXPECT_EQ(optim::LrScheduleKindNamed("cosine").value(), Kind::kCosine);
  EXPECT_THAT(std::string(optim::LrScheduleKindNamed("step").status().message()),
              HasSubstr("must be constant, cosine or linear; got 'step'"));
}

// A scheduled optimizer's state dict carries its step count, so one loaded
// from it takes the next step at the next step's rate.
TEST(LrSchedule, TheStepCountTravelsWithTheOptimizersState) {
  const auto options = optim::OptimizerOptions::SGD(1.0).set_momentum(0.9).set_schedule(
      {optim::LrSchedule::Kind::kLinear, 0, 4, 0.0});
  const c10::impl::GenericDict dict = c10::IValue(optim::OptionsToDict(options)).toGenericDict();
  at::Tensor a = at::zeros({3}), b = at::zeros({3});
  auto first = optim::MakeOptimizer(dict, {a});
  for (int k = 0; k < 3; ++k) {
    a.mutable_grad() = at::ones({3});
    first->step();
  }
  // Rates 1, 0.75, 0.5 with momentum 0.9: the buffer 1, 1.9, 2.71.
  EXPECT_TRUE(at::allclose(a, at::full({3}, -(1.0 + 0.75 * 1.9 + 0.5 * 2.71))));
  auto second = optim::MakeOptimizer(dict, {b});
  optim::LoadOptimizerStateDict(*second, optim::OptimizerStateDict(*first));
  ASSERT_NE(dynamic_cast<optim::ScheduledSteps*>(second.get()), nullptr);
  EXPECT_EQ(dynamic_cast<optim::ScheduledSteps*>(second.get())->steps(), 3);
  b.copy_(a);
  a.mutable_grad() = at::ones({3});
  b.mutable_grad() = at::ones({3});
  first->step();
  second->step();  // at 0.25, as the first's fourth step
  EXPECT_TRUE(at::equal(a, b));
  // Without a schedule the optimizer is LibTorch's own, its state as before.
  auto plain = optim::MakeOptimizer(c10::IValue(optim::OptionsToDict(optim::OptimizerOptions::SGD(1.0)))
                                        .toGenericDict(), {at::zeros({1})});
  EXPECT_EQ(dynamic_cast<optim::ScheduledSteps*>(plain.get()), nullptr);
}

// AdamW decays the parameters of two or more dimensions only, bitwise as
// LibTorch's AdamW over two groups (weight_decay, and 0 for the rest), with
// and without a schedule; with decay_all, as one group. Its state dict
// still says the decay given.
TEST(AdamW, DecaysMatricesOnlyAsTwoParameterGroupsDo) {
  for (bool scheduled : {false, true}) {
    for (bool decay_all : {false, true}) {
      SCOPED_TRACE(absl::StrCat("scheduled ", scheduled, ", decay_all ", decay_all));
      auto options = optim::OptimizerOptions::AdamW(0.1).set_weight_decay(0.5).set_decay_all(decay_all);
      if (scheduled) options.set_schedule({optim::LrSchedule::Kind::kLinear, 1, 3, 0.01});
      at::manual_seed(7);
      at::Tensor w = at::randn({3, 4}), b = at::randn({4}), rw = w.clone(), rb = b.clone();
      auto ours = optim::MakeOptimizer(c10::IValue(optim::OptionsToDict(options)).toGenericDict(), {w, b});
      std::vector<torch::optim::OptimizerParamGroup> groups;
      const auto adamw = torch::optim::AdamWOptions(0.1);
      groups.emplace_back(std::vector<at::Tensor>{rw}, std::make_unique<torch::optim::AdamWOptions>(
                                                           torch::optim::AdamWOptions(adamw).weight_decay(0.5)));
      groups.emplace_back(std::vector<at::Tensor>{rb},
                          std::make_unique<torch::optim::AdamWOptions>(
                              torch::optim::AdamWOptions(adamw).weight_decay(decay_all ? 0.5 : 0.0)));
      torch::optim::AdamW reference(std::move(groups), adamw);
      for (int k = 0; k < 4; ++k) {
        const at::Tensor gw = at::randn({3, 4}), gb = at::randn({4});
        w.mutable_grad() = gw.clone();
        b.mutable_grad() = gb.clone();
        rw.mutable_grad() = gw.clone();
        rb.mutable_grad() = gb.clone();
        const double lr = scheduled ? optim::ScheduledLr(0.1, options.schedule, k) : 0.1;
        for (auto& group : reference.param_groups()) group.options().set_lr(lr);
        ours->step();
        reference.step();
        ASSERT_TRUE(at::equal(w, rw)) << "step " << k;
        ASSERT_TRUE(at::equal(b, rb)) << "step " << k;
      }
      const c10::IValue state = optim::OptimizerStateDict(*ours);
      const auto group = state.toGenericDict().at("param_groups").toList().get(0).toGenericDict();
      EXPECT_DOUBLE_EQ(group.at("weight_decay").toDouble(), 0.5);
    }
  }
}

TEST(Parity, BatchNormStageMatchesLocalTrainingAndRunningStats) {
  ParityCase c{optim::OptimizerOptions::SGD(0.05).set_momentum(0.9)};
  c.batchnorm = true;
  ExpectParity(c);
}

}  // namespace
}  // namespace remora
