#include "master/ps_runs.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/numbers.h"
#include "base/status_util.h"
#include "checkpoint/checkpoint.h"
#include "shards/cnn.h"
#include "shards/resnet.h"
#include "ps/parameter_server.h"
#include "train/fit.h"
#include "train/ps_trainer.h"

namespace remora::master {
namespace {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// What the steps did, for the summary.
struct PsStats {
  std::vector<double> step_seconds;
  int64_t pull_bytes = 0, push_bytes = 0;
  std::map<std::string, int64_t> dropped, lost;

  void Add(const ps::StepReport& r, double seconds) {
    step_seconds.push_back(seconds);
    pull_bytes += r.pull_bytes;
    push_bytes += r.push_bytes;
    for (const auto& w : r.dropped) ++dropped[w];
    for (const auto& w : r.lost) ++lost[w];
  }
};

std::string Counts(const std::map<std::string, int64_t>& m) {
  std::vector<std::string> out;
  for (const auto& [w, n] : m) out.push_back(absl::StrCat(w, " x", n));
  return out.empty() ? "none" : absl::StrJoin(out, ", ");
}

// "ps step=S used=w1,w2 dropped=w3 lost=none rows=R/B loss=L seconds=T pull_bytes=P push_bytes=Q"
void PrintStep(const ps::StepReport& r, double seconds) {
  auto list = [](const std::vector<std::string>& v) { return v.empty() ? std::string("none") : absl::StrJoin(v, ","); };
  std::printf(
      "ps step=%lld used=%s dropped=%s lost=%s rows=%lld/%lld loss=%.6f seconds=%.3f "
      "pull_bytes=%lld push_bytes=%lld%s\n",
      static_cast<long long>(r.step), list(r.used).c_str(), list(r.dropped).c_str(), list(r.lost).c_str(),
      static_cast<long long>(r.rows), static_cast<long long>(r.batch_rows), base::UnsignedNan(r.loss), seconds,
      static_cast<long long>(r.pull_bytes), static_cast<long long>(r.push_bytes),
      r.rounds > 1 ? absl::StrCat(" rounds=", r.rounds).c_str() : "");
  std::fflush(stdout);
}

// How many of --workers are servers: K for --ps-partitions K >= 2, else none.
int ServerCount(const PsFlags& p) { return p.partitions > 1 ? p.partitions : 0; }

// Where the parameters live and which workers compute, with the channel
// the master reaches each over.
void PrintPlacement(rpc::Agent& agent, const std::vector<ps::PartitionPlacement>& partitions,
                    const std::vector<std::string>& workers) {
  auto route = [&agent](const std::string& w) {
    auto r = agent.channel_to(w);
    return r.ok() ? *r : std::string("?");
  };
  for (size_t k = 0; k < partitions.size(); ++k) {
    std::printf("  %s: server of partition %zu, %zu parameter tensors, %.1f KiB; tensors over %s\n",
                partitions[k].server.c_str(), k, partitions[k].params.size(), partitions[k].bytes / 1024.0,
                route(partitions[k].server).c_str());
  }
  for (const auto& w : workers) {
    std::printf("  %s: computes; tensors over %s\n", w.c_str(), route(w).c_str());
  }
  std::fflush(stdout);
}

}  // namespace

std::string CheckPsFlags(const RunOptions& c, const PsFlags& p, bool ps_mode, bool splits_given,
                         int pipeline_stages) {
  if (!ps_mode) {
    return p.partitions != 0 || p.backup_workers != 0 || p.step_lines
               ? "--ps-partitions, --backup-workers and --ps-step-lines go with --mode ps"
               : "";
  }
  if (c.local) return "--mode ps trains over workers: not with --local (which trains in this process)";
  if (c.replicas != 1 || pipeline_stages != 0 || c.zero != 0) {
    return "--mode ps is data parallelism through a parameter server: not with --replicas, "
           "--pipeline-stages or --zero (the pipeline's data parallelism)";
  }
  if (splits_given || !c.split_at.empty() || c.interleave != 0) {
    return "--mode ps gives each worker its whole share of a batch at once: --splits, --split-at "
           "and --interleave are the pipeline's";
  }
  if (c.compare_local || !c.trace.empty() || !c.timeline.empty()) {
    return "--compare-local, --trace and --timeline are the pipeline's: not with --mode ps";
  }
  if (p.partitions < 0) {
    return absl::StrCat("--ps-partitions ", p.partitions, ": give 0 or 1 (the master holds the model and optimizer) "
                        "or K >= 2 (the first K --workers hold a partition each)");
  }
  const int servers = ServerCount(p);
  const int all = static_cast<int>(c.all_workers.size());
  if (servers >= all) {
    return absl::StrCat("--ps-partitions ", p.partitions, " with ", all, " --workers: the first ", p.partitions,
                        " workers are the servers and at least one more must compute: give at most ",
                        all - 1, " partitions or more --workers");
  }
  const int n = all - servers;
  const std::string computing = servers > 0 ? " compute workers (the --workers after the servers)" : " --workers";
  if (p.backup_workers < 0 || p.backup_workers >= n) {
    return absl::StrCat("--backup-workers ", p.backup_workers, " with ", n, computing,
                        ": give 0 <= k < n (each step needs the gradients of n - k workers)");
  }
  if (c.batch_size < n) {
    return absl::StrCat("--batch-size ", c.batch_size, " is less than the ", n, computing,
                        ": each needs at least one row of every batch");
  }
  return "";
}

absl::Status TrainPs(rpc::Agent& agent, const RunOptions& c, const PsFlags& p,
                     const std::vector<pipeline::StageSpec>& stages, const Sets& sets,
                     const Checkpointing* checkpoints, Run& run, train::Elastic* elastic) {
  ps::PsOptions o;
  o.stages = stages;
  o.seed = static_cast<uint64_t>(c.seed);
  const auto first_worker = c.all_workers.begin() + ServerCount(p);
  o.servers.assign(c.all_workers.begin(), first_worker);
  o.workers.assign(first_worker, c.all_workers.end());
  o.loss = c.model.empty() && c.dataset.empty() ? "mse" : ReadsText(c) ? "causal_lm" : "cross_entropy";
  o.optimizer = OptimizerOf(c);
  o.backup_workers = p.backup_workers;
  o.clip_grad_norm = c.clip_grad_norm;
  o.bf16 = c.precision == "bf16";
  o.device = c.device;
  const size_t computing = o.workers.size();
  ASSIGN_OR_RETURN(auto trainer, train::PsTrainer::Create(agent, o));
  ps::ParameterServer& server = trainer->server();
  std::printf("parameter server: %zu stage%s, %.2f MiB of parameters %s, %zu worker%s%s\n", stages.size(),
              stages.size() == 1 ? "" : "s",
              server.parameter_bytes() / 1048576.0,
              o.servers.empty() ? "in the master"
                                : absl::StrCat("over ", o.servers.size(), " server processes").c_str(),
              computing, computing == 1 ? "" : "s",
              p.backup_workers > 0
                  ? absl::StrCat(", going on with the first ", computing - p.backup_workers,
                                 " gradient sets of each step (--backup-workers ", p.backup_workers, ")")
                        .c_str()
                  : ", synchronous");
  PrintPlacement(agent, server.placement(), o.workers);
  PsStats stats;
  trainer->set_on_step([&stats, &p](const ps::StepReport& r, double seconds) {
    stats.Add(r, seconds);
    if (p.step_lines || !r.lost.empty()) PrintStep(r, seconds);
  });
  if (run.log == nullptr) {
    ASSIGN_OR_RETURN(run.log, OpenRunLog(c, 1));
  }
  run.schedule = "ps";
  if (c.dataset.empty()) {
    auto [f, first] = StartBatchRun(c, checkpoints, run);
    // (A recovery goes on from an earlier batch: the later ones' times go.)
    if (f.resume) KeepStepsUpTo(run, first);
    train::FitFunctions batches;  // (each batch's line and record; the elastic supervisor told)
    batches.step = [&run, elastic](const train::StepRecord& s) {
      RecordBatch(run, static_cast<int>(s.step - 1), s.loss, s.seconds, s.rows);
      if (elastic != nullptr) elastic->StepDone(s.step);
    };
    f.observers = {&batches};
    RETURN_IF_ERROR(train::Fit(*trainer, DemoBatches(c, first), *data::NoRows(), f, std::cout).status());
  } else {
    // Each computing worker needs at least one row of every batch.
    train::TrainOptions f = TrainOptionsOf(c, 1, static_cast<int64_t>(computing), checkpoints);
    train::RunRecorder recorder(run);
    train::FitFunctions supervised;  // (tells the elastic supervisor of every step)
    if (elastic != nullptr) supervised.step = [elastic](const train::StepRecord& s) { elastic->StepDone(s.step); };
    f.observers = {&recorder, &supervised};
    if (c.data_on == "workers") {
      // Each worker reads its share of every batch; the test set is read
      // here, where the model is evaluated.
      RETURN_IF_ERROR(trainer->ReadOnWorkers(SourceSpecOf(c, true), sets.train->size(), *sets.test));
      std::printf("data: read on %s (the master sends row numbers; it reads the test set)\n",
                  absl::StrJoin(trainer->readers(), ", ").c_str());
    } else {
      std::printf("data: read on the master\n");
    }
    ASSIGN_OR_RETURN(std::vector<train::EpochResult> epochs,
                     train::Fit(*trainer, *sets.train, *sets.test, f, std::cout));
    MergeEpochs(run, epochs);
  }
  const double steps = std::max<double>(1, static_cast<double>(stats.step_seconds.size()));
  std::printf("ps: steps=%zu median_step_seconds=%.4f pull_bytes_per_step=%.0f push_bytes_per_step=%.0f "
              "dropped: %s; lost: %s; live workers: %s\n",
              stats.step_seconds.size(), Median(stats.step_seconds), stats.pull_bytes / steps,
              stats.push_bytes / steps, Counts(stats.dropped).c_str(), Counts(stats.lost).c_str(),
              absl::StrJoin(server.live_workers(), ",").c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace remora::master
