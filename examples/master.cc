// master: trains ResNet50 as a pipeline over worker processes (or, with
// --local, in this process alone) and reports how the split count pays.
//
//   worker --name worker1 & worker --name worker2 &
//   master --workers worker1,worker2 --splits 1,2,4,8
//
// The classic demo: random images, MSE loss against one-hot labels over
// 1000 classes, SGD through the DistributedOptimizer. --splits N means N
// micro-batches per batch (not their size). Each worker places its shard on
// its own --device (cuda:N for a GPU); activations between GPU workers go
// GPU to GPU (CUDA IPC or NCCL) as the workers' device maps say, and the
// last stage's output lands on the master's CPU.
#include <cstdio>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "autograd/dist_autograd.h"
#include "examples/builtins.h"
#include "examples/master_flags.h"
#include "examples/master_runs.h"
#include "examples/ps_runs.h"
#include "examples/timeline.h"
#include "launch/cli.h"
#include "rpc/agent.h"
#include "runtime/allocator.h"
#include "runtime/threads.h"

namespace remora {
namespace {

using namespace master;  // NOLINT: the program and its runs

int Main(int argc, char** argv) {
  Flags flags = DefaultFlags();
  cli::FlagParser parser("master",
                         "Trains ResNet50 as a pipeline over worker processes and reports the "
                         "speedup of each split count.\nStart the workers first: "
                         "worker --name worker1 (see worker --help).");
  AddFlags(parser, &flags);
  int code = 0;
  if (!parser.Parse(argc, argv, &code)) return code;
  auto checked = Check(std::move(flags));
  if (!checked.ok()) {
    std::cerr << "master: " << checked.status().message() << "\n";
    return 2;
  }
  CommandLine& line = *checked;
  Config& c = line.config;
  const PsFlags& ps_flags = line.ps;
  const bool ps_mode = line.ps_mode;
  Checkpointing& checkpoints = line.checkpoints;
  runtime::TuneAllocator();
  runtime::InstallCachingCpuAllocator();
  runtime::SetComputeThreads(c.threads);

  std::vector<Run> runs;
  std::unique_ptr<LocalTrainer> local_baseline;  // --compare-local
  absl::Status baseline_status;
  std::unique_ptr<Agent> agent;
  Registry registry;
  if (auto s = examples::RegisterStockWorker(registry); !s.ok()) {
    std::cerr << "master: " << s.message() << "\n";
    return 1;
  }
  auto die = [&](const absl::Status& s) {
    std::cerr << "master: " << s.message() << "\n";
    if (agent) agent->Shutdown(/*graceful=*/false).IgnoreError();
    return 1;
  };
  std::pair<data::Dataset, data::Dataset> sets;  // --dataset: training, test
  if (!c.dataset.empty()) {
    auto loaded = LoadDataset(c);
    if (!loaded.ok()) return die(loaded.status());
    sets = std::move(*loaded);
    if (c.model.empty() && sets.first.images.sizes().slice(1) != c10::IntArrayRef({1, 28, 28})) {
      return die(absl::InvalidArgumentError(absl::StrCat(
          "--dataset ", c.dataset, " has images of ", c10::str(sets.first.images.sizes().slice(1)),
          "; remora's small CNN takes [1, 28, 28]: give --model stages for these")));
    }
    std::printf("dataset %s: %lld training and %lld test images of %s\n", c.dataset.c_str(),
                static_cast<long long>(sets.first.size()), static_cast<long long>(sets.second.size()),
                c10::str(sets.first.images.sizes().slice(1)).c_str());
  }
  if (c.local) {
    for (int s : c.splits) {
      std::printf("local: splits=%d (%d micro-batches of %d images), %d threads\n", s, s,
                  c.batch_size / s, c.threads);
      auto trained = c.dataset.empty() ? TrainLocal(c, s) : FitLocal(c, s, sets.first, sets.second);
      if (!trained.ok()) return die(trained.status());
      Run run = std::move(*trained);
      std::printf("splits=%d seconds=%.3f images_per_second=%.2f\n", s, run.seconds,
                  Images(run, c) / run.seconds);
      runs.push_back(std::move(run));
    }
  } else {
    AgentOptions opts;
    opts.name = "master";
    opts.is_master = true;
    opts.listen_address = c.listen;
    opts.workers = c.all_workers;
    opts.connect_timeout = absl::Seconds(c.connect_timeout);
    opts.rpc_timeout = absl::Minutes(10);
    opts.token = line.security.token;
    opts.tls = line.security.tls;
    auto started = Agent::Start(opts, &registry);
    if (!started.ok()) return die(started.status());
    agent = std::move(*started);
    dist_autograd::Enable(*agent);
    std::cout << "master listening at " << agent->self().address << " (" << TlsModeName(line.security.tls)
              << "), waiting for "
              << absl::StrJoin(c.all_workers, ", ") << std::endl;
    if (auto s = agent->Join(); !s.ok()) return die(s);
    for (const auto& w : agent->workers()) {
      if (w.id != 0) std::cout << "  " << w.name << ": shards on " << w.device << "\n";
    }
    // The stages: the TorchScript files, the small CNN, or ResNet50's
    // blocks or a sequential model's layers as the partition cuts them.
    std::vector<pipeline::StageSpec> stages = c.scripts;
    if (checkpoints.resume) {
      stages = checkpoints.stages;  // the cut the checkpoint was saved from
      std::printf("resuming %zu stages from %s\n", stages.size(), checkpoints.resume->dir.c_str());
    } else if (ps_mode) {
      stages = PsStages(c);  // whole, in the master
    } else if (c.model.empty() && !c.dataset.empty()) {
      stages = SmallCnnStages(c);
    } else if (c.model.empty() || c.sequential) {
      auto cut = PartitionStages(*agent, c);
      if (!cut.ok()) return die(cut.status());
      stages = std::move(*cut);
    }
    if (!c.checkpoint_dir.empty()) {
      auto saver = checkpoint::Checkpointer::Create(*agent, c.checkpoint_dir, c.keep);
      if (!saver.ok()) return die(saver.status());
      checkpoints.saver = std::move(*saver);
      checkpoints.stages = stages;
    }
    if (ps_mode) {
      auto run = TrainPs(*agent, c, ps_flags, stages, sets, &checkpoints);
      if (!run.ok()) return die(run.status());
      std::printf("splits=1 seconds=%.3f images_per_second=%.2f\n", run->seconds, Images(*run, c) / run->seconds);
      runs.push_back(std::move(*run));
    }
    for (size_t i = 0; !ps_mode && i < c.splits.size(); ++i) {
      const int s = c.splits[i];
      const bool last = i + 1 == c.splits.size();
      std::printf("pipeline: splits=%d (%d micro-batches of ~%d images) over %zu workers, %zu stages\n",
                  s, s, c.batch_size / (s * c.replicas), c.workers.size(), stages.size());
      if (c.batch_size / (s * c.replicas) < kOneDnnRows) {
        std::printf("  note: micro-batches under %d rows: on a one-thread CPU worker, LibTorch's "
                    "1x1 convolutions leave oneDNN for a slower path below %d rows (ResNet50: "
                    "1.2x the time per image at 15 rows; see docs/pipeline.md)\n",
                    kOneDnnRows, kOneDnnRows);
      }
      // --compare-local: the local baseline trains batch by batch between
      // the last split count's batches, so that both meet the same minutes
      // of a machine whose speed drifts (measured: by 30% within minutes).
      std::function<void(int)> after_batch;
      if (last && c.compare_local) {
        std::printf("  alternating with local training (splits=1, %d threads, in this process)\n",
                    c.threads);
        auto trainer = LocalTrainer::Create(c, 1);
        if (!trainer.ok()) return die(trainer.status());
        local_baseline = std::move(*trainer);
        after_batch = [&local_baseline, &baseline_status](int b) {
          if (baseline_status.ok()) baseline_status = local_baseline->Step(b, "local ");
        };
      }
      auto run = c.dataset.empty()
                     ? TrainPipeline(*agent, c, stages, s,
                                     last && !(c.trace.empty() && c.timeline.empty()), after_batch,
                                     &checkpoints)
                     : FitPipeline(*agent, c, stages, s, sets.first, sets.second, &checkpoints);
      if (!run.ok()) return die(run.status());
      std::printf("splits=%d seconds=%.3f images_per_second=%.2f\n", s, run->seconds,
                  Images(*run, c) / run->seconds);
      runs.push_back(std::move(*run));
    }
  }
  PrintSummary(runs, c);
  std::vector<std::string> tracks = c.local ? std::vector<std::string>{"master (local)"} : c.workers;
  if (!c.report.empty()) {
    if (auto s = WriteReport(c.report, c.local, runs, c); !s.ok()) return die(s);
    std::cout << "report: " << c.report << "\n";
  }
  if (!c.trace.empty()) {
    if (auto s = cli::WriteChromeTrace(c.trace, tracks, runs.back().slices); !s.ok()) return die(s);
    std::cout << "trace: " << c.trace << " (open in https://ui.perfetto.dev or chrome://tracing)\n";
  }
  if (!c.timeline.empty()) {
    if (auto s = cli::WriteTimelineSvg(c.timeline, tracks, runs.back().slices, runs.back().splits);
        !s.ok()) {
      return die(s);
    }
    std::cout << "timeline: " << c.timeline << "\n";
  }
  if (!baseline_status.ok()) return die(baseline_status);
  if (local_baseline != nullptr) {
    const Run& run = local_baseline->run();
    std::printf("\nlocal baseline, batches alternating with splits=%d: splits=1 in this process, "
                "%d threads\n", runs.back().splits, c.threads);
    std::printf("splits=1 seconds=%.3f images_per_second=%.2f (local)\n", run.seconds,
                c.batches * c.batch_size / run.seconds);
    std::printf("pipeline splits=%d takes %.2fx the time of local splits=1 in all, %.2fx in steady "
                "state (median batch after the first: %.3f s against %.3f s)\n",
                runs.back().splits, runs.back().seconds / run.seconds,
                SteadySeconds(runs.back()) / SteadySeconds(run), SteadySeconds(runs.back()),
                SteadySeconds(run));
  }
  if (agent) {
    if (auto s = agent->Shutdown(); !s.ok()) return die(s);
  }
  return 0;
}

}  // namespace
}  // namespace remora

int main(int argc, char** argv) { return remora::Main(argc, argv); }
