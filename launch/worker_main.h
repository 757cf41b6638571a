// The main() of a worker program: flags (--name, --master, --listen,
// --threads, --device, --slow-ms, security), the agent, distributed autograd, and
// serving until the master ends the group. A worker program decides what it
// offers by the registrations it passes: the stock `worker` registers
// examples/builtins.h's RegisterStockWorker, a user's worker adds its own
// module types, tests add test functions.
//
//   int main(int argc, char** argv) {
//     return remora::launch::WorkerMain(argc, argv, "my_worker", RegisterMyModules);
//   }
#pragma once

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "rpc/registry.h"

namespace remora::launch {

// Runs a worker; returns the process's exit code (0: the group ended
// normally, 1: an error, 2: bad flags). `program` names it in --help and
// messages.
int WorkerMain(int argc, char** argv, const std::string& program,
               const std::function<absl::Status(Registry&)>& register_functions);

}  // namespace remora::launch
