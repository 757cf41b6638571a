#include "launch/worker_main.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "autograd/dist_autograd.h"
#include "channel/devices.h"
#include "ps/replica.h"
#include "launch/cli.h"
#include "rpc/agent.h"
#include "runtime/allocator.h"
#include "runtime/threads.h"

namespace remora::launch {

int WorkerMain(int argc, char** argv, const std::string& program,
               const std::function<absl::Status(Registry&)>& register_functions) {
  std::string name;
  std::string master = launch::MasterAddressFromEnv();
  std::string listen = "127.0.0.1:0";
  std::string device = "cpu";
  int threads = 0;
  int rpc_threads = 16;
  int connect_timeout_s = 60;
  launch::FlagParser flags(program, "A remora worker: serves the master's calls until it ends the group.");
  flags.AddString("name", &name, "this worker's name, 1-128 of [A-Za-z0-9_:-] (required)");
  flags.AddString("master", &master, "HOST:PORT of the master (MASTER_ADDR/MASTER_PORT also work)");
  flags.AddString("listen", &listen, "HOST:PORT this worker serves on; port 0 picks a free one");
  flags.AddInt("threads", &threads,
               "intra-op threads for LibTorch; 0: this machine's cores divided by the workers "
               "it runs (never oversubscribed)");
  flags.AddInt("rpc-threads", &rpc_threads, "threads that run incoming calls");
  flags.AddInt("connect-timeout", &connect_timeout_s, "seconds to keep trying to reach the master");
  flags.AddString("device", &device,
                  "where shards live: cpu or cuda:N (a GPU; needs LibTorch with CUDA)");
  std::string device_map;
  flags.AddString("device-map", &device_map,
                  "where CUDA tensors this worker sends land: auto (each peer's --device; the "
                  "master's CPU), none, or PEER/cuda:I=DEVICE,... (default: auto with a cuda "
                  "--device, else none)");
  int slow_ms = 0;
  flags.AddInt("slow-ms", &slow_ms,
               "a deliberately slow worker: each parameter-server gradient computation (master "
               "--mode ps) first sleeps this many milliseconds (for measuring stragglers)");
  std::string host_id;
  flags.AddString("host-id", &host_id,
                  "this process's host identity (else $REMORA_HOST_ID, else host name, boot and "
                  "network namespace): only processes with equal ids share memory");
  launch::SecurityFiles security_files;
  flags.AddSecurityFlags(&security_files);
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  auto security = launch::LoadSecurity(security_files);
  if (!security.ok()) {
    std::cerr << program << ": " << security.status().message() << "\n";
    return 2;
  }
  runtime::TuneAllocator();
  runtime::InstallCachingCpuAllocator();
  if (name.empty()) {
    std::cerr << "worker: --name is required (e.g. --name worker1)\n";
    return 2;
  }
  for (const auto& [flag, addr] : {std::pair{"--master", master}, std::pair{"--listen", listen}}) {
    if (auto s = launch::CheckAddress(addr, flag); !s.ok()) {
      std::cerr << program << ": " << s.message() << "\n";
      return 2;
    }
  }
  auto home = ParseDevice(device, "--device");
  if (!home.ok()) {
    std::cerr << program << ": " << home.status().message() << "\n";
    return 2;
  }
  if (absl::Status s = CheckLocalDevice(*home); !s.ok()) {
    std::cerr << "worker: --device " << s.message() << "\n";
    return 2;
  }
  if (device_map.empty()) device_map = home->is_cuda() ? "auto" : "none";
  auto maps = launch::ParseDeviceMapFlag(device_map);
  if (!maps.ok()) {
    std::cerr << program << ": " << maps.status().message() << "\n";
    return 2;
  }
  if (threads < 0 || rpc_threads < 1 || connect_timeout_s < 1 || slow_ms < 0) {
    std::cerr << "worker: --threads and --slow-ms must be >= 0, --rpc-threads and --connect-timeout >= 1\n";
    return 2;
  }
  ps::SetComputeDelay(absl::Milliseconds(slow_ms));
  if (threads > 0) runtime::SetComputeThreads(threads);

  Registry registry;
  if (auto s = register_functions(registry); !s.ok()) {
    std::cerr << program << ": " << s << "\n";
    return 1;
  }
  AgentOptions options;
  options.name = name;
  options.master_address = master;
  options.listen_address = listen;
  options.num_threads = rpc_threads;
  options.connect_timeout = absl::Seconds(connect_timeout_s);
  options.token = security->token;
  options.tls = security->tls;
  options.device = home->str();
  options.host_id = host_id;
  options.device_maps = maps->maps;
  options.map_to_peer_devices = maps->to_peer_devices;
  auto agent = Agent::Start(options, &registry);
  if (!agent.ok()) {
    std::cerr << program << ": " << agent.status().message() << "\n";
    return 1;
  }
  dist_autograd::Enable(**agent);
  if (auto s = (*agent)->Join(); !s.ok()) {
    std::cerr << program << ": " << s.message() << "\n";
    return 1;
  }
  if (threads == 0) {
    // Share the cores among the workers of this host (the master mostly waits).
    int local_workers = 0;
    for (const auto& w : (*agent)->workers()) {
      local_workers += w.id != 0 && w.host_id == (*agent)->self().host_id;
    }
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    threads = std::max(1, cores / std::max(1, local_workers));
    runtime::SetComputeThreads(threads);
  }
  std::cerr << program << " '" << name << "' (id " << (*agent)->self().id << ") serving at "
            << (*agent)->self().address << " (" << TlsModeName(security->tls) << ") with " << threads
            << " intra-op threads, shards on " << options.device << "\n";
  if (auto s = (*agent)->Shutdown(); !s.ok()) {
    std::cerr << program << ": " << s.message() << "\n";  // the message names this worker
    return 1;
  }
  return 0;
}

#if defined(__SANITIZE_ADDRESS__)
#define REMORA_EXIT_NORMALLY 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define REMORA_EXIT_NORMALLY 1
#endif
#endif

void ExitProgram(int code) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
#ifdef REMORA_EXIT_NORMALLY
  std::exit(code);
#else
  _exit(code);
#endif
}

}  // namespace remora::launch
