#include "train/report.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "base/json.h"
#include "base/status_util.h"
#include "train/curves.h"

namespace remora::train {

absl::StatusOr<std::shared_ptr<RunLog>> RunLog::Open(const std::string& dir, base::LineSink say) {
  auto log = std::make_shared<RunLog>();
  log->say_ = std::move(say);
  if (dir.empty()) return log;
  ASSIGN_OR_RETURN(log->events_, EventWriter::Open(dir));
  return log;
}

void RunLog::Add(const std::string& tag, int64_t step, double value) {
  if (events_ == nullptr) return;
  Warn(events_->AddScalar(tag, step, value));
}

void RunLog::Warn(const absl::Status& s) {
  if (s.ok() || warned_) return;
  base::Say(say_, absl::StrCat("remora: TensorBoard events: ", s.message(), " (training goes on)"));
  warned_ = true;
}

void RunLog::Step(int64_t step, double loss, int64_t rows, double seconds, double grad_norm) {
  losses_.emplace_back(static_cast<double>(step), loss);
  Add("step/loss", step, loss);
  if (grad_norm >= 0) Add("step/grad_norm", step, grad_norm);
  Add("step/seconds", step, seconds);
  if (seconds > 0) Add("step/images_per_second", step, rows / seconds);
  if (seconds > 0 && tokens_per_row_ > 0) Add("step/tokens_per_second", step, rows * tokens_per_row_ / seconds);
}

void RunLog::Epoch(const EpochResult& e) {
  Add("epoch/train_loss", e.epoch, e.train_loss);
  if (e.evaluated) {
    accuracy_.emplace_back(e.epoch, e.test_accuracy);
    Add("epoch/test_accuracy", e.epoch, e.test_accuracy);
    Add("epoch/test_top5", e.epoch, e.test_top5);
    Add("epoch/test_loss", e.epoch, e.test_loss);
    if (tokens_per_row_ > 0) Add("epoch/test_perplexity", e.epoch, std::exp(e.test_loss));
  }
  if (e.seconds > 0) Add("epoch/images_per_second", e.epoch, e.trained / e.seconds);
  if (e.seconds > 0 && tokens_per_row_ > 0) {
    Add("epoch/tokens_per_second", e.epoch, static_cast<double>(e.trained * tokens_per_row_) / e.seconds);
  }
  if (events_ != nullptr) Warn(events_->Flush());
}

void RunLog::Evaluated(int64_t step, const pipeline::Correct& tested) {
  Add("step/test_loss", step, tested.loss());
  Add("step/test_accuracy", step, tested.accuracy());
  if (tokens_per_row_ > 0) Add("step/test_perplexity", step, std::exp(tested.loss()));
  if (events_ != nullptr) Warn(events_->Flush());
}

void RunLog::Recovered(int64_t step, int count, int64_t restored) {
  if (events_ != nullptr) Warn(events_->AddRestart(restored + 1));
  Add("run/recoveries", step, count);
  if (events_ != nullptr) Warn(events_->Flush());
}

void RunLog::AddBubble(const Bubble& b, const std::vector<std::string>& workers, int64_t step) {
  Add("bubble/step", step, b.fraction);
  if (b.schedule_fraction >= 0) Add("bubble/schedule", step, b.schedule_fraction);
  for (size_t w = 0; w < b.workers.size() && w < workers.size(); ++w) {
    Add(absl::StrCat("bubble/", workers[w]), step, b.workers[w].idle_fraction());
  }
  if (events_ != nullptr) Warn(events_->Flush());
}

absl::Status RunRecorder::AfterStep(const StepRecord& s) {
  run_.batch_seconds.push_back(s.seconds);
  run_.step_rows.push_back(s.rows);
  run_.step_epochs.push_back(s.epoch);
  run_.losses.push_back(s.loss);
  return run_.log != nullptr ? run_.log->AfterStep(s) : absl::OkStatus();
}

void RunRecorder::Evaluated(int64_t step, const pipeline::Correct& tested) {
  run_.step_evals.emplace_back(step, tested);
  if (run_.log != nullptr) run_.log->Evaluated(step, tested);
}

void RunRecorder::EpochEnded(const EpochResult& e) {
  if (run_.log != nullptr) run_.log->EpochEnded(e);
}

void RunRecord::AddBatch(int b, double loss, double batch_time, int64_t rows) {
  seconds += batch_time;
  batch_seconds.push_back(batch_time);
  step_rows.push_back(rows);
  step_epochs.push_back(0);
  losses.push_back(loss);
  batch_rows = rows;
  if (log != nullptr) log->Step(b + 1, loss, rows, batch_time);
}

double RunRecord::images() const {
  if (epochs.empty()) return static_cast<double>(batch_seconds.size()) * batch_rows;
  double n = 0;
  for (const auto& e : epochs) n += e.trained;  // as the epoch lines count
  return n;
}

namespace {

// The median of `all` after its first (the only one's; 0: none).
double MedianAfterFirst(const std::vector<double>& all) {
  std::vector<double> v(all.begin() + (all.size() > 1 ? 1 : 0), all.end());
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// A run's bubble as a JSON object (WriteReport's "bubble").
std::string BubbleJson(const Bubble& b) {
  std::vector<std::string> workers;
  for (const WorkerTime& w : b.workers) {
    workers.push_back(absl::StrCat("{\"busy_seconds\": ", base::JsonFixed(6, w.busy_s),
                                   ", \"idle_seconds\": ", base::JsonFixed(6, w.idle_s), "}"));
  }
  return absl::StrCat("{\"steps\": ", b.steps, ", \"step_seconds\": ", base::JsonFixed(6, b.step_s),
                      ", \"fraction\": ", base::JsonFixed(6, b.fraction), ", \"schedule_fraction\": ",
                      b.schedule_fraction < 0 ? std::string("null") : base::JsonFixed(6, b.schedule_fraction),
                      ", \"workers\": [", absl::StrJoin(workers, ", "), "]}");
}

}  // namespace

double RunRecord::steady_seconds() const { return MedianAfterFirst(batch_seconds); }

double RunRecord::steady_data_wait_seconds() const { return MedianAfterFirst(data_wait_seconds); }

absl::Status WriteCurves(const std::string& path, const std::vector<RunRecord>& runs) {
  Panel loss{"training loss", "step", {}};
  Panel accuracy{"test accuracy", "epoch", {}};
  // A language model's held-out perplexity (exp of its test loss) by epoch.
  Panel perplexity{"held-out perplexity", "epoch", {}};
  for (const RunRecord& r : runs) {
    if (r.log == nullptr) continue;
    const std::string name = runs.size() > 1 ? absl::StrCat("splits=", r.splits) : "";
    loss.series.push_back({name, r.log->losses()});
    if (r.tokens_per_row == 0) {
      accuracy.series.push_back({name, r.log->accuracy()});
      continue;
    }
    Series s{name, {}};
    for (const EpochResult& e : r.epochs) {
      if (e.evaluated) s.points.emplace_back(e.epoch, std::exp(e.test_loss));
    }
    perplexity.series.push_back(std::move(s));
  }
  return WriteCurvesSvg(path, {loss, accuracy, perplexity});
}

namespace {

// A run's epochs as the report's JSON list (without brackets).
void WriteEpochs(std::ostream& out, const RunRecord& r) {
  for (size_t e = 0; e < r.epochs.size(); ++e) {
    const auto& x = r.epochs[e];
    out << (e ? ", " : "") << "{\"epoch\": " << x.epoch << ", \"train_loss\": "
        << base::JsonFixed(6, x.train_loss) << ", \"test_accuracy\": "
        << (x.evaluated ? base::JsonFixed(6, x.test_accuracy) : "null") << ", \"test_top5\": "
        << (x.evaluated ? base::JsonFixed(6, x.test_top5) : "null") << ", \"test_loss\": "
        << (x.evaluated ? base::JsonFixed(6, x.test_loss) : "null");
    if (r.tokens_per_row > 0) {
      out << ", \"test_perplexity\": " << (x.evaluated ? base::JsonFixed(6, std::exp(x.test_loss)) : "null");
    }
    out << ", \"seconds\": "
        << base::JsonFixed(3, x.seconds) << ", \"skipped_images\": " << x.skipped << "}";
  }
}

// A run's evaluations within epochs and its recoveries, as the report's
// JSON lists (without brackets).
void WriteStepEvals(std::ostream& out, const RunRecord& r) {
  for (size_t k = 0; k < r.step_evals.size(); ++k) {
    const auto& [step, x] = r.step_evals[k];
    out << (k ? ", " : "") << "{\"step\": " << step << ", \"test_accuracy\": " << base::JsonFixed(6, x.accuracy())
        << ", \"test_loss\": " << base::JsonFixed(6, x.loss());
    if (r.tokens_per_row > 0) out << ", \"test_perplexity\": " << base::JsonFixed(6, std::exp(x.loss()));
    out << "}";
  }
}
void WriteRecoveries(std::ostream& out, const RunRecord& r) {
  for (size_t k = 0; k < r.recoveries.size(); ++k) {
    const Recovery& x = r.recoveries[k];
    out << (k ? ", " : "") << "{\"lost\": \"" << x.lost << "\", \"replacement\": \"" << x.replacement
        << "\", \"detected_after_seconds\": " << base::JsonFixed(3, x.detected_after)
        << ", \"seconds_to_detect\": " << base::JsonFixed(3, x.seconds_to_detect)
        << ", \"failed_at_step\": " << x.failed_at << ", \"restored_step\": " << x.restored_step
        << ", \"steps_redone\": " << x.steps_redone() << ", \"seconds_lost\": "
        << (x.seconds_lost < 0 ? std::string("null") : base::JsonFixed(3, x.seconds_lost)) << "}";
  }
}

// A run's stages' peak memory and its messages per batch (by kind), as
// the report's JSON writes them.
void WriteStagesAndMessages(std::ostream& out, const RunRecord& r) {
  out << ", \"stages\": [";
  for (size_t k = 0; k < r.stage_memory.size(); ++k) {
    const RunRecord::StageMemory& m = r.stage_memory[k];
    out << (k ? ", " : "") << "{\"replica\": " << m.replica << ", \"stage\": " << m.stage
        << ", \"worker\": \"" << m.worker << "\", \"peak_activation_bytes\": "
        << (m.bytes < 0 ? std::string("null") : std::to_string(m.bytes)) << "}";
  }
  out << "]";
  if (r.messages_per_batch.empty()) return;
  double total = 0;
  std::vector<std::string> kinds;
  for (const auto& [kind, n] : r.messages_per_batch) {
    total += n;
    kinds.push_back(absl::StrFormat("\"%s\": %g", absl::StrReplaceAll(kind, {{"'", ""}}), n));
  }
  out << ", \"messages_per_batch\": {\"total\": " << absl::StrFormat("%g", total)
      << ", \"by_kind\": {" << absl::StrJoin(kinds, ", ") << "}}";
}

// One run as the report's JSON object.
void WriteRun(std::ostream& out, const RunRecord& r) {
  std::vector<std::string> losses;
  for (double l : r.losses) losses.push_back(base::JsonGeneral(l));
  std::vector<std::string> batch_seconds, data_waits;
  for (double b : r.batch_seconds) batch_seconds.push_back(base::JsonFixed(6, b));
  for (double w : r.data_wait_seconds) data_waits.push_back(base::JsonFixed(6, w));
  out << "{\"splits\": " << r.splits << ", \"schedule\": \"" << r.schedule
      << "\", \"seconds\": " << base::JsonFixed(6, r.seconds)
      << ", \"steady_batch_seconds\": " << base::JsonFixed(6, r.steady_seconds())
      << ", \"images_per_second\": "
      << base::JsonFixed(4, r.images() > 0 ? r.images() / r.seconds : NAN);
  if (r.tokens_per_row > 0) {
    out << ", \"tokens_per_second\": "
        << base::JsonFixed(2, r.images() > 0 ? r.images() * static_cast<double>(r.tokens_per_row) / r.seconds : NAN);
  }
  out << ", \"batch_seconds\": ["
      << absl::StrJoin(batch_seconds, ", ") << "]";
  if (!data_waits.empty()) {
    out << ", \"steady_data_wait_seconds\": " << base::JsonFixed(6, r.steady_data_wait_seconds())
        << ", \"data_wait_seconds\": [" << absl::StrJoin(data_waits, ", ") << "]";
  }
  out << ", \"losses\": ["
      << absl::StrJoin(losses, ", ") << "]";
  WriteStagesAndMessages(out, r);
  if (r.bubble.has_value()) out << ", \"bubble\": " << BubbleJson(*r.bubble);
  out << ", \"optimizer_state_bytes\": [" << absl::StrJoin(r.optimizer_state_bytes, ", ")
      << "], \"epochs\": [";
  WriteEpochs(out, r);
  out << "], \"step_evals\": [";
  WriteStepEvals(out, r);
  out << "], \"recoveries\": [";
  WriteRecoveries(out, r);
  out << "]}";
}

}  // namespace

absl::Status WriteReport(const std::string& path, const std::string& mode, const std::vector<RunRecord>& runs) {
  std::ofstream out(path);
  if (!out) return absl::InvalidArgumentError(absl::StrCat("cannot write the report ", path));
  out << "{\"mode\": \"" << mode << "\", \"runs\": [";
  for (size_t i = 0; i < runs.size(); ++i) {
    out << (i ? ", " : "");
    WriteRun(out, runs[i]);
  }
  out << "]}\n";
  return out.good() ? absl::OkStatus() : absl::DataLossError("writing the report failed");
}

}  // namespace remora::train
