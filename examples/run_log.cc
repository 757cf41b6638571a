// What the master's runs report as they go: TensorBoard event files
// (--tensorboard) and the curves drawn at the end (--curves).
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "examples/master_runs.h"
#include "train/curves.h"

namespace remora::master {

absl::StatusOr<std::shared_ptr<RunLog>> OpenRunLog(const Config& c, int splits) {
  auto log = std::make_shared<RunLog>();
  if (c.tensorboard.empty()) return log;
  const std::string dir =
      c.splits.size() > 1 ? absl::StrCat(c.tensorboard, "/splits-", splits) : c.tensorboard;
  ASSIGN_OR_RETURN(log->events, train::EventWriter::Open(dir));
  return log;
}

void RunLog::Add(const std::string& tag, int64_t step, double value) {
  if (events == nullptr) return;
  Warn(events->AddScalar(tag, step, value));
}

void RunLog::Warn(const absl::Status& s) {
  if (s.ok() || warned_) return;
  std::fprintf(stderr, "master: --tensorboard: %s (training goes on)\n", std::string(s.message()).c_str());
  warned_ = true;
}

void RunLog::Step(int64_t step, double loss, int64_t rows, double seconds) {
  losses.emplace_back(static_cast<double>(step), loss);
  Add("step/loss", step, loss);
  Add("step/seconds", step, seconds);
  if (seconds > 0) Add("step/images_per_second", step, rows / seconds);
}

void RunLog::Epoch(const pipeline::EpochResult& e) {
  accuracy.emplace_back(e.epoch, e.test_accuracy);
  Add("epoch/train_loss", e.epoch, e.train_loss);
  Add("epoch/test_accuracy", e.epoch, e.test_accuracy);
  if (e.seconds > 0) Add("epoch/images_per_second", e.epoch, e.trained / e.seconds);
  if (events != nullptr) Warn(events->Flush());
}

void ReportTo(std::shared_ptr<RunLog> log, pipeline::FitOptions& f) {
  f.on_step = [log](const pipeline::StepRecord& s) { log->Step(s.step, s.loss, s.rows, s.seconds); };
  f.on_epoch = [log](const pipeline::EpochResult& e) { log->Epoch(e); };
}

void RecordBatch(Run& run, int b, double loss, double seconds, int64_t rows) {
  run.seconds += seconds;
  run.batch_seconds.push_back(seconds);
  run.losses.push_back(loss);
  if (run.log != nullptr) run.log->Step(b + 1, loss, rows, seconds);
  PrintBatch(b, loss, seconds);
}

absl::Status WriteCurves(const std::string& path, const std::vector<Run>& runs) {
  train::Panel loss{"training loss", "step", {}};
  train::Panel accuracy{"test accuracy", "epoch", {}};
  for (const Run& r : runs) {
    if (r.log == nullptr) continue;
    const std::string name = runs.size() > 1 ? absl::StrCat("splits=", r.splits) : "";
    loss.series.push_back({name, r.log->losses});
    accuracy.series.push_back({name, r.log->accuracy});
  }
  return train::WriteCurvesSvg(path, {loss, accuracy});
}

}  // namespace remora::master
