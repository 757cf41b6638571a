#include "train/elastic.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_util.h"
#include "pipeline/pipeline.h"
#include "train/tracing.h"

namespace remora::train {

using pipeline::UnansweringWorkers;

Elastic::Elastic(rpc::Agent& agent, ElasticOptions options, std::shared_ptr<RunLog> log)
    : agent_(agent), options_(std::move(options)), free_spares_(options_.spares), log_(std::move(log)) {
  // (A resumed run's steps count on from its checkpoint's.)
  if (options_.resumed_from) last_step_ = options_.resumed_from->state().step;
}

absl::Status Elastic::Supervise(std::vector<std::string>& workers, std::optional<checkpoint::Checkpoint> from,
                                std::ostream& out, const Attempt& attempt) {
  while (true) {
    absl::Status s = attempt(workers, from);
    if (s.ok()) return s;
    ASSIGN_OR_RETURN(checkpoint::Checkpoint ck, Recover(s, workers, out));
    from = std::move(ck);
  }
}

void Elastic::StepDone(int64_t step) {
  last_step_ = step;
  last_step_time_ = absl::Now();
  for (auto& r : recoveries_) {
    if (r.seconds_lost < 0 && step > r.restored_step) {
      r.seconds_lost = absl::ToDoubleSeconds(absl::Now() - failed_at_time_);
    }
  }
}

absl::StatusOr<checkpoint::Checkpoint> Elastic::Recover(const absl::Status& failure,
                                                        std::vector<std::string>& workers, std::ostream& out) {
  failed_at_time_ = absl::Now();
  if (options_.max_restarts <= 0) return failure;
  std::vector<absl::Status> why_lost;
  const std::vector<std::string> lost = UnansweringWorkers(agent_, workers, options_.probe_timeout, &why_lost);
  if (lost.empty()) return failure;  // every worker answers: not a loss to recover from
  const std::string names = absl::StrCat("'", absl::StrJoin(lost, "', '"), "'");
  if (restarts_ >= options_.max_restarts) {
    return base::Annotate(failure, absl::StrCat("worker ", names, " lost after ", restarts_, " recover",
                                          restarts_ == 1 ? "y" : "ies", " (--max-restarts ",
                                          options_.max_restarts, "): giving up"));
  }
  absl::StatusOr<checkpoint::Checkpoint> latest = checkpoint::Latest(options_.checkpoint_dir);
  if (const auto& resumed = options_.resumed_from;
      resumed && (!latest.ok() || latest->state().step <= resumed->state().step)) {
    latest = *resumed;
  }
  if (!latest.ok()) {
    return base::Annotate(failure, absl::StrCat("worker ", names, " lost, and there is nothing to go on from: ",
                                          latest.status().message(), "; giving up"));
  }
  for (const std::string& skipped : latest->passed_over) {
    out << "elastic: warning: a newer checkpoint cannot be read (" << skipped << "); going on from " << latest->dir
        << "\n";
  }
  ++restarts_;
  const int64_t restored = latest->state().step;
  out << absl::StrFormat("elastic: lost %s after step %d (%s)\n", names, last_step_, failure.message());
  // (Why each counts as lost: the step's failure names one worker; a second
  // one lost at once is told apart from a false alarm by its probe's answer.)
  for (size_t i = 0; i < lost.size(); ++i) {
    out << absl::StrFormat("elastic: '%s' counts as lost: its probe (%s at most) failed: %s\n", lost[i],
                           absl::FormatDuration(options_.probe_timeout), why_lost[i].message());
  }
  out << std::flush;
  for (const std::string& name : lost) {
    RETURN_IF_ERROR(agent_.MarkLost(name));
    auto replacement = Replace(name, out);
    if (!replacement.ok()) {
      return absl::Status(replacement.status().code(),
                          absl::StrCat(replacement.status().message(), "; it was lost at: ", failure.message()));
    }
    if (options_.deterministic) RETURN_IF_ERROR(UseDeterministicAlgorithmsOn(agent_, {*replacement}));
    std::replace(workers.begin(), workers.end(), name, *replacement);
    Recovery r;
    r.lost = name;
    r.replacement = *replacement;
    r.cause = std::string(failure.message());
    r.detected_after = absl::ToDoubleSeconds(failed_at_time_ - start_);
    r.seconds_to_detect = absl::ToDoubleSeconds(failed_at_time_ - last_step_time_);
    r.failed_at = last_step_;
    r.restored_step = restored;
    recoveries_.push_back(std::move(r));
  }
  if (log_ != nullptr) log_->Recovered(last_step_, restarts_, restored);
  const int64_t redo = std::max<int64_t>(0, last_step_ - restored);  // (as Recovery::steps_redone)
  // The run goes on from the checkpoint: a failure before its next step
  // is timed from now, after that step.
  last_step_ = restored;
  last_step_time_ = absl::Now();
  out << absl::StrFormat("elastic: recovery %d of %d: going on over %s from the checkpoint of step %d "
                         "(%d step%s to train again)\n",
                         restarts_, options_.max_restarts, absl::StrJoin(workers, ","), restored, redo,
                         redo == 1 ? "" : "s")
      << std::flush;
  return std::move(*latest);
}

absl::StatusOr<std::string> Elastic::Replace(const std::string& lost, std::ostream& out) {
  while (!free_spares_.empty()) {
    const std::string spare = free_spares_.front();
    free_spares_.erase(free_spares_.begin());
    if (!UnansweringWorkers(agent_, {spare}, options_.probe_timeout).empty()) {
      out << "elastic: spare '" << spare << "' does not answer either; not taking it\n";
      agent_.MarkLost(spare).IgnoreError();
      continue;
    }
    out << "elastic: spare '" << spare << "' takes the place of '" << lost << "'\n" << std::flush;
    replaced_.push_back(lost);
    return spare;
  }
  // A worker whose place a spare took and that registered again since
  // stands by in turn.
  for (auto it = replaced_.begin(); it != replaced_.end(); ++it) {
    if (agent_.IsLost(*it) || !UnansweringWorkers(agent_, {*it}, options_.probe_timeout).empty()) continue;
    const std::string back = *it;
    replaced_.erase(it);
    out << "elastic: '" << back << "', back since a spare took its place, takes the place of '" << lost << "'\n"
        << std::flush;
    return back;
  }
  if (options_.rejoin_timeout <= absl::ZeroDuration()) {
    return absl::UnavailableError(absl::StrCat("worker '", lost, "' is lost and no spare is free (--spares)"));
  }
  out << "elastic: no spare free; waiting up to " << absl::FormatDuration(options_.rejoin_timeout)
      << " for a worker to register again as '" << lost << "'\n"
      << std::flush;
  const absl::Time t0 = absl::Now();
  RETURN_IF_ERROR(agent_.AwaitRejoin(lost, options_.rejoin_timeout));
  out << absl::StrFormat("elastic: '%s' is back (after %.1f s)\n", lost, absl::ToDoubleSeconds(absl::Now() - t0))
      << std::flush;
  return lost;
}

}  // namespace remora::train
