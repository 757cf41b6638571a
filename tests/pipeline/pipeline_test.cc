// pipeline::Pipeline with real worker processes: pipelined training equals training the same model
// in one process on the whole batch, for every schedule, for registered and TorchScript stages;
// eval_step; bad stages and options are clear errors that name the stage and the worker.
#include "pipeline/pipeline.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/flip.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/optim/sgd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "autograd/dist_autograd.h"
#include "data/source.h"
#include "pipeline/protocol.h"
#include "shards/cnn.h"
#include "shards/mlp.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/script_models.h"
#include "tests/support/test_group.h"

namespace remora::pipeline {
namespace {

using test_support::Mlp;
using test_support::StepMessagesBetween;
using test_support::RelativeError;
using Workers = test_support::TestWorkers;

StageSpec Spec(const shards::MLPStageOptions& o) { return test_support::MlpSpec(o); }

std::vector<std::pair<at::Tensor, at::Tensor>> Data(int steps, int rows, int in, int out) {
  return test_support::RandomBatches(steps, rows, in, out);
}

TEST(Pipeline, RegisteredStagesMatchOneProcessUnderEverySchedule) {
  Workers workers;
  struct Case {
    std::string schedule;
    std::vector<shards::MLPStageOptions> stages;
  };
  const std::vector<Case> cases = {
      {"gpipe", {Mlp(8, 16, 1), Mlp(16, 4, 2, false)}},
      {"1f1b", {Mlp(8, 16, 1), Mlp(16, 4, 2, false)}},
      {"gpipe", {Mlp(8, 16, 1), Mlp(16, 12, 2), Mlp(12, 16, 3), Mlp(16, 4, 4, false)}},
      {"interleaved", {Mlp(8, 16, 1), Mlp(16, 12, 2), Mlp(12, 16, 3), Mlp(16, 4, 4, false)}},
  };
  const auto data = Data(3, 10, 8, 4);  // 10 rows in 4 micro-batches: 3, 3, 2, 2
  for (const Case& c : cases) {
    SCOPED_TRACE(c.schedule + " over " + std::to_string(c.stages.size()) + " stages");
    // The reference: the same model in this process, whole batches.
    const test_support::LocalRun local = test_support::TrainMlpLocally(c.stages, data);
    const std::vector<double>& local_losses = local.losses;

    PipelineOptions o;
    for (const auto& s : c.stages) o.stages.push_back(Spec(s));
    o.workers = {"w1", "w2"};
    o.schedule = c.schedule;
    o.micro_batches = 4;
    o.loss = MseLoss();
    o.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);
    auto pipe = Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    EXPECT_EQ((*pipe)->schedule().name, c.schedule);
    for (size_t i = 0; i < data.size(); ++i) {
      auto loss = (*pipe)->start_train_step(data[i].first, data[i].second).wait();
      ASSERT_TRUE(loss.ok()) << loss.status();
      EXPECT_NEAR(*loss, local_losses[i], 1e-5 * std::abs(local_losses[i])) << "step " << i;
    }
    for (size_t k = 0; k < local.state.size(); ++k) {
      auto state = (*pipe)->stage_state(static_cast<int>(k));
      ASSERT_TRUE(state.ok()) << state.status();
      const std::vector<at::Tensor>& want = local.state[k];
      ASSERT_EQ(state->size(), want.size());
      for (size_t j = 0; j < want.size(); ++j) {
        EXPECT_LT(RelativeError((*state)[j], want[j]), 1e-5) << "stage " << k << " tensor " << j;
      }
    }
    // Training moved the weights: the comparison is not trivially equal.
    EXPECT_GT(RelativeError(local.state[0][0],
                            shards::ModuleState(*shards::MakeMLPStage(c.stages[0]))[0]), 1e-3);
  }
  for (const char* w : {"w1", "w2"}) {
    EXPECT_EQ(workers.master().rpc_sync(w, "remora.autograd.num_contexts").value().toInt(), 0) << w;
  }
}

// A TorchScript linear layer's bytes (tests/support/script_models.h).
std::string ScriptLinearBytes(int64_t in, int64_t out, int64_t seed, bool relu,
                         const std::string& method = "forward") {
  torch::jit::Module m = test_support::ScriptLinear(in, out, seed, relu, method);
  return test_support::SaveToBytes(m);
}

TEST(Pipeline, TorchScriptStagesTrainAndMatchOneProcess) {
  Workers workers;
  const std::string s0 = ScriptLinearBytes(8, 16, 1, true), s1 = ScriptLinearBytes(16, 4, 2, false);
  std::istringstream in0(s0), in1(s1);
  torch::jit::Module l0 = torch::jit::load(in0), l1 = torch::jit::load(in1);
  std::vector<at::Tensor> params;
  for (auto* m : {&l0, &l1}) {
    for (const at::Tensor& p : m->parameters()) params.push_back(p);
  }
  for (auto& p : params) p.requires_grad_(true);
  torch::optim::SGD local_opt(params, torch::optim::SGDOptions(0.1));
  const auto data = Data(3, 8, 8, 4);
  std::vector<double> local_losses;
  for (const auto& [x, t] : data) {
    local_opt.zero_grad();
    at::Tensor y = l1.forward({l0.forward({x})}).toTensor();
    at::Tensor l = at::mse_loss(y, t);
    l.backward();
    local_opt.step();
    local_losses.push_back(l.item<double>());
  }
  for (const std::string schedule : {"gpipe", "1f1b"}) {
    SCOPED_TRACE(schedule);
    PipelineOptions o;
    o.stages = {StageSpec::TorchScript(s0, "stage0.pt"), StageSpec::TorchScript(s1, "stage1.pt")};
    o.workers = {"w1", "w2"};
    o.schedule = schedule;
    o.micro_batches = 4;
    o.loss = MseLoss();
    o.optimizer = optim::OptimizerOptions::SGD(0.1);
    auto pipe = Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    for (size_t i = 0; i < data.size(); ++i) {
      auto loss = (*pipe)->start_train_step(data[i].first, data[i].second).wait();
      ASSERT_TRUE(loss.ok()) << loss.status();
      EXPECT_NEAR(*loss, local_losses[i], 1e-5 * std::abs(local_losses[i])) << "step " << i;
    }
    auto w0 = (*pipe)->stage_state(0).value(), w1 = (*pipe)->stage_state(1).value();
    EXPECT_LT(RelativeError(w0[0], params[0]), 1e-5);
    EXPECT_LT(RelativeError(w1[0], params[2]), 1e-5);
    // eval_step: forward only, the trained model's outputs, no context left.
    auto out = (*pipe)->eval_step(data[0].first);
    ASSERT_TRUE(out.ok()) << out.status();
    at::Tensor want = l1.forward({l0.forward({data[0].first})}).toTensor();
    EXPECT_LT(RelativeError(out->toTensor(), want), 1e-5);
    EXPECT_FALSE(out->toTensor().requires_grad());
  }
  for (const char* w : {"w1", "w2"}) {
    EXPECT_EQ(workers.master().rpc_sync(w, "remora.autograd.num_contexts").value().toInt(), 0) << w;
  }
}

// A first stage without parameters (a flatten, a scale) sends no gradient
// back: its backward actions never come, and the workers' orders must not
// wait for them (they did: stage 2's forward passes waited forever).
TEST(Pipeline, AFirstStageWithoutParametersDoesNotStallTheSchedule) {
  Workers workers;
  torch::jit::Module scale("Scale");
  scale.define("def forward(self, x):\n  return x * 2.0\n");
  const std::string first = test_support::SaveToBytes(scale);
  const auto data = Data(2, 8, 8, 4);
  for (const std::string schedule : {"1f1b", "interleaved"}) {
    SCOPED_TRACE(schedule);
    PipelineOptions o;
    o.stages = {StageSpec::TorchScript(first, "scale.pt"),
                StageSpec::TorchScript(ScriptLinearBytes(8, 16, 1, true), "l1.pt")};
    if (schedule == "interleaved") {
      o.stages.push_back(StageSpec::TorchScript(ScriptLinearBytes(16, 16, 2, true), "l2.pt"));
      o.stages.push_back(StageSpec::TorchScript(ScriptLinearBytes(16, 4, 3, false), "l3.pt"));
    } else {
      o.stages[1] = StageSpec::TorchScript(ScriptLinearBytes(8, 4, 1, false), "l1.pt");
    }
    o.workers = {"w1", "w2"};
    o.schedule = schedule;
    o.micro_batches = 4;
    o.loss = MseLoss();
    auto pipe = Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    for (const auto& [x, t] : data) {
      auto loss = (*pipe)->start_train_step(x, t).wait();
      ASSERT_TRUE(loss.ok()) << loss.status();
      EXPECT_TRUE(std::isfinite(*loss));
    }
  }
}

// 1F1B holds at most (stages - s) micro-batches' saved activations on stage
// s; GPipe holds all of them. Measured by the workers' allocators (bytes a
// forward pass allocated that are still alive): stage 0 at M = 8, S = 2
// holds 2 by the schedule plus outputs still held in flight (a push not yet
// acknowledged; CI saw two once): at most half of GPipe's; the last stage
// pushes nothing: at most 3/8. Here a stage keeps only its ReLU output.
TEST(Pipeline, OneFOneBBoundsSavedActivationsAndGPipeDoesNot) {
  Workers workers;
  std::map<std::string, std::vector<int64_t>> peaks;
  for (const std::string schedule : {"gpipe", "1f1b"}) {
    PipelineOptions o;
    o.stages = {Spec(Mlp(64, 1024, 1)), Spec(Mlp(1024, 8, 2, false))};
    o.workers = {"w1", "w2"};
    o.schedule = schedule;
    o.micro_batches = 8;
    o.loss = MseLoss();
    auto pipe = Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE((*pipe)->start_train_step(at::randn({512, 64}), at::randn({512, 8})).wait().ok());
    }
    auto p = (*pipe)->peak_activation_bytes();
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_EQ(p->size(), 2u);
    peaks[schedule] = *p;
  }
  // Stage 0's forward keeps its ReLU output (64 rows x 1024 floats, 256 KiB)
  // per micro-batch.
  EXPECT_GE(peaks["gpipe"][0], 8 * 64 * 1024 * 4) << "GPipe holds all 8 micro-batches";
  EXPECT_LE(peaks["1f1b"][0], peaks["gpipe"][0] / 2 + 4096)
      << "1f1b " << peaks["1f1b"][0] << " bytes against gpipe " << peaks["gpipe"][0];
  EXPECT_LE(peaks["1f1b"][1], peaks["gpipe"][1] * 3 / 8 + 4096)
      << "1f1b " << peaks["1f1b"][1] << " bytes against gpipe " << peaks["gpipe"][1];
}

// The step protocol (pipeline/runner.h): per batch, one call from the
// master to each of the W workers, and per stage boundary and micro-batch
// one push of the activation forward and one of its gradient back: W +
// 2M(S-1) requests in all processes together, nothing else (no schedule,
// no RRef forks or deletes, no optimizer or release round).
// With the batch read on stage 0's worker (pipeline/worker_data.h), a step
// trains exactly as with the batch sent by the master, and sends one
// message more: the labels, from stage 0's worker to the last stage's.
TEST(Pipeline, RowsReadOnStageZerosWorkerTrainAsBatchesSentByTheMaster) {
  Workers workers;
  const std::string dir = TempPath("worker_rows_idx");
  test_support::WriteToyIdx(dir, 64, 10);
  data::SourceSpec spec;
  spec.dataset = "idx:" + dir;
  auto here = data::OpenSource(spec);
  ASSERT_TRUE(here.ok()) << here.status();
  struct Case {
    int stages, m;
    std::string schedule;
  };
  for (const Case& c : {Case{2, 2, "1f1b"}, Case{4, 4, "interleaved"}}) {
    SCOPED_TRACE(absl::StrCat(c.stages, " stages, ", c.m, " micro-batches"));
    PipelineOptions o;
    for (int k = 0; k < c.stages; ++k) {
      const int64_t first = shards::kSmallCnnBlocks * k / c.stages;
      const int64_t last = shards::kSmallCnnBlocks * (k + 1) / c.stages;
      o.stages.push_back(StageSpec::Registered("SmallCnn", {first, last, int64_t{3}}));
    }
    o.workers = {"w1", "w2"};
    o.schedule = c.schedule;
    o.micro_batches = c.m;
    o.loss = CrossEntropyLoss();
    auto sent = Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(sent.ok()) << sent.status();
    auto read = Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(read.ok()) << read.status();
    auto data = WorkerData::Open(workers.master(), {"w1"}, spec, (*here)->size());
    ASSERT_TRUE(data.ok()) << data.status();
    constexpr int kSteps = 3;
    auto rows_of = [](int step) { return at::arange(step * 16, step * 16 + 16, at::kLong).flip(0); };
    std::vector<double> want;
    for (int step = 0; step <= kSteps; ++step) {
      auto batch = (*here)->Get(rows_of(step), 1);
      ASSERT_TRUE(batch.ok()) << batch.status();
      auto loss = (*sent)->start_train_step(batch->images, batch->labels).wait();
      ASSERT_TRUE(loss.ok()) << loss.status();
      want.push_back(*loss);
    }
    std::map<std::string, int64_t> before;
    for (int step = 0; step <= kSteps; ++step) {
      if (step == 1) before = *(*read)->sent_messages();
      auto got = (*read)->start_train_step((*data)->Rows(rows_of(step), 1)).wait();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_NEAR(*got, want[step], 1e-5 * std::abs(want[step])) << "step " << step;
    }
    std::map<std::string, int64_t> d = StepMessagesBetween(before, *(*read)->sent_messages());
    int64_t total = 0;
    for (const auto& [kind, n] : d) total += n;
    const int64_t boundaries = c.m * (c.stages - 1);
    EXPECT_EQ(total, kSteps * (2 + 2 * boundaries + 1)) << ::testing::PrintToString(d);
    EXPECT_EQ(d["function 'remora.pipeline.targets'"], kSteps);
    EXPECT_EQ(d["function 'remora.pipeline.push'"], kSteps * boundaries);
    // Evaluation too: the same count of right answers, and the rows read.
    const at::Tensor all = at::arange(64, at::kLong);
    auto batch = (*here)->Get(all, 0);
    ASSERT_TRUE(batch.ok()) << batch.status();
    auto right = (*sent)->eval_correct(batch->images, batch->labels);
    ASSERT_TRUE(right.ok()) << right.status();
    auto counted = (*read)->eval_correct((*data)->Rows(all, 0));
    ASSERT_TRUE(counted.ok()) << counted.status();
    EXPECT_EQ(counted->top1, right->top1);
    EXPECT_EQ(counted->top5, right->top5);
    EXPECT_EQ(counted->rows, 64);
  }
  auto other = WorkerData::Open(workers.master(), {"w1"}, spec, 65);  // a worker that finds another set
  ASSERT_FALSE(other.ok());
  EXPECT_THAT(std::string(other.status().message()), testing::HasSubstr("worker 'w1' finds 64 rows"));
  PipelineOptions o;
  o.stages = {StageSpec::Registered("SmallCnn", {int64_t{0}, int64_t{2}, int64_t{3}}),
              StageSpec::Registered("SmallCnn", {int64_t{2}, int64_t{4}, int64_t{3}})};
  o.workers = {"w1", "w2"};
  o.micro_batches = 1;
  o.loss = CrossEntropyLoss();
  auto pipe = Pipeline::Create(workers.master(), o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  auto lost = (*pipe)->start_train_step(WorkerRows{999, at::arange(4, at::kLong), 1}).wait();  // never opened
  ASSERT_FALSE(lost.ok());
  EXPECT_THAT(std::string(lost.status().message()), testing::HasSubstr("worker 'w1' has no data source 999"));
}

// The master-centred protocol (an unnamed loss, computed on the master)
// sends more: its count is printed for docs/measurements.md.
TEST(Pipeline, AnUnnamedLossKeepsTheMasterCentredProtocol) {
  Workers workers;
  PipelineOptions o;
  o.stages = {Spec(Mlp(8, 16, 1)), Spec(Mlp(16, 4, 2, false))};
  o.workers = {"w1", "w2"};
  o.schedule = "1f1b";
  o.micro_batches = 8;
  o.loss = [](const c10::IValue& out, const c10::IValue& t) {
    return at::mse_loss(out.toTensor(), t.toTensor());
  };
  auto pipe = Pipeline::Create(workers.master(), o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  EXPECT_FALSE((*pipe)->runs_on_workers());
  const auto data = Data(3, 16, 8, 4);
  ASSERT_TRUE((*pipe)->start_train_step(data[0].first, data[0].second).wait().ok());
  auto before = (*pipe)->sent_messages();
  ASSERT_TRUE(before.ok()) << before.status();
  for (int i = 1; i < 3; ++i) ASSERT_TRUE((*pipe)->start_train_step(data[i].first, data[i].second).wait().ok());
  auto after = (*pipe)->sent_messages();
  ASSERT_TRUE(after.ok()) << after.status();
  int64_t total = 0;
  std::string listing;
  for (const auto& [kind, d] : StepMessagesBetween(*before, *after)) {
    total += d;
    absl::StrAppend(&listing, "  ", kind, ": ", d / 2.0, "\n");
  }
  std::cout << "master-centred protocol, S=2 M=8 W=2: " << total / 2.0 << " requests per batch\n"
            << listing;
  EXPECT_GT(total / 2, 2 + 2 * 8) << listing;
}

PipelineOptions TwoStages(StageSpec a, StageSpec b) {
  PipelineOptions o;
  o.stages = {std::move(a), std::move(b)};
  o.workers = {"w1", "w2"};
  o.micro_batches = 2;
  o.loss = MseLoss();
  return o;
}

// eval_correct: the labels go to the last stage's worker, which counts the rows its outputs get right
// and replies with the counts alone, the ones the outputs give here. An output that is not
// [rows, classes] is an error naming the stage and the worker.
TEST(Pipeline, EvalCorrectCountsOnTheLastStagesWorker) {
  Workers workers;
  PipelineOptions o;
  o.stages = {Spec(Mlp(8, 16, 1)), Spec(Mlp(16, 12, 2)), Spec(Mlp(12, 16, 3)), Spec(Mlp(16, 4, 4, false))};
  o.workers = {"w1", "w2"};
  o.schedule = "interleaved";
  o.micro_batches = 4;
  o.loss = MseLoss();
  o.optimizer = optim::OptimizerOptions::SGD(0.05);
  auto pipe = Pipeline::Create(workers.master(), o);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  ASSERT_TRUE((*pipe)->runs_on_workers());
  const at::Tensor x = at::randn({10, 8});
  auto out = (*pipe)->eval_step(x);
  ASSERT_TRUE(out.ok()) << out.status();
  // The outputs' own classes, 3 rows of them changed: 7 right.
  at::Tensor labels = out->toTensor().argmax(1);
  for (int64_t i : {0, 4, 9}) labels[i] = (labels[i].item<int64_t>() + 1) % 4;
  auto before = (*pipe)->sent_messages();
  auto right = (*pipe)->eval_correct(x, labels);
  ASSERT_TRUE(right.ok()) << right.status();
  EXPECT_EQ(right->top1, 7);
  EXPECT_EQ(right->top5, 10);  // 4 classes: every label is among the first five
  auto after = (*pipe)->sent_messages();
  ASSERT_TRUE(before.ok() && after.ok());
  // One call per worker and one push per boundary per micro-batch.
  int64_t sent = 0;
  for (const auto& [kind, n] : StepMessagesBetween(*before, *after)) sent += n;
  EXPECT_EQ(sent, 2 + 3 * 4);
  ExpectError((*pipe)->eval_correct(x, labels.slice(0, 0, 5)).status(), {"10 inputs", "5 labels"});

  torch::jit::Module sum("Sum");
  sum.define("def forward(self, x):\n  return x.sum(1)\n");
  PipelineOptions flat = o;
  flat.stages = {StageSpec::TorchScript(ScriptLinearBytes(8, 4, 1, false), "l.pt"),
                 StageSpec::TorchScript(test_support::SaveToBytes(sum), "sum.pt")};
  flat.schedule = "1f1b";
  auto bad = Pipeline::Create(workers.master(), flat);
  ASSERT_TRUE(bad.ok()) << bad.status();
  ExpectError((*bad)->eval_correct(x, labels).status(),  // (any micro-batch may be counted first)
              {"stage 1", "w2", "micro-batch ", "the model's output for ", "rows is [", "needs [", ", classes]"});
}

// Steps started before the last one is waited for (start_train_step, as
// Fit does), and even calls that reach the workers in reverse order, train
// exactly as steps run one by one: each worker starts a batch only once the
// batch started before it has ended there.
TEST(Pipeline, StepsStartedAheadTrainAsStepsRunOneByOne) {
  Workers workers;
  const std::vector<shards::MLPStageOptions> stages = {Mlp(8, 16, 1), Mlp(16, 12, 2), Mlp(12, 16, 3),
                                                       Mlp(16, 4, 4, false)};
  const auto data = Data(4, 12, 8, 4);
  const test_support::LocalRun local = test_support::TrainMlpLocally(stages, data);
  PipelineOptions o;
  for (const auto& s : stages) o.stages.push_back(Spec(s));
  o.workers = {"w1", "w2"};
  o.schedule = "interleaved";
  o.micro_batches = 4;
  o.loss = MseLoss();
  o.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);
  auto expect_local = [&](Pipeline& pipe, const std::vector<double>& losses) {
    ASSERT_EQ(losses.size(), local.losses.size());
    for (size_t i = 0; i < losses.size(); ++i) {
      EXPECT_NEAR(losses[i], local.losses[i], 1e-5 * std::abs(local.losses[i])) << "step " << i;
    }
    for (size_t k = 0; k < local.state.size(); ++k) {
      auto state = pipe.stage_state(static_cast<int>(k));
      ASSERT_TRUE(state.ok()) << state.status();
      for (size_t j = 0; j < state->size(); ++j) {
        EXPECT_LT(RelativeError((*state)[j], local.state[k][j]), 1e-5) << "stage " << k << " tensor " << j;
      }
    }
  };
  {
    SCOPED_TRACE("all four started, then waited for");
    auto pipe = Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    std::vector<StartedStep> started;
    for (const auto& [x, t] : data) started.push_back((*pipe)->start_train_step(x, t));
    std::vector<double> losses;
    for (StartedStep& s : started) {
      auto loss = s.wait();
      ASSERT_TRUE(loss.ok()) << loss.status();
      losses.push_back(*loss);
    }
    expect_local(**pipe, losses);
  }
  {
    SCOPED_TRACE("the second batch's calls sent before the first's");
    auto pipe = Pipeline::Create(workers.master(), o);
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    rpc::Agent& master = workers.master();
    const int64_t first = autograd::NewContextId(master).value();
    const int64_t second = autograd::NewContextId(master).value();
    // As StartStep sends it.
    auto run = [&](const std::string& w, int64_t context, int64_t after, int i) {
      pipeline::RunRequest r;
      r.runner = (*pipe)->runner_id();
      r.context = context;
      r.after = after;
      if (w == "w1") r.inputs = data[i].first;
      if (w == "w2") r.targets = data[i].second;
      r.total_rows = 12;
      return master.rpc_async(w, pipeline::RunRequest::kFunction, rpc::EncodeCall(r));
    };
    std::vector<rpc::Future<c10::IValue>> later = {run("w1", second, first, 1), run("w2", second, first, 1)};
    absl::SleepFor(absl::Milliseconds(300));
    EXPECT_FALSE(later[0].ready() || later[1].ready()) << "the second batch ran before the first came";
    std::vector<rpc::Future<c10::IValue>> earlier = {run("w1", first, -1, 0), run("w2", first, -1, 0)};
    std::vector<double> losses;
    for (auto* replies : {&earlier, &later}) {
      for (auto& r : *replies) ASSERT_TRUE(r.wait().ok()) << r.wait().status();
      losses.push_back((*replies)[1].wait()->toDouble());
    }
    // The pipeline's own steps follow them.
    for (int i = 2; i < 4; ++i) {
      auto loss = (*pipe)->start_train_step(data[i].first, data[i].second).wait();
      ASSERT_TRUE(loss.ok()) << loss.status();
      losses.push_back(*loss);
    }
    expect_local(**pipe, losses);
  }
  for (const char* w : {"w1", "w2"}) {
    EXPECT_EQ(workers.master().rpc_sync(w, "remora.autograd.num_contexts").value().toInt(), 0) << w;
  }
}

TEST(Pipeline, BadStagesAreClearErrorsNamingTheStageAndTheWorker) {
  Workers workers;
  rpc::Agent& master = workers.master();
  const StageSpec good = Spec(Mlp(8, 16, 1));
  ExpectError(Pipeline::Create(master, TwoStages(good, StageSpec::TorchScript("not a zip", "bad.pt")))
                  .status(),
              {"stage 1", "w2", "bad.pt", "TorchScript"});
  ExpectError(Pipeline::Create(master, TwoStages(good, StageSpec::TorchScript(
                                                           ScriptLinearBytes(16, 4, 2, false, "run"),
                                                           "run_only.pt")))
                  .status(),
              {"stage 1", "w2", "no forward method"});
  ExpectError(Pipeline::Create(master, TwoStages(good, StageSpec::Registered("Nope"))).status(),
              {"stage 1", "w2", "no stage type 'Nope'", "MLPStage"});
  // Shapes that do not fit: stage 0 gives 16 features, stage 1 takes 8.
  auto pipe = Pipeline::Create(master, TwoStages(good, Spec(Mlp(8, 4, 2, false))));
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  ExpectError((*pipe)->start_train_step(at::randn({4, 8}), at::randn({4, 4})).wait().status(),
              {"stage 1", "w2", "forward of micro-batch", " given a Float tensor of shape [2, 16]: "});
  ExpectError((*pipe)->start_train_step(at::randn({1, 8}), at::randn({1, 4})).wait().status(),
              {"1 rows cannot be split into 2"});
  // A batch norm given a micro-batch of one row: LibTorch's error, and
  // what made the row alone.
  shards::MLPStageOptions normed = Mlp(16, 4, 2, false);
  normed.batchnorm = true;
  auto one_row = Pipeline::Create(master, TwoStages(good, Spec(normed)));
  ASSERT_TRUE(one_row.ok()) << one_row.status();
  ExpectError((*one_row)->start_train_step(at::randn({3, 8}), at::randn({3, 4})).wait().status(),
              {"stage 1", "w2", "Expected more than 1 value per channel", "a micro-batch of one row reached a batch "
               "norm", "--skip-bad-images"});
  // The workers keep serving: a good pipeline trains on them.
  auto fine = Pipeline::Create(master, TwoStages(good, Spec(Mlp(16, 4, 2, false))));
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_TRUE((*fine)->start_train_step(at::randn({4, 8}), at::randn({4, 4})).wait().ok());
}

TEST(Pipeline, BadOptionsAreClearErrors) {
  Workers workers;
  rpc::Agent& master = workers.master();
  const StageSpec a = Spec(Mlp(8, 8, 1));
  PipelineOptions three = TwoStages(a, a);
  three.stages.push_back(a);
  ExpectError(Pipeline::Create(master, three).status(), {"3 stages", "2 workers"});
  PipelineOptions alone = TwoStages(a, a);
  alone.workers = {"w1"};
  ExpectError(Pipeline::Create(master, alone).status(), {"2 stages on 1 worker", "give 2 or more workers"});
  PipelineOptions four = TwoStages(a, a);
  four.stages.insert(four.stages.end(), {a, a});
  four.schedule = "1f1b";
  ExpectError(Pipeline::Create(master, four).status(), {"1f1b", "interleaved"});
  PipelineOptions no_loss = TwoStages(a, a);
  no_loss.loss = nullptr;
  ExpectError(Pipeline::Create(master, no_loss).status(), {"loss"});
  PipelineOptions unknown = TwoStages(a, a);
  unknown.schedule = "zigzag";
  ExpectError(Pipeline::Create(master, unknown).status(), {"unknown schedule 'zigzag'"});
  ExpectError(StageSpec::TorchScriptFile("/nonexistent/stage0.pt").status(), {"/nonexistent/stage0.pt"});
  ExpectError(TorchScriptStages("/").status(), {"stage0.pt"});
  // A gap in the stage files' numbers is an error, not a shorter model.
  const std::string dir = TempPath("gapped_stages");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (const char* name : {"stage0.pt", "stage1.pt", "stage3.pt"}) {
    test_support::ScriptLinear(4, 4, 1, true).save(dir + "/" + name);
  }
  std::ofstream(dir + "/stage2.pt.bak") << "an old copy";
  ExpectError(TorchScriptStages(dir).status(),
              {"holds stage3.pt but no stage2.pt", "numbered from 0 without gaps (stage0.pt to stage1.pt"});
  std::filesystem::rename(dir + "/stage3.pt", dir + "/stage2.pt");
  auto renumbered = TorchScriptStages(dir);
  ASSERT_TRUE(renumbered.ok()) << renumbered.status();
  EXPECT_EQ(renumbered->size(), 3u);
}

}  // namespace
}  // namespace remora::pipeline
