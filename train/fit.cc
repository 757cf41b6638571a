#include "train/fit.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <filesystem>
#include <future>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/numbers.h"
#include "base/status_util.h"
#include "data/datasets.h"

namespace remora::train {
namespace {

double Seconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

double Now() { return Seconds(std::chrono::steady_clock::now()); }

// "12s", "3m05s".
std::string Duration(double s) {
  const int total = static_cast<int>(s + 0.5);
  return total >= 60 ? absl::StrFormat("%dm%02ds", total / 60, total % 60) : absl::StrCat(total, "s");
}

// "12.3 MiB", or "4.5 KiB" below a MiB.
std::string Size(int64_t bytes) {
  if (bytes < (1 << 20)) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
}

using Clock = std::chrono::steady_clock;

// Every step's loss, which a batch run's checkpoints keep (from the
// resumed checkpoint's on).
class Losses final : public FitObserver {
 public:
  explicit Losses(std::vector<double> before) : losses_(std::move(before)) {}
  absl::Status AfterStep(const StepRecord& s) override {
    losses_.push_back(s.loss);
    return absl::OkStatus();
  }
  const std::vector<double>& losses() const { return losses_; }

 private:
  std::vector<double> losses_;
};

// Reads a batch's rows (here, or only names them where a worker reads them).
using RowReader = std::function<absl::StatusOr<data::Batch>(const at::Tensor& rows, int epoch)>;
// Starts the step of a batch read (its rows and epoch too).
using BatchStarter = std::function<StartedStep(const data::Batch& batch, const at::Tensor& rows, int epoch)>;
// Measures the test set's accuracy (empty: there is no test set).
using AccuracyOf = std::function<absl::StatusOr<pipeline::Correct>()>;
// Runs after every step with the position after it (a checkpoint, an
// evaluation); `last`: the run's last step. An error stops the fit.
using AfterStep = std::function<absl::Status(const FitPosition&, bool last)>;
// Whether the step after `step` must wait until `step` is over and its
// AfterStep has run (it saves or evaluates).
using SettleAfter = std::function<bool(int64_t step)>;

// One Fit call's loop: the options, the steps taken, and the epoch under
// way.
// Used by the calling thread only (reads ahead run on threads of their own
// and touch only their rows).
class Loop {
 public:
  Loop(int64_t train_size, const RowReader& read_rows, const BatchStarter& start_step,
       const std::function<absl::StatusOr<int64_t>()>& skipped, const AccuracyOf& accuracy,
       const AfterStep& after_step, const SettleAfter& settle_after, const std::vector<FitObserver*>& observers,
       const FitOptions& o, std::ostream& out)
      : train_size_(train_size),
        read_rows_(read_rows),
        start_step_(start_step),
        skipped_(skipped),
        accuracy_(accuracy),
        after_step_(after_step),
        settle_after_(settle_after),
        observers_(observers),
        o_(o),
        out_(out),
        step_(o.start.step) {}

  absl::StatusOr<std::vector<EpochResult>> Run() {
    if (o_.epochs < 1 || o_.batch_size < 1 || o_.prefetch < 0) {
      return absl::InvalidArgumentError("fit: epochs and batch size must be at least 1, prefetch at least 0");
    }
    if (skipped_) {
      ASSIGN_OR_RETURN(skipped_before_, skipped_());
    }
    std::vector<EpochResult> results;
    for (int e = std::max(1, o_.start.epoch); e <= o_.epochs; ++e) {
      ASSIGN_OR_RETURN(const bool trained, TrainEpoch(e));
      if (!trained) continue;
      RETURN_IF_ERROR(EndEpoch());
      for (FitObserver* observer : observers_) observer->EpochEnded(r_);
      results.push_back(r_);
    }
    if (results.empty() && o_.start.step > 0 && o_.batch_run) {
      out_ << "fit: resumed after the run's last batch (step " << o_.start.step << "): nothing left to train\n"
           << std::flush;
    } else if (results.empty() && o_.start.step > 0) {  // (resumed)
      out_ << "fit: resumed at the run's end (epoch " << o_.start.epoch << " of --epochs " << o_.epochs
           << "): nothing left to train (give more --epochs to train on)\n"
           << std::flush;
    }
    return results;
  }

 private:
  // A step started and not yet waited for.
  struct Started {
    size_t batch;
    int64_t rows;
    StartedStep step;
  };

  // Trains epoch e's batches (from the resumed position in the resumed
  // epoch); false when there was none left to train (a run resumed after
  // the epoch's last batch, which reported the epoch then).
  absl::StatusOr<bool> TrainEpoch(int e) {
    const bool resumed = e == o_.start.epoch;
    RETURN_IF_ERROR(CutEpoch(e, resumed));
    first_ = resumed ? static_cast<size_t>(o_.start.batch) : 0;
    if (resumed && first_ == batches_.size() && first_ > 0) return false;
    BeginEpoch(e, resumed);
    for (size_t b = first_; b < batches_.size(); ++b) RETURN_IF_ERROR(TrainBatch(b, e));
    while (!started_.empty()) RETURN_IF_ERROR(FinishOldest());
    r_.seconds = Now() - t0_;
    return true;
  }

  // Epoch e's batches into batches_, the last left out when it is smaller
  // than a step takes (said once); an error when none is left, or when
  // the resumed position is past them.
  absl::Status CutEpoch(int e, bool resumed) {
    batches_ = data::EpochBatches(train_size_, o_.batch_size, o_.shuffle, o_.seed, e);
    if (!batches_.empty() && batches_.back().size(0) < o_.min_batch_rows) {
      if (!said_dropped_ && batches_.size() > 1) {
        said_dropped_ = true;  // (the same each epoch)
        out_ << "fit: the last batch of each epoch, " << batches_.back().size(0) << " of " << train_size_
             << " rows, is left out: its micro-batches need at least " << o_.min_batch_rows << " rows\n"
             << std::flush;
      }
      batches_.pop_back();
    }
    if (batches_.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("fit: ", train_size_,
                                                     " training rows make no batch of ", o_.min_batch_rows));
    }
    if (resumed && o_.start.batch > static_cast<int64_t>(batches_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("fit: resuming at batch ", o_.start.batch, " of epoch ", e,
                                                     ", which has ", batches_.size(), " batches"));
    }
    return absl::OkStatus();
  }

  // The epoch's result, sums and clocks at its start (a resumed epoch's
  // from the checkpoint; a run gone on after a failure counts the time
  // since it was lost and the epoch's kept steps).
  void BeginEpoch(int e, bool resumed) {
    r_ = EpochResult{};
    r_.epoch = e;
    r_.images = resumed ? o_.start.images : 0;
    loss_sum_ = resumed ? o_.start.loss_sum : 0;
    next_line_ = 0;
    call_t0_ = last_end_ = Now();
    t0_ = call_t0_;
    trained_ = 0;
    if (o_.gone_on && !counted_loss_) {  // (the first epoch this call trains)
      counted_loss_ = true;
      t0_ = std::min(t0_, Seconds(o_.gone_on->lost_since));
      if (resumed) {
        t0_ -= o_.gone_on->epoch_seconds_before;
        trained_ = o_.gone_on->epoch_images_before;
      }
    }
    read_.clear();
    next_read_ = first_;
  }

  // Takes batch b (read ahead) and starts its step, one step ahead of the
  // one waited for; a step over within its start is accounted for at once.
  absl::Status TrainBatch(size_t b, int e) {
    // The step before this one (step_ + started_.size()) may need the
    // workers to itself until after_step has run.
    if (!started_.empty() && settle_after_ && settle_after_(step_ + static_cast<int64_t>(started_.size()))) {
      while (!started_.empty()) RETURN_IF_ERROR(FinishOldest());
    }
    const int64_t next = step_ + static_cast<int64_t>(started_.size()) + 1;  // its step, if it has rows
    ReadAhead();
    const Clock::time_point taking = Clock::now();
    absl::StatusOr<data::Batch> batch = read_.front().get();
    read_.pop_front();
    ReadAhead();  // the next batches are read while this one trains
    Tell(next, "take batch", taking);
    if (!batch.ok()) {
      DropStarted();
      return base::Annotate(batch.status(), absl::StrCat("reading ", BatchName(b)));
    }
    r_.skipped += batch->skipped;
    if (batch->labels.size(0) == 0) return absl::OkStatus();  // every file of it skipped
    const Clock::time_point sending = Clock::now();
    StartedStep step = start_step_(*batch, batches_[b], e);
    Tell(next, "send", sending);
    if (step.over_at_start()) {
      // It ran within the call (or failed to start): the step before it
      // ended when the call began, and it is accounted for at once.
      const double ran_until = Now();
      if (!started_.empty()) {
        if (absl::Status s = FinishOldest(Seconds(sending)); !s.ok()) {
          step.abandon();
          return s;
        }
      }
      last_end_ = Seconds(sending);
      started_.push_back(Started{b, batch->labels.size(0), std::move(step)});
      return FinishOldest(ran_until);
    }
    started_.push_back(Started{b, batch->labels.size(0), std::move(step)});
    // One step ahead: the one before this is waited for now.
    while (started_.size() > 1) RETURN_IF_ERROR(FinishOldest());
    return absl::OkStatus();
  }

  // Batches read ahead (o_.prefetch of them while a step runs), in order
  // from batch next_read_.
  void ReadAhead() {
    while (next_read_ < batches_.size() && static_cast<int>(read_.size()) <= o_.prefetch) {
      read_.push_back(std::async(o_.prefetch > 0 ? std::launch::async : std::launch::deferred,
                                 [read_rows = &read_rows_, rows = batches_[next_read_], e = r_.epoch] {
                                   return (*read_rows)(rows, e);
                                 }));
      ++next_read_;
    }
  }

  void DropStarted() {
    for (auto& s : started_) s.step.abandon();
    started_.clear();
  }

  // "epoch E, batch B of N" for batch b of the epoch under way (a batch
  // run's "batch B of N").
  std::string BatchName(size_t b) const {
    const std::string batch = absl::StrCat("batch ", b + 1, " of ", batches_.size());
    return o_.batch_run ? batch : absl::StrCat("epoch ", r_.epoch, ", ", batch);
  }

  // Abandons the steps started and says where `s` stopped the fit.
  absl::Status Stopped(const absl::Status& s, const std::string& where) {
    DropStarted();
    return base::Annotate(s, where);
  }

  // Tells the observers of the time from `begin` to now on `step`.
  void Tell(int64_t step, const char* phase, Clock::time_point begin) {
    if (observers_.empty()) return;
    const Clock::time_point end = Clock::now();
    for (FitObserver* observer : observers_) observer->Spent(step, phase, begin, end);
  }

  // Waits for the oldest step started and accounts for it: it ended at
  // `ended` where that is given (Now() otherwise).
  absl::Status FinishOldest(std::optional<double> ended = std::nullopt) {
    Started oldest = std::move(started_.front());
    started_.pop_front();
    const size_t b = oldest.batch;
    const int e = r_.epoch;
    const Clock::time_point waiting = Clock::now();
    absl::StatusOr<double> loss = oldest.step.wait();
    Tell(step_ + 1, "wait", waiting);
    if (!loss.ok()) {
      return Stopped(loss.status(), BatchName(b));
    }
    *loss = base::UnsignedNan(*loss);
    if (!std::isfinite(*loss) && !said_not_finite_ && !o_.batch_run) {
      said_not_finite_ = true;  // (once: every later loss is likely the same)
      out_ << "fit: warning: the loss is " << *loss << " at epoch " << e << ", batch " << b + 1
           << ": the training diverged (a lower --lr?); it goes on\n"
           << std::flush;
    }
    loss_sum_ += *loss;
    r_.images += oldest.rows;
    trained_ += oldest.rows;
    ++step_;
    const double end = ended.value_or(Now());
    const double norm = oldest.step.grad_norm();
    const StepRecord record{e, step_, *loss, oldest.rows, end - last_end_, norm};
    const std::string where =
        o_.batch_run ? absl::StrCat("after batch ", b + 1) : absl::StrCat("after epoch ", e, ", batch ", b + 1);
    for (FitObserver* observer : observers_) {
      if (absl::Status s = observer->AfterStep(record); !s.ok()) return Stopped(s, where);
    }
    if (norm >= 0) last_norm_ = norm;
    Progress(b, end);
    if (after_step_) {
      const bool last = b + 1 == batches_.size() && e == o_.epochs;
      absl::Status s = after_step_(FitPosition{e, static_cast<int64_t>(b + 1), loss_sum_, r_.images, step_}, last);
      if (!s.ok()) return Stopped(s, where);
    }
    // (What ran after the step counts in no step's time.)
    last_end_ = Now();
    return absl::OkStatus();
  }

  // The progress line after batch b: redrawn in place, or every tenth of
  // the epoch.
  void Progress(size_t b, double now) {
    if (o_.batch_run) return;  // (an observer says what it will)
    const double done = static_cast<double>(b + 1 - first_) / (batches_.size() - first_);
    const double elapsed = now - t0_, in_call = now - call_t0_;
    // (Rows of a text are windows of tokens: the tokens a second then.)
    const double rate = trained_ / std::max(elapsed, 1e-9);
    const std::string speed = o_.tokens_per_row > 0
                                  ? absl::StrFormat("%.0f tokens/s", rate * static_cast<double>(o_.tokens_per_row))
                                  : absl::StrFormat("%.0f images/s", rate);
    // (With clipping, the last step's gradient norm before it.)
    const std::string norm = last_norm_ >= 0 ? absl::StrFormat("  grad_norm=%.3g", last_norm_) : "";
    const std::string line =
        absl::StrFormat("epoch %d/%d  %zu/%zu batches  loss=%.4f%s  %s  ETA %s", r_.epoch, o_.epochs, b + 1,
                        batches_.size(), loss_sum_ / (b + 1), norm, speed, Duration(in_call / done - in_call));
    if (o_.progress_bar) {
      out_ << "\r" << line << "   " << std::flush;
    } else if (done >= next_line_ && b + 1 < batches_.size()) {
      out_ << line << "\n" << std::flush;
      next_line_ += 0.1;
    }
  }

  // The epoch's rows left out where they were read, its loss, its test
  // accuracy and its line.
  absl::Status EndEpoch() {
    const int e = r_.epoch;
    if (skipped_) {
      auto now = skipped_();
      if (!now.ok()) return base::Annotate(now.status(), absl::StrCat("after epoch ", e));
      const int64_t epoch_skipped = *now - skipped_before_;
      skipped_before_ = *now;
      r_.skipped += epoch_skipped;
      r_.images -= epoch_skipped;
      trained_ -= epoch_skipped;
    }
    if (r_.images <= 0 && r_.skipped > 0) {
      // (Its loss would print as 0: a perfect fit to the eye.)
      return absl::FailedPreconditionError(absl::StrCat(
          "epoch ", e, " trained no image: all ", r_.skipped,
          " of its images were skipped as unreadable (--skip-bad-images); check the dataset's files"));
    }
    r_.trained = trained_;
    r_.train_loss = loss_sum_ / batches_.size();
    if (o_.progress_bar) out_ << "\n";
    std::string tested;
    if (accuracy_) {  // else no test set
      auto accuracy = accuracy_();
      if (!accuracy.ok()) return base::Annotate(accuracy.status(), absl::StrCat("evaluating after epoch ", e));
      r_.evaluated = true;
      r_.test_accuracy = accuracy->accuracy();
      r_.test_top5 = accuracy->top5_accuracy();
      r_.test_loss = accuracy->loss();
      tested = absl::StrFormat(" test_accuracy=%.4f test_top5=%.4f test_loss=%.4f", r_.test_accuracy, r_.test_top5,
                               r_.test_loss);
      if (o_.tokens_per_row > 0) absl::StrAppendFormat(&tested, " test_perplexity=%.3f", std::exp(r_.test_loss));
    }
    if (o_.batch_run) return absl::OkStatus();
    const double rows_per_second = trained_ / std::max(r_.seconds, 1e-9);
    out_ << absl::StrFormat("epoch=%d train_loss=%.4f%s seconds=%.1f images_per_second=%.0f%s%s\n", e,
                            r_.train_loss, tested, r_.seconds, rows_per_second,
                            o_.tokens_per_row > 0
                                ? absl::StrFormat(" tokens_per_second=%.0f", rows_per_second * o_.tokens_per_row)
                                : "",
                            r_.skipped > 0 ? absl::StrCat(" skipped_images=", r_.skipped) : "")
         << std::flush;
    return absl::OkStatus();
  }

  const int64_t train_size_;
  const RowReader& read_rows_;
  const BatchStarter& start_step_;
  const std::function<absl::StatusOr<int64_t>()>& skipped_;
  const AccuracyOf& accuracy_;
  const AfterStep& after_step_;
  const SettleAfter& settle_after_;
  const std::vector<FitObserver*>& observers_;
  const FitOptions& o_;
  std::ostream& out_;
  int64_t step_;
  int64_t skipped_before_ = 0;
  // The epoch under way.
  std::vector<at::Tensor> batches_;
  size_t first_ = 0;  // the first batch this call trains
  EpochResult r_;
  // When the epoch began (earlier where it counts FitOptions::gone_on) and
  // when this call began it.
  double t0_ = 0, call_t0_ = 0, last_end_ = 0, loss_sum_ = 0, next_line_ = 0;
  double last_norm_ = -1;  // the last step's gradient norm before clipping, or -1
  // Images of the epoch trained by this call (and, going on after a
  // recovery, before it).
  int64_t trained_ = 0;
  bool counted_loss_ = false;  // whether an epoch counts FitOptions::gone_on already
  bool said_not_finite_ = false;
  bool said_dropped_ = false;
  std::deque<std::future<absl::StatusOr<data::Batch>>> read_;
  size_t next_read_ = 0;
  std::deque<Started> started_;
};

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

namespace {

// The test set's accuracy, counted on the rows the trainer's workers read
// or on batches read here (null: there is no test set).
AccuracyOf TestAccuracy(Trainer& trainer, const data::Source& test, int64_t eval_batch_size) {
  if (test.size() == 0) return nullptr;
  WorkersRead* rows = trainer.rows();
  return [&trainer, rows, &test, eval_batch_size]() -> absl::StatusOr<pipeline::Correct> {
    if (rows != nullptr) {
      return pipeline::Accuracy([rows](const at::Tensor& r) { return rows->CountCorrectRows(r); }, test.size(),
                                eval_batch_size);
    }
    return pipeline::Accuracy(
        [&trainer](const at::Tensor& x, const at::Tensor& y) { return trainer.CountCorrect(x, y); }, test,
        eval_batch_size);
  };
}

// The evaluation after step `step`: its line on `out`; the observers told.
absl::Status Evaluate(int64_t step, const AccuracyOf& accuracy, const FitOptions& f,
                      const std::vector<FitObserver*>& observers, std::ostream& out) {
  const double t0 = Now();
  const absl::StatusOr<pipeline::Correct> tested = accuracy();
  if (!tested.ok()) return base::Annotate(tested.status(), absl::StrCat("evaluating after step ", step));
  if (f.progress_bar) out << "\n";
  out << absl::StrFormat("step=%d test_accuracy=%.4f test_top5=%.4f test_loss=%.4f%s seconds=%.1f\n", step,
                         tested->accuracy(), tested->top5_accuracy(), tested->loss(),
                         f.tokens_per_row > 0 ? absl::StrFormat(" test_perplexity=%.3f", std::exp(tested->loss()))
                                              : "",
                         Now() - t0)
      << std::flush;
  for (FitObserver* observer : observers) observer->Evaluated(step, *tested);
  return absl::OkStatus();
}

// The loop over `train`'s batches: their row numbers sent to the workers
// that read them (Trainer::rows()), or the batches read here.
absl::StatusOr<std::vector<EpochResult>> RunLoop(Trainer& trainer, const data::Source& train,
                                                 const AccuracyOf& accuracy, const AfterStep& after_step,
                                                 const SettleAfter& settle_after,
                                                 const std::vector<FitObserver*>& observers, FitOptions f,
                                                 std::ostream& out) {
  WorkersRead* rows = trainer.rows();
  if (rows == nullptr) {
    const RowReader read = [&train](const at::Tensor& r, int e) { return train.Get(r, e); };
    const BatchStarter start = [&trainer](const data::Batch& b, const at::Tensor&, int) {
      return trainer.StartStep({b.images, b.labels});
    };
    return Loop(train.size(), read, start, nullptr, accuracy, after_step, settle_after, observers, f, out).Run();
  }
  f.prefetch = 0;  // (nothing to read here)
  const RowReader names = [](const at::Tensor& r, int) -> absl::StatusOr<data::Batch> {
    return data::Batch{{}, r, 0};
  };
  const BatchStarter start = [&trainer](const data::Batch&, const at::Tensor& r, int e) {
    return trainer.StartStep(StepBatch::Rows(r, e));
  };
  const std::function<absl::StatusOr<int64_t>()> skipped = [rows] { return rows->skipped(); };
  return Loop(train.size(), names, start, skipped, accuracy, after_step, settle_after, observers, f, out).Run();
}

}  // namespace

absl::StatusOr<std::vector<EpochResult>> Fit(Trainer& trainer, const data::Source& train, const data::Source& test,
                                             const TrainOptions& o, std::ostream& out) {
  FitOptions f = o.fit;
  if (f.batch_run) {  // (one pass, in order, and no lines of its own)
    f.epochs = 1;
    f.shuffle = false;
    f.progress_bar = false;
  }
  const Checkpoints checkpoints(o.checkpoints, o.checkpoint_every);
  RETURN_IF_ERROR(checkpoints.Prepare());
  FitPosition last;
  if (o.resume) {
    if (!o.resume_loaded) RETURN_IF_ERROR(Resume(trainer, *o.resume, o.checkpoints.identity, out));
    const checkpoint::TrainingState s = o.resume->state();
    // (A batch run's checkpoint says epoch 0: its step is its next batch.)
    f.start = f.batch_run ? FitPosition{1, s.step, 0, 0, s.step}
                          : FitPosition{s.epoch, s.batch, s.epoch_loss_sum, s.epoch_images, s.step};
    last = f.start;
  }
  // A batch run's checkpoints keep every step's loss; its observers see
  // each step after they are counted.
  Losses losses(f.batch_run && o.resume ? o.resume->state().losses : std::vector<double>{});
  std::vector<FitObserver*> observers = o.observers;
  if (f.batch_run) observers.insert(observers.begin(), &losses);
  auto state_at = [&f, &losses](const FitPosition& p) -> checkpoint::TrainingState {
    if (f.batch_run) return {p.step, 0, p.step, 0, 0, losses.losses()};
    return {p.step, p.epoch, p.batch, p.loss_sum, p.images, {}};
  };
  const AccuracyOf accuracy = TestAccuracy(trainer, test, f.eval_batch_size);
  auto eval_due = [&o, &accuracy](int64_t step) { return accuracy && o.eval_every > 0 && step % o.eval_every == 0; };
  const AfterStep after_step = [&](const FitPosition& p, bool last_step) {
    last = p;
    // (The run's last step is saved once, as the final checkpoint, below.)
    if (!last_step) RETURN_IF_ERROR(checkpoints.MaybeSave(trainer, state_at(p), /*final=*/false, out));
    return eval_due(p.step) ? Evaluate(p.step, accuracy, f, observers, out) : absl::OkStatus();
  };
  // A step that saves or evaluates (or that an observer must see alone)
  // must not have the next one started before it.
  const SettleAfter settle_after = [&checkpoints, eval_due, &observers](int64_t step) {
    if (checkpoints.Due(step, false) || eval_due(step)) return true;
    for (const FitObserver* observer : observers) {
      if (observer->Settles(step)) return true;
    }
    return false;
  };
  ASSIGN_OR_RETURN(std::vector<EpochResult> epochs,
                   RunLoop(trainer, train, accuracy, after_step, settle_after, observers, f, out));
  // (A run resumed from its final checkpoint that trained nothing more has
  // it already: no line says it was saved again.)
  const bool saved_already = o.resume && o.resume->manifest.final && last.step == o.resume->state().step;
  if (!saved_already) RETURN_IF_ERROR(checkpoints.MaybeSave(trainer, state_at(last), /*final=*/true, out));
  return epochs;
}

}  // namespace remora::train
