// train::Fit (train/fit.h) on the one-process trainer (train/
// local_trainer.h), without workers: the checkpoint cadence, a resume that
// goes on bitwise like a run that never stopped, and the errors. The
// pipeline and parameter-server trainers run the same loop in the master's
// tests (tests/checkpoint, tests/ps, tests/data/imagefolder_master_test.cc).
#include "train/fit.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>

#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/full.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include "absl/strings/str_cat.h"
#include "base/json.h"
#include "data/source.h"
#include "tests/support/test_group.h"
#include "train/local_trainer.h"
#include "train/report.h"

namespace remora::train {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// A small classifier of 8 features into 3 classes, seeded by its argument
// (which seeds this process's generator: dropout draws from it).
void RegisterTinyMlp() {
  static const absl::Status registered = pipeline::RegisterStageModule<torch::nn::SequentialImpl>(
      "TrainTestMlp", [](const std::vector<c10::IValue>& a, c10::Device) {
        torch::manual_seed(a.at(0).toInt());
        return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Dropout(0.25),
                                     torch::nn::Linear(16, 3))
            .ptr();
      });
  ASSERT_TRUE(registered.ok()) << registered;
}

std::unique_ptr<LocalTrainer> Tiny(int seed = 1) {
  RegisterTinyMlp();
  LocalOptions o;
  o.stages = {pipeline::StageSpec::Registered("TrainTestMlp", {int64_t{seed}})};
  o.loss = pipeline::LossFn::Named("cross_entropy");
  o.optimizer = optim::OptimizerOptions::SGD(0.1).set_momentum(0.9);
  o.micro_batches = 2;
  auto t = LocalTrainer::Create(std::move(o));
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

data::Dataset Rows(int64_t n, int seed) {
  torch::manual_seed(seed);
  return {at::randn({n, 8}), at::randint(0, 3, {n}, at::kLong)};
}

checkpoint::RunIdentity Identity(const std::string& model = "tiny mlp") {
  checkpoint::RunIdentity id;
  id.model = model;
  id.data = "random 96 rows batch-size=16";
  id.optimizer = "sgd lr=0.1 momentum=0.9";
  return id;
}

// 2 epochs of 6 batches; every step's loss by its number.
// Every step's loss by its number.
class LossesByStep final : public FitObserver {
 public:
  std::map<int64_t, double> by_step;
  absl::Status AfterStep(const StepRecord& r) override {
    by_step[r.step] = r.loss;
    return absl::OkStatus();
  }
};

TrainOptions Options(const std::string& dir, LossesByStep* losses) {
  TrainOptions o;
  o.fit.epochs = 2;
  o.fit.batch_size = 16;
  o.fit.seed = 7;
  o.fit.min_batch_rows = 2;
  o.observers = {losses};
  o.checkpoints = SaveTarget{dir, 10, Identity()};
  o.checkpoint_every = 4;
  return o;
}

TEST(TrainFit, SavesEveryNStepsAndAtTheEnd) {
  const data::Dataset train = Rows(96, 1), test = Rows(32, 2);
  const std::string dir = TempPath("train_fit_cadence");
  std::filesystem::remove_all(dir);
  LossesByStep losses;
  std::ostringstream out;
  auto trainer = Tiny();
  ASSERT_NE(trainer, nullptr);
  auto epochs = Fit(*trainer, data::InMemory(train), data::InMemory(test), Options(dir, &losses), out);
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  ASSERT_EQ(epochs->size(), 2u);
  EXPECT_EQ(losses.by_step.size(), 12u);
  EXPECT_THAT(checkpoint::CompleteSteps(dir), ElementsAre(4, 8, 12));
  EXPECT_THAT(out.str(), HasSubstr("checkpoint: step 8 in "));
  EXPECT_THAT(out.str(), HasSubstr(", final)"));
  auto last = checkpoint::Latest(dir);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_TRUE(last->manifest.final);
  EXPECT_EQ(last->state().epoch, 2);

  // Resumed from that final checkpoint: nothing to train, and no line
  // says a checkpoint was saved (none is).
  std::ostringstream again_out;
  TrainOptions again = Options(dir, &losses);
  again.resume = *last;
  auto resumed = Tiny();
  ASSERT_NE(resumed, nullptr);
  auto none = Fit(*resumed, data::InMemory(train), data::InMemory(test), again, again_out);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
  EXPECT_THAT(again_out.str(), HasSubstr("nothing left to train"));
  EXPECT_THAT(again_out.str(), Not(HasSubstr("checkpoint: step"))) << again_out.str();
}

// A run resumed from its step-8 checkpoint (epoch 2, after batch 2) trains
// steps 9-12 with the losses of the run that never stopped, and ends with
// the same parameters.
TEST(TrainFit, AResumeGoesOnBitwiseLikeTheRunThatNeverStopped) {
  const data::Dataset train = Rows(96, 1), test = Rows(32, 2);
  const std::string dir = TempPath("train_fit_resume");
  std::filesystem::remove_all(dir);
  LossesByStep whole, resumed;
  std::ostringstream out;
  auto first = Tiny();
  ASSERT_NE(first, nullptr);
  auto whole_epochs = Fit(*first, data::InMemory(train), data::InMemory(test), Options(dir, &whole), out);
  ASSERT_TRUE(whole_epochs.ok()) << whole_epochs.status();

  auto ck = checkpoint::Latest(absl::StrCat(dir, "/step-00000008"));
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(ck->state().epoch, 2);
  EXPECT_EQ(ck->state().batch, 2);
  auto second = Tiny(/*seed=*/99);  // other initial weights: the checkpoint's must win
  ASSERT_NE(second, nullptr);
  TrainOptions o = Options(TempPath("train_fit_resume_again"), &resumed);
  o.resume = *ck;
  auto epochs = Fit(*second, data::InMemory(train), data::InMemory(test), o, out);
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  EXPECT_THAT(out.str(), HasSubstr("resumed from " + ck->dir + ": step 8, epoch 2 after batch 2"));
  ASSERT_EQ(resumed.by_step.size(), 4u);
  for (const auto& [step, loss] : resumed.by_step) {
    ASSERT_TRUE(whole.by_step.count(step)) << step;
    EXPECT_EQ(loss, whole.by_step[step]) << "step " << step;
  }
  const at::Tensor probe = Rows(5, 3).images;
  auto a = first->Eval(probe), b = second->Eval(probe);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(a->equal(*b));
  ASSERT_EQ(epochs->size(), 1u) << "only epoch 2 is left to run";
  EXPECT_EQ(epochs->back().test_accuracy, whole_epochs->back().test_accuracy);
  EXPECT_EQ(epochs->back().train_loss, whole_epochs->back().train_loss) << "epoch 2's mean, batches 1-2 included";
}

TEST(TrainFit, ACheckpointOfAnotherRunIsRefusedNamingWhatDiffers) {
  const data::Dataset train = Rows(96, 1), test = Rows(32, 2);
  const std::string dir = TempPath("train_fit_other");
  std::filesystem::remove_all(dir);
  LossesByStep losses;
  std::ostringstream out;
  auto trainer = Tiny();
  ASSERT_NE(trainer, nullptr);
  TrainOptions o = Options(dir, &losses);
  o.fit.epochs = 1;
  ASSERT_TRUE(Fit(*trainer, data::InMemory(train), data::InMemory(test), o, out).ok());
  auto ck = checkpoint::Latest(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();

  o.checkpoints.identity = Identity("another model");
  o.resume = *ck;
  losses.by_step.clear();
  auto r = Fit(*trainer, data::InMemory(train), data::InMemory(test), o, out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("another model"));
  EXPECT_TRUE(losses.by_step.empty()) << "no step may run before the checkpoint is refused";
}

TEST(TrainFit, ACheckpointDirectoryThatCannotBeMadeFailsBeforeAnyStep) {
  const data::Dataset train = Rows(32, 1), test = Rows(8, 2);
  const std::string file = TempPath("train_fit_a_file");
  std::ofstream(file) << "not a directory";
  LossesByStep losses;
  std::ostringstream out;
  auto trainer = Tiny();
  ASSERT_NE(trainer, nullptr);
  auto r = Fit(*trainer, data::InMemory(train), data::InMemory(test), Options(file + "/ckpt", &losses), out);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("cannot make the checkpoint directory"));
  EXPECT_TRUE(losses.by_step.empty());
}

TEST(LocalTrainer, BadOptionsAreClearErrors) {
  LocalOptions o;
  auto none = LocalTrainer::Create(o);
  EXPECT_THAT(none.status().message(), HasSubstr("no stages"));
  RegisterTinyMlp();
  o.stages = {pipeline::StageSpec::Registered("NoSuchStage", {})};
  o.loss = pipeline::LossFn::Named("cross_entropy");
  auto unknown = LocalTrainer::Create(o);
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(unknown.status().message(), HasSubstr("NoSuchStage"));
  o.stages = {pipeline::StageSpec::Registered("TrainTestMlp", {int64_t{1}})};
  o.micro_batches = 0;
  EXPECT_THAT(LocalTrainer::Create(o).status().message(), HasSubstr("micro_batches is 0"));
}

// A step that fails says where, as the pipeline says it: the stage and
// micro-batch whose forward pass threw, or the loss with the shapes it got.
TEST(LocalTrainer, AFailedStepNamesTheStageOrTheLossAndItsShapes) {
  auto trainer = Tiny();
  ASSERT_NE(trainer, nullptr);
  auto wrong_width = trainer->StartStep({at::randn({4, 5}), at::randint(0, 3, {4}, at::kLong)}).wait();
  ASSERT_FALSE(wrong_width.ok());
  EXPECT_THAT(wrong_width.status().message(), HasSubstr("local training, stage 0, micro-batch 0: "));
  auto wrong_class = trainer->StartStep({at::randn({4, 8}), at::full({4}, 7, at::kLong)}).wait();
  ASSERT_FALSE(wrong_class.ok());
  EXPECT_THAT(wrong_class.status().message(),
              HasSubstr("local training, micro-batch 0: the loss 'cross_entropy' of an output of [2, 3] against "
                        "targets of [2]: "));
}

// The master's waits for its batches go in the report beside the batch
// times, with their median after the first; a run without them (one
// process) has neither key.
TEST(Report, DataWaitsAreWrittenWithTheirSteadyMedian) {
  RunRecord piped(2), local(1);
  piped.batch_seconds = {1.0, 0.5, 0.4, 0.6};
  piped.data_wait_seconds = {0.9, 0.25, 0.0, 0.1};
  local.batch_seconds = {0.3, 0.2};
  EXPECT_DOUBLE_EQ(piped.steady_data_wait_seconds(), 0.1);
  EXPECT_DOUBLE_EQ(local.steady_data_wait_seconds(), 0);
  const std::string path = testing::TempDir() + "/data_wait_report.json";
  ASSERT_TRUE(WriteReport(path, "pipeline", {piped, local}).ok());
  std::ifstream in(path);
  std::stringstream json;
  json << in.rdbuf();
  EXPECT_THAT(json.str(), HasSubstr("\"steady_data_wait_seconds\": 0.100000, \"data_wait_seconds\": [0.900000, "
                                    "0.250000, 0.000000, 0.100000]"));
  int keys = 0;
  for (size_t at = json.str().find("data_wait"); at != std::string::npos; at = json.str().find("data_wait", at + 1)) {
    ++keys;
  }
  EXPECT_EQ(keys, 2);  // the pipeline run's two; the local run has none
}

// JSON written by hand (the report, the evaluator's lines) stays JSON: a
// number that is not finite is null, a string's quotes, backslashes and
// control characters are escaped.
TEST(Report, NumbersThatAreNotFiniteAreNullAndStringsAreEscaped) {
  EXPECT_EQ(base::JsonFixed(3, 0.5), "0.500");
  EXPECT_EQ(base::JsonFixed(6, std::nan("")), "null");
  EXPECT_EQ(base::JsonFixed(6, -std::numeric_limits<double>::infinity()), "null");
  EXPECT_EQ(base::JsonGeneral(0.25), "0.25");
  EXPECT_EQ(base::JsonGeneral(std::numeric_limits<double>::infinity()), "null");
  EXPECT_EQ(base::JsonQuoted("ckpt/step-00000012"), "\"ckpt/step-00000012\"");
  EXPECT_EQ(base::JsonQuoted("a\"b\\c\nd\x01"), "\"a\\\"b\\\\c\\nd\\u0001\"");
}

// The evaluator reads its own lines back: each key's value as written; a
// key's name inside a string is not a key.
TEST(Report, AWrittenLinesValuesReadBack) {
  const std::string line = absl::StrCat("{\"step\": 12, \"test_loss\": ", base::JsonFixed(6, std::nan("")),
                                        ", \"checkpoint\": ", base::JsonQuoted("a\", \"step\": 3, \"x\\"),
                                        ", \"test_accuracy\": 0.812500, \"final\": true}");
  EXPECT_EQ(base::JsonValueText(line, "step"), "12");
  EXPECT_EQ(base::JsonValueText(line, "checkpoint"), base::JsonQuoted("a\", \"step\": 3, \"x\\"));
  EXPECT_EQ(base::JsonValueText(line, "final"), "true");
  EXPECT_EQ(base::JsonValueText(line, "x"), "");
  EXPECT_EQ(base::JsonValueText(line, "created"), "");
  EXPECT_EQ(base::JsonNumber(line, "test_accuracy"), 0.8125);
  EXPECT_TRUE(std::isnan(base::JsonNumber(line, "test_loss")));
  EXPECT_TRUE(std::isnan(base::JsonNumber(line, "final")));
  EXPECT_TRUE(std::isnan(base::JsonNumber(line, "created")));
  EXPECT_EQ(base::JsonValueText("{\"cut\": \"no end", "cut"), "");
}

}  // namespace
}  // namespace remora::train
