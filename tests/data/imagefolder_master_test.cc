// The real programs on image folders: master trains in one process and
// over workers alike, names or skips bad files, learns four classes in
// every mode and resumes a killed run to the same end; a folder without
// val/ trains without a test set or holds a fraction out.
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "data/imagefolder.h"
#include "tests/data/image_files.h"
#include "tests/support/master_runs.h"
#include "tests/support/script_models.h"
#include "tests/support/test_group.h"

namespace remora::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using test_images::FreshImageDir;
using test_images::WriteClassFolders;

// The train_loss of each "epoch=E train_loss=L ..." line of `out`.
std::vector<double> EpochLosses(const std::string& out) {
  std::vector<double> losses;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::ConsumePrefix(&line, "epoch=")) continue;
    const size_t at = line.find(" train_loss=");
    if (at == absl::string_view::npos) continue;
    double loss = 0;
    const absl::string_view rest = line.substr(at + 12);
    if (absl::SimpleAtod(rest.substr(0, rest.find(' ')), &loss)) losses.push_back(loss);
  }
  return losses;
}

// A TorchScript file of Flatten, Linear(3 * 16 * 16, 8), Linear(8, 2).
std::string SmallImageModel() {
  torch::jit::Module model("Sequential"), flat("Flatten");
  flat.define("def forward(self, x):\n  return x.flatten(1)\n");
  model.register_module("f", flat);
  model.register_module("l0", test_support::ScriptLinear(3 * 16 * 16, 8, 1, true));
  model.register_module("l1", test_support::ScriptLinear(8, 2, 2, false));
  model.define("def forward(self, x):\n  x = self.f.forward(x)\n  x = self.l0.forward(x)\n"
               "  return self.l1.forward(x)\n");
  const std::string file = TempPath("imagefolder_model.pt");
  model.save(file);
  return file;
}

int RedOrBlue(int c, int i, int x, int y, int ch) {
  const int base = (ch == 0) == (c == 0) ? 200 : 30;
  return base + (x * 7 + y * 5 + i * 11) % 40;
}

// master --dataset imagefolder:DIR with a one-file model trains in one
// process and as a two-worker pipeline to the same losses (the crops
// depend on the seed, epoch and row only); a damaged file stops the run
// naming it, or is skipped and counted.
TEST(ImageFolderMaster, TrainsLocallyAndOverWorkersAlikeAndNamesBadFiles) {
  const std::string dir = FreshImageDir("master");
  WriteClassFolders(dir, {"red", "blue"}, 6, 2, RedOrBlue);
  const std::string file = SmallImageModel();
  const std::vector<std::string> common = {"--dataset", "imagefolder:" + dir, "--model", file, "--classes", "2",
                                           "--image-size", "16", "--epochs", "2", "--batch-size", "4",
                                           "--data-threads", "2", "--seed", "3", "--lr", "0.0005"};
  auto master = [&](std::vector<std::string> args) {
    args.insert(args.begin(), BinDir() + "/master");
    args.insert(args.end(), common.begin(), common.end());
    return args;
  };
  const std::string tensorboard = TempPath("imagefolder_tensorboard");
  auto [local_code, local_out] = RunProgram(
      master({"--local", "--threads", "1", "--splits", "1", "--tensorboard", tensorboard}), absl::Seconds(120));
  ASSERT_EQ(local_code, 0) << local_out;
  EXPECT_THAT(local_out, HasSubstr(": 12 training and 4 test images of [3, 16, 16]"));
  const std::vector<double> local = EpochLosses(local_out);
  ASSERT_EQ(local.size(), 2u) << local_out;
  // --tensorboard: 3 steps an epoch (12 images, batches of 4), numbered on
  // across epochs, and each epoch's loss as printed (to its 4 decimals).
  const auto steps = test_support::ScalarsIn(tensorboard, "step/loss");
  ASSERT_EQ(steps.size(), 6u);
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i].step, static_cast<int64_t>(i + 1));
  const auto epochs = test_support::ScalarsIn(tensorboard, "epoch/train_loss");
  ASSERT_EQ(epochs.size(), 2u);
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_EQ(epochs[e].step, static_cast<int64_t>(e + 1));
    EXPECT_NEAR(epochs[e].value, local[e], 6e-5);
    EXPECT_NEAR(epochs[e].value, (steps[3 * e].value + steps[3 * e + 1].value + steps[3 * e + 2].value) / 3, 1e-5);
  }
  EXPECT_EQ(test_support::ScalarsIn(tensorboard, "epoch/test_accuracy").size(), 2u);
  EXPECT_EQ(test_support::ScalarsIn(tensorboard, "epoch/test_top5").size(), 2u);

  // Workers w1 and w2 of a master at `at`, one thread each.
  std::vector<std::unique_ptr<launch::Subprocess>> workers;
  auto start_workers = [&workers](const std::string& at, const std::string& log) {
    workers.clear();
    for (const std::string name : {"w1", "w2"}) {
      const std::vector<std::string> argv = {BinDir() + "/worker", "--name", name, "--master", at, "--threads", "1"};
      workers.push_back(launch::Subprocess::Spawn(argv, TempPath(name + log)).value());
    }
  };
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  start_workers(addr, "_imagefolder.log");
  auto [code, out] = RunProgram(master({"--workers", "w1,w2", "--listen", addr, "--splits", "2"}),
                                absl::Seconds(120));
  ASSERT_EQ(code, 0) << out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  const std::vector<double> piped = EpochLosses(out);
  ASSERT_EQ(piped.size(), 2u) << out;
  for (size_t e = 0; e < 2; ++e) EXPECT_NEAR(piped[e], local[e], 1e-4 * std::abs(local[e])) << "epoch " << e + 1;
  EXPECT_THAT(out, HasSubstr(" test_top5="));  // counted on the last stage's worker

  // Without --model: ResNet50, in one process and cut in two over the workers.
  const std::vector<std::string> resnet = {"--dataset", "imagefolder:" + dir, "--image-size", "32", "--epochs", "1",
                                           "--batch-size", "4", "--seed", "3", "--lr", "0.001"};
  // (Two micro-batches both ways: batch norm sees the same rows.)
  std::vector<std::string> resnet_local = {BinDir() + "/master", "--local", "--threads", "1", "--splits", "2"};
  resnet_local.insert(resnet_local.end(), resnet.begin(), resnet.end());
  auto [resnet_code, resnet_out] = RunProgram(resnet_local, absl::Seconds(120));
  ASSERT_EQ(resnet_code, 0) << resnet_out;
  const std::vector<double> resnet_losses = EpochLosses(resnet_out);
  ASSERT_EQ(resnet_losses.size(), 1u) << resnet_out;
  const std::string addr2 = absl::StrCat("127.0.0.1:", FreePort());
  start_workers(addr2, "_imagefolder_resnet.log");
  const std::string ckpt = TempPath("imagefolder_ckpt");
  std::vector<std::string> resnet_piped = {BinDir() + "/master", "--workers", "w1,w2", "--listen", addr2,
                                           "--splits", "2", "--partition", "tutorial", "--checkpoint-dir", ckpt};
  resnet_piped.insert(resnet_piped.end(), resnet.begin(), resnet.end());
  auto [piped_code, piped_out] = RunProgram(resnet_piped, absl::Seconds(180));
  ASSERT_EQ(piped_code, 0) << piped_out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  const std::vector<double> resnet_piped_losses = EpochLosses(piped_out);
  ASSERT_EQ(resnet_piped_losses.size(), 1u) << piped_out;
  EXPECT_NEAR(resnet_piped_losses[0], resnet_losses[0], 1e-3 * std::abs(resnet_losses[0]));
  EXPECT_TRUE(fs::exists(ckpt + "/imagefolder-train.list"));  // a resumed run reads it
  // The evaluator scores the checkpoint on val/ at the training's size.
  auto [eval_code, eval_out] = RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", ckpt, "--dataset",
                                           "imagefolder:" + dir, "--image-size", "32", "--once", "--threads", "1"},
                                          absl::Seconds(120));
  EXPECT_EQ(eval_code, 0) << eval_out;
  EXPECT_THAT(eval_out, HasSubstr("4 test images of imagefolder:"));
  EXPECT_THAT(eval_out, HasSubstr("test_top5="));

  // --train-rows: the first N training images only.
  auto [head_code, head_out] =
      RunProgram(master({"--local", "--splits", "1", "--train-rows", "8"}), absl::Seconds(120));
  EXPECT_EQ(head_code, 0) << head_out;
  EXPECT_THAT(head_out, HasSubstr(": 8 training and 4 test images of [3, 16, 16]"));
  auto [all_code, all_out] =
      RunProgram(master({"--local", "--splits", "1", "--train-rows", "100000"}), absl::Seconds(120));
  EXPECT_EQ(all_code, 0) << all_out;
  EXPECT_THAT(all_out, HasSubstr("master: note: --train-rows 100000 is more than the "));

  std::ofstream(dir + "/train/red/9.jpg") << "\xff\xd8\xff cut short";
  auto [bad_code, bad_out] = RunProgram(master({"--local", "--splits", "1"}), absl::Seconds(120));
  EXPECT_EQ(bad_code, 1) << bad_out;
  EXPECT_THAT(bad_out, HasSubstr("red/9.jpg: a damaged JPEG image"));
  EXPECT_THAT(bad_out, HasSubstr("give --skip-bad-images"));
  auto [skip_code, skip_out] = RunProgram(master({"--local", "--splits", "1", "--skip-bad-images"}),
                                          absl::Seconds(120));
  EXPECT_EQ(skip_code, 0) << skip_out;
  EXPECT_THAT(skip_out, HasSubstr("skipped_images=1"));
  // Over workers, stage 0's worker reads the files itself: the same error
  // from it, and with --skip-bad-images the same count and losses as in
  // one process at two micro-batches (the last stage's worker weights by
  // the rows stage 0's read; a last batch of one row is dropped both ways).
  auto [skip2_code, skip2_out] = RunProgram(master({"--local", "--threads", "1", "--splits", "2",
                                                    "--skip-bad-images"}),
                                            absl::Seconds(120));
  EXPECT_EQ(skip2_code, 0) << skip2_out;
  for (const bool skip : {false, true}) {
    const std::string at = absl::StrCat("127.0.0.1:", FreePort());
    start_workers(at, "_imagefolder_bad.log");
    std::vector<std::string> args = {"--workers", "w1,w2", "--listen", at, "--splits", "2"};
    if (skip) args.push_back("--skip-bad-images");
    auto [over_code, over_out] = RunProgram(master(args), absl::Seconds(120));
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), skip ? 0 : 1);
    if (!skip) {
      EXPECT_EQ(over_code, 1) << over_out;
      EXPECT_THAT(over_out, HasSubstr("reading a batch on worker 'w1'"));
      EXPECT_THAT(over_out, HasSubstr("red/9.jpg: a damaged JPEG image"));
      continue;
    }
    EXPECT_EQ(over_code, 0) << over_out;
    EXPECT_THAT(over_out, HasSubstr("skipped_images=1"));
    const std::vector<double> want = EpochLosses(skip2_out), got = EpochLosses(over_out);
    ASSERT_EQ(got.size(), want.size()) << over_out;
    for (size_t e = 0; e < want.size(); ++e) {
      EXPECT_NEAR(got[e], want[e], 1e-4 * std::abs(want[e])) << "epoch " << e + 1;
    }
  }
}

// Four classes told apart by their colours, under the training recipe's
// crops and flips: a small CNN over two workers learns them well above
// chance (1 in 4), and the parameter server and data parallelism to the
// same losses. A run whose worker is killed after the checkpoint of
// step 8 (of 24), resumed on new workers, ends as the uninterrupted run
// did: the resumed epochs read the same images with the same crops.
TEST(ImageFolderMaster, ACnnLearnsTheClassesInEveryModeAndAResumedRunEndsAsOneThatNeverStopped) {
  const std::string dir = FreshImageDir("learn");
  const int colours[4][3] = {{200, 60, 50}, {50, 190, 70}, {60, 70, 200}, {180, 180, 60}};
  WriteClassFolders(dir, {"class0", "class1", "class2", "class3"}, 12, 4,
                    [&colours](int c, int i, int x, int y, int ch) {
                      return colours[c][ch] + (x * 13 + y * 7 + i * 29 + ch * 5) % 50 - 25;
                    });
  const std::string model = TempPath("imagefolder_cnn.pt");
  test_support::ScriptSmallCnn(4, 5).save(model);
  auto master = [&](const std::string& workers, const std::string& addr, const std::string& ckpt) {
    return std::vector<std::string>{BinDir() + "/master", "--workers", workers, "--listen", addr, "--dataset",
                                    "imagefolder:" + dir, "--model", model, "--classes", "4", "--image-size", "16",
                                    "--epochs", "4", "--batch-size", "8", "--splits", "2", "--data-threads", "2",
                                    "--seed", "1", "--lr", "0.05", "--threads", "1", "--checkpoint-dir", ckpt,
                                    "--checkpoint-every", "4"};
  };
  const std::string whole = test_support::FreshDir("imagefolder_whole");
  const std::string broken = test_support::FreshDir("imagefolder_broken");
  std::string whole_out;
  {
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "imagefolder_whole");
    auto [code, out] = RunProgram(master("w1,w2", addr, whole), absl::Seconds(120));
    ASSERT_EQ(code, 0) << out;
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
    whole_out = out;
  }
  const std::string last = test_support::LineStarting(whole_out, "epoch=4 ");
  const size_t at = last.find("test_accuracy=");
  ASSERT_NE(at, std::string::npos) << whole_out;
  double accuracy = 0;
  ASSERT_TRUE(absl::SimpleAtod(last.substr(at + 14, last.find(' ', at) - at - 14), &accuracy)) << last;
  EXPECT_GE(accuracy, 0.75) << "chance is 0.25:\n" << whole_out;
  // The parameter server and data parallelism (each worker reading its
  // own share of the folder) train to the same losses.
  for (const std::string mode : {"--mode ps", "--replicas 2"}) {
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "imagefolder_mode");
    std::vector<std::string> argv = master("w1,w2", addr, test_support::FreshDir("imagefolder_mode"));
    argv.erase(std::find(argv.begin(), argv.end(), "--splits"), std::find(argv.begin(), argv.end(), "--splits") + 2);
    const std::vector<std::string> flags = absl::StrSplit(mode, ' ');
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto [code, out] = RunProgram(argv, absl::Seconds(120));
    ASSERT_EQ(code, 0) << mode << ":\n" << out;
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
    const std::vector<double> got = EpochLosses(out), want = EpochLosses(whole_out);
    ASSERT_EQ(got.size(), want.size()) << mode << ":\n" << out;
    for (size_t e = 0; e < want.size(); ++e) EXPECT_NEAR(got[e], want[e], 1e-4 * std::abs(want[e])) << mode;
  }
  {
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "imagefolder_broken");
    const std::string log = TempPath("imagefolder_broken_master.log");
    auto job = launch::Subprocess::Spawn(master("w1,w2", addr, broken), log).value();
    AwaitOutput(*job, log, "checkpoint: step 8 ", absl::Seconds(60));
    workers[1]->Signal(SIGKILL);
    ASSERT_NE(job->Wait(absl::Seconds(60)).value_or(-1), 0) << "the run ended before w2 was killed:\n"
                                                            << ReadFile(log);
    workers[0]->Wait(absl::Seconds(30)).IgnoreError();
  }
  {
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = test_support::StartWorkers({"x1", "x2"}, addr, "imagefolder_resumed");
    std::vector<std::string> argv = master("x1,x2", addr, broken);
    argv.insert(argv.end(), {"--resume", broken});
    auto [code, out] = RunProgram(argv, absl::Seconds(120));
    ASSERT_EQ(code, 0) << out;
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
    EXPECT_THAT(out, HasSubstr("resumed from " + broken + "/step-"));
    const std::vector<double> resumed = EpochLosses(out), uninterrupted = EpochLosses(whole_out);
    ASSERT_FALSE(resumed.empty()) << out;
    ASSERT_EQ(uninterrupted.size(), 4u) << whole_out;
    EXPECT_NEAR(resumed.back(), uninterrupted.back(), 1e-5 * std::abs(uninterrupted.back())) << out;
    EXPECT_LT(test_support::CompareStages(whole, broken).largest, 1e-5);
  }
}

// The real programs on a folder of class folders alone (torchvision's
// ImageFolder(root)): without --val-fraction the run trains and says there
// is no test accuracy (none in the report either); with it, stage 0's
// worker reads the training images the master counts, the last stage's
// worker the held-out ones, and the evaluator scores the checkpoint on the
// same held-out images.
TEST(ImageFolderMaster, AFolderWithoutValTrainsWithoutTestOrHoldsAFractionOut) {
  const std::string dir = FreshImageDir("master_flat");
  WriteClassFolders(dir, {"red", "blue"}, 10, 0, RedOrBlue);
  const std::string flat = dir + "/classes";
  fs::rename(dir + "/train", flat);
  fs::remove_all(dir + "/val");
  const std::string model = SmallImageModel();
  auto master = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {BinDir() + "/master", "--dataset", "imagefolder:" + flat, "--model", model,
                                     "--classes", "2", "--image-size", "16", "--epochs", "2", "--batch-size", "4",
                                     "--data-threads", "1", "--seed", "3", "--lr", "0.0005"};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  };
  const std::string report = TempPath("imagefolder_flat_report.json");
  auto [code, out] = RunProgram(master({"--local", "--threads", "1", "--splits", "1", "--report", report}),
                                absl::Seconds(120));
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr(": 20 training images of [3, 16, 16] in 2 classes, no test images ("));
  EXPECT_THAT(out, HasSubstr("--val-fraction"));
  const std::string epoch2 = test_support::LineStarting(out, "epoch=2 ");
  EXPECT_THAT(epoch2, HasSubstr("train_loss="));
  EXPECT_THAT(epoch2, Not(HasSubstr("test_accuracy"))) << out;
  EXPECT_THAT(ReadFile(report), HasSubstr("\"test_accuracy\": null"));
  // ResNet50 (batch norm) over 20 images in batches of 19: the last batch,
  // one row, is dropped rather than failing the epoch (one row has no
  // variance to normalise by).
  auto [resnet_code, resnet_out] =
      RunProgram({BinDir() + "/master", "--local", "--dataset", "imagefolder:" + flat, "--image-size", "32",
                  "--epochs", "1", "--batch-size", "19", "--splits", "1", "--threads", "1", "--data-threads", "1"},
                 absl::Seconds(120));
  ASSERT_EQ(resnet_code, 0) << resnet_out;
  EXPECT_THAT(resnet_out, HasSubstr("epoch=1 train_loss="));

  const int64_t held = static_cast<int64_t>(ListImageFolder(flat, "val", 0.3).value().files.size());
  ASSERT_GT(held, 0);
  ASSERT_LT(held, 20);
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "imagefolder_flat");
  const std::string ckpt = test_support::FreshDir("imagefolder_flat_ckpt");
  auto [piped_code, piped_out] = RunProgram(master({"--workers", "w1,w2", "--listen", addr, "--splits", "2",
                                                    "--threads", "1", "--val-fraction", "0.3", "--checkpoint-dir",
                                                    ckpt}),
                                            absl::Seconds(120));
  ASSERT_EQ(piped_code, 0) << piped_out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  EXPECT_THAT(piped_out, HasSubstr(absl::StrCat(": ", 20 - held, " training and ", held, " test images")));
  EXPECT_THAT(piped_out, HasSubstr("data: read on w1"));
  EXPECT_THAT(test_support::LineStarting(piped_out, "epoch=2 "), HasSubstr(" test_accuracy="));
  auto [eval_code, eval_out] =
      RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", ckpt, "--dataset", "imagefolder:" + flat,
                  "--image-size", "16", "--val-fraction", "0.3", "--once", "--threads", "1"},
                 absl::Seconds(120));
  EXPECT_EQ(eval_code, 0) << eval_out;
  EXPECT_THAT(eval_out, HasSubstr(absl::StrCat(held, " test images of imagefolder:")));
  // Without --image-size and --val-fraction: the training's, read from the
  // checkpoint (the same score, so not recorded twice); another fraction
  // would score images the model trained on: refused.
  auto [taken_code, taken_out] = RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", ckpt, "--dataset",
                                             "imagefolder:" + flat, "--once", "--threads", "1"},
                                            absl::Seconds(60));
  EXPECT_EQ(taken_code, 0) << taken_out;
  EXPECT_THAT(taken_out, HasSubstr("evaluator: --image-size 16 --val-fraction 0.3, the training's ("));
  EXPECT_THAT(taken_out, HasSubstr("/eval.jsonl already)"));
  auto [other_code, other_out] = RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", ckpt, "--dataset",
                                             "imagefolder:" + flat, "--val-fraction", "0.5", "--once"},
                                            absl::Seconds(60));
  EXPECT_EQ(other_code, 1) << other_out;
  EXPECT_THAT(other_out, HasSubstr("was trained with --val-fraction 0.3 of the folder held out; the evaluator's is "
                                   "0.5, which scores other images: give --val-fraction 0.3"));
  // Its help has the flag, and no group's environment (it joins none).
  auto [help_code, help_out] = RunProgram({BinDir() + "/evaluator", "--help"}, absl::Seconds(30));
  EXPECT_EQ(help_code, 0);
  EXPECT_THAT(help_out, HasSubstr("--val-fraction"));
  EXPECT_THAT(help_out, Not(HasSubstr("MASTER_ADDR")));
  // A fraction where the other datasets have their own test set: refused.
  auto [bad_code, bad_out] = RunProgram({BinDir() + "/master", "--local", "--dataset", "fashion-mnist",
                                         "--val-fraction", "0.1"},
                                        absl::Seconds(60));
  EXPECT_EQ(bad_code, 2) << bad_out;
  EXPECT_THAT(bad_out, HasSubstr("--val-fraction holds images out of an image folder"));
  // And beside a val/ folder: a bad flag too, found before anything runs
  // (it exited 1 once the folder was read).
  const std::string split = FreshImageDir("master_split");
  WriteClassFolders(split, {"red", "blue"}, 2, 1, RedOrBlue);
  auto [beside_code, beside_out] =
      RunProgram({BinDir() + "/master", "--local", "--dataset", "imagefolder:" + split, "--model", model,
                  "--classes", "2", "--image-size", "16", "--val-fraction", "0.2"},
                 absl::Seconds(60));
  EXPECT_EQ(beside_code, 2) << beside_out;
  EXPECT_THAT(beside_out, HasSubstr("has val/: a val fraction holds training images out only where there is no "
                                    "val/ folder"));
  // The evaluator too, before it waits for a checkpoint.
  auto [eval_beside_code, eval_beside_out] =
      RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", TempPath("no_checkpoint_yet"), "--dataset",
                  "imagefolder:" + split, "--image-size", "16", "--val-fraction", "0.2", "--once"},
                 absl::Seconds(60));
  EXPECT_EQ(eval_beside_code, 2) << eval_beside_out;
  EXPECT_THAT(eval_beside_out, HasSubstr("has val/: a val fraction holds training images out"));
  // An unreadable test image stops the evaluator naming it, or with
  // --skip-bad-images is left out and counted (scored on another folder:
  // the training's fraction is not taken).
  std::ofstream(split + "/val/red/damaged.jpg") << "not an image";
  const std::vector<std::string> on_split = {BinDir() + "/evaluator", "--checkpoint-dir", ckpt, "--dataset",
                                             "imagefolder:" + split, "--once", "--threads", "1"};
  auto [damaged_code, damaged_out] = RunProgram(on_split, absl::Seconds(60));
  EXPECT_EQ(damaged_code, 1) << damaged_out;
  EXPECT_THAT(damaged_out, HasSubstr("damaged.jpg"));
  EXPECT_THAT(damaged_out, HasSubstr("give --skip-bad-images"));
  std::vector<std::string> skipping = on_split;
  skipping.push_back("--skip-bad-images");
  auto [skip_code, skip_out] = RunProgram(skipping, absl::Seconds(60));
  EXPECT_EQ(skip_code, 0) << skip_out;
  EXPECT_THAT(skip_out, HasSubstr("evaluator: --image-size 16, the training's ("));
  EXPECT_THAT(skip_out, HasSubstr(" skipped_images=1"));
}

// data_bench reads a folder's training images at each --data-threads
// count and prints the rate; an --image-size outside master's range is a
// bad flag (100000 aborted it, allocating 120 GB).
TEST(DataBench, ReadsAFolderAndRefusesSizesMasterWouldRefuse) {
  const std::string dir = FreshImageDir("data_bench");
  WriteClassFolders(dir, {"red", "blue"}, 4, 1, RedOrBlue);
  auto [code, out] = RunProgram({BinDir() + "/data_bench", "--dataset", "imagefolder:" + dir, "--image-size", "16",
                                 "--batch-size", "4", "--batches", "2", "--data-threads", "1,2"},
                                absl::Seconds(60));
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("threads=1 images=8 "));
  EXPECT_THAT(out, HasSubstr("threads=2 images=8 "));
  for (const char* size : {"100000", "0"}) {
    auto [bad_code, bad_out] = RunProgram({BinDir() + "/data_bench", "--dataset", "imagefolder:" + dir,
                                           "--image-size", size}, absl::Seconds(60));
    EXPECT_EQ(bad_code, 2) << bad_out;
    EXPECT_THAT(bad_out, HasSubstr("--image-size must be in [16, 1024]")) << bad_out;
  }
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--threads", "0"}, "--threads wants integers in [1, 256]; got '0'"},
           {{"--dir", dir + "/other"}, "name two folders: give one"}}) {
    std::vector<std::string> argv = {BinDir() + "/data_bench", "--dataset", "imagefolder:" + dir};
    argv.insert(argv.end(), args.begin(), args.end());
    auto [bad_code, bad_out] = RunProgram(argv, absl::Seconds(60));
    EXPECT_EQ(bad_code, 2) << bad_out;
    EXPECT_THAT(bad_out, HasSubstr(says)) << bad_out;
  }
}

// A fresh run lists the folder again: the listing an earlier run left in
// --checkpoint-dir (here one refused for its class count) is not reused
// once the folder is mended; the error names the class folders.
TEST(ImageFolderMaster, AFreshRunListsTheFolderAgain) {
  const std::string dir = FreshImageDir("relisted");
  WriteClassFolders(dir, {"red", "blue", "stray"}, 2, 1, RedOrBlue);
  const std::string ckpt = TempPath("relisted_ckpt");
  fs::remove_all(ckpt);
  const std::vector<std::string> args = {"--dataset", "imagefolder:" + dir, "--model", SmallImageModel(),
                                         "--classes", "2", "--image-size", "16", "--epochs", "1", "--batch-size",
                                         "2", "--splits", "1", "--data-threads", "1", "--checkpoint-dir", ckpt};
  // (It fails listing the folder, before it waits for any worker.)
  std::vector<std::string> alone = {BinDir() + "/master", "--workers", "w1,w2", "--listen",
                                    absl::StrCat("127.0.0.1:", FreePort())};
  alone.insert(alone.end(), args.begin(), args.end());
  auto [code, out] = RunProgram(alone, absl::Seconds(120));
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("has 3 class folders (blue, red, stray); --classes is 2: give --classes 3"));
  fs::remove_all(dir + "/train/stray");
  fs::remove_all(dir + "/val/stray");
  std::ofstream(dir + "/train/red/notes.txt") << "not an image: counted, not read";
  auto [again, again_out] = test_support::RunPipeline(2, args);
  EXPECT_EQ(again, 0) << again_out;
  EXPECT_THAT(again_out, HasSubstr(": 4 training and 2 test images of [3, 16, 16] in 2 classes; 1 other file is "
                                   "not read (not .jpg, .jpeg or .png), e.g. red/notes.txt"));
}

// A folder whose every file is unreadable trains nothing even with
// --skip-bad-images: an error (its loss printed as 0.0000, exit 0, before),
// in master and in data_bench alike.
TEST(ImageFolderMaster, AnEpochWhoseImagesAreAllSkippedIsAnError) {
  const std::string dir = FreshImageDir("all_bad");
  for (const char* file : {"/train/cat/0.jpg", "/train/dog/0.jpg"}) {
    std::filesystem::create_directories(std::filesystem::path(dir + file).parent_path());
    std::ofstream(dir + file) << "not an image";
  }
  auto [code, out] = RunProgram({BinDir() + "/master", "--local", "--dataset", "imagefolder:" + dir, "--image-size",
                                 "32", "--batch-size", "2", "--splits", "1", "--epochs", "1", "--threads", "1",
                                 "--skip-bad-images"},
                                absl::Seconds(120));
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("epoch 1 trained no image: all 2 of its images were skipped as unreadable"));
  auto [bench_code, bench_out] = RunProgram({BinDir() + "/data_bench", "--dataset", "imagefolder:" + dir,
                                             "--image-size", "16", "--batch-size", "2", "--batches", "1",
                                             "--data-threads", "1", "--skip-bad-images"},
                                            absl::Seconds(60));
  EXPECT_EQ(bench_code, 1) << bench_out;
  EXPECT_THAT(bench_out, HasSubstr("no image of " + dir + " could be read: all 2 were skipped"));
}

}  // namespace
}  // namespace remora::data
