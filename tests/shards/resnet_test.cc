// ResNet50 shards, partitioning, and the master program end to end.
#include <unistd.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <regex>

#include <ATen/ops/equal.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "launch/cli.h"
#include "shards/resnet.h"
#include "parallel/process_group.h"
#include "pipeline/schedule.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/master_runs.h"
#include "tests/support/script_models.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using test_support::ExpectSameLosses;
using test_support::LocalLosses;
using test_support::ReportEpochs;
using test_support::ReportLosses;
using test_support::ReportNumbers;
using test_support::RunPipeline;


int64_t NumParameters(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

TEST(ResNet, HasTorchvisionsParameterCount) {
  shards::ResNetShardImpl full(0, shards::kResNetBlocks, 0);
  EXPECT_EQ(NumParameters(full), 25557032);
  at::Tensor out = full.forward(at::randn({2, 3, 64, 64}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 1000}));
}

TEST(ResNet, ShardsEqualTheSameBlocksOfTheFullModel) {
  shards::ResNetShardImpl full(0, shards::kResNetBlocks, 3);
  shards::ResNetShardImpl a(0, 8, 3), b(8, shards::kResNetBlocks, 3);
  EXPECT_EQ(NumParameters(a) + NumParameters(b), NumParameters(full));
  auto fp = full.parameters();
  auto ap = a.parameters(), bp = b.parameters();
  ap.insert(ap.end(), bp.begin(), bp.end());
  ASSERT_EQ(ap.size(), fp.size());
  for (size_t i = 0; i < fp.size(); ++i) EXPECT_TRUE(at::equal(ap[i], fp[i])) << i;
  at::Tensor x = at::randn({2, 3, 32, 32});
  EXPECT_TRUE(at::allclose(b.forward(a.forward(x)), full.forward(x), 1e-5, 1e-6));
  EXPECT_THROW(shards::ResNetShardImpl(5, 5, 0), std::invalid_argument);
  EXPECT_THROW(shards::ResNetShardImpl(0, 19, 0), std::invalid_argument);
}

TEST(ResNet, TutorialSplitIsTorchvisions) {
  EXPECT_EQ(shards::TutorialSplit(), (std::vector<int>{0, 8, 18}));
}

const std::vector<std::string> kSmall = {"--batches", "2", "--batch-size", "8",
                                         "--image-size", "32"};

TEST(Master, PipelineLossesMatchLocalTraining) {
  const std::string report = TempPath("pipeline.json"), local = TempPath("local.json");
  const std::string trace = TempPath("trace.json"), svg = TempPath("timeline.svg");
  const std::string tensorboard = TempPath("tensorboard"), curves = TempPath("curves.svg");
  std::vector<std::string> args = kSmall;
  for (const char* a : {"--splits", "1,2"}) args.push_back(a);
  std::vector<std::string> pipeline_args = args;
  pipeline_args.insert(pipeline_args.end(), {"--report", report, "--trace", trace, "--timeline", svg,
                                             "--tensorboard", tensorboard, "--curves", curves});
  auto [code, out] = RunPipeline(2, pipeline_args);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("batch=1 loss="));
  EXPECT_THAT(out, HasSubstr("splits=2 seconds="));
  EXPECT_THAT(out, HasSubstr("speedup"));
  std::vector<std::string> local_args = {BinDir() + "/master", "--local", "--threads", "1",
                                         "--report", local};
  local_args.insert(local_args.end(), args.begin(), args.end());
  auto [lcode, lout] = RunProgram(local_args, absl::Seconds(240));
  ASSERT_EQ(lcode, 0) << lout;

  const std::string pj = ReadFile(report), lj = ReadFile(local);
  EXPECT_THAT(pj, HasSubstr("\"mode\": \"pipeline\""));
  EXPECT_THAT(lj, HasSubstr("\"mode\": \"local\""));
  // The master's waits for its batches, each within its batch's time; one process reports none.
  const auto waits = ReportNumbers(pj, "data_wait_seconds"), times = ReportNumbers(pj, "batch_seconds");
  ASSERT_EQ(waits.size(), 2u);
  for (size_t r = 0; r < 2; ++r) EXPECT_LE(waits[r].at(0) + waits[r].at(1), times[r].at(0) + times[r].at(1));
  EXPECT_TRUE(ReportNumbers(lj, "data_wait_seconds").empty());
  EXPECT_THAT(out, HasSubstr("data wait: the master waited "));
  auto p = ReportLosses(pj), l = ReportLosses(lj);
  ASSERT_EQ(p.size(), 2u);
  ASSERT_EQ(l.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(p[r].size(), 2u);
    ASSERT_EQ(l[r].size(), 2u);
    for (size_t b = 0; b < 2; ++b) {
      EXPECT_LT(std::abs(p[r][b] - l[r][b]) / std::abs(l[r][b]), 1e-4)
          << "run " << r << " batch " << b << ": " << p[r][b] << " vs " << l[r][b];
    }
  }
  // Training moved the model: the second batch's loss differs from the first's.
  EXPECT_GT(std::abs(l[0][1] - l[0][0]), 1e-3);

  // --tensorboard: a directory per split count of the sweep, each batch's
  // loss at steps 1 and 2 as the report has it; --curves: one line each.
  for (size_t r = 0; r < 2; ++r) {
    const auto losses = test_support::ScalarsIn(absl::StrCat(tensorboard, "/splits-", r + 1), "step/loss");
    ASSERT_EQ(losses.size(), 2u) << "splits " << r + 1;
    for (size_t b = 0; b < 2; ++b) {
      EXPECT_EQ(losses[b].step, static_cast<int64_t>(b + 1));
      EXPECT_FLOAT_EQ(losses[b].value, static_cast<float>(p[r][b]));
    }
  }
  EXPECT_THAT(out, HasSubstr("tensorboard: " + tensorboard));
  const auto bubble = test_support::ScalarsIn(absl::StrCat(tensorboard, "/splits-2"), "bubble/step");
  ASSERT_EQ(bubble.size(), 1u);
  EXPECT_EQ(bubble[0].step, 2);
  EXPECT_EQ(test_support::ScalarsIn(absl::StrCat(tensorboard, "/splits-2"), "bubble/worker1").size(), 1u);
  const std::string cs = ReadFile(curves);
  for (const char* part : {"splits=1", "splits=2", "<polyline"}) EXPECT_THAT(cs, HasSubstr(part));

  // The trace has a track per worker and forward/backward slices per micro-batch.
  const std::string tj = ReadFile(trace);
  for (const char* part : {"\"traceEvents\"", "\"name\": \"worker1\"", "\"name\": \"worker2\""}) {
    EXPECT_THAT(tj, HasSubstr(part));
  }
  for (const char* slice : {"forward mb0", "forward mb1", "backward mb0", "backward mb1", "step"}) {
    EXPECT_THAT(tj, HasSubstr(slice)) << slice;
  }
  // Copies and waits on each track's second row; the master's own track.
  EXPECT_THAT(tj, HasSubstr("\"name\": \"input\", \"cat\": \"input\", \"ph\": \"X\", \"pid\": 0, \"tid\": 1"));
  EXPECT_THAT(tj, HasSubstr("\"name\": \"master\""));
  // Message hops there too: worker2's receipt of worker1's activations (to
  // its handler's start), worker1's wait for its forward pass's turn.
  EXPECT_THAT(tj, HasSubstr("\"name\": \"recv remora.pipeline.push\", \"cat\": \"recv remora.pipeline.push\", "
                            "\"ph\": \"X\", \"pid\": 1, \"tid\": 1"));
  EXPECT_THAT(tj, HasSubstr("\"name\": \"turn F0@stage0\", \"cat\": \"turn F0@stage0\", \"ph\": \"X\", \"pid\": 0"));
  EXPECT_THAT(tj, HasSubstr("\"name\": \"call function 'remora.pipeline.push' to worker2\""));
  for (const char* slice : {"\"take batch\"", "\"send\"", "\"wait\"", "\"settle\"", "\"loss reply\""}) {
    EXPECT_THAT(tj, HasSubstr(slice)) << slice;
  }
  // Forward and backward slices name their stage (two per worker here).
  EXPECT_THAT(tj, HasSubstr("\"cat\": \"forward\", \"ph\": \"X\", \"pid\": 0"));
  EXPECT_THAT(tj, HasSubstr("\"stage\": \"stage 0\""));
  for (const char* kind : {"forward", "backward"}) {
    std::regex staged(absl::StrCat("\"name\": \"", kind, " mb[0-9]+\"[^}]*\"stage\": \"stage [0-9]+\""));
    EXPECT_TRUE(std::regex_search(tj, staged)) << kind;
  }
  const std::string sj = ReadFile(svg);
  for (const char* part : {"<svg", "worker2", ">stage", ">idle ", "forward of micro-batch 0"}) {
    EXPECT_THAT(sj, HasSubstr(part)) << part;
  }
  // The traced run's bubble (its second batch) beside its schedule's, in
  // the console and the report.
  EXPECT_THAT(out, HasSubstr("% of each step idle over 1 step after the first"));
  EXPECT_THAT(out, HasSubstr("the schedule alone leaves "));
  EXPECT_THAT(out, HasSubstr("  worker1: busy "));
  EXPECT_THAT(pj, HasSubstr("\"bubble\": {\"steps\": 1, \"step_seconds\": "));
  EXPECT_GT(std::count(sj.begin(), sj.end(), '\n'), 20);
}

// Interleaved stages (worker k also hosts stage k + n) train the same model:
// one stage per worker and three per worker (the default is two) give local
// training's losses.
TEST(Master, InterleavedStagesMatchLocalTraining) {
  std::vector<std::string> args = kSmall;
  for (const char* a : {"--splits", "2"}) args.push_back(a);
  auto l = LocalLosses(args, "local2");
  ASSERT_EQ(l.size(), 1u);
  for (int per_worker : {1, 3}) {
    const std::string report = TempPath(absl::StrCat("interleave", per_worker, ".json"));
    std::vector<std::string> pipeline_args = args;
    for (const std::string& a : {std::string("--interleave"), absl::StrCat(per_worker),
                                 std::string("--report"), report}) {
      pipeline_args.push_back(a);
    }
    auto [code, out] = RunPipeline(2, pipeline_args);
    ASSERT_EQ(code, 0) << out;
    EXPECT_THAT(out, HasSubstr(absl::StrCat("over 2 workers, ", 2 * per_worker, " stages")));
    auto p = ReportLosses(ReadFile(report));
    ASSERT_EQ(p.size(), 1u);
    ExpectSameLosses(p[0], l[0], absl::StrCat("--interleave ", per_worker));
  }
}

// Each worker runs its stages' forward and backward passes in exactly its
// schedule's order (read from the trace, one batch after the other), and
// training is unchanged by the schedule.
TEST(Master, WorkersRunTheirActionsInTheSchedulesOrder) {
  std::vector<std::string> args = kSmall;
  for (const char* a : {"--splits", "4"}) args.push_back(a);
  auto l = LocalLosses(args, "local4");
  ASSERT_EQ(l.size(), 1u);
  struct Case { std::string schedule; int per_worker; };  // NOLINT(whitespace/braces)
  for (const Case& k : {Case{"1f1b", 1}, Case{"gpipe", 1}, Case{"interleaved", 2}}) {
    SCOPED_TRACE(k.schedule);
    const std::string report = TempPath(k.schedule + ".json"), trace = TempPath(k.schedule + "_trace.json");
    std::vector<std::string> pipeline_args = args;
    for (const std::string& a : {std::string("--schedule"), k.schedule, std::string("--interleave"),
                                 std::to_string(k.per_worker), std::string("--report"), report,
                                 std::string("--trace"), trace}) {
      pipeline_args.push_back(a);
    }
    auto [code, out] = RunPipeline(2, pipeline_args);
    ASSERT_EQ(code, 0) << out;
    auto p = ReportLosses(ReadFile(report));
    ASSERT_EQ(p.size(), 1u);
    ExpectSameLosses(p[0], l[0], "--schedule " + k.schedule);
    // Per worker (trace pid), the forward and backward slices in time order.
    const std::string tj = ReadFile(trace);
    const std::regex slice(
        "\"name\": \"(forward|backward) mb([0-9]+)\"[^}]*\"pid\": ([0-9]+)[^}]*\"ts\": "
        "([0-9]+)[^}]*\"stage\": \"stage ([0-9]+)\"");
    std::vector<std::vector<std::pair<int64_t, std::string>>> ran(2);
    for (auto it = std::sregex_iterator(tj.begin(), tj.end(), slice); it != std::sregex_iterator(); ++it) {
      const int pid = std::stoi((*it)[3]);
      ASSERT_LT(pid, 2);
      ran[pid].emplace_back(std::stoll((*it)[4]), absl::StrCat((*it)[1].str() == "forward" ? "F" : "B",
                                                               (*it)[2].str(), "@", (*it)[5].str()));
    }
    auto schedule = pipeline::MakeSchedule(k.schedule, 2, k.per_worker, 4).value();
    for (int w = 0; w < 2; ++w) {
      std::sort(ran[w].begin(), ran[w].end());
      std::string got, want;
      for (const auto& [ts, name] : ran[w]) got += name + " ";
      for (int batch = 0; batch < 2; ++batch) {
        for (const auto& a : schedule.actions[w]) want += a.ToString() + " ";
      }
      EXPECT_EQ(got, want) << "worker " << w;
    }
  }
}

// A TorchScript linear layer saved to `path` (made in C++: no Python).
void SaveScriptLinear(const std::string& path, int64_t in, int64_t out, int64_t seed, bool relu) {
  test_support::ScriptLinear(in, out, seed, relu).save(path);
}

// master --model DIR trains TorchScript stages (the stock worker hosts them
// without being rebuilt) as --local trains them in one process.
TEST(Master, TrainsTorchScriptStagesFromADirectory) {
  const std::string dir = TempPath("script_model");
  std::filesystem::create_directories(dir);
  SaveScriptLinear(dir + "/stage0.pt", 12, 16, 1, true);
  SaveScriptLinear(dir + "/stage1.pt", 16, 16, 2, true);
  SaveScriptLinear(dir + "/stage2.pt", 16, 16, 3, true);
  SaveScriptLinear(dir + "/stage3.pt", 16, 5, 4, false);
  const std::vector<std::string> args = {"--model", dir, "--input-shape", "12", "--classes", "5",
                                         "--batches", "3", "--batch-size", "16", "--splits", "4",
                                         "--lr", "0.1"};
  auto l = LocalLosses(args, "script_local");
  ASSERT_EQ(l.size(), 1u);
  ASSERT_EQ(l[0].size(), 3u);
  EXPECT_LT(l[0][2], l[0][0]);  // it trains
  for (const std::string schedule : {"interleaved", "gpipe"}) {
    const std::string report = TempPath("script_" + schedule + ".json");
    std::vector<std::string> pipeline_args = args;
    for (const std::string& a : {std::string("--schedule"), schedule, std::string("--report"), report}) {
      pipeline_args.push_back(a);
    }
    auto [code, out] = RunPipeline(2, pipeline_args);
    ASSERT_EQ(code, 0) << out;
    EXPECT_THAT(out, HasSubstr("schedule " + schedule + ": 4 stages over 2 workers"));
    auto p = ReportLosses(ReadFile(report));
    ASSERT_EQ(p.size(), 1u);
    ExpectSameLosses(p[0], l[0], "--model, --schedule " + schedule);
  }
}

// master --model FILE of one scripted nn.Sequential cuts it over the
// workers, by measured cost (two interleaved stages per worker) or at
// --split-at, and trains as --local trains the whole module.
TEST(Master, CutsOneSequentialTorchScriptFileOverTheWorkers) {
  const std::string file = TempPath("sequential.pt");
  test_support::ScriptSequential({12, 16, 16, 16, 16, 16, 5}).save(file);
  const std::vector<std::string> args = {"--model", file, "--input-shape", "12", "--classes", "5",
                                         "--batches", "3", "--batch-size", "16", "--splits", "4",
                                         "--lr", "0.1"};
  auto l = LocalLosses(args, "sequential_local");
  ASSERT_EQ(l.size(), 1u);
  const std::vector<std::pair<std::vector<std::string>, std::string>> cuts = {
      {{}, "schedule interleaved: 4 stages over 2 workers"},
      {{"--split-at", "2"}, "schedule 1f1b: 2 stages over 2 workers"}};
  for (const auto& [cut, want] : cuts) {
    const std::string report = TempPath("sequential_pipeline.json");
    std::vector<std::string> pipeline_args = args;
    pipeline_args.insert(pipeline_args.end(), cut.begin(), cut.end());
    pipeline_args.insert(pipeline_args.end(), {"--report", report});
    auto [code, out] = RunPipeline(2, pipeline_args);
    ASSERT_EQ(code, 0) << out;
    EXPECT_THAT(out, HasSubstr(want));
    EXPECT_THAT(out, HasSubstr("worker1    layers [ 0,"));
    if (cut.empty()) {
      EXPECT_THAT(out, HasSubstr("of the measured cost"));
    }
    auto p = ReportLosses(ReadFile(report));
    ASSERT_EQ(p.size(), 1u);
    ExpectSameLosses(p[0], l[0], absl::StrCat("--model FILE ", absl::StrJoin(cut, " ")));
  }
}

// master --replicas: two copies of a two-stage pipeline over four
// workers (hybrid), and two single-worker replicas (plain data
// parallelism), train as --local trains the model on the whole batch.
TEST(Master, ReplicasTrainLikeOneProcess) {
  if (!parallel::HaveGloo()) GTEST_SKIP() << "built without Gloo";
  const std::string dir = TempPath("replica_model");
  std::filesystem::create_directories(dir);
  SaveScriptLinear(dir + "/stage0.pt", 12, 16, 1, true);
  SaveScriptLinear(dir + "/stage1.pt", 16, 5, 2, false);
  const std::string file = TempPath("replica_model.pt");
  test_support::ScriptSequential({12, 16, 5}).save(file);
  const std::vector<std::pair<std::string, std::string>> runs = {
      {dir, "0"}, {dir, "1"}, {file, "0"}};  // (model, --zero)
  for (const auto& [model, zero] : runs) {
    const std::vector<std::string> args = {"--model", model, "--input-shape", "12", "--classes",
                                           "5", "--batches", "3", "--batch-size", "18",
                                           "--splits", "2", "--lr", "0.1"};
    auto l = LocalLosses(args, "replica_local");
    ASSERT_EQ(l.size(), 1u);
    const int workers = model == dir ? 4 : 2;
    const std::string report = TempPath("replica_pipeline.json");
    std::vector<std::string> pipeline_args = args;
    pipeline_args.insert(pipeline_args.end(), {"--replicas", "2", "--zero", zero, "--report", report});
    auto [code, out] = RunPipeline(workers, pipeline_args);
    ASSERT_EQ(code, 0) << out;
    EXPECT_THAT(out, HasSubstr(zero == "1" ? "overlapping backward, ZeRO-1: optimizer state sharded)"
                                           : "2 replicas (gradients summed over Gloo, overlapping backward)"));
    EXPECT_THAT(out, HasSubstr(workers == 4 ? "worker4      1        1" : "worker2      1        0"));
    EXPECT_THAT(out, HasSubstr("replica 1: optimizer state"));
    // Every replica's stages, on their own workers (replica 0's only before).
    EXPECT_THAT(out, HasSubstr(workers == 4 ? "replica 1, stage 1 on worker4: peak saved activations"
                                            : "replica 1, stage 0 on worker2: peak saved activations"));
    EXPECT_THAT(ReadFile(report), HasSubstr(workers == 4 ? "{\"replica\": 1, \"stage\": 1, \"worker\": \"worker4\""
                                                         : "{\"replica\": 1, \"stage\": 0, \"worker\": \"worker2\""));
    EXPECT_THAT(out, HasSubstr(workers == 4 ? "over 4 workers: 2 replicas of 2 workers, 2 stages each"
                                            : "over 2 workers: 2 replicas of 1 worker, 1 stage each"));
    auto p = ReportLosses(ReadFile(report));
    ASSERT_EQ(p.size(), 1u);
    ExpectSameLosses(p[0], l[0], absl::StrCat("--replicas 2 --zero ", zero, " over ", workers, " workers"));
  }
}

// master --dataset trains the small CNN for --epochs, prints the test
// accuracy after each, and the pipeline matches training in one process.
TEST(Master, DatasetEpochsReportTestAccuracyAndMatchLocalTraining) {
  const std::string dir = TempPath("toy_idx");
  test_support::WriteToyIdx(dir, 320, 100);
  const std::vector<std::string> args = {"--dataset", "idx:" + dir, "--epochs", "2",
                                         "--batch-size", "32", "--splits", "2"};
  const std::string local_report = TempPath("toy_local.json");
  const std::string local_trace = TempPath("toy_local_trace.json");
  std::vector<std::string> local_argv = {BinDir() + "/master", "--local", "--threads", "1", "--report",
                                         local_report, "--trace", local_trace};
  local_argv.insert(local_argv.end(), args.begin(), args.end());
  auto [local_code, local_out] = RunProgram(local_argv, absl::Seconds(240));
  ASSERT_EQ(local_code, 0) << local_out;
  EXPECT_THAT(local_out, HasSubstr("320 training and 100 test images"));
  EXPECT_THAT(local_out, HasSubstr("epoch=2 train_loss="));
  EXPECT_THAT(local_out, HasSubstr("local: splits=2 (2 micro-batches of 16 images)"));
  auto local = ReportEpochs(ReadFile(local_report));
  ASSERT_EQ(local.size(), 2u);
  EXPECT_LT(local[1].first, local[0].first);
  EXPECT_GT(local[1].second, 0.5) << "the toy classes are easy to learn";
  const std::string report = TempPath("toy_pipeline.json"), trace = TempPath("toy_trace.json");
  std::vector<std::string> pipeline_args = args;
  for (const std::string& a : {std::string("--report"), report, std::string("--trace"), trace}) {
    pipeline_args.push_back(a);
  }
  auto [code, out] = RunPipeline(2, pipeline_args);
  ASSERT_EQ(code, 0) << out;
  // The epochs' steps are traced, in one process and on both workers.
  const std::string lt = ReadFile(local_trace), pt = ReadFile(trace);
  for (const char* slice : {"forward mb0", "backward mb1", "step"}) EXPECT_THAT(lt, HasSubstr(slice)) << slice;
  for (const char* slice : {"\"cat\": \"forward\", \"ph\": \"X\", \"pid\": 0",
                            "\"cat\": \"backward\", \"ph\": \"X\", \"pid\": 1"}) {
    EXPECT_THAT(pt, HasSubstr(slice)) << slice;
  }
  EXPECT_THAT(out, HasSubstr("pipeline: splits=2 (2 micro-batches of 16 images) over 2 workers"));
  EXPECT_THAT(out, HasSubstr("schedule 1f1b: 2 stages over 2 workers"));
  EXPECT_THAT(out, HasSubstr("data: read on worker1 (the master sends row numbers)"));
  auto piped = ReportEpochs(ReadFile(report));
  ASSERT_EQ(piped.size(), 2u);
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_LT(std::abs(piped[e].first - local[e].first) / local[e].first, 1e-4) << "epoch " << e + 1;
    EXPECT_NEAR(piped[e].second, local[e].second, 0.011) << "epoch " << e + 1;
  }
  // Stage 0's worker read those batches itself (--data-on workers, the
  // default): the same epochs as with the master sending them, also for
  // two replicas that each read their half.
  for (const std::vector<std::string>& mode : {std::vector<std::string>{}, {"--replicas", "2", "--splits", "1"}}) {
    std::vector<std::pair<double, double>> by[2];
    for (int on_master = 0; on_master < 2; ++on_master) {
      if (mode.empty() && !on_master) {  // the run above
        by[0] = piped;
        continue;
      }
      std::vector<std::string> a = args;
      a.insert(a.end(), mode.begin(), mode.end());
      if (on_master) a.insert(a.end(), {"--data-on", "master"});
      const std::string r = TempPath("toy_data_on.json");
      a.insert(a.end(), {"--report", r});
      auto [rc, text] = RunPipeline(2, a);
      ASSERT_EQ(rc, 0) << text;
      EXPECT_THAT(text, HasSubstr(on_master ? "data: read on the master" : "data: read on worker1"));
      if (!mode.empty()) {
        EXPECT_THAT(text, HasSubstr("(1 micro-batch of 16 images per replica)"));
      }
      by[on_master] = ReportEpochs(ReadFile(r));
      ASSERT_EQ(by[on_master].size(), 2u) << text;
    }
    for (size_t e = 0; e < 2; ++e) {
      EXPECT_NEAR(by[0][e].first, by[1][e].first, 1e-6 * by[1][e].first) << absl::StrJoin(mode, " ") << " epoch " << e + 1;
      EXPECT_EQ(by[0][e].second, by[1][e].second) << absl::StrJoin(mode, " ") << " epoch " << e + 1;
    }
  }
  // Fewer training images than --batch-size: the header counts the batch
  // that is trained, not --batch-size.
  auto [few_code, few_out] = RunProgram({BinDir() + "/master", "--local", "--threads", "1", "--dataset", "idx:" + dir,
                                         "--train-rows", "10", "--batch-size", "64", "--splits", "4"});
  EXPECT_EQ(few_code, 0) << few_out;
  EXPECT_THAT(few_out, HasSubstr("local: splits=4 (4 micro-batches of ~2 images)")) << few_out;
  // A dataset that is not there is a clear error before the master listens (a bad flag value: 2).
  for (const auto& [dataset, says] : {std::array<std::string, 2>{"idx:" + TempPath("none"), "none does not exist"},
                                      {"cifar10:/dev/null", "cifar10:/dev/null: /dev/null is not a directory"}}) {
    auto [bad, bad_out] = RunProgram({BinDir() + "/master", "--workers", "w1,w2", "--dataset", dataset});
    EXPECT_EQ(bad, 2) << bad_out;
    EXPECT_THAT(bad_out, ::testing::AllOf(HasSubstr(says), Not(HasSubstr("master listening"))));
  }
}

// --compare-local trains the local baseline batch by batch between the last
// split count's batches (both meet the same minutes of a drifting machine).
TEST(Master, CompareLocalAlternatesBatchesWithThePipeline) {
  std::vector<std::string> args = kSmall;
  for (const char* a : {"--splits", "1,2", "--compare-local"}) args.push_back(a);
  auto [code, out] = RunPipeline(2, args);
  ASSERT_EQ(code, 0) << out;
  const size_t last = out.find("pipeline: splits=2");
  ASSERT_NE(last, std::string::npos) << out;
  size_t at = last;
  for (const char* line : {"\nbatch=0 loss=", "\nlocal batch=0 loss=", "\nbatch=1 loss=",
                           "\nlocal batch=1 loss=", "splits=1 seconds=",
                           "pipeline splits=2 takes "}) {
    const size_t next = out.find(line, at);
    ASSERT_NE(next, std::string::npos) << "missing, in order: " << line << "\n" << out;
    at = next;
  }
  // The first split count ran alone.
  EXPECT_EQ(out.substr(0, last).find("local batch="), std::string::npos) << out;
}

TEST(Master, BalancedSplitWorksForThreeAndFourWorkers) {
  for (int n : {3, 4}) {
    std::vector<std::string> args = kSmall;
    args[1] = "1";  // one batch
    args.push_back("--splits");
    args.push_back("2");
    auto [code, out] = RunPipeline(n, args);
    ASSERT_EQ(code, 0) << out;
    EXPECT_THAT(out, HasSubstr(absl::StrCat("worker", n, " ")));
    EXPECT_THAT(out, HasSubstr("of the measured cost"));
    EXPECT_THAT(out, HasSubstr("batch=0 loss="));
  }
}

TEST(Master, TutorialPartitionRunsOverMutualTls) {
  std::vector<std::string> args = kSmall;
  for (const char* a : {"--partition", "tutorial", "--splits", "2", "--batches", "1"}) {
    args.push_back(a);
  }
  const TestPki pki = MakeTestPki("master");
  auto [code, out] = RunPipeline(2, args, pki.files().WorkerArgs());
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("(mutual TLS)"));
  EXPECT_THAT(out, HasSubstr("batch=0 loss="));
}

// master --model FILE --dataset: a one-file model over two workers is cut
// on the dataset's image shape (1x28x28 here), not --input-shape's default;
// an --input-shape that contradicts the dataset is an error naming both.
TEST(Master, AOneFileModelWithADatasetTakesTheDatasetsShape) {
  const std::string data = TempPath("one_file_idx");
  test_support::WriteToyIdx(data, 96, 32);
  torch::jit::Module model("Sequential"), flat("Flatten");
  flat.define("def forward(self, x):\n  return x.flatten(1)\n");
  model.register_module("f", flat);
  model.register_module("l0", test_support::ScriptLinear(784, 32, 1, true));
  model.register_module("l1", test_support::ScriptLinear(32, 10, 2, false));
  model.define("def forward(self, x):\n  x = self.f.forward(x)\n  x = self.l0.forward(x)\n"
               "  return self.l1.forward(x)\n");
  const std::string file = TempPath("one_file_model.pt");
  model.save(file);
  const std::vector<std::string> args = {"--model", file, "--dataset", "idx:" + data, "--epochs", "1",
                                         "--classes", "10", "--batch-size", "16", "--splits", "2"};
  auto [code, out] = RunPipeline(2, args);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("test_accuracy="));
  EXPECT_THAT(out, HasSubstr(" test_top5="));
  // Found once the dataset is loaded, before any worker is waited for.
  std::vector<std::string> contradicting = {BinDir() + "/master", "--workers", "worker1,worker2", "--listen",
                                            absl::StrCat("127.0.0.1:", FreePort()), "--input-shape",
                                            "3,32,32"};
  contradicting.insert(contradicting.end(), args.begin(), args.end());
  auto [bad_code, bad_out] = RunProgram(contradicting, absl::Seconds(60));
  EXPECT_EQ(bad_code, 1) << bad_out;
  EXPECT_THAT(bad_out, HasSubstr("--input-shape 3,32,32 does not match --dataset idx:" +
                                 std::filesystem::path(data).lexically_normal().string() + "'s images of 1,28,28"));
  // Without --dataset, --input-shape's default 3,32,32 does not fit: the
  // layer that refuses it and both shapes, no TorchScript traceback.
  auto [unfit_code, unfit_out] =
      RunPipeline(2, {"--model", file, "--batches", "1", "--batch-size", "16", "--splits", "2"}, {}, 1);
  EXPECT_EQ(unfit_code, 1) << unfit_out;
  EXPECT_THAT(unfit_out, HasSubstr("layer 1 ('l0', Linear) does not take the previous layer's output, a Float "
                                   "tensor of shape [8, 3072]: "));
  EXPECT_THAT(unfit_out, HasSubstr("(8x3072 and 784x32); one input is 3,32,32 (--input-shape's default)"));
  EXPECT_THAT(unfit_out, Not(HasSubstr("Traceback")));
}

// The same --seed gives bitwise the same losses when a stage has dropout,
// in every mode: every worker's generators are seeded from the run's seed
// and the worker's place (they started from random seeds).
TEST(Master, TheSameSeedGivesTheSameLossesWithDropoutInEveryMode) {
  const std::string dir = TempPath("dropout_model");
  std::filesystem::create_directories(dir);
  torch::jit::Module first("DropoutStage");
  first.register_module("l0", test_support::ScriptLinear(12, 16, 1, true));
  first.define("def forward(self, x):\n  return torch.dropout(self.l0.forward(x), 0.5, True)\n");
  first.save(dir + "/stage0.pt");
  SaveScriptLinear(dir + "/stage1.pt", 16, 5, 2, false);
  const std::vector<std::string> common = {"--model", dir, "--input-shape", "12", "--classes", "5",
                                           "--batches", "3", "--batch-size", "16", "--lr", "0.1",
                                           "--seed", "7"};
  struct Mode {
    std::string name;
    int workers;
    std::vector<std::string> args;
  };
  for (const Mode& m : {Mode{"pipeline", 2, {"--splits", "2"}},
                        Mode{"replicas", 4, {"--splits", "2", "--replicas", "2"}},
                        Mode{"parameter server", 2, {"--mode", "ps"}}}) {
    SCOPED_TRACE(m.name);
    std::vector<std::vector<double>> losses;
    for (int run = 0; run < 2; ++run) {
      const std::string report = TempPath(absl::StrCat("dropout_", run, ".json"));
      std::vector<std::string> args = common;
      args.insert(args.end(), m.args.begin(), m.args.end());
      args.insert(args.end(), {"--report", report});
      auto [code, out] = RunPipeline(m.workers, args);
      ASSERT_EQ(code, 0) << out;
      auto p = ReportLosses(ReadFile(report));
      ASSERT_EQ(p.size(), 1u);
      ASSERT_EQ(p[0].size(), 3u);
      losses.push_back(p[0]);
    }
    EXPECT_EQ(losses[0], losses[1]);  // bitwise
  }
}

// A master that fails after the group formed (stages whose shapes do not
// fit) tells its workers why: they exit at once with its error instead of
// waiting out the master's silence.
TEST(Master, AFailedMasterEndsItsGroupAndTheWorkersExitWithItsError) {
  const std::string dir = TempPath("misfit_model");
  std::filesystem::create_directories(dir);
  SaveScriptLinear(dir + "/stage0.pt", 12, 16, 1, true);
  SaveScriptLinear(dir + "/stage1.pt", 8, 5, 2, false);  // takes 8 features, gets 16
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  std::vector<std::unique_ptr<launch::Subprocess>> workers;
  for (const std::string name : {"worker1", "worker2"}) {
    workers.push_back(launch::Subprocess::Spawn({BinDir() + "/worker", "--name", name, "--master", addr},
                                             TempPath(name + "_misfit.log"))
                          .value());
  }
  auto [code, out] = RunProgram({BinDir() + "/master", "--workers", "worker1,worker2", "--listen", addr,
                                 "--model", dir, "--input-shape", "12", "--classes", "5", "--batches",
                                 "2", "--batch-size", "8", "--splits", "2"},
                                absl::Seconds(120));
  EXPECT_EQ(code, 1) << out;
  const absl::Time ended = absl::Now();
  for (size_t i = 0; i < workers.size(); ++i) {
    EXPECT_EQ(workers[i]->Wait(absl::Seconds(30)).value_or(0), 1);
    const std::string log = ReadFile(TempPath(absl::StrCat("worker", i + 1, "_misfit.log")));
    EXPECT_THAT(log, HasSubstr("failed and ended the group"));
    EXPECT_THAT(log, HasSubstr("stage 1"));
  }
  // The heartbeat would have taken 10 s.
  EXPECT_LT(absl::Now() - ended, absl::Seconds(5));
}

// A stage file that does not load on its worker fails the master with the
// cause first: which stage, which worker, TorchScript's refusal; no
// internal call (it read "encoding the arguments of 'activation_bytes':
// cannot send a failed RRef: cannot load TorchScript ...").
TEST(Master, AStageFileThatDoesNotLoadIsNamedWithItsCause) {
  const std::string dir = TempPath("unloadable_model");
  std::filesystem::create_directories(dir);
  SaveScriptLinear(dir + "/stage0.pt", 12, 16, 1, true);
  {
    std::ofstream junk(dir + "/stage1.pt");
    junk << "not a TorchScript archive";
  }
  auto [code, out] = RunPipeline(2, {"--model", dir, "--input-shape", "12", "--classes", "5", "--batches", "1",
                                     "--batch-size", "8", "--splits", "2"},
                                 {}, /*worker_code=*/1);
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("placing stage 1 on worker 'worker2': "));
  EXPECT_THAT(out, HasSubstr("cannot load TorchScript from"));
  EXPECT_THAT(out, Not(HasSubstr("activation_bytes")));
  EXPECT_THAT(out, Not(HasSubstr("failed RRef")));
}

}  // namespace
}  // namespace remora
