// Issue 55's parity check, as a user runs it: the built-in GPT over two
// real workers against one process, with every language-model feature on
// at once (master --dataset text:PATH).
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/owner_file.h"
#include "launch/cli.h"
#include "tests/support/master_runs.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;

// Issue 55's parity check, every feature an LLM run uses at once: the
// built-in GPT with tied embeddings, AdamW (no decay on biases and norm
// weights), cosine warm-up and clipping, 4 micro-batches, over 20 steps:
// cut over two workers (1F1B, two stages; interleaved, four) each step's
// loss is one process's within 1e-6 and the held-out losses too; the
// two cuts' final parameters are within 1e-6 of one another's (their
// clipping norms sum the stages' shares in another order), and
// --recompute changes nothing, bit for bit. Under --precision bf16 the pipeline is
// within 0.1% of one process's autocast (what crosses a boundary is
// rounded to bf16 there, not in one process).
TEST(TextMaster, APipelineEqualsOneProcessStepByStepWithEveryLanguageModelFeature) {
  const std::string text = test_support::WriteText("gpt_parity.txt");
  const std::string dir = test_support::FreshDir("gpt_parity");
  const std::vector<std::string> common = {
      "--dataset", "text:" + text, "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
      "--batch-size", "8", "--epochs", "2", "--train-rows", "80", "--seed", "5", "--optimizer", "adamw",
      "--lr-schedule", "cosine", "--warmup-steps", "4", "--clip-grad-norm", "0.5", "--deterministic",
      "--splits", "4"};
  // (Without --checkpoint-dir the tokens go to the temporary directory.)
  setenv("TMPDIR", dir.c_str(), 1);
  // One run's per-step losses (its --report) and held-out loss per epoch;
  // `workers` empty: --local on one thread.
  struct Result {
    std::vector<double> losses, test_losses;
    std::string out;
  };
  auto run = [&](const std::string& name, std::vector<std::string> flags) {
    SCOPED_TRACE(name);
    Result r;
    const std::string report = dir + "/" + name + ".json";
    std::vector<std::string> argv = {BinDir() + "/master", "--report", report};
    argv.insert(argv.end(), common.begin(), common.end());
    std::vector<std::unique_ptr<launch::Subprocess>> workers;
    if (flags.front() == "--local") {
      argv.insert(argv.end(), {"--threads", "1"});
    } else {
      const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
      workers = test_support::StartWorkers({"w1", "w2"}, addr, "gpt_parity_" + name);
      argv.insert(argv.end(), {"--workers", "w1,w2", "--listen", addr, "--checkpoint-dir", dir + "/" + name});
    }
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto [code, out] = RunProgram(argv, absl::Seconds(180));
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
    EXPECT_EQ(code, 0) << out;
    const auto losses = test_support::ReportLosses(ReadFile(report));
    if (losses.size() == 1) r.losses = losses[0];
    r.test_losses = test_support::EpochField(out, "test_loss");
    r.out = out;
    return r;
  };
  // The final checkpoint's parameters and buffers in stage order, named
  // (a stage's names are its own: each cut numbers its blocks from 0).
  using Named = std::vector<std::pair<std::string, at::Tensor>>;
  auto final_tensors = [&](const std::string& name) {
    std::map<int64_t, Named> stages;
    Named all;
    auto ck = checkpoint::Latest(dir + "/" + name);
    if (!ck.ok()) {
      ADD_FAILURE() << name << ": " << ck.status();
      return all;
    }
    EXPECT_TRUE(ck->manifest.final);
    for (const checkpoint::ManifestFile& file : ck->manifest.files) {
      auto saved = checkpoint::ReadOwnerFile(ck->dir + "/" + file.file, file.bytes, file.crc32);
      if (!saved.ok()) {
        ADD_FAILURE() << saved.status();
        continue;
      }
      for (size_t k = 0; k < saved->stages.size(); ++k) {
        for (size_t i = 0; i < saved->tensors[k].size(); ++i) {
          stages[saved->stages[k]].emplace_back(saved->names[k][i], saved->tensors[k][i]);
        }
      }
    }
    for (auto& [stage, tensors] : stages) all.insert(all.end(), tensors.begin(), tensors.end());
    return all;
  };

  const Result local = run("local", {"--local"});
  ASSERT_EQ(local.losses.size(), 20u) << local.out;
  EXPECT_THAT(local.out, HasSubstr("learning rate: cosine from 0.001 after 4 warm-up steps"));
  EXPECT_THAT(local.out, ::testing::Not(HasSubstr("Warning")));  // (LibTorch's, once a step)
  Named first;
  for (const auto& [name, schedule, more] :
       std::vector<std::tuple<std::string, std::string, std::vector<std::string>>>{
           {"1f1b", "1f1b", {}}, {"interleaved", "interleaved", {}}, {"recompute", "1f1b", {"--recompute"}}}) {
    std::vector<std::string> flags = {"--schedule", schedule};
    flags.insert(flags.end(), more.begin(), more.end());
    const Result piped = run(name, flags);
    ASSERT_EQ(piped.losses.size(), local.losses.size()) << piped.out;
    for (size_t i = 0; i < local.losses.size(); ++i) {
      EXPECT_NEAR(piped.losses[i], local.losses[i], 1e-6) << name << ", step " << i + 1;
    }
    ASSERT_EQ(piped.test_losses.size(), 2u) << piped.out;
    for (size_t e = 0; e < 2; ++e) EXPECT_NEAR(piped.test_losses[e], local.test_losses[e], 1e-6) << name;
    EXPECT_THAT(piped.out, HasSubstr(schedule == "1f1b" ? "2 stages over 2 workers" : "4 stages over 2 workers"));
    Named tensors = final_tensors(name);
    auto named = [&tensors](const std::string& key) {
      return std::count_if(tensors.begin(), tensors.end(), [&key](const auto& t) { return t.first == key; });
    };
    EXPECT_EQ(named("embed.tokens.weight"), 1);
    EXPECT_EQ(named("head.head.weight"), 0) << "the tied weight is stored once";
    if (first.empty()) {
      first = std::move(tensors);
      continue;
    }
    ASSERT_EQ(tensors.size(), first.size()) << name;
    for (size_t i = 0; i < first.size(); ++i) {
      const std::string& key = first[i].first;
      ASSERT_EQ(tensors[i].first, key) << name;
      if (name == "recompute") {
        EXPECT_TRUE(tensors[i].second.equal(first[i].second)) << key << " differs from 1f1b's";
      } else {  // (another cut sums the clipping norm's shares in another order)
        EXPECT_LT(test_support::RelativeError(tensors[i].second, first[i].second), 1e-6) << name << ": " << key;
      }
    }
  }

  const Result local_bf16 = run("local_bf16", {"--local", "--precision", "bf16"});
  const Result piped_bf16 = run("bf16", {"--schedule", "1f1b", "--precision", "bf16"});
  ASSERT_EQ(local_bf16.losses.size(), 20u) << local_bf16.out;
  ASSERT_EQ(piped_bf16.losses.size(), 20u) << piped_bf16.out;
  double bf16_off = 0;
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_NEAR(piped_bf16.losses[i], local_bf16.losses[i], 1e-3 * local_bf16.losses[i]) << "step " << i + 1;
    bf16_off = std::max(bf16_off, std::abs(local_bf16.losses[i] - local.losses[i]));
  }
  RestoreTmpdir();
  EXPECT_GT(bf16_off, 1e-6) << "bf16 computes other numbers than fp32";
}

}  // namespace
}  // namespace remora
