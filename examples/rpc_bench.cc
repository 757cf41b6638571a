// rpc_bench: RPC latency and bulk throughput between two processes on this
// machine. It starts one `worker` beside itself and prints, as its last
// lines, latency_us_median (round trip of rpc_sync with a 4-element tensor),
// bulk_gbps (one-way payload rate of a large float tensor sent with rpc_sync
// to a function that returns one element, on the channel it names) and
// memcpy_gbps (a single-thread copy of the same tensor, measured in the same
// run, as the yardstick); async_latency_us_median is the same round trip of
// rpc_async, waited for (as the pipeline's pushes and gradients travel);
// rpc_sync_on says whether the calls went on long-lived streams (the
// default) or as unary calls (REMORA_STREAMS=0), rpc_async_on whether
// rpc_async went on the local link (the default on one host) or as unary
// gRPC calls (REMORA_LINKS=0).
// grpc_floor_us_median is the round trip of a bare
// gRPC unary call to the same worker that gRPC answers itself on its own
// thread (a method remora does not serve): what the transport costs before
// remora does anything, measured in the same run.
//
// --device cuda (a build with the CUDA channel, a GPU): the bulk tensor is
// a 256 MiB CUDA tensor on this process's cuda:0 sent to the worker's
// --peer-device (cuda:0: CUDA IPC; another GPU: NCCL), and the yardstick is
// d2d_gbps, a cudaMemcpy within cuda:0 measured in the same run.
//
// Before those, --sizes sweeps tensor sizes (CPU): a line per size with the
// channel that carried it (shm when the shared-memory channel wrote it,
// else inline: in the gRPC message) and its one-way rate, so that the
// out-of-band threshold shows.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "launch/cli.h"
#include "launch/local_group.h"
#include "launch/worker_main.h"
#include "channel/cuda/cuda_channel.h"
#include "base/status_util.h"
#include "channel/devices.h"
#include "examples/demo_functions.h"
#include "runtime/allocator.h"

namespace {

// Round trips (microseconds, sorted) of `calls` bare gRPC unary calls to
// `address`, each driven on this thread's own completion queue as rpc_sync
// drives its calls (polling for `spin` first). The worker rejects the
// method at once (UNIMPLEMENTED).
std::vector<double> GrpcFloor(const std::string& address, absl::Duration spin, int warmup,
                              int calls) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ByteBuffer request, response;
  std::vector<double> us;
  for (int i = 0; i < warmup + calls; ++i) {
    absl::Time t0 = absl::Now();
    grpc::ClientContext context;
    auto call = stub.PrepareUnaryCall(&context, "/remora.bench/Floor", request, &cq);
    call->StartCall();
    grpc::Status status;
    call->Finish(&response, &status, nullptr);
    void* tag = nullptr;
    bool ok = false;
    remora::rpc::NextPolling(&cq, spin, &tag, &ok);
    if (i >= warmup) us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  std::sort(us.begin(), us.end());
  return us;
}

// Parses --sizes: comma-separated sizes with an optional K or M suffix
// (KiB, MiB), each from 1 byte to 1 GiB.
absl::StatusOr<std::vector<int64_t>> ParseSizes(const std::string& text) {
  std::vector<int64_t> sizes;
  if (remora::launch::HasEmptyPart(text)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sizes '", text, "' has an empty size (two commas, or one at an end)"));
  }
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int64_t scale = 1;
    if (absl::EndsWithIgnoreCase(part, "k")) scale = 1 << 10;
    if (absl::EndsWithIgnoreCase(part, "m")) scale = 1 << 20;
    if (scale > 1) part.remove_suffix(1);
    int64_t n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 1 || n > (int64_t{1} << 30) / scale) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--sizes: '", part, "' is not a size (e.g. 4K, 64K, 1M: 1 byte to 1 GiB)"));
    }
    sizes.push_back(n * scale);
  }
  return sizes;
}

// One line per size: `size_bytes=<n> channel=<shm|inline> gbps=<rate>`,
// the one-way rate of rpc_sync sending a byte tensor of that size to the
// peer's `sink` (after one warm-up call), over enough calls to move 256 MiB
// (20 to 2000 calls).
absl::Status SweepSizes(remora::rpc::Agent& agent, const std::vector<int64_t>& sizes) {
  for (int64_t size : sizes) {
    at::Tensor t = at::ones({size}, at::kByte);
    const int calls = static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / size, 20, 2000));
    if (auto r = agent.rpc_sync("peer", "sink", {t}); !r.ok()) return r.status();
    const int64_t writes = agent.shm_stats().writes;
    absl::Time t0 = absl::Now();
    for (int i = 0; i < calls; ++i) {
      auto r = agent.rpc_sync("peer", "sink", {t});
      if (!r.ok()) return r.status();
      // sink answers the element count as a float: exact up to 2^24.
      if (std::abs(r->toTensor().item<double>() - static_cast<double>(size)) > size * 1e-6) {
        return absl::InternalError(absl::StrCat("sink saw a wrong size for ", size, " bytes"));
      }
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    const bool shm = agent.shm_stats().writes - writes >= calls;
    std::printf("size_bytes=%lld channel=%s calls=%d gbps=%.3f\n", static_cast<long long>(size),
                shm ? "shm" : "inline", calls, static_cast<double>(size) * calls / seconds / 1e9);
  }
  return absl::OkStatus();
}

// --rendezvous N: starts N local workers and times the group's forming
// (their processes starting included), `runs` times; one line.
int MeasureRendezvous(int workers, int runs, const remora::rpc::Registry& registry,
                      const remora::rpc::AgentOptions& options) {
  std::vector<std::string> names;
  for (int i = 1; i <= workers; ++i) names.push_back(absl::StrCat("peer", i));
  std::vector<double> seconds;
  for (int run = 0; run < runs; ++run) {
    const absl::Time t0 = absl::Now();
    auto group = remora::launch::StartLocalGroup(names, &registry, {"--threads", "1"}, options,
                                                 remora::examples::DemoWorkerProgram("rpc_bench"));
    if (!group.ok()) {
      std::cerr << "rpc_bench: rendezvous of " << workers << " workers: " << group.status().message()
                << "\n";
      return 1;
    }
    seconds.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    if (auto s = group->Shutdown(); !s.ok()) {
      std::cerr << "rpc_bench: shutdown: " << s.message() << "\n";
      return 1;
    }
  }
  std::vector<std::string> each;
  for (double s : seconds) each.push_back(absl::StrFormat("%.3f", s));
  std::sort(seconds.begin(), seconds.end());
  std::printf("rendezvous_workers=%d runs=%s seconds_median=%.3f\n", workers,
              absl::StrJoin(each, ",").c_str(), seconds[seconds.size() / 2]);
  return 0;
}

using namespace remora;  // NOLINT: the program's own helpers below

// --device and --peer-device checked: whether the bulk tensor is on the GPU.
absl::StatusOr<bool> CheckDevices(const std::string& device, const std::string& peer_device) {
  const bool cuda = device == "cuda" || device == "cuda:0";
  if (device != "cpu" && !cuda) return absl::InvalidArgumentError("--device is cpu or cuda, not '" + device + "'");
  if (!cuda) return false;
  absl::Status ok = channel::CudaChannelBuilt() ? channel::CheckLocalDevice(c10::Device(c10::kCUDA, 0))
                                       : absl::FailedPreconditionError(channel::kNoCudaBuild);
  if (auto peer = channel::ParseDevice(peer_device, "--peer-device"); !peer.ok() || !peer->is_cuda()) {
    ok = peer.ok() ? absl::InvalidArgumentError("--peer-device must be cuda:N") : peer.status();
  }
  if (!ok.ok()) return base::Annotate(ok, "--device cuda");
  return true;
}

// The master and its worker 'peer': started here (`rpc_bench worker ...`),
// or with `external` waited for at options.listen_address.
absl::StatusOr<launch::LocalGroup> StartPeer(rpc::AgentOptions options, bool external,
                                             const std::vector<std::string>& worker_args,
                                             const rpc::Registry* registry) {
  if (!external) {
    return launch::StartLocalGroup({"peer"}, registry, worker_args, options, examples::DemoWorkerProgram("rpc_bench"));
  }
  options.name = "master";
  options.is_master = true;
  options.workers = {"peer"};
  ASSIGN_OR_RETURN(std::unique_ptr<rpc::Agent> master, rpc::Agent::Start(options, registry));
  std::cerr << "rpc_bench: waiting for worker 'peer' at " << master->self().address << "\n";
  RETURN_IF_ERROR(master->Join());
  launch::LocalGroup group;
  group.master = std::move(master);
  return group;
}

// Microseconds of `calls` small echo calls (after `warmup` untimed),
// sorted: rpc_sync's, or (`async`) rpc_async's waited for.
absl::StatusOr<std::vector<double>> MeasureLatency(rpc::Agent& agent, int warmup, int calls, bool async = false) {
  const at::Tensor small = at::ones({4});
  auto call = [&] {
    return async ? agent.rpc_async("peer", "echo", {small}).wait() : agent.rpc_sync("peer", "echo", {small});
  };
  for (int i = 0; i < warmup; ++i) RETURN_IF_ERROR(call().status());
  std::vector<double> us;
  us.reserve(calls);
  for (int i = 0; i < calls; ++i) {
    const absl::Time t0 = absl::Now();
    auto r = call();
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
    RETURN_IF_ERROR(r.status());
  }
  std::sort(us.begin(), us.end());
  return us;
}

// The bulk calls' figures and their yardsticks.
struct Bulk {
  double bytes = 0, seconds = 0;
  double memcpy_seconds = 1e9;  // one thread copying the same bytes, best of 5
  double d2d_gbps = 0;          // with cuda: a device-to-device copy on cuda:0
  std::string channel;
};

// `bulk_calls` calls sending a tensor of `bulk_mib` MiB (on cuda:0 with
// `cuda`) to the peer's sink, after one untimed.
absl::StatusOr<Bulk> MeasureBulk(rpc::Agent& agent, int bulk_mib, int bulk_calls, bool cuda) {
  Bulk b;
  const int64_t numel = int64_t{bulk_mib} * (1 << 20) / 4;
  at::Tensor big = at::rand({numel});
  if (cuda) big = big.to(c10::Device(c10::kCUDA, 0));
  b.bytes = static_cast<double>(big.nbytes());
  agent.rpc_sync("peer", "sink", {big}).IgnoreError();  // warm-up
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < bulk_calls; ++i) {
    auto r = agent.rpc_sync("peer", "sink", {big});
    if (!r.ok()) return base::Annotate(r.status(), "bulk call failed");
    if (r->toTensor().item<double>() != numel) {
      return absl::DataLossError(absl::StrCat("bulk call failed: the peer received ", r->toTensor().item<double>(),
                                              " elements of ", numel));
    }
  }
  b.seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  // The yardstick: one thread copying the same bytes between two buffers
  // that are already resident (best of a few, as the bulk calls reuse
  // their buffers too).
  at::Tensor host = big.cpu();
  at::Tensor copy = at::empty_like(host);
  std::memcpy(copy.data_ptr(), host.data_ptr(), host.nbytes());
  for (int i = 0; i < 5; ++i) {
    const absl::Time c0 = absl::Now();
    std::memcpy(copy.data_ptr(), host.data_ptr(), host.nbytes());
    b.memcpy_seconds = std::min(b.memcpy_seconds, absl::ToDoubleSeconds(absl::Now() - c0));
  }
  b.channel = agent.channel_to("peer", cuda ? "cuda:0" : "cpu").value_or("unknown");
  if (cuda) {
    ASSIGN_OR_RETURN(b.d2d_gbps, channel::MeasureDeviceCopyGbps(0, big.nbytes()));
  }
  return b;
}

void PrintFigures(rpc::Agent& agent, const std::vector<double>& us, const std::vector<double>& async_us,
                  const std::vector<double>& floor_us, const Bulk& b, int bulk_calls, bool cuda,
                  const std::string& peer_device) {
  // Streams (rpc/stream.h) carry rpc_sync unless REMORA_STREAMS=0.
  std::printf("rpc_sync_on=%s\n", agent.streams_opened() > 0 ? "streams" : "unary calls");
  // Local links (rpc/link.h) carry rpc_async on one host unless REMORA_LINKS=0.
  std::printf("rpc_async_on=%s\n", agent.calls_on_links() > 0 ? "link" : "unary calls");
  std::printf("calls=%zu latency_us_p10=%.1f latency_us_p90=%.1f latency_us_p99=%.1f\n", us.size(),
              us[us.size() / 10], us[us.size() * 9 / 10], us[us.size() * 99 / 100]);
  std::printf("bulk_bytes=%.0f bulk_calls=%d bulk_seconds=%.3f channel=%s\n", b.bytes, bulk_calls, b.seconds,
              b.channel.c_str());
  const double bulk_gbps = b.bytes * bulk_calls / b.seconds / 1e9;
  const double memcpy_gbps = b.bytes / b.memcpy_seconds / 1e9;
  if (!floor_us.empty()) {
    std::printf("grpc_floor_us_p10=%.1f grpc_floor_us_median=%.1f grpc_floor_us_p90=%.1f\n",
                floor_us[floor_us.size() / 10], floor_us[floor_us.size() / 2], floor_us[floor_us.size() * 9 / 10]);
  }
  std::printf("async_latency_us_p10=%.1f async_latency_us_median=%.1f async_latency_us_p90=%.1f\n",
              async_us[async_us.size() / 10], async_us[async_us.size() / 2], async_us[async_us.size() * 9 / 10]);
  std::printf("latency_us_median=%.1f\n", us[us.size() / 2]);
  std::printf("channel=%s\n", b.channel.c_str());
  std::printf("bulk_gbps=%.2f\n", bulk_gbps);
  std::printf("memcpy_gbps=%.2f\n", memcpy_gbps);
  std::printf("bulk_over_memcpy=%.2f\n", bulk_gbps / memcpy_gbps);
  if (cuda) {
    std::printf("device=cuda:0 peer_device=%s\n", peer_device.c_str());
    std::printf("d2d_gbps=%.2f\n", b.d2d_gbps);
    std::printf("bulk_over_d2d=%.3f\n", bulk_gbps / b.d2d_gbps);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace remora;
  if (examples::IsDemoWorker(argc, argv)) launch::ExitProgram(examples::DemoWorkerMain(argc, argv, "rpc_bench"));
  int calls = 2000, warmup = 200, bulk_mib = 0, bulk_calls = 20;
  std::string device = "cpu", peer_device = "cuda:0", sizes_flag = "4K,32K,64K,256K,1M,16M";
  launch::FlagParser flags("rpc_bench", "Measures rpc_sync latency and bulk throughput to a local worker.");
  flags.AddInt("calls", &calls, "timed small calls (>= 2000 for the reported median)");
  flags.AddInt("warmup", &warmup, "untimed small calls first");
  flags.AddInt("bulk-mib", &bulk_mib, "size of the bulk tensor in MiB (0: 64, or 256 with --device cuda)");
  flags.AddInt("bulk-calls", &bulk_calls, "timed bulk calls");
  flags.AddString("device", &device, "where the bulk tensor lives: cpu, or cuda (this process's cuda:0)");
  flags.AddString("peer-device", &peer_device,
                  "with --device cuda: the worker's GPU (cuda:0: CUDA IPC; another: NCCL)");
  flags.AddString("sizes", &sizes_flag,
                  "CPU tensor sizes to sweep first (K, M suffixes; empty: none), a line each; each size makes "
                  "the calls that move 256 MiB (20 to 2000, whatever --calls says)",
                  /*empty_allowed=*/true);
  std::string listen = "127.0.0.1:0";
  flags.AddString("listen", &listen, "HOST:PORT where this process (the master) listens");
  bool external = false;
  flags.AddBool("external", &external,
                "start no worker: wait at --listen for one named 'peer' (rpc_bench worker --name peer "
                "--master HOST:PORT, on another host or network namespace)");
  int connect_timeout = 60;
  flags.AddInt("connect-timeout", &connect_timeout, "seconds to wait for the worker to register (with --external)");
  int rendezvous = 0;
  flags.AddInt("rendezvous", &rendezvous,
               "only time the rendezvous of this many local workers (3 runs; their start "
               "included) and exit");
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  auto fail = [](const absl::Status& s, int code) {
    std::cerr << "rpc_bench: " << s.message() << "\n";
    return code;
  };
  if (auto s = launch::CheckAddress(listen, "--listen"); !s.ok()) return fail(s, 2);
  if (auto s = launch::CheckAtLeast({{"rendezvous", rendezvous, 0},
                                     {"calls", calls, 1},
                                     {"warmup", warmup, 0},
                                     {"bulk-mib", bulk_mib, 0},
                                     {"bulk-calls", bulk_calls, 1},
                                     {"connect-timeout", connect_timeout, 1}});
      !s.ok()) {
    return fail(s, 2);
  }
  runtime::TuneAllocator();
  auto cuda = CheckDevices(device, peer_device);
  if (!cuda.ok()) return fail(cuda.status(), 2);
  if (bulk_mib == 0) bulk_mib = *cuda ? 256 : 64;
  if (bulk_mib > 1024) {
    return fail(absl::InvalidArgumentError(absl::StrCat("--bulk-mib must be at most 1024; got ", bulk_mib)), 2);
  }
  auto sizes = ParseSizes(sizes_flag);
  if (!sizes.ok()) return fail(sizes.status(), 2);
  rpc::Registry registry;
  if (auto s = examples::RegisterDemoWorker(registry); !s.ok()) return fail(s, 1);
  rpc::AgentOptions options;
  options.listen_address = listen;
  options.connect_timeout = absl::Seconds(connect_timeout);
  if (rendezvous > 0) return MeasureRendezvous(rendezvous, 3, registry, options);
  std::vector<std::string> worker_args;
  if (*cuda) {
    options.device = "cuda:0";
    options.device_maps["peer"]["cuda:0"] = peer_device;
    worker_args = {"--device", peer_device};
  }
  auto group = StartPeer(options, external, worker_args, &registry);
  if (!group.ok()) return fail(group.status(), 1);
  rpc::Agent& agent = *group->master;
  // A failure from here ends the group: the peer is told why and exits.
  auto fail_group = [&fail, &agent](const absl::Status& s) {
    agent.Abort(s);
    return fail(s, 1);
  };
  auto us = MeasureLatency(agent, warmup, calls);
  if (!us.ok()) {
    if (external && absl::IsNotFound(us.status())) {  // (the stock worker, say: it has no echo)
      return fail_group(absl::FailedPreconditionError(
          absl::StrCat(us.status().message(), "; the peer must be rpc_bench's own worker: start it as "
                                              "`rpc_bench worker --name peer --master HOST:PORT`")));
    }
    return fail_group(us.status());
  }
  auto async_us = MeasureLatency(agent, warmup, calls, /*async=*/true);
  if (!async_us.ok()) return fail_group(async_us.status());
  std::vector<double> floor_us;
  if (!options.tls.enabled()) floor_us = GrpcFloor(agent.worker("peer")->address, agent.sync_spin(), warmup, calls);
  if (auto s = SweepSizes(agent, *sizes); !s.ok()) return fail_group(base::Annotate(s, "size sweep"));
  auto bulk = MeasureBulk(agent, bulk_mib, bulk_calls, *cuda);
  if (!bulk.ok()) return fail_group(bulk.status());
  PrintFigures(agent, *us, *async_us, floor_us, *bulk, bulk_calls, *cuda, peer_device);
  if (auto s = group->Shutdown(); !s.ok()) return fail(base::Annotate(s, "shutdown"), 1);
  return 0;
}
