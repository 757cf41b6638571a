// master's command line: its flags with their help, and the checks that
// turn them into a RunPlan (master/run.h) before any worker is waited
// for. Apart from main.cc so that tests check every bad flag in this
// process (tests/master/flags_test.cc) instead of starting the program
// once per case.
//
// Thread-compatible: plain functions over values the caller owns.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "launch/cli.h"
#include "master/ps_runs.h"
#include "master/run.h"
#include "master/runs.h"

namespace remora::master {

// The flags as given, before the checks and the defaults that depend on
// other flags. Most flags write straight into `config`.
struct Flags {
  RunOptions config;
  PsFlags ps;
  launch::SecurityFiles security;
  std::string workers;
  std::string spares;
  bool insecure_collectives = false;  // --insecure-collectives
  bool verbose = false;  // --verbose: errors with their TorchScript tracebacks whole
  std::string splits;  // empty: 8, or 1 with --mode ps
  std::string mode = "pipeline";
  std::string split_at;
  std::string input_shape;  // empty: the dataset's images, else 3,32,32
  int pipeline_stages = 0;
  int batch_size = -1;  // not given: 128, or 64 with --dataset
  double lr = -1;       // not given: by the optimizer and the workload (the --lr flag's help)
  std::set<std::string> given;  // the flags on the command line (FlagParser::given)
};

// master's defaults: --listen from MASTER_ADDR and MASTER_PORT, --threads
// one per core.
Flags DefaultFlags();

// Adds every flag of master to `parser`, bound to `flags` (which must
// outlive the parsing).
void AddFlags(launch::FlagParser& parser, Flags* flags);

// A command line that passed the checks: what master runs.
using CommandLine = RunPlan;

// Checks `flags` and resolves them: reads the token and TLS files, --model's
// TorchScript files and the checkpoint to resume. Every error names the
// flag (or file) and says what to give instead.
absl::StatusOr<CommandLine> Check(Flags flags);

// The flags in `given` that the run `c` does not use, said in a line
// ("master: note: ... (no effect)"), or "": a flag that silently does
// nothing hides a mistake.
std::string UnusedFlags(const std::set<std::string>& given, const RunOptions& c);

// AddFlags, parsing and Check in one: `args` without the program's name.
// For tests. When the parser stops (it prints why: --help, an unknown flag,
// a flag without its value), an InvalidArgument error saying so.
absl::StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args);

}  // namespace remora::master
