// Starts a master agent in this process and worker programs beside it, on
// this machine: how the demo, rpc_bench and the multi-process tests run a
// group without a cluster.
//
//   Registry registry;  // the master's own functions (filled before the start)
//   RETURN_IF_ERROR(train::RegisterWorkerFunctions(registry));
//   ASSIGN_OR_RETURN(launch::LocalGroup group, launch::StartLocalGroup({"w1", "w2"}, &registry));
//   ... make a trainer on *group.master, train ...
//   RETURN_IF_ERROR(group.Shutdown());  // or let it go: its destructor ends the group too
//
// The master it starts has distributed autograd enabled
// (autograd::Enable) and has joined: it is ready for a trainer.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "launch/cli.h"
#include "rpc/agent.h"

namespace remora::launch {

// A master and the worker processes it started (StartLocalGroup).
//
// Thread-safety: one thread uses it (the master's). Ownership: owns the
// master's agent and the worker processes; move-only. A group that is
// destroyed without Shutdown() (a master that returns early, with an error)
// ends as Shutdown() does: its workers are told to stop and exit 0, none is
// left waiting for a master that is gone. Make trainers after it, so that
// they go before it.
struct LocalGroup {
  LocalGroup() = default;
  LocalGroup(LocalGroup&& other) = default;
  // Ends this group first (as the destructor does), then takes `other`'s.
  LocalGroup& operator=(LocalGroup&& other);
  ~LocalGroup();

  std::unique_ptr<rpc::Agent> master;
  std::vector<std::unique_ptr<Subprocess>> workers;
  std::vector<std::string> names;  // workers[i] is worker names[i]

  // Shuts the group down gracefully (Agent::Shutdown: every worker is told
  // to stop) and waits for every worker to exit, at most `timeout` each (one
  // still running then is killed); an error names the first worker that did
  // not exit 0. Called again: OK, nothing done.
  absl::Status Shutdown(absl::Duration timeout = absl::Seconds(30));

 private:
  bool ended_ = false;
};

// The program a local group's workers run: its name beside this executable
// (SiblingProgram), or an absolute path ("/opt/remora/bin/worker"), and the
// arguments that come before the worker flags (a subcommand: `rpc_demo
// worker --name ...`).
struct WorkerProgram {
  WorkerProgram(std::string program = "worker", std::vector<std::string> leading = {})
      : name(std::move(program)), leading_args(std::move(leading)) {}
  WorkerProgram(const char* program) : name(program) {}  // NOLINT: a name alone is the usual case

  std::string name;
  std::vector<std::string> leading_args;
  std::vector<std::string> env;  // NAME=VALUE entries the workers get besides this process's
};

// How StartLocalGroup starts the master and the workers, beside their names.
struct LocalGroupOptions {
  // Flags every worker gets after its --name, --master and --listen
  // (worker --help lists them: --threads 1, the TLS files, --device, ...).
  std::vector<std::string> worker_args;
  // The master's agent. Its listen_address is where the master listens:
  // by default 127.0.0.1 at a free port; "127.0.0.1:29500" (or
  // "0.0.0.0:29500") picks the port. The name defaults to "master";
  // is_master and workers are set by StartLocalGroup.
  rpc::AgentOptions master;
  // The program the workers run (default: `worker` beside this program).
  WorkerProgram program;
  // Where each worker listens, HOST:PORT (its --listen), in the order of
  // the names: one per worker, or none, which puts each at a free port of
  // 127.0.0.1. For ports a firewall lets through, or known in advance:
  //   o.worker_addresses = {"127.0.0.1:30001", "127.0.0.1:30002"};
  // A malformed or repeated address, or a port that is in use, fails
  // before any worker starts, naming the worker.
  std::vector<std::string> worker_addresses;
};

// Starts the master (with distributed autograd enabled), spawns one worker
// program per name, and waits until they have all joined. A worker that
// exits before the group formed fails it at once, naming the worker; the
// workers already started are then stopped.
absl::StatusOr<LocalGroup> StartLocalGroup(const std::vector<std::string>& names, const rpc::Registry* registry,
                                           const LocalGroupOptions& options);

// The same, as it was called before LocalGroupOptions: `extra_args` are
// LocalGroupOptions::worker_args, `options` the master's agent options.
absl::StatusOr<LocalGroup> StartLocalGroup(const std::vector<std::string>& names,
                                           const rpc::Registry* registry,
                                           const std::vector<std::string>& extra_args = {},
                                           rpc::AgentOptions options = {},
                                           const WorkerProgram& program = {});

}  // namespace remora::launch
