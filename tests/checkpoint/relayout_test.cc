// A checkpoint moved to another layout (checkpoint::Relayout): saved from
// two stages over two workers, it goes on as four stages over two, then as
// one stage on one worker, each continuing bitwise as an uninterrupted run
// of that cut from the same state (Adam's moments and its schedule's step
// count included); a cut of another model, or one that leaves part of the
// model out, is an error naming the tensors.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ops/equal.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint/checkpoint.h"
#include "checkpoint/manifest.h"
#include "pipeline/partition.h"
#include "tests/support/master_runs.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/script_models.h"

namespace remora::checkpoint {
namespace {

using ::testing::HasSubstr;
using test_support::AllStageState;
using test_support::FreshDir;

constexpr int kLayers = 5;

// The one-file model: five linear layers (l0 ... l4), cut at `bounds`.
std::vector<pipeline::StageSpec> Cut(const pipeline::SequentialModel& model, const std::vector<int>& bounds) {
  std::vector<pipeline::StageSpec> stages;
  for (size_t k = 0; k + 1 < bounds.size(); ++k) stages.push_back(model.Stage(bounds[k], bounds[k + 1]).value());
  return stages;
}

std::unique_ptr<pipeline::Pipeline> PipelineOn(rpc::Agent& master, const std::vector<pipeline::StageSpec>& stages,
                                                 std::vector<std::string> workers) {
  pipeline::PipelineOptions o;
  o.stages = stages;
  o.workers = std::move(workers);
  o.schedule = stages.size() > o.workers.size() ? "interleaved" : "1f1b";
  o.micro_batches = 2;
  o.loss = pipeline::MseLoss();
  o.optimizer = optim::OptimizerOptions::Adam(0.01).set_schedule({optim::LrSchedule::Kind::kCosine, 2, 10, 0.001});
  auto pipe = pipeline::Pipeline::Create(master, o);
  EXPECT_TRUE(pipe.ok()) << pipe.status();
  return pipe.ok() ? std::move(*pipe) : nullptr;
}

void ExpectSameState(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t j = 0; j < want.size(); ++j) EXPECT_TRUE(at::equal(got[j], want[j])) << "tensor " << j;
}

using Batches = std::vector<std::pair<at::Tensor, at::Tensor>>;

// A pipeline of `stages` over `workers` loaded from `ck`, trained on steps
// [from, to) of `data`, each loss expected to be `want`'s and the state
// after them `state`; returned (null when it could not be made or loaded).
std::unique_ptr<pipeline::Pipeline> GoOn(rpc::Agent& master, const std::vector<pipeline::StageSpec>& stages,
                                         std::vector<std::string> workers, const Checkpoint& ck,
                                         const Batches& data, size_t from, size_t to,
                                         const std::vector<double>& want, const std::vector<at::Tensor>& state) {
  auto pipe = PipelineOn(master, stages, std::move(workers));
  if (pipe == nullptr) return nullptr;
  const absl::Status restored = Restore(*pipe, ck);
  EXPECT_TRUE(restored.ok()) << restored;
  if (!restored.ok()) return nullptr;
  for (size_t i = from; i < to; ++i) {
    EXPECT_EQ(pipe->start_train_step(data[i].first, data[i].second).wait().value(), want[i]) << "step " << i + 1;
  }
  ExpectSameState(AllStageState(*pipe), state);
  return pipe;
}

TEST(Relayout, TwoStagesThenFourThenOneGoOnAsAnUninterruptedRunOfEachCut) {
  test_support::TestWorkers workers;
  torch::jit::Module whole = test_support::ScriptSequential({6, 8, 8, 8, 8, 3});
  auto model = pipeline::SequentialModel::TorchScript(test_support::SaveToBytes(whole), "five.pt");
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ(model->num_layers(), kLayers);
  const auto data = test_support::RandomBatches(8, 10, 6, 3);
  RunIdentity id;
  id.model = "five";
  id.micro_batches = 2;

  // Uninterrupted: four stages over two workers, eight steps.
  const std::vector<pipeline::StageSpec> four = Cut(*model, {0, 1, 2, 4, kLayers});
  std::vector<double> want;
  std::vector<at::Tensor> want_at_6, want_at_8;
  {
    auto pipe = PipelineOn(workers.master(), four, {"w1", "w2"});
    ASSERT_NE(pipe, nullptr);
    for (size_t i = 0; i < data.size(); ++i) {
      want.push_back(pipe->start_train_step(data[i].first, data[i].second).wait().value());
      if (i == 5) want_at_6 = AllStageState(*pipe);
    }
    want_at_8 = AllStageState(*pipe);
  }

  // Two stages for three steps, saved; the same model from the same start.
  const std::vector<pipeline::StageSpec> two = Cut(*model, {0, 3, kLayers});
  const std::string dir = FreshDir("relayout");
  auto saver = Checkpointer::Create(workers.master(), dir, /*keep=*/1);
  ASSERT_TRUE(saver.ok()) << saver.status();
  {
    auto pipe = PipelineOn(workers.master(), two, {"w1", "w2"});
    ASSERT_NE(pipe, nullptr);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(pipe->start_train_step(data[i].first, data[i].second).wait().value(), want[i]) << "step " << i + 1;
    }
    TrainingState at;
    at.step = 3;
    ASSERT_TRUE((*saver)->Save(*pipe, two, id, at).ok());
  }

  // Written again for four stages (interleaved over two workers: stage k
  // on worker k mod 2), resumed, three steps more, saved.
  auto ck = Latest(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  auto moved = Relayout(*ck, four, {0, 1, 0, 1}, FreshDir("relayout_four"));
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->manifest.step, 3);
  EXPECT_EQ(moved->manifest.stages.size(), 4u);
  ASSERT_EQ(moved->manifest.files.size(), 2u);
  EXPECT_EQ(moved->manifest.files[1].stages, (std::vector<int>{1, 3}));
  EXPECT_TRUE(CheckMatches(*moved, id).ok());
  const std::string dir4 = FreshDir("relayout_saved_four");
  auto saver4 = Checkpointer::Create(workers.master(), dir4, /*keep=*/1);
  ASSERT_TRUE(saver4.ok()) << saver4.status();
  {
    auto pipe = GoOn(workers.master(), four, {"w1", "w2"}, *moved, data, 3, 6, want, want_at_6);
    ASSERT_NE(pipe, nullptr);
    TrainingState at;
    at.step = 6;
    ASSERT_TRUE((*saver4)->Save(*pipe, four, id, at).ok());
  }

  // Then as one stage on one worker: the whole model, two steps more.
  auto ck4 = Latest(dir4);
  ASSERT_TRUE(ck4.ok()) << ck4.status();
  const std::vector<pipeline::StageSpec> one = Cut(*model, {0, kLayers});
  auto whole_ck = Relayout(*ck4, one, {0}, FreshDir("relayout_one"));
  ASSERT_TRUE(whole_ck.ok()) << whole_ck.status();
  ASSERT_EQ(whole_ck->manifest.files.size(), 1u);
  EXPECT_NE(GoOn(workers.master(), one, {"w2"}, *whole_ck, data, 6, 8, want, want_at_8), nullptr);
  // The evaluator's way reads the moved checkpoint as any other.
  auto loaded = LoadModel(*whole_ck, c10::kCPU);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->size(), 1u);
}

TEST(Relayout, AnotherModelOrAPartOfTheModelIsAnErrorNamingTheTensors) {
  test_support::TestWorkers workers;
  torch::jit::Module whole = test_support::ScriptSequential({6, 8, 8, 8, 8, 3});
  auto model = pipeline::SequentialModel::TorchScript(test_support::SaveToBytes(whole), "five.pt").value();
  const std::vector<pipeline::StageSpec> two = Cut(model, {0, 3, kLayers});
  const std::string dir = FreshDir("relayout_errors");
  auto saver = Checkpointer::Create(workers.master(), dir, /*keep=*/1);
  ASSERT_TRUE(saver.ok()) << saver.status();
  {
    auto pipe = PipelineOn(workers.master(), two, {"w1", "w2"});
    ASSERT_NE(pipe, nullptr);
    ASSERT_TRUE((*saver)->Save(*pipe, two, RunIdentity(), TrainingState()).ok());
  }
  const Checkpoint ck = Latest(dir).value();

  // A model with a sixth layer: l5 is nowhere in the checkpoint.
  torch::jit::Module six = test_support::ScriptSequential({6, 8, 8, 8, 8, 8, 3});
  auto bigger = pipeline::SequentialModel::TorchScript(test_support::SaveToBytes(six), "six.pt").value();
  auto other = Relayout(ck, Cut(bigger, {0, 3, 6}), {0, 1}, FreshDir("relayout_other"));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("no tensor named 'l5.weight', 'l5.bias'"));

  // The first three layers only: l3 and l4 would be lost.
  auto part = Relayout(ck, Cut(model, {0, 1, 3}), {0, 1}, FreshDir("relayout_part"));
  EXPECT_EQ(part.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(part.status().message()), HasSubstr("'l3.bias', 'l3.weight', 'l4.bias', 'l4.weight'"));

  // A placement that leaves a worker without a stage.
  auto gap = Relayout(ck, two, {0, 2}, FreshDir("relayout_gap"));
  EXPECT_EQ(gap.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(gap.status().message()), HasSubstr("leaves worker 1 of 3 without a stage"));
}

// A checkpoint written again for another cut (the master's
// relayout-step-N) stays while step N is among the newest kept, and goes
// with it.
TEST(Relayout, AMovedCheckpointIsPrunedWithTheStepItWasWrittenFrom) {
  const std::string dir = FreshDir("relayout_prune");
  for (const char* name : {"step-00000006", "relayout-step-00000006", "step-00000012", "step-00000018"}) {
    std::filesystem::create_directories(dir + "/" + name);
    std::ofstream(dir + "/" + name + "/" + kManifestFile) << "{}";
  }
  EXPECT_THAT(PrunableDirs(dir, 3), ::testing::IsEmpty());
  std::vector<std::string> doomed = PrunableDirs(dir, 2);
  std::sort(doomed.begin(), doomed.end());
  EXPECT_THAT(doomed, ::testing::ElementsAre(dir + "/relayout-step-00000006", dir + "/step-00000006"));
}

}  // namespace
}  // namespace remora::checkpoint
