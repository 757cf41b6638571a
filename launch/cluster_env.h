// Roles from a cluster's environment: which rank this process is, how many
// there are and where rank 0 (the master) listens, read from torchrun's
// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or
// Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID,
// SLURM_JOB_NODELIST), and the command line that starts the role: rank 0
// runs `master --workers worker1,...`, rank r > 0 runs `worker --name
// worker<r>` joining it. examples/remora_launch.cc is the program.
//
// Torch-free (Abseil and the C library only), so the launcher links no
// LibTorch. The parsing functions are pure; the address functions at the
// end ask this host's resolver and routing table.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace remora::launch {

// Expands a Slurm host list as `scontrol show hostnames` does:
// "n[1-3,7],gpu-a[01-02]" is n1 n2 n3 n7 gpu-a01 gpu-a02. A range is
// zero-padded to the width of its lower bound ("[08-10]": 08 09 10), several
// brackets in one name multiply ("r[1-2]n[1-2]": r1n1 r1n2 r2n1 r2n2), and
// empty items are skipped. Errors name the list and the offending part.
absl::StatusOr<std::vector<std::string>> ExpandHostList(absl::string_view list);

// The variables a launcher reads (set ones only), by name.
using EnvMap = std::map<std::string, std::string>;

// The variables of kClusterVariables that this process has.
EnvMap ReadClusterEnvironment();

// Every variable RoleFromEnvironment looks at, in the order errors list them.
extern const std::vector<std::string> kClusterVariables;

// Where the role came from.
enum class EnvSource { kTorchrun, kSlurm };
const char* EnvSourceName(EnvSource source);

// This process's place in the job.
struct ClusterRole {
  EnvSource source = EnvSource::kTorchrun;
  int rank = 0;
  int world_size = 0;
  int local_rank = 0;
  // Slurm: this task's node (SLURM_NODEID) and the job's nodes, expanded;
  // -1 and empty under torchrun.
  int node_id = -1;
  std::vector<std::string> nodes;
  // Slurm: the node this task runs on (SLURMD_NODENAME), when set.
  std::string node_name;
  // Rank 0's host: MASTER_ADDR, else (Slurm) the first host of the node
  // list; and where it listens (MASTER_PORT, else 29500).
  std::string master_host;
  int master_port = 29500;
  // Where master_host came from, for messages: "MASTER_ADDR" or
  // "the first host of SLURM_JOB_NODELIST=n[1-2]".
  std::string master_host_origin;

  bool is_master() const { return rank == 0; }
  // "master" for rank 0, else "worker<rank>".
  std::string name() const;
  // worker1 ... worker<world_size - 1>, in rank order.
  std::vector<std::string> worker_names() const;
  // One line: "rank 1 of 4 (slurm, node n1, local rank 1)".
  std::string Describe() const;
};

// Which variables to read: torchrun's, Slurm's, or (kAuto) torchrun's
// where RANK or WORLD_SIZE is set, else Slurm's where SLURM_PROCID is.
enum class EnvChoice { kAuto, kTorchrun, kSlurm };
absl::StatusOr<EnvChoice> ParseEnvChoice(absl::string_view text);

// The role `env` describes. A missing, malformed or contradictory variable
// (a rank not below the world size, SLURM_NTASKS against SLURM_NPROCS, a
// node id outside the node list, fewer than two ranks) is an
// InvalidArgument error that says what is wrong and lists every variable
// of kClusterVariables that was found, with its value.
absl::StatusOr<ClusterRole> RoleFromEnvironment(const EnvMap& env,
                                                EnvChoice choice = EnvChoice::kAuto);

// NodeAddr from the output of `scontrol show node -o NAME` (one line of
// Key=Value pairs); NotFound when the line has none.
absl::StatusOr<std::string> NodeAddrFromScontrol(absl::string_view output);

// The launcher's decisions, made from the role and its flags.
struct LaunchOptions {
  std::string master_program;   // path of the master program
  std::string worker_program;   // path of the worker program
  std::vector<std::string> master_args;  // passed to rank 0 only
  std::vector<std::string> shared_args;  // passed to every rank (security, timeouts)
  std::vector<std::string> worker_args;  // passed to ranks > 0 only
  // Rank 0: HOST:PORT it listens on. Ranks > 0: where they join the master.
  std::string master_address;
  // Ranks > 0: HOST:PORT the worker serves on.
  std::string worker_listen;
  // The last `spares` worker ranks stand by: rank 0 gets them as --spares
  // instead of in --workers (master --max-restarts).
  int spares = 0;
};

// The argv that starts the role: rank 0 gets
//   master <master_args> <shared_args> --listen <master_address> --workers worker1,...
//          [--spares worker<N-s>,...]
// and rank r gets
//   worker <shared_args> <worker_args> --name worker<r> --master <master_address>
//          --listen <worker_listen>
std::vector<std::string> RoleCommand(const ClusterRole& role, const LaunchOptions& options);

// "HOST:PORT", with IPv6 literals in brackets.
std::string JoinHostPort(const std::string& host, int port);

// True for an IPv4 or IPv6 literal.
bool IsIpLiteral(const std::string& host);

// An IP address of `host` from the resolver (IPv4 first); an error naming
// the host and the resolver's reason.
absl::StatusOr<std::string> ResolveHost(const std::string& host);

// The address of this host that packets to `ip` leave from (the routing
// table's choice; nothing is sent): where a worker serves so that the
// master can reach it.
absl::StatusOr<std::string> LocalAddressToward(const std::string& ip, int port);

// OK when `ip` is an address of this host (a socket binds to it).
absl::Status CheckLocalAddress(const std::string& ip);

}  // namespace remora::launch
