// master: trains ResNet50 as a pipeline over worker processes (or, with
// --local, in this process alone) and reports how the split count pays.
//
//   worker --name worker1 & worker --name worker2 &
//   master --workers worker1,worker2 --splits 1,2,4,8
//
// The classic demo: random images, MSE loss against one-hot labels over
// 1000 classes, SGD through the DistributedOptimizer. --splits N means N
// micro-batches per batch (not their size). Each worker places its shard on
// its own --device (cuda:N for a GPU); activations between GPU workers go
// GPU to GPU (CUDA IPC or NCCL) as the workers' device maps say, and the
// last stage's output lands on the master's CPU.
//
// This file is the command line alone (master/flags.h checks it);
// the run is one call, master::RunMaster (master/run.h).
#include <algorithm>
#include <iostream>
#include <string>
#include <thread>
#include <utility>

#include "base/status_util.h"
#include "master/flags.h"
#include "examples/stock_worker.h"
#include "launch/cli.h"
#include "launch/error_text.h"
#include "launch/worker_main.h"
#include "runtime/threads.h"
#include "master/run.h"

namespace remora {
namespace {

int Main(int argc, char** argv) {
  master::Flags flags = master::DefaultFlags();
  launch::FlagParser parser("master",
                         "Trains ResNet50 as a pipeline over worker processes and reports the "
                         "speedup of each split count.\nStart the workers first: "
                         "worker --name worker1 (see worker --help).");
  master::AddFlags(parser, &flags);
  int code = 0;
  if (!parser.Parse(argc, argv, &code)) return code;
  flags.given = parser.given();
  const bool verbose = flags.verbose;
  auto said = [verbose](const absl::Status& s) {
    return verbose ? std::string(s.message()) : launch::WithoutTorchScriptTraceback(s.message());
  };
  auto line = master::Check(std::move(flags));
  if (line.ok()) {  // (bad paths are bad flag values too: a supervisor does not restart for them)
    if (absl::Status paths = master::CheckPaths(line->config); !paths.ok()) line = paths;
    if (line.ok()) line->paths_checked = true;
  }
  if (!line.ok()) {
    std::cerr << "master: " << said(line.status()) << "\n";
    return 2;
  }
  // Training here on several threads (--local, --compare-local, --mode
  // ps): LibTorch's threads sleep while they wait, not spin (this may
  // start the program again, before anything is printed or opened).
  const master::RunOptions& c = line->config;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if ((c.local || c.compare_local || c.coordinator_threads > 1) && (c.threads_auto ? cores : c.threads) > 1) {
    runtime::PreferSleepingComputeWaits(argv);
  }
  if (!line->note.empty()) std::cout << line->note << "\n";
  rpc::Registry registry;  // what this process serves: the stock worker's (its stage types too)
  absl::Status s = examples::RegisterStockWorker(registry);
  try {
    if (s.ok()) s = master::RunMaster(*line, &registry);
  } catch (...) {  // (a bug: errors are statuses; never an abort)
    s = base::StatusFromCurrentException("unexpected error (please report it)");
  }
  if (!s.ok()) {
    std::cerr << "master: " << said(s) << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace remora

int main(int argc, char** argv) { remora::launch::ExitProgram(remora::Main(argc, argv)); }
