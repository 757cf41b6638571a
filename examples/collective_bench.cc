// collective_bench: the data-parallel gradient path's collective alone.
// All-reduce (sum) of 1 Mi to 64 Mi floats between 2 and 4 local
// processes through parallel::ProcessGroup (c10d's Gloo over a TCPStore,
// as `master --replicas` uses it), as algorithm bandwidth (bytes / time),
// beside a one-thread memcpy of the same bytes in the same run.
//
//   collective_bench                      # 2 and 4 processes, 1..64 Mi floats
//   collective_bench --ranks 2 --reps 9
//
// Rank 0 hosts the store, starts the other ranks (this program again, with
// --rank and --store) and prints the table; the figures are medians.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ops/ones.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "launch/cli.h"
#include "parallel/process_group.h"

namespace remora {
namespace {

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

const std::vector<int64_t> kMiFloats = {1, 4, 16, 64};

// One rank's part: every size, `reps` timed all-reduces after a warm-up;
// the medians (seconds) per size.
absl::StatusOr<std::vector<double>> RunRank(const parallel::GroupOptions& g, int reps) {
  auto group = parallel::ProcessGroup::Join(g);
  if (!group.ok()) return group.status();
  std::vector<double> medians;
  for (int64_t mi : kMiFloats) {
    at::Tensor t = at::ones({mi << 20});
    std::vector<double> times;
    for (int rep = 0; rep <= reps; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      if (auto s = (*group)->AllReduceSum(t).Wait(); !s.ok()) return s;
      if (rep > 0) times.push_back(Seconds(start));
    }
    medians.push_back(Median(times));
  }
  return medians;
}

double MemcpyGBps(int64_t bytes, int reps) {
  std::vector<char> a(bytes, 1), b(bytes);
  std::vector<double> times;
  for (int rep = 0; rep <= reps; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    if (rep > 0) times.push_back(Seconds(start));
  }
  return bytes / Median(times) / 1e9;
}

int Main(int argc, char** argv) {
  std::string ranks_list = "2,4", store;
  int reps = 5, rank = 0, size = 0;
  launch::FlagParser flags("collective_bench",
                        "All-reduce bandwidth between local processes through remora's Gloo "
                        "groups, beside memcpy.");
  flags.JoinsNoGroup();  // (Gloo groups of its own processes, no agents)
  flags.AddString("ranks", &ranks_list, "process counts to measure, e.g. 2,4");
  flags.AddInt("reps", &reps, "timed all-reduces per size (after one warm-up); medians are printed");
  flags.AddString("store", &store, "(internal) HOST:PORT of rank 0's store");
  flags.AddInt("rank", &rank, "(internal) this process's rank");
  flags.AddInt("size", &size, "(internal) the process count");
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  if (reps < 1) {
    std::fprintf(stderr, "collective_bench: --reps must be >= 1\n");
    return 2;
  }
  if (!parallel::HaveGloo()) {
    std::fprintf(stderr, "collective_bench: this build has no Gloo (install libgloo-dev and rebuild)\n");
    return 2;
  }
  if (store.empty() != (rank == 0)) {
    std::fprintf(stderr, "collective_bench: --rank and --store go together: rank 0 gives them to the ranks it "
                         "starts (run it without either)\n");
    return 2;
  }
  if (!store.empty()) {  // a rank started by rank 0
    if (auto s = launch::CheckAddress(store, "--store"); !s.ok()) {
      std::fprintf(stderr, "collective_bench: %s\n", std::string(s.message()).c_str());
      return 2;
    }
    const size_t colon = store.rfind(':');
    const int port = std::stoi(store.substr(colon + 1));
    auto done = RunRank({store.substr(0, colon), port, absl::StrCat("bench", size), rank, size,
                         absl::Seconds(60)}, reps);
    if (!done.ok()) std::fprintf(stderr, "collective_bench rank %d: %s\n", rank, done.status().ToString().c_str());
    return done.ok() ? 0 : 1;
  }
  std::vector<int> counts;
  for (const auto& part : launch::SplitList(ranks_list)) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 2 || n > 16 || launch::HasEmptyPart(ranks_list)) {
      std::fprintf(stderr, "collective_bench: --ranks wants counts in 2..16, e.g. 2,4; got '%s'\n", ranks_list.c_str());
      return 2;
    }
    counts.push_back(n);
  }
  auto server = parallel::StoreServer::Start("127.0.0.1", absl::Seconds(60));
  if (!server.ok()) {
    std::fprintf(stderr, "collective_bench: %s\n", server.status().ToString().c_str());
    return 1;
  }
  const std::string address = absl::StrCat((*server)->host(), ":", (*server)->port());
  std::printf("%6s %10s %14s %12s %16s\n", "ranks", "floats", "allreduce_ms", "algbw_GBps",
              "memcpy_GBps");
  for (int n : counts) {
    std::vector<std::unique_ptr<launch::Subprocess>> others;
    for (int r = 1; r < n; ++r) {
      auto child = launch::Subprocess::Spawn(
          {launch::SiblingProgram("collective_bench"), "--store", address, "--rank",
           std::to_string(r), "--size", std::to_string(n), "--reps", std::to_string(reps)},
          "");
      if (!child.ok()) {
        std::fprintf(stderr, "collective_bench: %s\n", child.status().ToString().c_str());
        return 1;
      }
      others.push_back(std::move(*child));
    }
    auto medians = RunRank({(*server)->host(), (*server)->port(), absl::StrCat("bench", n), 0, n,
                            absl::Seconds(60)}, reps);
    for (auto& c : others) c->Wait(absl::Seconds(120)).IgnoreError();
    if (!medians.ok()) {
      std::fprintf(stderr, "collective_bench: %s\n", medians.status().ToString().c_str());
      return 1;
    }
    for (size_t i = 0; i < kMiFloats.size(); ++i) {
      const int64_t bytes = (kMiFloats[i] << 20) * 4;
      std::printf("%6d %9lldMi %14.2f %12.2f %16.2f\n", n, static_cast<long long>(kMiFloats[i]),
                  (*medians)[i] * 1e3, bytes / (*medians)[i] / 1e9, MemcpyGBps(bytes, reps));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace remora

int main(int argc, char** argv) { return remora::Main(argc, argv); }
