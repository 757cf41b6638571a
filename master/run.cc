#include "master/run.h"

#include <ATen/Context.h>
#include <ATen/ops/arange.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "autograd/dist_autograd.h"
#include "base/status_util.h"
#include "launch/interrupt.h"
#include "pipeline/schedule.h"
#include "rpc/agent.h"
#include "runtime/allocator.h"
#include "runtime/threads.h"
#include "train/report.h"
#include "train/timeline.h"
#include "train/tracing.h"

namespace remora::master {
namespace {

// "1 micro-batch of 8 images", "4 micro-batches of ~2 images" (of a
// text: windows).
std::string MicroBatches(const RunOptions& c, int count, int rows, bool about) {
  const char* row = ReadsText(c) ? " window" : " image";
  return absl::StrCat(count, count == 1 ? " micro-batch of " : " micro-batches of ", about ? "~" : "", rows, row,
                      rows == 1 ? "" : "s");
}

// Whether a run is one --trace/--timeline record: the last split count's,
// when either is given.
bool Traced(const RunOptions& c, bool last) { return last && !(c.trace.empty() && c.timeline.empty()); }

// The rows of a batch: --batch-size, or all the training images where
// --dataset has fewer (each epoch is then one smaller batch).
int64_t BatchRows(const RunOptions& c, const Sets& sets) {
  return sets.train == nullptr ? c.batch_size : std::min<int64_t>(c.batch_size, sets.train->size());
}

// --dataset's sets, loaded (or, for an image folder, listed) and
// described (empty sets without --dataset).
absl::StatusOr<std::unique_ptr<Sets>> LoadSets(const RunOptions& c, bool resuming) {
  if (c.dataset.empty()) return std::make_unique<Sets>();
  auto sets = LoadDataset(c, resuming);
  if (!sets.ok()) return sets.status();
  const std::vector<int64_t>& shape = (*sets)->shape;
  if (TrainsSmallCnn(c) && shape != std::vector<int64_t>{1, 28, 28}) {
    return absl::InvalidArgumentError(absl::StrCat("--dataset ", c.dataset, " has images of ",
                                                   c10::str(c10::IntArrayRef(shape)),
                                                   "; remora's small CNN takes [1, 28, 28]: give --model "
                                                   "stages for these"));
  }
  std::printf("dataset %s: %s\n", c.dataset.c_str(), (*sets)->Describe().c_str());
  if (c.train_rows > (*sets)->train->size()) {
    std::printf("master: note: --train-rows %lld is more than the %lld training images: all of them are trained\n",
                static_cast<long long>(c.train_rows), static_cast<long long>((*sets)->train->size()));
  }
  return sets;
}

// --model with --dataset: the model's inputs are the dataset's images
// (--input-shape, when given, must say the same).
absl::Status FitInputShape(RunOptions& c, const Sets& sets) {
  if (c.model.empty() || c.dataset.empty()) return absl::OkStatus();
  const std::vector<int64_t>& shape = sets.shape;
  if (c.input_shape_given && c.input_shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--input-shape ", absl::StrJoin(c.input_shape, ","), " does not match --dataset ", c.dataset,
        "'s images of ", absl::StrJoin(shape, ","), ": leave --input-shape out with --dataset"));
  }
  c.input_shape = shape;
  return absl::OkStatus();
}

// A schedule that decays without --decay-steps reaches --min-lr at the
// run's last step (each split count's run steps from the start); said.
void SetDecaySteps(RunOptions& c, const Sets& sets) {
  if (c.lr_schedule != "constant" && c.decay_steps == 0) {
    if (sets.train == nullptr) {
      c.decay_steps = c.batches;
    } else {
      int64_t rows = sets.train->size();
      if (c.train_rows > 0) rows = std::min<int64_t>(rows, c.train_rows);
      const int64_t batch = BatchRows(c, sets);
      c.decay_steps = static_cast<int>(c.epochs * ((rows + batch - 1) / batch));
    }
  }
  const optim::OptimizerOptions o = OptimizerOf(c);
  if (!o.schedule.scheduled()) return;
  std::printf("learning rate: %s from %g", optim::LrScheduleName(o.schedule.kind).c_str(), o.lr);
  if (o.schedule.warmup_steps > 0) std::printf(" after %d warm-up steps", c.warmup_steps);
  if (o.schedule.kind != optim::LrSchedule::Kind::kConstant) {
    std::printf(", down to %g at step %d", o.schedule.min_lr, c.decay_steps);
  }
  std::printf("\n");
}

void PrintRun(const Run& run, const RunOptions& c) {
  std::printf("splits=%d seconds=%.3f images_per_second=%s\n", run.splits, run.seconds,
              ImagesPerSecond(run).c_str());
  if (!run.data_wait_seconds.empty()) {
    const double total = std::accumulate(run.data_wait_seconds.begin(), run.data_wait_seconds.end(), 0.0);
    std::printf("data wait: the master waited %.3f s in all for its batches to be made, %.3f s a batch in "
                "steady state\n", total, run.steady_data_wait_seconds());
  }
}

// --local and --compare-local without --threads on a CPU: the thread
// count that trains this run's first batch fastest here (measured on a
// throwaway trainer), into c.threads, and said. The global generator is
// seeded again after (the measurement drew from it).
absl::Status ChooseLocalThreads(RunOptions& c, const Sets& sets) {
  if (!c.threads_auto || !(c.local || c.compare_local) || c.device != "cpu") return absl::OkStatus();
  at::Tensor x, y;
  if (sets.train != nullptr) {
    ASSIGN_OR_RETURN(data::Batch b, sets.train->Get(at::arange(BatchRows(c, sets), at::kLong), /*epoch=*/0));
    x = b.images;
    y = b.labels;
  } else {
    ASSIGN_OR_RETURN(auto batch, MakeBatch(c, 0));
    x = batch.first;
    y = batch.second;
  }
  // (--compare-local trains its baseline at --splits 1.)
  const int splits = c.compare_local ? 1 : c.splits.front();
  ASSIGN_OR_RETURN(const ThreadChoice choice, FastestLocalThreads(c, splits, x, y));
  c.threads = choice.threads;
  at::manual_seed(static_cast<uint64_t>(c.seed));
  std::printf("local: %s; %s; --threads N sets the count, and --threads 1 gives the losses of a pipeline of "
              "one-thread workers bit for bit\n",
              choice.Describe().c_str(), runtime::ComputeWaits().c_str());
  return absl::OkStatus();
}

// --local: each split count trained in this process.
absl::StatusOr<std::vector<Run>> TrainHere(const RunOptions& c, const Sets& sets) {
  std::vector<Run> runs;
  for (size_t i = 0; i < c.splits.size(); ++i) {
    const int s = c.splits[i];
    const int64_t rows = BatchRows(c, sets);
    std::printf("local: splits=%d (%s), %d %s\n", s,
                MicroBatches(c, s, static_cast<int>(rows / s), rows % s != 0).c_str(),
                c.threads, c.threads == 1 ? "thread" : "threads");
    const bool traced = Traced(c, i + 1 == c.splits.size());
    auto run = c.dataset.empty() ? TrainLocal(c, s) : FitLocal(c, s, *sets.train, *sets.test, traced);
    if (!run.ok()) return run.status();
    run->tokens_per_row = TokensPerRow(c);  // (a text's: the report's and curves' tokens)
    PrintRun(*run, c);
    runs.push_back(std::move(*run));
  }
  return runs;
}

// The master's agent, listening (workers may register from now on; Join
// waits for them all).
absl::StatusOr<std::unique_ptr<rpc::Agent>> StartMaster(const RunPlan& line, rpc::Registry& registry) {
  const RunOptions& c = line.config;
  rpc::AgentOptions opts;
  opts.name = "master";
  opts.is_master = true;
  opts.listen_address = c.listen;
  opts.workers = c.all_workers;
  opts.workers.insert(opts.workers.end(), c.spares.begin(), c.spares.end());  // (they stand by)
  opts.connect_timeout = absl::Seconds(c.connect_timeout);
  opts.busy_poll = absl::Microseconds(c.busy_poll_us);
  opts.rpc_timeout = absl::Minutes(10);
  opts.token = line.security.token;
  opts.tls = line.security.tls;
  auto agent = rpc::Agent::Start(opts, &registry);
  if (!agent.ok()) return agent.status();
  autograd::Enable(**agent);
  std::cout << "master listening at " << (*agent)->self().address << " (" << rpc::TlsModeName(line.security.tls)
            << launch::BusyPollingNote((*agent)->busy_poll()) << "), waiting for "
            << absl::StrJoin(opts.workers, ", ") << std::endl;
  return agent;
}

// Waits until every worker joined; lists them.
absl::Status JoinWorkers(rpc::Agent& agent, const RunOptions& c) {
  RETURN_IF_ERROR(agent.Join());
  std::vector<std::string> names;
  for (const auto& w : agent.workers()) {
    if (w.id == 0) continue;
    names.push_back(w.name);
    const bool spare = std::find(c.spares.begin(), c.spares.end(), w.name) != c.spares.end();
    std::cout << "  " << w.name << (spare ? ": spare, standing by (" : ": shards on ") << w.device
              << (spare ? ")\n" : "\n");
  }
  // Before anything runs there (a balanced partition measures layers).
  return c.deterministic ? train::UseDeterministicAlgorithmsOn(agent, names) : absl::OkStatus();
}

// The stages: the checkpoint's (the cut it was saved from), the whole
// model for the parameter server, the small CNN's, the TorchScript files,
// or ResNet50's blocks or a sequential model's layers as the partition
// cuts them.
absl::StatusOr<std::vector<pipeline::StageSpec>> ChooseStages(rpc::Agent& agent, const RunPlan& line) {
  const RunOptions& c = line.config;
  if (line.checkpoints.resume && !line.checkpoints.relayout) {
    std::printf("resuming %zu stage%s from %s\n", line.checkpoints.stages.size(),
                line.checkpoints.stages.size() == 1 ? "" : "s",
                line.checkpoints.resume->dir.c_str());
    return line.checkpoints.stages;
  }
  if (line.ps_mode) return WholeModelStages(c);
  if (TrainsSmallCnn(c)) return SmallCnnStages(c);
  if (c.model.empty() || c.sequential) return PartitionStages(agent, c);
  return c.scripts;
}

// --resume under another cut: the checkpoint written again for `stages`
// (checkpoint::Relayout) in --checkpoint-dir's relayout-step-N (replaced
// by the next such resume, pruned with step N), which the run then loads.
absl::StatusOr<checkpoint::Checkpoint> MoveCheckpoint(const RunOptions& c, const checkpoint::Checkpoint& ck,
                                                      const std::vector<pipeline::StageSpec>& stages) {
  const int n = static_cast<int>(c.workers.size());
  const std::vector<int> placement = pipeline::StagePlacement(c.schedule, n, static_cast<int>(stages.size()) / n);
  const std::string dir =
      (std::filesystem::path(c.checkpoint_dir) / ("relayout-" + std::filesystem::path(ck.dir).filename().string()))
          .string();
  auto moved = checkpoint::Relayout(ck, stages, placement, dir);
  if (!moved.ok()) return base::Annotate(moved.status(), absl::StrCat("resuming ", ck.dir, " under another cut"));
  const auto count = [](size_t k, const char* what) { return absl::StrCat(k, " ", what, k == 1 ? "" : "s"); };
  std::printf("resuming %s (%s over %s) cut again: %s over %s, written to %s\n", ck.dir.c_str(),
              count(ck.manifest.stages.size(), "stage").c_str(), count(ck.manifest.files.size(), "worker").c_str(),
              count(stages.size(), "stage").c_str(), count(c.workers.size(), "worker").c_str(), dir.c_str());
  return moved;
}

// --compare-local: the local baseline, trained batch by batch between the
// last split count's batches, so that both meet the same minutes of a
// machine whose speed drifts (measured: by 30% within minutes).
struct Baseline {
  std::unique_ptr<LocalRun> trainer;
  absl::Status status;  // the first failed batch's
};

// Training over the workers: the parameter server's run, or each split
// count's pipeline run.
absl::StatusOr<std::vector<Run>> TrainOverWorkers(rpc::Agent& agent, RunPlan& line, const Sets& sets,
                                                  Baseline& baseline) {
  const RunOptions& c = line.config;
  const Checkpointing& checkpoints = line.checkpoints;
  if (auto s = PlanRun(agent, line.config, BatchRows(c, sets)); !s.ok()) return s;
  if (c.planned_step_ms > 0 && !c.checkpoint_dir.empty()) {
    // (What the checkpoints record: the plan's schedule and count, with
    // which the run resumes.)
    line.checkpoints.identity = IdentityOf(c, c.splits[0]);
  }
  auto stages = ChooseStages(agent, line);
  if (!stages.ok()) return stages.status();
  if (line.checkpoints.relayout) {
    auto moved = MoveCheckpoint(c, *line.checkpoints.resume, *stages);
    if (!moved.ok()) return moved.status();
    line.checkpoints.resume = std::move(*moved);
  }
  // A directory that cannot be made fails now, before any training.
  if (auto s = train::Checkpoints(checkpoints.Target(c), c.checkpoint_every).Prepare(); !s.ok()) return s;
  std::vector<Run> runs;
  if (line.ps_mode) {
    Run run(1);
    if (auto log = OpenRunLog(c, 1); log.ok()) {
      run.log = *log;
    } else {
      return log.status();
    }
    auto trained = TrainElastic(agent, c, *stages, checkpoints, run,
                                [&](const RunOptions& now, const Checkpointing& ck,
                                    const std::vector<pipeline::StageSpec>& cut, train::Elastic* elastic) {
                                  return TrainPs(agent, now, line.ps, cut, sets, &ck, run, elastic);
                                });
    if (!trained.ok()) return trained;
    run.tokens_per_row = TokensPerRow(c);
    PrintRun(run, c);
    runs.push_back(std::move(run));
    return runs;
  }
  for (size_t i = 0; i < c.splits.size(); ++i) {
    const int s = c.splits[i];
    const bool last = i + 1 == c.splits.size();
    const int64_t batch = BatchRows(c, sets);
    const int rows = static_cast<int>(batch / (s * c.replicas));
    const bool about = batch % (s * c.replicas) != 0;
    if (c.replicas > 1) {
      const size_t p = c.workers.size(), k = stages->size();
      std::printf("pipeline: splits=%d (%s per replica) over %zu workers: %d replicas of %zu %s, %zu %s each\n",
                  s, MicroBatches(c, s, rows, about).c_str(), c.all_workers.size(), c.replicas, p,
                  p == 1 ? "worker" : "workers", k, k == 1 ? "stage" : "stages");
    } else {
      std::printf("pipeline: splits=%d (%s) over %zu workers, %zu stages\n", s,
                  MicroBatches(c, s, rows, about).c_str(), c.workers.size(), stages->size());
    }
    if (rows < kOneDnnRows && c.model.empty() && !TrainsSmallCnn(c) && !TrainsGpt(c)) {  // ResNet50's note
      std::printf("  note: micro-batches under %d rows: on a one-thread CPU worker, LibTorch's "
                  "1x1 convolutions leave oneDNN for a slower path below %d rows (ResNet50: "
                  "1.2x the time per image at 15 rows; see docs/pipeline.md)\n",
                  kOneDnnRows, kOneDnnRows);
    }
    std::function<void(int)> after_batch;
    if (last && c.compare_local) {
      std::printf("  alternating with local training (splits=1, %d threads, in this process)\n", c.threads);
      auto trainer = LocalRun::Create(c, 1);
      if (!trainer.ok()) return trainer.status();
      baseline.trainer = std::move(*trainer);
      after_batch = [&baseline, &c](int b) {
        if (!baseline.status.ok()) return;
        runtime::SetComputeThreads(c.threads);
        baseline.status = baseline.trainer->Step(b, "local ");
        runtime::SetComputeThreads(c.coordinator_threads);
      };
    }
    auto run = TrainOverPipeline(agent, c, *stages, s, sets, Traced(c, last), after_batch, checkpoints);
    if (!run.ok()) return run.status();
    if (c.planned_step_ms > 0) {
      std::printf("plan: predicted %.1f ms a step, measured %.1f ms (the median step after the first)\n",
                  c.planned_step_ms, 1000 * run->steady_seconds());
    }
    run->tokens_per_row = TokensPerRow(c);  // (a text's: the report's and curves' tokens)
    PrintRun(*run, c);
    runs.push_back(std::move(*run));
  }
  return runs;
}

}  // namespace

absl::Status CheckPaths(const RunOptions& c) {
  if (!c.dataset.empty()) {  // (read once the master listens)
    RETURN_IF_ERROR(data::CheckDatasetDir(c.dataset, c.val_fraction));
  }
  for (const auto& [flag, path] : {std::pair<const char*, std::string>{"report", c.report},
                                   {"trace", c.trace},
                                   {"timeline", c.timeline},
                                   {"curves", c.curves}}) {
    if (path.empty()) continue;
    if (const std::string why = launch::WhyCannotWrite(path); !why.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--", flag, " ", path, ": cannot write there (", why, "); give a path this user can write"));
    }
  }
  for (const auto& [flag, dir] : {std::pair<const char*, std::string>{"checkpoint-dir", c.checkpoint_dir},
                                  {"tensorboard", c.tensorboard}}) {
    if (dir.empty()) continue;
    if (const std::string why = launch::WhyCannotWriteDir(dir); !why.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--", flag, " ", dir, ": cannot write into it (", why, "); give a directory this user can write"));
    }
  }
  return absl::OkStatus();
}

namespace {

// The summary table, and the report, trace, timeline and curves asked for.
absl::Status WriteOutputs(const std::vector<Run>& runs, const RunOptions& c) {
  PrintSummary(runs, c);
  std::vector<std::string> tracks = c.local ? std::vector<std::string>{"master (local)"} : c.workers;
  if (!c.report.empty()) {
    if (auto s = WriteReport(c.report, c.local, runs, c); !s.ok()) return s;
    std::cout << "report: " << c.report << "\n";
  }
  if (!c.trace.empty()) {
    std::vector<std::string> all = tracks;
    if (!c.local) all.push_back("master");  // (its take batch, send and wait)
    if (auto s = train::WriteChromeTrace(c.trace, all, runs.back().slices); !s.ok()) return s;
    std::cout << "trace: " << c.trace << " (open in https://ui.perfetto.dev or chrome://tracing)\n";
  }
  if (!c.timeline.empty()) {
    if (auto s = train::WriteTimelineSvg(c.timeline, tracks, runs.back().slices, runs.back().splits); !s.ok()) {
      return s;
    }
    std::cout << "timeline: " << c.timeline << "\n";
  }
  if (!c.curves.empty()) {
    if (auto s = train::WriteCurves(c.curves, runs); !s.ok()) return s;
    std::cout << "curves: " << c.curves << "\n";
  }
  if (!c.tensorboard.empty()) {
    std::cout << "tensorboard: " << c.tensorboard << " (view with: tensorboard --logdir " << c.tensorboard << ")\n";
  }
  return absl::OkStatus();
}

void PrintBaseline(const Run& pipelined, const Run& local, const RunOptions& c) {
  std::printf("\nlocal baseline, batches alternating with splits=%d: splits=1 in this process, "
              "%d threads\n", pipelined.splits, c.threads);
  std::printf("splits=1 seconds=%.3f images_per_second=%.2f (local)\n", local.seconds,
              c.batches * c.batch_size / local.seconds);
  std::printf("pipeline splits=%d takes %.2fx the time of local splits=1 in all, %.2fx in steady "
              "state (median batch after the first: %.3f s against %.3f s)\n",
              pipelined.splits, pipelined.seconds / local.seconds, pipelined.steady_seconds() / local.steady_seconds(),
              pipelined.steady_seconds(), local.steady_seconds());
  if (!pipelined.data_wait_seconds.empty()) {
    std::printf("(the pipeline's steady batch includes %.3f s of waiting for the batch to be made; the local run "
                "makes each batch before its clock starts)\n", pipelined.steady_data_wait_seconds());
  }
}

}  // namespace

absl::Status RunMaster(RunPlan& plan, rpc::Registry* registry) {
  const RunOptions& c = plan.config;
  runtime::TuneAllocator();
  runtime::InstallCachingCpuAllocator();
  runtime::SetComputeThreads(c.local ? c.threads : c.coordinator_threads);
  // This process's generators too (dropout in --local runs); the workers'
  // are seeded when their stages are placed.
  at::manual_seed(static_cast<uint64_t>(c.seed));
  if (c.deterministic) runtime::UseDeterministicAlgorithms();

  std::unique_ptr<rpc::Agent> agent;
  // Ctrl-C or a scheduler's SIGTERM ends the group too (declared after the
  // agent: unhooked before it goes).
  std::optional<launch::InterruptHook> interrupted;
  // Every error ends the group: the workers are told why and exit at once.
  // (Unhooked first: where a signal's telling is under way, this waits for
  // it to end the process instead of stopping the agent under it.)
  auto fail = [&agent, &interrupted](const absl::Status& s) {
    interrupted.reset();
    if (agent) agent->Abort(s);
    return s;
  };
  // Listening before the dataset loads: a port in use is found at once
  // (checked first, so that gRPC's own log line does not precede remora's
  // message), and workers that register meanwhile learn of a failure.
  if (!plan.paths_checked) {
    if (auto s = CheckPaths(c); !s.ok()) return fail(s);
  }
  if (c.local) {
    // (Nothing to tell: said, then ended by the signal, as with workers.)
    interrupted.emplace([](int signo) {
      std::cerr << "master: stopped by a signal (" << strsignal(signo) << "); exiting" << std::endl;
    });
  } else {
    if (auto s = launch::CheckCanListen(c.listen, launch::AddressSource("--listen", c.listen)); !s.ok()) {
      return fail(s);
    }
    auto started = StartMaster(plan, *registry);
    if (!started.ok()) return fail(started.status());
    agent = std::move(*started);
    interrupted.emplace([a = agent.get()](int signo) {
      const std::string why = absl::StrCat("the master was stopped by a signal (", strsignal(signo), ")");
      std::cerr << "master: " << why << "; ending the group" << std::endl;
      a->TellGroupEnded(absl::CancelledError(why), signo);
    });
  }
  Baseline baseline;
  absl::StatusOr<std::vector<Run>> runs;
  try {  // (errors are statuses; an exception here is a bug, which must still end the group)
    auto sets = LoadSets(c, plan.checkpoints.resume.has_value());
    if (!sets.ok()) return fail(sets.status());
    if (auto s = FitInputShape(plan.config, **sets); !s.ok()) return fail(s);
    if (auto s = ChooseLocalThreads(plan.config, **sets); !s.ok()) return fail(s);
    SetDecaySteps(plan.config, **sets);
    runtime::SetComputeThreads(c.local ? c.threads : c.coordinator_threads);
    if (c.local) {
      runs = TrainHere(c, **sets);
    } else {
      if (auto s = JoinWorkers(*agent, c); !s.ok()) return fail(s);
      runs = TrainOverWorkers(*agent, plan, **sets, baseline);
    }
  } catch (...) {
    return fail(base::StatusFromCurrentException("unexpected error (please report it)"));
  }
  if (!runs.ok()) return fail(runs.status());
  if (auto s = WriteOutputs(*runs, c); !s.ok()) return fail(s);
  if (!baseline.status.ok()) return fail(baseline.status);
  if (baseline.trainer != nullptr) PrintBaseline(runs->back(), baseline.trainer->run(), c);
  if (agent) {
    interrupted.reset();  // (as in fail)
    if (auto s = agent->Shutdown(); !s.ok()) return fail(s);
  }
  return absl::OkStatus();
}

}  // namespace remora::master
