// master --resume under another cut, as a user runs it: the GPT (tied
// embeddings, Adam) trained over two workers, resumed over three, then
// over one, each run's losses equal to those of an uninterrupted run of
// its own cut, step by step. Stages given cut (the small CNN's blocks)
// resume over their own worker count only, and the error says so.
#include <stdlib.h>

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "launch/cli.h"
#include "tests/support/master_runs.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;

// The losses of every step in the --report `path` (one run).
std::vector<double> Losses(const std::string& path) {
  const std::vector<std::vector<double>> runs = test_support::ReportLosses(ReadFile(path));
  return runs.size() == 1 ? runs[0] : std::vector<double>();
}

TEST(ResumeCut, AGptSavedOverTwoWorkersGoesOnOverThreeThenOneAsUninterruptedRunsOfThoseCuts) {
  const std::string text = test_support::WriteText("resume_cut.txt");
  const std::string dir = test_support::FreshDir("resume_cut");
  setenv("TMPDIR", dir.c_str(), 1);  // (the tokens)
  const std::string ckpt = dir + "/ckpt";
  // Six steps an epoch (48 rows in batches of 8), two micro-batches.
  auto run = [&](int workers, int epochs, const std::string& name, std::vector<std::string> more) {
    std::vector<std::string> args = {"--dataset", "text:" + text, "--layers", "4", "--d-model", "32", "--heads",
                                     "2", "--seq-len", "16", "--batch-size", "8", "--train-rows", "48",
                                     "--optimizer", "adam", "--lr", "0.003", "--tie-embeddings", "--splits", "2",
                                     "--schedule", "1f1b", "--seed", "5", "--epochs", std::to_string(epochs),
                                     "--report", dir + "/" + name + ".json"};
    args.insert(args.end(), more.begin(), more.end());
    auto [code, out] = test_support::RunPipeline(workers, args);
    EXPECT_EQ(code, 0) << name << "\n" << out;
    return out;
  };
  // Uninterrupted: three workers for two epochs, one worker for three.
  run(3, 2, "three", {});
  run(1, 3, "one", {});
  const std::vector<double> three = Losses(dir + "/three.json");
  const std::vector<double> one = Losses(dir + "/one.json");
  ASSERT_EQ(three.size(), 12u);
  ASSERT_EQ(one.size(), 18u);

  // Two workers, one epoch, saved; the cut does not change the numbers.
  run(2, 1, "two", {"--checkpoint-dir", ckpt});
  const std::vector<double> two = Losses(dir + "/two.json");
  ASSERT_EQ(two.size(), 6u);
  for (size_t i = 0; i < two.size(); ++i) EXPECT_EQ(two[i], three[i]) << "step " << i + 1;

  // Resumed over three workers for the second epoch: cut again, the
  // checkpoint written for that cut, steps 7-12 as the uninterrupted run's.
  const std::string over_three = run(3, 2, "resumed_three", {"--resume", ckpt});
  EXPECT_THAT(over_three, HasSubstr("(2 stages over 2 workers) cut again: 3 stages over 3 workers, written to " +
                                    ckpt + "/relayout-step-00000006"));
  const std::vector<double> resumed_three = Losses(dir + "/resumed_three.json");
  ASSERT_EQ(resumed_three.size(), 6u) << over_three;
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(resumed_three[i], three[6 + i]) << "step " << 7 + i;
  // (One stage sums the tied weight's two gradients in another order: to
  // rounding only.)
  test_support::ExpectSameLosses(resumed_three, std::vector<double>(one.begin() + 6, one.begin() + 12),
                                 "as one worker's steps 7-12");

  // Then over one worker, the whole model as one stage, for the third.
  const std::string over_one = run(1, 3, "resumed_one", {"--resume", ckpt});
  EXPECT_THAT(over_one, HasSubstr("(3 stages over 3 workers) cut again: 1 stage over 1 worker"));
  const std::vector<double> resumed_one = Losses(dir + "/resumed_one.json");
  ASSERT_EQ(resumed_one.size(), 6u) << over_one;
  // It goes on from the three stages' state after step 12, which is one
  // worker's to rounding only (above): equal to rounding too. (Bit for bit
  // on some CPUs, not on all: the rounding shows or not by step 18.)
  test_support::ExpectSameLosses(resumed_one, std::vector<double>(one.begin() + 12, one.end()),
                                 "as one worker's steps 13-18");
  RestoreTmpdir();
}

// Another --interleave is another cut of the same workers: a GPT saved as
// 2 stages over two workers (1F1B) goes on as 4 (interleaved), its steps
// those of a run that never stopped (the schedule changes where the
// gradients are summed, not what they are).
TEST(ResumeCut, AnotherInterleaveCutsTheSameWorkersAgainAndGoesOnAsUninterrupted) {
  const std::string text = test_support::WriteText("resume_interleave.txt");
  const std::string dir = test_support::FreshDir("resume_interleave");
  setenv("TMPDIR", dir.c_str(), 1);  // (the tokens)
  const std::string ckpt = dir + "/ckpt";
  auto run = [&](int epochs, const std::string& name, std::vector<std::string> more) {
    std::vector<std::string> args = {"--dataset", "text:" + text, "--layers", "4", "--d-model", "32", "--heads",
                                     "2", "--seq-len", "16", "--batch-size", "8", "--train-rows", "48",
                                     "--splits", "2", "--seed", "5", "--epochs", std::to_string(epochs), "--report", dir + "/" + name + ".json"};
    args.insert(args.end(), more.begin(), more.end());
    auto [code, out] = test_support::RunPipeline(2, args);
    EXPECT_EQ(code, 0) << name << "\n" << out;
    return out;
  };
  run(2, "whole", {"--interleave", "1", "--split-at", "3"});
  run(1, "saved", {"--interleave", "1", "--split-at", "3", "--checkpoint-dir", ckpt});
  const std::string out = run(2, "resumed", {"--interleave", "2", "--split-at", "2,3,4", "--resume", ckpt});
  RestoreTmpdir();
  EXPECT_THAT(out, HasSubstr("(2 stages over 2 workers) cut again: 4 stages over 2 workers")) << out;
  EXPECT_THAT(out, HasSubstr("schedule interleaved")) << out;
  const std::vector<double> whole = Losses(dir + "/whole.json");
  const std::vector<double> resumed = Losses(dir + "/resumed.json");
  ASSERT_EQ(whole.size(), 12u);
  ASSERT_EQ(resumed.size(), 6u) << out;
  test_support::ExpectSameLosses(resumed, std::vector<double>(whole.begin() + 6, whole.end()), "steps 7-12");
}

TEST(ResumeCut, StagesGivenCutResumeOverTheirOwnWorkerCountOnly) {
  const std::string dir = test_support::FreshDir("resume_given_cut");
  test_support::WriteToyIdx(dir, 64, 32);  // two batches an epoch
  const std::string ckpt = dir + "/ckpt";
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "resume_given_cut");
  auto [code, out] = RunProgram(test_support::MasterArgv("w1,w2", addr, dir, {"--epochs", "1", "--checkpoint-dir",
                                                                               ckpt}),
                                absl::Seconds(120));
  ASSERT_EQ(code, 0) << out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  // (Refused before any worker is waited for.)
  auto [refused, why] = RunProgram(
      test_support::MasterArgv("w1,w2,w3", absl::StrCat("127.0.0.1:", FreePort()), dir,
                               {"--epochs", "2", "--resume", ckpt}),
      absl::Seconds(60));
  EXPECT_EQ(refused, 2) << why;
  EXPECT_THAT(why, HasSubstr("its stages were given cut (the built-in small CNN's blocks): give 2 workers per "
                             "replica, not 3"));
}

}  // namespace
}  // namespace remora
