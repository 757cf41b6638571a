// What Checkpointer::Save (a pipeline's owner files, written by the workers) and
// SaveLocal (stages held in this process: the parameter server) share: the
// step directories, the manifest's fields, model.pt, the commit and the
// choice of checkpoints to prune. Internal to checkpoint/.
//
// Thread-compatible free functions.
#pragma once

#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "proto/checkpoint.pb.h"

namespace remora::checkpoint {

inline constexpr char kManifestFile[] = "manifest.json";
inline constexpr char kModelFile[] = "model.pt";
inline constexpr int kFormat = 1;

// DIR/step-NNNNNNNN.
std::string StepDir(const std::string& dir, int64_t step);

// What a save that failed says first: "checkpoint of step N in DIR (the
// previous checkpoint is still the latest)".
std::string SaveFailed(int64_t step, const std::string& step_dir);

// A manifest of `identity` at `state`, created now, with this process's
// CPU generator state; owner files and stages are added by the caller.
wire::Manifest NewManifest(const RunIdentity& identity, const TrainingState& state, bool final);

// Writes model.pt (the stage specs) into `dir`, and lists the stages in
// `m`, stage k in owner file `file_of[k]` (0 for every stage when empty).
absl::Status WriteModel(const std::vector<pipeline::StageSpec>& stages, const std::vector<int>& file_of,
                        const std::string& dir, wire::Manifest* m);

// The manifest as read, and back as written.
Manifest ManifestFromWire(const wire::Manifest& m);
wire::Manifest ManifestToWire(const Manifest& m);

// Writes `m` as dir/manifest.json, atomically: the commit.
absl::Status CommitManifest(const wire::Manifest& m, const std::string& dir);

// The step directories in `dir` to remove so that `keep` complete
// checkpoints remain: older ones, and incomplete ones older than the newest;
// a relayout-step-N (the master's --resume under another cut) once step N
// is among the older ones.
std::vector<std::string> PrunableDirs(const std::string& dir, int keep);

}  // namespace remora::checkpoint
