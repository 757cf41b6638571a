// A language model from a text file, as a user runs it: master --dataset
// text:PATH trains the built-in GPT in one process, as a pipeline over
// real workers and with the parameter server to the same losses, reports
// the held-out loss, perplexity and tokens a second everywhere it reports,
// and says what is wrong with a text it cannot take; generate samples
// text from the pipeline's checkpoint. A scripted language model of one's
// own (--model) is cut at its blocks and trains on the text too. A
// SentencePiece model (--tokenizer) gives the tokens in every program.
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "launch/cli.h"
#include "tests/support/master_runs.h"
#include "tests/support/script_models.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

namespace fs = std::filesystem;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;

TEST(TextMaster, AGptTrainsOverWorkersAsInOneProcessAndReportsPerplexity) {
  const std::string text = test_support::WriteText("gpt_text.txt");
  const std::vector<std::string> common = {"--dataset", "text:" + text, "--layers", "2", "--d-model", "32",
                                           "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--epochs", "2",
                                           "--train-rows", "48", "--seed", "5", "--lr-schedule", "cosine",
                                           "--warmup-steps", "3", "--eval-every", "5"};
  auto master = [&](std::vector<std::string> args) {
    args.insert(args.begin(), BinDir() + "/master");
    args.insert(args.end(), common.begin(), common.end());
    return args;
  };
  const std::string local_dir = test_support::FreshDir("gpt_local");
  const std::string tensorboard = test_support::FreshDir("gpt_tensorboard");
  const std::string local_report = local_dir + "/report.json";
  // (Without --checkpoint-dir the tokens go to the temporary directory.)
  setenv("TMPDIR", local_dir.c_str(), 1);
  const std::string curves = local_dir + "/curves.svg";
  auto [local_code, local_out] =
      RunProgram(master({"--local", "--threads", "1", "--splits", "2", "--tensorboard", tensorboard, "--report",
                         local_report, "--peak-tflops", "1", "--curves", curves}),
                 absl::Seconds(180));
  RestoreTmpdir();
  ASSERT_EQ(local_code, 0) << local_out;
  // The text tokenised once; 5% held out.
  EXPECT_THAT(local_out, HasSubstr("tokens (bytes: vocabulary 256; written to " + local_dir + "/remora-"));
  EXPECT_THAT(local_out, HasSubstr(", 48 training windows of 16 tokens an epoch, "));
  EXPECT_THAT(local_out, HasSubstr("held-out windows (the last 5%)"));
  EXPECT_THAT(local_out, HasSubstr("local: splits=2 (2 micro-batches of 4 windows), 1 thread"));
  // Warm-up, then half a cosine to lr / 10 at the run's last step (6
  // batches an epoch): the pipeline's and the parameter server's owners
  // below step by the same rates, or their losses would differ.
  EXPECT_THAT(local_out, HasSubstr("learning rate: cosine from 0.001 after 3 warm-up steps, down to 0.0001 at step 12"));
  const std::vector<double> losses = test_support::EpochField(local_out, "train_loss");
  const std::vector<double> test_losses = test_support::EpochField(local_out, "test_loss");
  const std::vector<double> perplexity = test_support::EpochField(local_out, "test_perplexity");
  const std::vector<double> tokens = test_support::EpochField(local_out, "tokens_per_second");
  ASSERT_EQ(losses.size(), 2u) << local_out;
  ASSERT_EQ(test_losses.size(), 2u);
  // From about ln 256 (every byte alike) down, and each epoch lower.
  EXPECT_LT(losses[0], std::log(256.0) + 0.2) << local_out;
  EXPECT_LT(losses[1], losses[0]) << local_out;
  EXPECT_LT(test_losses[1], test_losses[0]) << local_out;
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_NEAR(perplexity[e], std::exp(test_losses[e]), 2e-3 * perplexity[e]) << local_out;
    EXPECT_GT(tokens[e], 0) << local_out;
  }
  EXPECT_THAT(local_out, HasSubstr(" training FLOPs a token, "));
  EXPECT_THAT(local_out, HasSubstr("model FLOPs utilisation"));
  const std::string report = ReadFile(local_report);
  EXPECT_THAT(report, HasSubstr("\"tokens_per_second\": "));
  EXPECT_THAT(report, HasSubstr("\"test_perplexity\": "));
  EXPECT_EQ(test_support::ScalarsIn(tensorboard, "epoch/test_perplexity").size(), 2u);
  EXPECT_EQ(test_support::ScalarsIn(tensorboard, "epoch/test_loss").size(), 2u);
  EXPECT_EQ(test_support::ScalarsIn(tensorboard, "step/tokens_per_second").size(), 12u);
  // --eval-every 5: the held-out windows evaluated after steps 5 and 10
  // too, within the epochs.
  const std::vector<double> step_test_losses = test_support::EpochField(local_out, "test_loss", "step=");
  ASSERT_EQ(step_test_losses.size(), 2u) << local_out;
  EXPECT_THAT(local_out, HasSubstr("\nstep=5 test_accuracy="));
  EXPECT_THAT(local_out, HasSubstr("\nstep=10 test_accuracy="));
  EXPECT_EQ(test_support::ScalarsIn(tensorboard, "step/test_perplexity").size(), 2u);
  EXPECT_THAT(report, HasSubstr("\"step_evals\": [{\"step\": 5, \"test_accuracy\": "));
  // The curves draw the held-out perplexity, not an accuracy.
  const std::string svg = ReadFile(curves);
  EXPECT_THAT(svg, HasSubstr("held-out perplexity"));
  EXPECT_THAT(svg, ::testing::Not(HasSubstr("test accuracy")));

  // Over two workers: stage 0's worker reads its windows, the targets go
  // to the last stage's worker, and the losses are one process's.
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "gpt");
  const std::string piped_dir = test_support::FreshDir("gpt_piped");
  auto [code, out] = RunProgram(
      master({"--workers", "w1,w2", "--listen", addr, "--splits", "2", "--checkpoint-dir", piped_dir + "/ckpt"}),
      absl::Seconds(180));
  ASSERT_EQ(code, 0) << out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  // The partitioner measures the four parts' cost (embedding, 2 blocks,
  // head) on the workers and cuts them into two stages a worker
  // (interleaved).
  EXPECT_THAT(out, HasSubstr("measuring per-layer cost of Gpt"));
  EXPECT_THAT(out, HasSubstr("over 2 workers, 4 stages"));
  const std::vector<double> piped = test_support::EpochField(out, "train_loss");
  const std::vector<double> piped_test = test_support::EpochField(out, "test_loss");
  ASSERT_EQ(piped.size(), 2u) << out;
  ASSERT_EQ(piped_test.size(), 2u) << out;
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_NEAR(piped[e], losses[e], 1e-4 * losses[e]) << "epoch " << e + 1 << "\n" << out;
    EXPECT_NEAR(piped_test[e], test_losses[e], 1e-4 * test_losses[e]) << "epoch " << e + 1 << "\n" << out;
  }
  EXPECT_TRUE(fs::exists(piped_dir + "/ckpt/text.tokens"));
  // The evaluator scores the final checkpoint on the held-out windows as
  // the run's last epoch did, taking the windows' length and the held-out
  // share from the checkpoint.
  auto [eval_code, eval_out] = RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", piped_dir + "/ckpt", "--dataset",
                                           "text:" + text, "--once", "--threads", "1"},
                                          absl::Seconds(60));
  ASSERT_EQ(eval_code, 0) << eval_out;
  EXPECT_THAT(eval_out, HasSubstr("evaluator: --seq-len 16 --val-fraction 0.05, the training's"));
  const std::vector<double> scored = test_support::EpochField(eval_out, "test_loss", "step=");
  ASSERT_EQ(scored.size(), 1u) << eval_out;
  EXPECT_NEAR(scored[0], piped_test[1], 1e-4 * piped_test[1]) << eval_out;
  EXPECT_NEAR(test_support::EpochField(eval_out, "test_perplexity", "step=")[0], std::exp(scored[0]), 1e-3 * std::exp(scored[0]));
  EXPECT_THAT(ReadFile(piped_dir + "/ckpt/eval.jsonl"), HasSubstr("\"test_perplexity\": "));
  auto [other_code, other_out] = RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", piped_dir + "/ckpt",
                                             "--dataset", "text:" + text, "--once", "--seq-len", "8"},
                                            absl::Seconds(60));
  EXPECT_EQ(other_code, 1) << other_out;
  EXPECT_THAT(other_out, HasSubstr("was trained on windows of 16 tokens; the evaluator's --seq-len is 8"));
  const std::vector<double> piped_step_tests = test_support::EpochField(out, "test_loss", "step=");
  ASSERT_EQ(piped_step_tests.size(), 2u) << out;
  for (size_t k = 0; k < 2; ++k) EXPECT_NEAR(piped_step_tests[k], step_test_losses[k], 1e-4 * step_test_losses[k]);

  // generate: the pipeline's checkpoint (four stages) sampled in one
  // process; the same seed, the same text; temperature 0, the likeliest.
  auto generate = [&](std::vector<std::string> more) {
    std::vector<std::string> argv = {BinDir() + "/generate", "--checkpoint-dir", piped_dir + "/ckpt", "--prompt",
                                     "the ", "--tokens", "40"};
    argv.insert(argv.end(), more.begin(), more.end());
    return RunProgram(argv, absl::Seconds(60));
  };
  // (The text: what follows the line that says what was loaded.)
  auto text_of = [](const std::string& out) { return out.substr(out.find('\n') + 1); };
  auto [gen_code, sample] = generate({"--seed", "3", "--top-k", "20"});
  ASSERT_EQ(gen_code, 0) << sample;
  EXPECT_THAT(sample, HasSubstr("a GPT of context 16 tokens in 4 stages; 40 tokens at temperature 0.8, top-k 20"));
  EXPECT_EQ(text_of(sample).substr(0, 4), "the ") << sample;
  // 40 byte tokens: 10 to 40 characters (a byte that starts no UTF-8
  // character is shown as U+FFFD, one character of three bytes).
  const std::string sampled = text_of(sample);
  const auto characters = std::count_if(sampled.begin(), sampled.end(), [](char ch) { return (ch & 0xC0) != 0x80; });
  EXPECT_LE(characters, 4 + 40 + 1) << sample;
  EXPECT_GE(characters, 4 + 10 + 1) << sample;
  EXPECT_EQ(generate({"--seed", "3", "--top-k", "20"}).second, sample);
  EXPECT_NE(text_of(generate({"--seed", "4", "--top-k", "20"}).second), text_of(sample));
  auto [greedy_code, greedy] = generate({"--temperature", "0"});
  EXPECT_EQ(greedy_code, 0) << greedy;
  EXPECT_EQ(text_of(generate({"--temperature", "0", "--seed", "9"}).second), text_of(greedy));
  EXPECT_EQ(generate({"--tokens", "0"}).first, 2);
  auto [none_code, none] = RunProgram(
      {BinDir() + "/generate", "--checkpoint-dir", TempPath("no_checkpoints_here"), "--tokens", "4"}, absl::Seconds(60));
  EXPECT_EQ(none_code, 1) << none;

  // The parameter server: each worker computes its share of a batch with
  // the same loss.
  // (Without --checkpoint-dir the master and workers put the tokens in
  // the temporary directory: the test's own.)
  const std::string ps_addr = absl::StrCat("127.0.0.1:", FreePort());
  setenv("TMPDIR", test_support::FreshDir("gpt_ps_tmp").c_str(), 1);
  workers = test_support::StartWorkers({"w1", "w2"}, ps_addr, "gpt_ps");
  auto [ps_code, ps_out] = RunProgram(master({"--workers", "w1,w2", "--listen", ps_addr, "--mode", "ps"}),
                                      absl::Seconds(180));
  RestoreTmpdir();
  ASSERT_EQ(ps_code, 0) << ps_out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  const std::vector<double> ps_losses = test_support::EpochField(ps_out, "train_loss");
  ASSERT_EQ(ps_losses.size(), 2u) << ps_out;
  for (size_t e = 0; e < 2; ++e) EXPECT_NEAR(ps_losses[e], losses[e], 1e-4 * losses[e]) << ps_out;

  // --precision bf16 over the workers: near the float32 run's losses (bf16
  // rounds the matrix products and what crosses a boundary).
  const std::string bf16_addr = absl::StrCat("127.0.0.1:", FreePort());
  workers = test_support::StartWorkers({"w1", "w2"}, bf16_addr, "gpt_bf16");
  auto [bf16_code, bf16_out] = RunProgram(
      master({"--workers", "w1,w2", "--listen", bf16_addr, "--splits", "2", "--precision", "bf16", "--checkpoint-dir",
              test_support::FreshDir("gpt_bf16") + "/ckpt"}),
      absl::Seconds(180));
  ASSERT_EQ(bf16_code, 0) << bf16_out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  const std::vector<double> bf16_losses = test_support::EpochField(bf16_out, "train_loss");
  ASSERT_EQ(bf16_losses.size(), 2u) << bf16_out;
  for (size_t e = 0; e < 2; ++e) EXPECT_NEAR(bf16_losses[e], losses[e], 1e-2 * losses[e]) << bf16_out;
}

// A language model of one's own, as PyTorch scripts it (nanoGPT's shape:
// token and position embeddings summed in its forward, blocks that add to
// a residual stream, a head; its forward returns the logits), trains on
// the text as a one-file --model: the master cuts its forward at the
// blocks and the pipeline's losses are one process's.
TEST(TextMaster, AScriptedLanguageModelIsCutAtItsBlocksAndTrainsAsInOneProcess) {
  torch::jit::Module gpt = test_support::ScriptByteGpt(R"(def forward(self, idx):
  pos = torch.arange(idx.size(1))
  x = self.wte.forward(idx) + torch.embedding(self.wpe, pos)
  x = self.h0.forward(x)
  x = self.h1.forward(x)
  return self.head.forward(x)
)");
  const std::string model = TempPath("scripted_gpt.pt");
  gpt.save(model);
  const std::string text = test_support::WriteText("scripted_gpt.txt");
  const std::string dir = test_support::FreshDir("scripted_gpt");
  const std::vector<std::string> common = {"--model", model, "--dataset", "text:" + text, "--seq-len", "16",
                                           "--batch-size", "8", "--epochs", "2", "--train-rows", "32", "--seed", "5",
                                           "--splits", "2"};
  // (The tokens go to the temporary directory: the test's own.)
  setenv("TMPDIR", dir.c_str(), 1);
  auto master = [&](std::vector<std::string> args) {
    args.insert(args.begin(), BinDir() + "/master");
    args.insert(args.end(), common.begin(), common.end());
    return args;
  };
  auto [local_code, local_out] = RunProgram(master({"--local", "--threads", "1"}), absl::Seconds(180));
  ASSERT_EQ(local_code, 0) << local_out;
  const std::vector<double> losses = test_support::EpochField(local_out, "train_loss");
  ASSERT_EQ(losses.size(), 2u) << local_out;
  EXPECT_LT(losses[1], losses[0]) << local_out;
  EXPECT_THAT(local_out, HasSubstr("tokens/s"));
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "scripted_gpt");
  auto [code, out] = RunProgram(master({"--workers", "w1,w2", "--listen", addr, "--interleave", "1"}),
                                absl::Seconds(180));
  ASSERT_EQ(code, 0) << out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  // Its layers: the embeddings, each block, the head.
  EXPECT_THAT(out, HasSubstr("measuring per-layer cost of " + model));
  EXPECT_THAT(out, HasSubstr("over 2 workers, 2 stages"));
  const std::vector<double> piped = test_support::EpochField(out, "train_loss");
  const std::vector<double> piped_test = test_support::EpochField(out, "test_loss");
  const std::vector<double> local_test = test_support::EpochField(local_out, "test_loss");
  ASSERT_EQ(piped.size(), 2u) << out;
  ASSERT_EQ(piped_test.size(), 2u) << out;
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_NEAR(piped[e], losses[e], 1e-4 * losses[e]) << "epoch " << e + 1 << "\n" << out;
    EXPECT_NEAR(piped_test[e], local_test[e], 1e-4 * local_test[e]) << "epoch " << e + 1 << "\n" << out;
  }
  RestoreTmpdir();
}

// --splits auto: the master times the GPT's parts at two micro-batch sizes
// and a crossing, predicts every schedule at every count, trains under the
// fastest and prints the prediction beside the measured step; the planned
// run's losses are one process's at the planned count.
TEST(TextMaster, SplitsAutoPlansScheduleAndCountAndTrainsAsInOneProcess) {
  const std::string text = test_support::WriteText("gpt_plan.txt");
  const std::string dir = test_support::FreshDir("gpt_plan");
  setenv("TMPDIR", dir.c_str(), 1);  // (the tokens)
  const std::vector<std::string> common = {"--dataset", "text:" + text, "--layers", "2", "--d-model", "32",
                                           "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--epochs", "1",
                                           "--train-rows", "48", "--seed", "5"};
  auto master = [&](std::vector<std::string> args) {
    args.insert(args.begin(), BinDir() + "/master");
    args.insert(args.end(), common.begin(), common.end());
    return args;
  };
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "gpt_plan");
  auto [code, out] = RunProgram(
      master({"--workers", "w1,w2", "--listen", addr, "--splits", "auto", "--checkpoint-dir", dir + "/ckpt"}),
      absl::Seconds(180));
  ASSERT_EQ(code, 0) << out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  EXPECT_THAT(out, HasSubstr("planning: timing each layer of Gpt"));
  EXPECT_THAT(out, HasSubstr("(forward, B and W) at 2 and 8 rows on w1, w2 at once, and a crossing"));
  EXPECT_THAT(out, ContainsRegex("of the layers' time as timed, F [0-9]+%, B [0-9]+%, W [0-9]+%"));
  // Four schedules at 1, 2 and 4 micro-batches (2 rows or more each), one
  // of them chosen.
  int rows = 0, chosen = 0;
  for (const absl::string_view line : absl::StrSplit(out, '\n')) {
    for (const char* name : {"1f1b", "interleaved", "zb1p", "zbv"}) {
      for (int m : {1, 2, 4}) {
        if (line.size() > 2 && absl::StartsWith(line.substr(2), absl::StrFormat("%-12s %6d ", name, m))) {
          ++rows;
          chosen += absl::StartsWith(line, "* ");
        }
      }
    }
  }
  EXPECT_EQ(rows, 12) << out;
  EXPECT_EQ(chosen, 1) << out;
  const size_t at = out.find("plan: --schedule ");
  ASSERT_NE(at, std::string::npos) << out;
  char schedule[32] = {0};
  int splits = 0;
  ASSERT_EQ(std::sscanf(out.c_str() + at, "plan: --schedule %31s --splits %d", schedule, &splits), 2) << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("pipeline: splits=", splits, " (")));
  EXPECT_THAT(out, HasSubstr("ms a step, measured "));
  // Its checkpoint records the plan: the run goes on under the schedule and
  // count printed.
  const std::string again_addr = absl::StrCat("127.0.0.1:", FreePort());
  workers = test_support::StartWorkers({"w1", "w2"}, again_addr, "gpt_plan_resumed");
  std::vector<std::string> resume = master({"--workers", "w1,w2", "--listen", again_addr, "--resume", dir + "/ckpt",
                                            "--schedule", schedule, "--splits", std::to_string(splits)});
  resume.insert(resume.end(), {"--epochs", "2"});
  auto [resumed_code, resumed_out] = RunProgram(resume, absl::Seconds(180));
  EXPECT_EQ(resumed_code, 0) << resumed_out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  EXPECT_THAT(resumed_out, HasSubstr("epoch=2 train_loss=")) << resumed_out;
  auto [local_code, local_out] =
      RunProgram(master({"--local", "--threads", "1", "--splits", std::to_string(splits)}), absl::Seconds(180));
  RestoreTmpdir();
  ASSERT_EQ(local_code, 0) << local_out;
  const std::vector<double> piped = test_support::EpochField(out, "train_loss");
  const std::vector<double> local = test_support::EpochField(local_out, "train_loss");
  ASSERT_EQ(piped.size(), 1u) << out;
  ASSERT_EQ(local.size(), 1u) << local_out;
  EXPECT_NEAR(piped[0], local[0], 1e-4 * local[0]) << schedule << " at " << splits << "\n" << out;
}

// --tokenizer: the text as a SentencePiece model's tokens (spm_train made
// it), on the master and the workers alike; the GPT's vocabulary is the
// model's; generate reads and writes text through it. The runs train with
// AdamW (the matrices decaying) and the gradients clipped over the whole
// model, in one process as over the workers.
TEST(TextMaster, ASentencePieceTokenizerTrainsOverWorkersAsInOneProcessAndGenerateSpeaksIt) {
  if (std::system("command -v spm_train >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "spm_train (Debian's sentencepiece) is not installed";
  }
  const std::string text = test_support::WriteText("spm_text.txt");
  const std::string dir = test_support::FreshDir("gpt_spm");
  ASSERT_EQ(std::system(("spm_train --input=" + text + " --model_prefix=" + dir +
                         "/spm --vocab_size=80 --model_type=bpe --minloglevel=2")
                            .c_str()),
            0);
  const std::string model = dir + "/spm.model";
  const std::vector<std::string> common = {"--dataset", "text:" + text, "--tokenizer", model, "--layers", "1",
                                           "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "8",
                                           "--epochs", "2", "--train-rows", "32", "--seed", "3",
                                           "--optimizer", "adamw", "--clip-grad-norm", "0.5"};
  auto master = [&](std::vector<std::string> args) {
    args.insert(args.begin(), BinDir() + "/master");
    args.insert(args.end(), common.begin(), common.end());
    return args;
  };
  // (In one process the tokens go to the temporary directory.)
  fs::create_directories(dir + "/tmp");
  setenv("TMPDIR", (dir + "/tmp").c_str(), 1);
  const std::string local_board = dir + "/local_board", piped_board = dir + "/piped_board";
  auto [local_code, local_out] = RunProgram(
      master({"--local", "--threads", "1", "--splits", "2", "--tensorboard", local_board}), absl::Seconds(180));
  ASSERT_EQ(local_code, 0) << local_out;
  EXPECT_THAT(local_out,
              HasSubstr("tokens (SentencePiece " + model + ": vocabulary 80; written to " + dir + "/tmp/remora-"));
  const std::vector<double> losses = test_support::EpochField(local_out, "train_loss");
  ASSERT_EQ(losses.size(), 2u) << local_out;
  EXPECT_LT(losses[0], std::log(80.0) + 0.3) << local_out;  // (ln 256 would be 5.5)
  EXPECT_LT(losses[1], losses[0]) << local_out;

  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "gpt_spm");
  auto [code, out] = RunProgram(master({"--workers", "w1,w2", "--listen", addr, "--splits", "2", "--checkpoint-dir",
                                        dir + "/piped", "--report", dir + "/plain.json", "--tensorboard", piped_board}),
                                absl::Seconds(180));
  ASSERT_EQ(code, 0) << out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  const std::vector<double> piped = test_support::EpochField(out, "train_loss");
  ASSERT_EQ(piped.size(), 2u) << out;
  for (size_t e = 0; e < 2; ++e) EXPECT_NEAR(piped[e], losses[e], 1e-4 * losses[e]) << "epoch " << e + 1 << "\n" << out;
  // Each step's gradient norm before clipping: in the progress lines and
  // TensorBoard, the workers' the one process's.
  EXPECT_THAT(out, HasSubstr(" grad_norm="));
  EXPECT_THAT(local_out, HasSubstr(" grad_norm="));
  const auto local_norms = test_support::ScalarsIn(local_board, "step/grad_norm");
  const auto piped_norms = test_support::ScalarsIn(piped_board, "step/grad_norm");
  ASSERT_EQ(local_norms.size(), 8u);  // (2 epochs of 32 rows in batches of 8)
  ASSERT_EQ(piped_norms.size(), local_norms.size());
  for (size_t i = 0; i < local_norms.size(); ++i) {
    EXPECT_GT(local_norms[i].value, 0) << "step " << i + 1;
    EXPECT_NEAR(piped_norms[i].value, local_norms[i].value, 1e-4 * local_norms[i].value) << "step " << i + 1;
  }

  // --recompute: the same losses to the last digit printed, with less
  // held between the passes (the report's peaks, all stages together:
  // with a model this small, each micro-batch's input, generator state and
  // output are much of what is held).
  auto peaks = [](const std::string& report) {
    int64_t sum = 0;
    for (size_t at = report.find("\"peak_activation_bytes\": "); at != std::string::npos;
         at = report.find("\"peak_activation_bytes\": ", at + 1)) {
      sum += std::stoll(report.substr(at + std::strlen("\"peak_activation_bytes\": ")));
    }
    return sum;
  };
  const std::string again_addr = absl::StrCat("127.0.0.1:", FreePort());
  workers = test_support::StartWorkers({"w1", "w2"}, again_addr, "gpt_spm_recompute");
  auto [re_code, re_out] = RunProgram(master({"--workers", "w1,w2", "--listen", again_addr, "--splits", "2",
                                              "--report", dir + "/recomputed.json", "--recompute"}),
                                      absl::Seconds(180));
  ASSERT_EQ(re_code, 0) << re_out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  EXPECT_EQ(test_support::EpochField(re_out, "train_loss"), piped) << re_out;
  EXPECT_EQ(test_support::EpochField(re_out, "test_loss"), test_support::EpochField(out, "test_loss")) << re_out;
  const int64_t plain_peak = peaks(ReadFile(dir + "/plain.json")), re_peak = peaks(ReadFile(dir + "/recomputed.json"));
  EXPECT_GT(plain_peak, 0);
  // (Under half when the machine is quiet; the peak moves with when a
  // finished backward pass frees what it held, so under load it was 56%.)
  EXPECT_LT(re_peak * 4, plain_peak * 3) << re_peak << " bytes recomputed, " << plain_peak << " without";

  // The parameter server clips the workers' mean gradient alike (the
  // server is this process: the tokens in the test's temporary directory).
  const std::string ps_addr = absl::StrCat("127.0.0.1:", FreePort());
  workers = test_support::StartWorkers({"w1", "w2"}, ps_addr, "gpt_spm_ps");
  auto [ps_code, ps_out] =
      RunProgram(master({"--workers", "w1,w2", "--listen", ps_addr, "--mode", "ps"}), absl::Seconds(180));
  ASSERT_EQ(ps_code, 0) << ps_out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  const std::vector<double> ps_losses = test_support::EpochField(ps_out, "train_loss");
  ASSERT_EQ(ps_losses.size(), 2u) << ps_out;
  for (size_t e = 0; e < 2; ++e) EXPECT_NEAR(ps_losses[e], losses[e], 1e-4 * losses[e]) << ps_out;
  EXPECT_THAT(ps_out, HasSubstr(" grad_norm="));

  auto generate = [&](std::vector<std::string> more) {
    std::vector<std::string> argv = {BinDir() + "/generate", "--checkpoint-dir", dir + "/piped", "--prompt",
                                     "the master", "--tokens", "12", "--seed", "1"};
    argv.insert(argv.end(), more.begin(), more.end());
    return RunProgram(argv, absl::Seconds(60));
  };
  // The evaluator reads the held-out text with the run's tokenizer (from
  // the checkpoint) and scores it as the run's last epoch did.
  auto [eval_code, eval_out] = RunProgram(
      {BinDir() + "/evaluator", "--checkpoint-dir", dir + "/piped", "--dataset", "text:" + text, "--once"},
      absl::Seconds(60));
  ASSERT_EQ(eval_code, 0) << eval_out;
  EXPECT_THAT(eval_out, HasSubstr("--tokenizer " + model + ", the training's"));
  ASSERT_EQ(test_support::EpochField(eval_out, "test_loss", "step=").size(), 1u) << eval_out;
  EXPECT_NEAR(test_support::EpochField(eval_out, "test_loss", "step=")[0], test_support::EpochField(out, "test_loss")[1],
              1e-4 * test_support::EpochField(out, "test_loss")[1])
      << eval_out;
  auto [gen_code, sample] = generate({"--tokenizer", model});
  ASSERT_EQ(gen_code, 0) << sample;
  const std::string sampled = sample.substr(sample.find('\n') + 1);
  EXPECT_EQ(sampled.substr(0, 10), "the master") << sample;
  EXPECT_GT(sampled.size(), 14u) << sample;  // (12 tokens of pieces of words)
  EXPECT_EQ(generate({"--tokenizer", model}).second, sample);
  // Without the model, or with another file: what to give instead.
  auto [bytes_code, bytes_out] = generate({});
  EXPECT_EQ(bytes_code, 2) << bytes_out;
  EXPECT_THAT(bytes_out, HasSubstr("reads a vocabulary of 80, not bytes: give the SentencePiece model"));
  auto [other_code, other_out] = generate({"--tokenizer", text});
  EXPECT_EQ(other_code, 2) << other_out;
  EXPECT_THAT(other_out, HasSubstr("is it a SentencePiece model?"));

  // master refuses a file that is not a model before it trains, and a
  // tokenizer without a text.
  fs::remove_all(dir + "/tmp");
  fs::create_directories(dir + "/tmp");
  auto [bad_code, bad_out] = RunProgram(
      {BinDir() + "/master", "--local", "--dataset", "text:" + text, "--tokenizer", text}, absl::Seconds(60));
  RestoreTmpdir();
  EXPECT_EQ(bad_code, 2) << bad_out;
  EXPECT_THAT(bad_out, HasSubstr("--tokenizer " + text + ": spm_export_vocab failed"));
  // What the failed run left behind, by name: not RunProgram's own record
  // of its output, which lands here too when TEST_TMPDIR is unset (ctest
  // run by hand, not through ./run).
  const std::string own = fs::path(TempPath("out.txt")).filename().string();
  std::string left;
  for (const auto& e : fs::directory_iterator(dir + "/tmp")) {
    if (e.path().filename() != own) left += e.path().filename().string() + " ";
  }
  EXPECT_EQ(left, "");
  auto [alone_code, alone_out] = RunProgram({BinDir() + "/master", "--local", "--tokenizer", model}, absl::Seconds(60));
  EXPECT_EQ(alone_code, 2) << alone_out;
  EXPECT_THAT(alone_out, HasSubstr("--tokenizer tokenises a text: give --dataset text:PATH too"));
}

TEST(TextMaster, ATextItCannotTakeIsAClearError) {
  auto [missing_code, missing_out] = RunProgram(
      {BinDir() + "/master", "--local", "--dataset", "text:" + TempPath("no_such_text.txt")}, absl::Seconds(60));
  EXPECT_EQ(missing_code, 2) << missing_out;
  EXPECT_THAT(missing_out, HasSubstr("no_such_text.txt does not exist: give a UTF-8 text file"));

  const std::string latin1 = TempPath("latin1.txt");
  std::ofstream(latin1, std::ios::binary) << "caf\xe9 au lait, " << std::string(200, 'x');
  setenv("TMPDIR", test_support::FreshDir("text_errors").c_str(), 1);
  auto [code, out] = RunProgram({BinDir() + "/master", "--local", "--threads", "1", "--dataset", "text:" + latin1},
                                absl::Seconds(60));
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("is not UTF-8: byte 3"));

  const std::string tiny = TempPath("tiny.txt");
  std::ofstream(tiny, std::ios::binary) << "too short";
  auto [tiny_code, tiny_out] =
      RunProgram({BinDir() + "/master", "--local", "--threads", "1", "--dataset", "text:" + tiny, "--seq-len", "64"},
                 absl::Seconds(60));
  RestoreTmpdir();
  EXPECT_EQ(tiny_code, 1) << tiny_out;
  EXPECT_THAT(tiny_out, HasSubstr("--seq-len 64 needs 65 tokens"));
}

// Against PyTorch itself: nanoGPT's shape as docs/pipeline.md writes it,
// scripted by Debian's python3-torch with its own initial weights, trained
// by PyTorch in one process (AdamW, decay on the matrices only) on the
// windows remora draws (its splitmix64 of seed, epoch and row, file order)
// and by master --model over two workers: the first 10 losses agree. Also
// with nanoGPT's tied embeddings (lm_head.weight = wte.weight): one
// parameter under two paths, which --local steps once and the pipeline
// cuts between, its two copies tied. Skips where python3-torch is absent.
TEST(TextMaster, ANanoGptFromPyTorchTrainsOverWorkersAsPyTorchTrainsIt) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "no python3-torch (Debian's) to compare against";
  }
  const std::string text = test_support::WriteText("nanogpt_text.txt");
  for (const std::string tie : {"untied", "tie"}) {
    SCOPED_TRACE(tie);
    const std::string dir = test_support::FreshDir("nanogpt_" + tie);
    const std::string script = dir + "/parity.py";
    std::ofstream(script) << R"PY(import math, sys, torch
from torch import nn
text, out, steps, tie = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "tie"
T, B, SEED, LR, WD, VAL = 16, 8, 3, 1e-3, 0.1, 0.05
torch.set_num_threads(1)
torch.manual_seed(0)

class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2, self.heads = nn.LayerNorm(d), nn.LayerNorm(d), heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = [t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(C, dim=2)]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = (att.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))

class GPT(nn.Module):
    def __init__(self, vocab=256, seq_len=16, d=32, heads=2, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

model = GPT()
if tie:
    model.head.weight = model.wte.weight  # nanoGPT's tied embeddings
torch.jit.script(model).save(out + "/gpt.pt")

# remora's training windows: row r of epoch e starts where splitmix64 of
# (seed, e, r) says, in the first (1 - val) of the tokens (data/text.cc).
def mix(x):
    M = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)
tokens = torch.tensor(list(open(text, "rb").read()), dtype=torch.long)
end = len(tokens) - int(len(tokens) * VAL)
span = end - T
def window(r):
    s = mix(SEED ^ mix(1 ^ mix(r))) % span
    return tokens[s:s + T], tokens[s + 1:s + T + 1]

decay = [p for p in model.parameters() if p.dim() >= 2]
rest = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR)
with open(out + "/losses.txt", "w") as f:
    for step in range(steps):
        xs, ys = zip(*[window(step * B + i) for i in range(B)])
        x, y = torch.stack(xs), torch.stack(ys)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        f.write("%.9f\n" % loss.item())
)PY";
    auto [py_code, py_out] =
        RunProgram({"/usr/bin/python3", script, text, dir, "10", tie}, absl::Seconds(120));
    ASSERT_EQ(py_code, 0) << py_out;
    std::vector<double> want;
    for (absl::string_view line : absl::StrSplit(ReadFile(dir + "/losses.txt"), '\n', absl::SkipEmpty())) {
      double v = 0;
      ASSERT_TRUE(absl::SimpleAtod(line, &v)) << line;
      want.push_back(v);
    }
    ASSERT_EQ(want.size(), 10u);

    const std::vector<std::string> flags = {
        "--model", dir + "/gpt.pt", "--dataset", "text:" + text, "--seq-len", "16", "--batch-size", "8",
        "--train-rows", "80", "--epochs", "1", "--shuffle=false", "--optimizer", "adamw", "--weight-decay", "0.1",
        "--lr", "0.001", "--seed", "3", "--val-fraction", "0.05", "--splits", "2"};
    auto master = [&](std::vector<std::string> args) {
      args.insert(args.begin(), BinDir() + "/master");
      args.insert(args.end(), flags.begin(), flags.end());
      return RunProgram(args, absl::Seconds(180));
    };
    auto expect_losses = [&](const std::string& board, const std::string& out) {
      const auto losses = test_support::ScalarsIn(board, "step/loss");
      ASSERT_EQ(losses.size(), want.size()) << out;
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_NEAR(losses[i].value, want[i], 1e-5) << "step " << i + 1 << "\n" << out;
      }
    };
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "nanogpt");
    auto [code, out] = master({"--workers", "w1,w2", "--listen", addr, "--tensorboard", dir + "/board",
                               "--checkpoint-dir", dir + "/ckpt"});
    ASSERT_EQ(code, 0) << out;
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
    EXPECT_THAT(out, HasSubstr("over 2 workers"));
    expect_losses(dir + "/board", out);
    if (tie == "tie") {
      auto [local_code, local_out] = master({"--local", "--threads", "1", "--tensorboard", dir + "/local_board"});
      ASSERT_EQ(local_code, 0) << local_out;
      expect_losses(dir + "/local_board", local_out);
    }
  }
}

}  // namespace
}  // namespace remora
