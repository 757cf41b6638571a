#include "train/fit.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_util.h"

namespace remora::train {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// "12.3 MiB", or "4.5 KiB" below a MiB.
std::string Size(int64_t bytes) {
  if (bytes < (1 << 20)) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
}

checkpoint::TrainingState StateAt(const pipeline::FitPosition& p) {
  return {p.step, p.epoch, p.batch, p.loss_sum, p.images, {}};
}

}  // namespace

absl::Status Checkpoints::Prepare() const {
  if (!active()) return absl::OkStatus();
  std::error_code ec;
  std::filesystem::create_directories(target_.dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat("cannot make the checkpoint directory ", target_.dir,
                                                      ": ", ec.message(), " (give a writable --checkpoint-dir)"));
  }
  if (target_.keep < 1) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoints: keep is ", target_.keep, "; keep at least 1"));
  }
  return absl::OkStatus();
}

bool Checkpoints::Due(int64_t step, bool final) const {
  if (!active()) return false;
  return final || (every_ > 0 && step % every_ == 0);
}

absl::Status Checkpoints::MaybeSave(Trainer& trainer, const checkpoint::TrainingState& state, bool final,
                                    std::ostream& out) const {
  const bool due = Due(state.step, final);
  // (A save now waits for the one before it.)
  ASSIGN_OR_RETURN(std::optional<Saved> committed, trainer.CommitSaved(/*wait=*/due));
  // (When the run's last step was also a periodic one, the final line
  // below names that same checkpoint: one line for it.)
  if (committed && !(final && due && committed->step == state.step)) {
    out << absl::StrFormat("checkpoint: step %d in %s (%s, written in the background)\n", committed->step,
                           committed->dir, Size(committed->bytes))
        << std::flush;
  }
  if (!due) return absl::OkStatus();
  const double t0 = Now();
  ASSIGN_OR_RETURN(Saved saved, trainer.Save(target_, state, final));
  if (saved.pending) {
    // (Not "checkpoint: step N": that line says the checkpoint is there.)
    out << absl::StrFormat("checkpoint of step %d: state copied in %.2f s, its files being written\n", state.step,
                           Now() - t0)
        << std::flush;
    return absl::OkStatus();
  }
  out << absl::StrFormat("checkpoint: step %d in %s (%s, %.2f s%s)\n", state.step, saved.dir, Size(saved.bytes),
                         Now() - t0, final ? ", final" : "")
      << std::flush;
  return absl::OkStatus();
}

absl::Status Resume(Trainer& trainer, const checkpoint::Checkpoint& ck,
                    const checkpoint::RunIdentity& identity, std::ostream& out) {
  if (!identity.model.empty()) RETURN_IF_ERROR(checkpoint::CheckMatches(ck, identity));
  const double t0 = Now();
  const absl::StatusOr<int64_t> bytes = trainer.Load(ck);
  if (!bytes.ok()) return base::Annotate(bytes.status(), absl::StrCat("resuming from ", ck.dir));
  const checkpoint::TrainingState s = ck.state();
  out << "resumed from " << ck.dir << ": step " << s.step;
  if (s.epoch > 0) out << ", epoch " << s.epoch << " after batch " << s.batch;
  out << absl::StrFormat(" (%s loaded in %.2f s)\n", Size(*bytes), Now() - t0) << std::flush;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<pipeline::EpochResult>> Fit(Trainer& trainer, const data::Source& train,
                                                       const data::Source& test, const TrainOptions& o,
                                                       std::ostream& out) {
  pipeline::FitOptions f = o.fit;
  const Checkpoints checkpoints(o.checkpoints, o.checkpoint_every);
  RETURN_IF_ERROR(checkpoints.Prepare());
  pipeline::FitPosition last;
  if (o.resume) {
    RETURN_IF_ERROR(Resume(trainer, *o.resume, o.checkpoints.identity, out));
    const checkpoint::TrainingState s = o.resume->state();
    f.start = pipeline::FitPosition{s.epoch, s.batch, s.epoch_loss_sum, s.epoch_images, s.step};
    last = f.start;
  }
  RowsSteps* rows = trainer.rows();
  const bool evaluates = o.eval_every > 0 && test.size() > 0;
  auto eval_due = [&o, evaluates](int64_t step) { return evaluates && step % o.eval_every == 0; };
  f.after_step = [&](const pipeline::FitPosition& p) {
    last = p;
    RETURN_IF_ERROR(checkpoints.MaybeSave(trainer, StateAt(p), /*final=*/false, out));
    if (!eval_due(p.step)) return absl::OkStatus();
    const double t0 = Now();
    const absl::StatusOr<pipeline::Correct> tested =
        rows != nullptr
            ? pipeline::Accuracy([rows](const at::Tensor& r) { return rows->CountCorrectRows(r); }, test.size(),
                                 f.eval_batch_size)
            : pipeline::Accuracy(
                  [&trainer](const at::Tensor& x, const at::Tensor& y) { return trainer.CountCorrect(x, y); },
                  test, f.eval_batch_size);
    if (!tested.ok()) return base::Annotate(tested.status(), absl::StrCat("evaluating after step ", p.step));
    if (f.progress_bar) out << "\n";
    out << absl::StrFormat("step=%d test_accuracy=%.4f test_top5=%.4f test_loss=%.4f%s seconds=%.1f\n", p.step,
                           tested->accuracy(), tested->top5_accuracy(), tested->loss(),
                           f.tokens_per_row > 0 ? absl::StrFormat(" test_perplexity=%.3f", std::exp(tested->loss()))
                                                : "",
                           Now() - t0)
        << std::flush;
    if (o.on_eval) o.on_eval(p.step, *tested);
    return absl::OkStatus();
  };
  // A step that saves or evaluates must not have the next one started
  // before it.
  f.settle_after = [&checkpoints, eval_due](int64_t step) { return checkpoints.Due(step, false) || eval_due(step); };
  std::vector<pipeline::EpochResult> epochs;
  if (rows != nullptr) {
    ASSIGN_OR_RETURN(
        epochs, pipeline::FitRows([rows](const at::Tensor& r, int e) { return rows->StartRowsStep(r, e); },
                                  train.size(),
                                  [rows](const at::Tensor& r) { return rows->CountCorrectRows(r); },
                                  test.size(), [rows] { return rows->skipped(); }, f, out));
  } else {
    ASSIGN_OR_RETURN(
        epochs,
        pipeline::Fit([&trainer](const at::Tensor& x, const at::Tensor& y) { return trainer.StartStep(x, y); },
                      [&trainer](const at::Tensor& x, const at::Tensor& y) { return trainer.CountCorrect(x, y); },
                      train, test, f, out));
  }
  // (A run resumed from its final checkpoint that trained nothing more has
  // it already: no line says it was saved again.)
  const bool saved_already = o.resume && o.resume->manifest.final && last.step == o.resume->state().step;
  if (!saved_already) RETURN_IF_ERROR(checkpoints.MaybeSave(trainer, StateAt(last), /*final=*/true, out));
  return epochs;
}

}  // namespace remora::train
