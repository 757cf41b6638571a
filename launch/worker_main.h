// The main() of a worker program: flags (--name, --master, --listen,
// --threads, --device, --slow-ms, security), the agent, distributed autograd, and
// serving until the master ends the group. A worker program decides what it
// offers by the registrations it passes: the stock `worker` registers
// examples/stock_worker.h's RegisterStockWorker, a user's worker adds its own
// module types, tests add test functions.
//
//   int main(int argc, char** argv) {
//     remora::launch::ExitProgram(
//         remora::launch::WorkerMain(argc, argv, "my_worker", RegisterMyModules));
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
               const std::function<absl::Status(rpc::Registry&)>& register_functions);

// Ends the process with exit code `code` once stdout and stderr are
// flushed, without running static destructors. The end of every remora
// program's main(): LibTorch's static destructors (deregistering its
// operators in __cxa_finalize) were seen to keep a master that had already
// failed alive for over 30 s on a loaded machine, and nothing of remora's
// needs them; the operating system frees what is left. Under the
// sanitizers it is a normal exit, so that the leak check runs.
[[noreturn]] void ExitProgram(int code);

}  // namespace remora::launch
