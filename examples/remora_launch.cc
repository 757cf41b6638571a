// remora-launch: starts this process's role in a cluster job from the
// environment (torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or
// Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_JOB_NODELIST): rank 0 becomes the
// master with the given master flags, every other rank the worker
// `worker<rank>` joining it. It replaces itself with that program (exec),
// so the job's exit code and signals are the role's own; with
// --max-restarts N it stays as the program's supervisor instead and starts
// it again, under the same name, when it fails.
//
//   srun remora-launch --batches 2 --image-size 32        (Slurm)
//   RANK=1 WORLD_SIZE=3 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 remora-launch ...
//
// Links no LibTorch: launch/cluster_env.h does the work.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "launch/cluster_env.h"
#include "launch/program_path.h"

namespace {

using remora::launch::ClusterRole;
using remora::launch::EnvSource;

constexpr char kUsage[] = R"(usage: remora-launch [launcher flags] [master flags] [-- worker flags]

Starts this process's part of a remora job from the cluster's environment:
rank 0 runs `master` with the master flags, every other rank r runs `worker
--name worker<r>`, which joins it. Ranks come from torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or Slurm's (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_JOB_NODELIST). Rank 0's host
is MASTER_ADDR, else the first host of the node list (a Slurm node name that
does not resolve is looked up with `scontrol show node`); MASTER_PORT defaults
to 29500. The master listens on that host's address (or --listen), each worker
on the address of its host that routes to the master, on a free port.

launcher flags:
  --env auto|torchrun|slurm   which variables to read; auto: torchrun's when RANK
                              or WORLD_SIZE is set, else Slurm's (default: auto)
  --listen HOST:PORT          where rank 0 listens (default: rank 0's host address
                              and MASTER_PORT; 0.0.0.0 only when given here)
  --worker-listen HOST:PORT   where workers serve (default: this host's address
                              toward the master, port 0)
  --host-id ID                this process's host identity (REMORA_HOST_ID), for
                              containers: processes share memory only when their
                              host ids are equal
  --master-program PATH       the master program (default: master beside this one)
  --worker-program PATH       the worker program (default: worker beside this one),
                              e.g. your own built with launch::WorkerMain
  --max-restarts N            start this rank's program again, under the same name,
                              when it fails (exit code other than 0 and 2, or a
                              signal; not a worker that exits as its master
                              stopped by a signal, nor the master stopped by
                              one), up to N times (default 0: replace this
                              process with it). The master gets --max-restarts N
                              too: it puts a restarted worker back in its place and
                              goes on from the last checkpoint, the other workers
                              keep running. A failed master is restarted as well:
                              give it --checkpoint-dir DIR --resume auto, so that the
                              job goes on from its last checkpoint
  --spares N                  the last N worker ranks stand by (the master's
                              --spares): they hold no stage and take a lost
                              worker's place at once (with --max-restarts)
  --restart-delay S           seconds to wait before a restart (default 3: the
                              failed job's other processes end first)
  --dry-run                   print the role and its command line, start nothing
  --help                      print this and exit

Passed to every rank: --token-file, --tls-cert, --tls-key, --tls-ca and
--connect-timeout. Every other flag before `--` goes to the master (see
`master --help`); flags after `--` go to the workers (see `worker --help`).
remora-launch sets the master's --workers itself, so do not pass it.
)";

// Flags remora-launch takes, and the master flags it passes to every rank.
struct Flags {
  std::string env = "auto";
  std::string listen;
  std::string worker_listen;
  std::string host_id;
  std::string master_program;
  std::string worker_program;
  bool dry_run = false;
  int max_restarts = 0;
  int spares = 0;
  double restart_delay = 3;
  std::vector<std::string> master_args;
  std::vector<std::string> shared_args;
  std::vector<std::string> worker_args;
};

// Parses argv into Flags; false after printing the usage or an error, with
// the exit code in *code.
bool ParseFlags(int argc, char** argv, Flags* f, int* code) {
  const std::vector<std::string> own = {"env",         "listen",         "worker-listen", "host-id",
                                        "master-program", "worker-program", "max-restarts",  "restart-delay",
                                        "spares"};
  const std::vector<std::string> shared = {"token-file", "tls-cert", "tls-key", "tls-ca",
                                           "connect-timeout"};
  auto in = [](const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      f->worker_args.assign(argv + i + 1, argv + argc);
      break;
    }
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      *code = 0;
      return false;
    }
    if (arg == "--dry-run") {
      f->dry_run = true;
      continue;
    }
    std::string name = arg.rfind("--", 0) == 0 ? arg.substr(2) : "", value;
    bool inline_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    if (name == "workers" || name == "local") {
      std::cerr << "remora-launch: --" << name
                << " is not for remora-launch: it starts the master and one worker per rank "
                   "(worker1 ... worker<N-1>) from the environment\n";
      *code = 2;
      return false;
    }
    if (!in(own, name) && !in(shared, name)) {
      f->master_args.push_back(arg);  // the master's, value and all
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argc) {
        std::cerr << "remora-launch: --" << name << " needs a value\n";
        *code = 2;
        return false;
      }
      value = argv[++i];
    }
    if (in(shared, name)) {
      f->shared_args.insert(f->shared_args.end(), {"--" + name, value});
    } else if (name == "env") {
      f->env = value;
    } else if (name == "listen") {
      f->listen = value;
    } else if (name == "worker-listen") {
      f->worker_listen = value;
    } else if (name == "host-id") {
      f->host_id = value;
    } else if (name == "master-program") {
      f->master_program = value;
    } else if (name == "spares") {
      if (!absl::SimpleAtoi(value, &f->spares) || f->spares < 0) {
        std::cerr << "remora-launch: --spares wants a count >= 0 of worker ranks, not '" << value << "'\n";
        *code = 2;
        return false;
      }
    } else if (name == "max-restarts" || name == "restart-delay") {
      const bool count = name == "max-restarts";
      const bool good = count ? absl::SimpleAtoi(value, &f->max_restarts) && f->max_restarts >= 0
                              : absl::SimpleAtod(value, &f->restart_delay) && f->restart_delay >= 0 &&
                                    f->restart_delay <= 3600;
      if (!good) {
        std::cerr << "remora-launch: --" << name << " wants " << (count ? "a count >= 0" : "seconds in 0..3600")
                  << ", not '" << value << "'\n";
        *code = 2;
        return false;
      }
    } else {
      f->worker_program = value;
    }
  }
  return true;
}

// The IP address of rank 0's host: MASTER_ADDR or the node list's first
// host, through the resolver, else (Slurm) its NodeAddr from scontrol.
absl::StatusOr<std::string> MasterIp(const ClusterRole& role) {
  auto resolved = remora::launch::ResolveHost(role.master_host);
  if (resolved.ok() || role.source != EnvSource::kSlurm) {
    if (!resolved.ok()) {
      return absl::NotFoundError(absl::StrCat(resolved.status().message(), " (rank 0's host, from ",
                                              role.master_host_origin,
                                              "); set MASTER_ADDR to its IP address"));
    }
    return resolved;
  }
  // A Slurm node name need not resolve (NodeName=n1 NodeAddr=10.0.0.1).
  const std::string command =
      absl::StrCat("scontrol show node -o '", role.master_host, "' 2>&1");
  std::string output;
  if (role.master_host.find('\'') == std::string::npos) {
    if (FILE* p = popen(command.c_str(), "r")) {
      char buf[4096];
      size_t n;
      while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output.append(buf, n);
      pclose(p);
    }
  }
  auto addr = remora::launch::NodeAddrFromScontrol(output);
  if (addr.ok()) {
    auto ip = remora::launch::ResolveHost(*addr);
    if (ip.ok()) return ip;
    addr = ip.status();
  }
  return absl::NotFoundError(absl::StrCat(
      resolved.status().message(), " (rank 0's host, from ", role.master_host_origin,
      "), and `scontrol show node ", role.master_host, "` gave no usable NodeAddr (",
      addr.status().message(), "); set MASTER_ADDR to rank 0's IP address"));
}

// Whether the master's flags resume from their checkpoint directory.
bool ResumesAuto(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--resume=auto" || (args[i] == "--resume" && i + 1 < args.size() && args[i + 1] == "auto")) {
      return true;
    }
  }
  return false;
}

// The running program, for the signal handler to pass a signal on to.
volatile sig_atomic_t g_child = 0;
volatile sig_atomic_t g_stopping = 0;

void PassOn(int sig) {
  g_stopping = 1;
  if (g_child > 0) kill(static_cast<pid_t>(g_child), sig);
}

// "exited with code N" / "was killed by signal N (NAME)"; a code of 128 +
// SIGTERM, SIGINT or SIGHUP's number (a worker exits so when one stopped
// its master) names the signal too.
std::string Describe(int status, bool master) {
  if (WIFSIGNALED(status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  }
  const int code = WEXITSTATUS(status);
  if (code == 128 + SIGTERM || code == 128 + SIGINT || code == 128 + SIGHUP) {
    return absl::StrCat("exited with code ", code, " (128 + signal ", code - 128, ", ", strsignal(code - 128),
                        master ? ")" : ": as a worker exits whose master that signal stopped)");
  }
  return absl::StrCat("exited with code ", code);
}

// Runs `argv` as a child and starts it again when it fails, up to
// `restarts` times; returns the last run's exit code (128 + the signal
// when killed by one). Exit code 2 (bad flags) is not retried: it would
// fail the same way; nor is a program that was stopped: one that exits 128
// + SIGTERM, SIGINT or SIGHUP (a worker whose master was stopped so), or
// the master killed by one of those (it ended its group). A worker killed
// by one is restarted, as any worker lost: its master goes on. Those
// signals sent to remora-launch are passed on to the program and end the
// restarts.
int Supervise(std::vector<char*> argv, const std::string& who, const std::string& what, bool master,
              int restarts, double delay) {
  // Signals passed on (those not ignored: under nohup SIGHUP stays
  // ignored, here and in the program); the program gets the dispositions
  // remora-launch was started with.
  const int kPassed[] = {SIGTERM, SIGINT, SIGHUP};
  struct sigaction original[3];
  struct sigaction pass = {};
  pass.sa_handler = PassOn;
  pass.sa_flags = SA_RESTART;
  sigemptyset(&pass.sa_mask);
  sigset_t passed, before;
  sigemptyset(&passed);
  for (int k = 0; k < 3; ++k) {
    sigaction(kPassed[k], nullptr, &original[k]);
    if (original[k].sa_handler != SIG_IGN) sigaction(kPassed[k], &pass, nullptr);
    sigaddset(&passed, kPassed[k]);
  }
  signal(SIGCHLD, SIG_DFL);  // an inherited SIG_IGN would reap the program before waitpid sees it
  const pid_t self = getpid();
  for (int run = 0;; ++run) {
    // Held until g_child is set, so that none arrives before it can be
    // passed on; one that came before is seen here.
    sigprocmask(SIG_BLOCK, &passed, &before);
    if (g_stopping) return 128 + SIGTERM;
    const pid_t pid = fork();
    if (pid < 0) {
      sigprocmask(SIG_SETMASK, &before, nullptr);
      std::cerr << "remora-launch: " << who << ": cannot start " << what << ": " << std::strerror(errno) << "\n";
      return 1;
    }
    if (pid == 0) {
      for (int k = 0; k < 3; ++k) sigaction(kPassed[k], &original[k], nullptr);
      sigprocmask(SIG_SETMASK, &before, nullptr);
      prctl(PR_SET_PDEATHSIG, SIGTERM);  // the program ends with its supervisor
      if (getppid() != self) _exit(128 + SIGTERM);  // the supervisor is already gone
      execv(argv[0], argv.data());
      std::cerr << "remora-launch: " << who << ": cannot start " << argv[0] << ": " << std::strerror(errno)
                << " (--master-program / --worker-program give another path)\n";
      _exit(127);
    }
    g_child = pid;
    sigprocmask(SIG_SETMASK, &before, nullptr);
    int status = 0;
    pid_t waited;
    while ((waited = waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
    }
    g_child = 0;
    if (waited < 0) {
      std::cerr << "remora-launch: " << who << ": cannot wait for " << what << ": " << std::strerror(errno) << "\n";
      return 1;
    }
    const int code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
    if (code == 0) return 0;
    const bool stop_signal = code == 128 + SIGTERM || code == 128 + SIGINT || code == 128 + SIGHUP;
    const bool stopped = stop_signal && (master || !WIFSIGNALED(status));
    if (g_stopping || stopped || code == 2 || code == 127) {
      if (stopped && !g_stopping) {
        std::cerr << "remora-launch: " << who << ": " << what << " " << Describe(status, master) << ": not restarted\n";
      }
      return code;
    }
    if (run >= restarts) {
      std::cerr << "remora-launch: " << who << ": " << what << " " << Describe(status, master) << " after " << run
                << " restarts (--max-restarts " << restarts << "): giving up\n";
      return code;
    }
    std::cerr << "remora-launch: " << who << ": " << what << " " << Describe(status, master) << "; restarting it in "
              << delay << " s (restart " << run + 1 << " of " << restarts << ")" << std::endl;
    // Slept in steps, so that a signal meanwhile ends the wait.
    for (double left = delay; left > 0 && !g_stopping; left -= 0.1) usleep(static_cast<useconds_t>(1e5));
    if (g_stopping) return code;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  int code = 0;
  if (!ParseFlags(argc, argv, &f, &code)) return code;
  auto choice = remora::launch::ParseEnvChoice(f.env);
  if (!choice.ok()) {
    std::cerr << "remora-launch: " << choice.status().message() << "\n";
    return 2;
  }
  auto role = remora::launch::RoleFromEnvironment(remora::launch::ReadClusterEnvironment(), *choice);
  if (!role.ok()) {
    std::cerr << "remora-launch: " << role.status().message() << "\n";
    return 2;
  }
  remora::launch::LaunchOptions o;
  o.master_program = f.master_program.empty() ? remora::launch::SiblingProgram("master") : f.master_program;
  o.worker_program = f.worker_program.empty() ? remora::launch::SiblingProgram("worker") : f.worker_program;
  o.master_args = f.master_args;
  o.spares = f.spares;
  if (f.spares > 0 && static_cast<size_t>(f.spares) >= role->worker_names().size()) {
    std::cerr << "remora-launch: --spares " << f.spares << " leaves no worker to train: the job has "
              << role->worker_names().size() << " worker ranks\n";
    return 2;
  }
  const bool elastic_given = std::any_of(f.master_args.begin(), f.master_args.end(), [](const std::string& a) {
    return a == "--max-restarts" || a.rfind("--max-restarts=", 0) == 0;
  });
  if (f.max_restarts > 0 && !elastic_given) {
    // The master replaces a lost worker itself, waiting for the worker's
    // remora-launch to start it again under its name: the survivors go on.
    o.master_args.push_back("--max-restarts");
    o.master_args.push_back(std::to_string(f.max_restarts));
  }
  o.shared_args = f.shared_args;
  o.worker_args = f.worker_args;
  auto fail = [&](const std::string& why) {
    std::cerr << "remora-launch: " << role->Describe() << ": " << why << "\n";
    return 1;
  };
  if (role->is_master() && !f.listen.empty()) {
    o.master_address = f.listen;  // the master checks HOST:PORT itself
  } else {
    if (role->master_host == "0.0.0.0" || role->master_host == "::") {
      return fail(absl::StrCat(role->master_host_origin, " is ", role->master_host,
                               ", which workers cannot reach; give rank 0's address (to listen "
                               "on every interface, pass --listen ",
                               role->master_host == "::" ? "[::]" : "0.0.0.0", ":PORT)"));
    }
    auto ip = MasterIp(*role);
    if (!ip.ok()) return fail(std::string(ip.status().message()));
    o.master_address = remora::launch::JoinHostPort(*ip, role->master_port);
    if (role->is_master()) {
      if (auto s = remora::launch::CheckLocalAddress(*ip); !s.ok()) {
        char host[256] = {0};
        gethostname(host, sizeof(host) - 1);
        return fail(absl::StrCat("rank 0 runs on ", host, ", but rank 0's host '",
                                 role->master_host, "' (from ", role->master_host_origin,
                                 ") is ", *ip, ": ", s.message(),
                                 ". Set MASTER_ADDR to this host's address, or pass --listen"));
      }
    } else if (!f.worker_listen.empty()) {
      o.worker_listen = f.worker_listen;
    } else {
      auto local = remora::launch::LocalAddressToward(*ip, role->master_port);
      if (!local.ok()) return fail(std::string(local.status().message()));
      o.worker_listen = remora::launch::JoinHostPort(*local, 0);
    }
  }
  if (f.max_restarts > 0 && !ResumesAuto(f.master_args)) {
    // Checked on every rank: they share one command line. (A bad flag
    // combination: 2, which no supervisor retries.)
    fail(absl::StrCat("--max-restarts restarts the master too: give it --checkpoint-dir DIR --resume auto, so that "
                      "the job goes on from its last checkpoint instead of starting over",
                      role->is_master() ? "" : absl::StrCat(" (rank ", role->rank, " is a worker, but every rank is "
                                                          "given the same command, the master's flags included)")));
    return 2;
  }
  const std::vector<std::string> command = remora::launch::RoleCommand(*role, o);
  const std::string summary =
      role->is_master()
          ? absl::StrCat("master at ", o.master_address, " for ",
                         absl::StrJoin(role->worker_names(), ","))
          : absl::StrCat("worker '", role->name(), "' at ", o.worker_listen, " joining ",
                         o.master_address);
  // The role's program runs with glibc's heap on transparent huge pages
  // unless this environment sets glibc's tunables itself: a process linked
  // with LibTorch starts in about 0.75x the CPU and faults a fifth as often
  // in its first steps (docs/testing-and-ci.md, "Huge pages for the heap").
  const bool tunables_given = std::getenv("GLIBC_TUNABLES") != nullptr;
  constexpr char kTunables[] = "glibc.malloc.hugetlb=1";
  if (f.dry_run) {
    std::cout << role->Describe() << ": " << summary << "\n"
              << absl::StrJoin(command, " ") << "\n";
    if (!f.host_id.empty()) std::cout << "REMORA_HOST_ID=" << f.host_id << "\n";
    if (!tunables_given) std::cout << "GLIBC_TUNABLES=" << kTunables << "\n";
    if (f.max_restarts > 0) {
      std::cout << "restarted up to " << f.max_restarts << (f.max_restarts == 1 ? " time\n" : " times\n");
    }
    return 0;
  }
  std::cerr << "remora-launch: " << role->Describe() << ": " << summary << std::endl;
  if (!f.host_id.empty()) setenv("REMORA_HOST_ID", f.host_id.c_str(), 1);
  if (!tunables_given) setenv("GLIBC_TUNABLES", kTunables, 0);
  std::vector<char*> args;
  for (const auto& a : command) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  if (f.max_restarts > 0) {
    const std::string what = role->is_master() ? "the master" : absl::StrCat("worker '", role->name(), "'");
    return Supervise(args, role->Describe(), what, role->is_master(), f.max_restarts, f.restart_delay);
  }
  execv(args[0], args.data());
  return fail(absl::StrCat("cannot start ", command[0], ": ", std::strerror(errno),
                           " (--master-program / --worker-program give another path)"));
}
