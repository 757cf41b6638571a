// master's checkpoint and elastic flags, checked (master/flags.cc
// checks the rest): whether --checkpoint-dir is this run's to save in,
// --resume's checkpoint read and matched to the run, --max-restarts and
// --spares. Internal to the master's command line.
#pragma once

#include <set>
#include <string>

#include "absl/status/status.h"
#include "master/flags.h"

namespace remora::master {

// A bad flag: InvalidArgument with `message` (exit 2).
inline absl::Status Bad(const std::string& message) { return absl::InvalidArgumentError(message); }

// Refuses a --checkpoint-dir that holds another run's checkpoints (the
// newest --keep are kept whoever wrote them), unless the run goes on from
// its latest; `derived`: the directory is --resume's, no --checkpoint-dir
// was given.
absl::Status CheckCheckpointDirIsOurs(const RunOptions& c, bool derived = false);
// The checkpoint flags, and with --resume the checkpoint itself (read into
// line.checkpoints); `given`: the flags on the command line; `cut`: the
// master cuts the model (ResNet50, the GPT, a one-file --model), so that
// a checkpoint resumes over another worker count, --interleave or
// --split-at.
absl::Status CheckCheckpoints(CommandLine& line, const std::set<std::string>& given, bool cut);
// --max-restarts, --rejoin-timeout and --spares.
absl::Status CheckElastic(const CommandLine& line);

}  // namespace remora::master
