#include "master/checkpoint_flags.h"

#include <filesystem>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/ids.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/manifest.h"
#include "launch/cli.h"

namespace remora::master {

// A run that saves into a directory of another run's checkpoints would
// lose its own: the newest --keep steps are kept, whichever run wrote
// them. Refused unless the run goes on from that directory.
absl::Status CheckCheckpointDirIsOurs(const RunOptions& c, bool derived) {
  const std::string where =
      derived ? absl::StrCat("the directory it is in, ", c.checkpoint_dir,
                             ", where this run saves (no --checkpoint-dir given),")
              : absl::StrCat("--checkpoint-dir ", c.checkpoint_dir);
  const std::vector<int64_t> steps = checkpoint::CompleteSteps(c.checkpoint_dir);
  if (steps.empty()) return absl::OkStatus();
  if (!c.resume.empty()) {
    std::error_code dir_error, from_error;
    const std::filesystem::path dir = std::filesystem::weakly_canonical(c.checkpoint_dir, dir_error);
    const std::filesystem::path from = std::filesystem::weakly_canonical(c.resume, from_error);
    const bool known = !dir_error && !from_error;
    if (known && from == dir) return absl::OkStatus();  // its latest
    if (known && from.parent_path() == dir) {
      // An older step of it: the newer ones would outrank this run's.
      const int64_t step = checkpoint::StepOf(from);
      if (step < 0 || step >= steps.back()) return absl::OkStatus();
      return Bad(absl::StrCat("--resume ", c.resume, " is step ", step, ", but ", where,
                              " holds later ones (up to step ", steps.back(),
                              "): they would outrank this run's checkpoints (pruned by --keep, taken by --resume "
                              "auto); remove them, or save into another --checkpoint-dir"));
    }
  }
  return Bad(absl::StrCat(
      "--checkpoint-dir ", c.checkpoint_dir, " already holds checkpoints of an earlier run (steps ", steps.front(),
      steps.size() > 1 ? absl::StrCat(" to ", steps.back()) : "",
      "): this run's would be pruned among them (--keep keeps the newest steps, whoever wrote them); give --resume ",
      c.checkpoint_dir, " (or --resume auto) to go on from its latest, or another --checkpoint-dir"));
}

// The checkpoint flags, and with --resume the checkpoint itself.
absl::Status CheckCheckpoints(CommandLine& line, const std::set<std::string>& given, bool cut) {
  RunOptions& c = line.config;
  RETURN_IF_ERROR(launch::CheckAtLeast(
      {{"checkpoint-every", c.checkpoint_every, 0}, {"train-rows", c.train_rows, 0}, {"keep", c.keep, 1}}));
  // (A trailing '/' names the same directory; its parent is where a
  // resumed run saves.)
  for (std::string* path : {&c.resume, &c.checkpoint_dir}) {
    while (path->size() > 1 && path->back() == '/') path->pop_back();
  }
  if (c.resume == "auto") {
    // As a supervisor restarts a job: the latest checkpoint of
    // --checkpoint-dir when there is one, else a fresh start.
    if (c.checkpoint_dir.empty()) {
      return Bad("--resume auto goes on from the latest checkpoint in --checkpoint-dir: give --checkpoint-dir too");
    }
    // Fresh only when the directory holds no complete checkpoint; one that
    // cannot be read is an error below, never a reason to start over.
    const std::filesystem::path dir(c.checkpoint_dir);
    std::error_code ec;
    const bool exists = std::filesystem::exists(dir, ec);
    if (exists) std::filesystem::directory_iterator(dir, ec);
    if (ec) return Bad(absl::StrCat("--resume auto: cannot look into --checkpoint-dir ", dir.string(), ": ",
                                    ec.message()));
    const bool fresh =
        !exists || (!checkpoint::IsCheckpointDir(dir.string()) && checkpoint::CompleteSteps(dir.string()).empty());
    c.resume = fresh ? "" : c.checkpoint_dir;
    if (fresh) {
      line.note =
          absl::StrCat("resume: no complete checkpoint in ", dir.string(), " yet; starting fresh (--resume auto)");
    }
  }
  if (!c.checkpoint_dir.empty() || !c.resume.empty()) {
    if (c.local) return Bad("--checkpoint-dir and --resume save and load workers' stages: not with --local");
    if (c.splits.size() != 1) return Bad("--checkpoint-dir and --resume train one --splits count, not a sweep");
    if (c.compare_local) return Bad("--compare-local does not go with --checkpoint-dir or --resume");
    line.checkpoints.identity = IdentityOf(c, c.splits[0]);
  }
  if (!c.checkpoint_dir.empty()) RETURN_IF_ERROR(CheckCheckpointDirIsOurs(c));
  if (c.checkpoint_dir.empty() && !c.resume.empty()) {
    // Saving beside it (below): checked as if given.
    RunOptions beside = c;
    beside.checkpoint_dir =
        checkpoint::IsCheckpointDir(c.resume) ? std::filesystem::path(c.resume).parent_path().string() : c.resume;
    if (beside.checkpoint_dir.empty()) beside.checkpoint_dir = ".";
    RETURN_IF_ERROR(CheckCheckpointDirIsOurs(beside, /*derived=*/true));
  }
  if (c.resume.empty()) return absl::OkStatus();
  auto ck = checkpoint::Latest(c.resume);
  if (!ck.ok()) return ck.status();
  if (auto s = checkpoint::CheckMatches(*ck, line.checkpoints.identity); !s.ok()) return s;
  const bool other_workers = !line.ps_mode && ck->manifest.files.size() != c.workers.size();
  const bool other_stages =
      c.interleave > 0 && ck->manifest.stages.size() != c.workers.size() * static_cast<size_t>(c.interleave);
  if (cut && !line.ps_mode && (other_workers || other_stages || !c.split_at.empty())) {
    // Cut as the flags say; the checkpoint is written again for that cut
    // once it is made (master/run.cc).
    line.checkpoints.relayout = true;
  } else {
    if (other_workers) {
      return Bad(absl::StrCat("checkpoint ", ck->manifest_path, " has ", ck->manifest.files.size(),
                              " owner files, one per pipeline worker, and its stages were given cut (",
                              c.model.empty() ? "the built-in small CNN's blocks" : "--model's stage files",
                              "): give ", ck->manifest.files.size(), " workers per replica, not ", c.workers.size(),
                              " (a model the master cuts, ResNet50, the GPT or a one-file --model, resumes over "
                              "any number)"));
    }
    auto stages = checkpoint::LoadStageSpecs(*ck);
    if (!stages.ok()) return stages.status();
    line.checkpoints.stages = std::move(*stages);
  }
  // The run's checkpoint settings go on, unless the flags say otherwise
  // (a manifest from before they were recorded has keep 0).
  if (ck->manifest.keep > 0) {
    if (!given.count("checkpoint-every")) c.checkpoint_every = ck->manifest.checkpoint_every;
    if (!given.count("keep")) c.keep = ck->manifest.keep;
  }
  line.checkpoints.identity.checkpoint_every = c.checkpoint_every;
  line.checkpoints.identity.keep = c.keep;
  if (c.checkpoint_dir.empty()) {  // go on saving beside it
    c.checkpoint_dir = ck->dir == c.resume ? std::filesystem::path(ck->dir).parent_path().string() : c.resume;
    if (c.checkpoint_dir.empty()) c.checkpoint_dir = ".";
  }
  for (const std::string& skipped : ck->passed_over) {
    const std::string warning =
        absl::StrCat("master: warning: a newer checkpoint cannot be read (", skipped, "); going on from ", ck->dir);
    line.note = line.note.empty() ? warning : absl::StrCat(line.note, "\n", warning);
  }
  line.checkpoints.resume = std::move(*ck);
  return absl::OkStatus();
}

// --max-restarts, --rejoin-timeout and --spares.
absl::Status CheckElastic(const CommandLine& line) {
  const RunOptions& c = line.config;
  if (auto s = launch::CheckAtLeast({{"max-restarts", c.max_restarts, 0}, {"rejoin-timeout", c.rejoin_timeout, 0}});
      !s.ok()) {
    return Bad(std::string(s.message()));
  }
  if (c.max_restarts == 0) {
    return c.spares.empty() ? absl::OkStatus()
                            : Bad("--spares stand by to replace a lost worker: give --max-restarts N too");
  }
  if (c.local) return Bad("--max-restarts recovers a run over workers: not with --local");
  if (c.checkpoint_dir.empty()) {
    return Bad("--max-restarts goes on from the latest checkpoint: give --checkpoint-dir DIR (and --checkpoint-every "
               "N: the steps since the last checkpoint are trained again)");
  }
  std::set<std::string> seen(c.all_workers.begin(), c.all_workers.end());
  for (const auto& s : c.spares) {
    if (!base::IsValidWorkerName(s)) return Bad(absl::StrCat("--spares: invalid worker name '", s, "'"));
    if (!seen.insert(s).second) {
      return Bad(absl::StrCat("--spares: '", s, "' is named twice (in --workers or --spares); a spare holds no stage"));
    }
  }
  return absl::OkStatus();
}

}  // namespace remora::master
