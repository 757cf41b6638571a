// Training in this process (--local, --compare-local): LocalRun, TrainLocal
// (the demo's batches through train::Fit), and --local's thread count,
// measured (FastestLocalThreads). See master/runs.h.
#include <ATen/ops/narrow.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_util.h"
#include "runtime/threads.h"
#include "shards/stage_types.h"
#include "trace/trace.h"
#include "master/runs.h"

namespace remora::master {

LocalRun::LocalRun(const RunOptions& c, int splits, std::unique_ptr<train::LocalTrainer> trainer)
    : c_(c), run_(splits), trainer_(std::move(trainer)), start_(trace::NowUs()) {
  // Every step's slices (forward, backward, step) go into the run, on the
  // run's clock, whether Step or TrainLocal drives the trainer.
  trainer_->set_slices([this](const char* what, int64_t mb, int64_t s, int64_t e) {
    run_.slices.push_back({0, what, mb, s - start_, e - start_, ""});
  });
}

absl::StatusOr<std::unique_ptr<LocalRun>> LocalRun::Create(const RunOptions& c, int splits) {
  RETURN_IF_ERROR(shards::RegisterStageTypes());
  train::LocalOptions o;
  o.stages = WholeModelStages(c);
  o.loss = Loss(c);
  o.optimizer = OptimizerOf(c);
  o.micro_batches = splits;
  o.device = c.device;
  o.clip_grad_norm = c.clip_grad_norm;
  o.bf16 = c.precision == "bf16";
  ASSIGN_OR_RETURN(auto trainer, train::LocalTrainer::Create(std::move(o)));
  return std::unique_ptr<LocalRun>(new LocalRun(c, splits, std::move(trainer)));
}

absl::Status LocalRun::Step(int b, const char* prefix) {
  ASSIGN_OR_RETURN(auto batch, MakeBatch(c_, b));
  auto& [inputs, targets] = batch;
  const int64_t t0 = trace::NowUs();
  ASSIGN_OR_RETURN(double loss, trainer_->StartStep({inputs, targets}).wait());
  const double seconds = (trace::NowUs() - t0) / 1e6;
  std::printf("%s", prefix);
  RecordBatch(run_, b, loss, seconds, inputs.size(0));
  return absl::OkStatus();
}

namespace {

// The demo's batches made in Fit's own thread when it asks for them (with
// Fit's prefetch 0, before a step's time starts): a local run's compute
// threads share the cores with no batch maker, as they did when --local
// looped over the batches itself. Asked for in order, whole batches.
class LocalDemoBatches final : public data::Source {
 public:
  explicit LocalDemoBatches(const RunOptions& c) : c_(c) {}

  int64_t size() const override { return int64_t{c_.batches} * c_.batch_size; }
  absl::StatusOr<data::Batch> Get(const at::Tensor& rows, int /*epoch*/) const override {
    const int64_t from = rows.numel() > 0 ? rows.reshape({-1})[0].item<int64_t>() : 0;
    ASSIGN_OR_RETURN(auto batch, MakeBatch(c_, static_cast<int>(from / c_.batch_size)));
    return data::Batch{std::move(batch.first), std::move(batch.second), 0};
  }

 private:
  const RunOptions& c_;
};

}  // namespace

absl::StatusOr<Run> TrainLocal(const RunOptions& c, int splits) {
  ASSIGN_OR_RETURN(auto local, LocalRun::Create(c, splits));
  Run& run = local->run();
  ASSIGN_OR_RETURN(run.log, OpenRunLog(c, splits));
  train::TrainOptions options = StartBatchRun(c, nullptr, run).options;
  train::FitFunctions batches;  // (each batch's line and record)
  batches.step = [&run](const train::StepRecord& s) {
    RecordBatch(run, static_cast<int>(s.step - 1), s.loss, s.seconds, s.rows);
  };
  options.observers = {&batches};
  RETURN_IF_ERROR(train::Fit(local->trainer(), LocalDemoBatches(c), *data::NoRows(), options, std::cout).status());
  return std::move(run);
}

std::string ThreadChoice::Describe() const {
  auto count = [](int n) { return absl::StrCat(n, n == 1 ? " thread" : " threads"); };
  if (timed.empty()) return absl::StrCat(count(threads), " (this machine has one core)");
  std::string line = absl::StrCat(count(threads), " (the fastest here: ");
  for (size_t k = 0; k < timed.size(); ++k) {
    absl::StrAppendFormat(&line, "%s%s %.3f s%s", k == 0 ? "" : ", ", count(timed[k].threads), timed[k].seconds,
                          k == 0 ? " a step" : "");
    if (timed[k].warm_only) line += " (ruled out warming up)";
  }
  absl::StrAppendFormat(&line, "; measured on %d rows in %.1f s)", rows, probe_seconds);
  return line;
}

namespace {
constexpr int64_t kProbeRows = 32;
constexpr double kLargeStepSeconds = 0.25;
constexpr double kShortStepSeconds = 0.05;
}  // namespace

absl::StatusOr<ThreadChoice> FastestLocalThreads(const RunOptions& c, int splits, const at::Tensor& x,
                                                 const at::Tensor& y) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> counts;
  for (int n = cores; n > 1; n /= 2) {
    if (counts.empty() || counts.back() != n) counts.push_back(n);
  }
  counts.push_back(1);
  ThreadChoice choice;
  choice.threads = counts.front();
  if (counts.size() == 1) return choice;
  const int64_t t0 = trace::NowUs();
  ASSIGN_OR_RETURN(auto probe, LocalRun::Create(c, splits));
  // A large model is timed on the batch's first rows (enough for every
  // micro-batch to have two): its operations are large enough to share
  // either way, and a whole batch of ResNet50 at 128x128 takes seconds a
  // step. A model whose cold step on those rows is short gets the whole
  // batch, where a few rows would favour fewer threads.
  const int64_t rows = x.size(0), few = std::min<int64_t>(rows, std::max<int64_t>(kProbeRows, 2 * splits));
  at::Tensor px = x.narrow(0, 0, few), py = y.narrow(0, 0, few);
  int current = counts.front();  // (the count the pools were last set to)
  runtime::SetComputeThreads(current);
  // One step at `n` threads, timed. With `settle`, a switch of count is
  // followed by a step that is not timed: the first parallel regions after
  // it start (or wake) the new team, which a run at one count pays once,
  // not every step; a short step would be timed with that cost in it.
  auto step = [&](int n, bool settle = false) -> absl::StatusOr<double> {
    if (n != current) {
      runtime::SetComputeThreads(n);
      current = n;
      if (settle) RETURN_IF_ERROR(probe->trainer().StartStep({px, py}).wait().status());
    }
    const int64_t s = trace::NowUs();
    RETURN_IF_ERROR(probe->trainer().StartStep({px, py}).wait().status());
    return (trace::NowUs() - s) / 1e6;
  };
  // A cold step first (allocations, caches), then one warm step at each
  // count: a count whose warm step takes 1.5x the fastest's, and a fifth
  // of a second more, is slower beyond noise and ruled out at once (short
  // steps are all timed again: one of them says little).
  ASSIGN_OR_RETURN(const double cold, step(counts.front()));
  if (cold < kLargeStepSeconds && few < rows) {
    px = x;
    py = y;
    RETURN_IF_ERROR(step(counts.front()).status());  // (cold again at the whole batch's size)
  }
  choice.rows = px.size(0);
  std::vector<double> warm;
  for (int n : counts) {
    ASSIGN_OR_RETURN(const double t, step(n));
    warm.push_back(t);
  }
  const double fastest_warm = *std::min_element(warm.begin(), warm.end());
  std::vector<std::vector<double>> times(counts.size());
  std::vector<size_t> left;
  for (size_t k = 0; k < counts.size(); ++k) {
    if (warm[k] <= 1.5 * fastest_warm || warm[k] - fastest_warm < 0.2) left.push_back(k);
  }
  // The counts left in turn (so that a machine whose speed drifts meets
  // them all alike), for a second at least; medians compared. Short steps
  // go in blocks of four after a settling step, so that each block runs on
  // a team already awake, as a whole run at that count does.
  if (left.size() > 1) {
    const bool short_steps = fastest_warm < kShortStepSeconds;
    const int block = short_steps ? 4 : 1;
    double spent = 0;
    for (int round = 0; round < 25 && (round < 1 || spent < 1.0); ++round) {
      for (size_t k : left) {
        for (int i = 0; i < block; ++i) {
          ASSIGN_OR_RETURN(const double t, step(counts[k], short_steps));
          times[k].push_back(t);
          spent += t;
        }
      }
    }
  }
  double best = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    ThreadChoice::Timed timed{counts[k], warm[k], times[k].empty()};
    if (!times[k].empty()) {
      std::vector<double>& t = times[k];
      std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
      timed.seconds = t[t.size() / 2];
    }
    const bool in = std::find(left.begin(), left.end(), k) != left.end();
    if (in && (best == 0 || timed.seconds < best)) {
      best = timed.seconds;
      choice.threads = counts[k];
    }
    if (in && left.size() == 1) timed.warm_only = false;  // (the only one left: its warm step is its time)
    choice.timed.push_back(timed);
  }
  runtime::SetComputeThreads(choice.threads);
  choice.probe_seconds = (trace::NowUs() - t0) / 1e6;
  return choice;
}

}  // namespace remora::master
