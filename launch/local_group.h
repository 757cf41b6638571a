// Starts a master agent in this process and worker programs beside it, on
// this machine: how the demo, rpc_bench and the multi-process tests run a
// group without a cluster.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "launch/cli.h"
#include "rpc/agent.h"

namespace remora::launch {

struct LocalGroup {
  std::unique_ptr<Agent> master;
  std::vector<std::unique_ptr<Subprocess>> workers;

  // Shuts the group down gracefully and waits for every worker to exit;
  // an error names the first worker that did not exit 0.
  absl::Status Shutdown(absl::Duration timeout = absl::Seconds(30));
};

// The program a local group's workers run: its name beside this executable
// (SiblingProgram) and the arguments that come before the worker flags (a
// subcommand: `rpc_demo worker --name ...`).
struct WorkerProgram {
  WorkerProgram(std::string program = "worker", std::vector<std::string> leading = {})
      : name(std::move(program)), leading_args(std::move(leading)) {}
  WorkerProgram(const char* program) : name(program) {}  // NOLINT: a name alone is the usual case

  std::string name;
  std::vector<std::string> leading_args;
  std::vector<std::string> env;  // NAME=VALUE entries the workers get besides this process's
};

// Starts the master (listening on 127.0.0.1, a free port), spawns one
// worker program per name with `extra_args`, and joins.
absl::StatusOr<LocalGroup> StartLocalGroup(const std::vector<std::string>& names,
                                           const Registry* registry,
                                           const std::vector<std::string>& extra_args = {},
                                           AgentOptions options = {},
                                           const WorkerProgram& program = {});

}  // namespace remora::launch
