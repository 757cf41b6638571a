// What a training run reports: as it goes, TensorBoard's scalars and the
// points of its curves (RunLog); at the end, its record (RunRecord) as a
// JSON report, a summary's figures and SVG curves.
//
//   train::RunRecord run;
//   run.log = train::RunLog::Open("runs/a").value();     // "" : no event files
//   train::RunRecorder recorder(run);                    // every step and epoch
//   options.observers = {&recorder};
//   run.epochs = train::Fit(...).value();
//   RETURN_IF_ERROR(train::WriteReport("report.json", "pipeline", {run}));
//
// Thread-safety: a RunLog and a RunRecord belong to the training loop's
// thread; the free functions are thread-compatible.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/lines.h"
#include "train/fit.h"
#include "train/events.h"
#include "train/timeline.h"

namespace remora::train {

// One recovery of an elastic run (train/elastic.h): a lost worker and what
// took its place.
struct Recovery {
  std::string lost;         // the worker lost
  std::string replacement;  // the spare that took its place, or the lost name back
  std::string cause;        // the failure that revealed it
  double detected_after = 0;  // seconds from the run's start to the failure
  // Seconds from the last step done before the failure to the failure:
  // the failed step's own work and the time its failure took to show.
  double seconds_to_detect = 0;
  int64_t failed_at = 0;      // steps completed when it failed
  int64_t restored_step = 0;  // the checkpoint's step the run went on from
  // Seconds from the failure to the first step completed after the
  // restore (-1: none was).
  double seconds_lost = -1;
  int64_t steps_redone() const { return failed_at - restored_step; }
};

// TensorBoard's event files of a run and the points of its curves; a
// FitObserver of a Fit (or fed by a loop of one's own).
class RunLog final : public FitObserver {
 public:
  // Event files in `dir` (made if needed; an error when it cannot be);
  // "" : none, only the curves' points. A write that fails later is said
  // once to `say`.
  static absl::StatusOr<std::shared_ptr<RunLog>> Open(const std::string& dir, base::LineSink say = nullptr);

  // step/loss, step/seconds, step/images_per_second; at an epoch's end
  // epoch/train_loss, epoch/test_accuracy, epoch/test_top5,
  // epoch/test_loss, epoch/images_per_second. A language model's
  // (set_tokens_per_row) also step/tokens_per_second,
  // epoch/tokens_per_second and epoch/test_perplexity. A
  // failed write is said once (Open's `say`); training goes on.
  // With clipping (grad_norm >= 0) also step/grad_norm, the norm before it.
  void Step(int64_t step, double loss, int64_t rows, double seconds, double grad_norm = -1);
  void Epoch(const EpochResult& e);
  // The test set evaluated after `step` within an epoch: step/test_loss,
  // step/test_accuracy (a language model's: step/test_perplexity).
  void Evaluated(int64_t step, const pipeline::Correct& tested) override;
  // (As an observer: Step and Epoch of each.)
  absl::Status AfterStep(const StepRecord& s) override {
    Step(s.step, s.loss, s.rows, s.seconds, s.grad_norm);
    return absl::OkStatus();
  }
  void EpochEnded(const EpochResult& e) override { Epoch(e); }
  // A language model's tokens a row (its window); 0: not one.
  void set_tokens_per_row(int64_t tokens) { tokens_per_row_ = tokens; }
  // A recovery that goes on after step `restored`: a restart mark at the
  // step after it (the steps trained again show once in TensorBoard), then
  // run/recoveries, the run's recoveries so far, at the step it failed at.
  void Recovered(int64_t step, int count, int64_t restored);
  // A pipeline run's bubble (train/timeline.h) at `step`: bubble/step, the
  // fraction of the steps idle; bubble/schedule, the schedule's own; and
  // bubble/<worker>, each worker's.
  void AddBubble(const Bubble& b, const std::vector<std::string>& workers, int64_t step);

  const std::vector<std::pair<double, double>>& losses() const { return losses_; }      // (step, loss)
  const std::vector<std::pair<double, double>>& accuracy() const { return accuracy_; }  // (epoch, accuracy)

 private:
  void Add(const std::string& tag, int64_t step, double value);
  void Warn(const absl::Status& s);

  std::unique_ptr<EventWriter> events_;  // null without a directory
  std::vector<std::pair<double, double>> losses_, accuracy_;
  base::LineSink say_;
  bool warned_ = false;
  int64_t tokens_per_row_ = 0;
};

// One run: of N batches (a demo or benchmark) or of epochs over a dataset.
struct RunRecord {
  explicit RunRecord(int s = 1) : splits(s) {}
  int splits = 1;  // micro-batches per batch
  std::string schedule = "local";
  double seconds = 0;                 // training time
  int64_t batch_rows = 0;             // rows per batch of a run of batches
  // A language model's tokens a row (its window: rows are windows of
  // text); 0: not one. The report then gives tokens a second and each
  // epoch's test perplexity (exp of its test loss).
  int64_t tokens_per_row = 0;
  std::vector<double> batch_seconds;  // every batch's (of a run of epochs: every step's)
  std::vector<int64_t> step_rows;     // the rows each of those trained
  std::vector<int> step_epochs;       // and the epoch of each (from 1; 0 in a run of batches)
  // A pipeline's run of batches: how long the master waited for batches to
  // be made (train/runs.h, BatchesAhead) within each batch's time (a wait
  // for the next batch falls in the running one's); empty in other runs
  // (one process makes each batch before its clock starts).
  std::vector<double> data_wait_seconds;
  std::vector<double> losses;         // every batch's (every step's) loss
  // Each stage's peak saved activations (bytes; -1: not measured), every
  // replica's; pipeline runs only.
  struct StageMemory {
    int replica = 0;
    int stage = 0;
    std::string worker;
    int64_t bytes = -1;
  };
  std::vector<StageMemory> stage_memory;
  std::vector<int64_t> optimizer_state_bytes;  // per replica; pipeline runs only
  std::vector<EpochResult> epochs;   // runs over a dataset
  // The test set evaluated within epochs (TrainOptions::eval_every):
  // the step after which, and what it measured.
  std::vector<std::pair<int64_t, pipeline::Correct>> step_evals;
  // Requests sent per batch by the master and the workers together, by
  // kind, over the batches after the first; empty when not measured.
  std::map<std::string, double> messages_per_batch;
  std::vector<TimelineSlice> slices;  // a traced run's (train/timeline.h)
  std::optional<Bubble> bubble;       // a traced pipeline run's, measured from them
  std::shared_ptr<RunLog> log;        // may be null
  std::vector<Recovery> recoveries;   // an elastic run's (train/elastic.h)
  // An elastic run's place, so that a recovery's time counts in the run's
  // and its epoch's: the step this process began after (a run resumed
  // from a checkpoint: its step; batch_seconds[i] is step first_step + i +
  // 1's), and when its last step ended (unset before the first).
  int64_t first_step = 0;
  std::optional<std::chrono::steady_clock::time_point> last_step_end;

  // Batch b's loss and time (its log's step b + 1).
  void AddBatch(int b, double loss, double seconds, int64_t rows);
  // Images trained: batches x batch_rows, or what the epochs trained.
  double images() const;
  // The steady-state batch time: the median of the batches after the
  // first (which warms up allocators and caches); the only one's, or 0.
  double steady_seconds() const;
  // The same median of data_wait_seconds (0 when empty).
  double steady_data_wait_seconds() const;
};

// Keeps a Fit's steps in `run` (every step's time in batch_seconds, so
// that steady_seconds is the median step after the first; its rows, epoch
// and loss) and its evaluations within epochs (step_evals), and reports
// every step, evaluation and epoch to run.log when set. The epochs
// themselves are the caller's to keep (Fit returns them). `run` must
// outlive it; used on Fit's thread.
class RunRecorder final : public FitObserver {
 public:
  explicit RunRecorder(RunRecord& run) : run_(run) {}

  absl::Status AfterStep(const StepRecord& s) override;
  void Evaluated(int64_t step, const pipeline::Correct& tested) override;
  void EpochEnded(const EpochResult& e) override;

 private:
  RunRecord& run_;
};

// The runs as JSON: {"mode": mode, "runs": [{"splits", "schedule",
// "seconds", "steady_batch_seconds", "images_per_second",
// ["tokens_per_second"], "batch_seconds", ["steady_data_wait_seconds",
// "data_wait_seconds"], "losses", "stages", ["messages_per_batch"],
// "optimizer_state_bytes", "epochs" (each with "test_loss", and
// "test_perplexity" for a language model), ["bubble": {"steps", "step_seconds",
// "fraction", "schedule_fraction", "workers": [{"busy_seconds",
// "idle_seconds"}, ...]}]}, ...]}. An error names the file.
absl::Status WriteReport(const std::string& path, const std::string& mode, const std::vector<RunRecord>& runs);

// The runs' loss by step and test accuracy by epoch as an SVG (a series a
// run, named "splits=N" when there are several).
absl::Status WriteCurves(const std::string& path, const std::vector<RunRecord>& runs);

}  // namespace remora::train
