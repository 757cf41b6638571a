// What the parameter server's suites share (ps_test.cc, ps_partitions_test.cc):
// the MLP the servers train, a state comparison, and ways to start real
// worker and master programs.
#pragma once

#include <cmath>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "launch/local_group.h"
#include "ps/parameter_server.h"
#include "train/ps_trainer.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/test_group.h"

namespace remora::ps_fixtures {

inline const std::vector<shards::MLPStageOptions> kStages = {test_support::Mlp(8, 16, 1),
                                                             test_support::Mlp(16, 4, 2, /*relu=*/false)};

inline ps::PsOptions MlpServer(const std::vector<std::string>& workers, int backup = 0) {
  ps::PsOptions o;
  for (const auto& s : kStages) o.stages.push_back(test_support::MlpSpec(s));
  o.workers = workers;
  o.loss = "mse";
  o.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);  // TrainMlpLocally's
  o.backup_workers = backup;
  return o;
}

// A parameter server as master --mode ps drives it: through a
// train::PsTrainer (its server() for the rest).
inline absl::StatusOr<std::unique_ptr<train::PsTrainer>> Server(rpc::Agent& agent, ps::PsOptions options) {
  return train::PsTrainer::Create(agent, std::move(options));
}

// One step through the trainer; the report it gave on_step, or the
// step's error.
inline absl::StatusOr<ps::StepReport> Step(train::PsTrainer& trainer, const at::Tensor& x, const at::Tensor& y) {
  std::optional<ps::StepReport> report;
  trainer.set_on_step([&report](const ps::StepReport& r, double) { report = r; });
  const absl::Status status = trainer.StartStep({x, y}).wait().status();
  trainer.set_on_step(nullptr);
  if (!status.ok()) return status;
  if (!report) return absl::InternalError("the step ended without a report");
  return *report;
}

inline void ExpectStateNear(const std::vector<std::vector<at::Tensor>>& got,
                            const std::vector<std::vector<at::Tensor>>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t k = 0; k < want.size(); ++k) {
    ASSERT_EQ(got[k].size(), want[k].size()) << what << " stage " << k;
    for (size_t i = 0; i < want[k].size(); ++i) {
      EXPECT_LE(test_support::RelativeError(got[k][i], want[k][i]), 1e-5)
          << what << " stage " << k << " tensor " << i;
    }
  }
}

// A master in this process and worker programs w1, w2, ... with their own
// flags each.
inline launch::LocalGroup StartWorkers(rpc::Registry* registry, const std::vector<std::vector<std::string>>& args) {
  std::vector<std::string> names;
  for (size_t i = 0; i < args.size(); ++i) names.push_back(absl::StrCat("w", i + 1));
  launch::LocalGroup group;
  rpc::AgentOptions o = MasterOptions(names);
  group.master = std::move(rpc::Agent::Start(o, registry).value());
  for (size_t i = 0; i < args.size(); ++i) {
    std::vector<std::string> argv = {BinDir() + "/worker", "--name", names[i], "--master",
                                     group.master->self().address, "--threads", "1"};
    argv.insert(argv.end(), args[i].begin(), args[i].end());
    group.workers.push_back(launch::Subprocess::Spawn(argv).value());
  }
  EXPECT_TRUE(group.master->Join().ok());
  return group;
}

// (train_loss, test_accuracy) per epoch in a --report file.
inline std::vector<std::pair<double, double>> ReportEpochs(const std::string& json) {
  std::vector<std::pair<double, double>> out;
  std::regex epoch("\"train_loss\": ([0-9.e+-]+), \"test_accuracy\": ([0-9.e+-]+)");
  for (auto it = std::sregex_iterator(json.begin(), json.end(), epoch); it != std::sregex_iterator(); ++it) {
    out.emplace_back(std::stod((*it)[1]), std::stod((*it)[2]));
  }
  return out;
}

// Worker programs worker1 .. worker<n> joining a master at `addr`; and the
// master --mode ps argv over them.
struct PsPrograms {
  std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  std::vector<std::string> names;
  std::vector<std::unique_ptr<launch::Subprocess>> workers;

  explicit PsPrograms(int n) {
    for (int i = 1; i <= n; ++i) {
      names.push_back(absl::StrCat("worker", i));
      workers.push_back(launch::Subprocess::Spawn({BinDir() + "/worker", "--name", names.back(), "--master", addr,
                                                "--threads", "1"},
                                               TempPath(absl::StrCat(names.back(), ".log")))
                            .value());
    }
  }
  std::vector<std::string> MasterArgv(const std::vector<std::string>& master_args) const {
    std::vector<std::string> argv = {BinDir() + "/master", "--mode", "ps", "--workers", absl::StrJoin(names, ","),
                                     "--listen", addr};
    argv.insert(argv.end(), master_args.begin(), master_args.end());
    return argv;
  }
};

// master --mode ps over `n` real workers; returns its exit code and output.
inline std::pair<int, std::string> RunPs(const std::vector<std::string>& master_args, int n = 2) {
  PsPrograms programs(n);
  auto result = RunProgram(programs.MasterArgv(master_args), absl::Seconds(240));
  for (auto& w : programs.workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  return result;
}

// Trains two epochs of toy IDX data at once, then one epoch with a
// checkpoint and a second resumed from it (master --mode ps `flags` over
// `n` workers; both with --resume auto), and expects the resumed second
// epoch to equal the uninterrupted one's. Returns the checkpoint directory.
inline std::string ExpectResumeGoesOn(const std::vector<std::string>& flags, int n, const std::string& tag) {
  const std::string dir = TempPath(tag + "_idx");
  test_support::WriteToyIdx(dir, 160, 50);
  std::vector<std::string> args = {"--dataset", "idx:" + dir, "--batch-size", "32", "--threads", "1"};
  args.insert(args.end(), flags.begin(), flags.end());
  auto with = [&args](std::vector<std::string> more) {
    more.insert(more.begin(), args.begin(), args.end());
    return more;
  };
  const std::string whole = TempPath(tag + "_whole.json"), resumed = TempPath(tag + "_resumed.json");
  const std::string ckpt = TempPath(tag + "_ckpt");
  auto [code, out] = RunPs(with({"--epochs", "2", "--report", whole}), n);
  EXPECT_EQ(code, 0) << out;
  // Both with --resume auto, as a supervisor restarts a job: the first
  // finds no checkpoint and starts fresh, the second goes on from it.
  auto [first, first_out] = RunPs(with({"--epochs", "1", "--checkpoint-dir", ckpt, "--resume", "auto"}), n);
  EXPECT_EQ(first, 0) << first_out;
  EXPECT_NE(first_out.find("starting fresh (--resume auto)"), std::string::npos) << first_out;
  auto [second, second_out] = RunPs(
      with({"--epochs", "2", "--checkpoint-dir", ckpt, "--resume", "auto", "--report", resumed}), n);
  EXPECT_EQ(second, 0) << second_out;
  EXPECT_NE(second_out.find("resumed from "), std::string::npos) << second_out;
  EXPECT_NE(second_out.find(tag + "_ckpt/step-"), std::string::npos) << second_out;
  const auto a = ReportEpochs(ReadFile(whole)), b = ReportEpochs(ReadFile(resumed));
  EXPECT_EQ(a.size(), 2u);
  // The resumed run trains epoch 2 only (epoch 1 ended in the checkpoint
  // and was reported by the first run).
  EXPECT_EQ(b.size(), 1u);
  EXPECT_EQ(second_out.find("epoch=1 "), std::string::npos) << second_out;
  if (a.size() == 2 && b.size() == 1) {
    EXPECT_LT(std::abs(b[0].first - a[1].first) / a[1].first, 1e-6) << "epoch 2's loss";
    EXPECT_EQ(b[0].second, a[1].second) << "epoch 2's test accuracy";
  }
  return ckpt;
}

}  // namespace remora::ps_fixtures
