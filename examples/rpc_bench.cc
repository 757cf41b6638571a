// rpc_bench: RPC latency and bulk throughput between two processes on this
// machine. It starts one `worker` beside itself and prints, as its last
// lines, latency_us_median (round trip of rpc_sync with a 4-element tensor),
// bulk_gbps (one-way payload rate of a large float tensor sent with rpc_sync
// to a function that returns one element, on the channel it names) and
// memcpy_gbps (a single-thread copy of the same tensor, measured in the same
// run, as the yardstick).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>

#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>

#include "absl/time/clock.h"
#include "examples/local_group.h"
#include "shards/builtins.h"

int main(int argc, char** argv) {
  using namespace remora;
  int calls = 2000, warmup = 200, bulk_mib = 64, bulk_calls = 20;
  cli::FlagParser flags("rpc_bench", "Measures rpc_sync latency and bulk throughput to a local worker.");
  flags.AddInt("calls", &calls, "timed small calls (>= 2000 for the reported median)");
  flags.AddInt("warmup", &warmup, "untimed small calls first");
  flags.AddInt("bulk-mib", &bulk_mib, "size of the bulk tensor in MiB");
  flags.AddInt("bulk-calls", &bulk_calls, "timed bulk calls");
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  cli::TuneAllocator();
  if (calls < 1 || warmup < 0 || bulk_mib < 1 || bulk_mib > 1024 || bulk_calls < 1) {
    std::cerr << "rpc_bench: counts must be positive and --bulk-mib at most 1024\n";
    return 2;
  }
  Registry registry;
  if (auto s = shards::RegisterAll(registry); !s.ok()) {
    std::cerr << "rpc_bench: " << s.message() << "\n";
    return 1;
  }
  auto group = cli::StartLocalGroup({"peer"}, &registry);
  if (!group.ok()) {
    std::cerr << "rpc_bench: " << group.status().message() << "\n";
    return 1;
  }
  Agent& agent = *group->master;

  at::Tensor small = at::ones({4});
  for (int i = 0; i < warmup; ++i) {
    if (auto r = agent.rpc_sync("peer", "echo", {small}); !r.ok()) {
      std::cerr << "rpc_bench: " << r.status().message() << "\n";
      return 1;
    }
  }
  std::vector<double> us;
  us.reserve(calls);
  for (int i = 0; i < calls; ++i) {
    absl::Time t0 = absl::Now();
    auto r = agent.rpc_sync("peer", "echo", {small});
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
    if (!r.ok()) {
      std::cerr << "rpc_bench: " << r.status().message() << "\n";
      return 1;
    }
  }
  std::sort(us.begin(), us.end());

  const int64_t numel = int64_t{bulk_mib} * (1 << 20) / 4;
  at::Tensor big = at::rand({numel});
  const double bytes = static_cast<double>(big.nbytes());
  agent.rpc_sync("peer", "sink", {big}).IgnoreError();  // warm-up
  absl::Time t0 = absl::Now();
  for (int i = 0; i < bulk_calls; ++i) {
    auto r = agent.rpc_sync("peer", "sink", {big});
    if (!r.ok() || r->toTensor().item<double>() != numel) {
      std::cerr << "rpc_bench: bulk call failed: " << r.status().message() << "\n";
      return 1;
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);

  // The yardstick: one thread copying the same bytes between two buffers
  // that are already resident (best of a few, as the bulk calls reuse
  // their buffers too).
  at::Tensor copy = at::empty_like(big);
  std::memcpy(copy.data_ptr(), big.data_ptr(), big.nbytes());
  double memcpy_seconds = 1e9;
  for (int i = 0; i < 5; ++i) {
    absl::Time c0 = absl::Now();
    std::memcpy(copy.data_ptr(), big.data_ptr(), big.nbytes());
    memcpy_seconds = std::min(memcpy_seconds, absl::ToDoubleSeconds(absl::Now() - c0));
  }
  const std::string channel = agent.channel_to("peer").value_or("unknown");

  std::printf("calls=%d latency_us_p10=%.1f latency_us_p90=%.1f latency_us_p99=%.1f\n", calls,
              us[us.size() / 10], us[us.size() * 9 / 10], us[us.size() * 99 / 100]);
  std::printf("bulk_bytes=%.0f bulk_calls=%d bulk_seconds=%.3f channel=%s\n", bytes,
              bulk_calls, seconds, channel.c_str());
  const double bulk_gbps = bytes * bulk_calls / seconds / 1e9;
  const double memcpy_gbps = bytes / memcpy_seconds / 1e9;
  std::printf("latency_us_median=%.1f\n", us[us.size() / 2]);
  std::printf("channel=%s\n", channel.c_str());
  std::printf("bulk_gbps=%.2f\n", bulk_gbps);
  std::printf("memcpy_gbps=%.2f\n", memcpy_gbps);
  std::printf("bulk_over_memcpy=%.2f\n", bulk_gbps / memcpy_gbps);
  std::fflush(stdout);
  if (auto s = group->Shutdown(); !s.ok()) {
    std::cerr << "rpc_bench: shutdown: " << s.message() << "\n";
    return 1;
  }
  return 0;
}
