// What the master's runs report as they go: TensorBoard event files
// (--tensorboard), the batch lines, and the record of a run that goes on
// after a failure (its epochs and step times), each stage's peak memory;
// and at the end, the summary table (a GPT's tokens a second and FLOPs
// too) and the report.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/numbers.h"
#include "master/runs.h"

namespace remora::master {

absl::StatusOr<std::shared_ptr<train::RunLog>> OpenRunLog(const RunOptions& c, int splits) {
  ASSIGN_OR_RETURN(std::shared_ptr<train::RunLog> log,
                   c.tensorboard.empty()
                       ? train::RunLog::Open("")
                       : train::RunLog::Open(
                             c.splits.size() > 1 ? absl::StrCat(c.tensorboard, "/splits-", splits) : c.tensorboard,
                             base::LinesTo(std::cerr)));
  log->set_tokens_per_row(TokensPerRow(c));
  return log;
}

void RecordBatch(Run& run, int b, double loss, double seconds, int64_t rows) {
  loss = base::UnsignedNan(loss);
  // (Said where the losses turn not finite: once for a run that diverged.)
  const bool first_not_finite = !std::isfinite(loss) && (run.losses.empty() || std::isfinite(run.losses.back()));
  run.AddBatch(b, loss, seconds, rows);
  PrintBatch(b, loss, seconds);
  if (first_not_finite) {
    std::printf("warning: the loss is %g at batch %d: the training diverged (a lower --lr?); it goes on\n", loss, b);
  }
}

bool GoesOnAfterAFailure(Run& run, int64_t from) {
  if (run.last_step_end) return true;
  run.first_step = from;
  return false;
}

KeptSteps KeepStepsUpTo(Run& run, int64_t from, int epoch) {
  const size_t kept = static_cast<size_t>(
      std::clamp<int64_t>(from - run.first_step, 0, static_cast<int64_t>(run.batch_seconds.size())));
  KeptSteps out;
  for (size_t i = 0; i < run.batch_seconds.size(); ++i) {
    if (i >= kept) {
      out.discarded_seconds += run.batch_seconds[i];
    } else if (epoch > 0 && i < run.step_epochs.size() && run.step_epochs[i] == epoch) {
      // (Counted by the epoch each step recorded: a batch that took no
      // step, every file of it skipped, leaves no gap to count back over.)
      out.epoch_seconds_before += run.batch_seconds[i];
      if (i < run.step_rows.size()) out.epoch_images_before += run.step_rows[i];
    }
  }
  run.batch_seconds.resize(kept);
  if (run.step_rows.size() > kept) run.step_rows.resize(kept);
  if (run.step_epochs.size() > kept) run.step_epochs.resize(kept);
  if (run.losses.size() > kept) run.losses.resize(kept);
  if (run.data_wait_seconds.size() > kept) run.data_wait_seconds.resize(kept);
  return out;
}

void MergeEpochs(Run& run, const std::vector<train::EpochResult>& epochs) {
  if (!epochs.empty()) {
    const int from = epochs.front().epoch;
    run.epochs.erase(std::remove_if(run.epochs.begin(), run.epochs.end(),
                                    [from](const train::EpochResult& e) { return e.epoch >= from; }),
                     run.epochs.end());
  }
  run.epochs.insert(run.epochs.end(), epochs.begin(), epochs.end());
  run.seconds = 0;
  for (const auto& e : run.epochs) run.seconds += e.seconds;
}

std::string ImagesPerSecond(const Run& r) {
  return r.images() > 0 && r.seconds > 0 ? absl::StrFormat("%.2f", r.images() / r.seconds) : "-";
}

void PrintSummary(const std::vector<Run>& runs, const RunOptions& c) {
  std::printf("\n%8s %12s %10s %14s %18s %9s\n", "splits", "schedule", "seconds",
              "steady_batch_s", "images_per_second", "speedup");
  for (const Run& r : runs) {
    // ("-": a run that recorded no batch times, or trained nothing.)
    const std::string steady = r.batch_seconds.empty() ? "-" : absl::StrFormat("%.3f", r.steady_seconds());
    const std::string speedup =
        r.images() > 0 && r.seconds > 0 && runs[0].seconds > 0 ? absl::StrFormat("%.2fx", runs[0].seconds / r.seconds)
                                                                : "-";
    std::printf("%8d %12s %10.3f %14s %18s %9s\n", r.splits, r.schedule.c_str(), r.seconds, steady.c_str(),
                ImagesPerSecond(r).c_str(), speedup.c_str());
  }
  if (ReadsText(c)) {
    // A row is a window of --seq-len tokens; the built-in GPT's FLOPs a
    // token from its shape (shards::GptTrainFlopsPerToken; a --model's are
    // not known from flags: 0).
    const double flops = TrainFlopsPerToken(c);
    for (const Run& r : runs) {
      if (!(r.images() > 0 && r.seconds > 0)) continue;
      const double tokens = r.images() * static_cast<double>(c.seq_len) / r.seconds;
      if (flops <= 0) {
        std::printf("splits=%d: %.0f tokens/s\n", r.splits, tokens);
        continue;
      }
      std::printf("splits=%d: %.0f tokens/s, %.3g training FLOPs a token, %.3f TFLOP/s%s\n", r.splits, tokens, flops,
                  tokens * flops / 1e12,
                  c.peak_tflops > 0
                      ? absl::StrFormat(", model FLOPs utilisation %.2f%% of --peak-tflops %g",
                                        100 * tokens * flops / 1e12 / c.peak_tflops, c.peak_tflops)
                            .c_str()
                      : "");
    }
  }
}

absl::Status WriteReport(const std::string& path, bool local, const std::vector<Run>& runs, const RunOptions& c) {
  return train::WriteReport(path, local ? "local" : c.schedule == "ps" ? "ps" : "pipeline",  // --mode ps sets "ps"
                            runs);
}

absl::Status ReportMemory(parallel::DataParallelPipeline& pipe, const RunOptions& c, Run& run) {
  run.stage_memory.clear();
  for (int r = 0; r < pipe.replicas(); ++r) {
    pipeline::Pipeline& replica = pipe.replica(r);
    ASSIGN_OR_RETURN(const std::vector<int64_t> peaks, replica.peak_activation_bytes());
    for (size_t k = 0; k < peaks.size(); ++k) {
      run.stage_memory.push_back({r, static_cast<int>(k), replica.worker_of(static_cast<int>(k)), peaks[k]});
    }
  }
  ASSIGN_OR_RETURN(run.optimizer_state_bytes, pipe.optimizer_state_bytes());
  for (const Run::StageMemory& m : run.stage_memory) {
    const std::string peak = m.bytes < 0 ? "not measured (a GPU stage, or REMORA_MALLOC=default)"
                                         : absl::StrFormat("%.1f MiB", m.bytes / 1048576.0);
    std::printf("  %sstage %d on %s: peak saved activations %s\n",
                pipe.replicas() > 1 ? absl::StrCat("replica ", m.replica, ", ").c_str() : "", m.stage,
                m.worker.c_str(), peak.c_str());
  }
  for (size_t r = 0; r < run.optimizer_state_bytes.size() && c.replicas > 1; ++r) {
    std::printf("  replica %zu: optimizer state %.2f MiB\n", r, run.optimizer_state_bytes[r] / 1048576.0);
  }
  return absl::OkStatus();
}

}  // namespace remora::master
