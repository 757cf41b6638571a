#include "tests/support/master_runs.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>

#include <ATen/TensorOperators.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/max.h>
#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "checkpoint/checkpoint.h"
#include "tests/support/test_group.h"

namespace remora::test_support {
// Losses of every run in a --report file, in order.
std::vector<std::vector<double>> ReportLosses(const std::string& json) { return ReportNumbers(json, "losses"); }

std::vector<std::vector<double>> ReportNumbers(const std::string& json, const std::string& key) {
  std::vector<std::vector<double>> out;
  std::regex losses("\"" + key + "\": \\[([^\\]]*)\\]");
  for (auto it = std::sregex_iterator(json.begin(), json.end(), losses);
       it != std::sregex_iterator(); ++it) {
    std::vector<double> v;
    for (auto part : absl::StrSplit((*it)[1].str(), ", ")) v.push_back(std::stod(std::string(part)));
    out.push_back(v);
  }
  return out;
}

// A pipeline run over `n` real workers; returns the master's exit code and
// output. `common_args` go to the master and every worker; the workers
// must exit with `worker_code` (1 when the master fails: it ends the group).
std::pair<int, std::string> RunPipeline(int n, const std::vector<std::string>& master_args,
                                        const std::vector<std::string>& common_args, int worker_code) {
  const int port = FreePort();
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  std::vector<std::unique_ptr<launch::Subprocess>> workers;
  std::string names;
  for (int i = 1; i <= n; ++i) {
    const std::string name = absl::StrCat("worker", i);
    names += (i > 1 ? "," : "") + name;
    std::vector<std::string> worker_argv = {BinDir() + "/worker", "--name", name, "--master", addr,
                                            "--threads", "1"};
    worker_argv.insert(worker_argv.end(), common_args.begin(), common_args.end());
    workers.push_back(launch::Subprocess::Spawn(worker_argv, TempPath(name + ".log")).value());
  }
  std::vector<std::string> argv = {BinDir() + "/master", "--workers", names, "--listen", addr};
  argv.insert(argv.end(), master_args.begin(), master_args.end());
  argv.insert(argv.end(), common_args.begin(), common_args.end());
  auto result = RunProgram(argv, absl::Seconds(240));
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), worker_code);
  return result;
}

// The losses of `master --local --threads 1` with `args`, one list per
// split count (empty when it failed, which the test is told).
std::vector<std::vector<double>> LocalLosses(const std::vector<std::string>& args,
                                             const std::string& name) {
  const std::string report = TempPath(name + ".json");
  std::vector<std::string> argv = {BinDir() + "/master", "--local", "--threads", "1", "--report",
                                   report};
  argv.insert(argv.end(), args.begin(), args.end());
  auto [code, out] = RunProgram(argv, absl::Seconds(240));
  EXPECT_EQ(code, 0) << out;
  return code == 0 ? ReportLosses(ReadFile(report)) : std::vector<std::vector<double>>{};
}

// Every batch's loss of `got` within 1e-4 (relative) of `want`'s.
void ExpectSameLosses(const std::vector<double>& got, const std::vector<double>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t b = 0; b < want.size(); ++b) {
    EXPECT_LT(std::abs(got[b] - want[b]) / std::abs(want[b]), 1e-4)
        << what << " batch " << b << ": " << got[b] << " vs " << want[b];
  }
}

// (train_loss, test_accuracy) per epoch in a report.
std::vector<std::pair<double, double>> ReportEpochs(const std::string& json) {
  std::vector<std::pair<double, double>> out;
  std::regex epoch("\"train_loss\": ([0-9.e+-]+), \"test_accuracy\": ([0-9.e+-]+)");
  for (auto it = std::sregex_iterator(json.begin(), json.end(), epoch); it != std::sregex_iterator(); ++it) {
    out.emplace_back(std::stod((*it)[1]), std::stod((*it)[2]));
  }
  return out;
}

std::vector<train::ScalarEvent> ScalarsIn(const std::string& dir, const std::string& tag,
                                          std::vector<int64_t>* restarts) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0) files.push_back(entry.path());
  }
  EXPECT_EQ(files.size(), 1u) << "event files in " << dir;
  if (files.size() != 1) return {};
  auto all = train::ReadScalars(files[0], nullptr, restarts);
  EXPECT_TRUE(all.ok()) << all.status();
  std::vector<train::ScalarEvent> out;
  if (all.ok()) {
    for (const train::ScalarEvent& e : *all) {
      if (e.tag == tag) out.push_back(e);
    }
  }
  return out;
}

std::string FreshDir(const std::string& name) {
  const std::string dir = std::filesystem::path(TempPath(name)).lexically_normal().string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::vector<std::unique_ptr<launch::Subprocess>> StartWorkers(const std::vector<std::string>& names,
                                                              const std::string& addr, const std::string& tag) {
  std::vector<std::unique_ptr<launch::Subprocess>> out;
  for (const auto& n : names) {
    out.push_back(launch::Subprocess::Spawn({BinDir() + "/worker", "--name", n, "--master", addr, "--threads", "1"},
                                            TempPath(tag + "_" + n + ".log"))
                      .value());
  }
  return out;
}

std::vector<std::string> MasterArgv(const std::string& workers, const std::string& addr, const std::string& data,
                                    std::vector<std::string> more) {
  std::vector<std::string> argv = {BinDir() + "/master", "--workers", workers, "--listen", addr,
                                   "--dataset", "idx:" + data, "--epochs", "3", "--batch-size", "32",
                                   "--splits", "2", "--threads", "1"};
  argv.insert(argv.end(), more.begin(), more.end());
  return argv;
}

std::string LineStarting(const std::string& output, const std::string& prefix) {
  for (size_t at = 0; at < output.size();) {
    const size_t end = std::min(output.find('\n', at), output.size());
    if (output.compare(at, prefix.size(), prefix) == 0) return output.substr(at, end - at);
    at = end + 1;
  }
  return "";
}

StageDifference CompareStages(const std::string& a_path, const std::string& b_path) {
  StageDifference d;
  auto a = checkpoint::ReadStageTensors(checkpoint::Latest(a_path).value());
  auto b = checkpoint::ReadStageTensors(checkpoint::Latest(b_path).value());
  EXPECT_TRUE(a.ok() && b.ok());
  if (!a.ok() || !b.ok() || a->size() != b->size()) return {false, INFINITY};
  for (size_t k = 0; k < a->size(); ++k) {
    EXPECT_EQ((*a)[k].size(), (*b)[k].size()) << "stage " << k;
    if ((*a)[k].size() != (*b)[k].size()) return {false, INFINITY};
    for (size_t j = 0; j < (*a)[k].size(); ++j) {
      d.equal = d.equal && at::equal((*a)[k][j], (*b)[k][j]);
      d.largest = std::max(d.largest, ((*a)[k][j] - (*b)[k][j]).abs().max().item<double>());
    }
  }
  return d;
}

std::vector<double> EpochField(const std::string& out, const std::string& key, const char* prefix) {
  std::vector<double> values;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::ConsumePrefix(&line, prefix)) continue;
    const size_t at = line.find(" " + key + "=");
    double v = std::nan("");
    if (at != absl::string_view::npos) {
      absl::string_view rest = line.substr(at + key.size() + 2);
      if (!absl::SimpleAtod(rest.substr(0, rest.find(' ')), &v)) v = std::nan("");
    }
    values.push_back(v);
  }
  return values;
}

std::string WriteText(const std::string& name) {
  const char* sentences[] = {"the pipeline sends activations to the next stage. ",
                             "a worker holds its shard of the model. ",
                             "gradients flow back through the distributed autograd engine. ",
                             "the master splits each batch into micro-batches. "};
  std::string text;
  uint32_t x = 7;
  while (text.size() < 5000) {
    x = x * 1103515245u + 12345u;
    text += sentences[(x >> 16) % 4];
    if ((x >> 8) % 5 == 0) text += "\n";
  }
  const std::string path = TempPath(name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

}  // namespace remora::test_support
