// The master's whole run as one call: what `master` does once its command
// line is checked (master/flags.h): the agent listening, the
// dataset loaded, the workers waited for, the stages chosen, each --splits
// count trained (a pipeline, its replicas, the parameter server, or this
// process alone), and the summary, report, trace, timeline and curves
// written. The program's own (not installed: a program of one's own builds
// on train/, docs/writing-your-own-master.md); main.cc calls it as
//
//   master::RunPlan plan;                         // options as C++ structs
//   plan.config.all_workers = plan.config.workers = {"w1", "w2"};
//   plan.config.splits = {1, 8};
//   Registry registry;                            // the master's own
//   RETURN_IF_ERROR(examples::RegisterStockWorker(registry));
//   absl::Status s = master::RunMaster(plan, &registry);
//
// The options, the runs and their pieces are in master/runs.h and
// master/ps_runs.h.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "launch/cli.h"
#include "rpc/registry.h"
#include "master/ps_runs.h"
#include "master/runs.h"

namespace remora::master {

// A checked run: what RunMaster runs.
struct RunPlan {
  RunOptions config;
  PsFlags ps;
  bool ps_mode = false;  // --mode ps: the parameter server instead of a pipeline
  launch::Security security;
  // The run's identity with --checkpoint-dir or --resume; with --resume,
  // the checkpoint and the stages it was saved from.
  Checkpointing checkpoints;
  // A line to print before it starts, or empty (--resume auto that found
  // no checkpoint).
  std::string note;
  // CheckPaths(config) has passed already (`master` checks it with its
  // flags); RunMaster checks it otherwise.
  bool paths_checked = false;
};

// The paths a run reads and writes, checked before it starts, so that no
// run is lost to a typo in a path: a --dataset directory exists, the files
// written at the end (--report, --trace, --timeline, --curves) and the
// directories written into (--checkpoint-dir, --tensorboard) can be
// written (missing directories are made). RunMaster checks them first
// unless the plan says they were; `master` checks them with its flags, as
// bad flag values (exit 2).
absl::Status CheckPaths(const RunOptions& c);

// Runs `plan` (config.local: in this process; else over config.all_workers,
// which register with this process's agent, serving `registry`). Every
// error ends the group (the workers are told why and exit) and is
// returned; the workers are shut down when it succeeds. `plan` is
// completed as the run goes (a --model with --dataset takes the dataset's
// input shape).
absl::Status RunMaster(RunPlan& plan, rpc::Registry* registry);

}  // namespace remora::master
