// The master program's parameter-server runs (master --mode ps): the model
// and optimizer in the master (ps/parameter_server.h), the workers pulling
// the parameters and pushing their shares' gradients every step, over the
// ResNet50 demo, --model or --dataset, with checkpoints the evaluator
// follows. master/run.h runs them (RunMaster); runs.h holds the pipeline's
// runs and what both share.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "data/datasets.h"
#include "master/runs.h"
#include "pipeline/pipeline.h"
#include "rpc/agent.h"

namespace remora::master {

// The parameter-server flags.
struct PsFlags {
  int partitions = 0;          // --ps-partitions: server processes, the first K --workers (0 or 1: the master)
  int backup_workers = 0;  // --backup-workers k
  bool step_lines = false;  // --ps-step-lines: a line per step
};

// An error message for flags that do not go with --mode ps (or for --ps
// flags without it); empty when they are fine. `splits_given`: --splits
// was on the command line.
std::string CheckPsFlags(const RunOptions& c, const PsFlags& p, bool ps_mode, bool splits_given,
                         int pipeline_stages);

// Trains with the parameter server over c.workers: c.batches batches of
// the demo or --model, or c.epochs epochs of `sets` (--dataset). Prints
// every demo batch, a line for each step that lost a worker (every step
// with --ps-step-lines), and a summary: steps, median step time, bytes
// pulled and pushed per step, each worker's dropped and lost steps. Saves
// (checkpoint::SaveLocal's one-file checkpoints) and resumes as
// `checkpoints` says (train/ps_trainer.h).
// Into `run` (its log opened when not yet); each step is told to
// `elastic` when set (TrainElastic's attempts).
absl::Status TrainPs(rpc::Agent& agent, const RunOptions& c, const PsFlags& p,
                     const std::vector<pipeline::StageSpec>& stages, const Sets& sets,
                     const Checkpointing* checkpoints, Run& run, train::Elastic* elastic = nullptr);

}  // namespace remora::master
