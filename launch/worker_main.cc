#include "launch/worker_main.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "autograd/dist_autograd.h"
#include "base/ids.h"
#include "base/status_util.h"
#include "channel/devices.h"
#include "ps/replica.h"
#include "launch/cli.h"
#include "launch/interrupt.h"
#include "rpc/agent.h"
#include "runtime/allocator.h"
#include "runtime/cpus.h"
#include "runtime/threads.h"

namespace remora::launch {

namespace {

// A worker's flags, as parsed.
struct WorkerFlags {
  std::string name;
  std::string master = launch::MasterAddressFromEnv();
  std::string listen = "127.0.0.1:0";
  std::string device = "cpu";
  std::string device_map;
  std::string host_id;
  std::string cpus;
  int threads = 0;
  int rpc_threads = 16;
  int connect_timeout_s = 60;
  int master_timeout_s = 10;
  int slow_ms = 0;
  int busy_poll_us = 0;
  launch::SecurityFiles security;
};

void AddWorkerFlags(launch::FlagParser& flags, WorkerFlags* f) {
  flags.AddString("name", &f->name, "this worker's name, 1-128 of [A-Za-z0-9_:-] (required)");
  flags.AddString("master", &f->master, "HOST:PORT of the master (MASTER_ADDR/MASTER_PORT also work)");
  flags.AddString("listen", &f->listen, "HOST:PORT this worker serves on; port 0 picks a free one");
  flags.AddInt("threads", &f->threads,
               "intra-op threads for LibTorch; 0: this machine's cores divided by the workers "
               "it runs (never oversubscribed)");
  flags.AddString("cpus", &f->cpus,
                  "the cores this worker's threads run on: a list such as 0-3,8, or auto (this host's cores "
                  "shared among the group's workers on it, in worker order); --threads then defaults to "
                  "their number (default: none, the system places the threads)");
  flags.AddInt("busy-poll-us", &f->busy_poll_us,
               "microseconds the threads that wait for peers' messages (local links' readers, the compute "
               "lane, one idle thread of the pool) keep looking before they sleep, at most 10000: lower "
               "latency for cores spent (REMORA_BUSY_POLL_US sets it too)");
  flags.AddInt("rpc-threads", &f->rpc_threads, "threads that run incoming calls");
  flags.AddInt("connect-timeout", &f->connect_timeout_s, "seconds to keep trying to reach the master");
  flags.AddInt("master-timeout", &f->master_timeout_s,
               "seconds the master may stay unreachable (it is pinged every second) before this worker exits 1, "
               "its group gone; 0: wait forever");
  flags.AddString("device", &f->device, "where shards live: cpu or cuda:N (a GPU; needs LibTorch with CUDA)");
  flags.AddString("device-map", &f->device_map,
                  "where CUDA tensors this worker sends land: auto (each peer's --device; the "
                  "master's CPU), none, or PEER/cuda:I=DEVICE,... (default: auto with a cuda "
                  "--device, else none)");
  flags.AddInt("slow-ms", &f->slow_ms,
               "a deliberately slow worker: each parameter-server gradient computation (master "
               "--mode ps) first sleeps this many milliseconds (for measuring stragglers)");
  flags.AddString("host-id", &f->host_id,
                  "this process's host identity (else $REMORA_HOST_ID, else host name, boot and "
                  "network namespace): only processes with equal ids share memory");
  flags.AddSecurityFlags(&f->security);
}

// The agent's options from checked flags; an error is the line to print
// (exit code 2).
absl::StatusOr<rpc::AgentOptions> OptionsFrom(const WorkerFlags& f, const std::string& program) {
  auto bad = [&program](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(program, ": ", what));
  };
  auto security = launch::LoadSecurity(f.security);
  if (!security.ok()) return bad(security.status().message());
  if (f.name.empty()) return absl::InvalidArgumentError("worker: --name is required (e.g. --name worker1)");
  if (!base::IsValidWorkerName(f.name) || f.name == "master") {
    return bad(absl::StrCat("--name '", f.name, "': ",
                            f.name == "master" ? "the master's own name; pick another"
                                               : "use 1 to 128 characters of [A-Za-z0-9_:-]"));
  }
  for (const auto& [flag, addr] : {std::pair{"--master", f.master}, std::pair{"--listen", f.listen}}) {
    if (auto s = launch::CheckAddress(addr, launch::AddressSource(flag, addr)); !s.ok()) return bad(s.message());
  }
  if (absl::EndsWith(f.master, ":0")) {  // (a port to listen on, never one to dial)
    return bad(absl::StrCat(launch::AddressSource("--master", f.master), " ", f.master,
                            " names port 0, which no master listens on: give the port the master prints in "
                            "'master listening on HOST:PORT'"));
  }
  auto home = channel::ParseDevice(f.device, "--device");
  if (!home.ok()) return bad(home.status().message());
  if (absl::Status s = channel::CheckLocalDevice(*home); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("worker: --device ", s.message()));
  }
  auto maps = launch::ParseDeviceMapFlag(f.device_map.empty() ? (home->is_cuda() ? "auto" : "none") : f.device_map);
  if (!maps.ok()) return bad(maps.status().message());
  if (auto s = CheckAtLeast({{"threads", f.threads, 0},
                             {"rpc-threads", f.rpc_threads, 1},
                             {"connect-timeout", f.connect_timeout_s, 1},
                             {"slow-ms", f.slow_ms, 0},
                             {"master-timeout", f.master_timeout_s, 0}});
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("worker: ", s.message()));
  }
  if (auto s = CheckBusyPollFlag(f.busy_poll_us, absl::ToInt64Microseconds(rpc::kMaxBusyPoll)); !s.ok()) {
    return bad(s.message());
  }
  if (f.threads > launch::kMaxThreads || f.rpc_threads > launch::kMaxThreads) {
    return absl::InvalidArgumentError(absl::StrCat("worker: --threads and --rpc-threads must be at most ",
                                                   launch::kMaxThreads, "; got ", f.threads, " and ", f.rpc_threads));
  }
  rpc::AgentOptions options;
  options.name = f.name;
  options.master_address = f.master;
  options.listen_address = f.listen;
  options.num_threads = f.rpc_threads;
  options.connect_timeout = absl::Seconds(f.connect_timeout_s);
  options.master_timeout = absl::Seconds(f.master_timeout_s);
  options.token = security->token;
  options.tls = security->tls;
  options.device = home->str();
  options.host_id = f.host_id;
  options.device_maps = maps->maps;
  options.map_to_peer_devices = maps->to_peer_devices;
  options.busy_poll = absl::Microseconds(f.busy_poll_us);
  return options;
}

// This machine's cores shared among the group's workers on this host (the
// master mostly waits).
int SharedThreads(rpc::Agent& agent) {
  int local_workers = 0;
  for (const auto& w : agent.workers()) local_workers += w.id != 0 && w.host_id == agent.self().host_id;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, local_workers));
}

// Pins this process to the cores --cpus names, kept in `cpus` (left empty
// without --cpus). 'auto' is a share of the host's cores, known once the
// group has formed: before then (`agent` null) it pins nothing.
absl::Status PinToCpus(const WorkerFlags& f, const rpc::Agent* agent, std::vector<int>* cpus) {
  if (f.cpus.empty() || (f.cpus == "auto" && agent == nullptr)) return absl::OkStatus();
  if (f.cpus == "auto") {
    std::vector<base::WorkerId> local;  // the workers on this host
    for (const auto& w : agent->workers()) {
      if (w.id != 0 && w.host_id == agent->self().host_id) local.push_back(w.id);
    }
    std::sort(local.begin(), local.end());
    const int index = static_cast<int>(std::find(local.begin(), local.end(), agent->self().id) - local.begin());
    *cpus = runtime::ShareOfCpus(runtime::AllowedCpus(), index, static_cast<int>(local.size()));
    if (cpus->empty()) return absl::InternalError("--cpus auto: this worker is not among the group's on its host");
  } else {
    ASSIGN_OR_RETURN(*cpus, runtime::ParseCpuList(f.cpus, runtime::AllowedCpus()));
  }
  return runtime::PinProcessToCpus(*cpus);
}

// "worker 'w1' (id 1) serving at HOST:PORT (plaintext) with 2 intra-op
// threads on cores 0-1, busy-polling 1000 us, shards on cpu".
std::string ServingLine(const std::string& program, const std::string& name, const rpc::Agent& agent, int threads,
                        const std::vector<int>& cpus) {
  std::string line = absl::StrCat(program, " '", name, "' (id ", agent.self().id, ") serving at ",
                                  agent.self().address, " (", rpc::TlsModeName(agent.options().tls), ") with ",
                                  threads, threads == 1 ? " intra-op thread" : " intra-op threads");
  if (!cpus.empty()) absl::StrAppend(&line, cpus.size() == 1 ? " on core " : " on cores ", runtime::CpuListText(cpus));
  return absl::StrCat(line, BusyPollingNote(agent.busy_poll()), ", shards on ", agent.options().device);
}

}  // namespace

int WorkerMain(int argc, char** argv, const std::string& program,
               const std::function<absl::Status(rpc::Registry&)>& register_functions) {
  WorkerFlags f;
  launch::FlagParser flags(program, "A remora worker: serves the master's calls until it ends the group.");
  AddWorkerFlags(flags, &f);
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  std::vector<int> cpus;  // (a list pinned now, 'auto' once the group has formed)
  if (absl::Status s = PinToCpus(f, nullptr, &cpus); !s.ok()) {
    std::cerr << program << ": " << s.message() << "\n";
    return 2;
  }
  // Several intra-op threads given, or cores for them: they sleep while
  // they wait, not spin (this may start the program again, before anything
  // is opened). The default (the cores shared among the machine's workers)
  // is known only once the group forms, too late for that: it keeps
  // OpenMP's policy.
  if (f.threads > 1 || (f.threads == 0 && cpus.size() > 1)) runtime::PreferSleepingComputeWaits(argv);
  auto options = OptionsFrom(f, program);
  if (!options.ok()) {
    std::cerr << options.status().message() << "\n";
    return 2;
  }
  runtime::TuneAllocator();
  runtime::InstallCachingCpuAllocator();
  ps::SetComputeDelay(absl::Milliseconds(f.slow_ms));
  if (f.threads > 0) runtime::SetComputeThreads(f.threads);

  rpc::Registry registry;
  if (auto s = register_functions(registry); !s.ok()) {
    std::cerr << program << ": " << s << "\n";
    return 1;
  }
  // (Checked first, so that gRPC's own log lines do not precede the reason.)
  if (absl::Status s = launch::CheckCanListen(f.listen, launch::AddressSource("--listen", f.listen)); !s.ok()) {
    std::cerr << program << ": " << s.message() << "\n";
    return 1;
  }
  auto agent = rpc::Agent::Start(*options, &registry);
  if (!agent.ok()) {
    std::cerr << program << ": " << agent.status().message() << "\n";
    return 1;
  }
  autograd::Enable(**agent, base::LinesTo(std::cout));
  // Ctrl-C, a scheduler's or a supervisor's SIGTERM: said in a line, then
  // the process ends by the signal (the master finds this worker gone; a
  // supervisor restarts it). Declared after the agent: unhooked before it goes.
  launch::InterruptHook interrupted([&program, &f](int signo) {
    std::cerr << program << " '" << f.name << "': stopped by a signal (" << strsignal(signo) << "); exiting"
              << std::endl;
  });
  // (Join returns once the whole group has formed: until then this line says where it waits.)
  std::cerr << program << " '" << f.name << "': joining the master at " << options->master_address
            << " (for up to --connect-timeout " << f.connect_timeout_s << "s)" << std::endl;
  if (auto s = (*agent)->Join(); !s.ok()) {
    std::cerr << program << ": " << s.message() << "\n";
    // (A master stopped by a signal before the group formed: as below.)
    const int signal = (*agent)->group_ended_by_signal();
    return signal > 0 ? 128 + signal : 1;
  }
  if (absl::Status s = f.cpus == "auto" ? PinToCpus(f, agent->get(), &cpus) : absl::OkStatus(); !s.ok()) {
    std::cerr << program << ": " << s.message() << " (the threads run where the system puts them)\n";
    cpus.clear();
  }
  const int threads = f.threads > 0 ? f.threads : cpus.empty() ? SharedThreads(**agent) : static_cast<int>(cpus.size());
  if (f.threads == 0) runtime::SetComputeThreads(threads);
  std::cerr << ServingLine(program, f.name, **agent, threads, cpus) << "\n";
  if (auto s = (*agent)->Shutdown(); !s.ok()) {
    std::cerr << program << ": " << s.message() << "\n";  // the message names this worker
    // (A master stopped by a signal: this worker exits as stopped by it
    // too, which a supervisor does not restart.)
    const int signal = (*agent)->group_ended_by_signal();
    return signal > 0 ? 128 + signal : 1;
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
