#include "master/runs.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/mse_loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string_view>
#include <thread>
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "autograd/dist_autograd.h"
#include "launch/cli.h"
#include "optim/distributed_optimizer.h"
#include "pipeline/microbatch.h"
#include "pipeline/partition.h"
#include "pipeline/pipeline.h"
#include "pipeline/stage.h"
#include "channel/devices.h"
#include "base/status_util.h"
#include "runtime/allocator.h"
#include "runtime/threads.h"
#include "trace/trace.h"
#include "shards/stage_types.h"
#include "shards/cnn.h"
#include "shards/gpt.h"
#include "shards/protocol.h"
#include "shards/resnet.h"
#include "train/pipeline_trainer.h"
#include "train/protocol.h"
#include "train/tracing.h"

namespace remora::master {


pipeline::LossFn Loss(const RunOptions& c) {
  pipeline::LossFn loss = c.model.empty() && c.dataset.empty() ? pipeline::MseLoss()
                          : ReadsText(c)                       ? pipeline::CausalLmLoss()
                                                               : pipeline::CrossEntropyLoss();
  // REMORA_STEP_PROTOCOL=master: the loss unnamed, so the pipeline keeps the
  // master in the data path (the earlier protocol), to measure one against
  // the other with one binary.
  if (const char* p = std::getenv("REMORA_STEP_PROTOCOL"); p != nullptr && std::string(p) == "master") {
    return pipeline::LossFn([loss](const c10::IValue& out, const c10::IValue& target) {
      return loss(out, target);
    });
  }
  return loss;
}

void PrintBatch(int b, double loss, double seconds) {
  std::printf("batch=%d loss=%.6f seconds=%.3f\n", b, loss, seconds);
  std::fflush(stdout);
}

std::vector<pipeline::StageSpec> WholeModelStages(const RunOptions& c) {
  if (!c.model.empty()) return c.scripts;
  if (TrainsGpt(c)) return {GptPart(c, 0, shards::GptParts(c.layers))};
  if (TrainsSmallCnn(c)) {
    return {pipeline::StageSpec::Registered("SmallCnn", {int64_t{0}, int64_t{shards::kSmallCnnBlocks},
                                                         int64_t{c.seed}})};
  }
  return {pipeline::StageSpec::Registered("ResNetShard", {int64_t{0}, int64_t{shards::kResNetBlocks},
                                                          int64_t{c.seed}})};
}

std::vector<pipeline::StageSpec> SmallCnnStages(const RunOptions& c) {
  // One stage per worker; zbv's V two.
  const int n = static_cast<int>(c.workers.size()) * (c.schedule == "zbv" ? 2 : 1);
  std::vector<pipeline::StageSpec> out;
  for (int k = 0; k < n; ++k) {
    const int64_t first = shards::kSmallCnnBlocks * k / n, last = shards::kSmallCnnBlocks * (k + 1) / n;
    out.push_back(pipeline::StageSpec::Registered("SmallCnn", {first, last, int64_t{c.seed}}));
  }
  return out;
}

namespace {

// The microseconds of the windows in `paused` that ended by `t`: what a
// slice starting at `t` is moved back by, so that the timeline leaves them out.
int64_t PausedBefore(const std::vector<std::pair<int64_t, int64_t>>& paused, int64_t t) {
  int64_t sum = 0;
  for (const auto& [p0, p1] : paused) {
    if (p1 <= t) sum += p1 - p0;
  }
  return sum;
}

// The workers' trace slices since `start` (trace::NowUs), into the run's
// timeline; the windows in `paused` (--compare-local's local batches) are
// left out of it. Stops the workers' tracing.
absl::Status CollectSlices(train::PipelineTrainer& trainer, int64_t start,
                           const std::vector<std::pair<int64_t, int64_t>>& paused, Run& run) {
  ASSIGN_OR_RETURN(std::vector<train::TimelineSlice> slices, trainer.TakeTraces(start));
  for (train::TimelineSlice& t : slices) {
    const int64_t skipped = PausedBefore(paused, start + t.start_us);
    t.start_us -= skipped;
    t.end_us -= skipped;
    run.slices.push_back(std::move(t));
  }
  return absl::OkStatus();
}

// The steps of a pipeline run that the workers trace: enough for its
// bubble and a picture of its shape (--trace, --timeline), not every
// epoch (a long run's slices would fill the workers' memory and the
// collecting reply).
constexpr int64_t kTracedSteps = 100;

// The workers' slices of a pipeline run (its first kTracedSteps steps;
// replica 0's), collected into run.slices where the run is `traced`
// (--trace, --timeline), and its bubble (train/timeline.h) beside its
// schedule's, recorded for the report and printed. Where fewer than two steps were
// traced, or an untraced run's slices cannot be collected, it says so and
// the run goes on.
absl::Status CollectAndMeasure(train::PipelineTrainer& trainer, int64_t start,
                               const std::vector<std::pair<int64_t, int64_t>>& paused, bool traced, Run& run) {
  const std::vector<std::string>& workers = trainer.pipeline().replica(0).workers();
  const pipeline::Schedule& schedule = trainer.pipeline().replica(0).schedule();
  const size_t before = run.slices.size();  // (an elastic run's earlier attempts')
  absl::StatusOr<train::Bubble> b;
  if (absl::Status collected = CollectSlices(trainer, start, paused, run); !collected.ok()) {
    if (traced) return collected;
    b = collected;
  } else {
    const std::vector<train::TimelineSlice> these(run.slices.begin() + before, run.slices.end());
    b = train::MeasureBubble(these, static_cast<int>(workers.size()));
  }
  if (!traced) run.slices.erase(run.slices.begin() + before, run.slices.end());
  if (!b.ok()) {
    std::printf("bubble: not measured: %s\n", std::string(b.status().message()).c_str());
    return absl::OkStatus();
  }
  if (absl::StatusOr<double> s = train::ScheduleBubble(schedule); s.ok()) b->schedule_fraction = *s;
  b->schedule_split = schedule.SplitsBackward();
  std::printf("%s", train::FormatBubble(*b, workers).c_str());
  if (run.log != nullptr) run.log->AddBubble(*b, workers, run.first_step + b->steps + 1);
  run.bubble = *std::move(b);
  return absl::OkStatus();
}

// The run's pipeline over the workers (stage k on worker k mod n), with
// --replicas R copies of it, its schedule and placement printed.
absl::StatusOr<std::unique_ptr<train::PipelineTrainer>> CreatePipeline(
    rpc::Agent& agent, const RunOptions& c, const std::vector<pipeline::StageSpec>& stages, int splits) {
  parallel::DataParallelOptions o;
  o.pipeline.stages = stages;
  o.pipeline.workers = c.all_workers;
  o.pipeline.schedule = c.schedule;
  o.pipeline.micro_batches = splits;
  o.pipeline.loss = Loss(c);
  o.pipeline.optimizer = OptimizerOf(c);
  o.pipeline.seed = static_cast<uint64_t>(c.seed);
  o.pipeline.clip_grad_norm = c.clip_grad_norm;
  if (TrainsGpt(c) && c.tie_embeddings && stages.size() > 1) {
    o.pipeline.tied_first = shards::kGptTiedFirst;
    o.pipeline.tied_last = shards::kGptTiedLast;
  } else if (auto tied = c.sequential ? c.sequential->Tied() : std::nullopt; tied && stages.size() > 1) {
    o.pipeline.tied_first = tied->first;  // (a one-file model's own tie)
    o.pipeline.tied_last = tied->second;
  }
  o.replicas = c.replicas;
  o.bucket_bytes = int64_t{c.bucket_mb} << 20;
  o.overlap = c.overlap;
  o.timeout = absl::Seconds(c.collective_timeout);
  o.zero = c.zero;
  ASSIGN_OR_RETURN(auto trainer, train::PipelineTrainer::Create(agent, std::move(o)));
  parallel::DataParallelPipeline* pipe = &trainer->pipeline();
  const int stages_here = pipe->replica(0).num_stages();
  std::printf("  schedule %s: %d stage%s over %zu worker%s", pipe->replica(0).schedule().name.c_str(), stages_here,
              stages_here == 1 ? "" : "s", c.workers.size(), c.workers.size() == 1 ? "" : "s");
  if (c.replicas > 1) {
    std::printf(", %d replicas (gradients summed over %s%s%s):\n%s", c.replicas,
                pipe->backend().c_str(),
                c.overlap ? ", overlapping backward" : "",
                c.zero == 1 ? ", ZeRO-1: optimizer state sharded" : "", pipe->Placement().c_str());
  } else {
    std::printf("\n");
  }
  return trainer;
}

// What a pipeline's run of epochs does beside recording its steps: keeps
// each epoch in the run as it ends (an attempt that fails later loses
// none), marks when the last step ended (a recovery's time counts in the
// epoch it goes on in), tells the elastic supervisor (when there is one)
// of every step, and stops the workers' tracing after kTracedSteps steps.
// Used on Fit's thread; borrows all it is given.
class FitWatch final : public train::FitObserver {
 public:
  FitWatch(train::PipelineTrainer& traced, Run& run, train::Elastic* elastic)
      : traced_(traced), run_(run), elastic_(elastic) {}

  absl::Status AfterStep(const train::StepRecord& s) override {
    if (++steps_ == kTracedSteps) traced_.StopTracing();
    run_.last_step_end = std::chrono::steady_clock::now();
    if (elastic_ != nullptr) elastic_->StepDone(s.step);
    return absl::OkStatus();
  }
  void EpochEnded(const train::EpochResult& e) override { MergeEpochs(run_, {e}); }

 private:
  train::PipelineTrainer& traced_;
  Run& run_;
  train::Elastic* elastic_;
  int64_t steps_ = 0;
};

}  // namespace

checkpoint::RunIdentity IdentityOf(const RunOptions& c, int splits) {
  checkpoint::RunIdentity id;
  id.checkpoint_every = c.checkpoint_every;
  id.keep = c.keep;
  if (!c.model.empty()) {
    std::vector<std::string> crcs;
    for (const auto& spec : c.scripts) crcs.push_back(checkpoint::Crc32(spec.script));
    id.model = absl::StrCat("torchscript crc32=", absl::StrJoin(crcs, ","));
  } else {
    id.model = TrainsSmallCnn(c) ? "small-cnn"
               : TrainsGpt(c)
                   ? absl::StrCat("gpt layers=", c.layers, " d-model=", c.d_model, " heads=", c.heads,
                                  " seq-len=", c.seq_len, c.tie_embeddings ? " tie-embeddings" : "")
                   : absl::StrCat("resnet50 image-size=", c.image_size);
  }
  if (c.dataset.empty()) {
    id.data = absl::StrCat("random batch-size=", c.batch_size, " seed=", c.seed);
    if (!c.model.empty()) {
      absl::StrAppend(&id.data, " input-shape=", absl::StrJoin(c.input_shape, ","), " classes=", c.classes);
    }
  } else {
    id.data = absl::StrCat(c.dataset, " batch-size=", c.batch_size, " seed=", c.seed,
                           c.shuffle ? " shuffle" : " file-order",
                           // (An image folder's N are spread over its listing; they were its
                           // first N once: another subset, refused on resume.)
                           c.train_rows > 0 ? absl::StrCat(" train-rows=", c.train_rows,
                                                           ReadsImageFolder(c) ? " spread" : "")
                                            : "",
                           c.val_fraction > 0 ? absl::StrCat(" val-fraction=", c.val_fraction) : "",
                           c.tokenizer.empty() ? "" : absl::StrCat(" tokenizer=", c.tokenizer),
                           // (The built-in GPT's is in its model's name.)
                           ReadsText(c) && !c.model.empty() ? absl::StrCat(" seq-len=", c.seq_len) : "",
                           // (ResNet50's is in its model's name.)
                           ReadsImageFolder(c) && !c.model.empty() ? absl::StrCat(" image-size=", c.image_size) : "");
  }
  const optim::OptimizerOptions o = OptimizerOf(c);
  id.optimizer = o.kind == optim::OptimizerOptions::Kind::kAdam    ? absl::StrCat("adam lr=", o.lr)
                 : o.kind == optim::OptimizerOptions::Kind::kAdamW ? absl::StrCat("adamw lr=", o.lr, " weight-decay=",
                                                                                  o.weight_decay)
                                                                   : absl::StrCat("sgd lr=", o.lr, " momentum=",
                                                                                  o.momentum);
  if (o.kind == optim::OptimizerOptions::Kind::kAdamW && o.decay_all) absl::StrAppend(&id.optimizer, " decay-all");
  if (c.clip_grad_norm > 0) absl::StrAppend(&id.optimizer, " clip-grad-norm=", c.clip_grad_norm);
  if (o.schedule.scheduled()) absl::StrAppend(&id.optimizer, " lr-schedule=", DescribeSchedule(o));
  id.schedule = c.schedule;
  id.micro_batches = splits;
  id.replicas = c.replicas;
  return id;
}

int64_t RowsPerPart(const RunOptions& c) {
  // (The small CNN and the GPT have no batch norm, ResNet50 has.)
  if (c.model.empty()) return TrainsSmallCnn(c) || TrainsGpt(c) ? 1 : 2;
  for (const pipeline::StageSpec& spec : c.scripts) {
    auto stage = pipeline::BuildStage(spec, c10::Device(c10::kCPU));
    if (!stage.ok()) continue;  // the workers' building says what is wrong with it
    for (const std::string& name : (*stage)->Names()) {
      if (name == "running_mean" || absl::EndsWith(name, ".running_mean")) return 2;
    }
  }
  return 1;
}

train::TrainOptions TrainOptionsOf(const RunOptions& c, int splits, int64_t parts,
                                   const Checkpointing* checkpoints) {
  train::TrainOptions o;
  o.fit.epochs = c.epochs;
  o.fit.batch_size = c.batch_size;
  // (Capped at the batch size: full batches are never dropped.)
  o.fit.min_batch_rows = std::max(parts, std::min(parts * RowsPerPart(c), int64_t{c.batch_size}));
  o.fit.shuffle = c.shuffle;
  o.fit.seed = static_cast<uint64_t>(c.seed);
  o.fit.progress_bar = isatty(fileno(stdout));
  // Files are read and decoded ahead; sets in memory need no reading.
  if (ReadsImageFolder(c)) o.fit.prefetch = c.prefetch;
  o.fit.tokens_per_row = TokensPerRow(c);
  o.eval_every = c.eval_every;
  if (checkpoints != nullptr) {
    o.checkpoints = checkpoints->Target(c);
    o.checkpoint_every = c.checkpoint_every;
    o.resume = checkpoints->resume;
  }
  return o;
}

absl::StatusOr<Run> FitLocal(const RunOptions& c, int splits, const data::Source& train, const data::Source& test,
                             bool traced) {
  ASSIGN_OR_RETURN(auto local, LocalRun::Create(c, splits));
  Run run(splits);
  if (traced) {  // (the first kTracedSteps steps: a step's last slice is "step")
    local->trainer().set_slices([&run, start = trace::NowUs(), steps = int64_t{0}](const char* what, int64_t mb,
                                                                                  int64_t s, int64_t e) mutable {
      if (steps >= kTracedSteps) return;
      run.slices.push_back({0, what, mb, s - start, e - start, ""});
      steps += std::string_view(what) == "step";
    });
  }
  ASSIGN_OR_RETURN(run.log, OpenRunLog(c, splits));
  train::TrainOptions options = TrainOptionsOf(c, splits, splits, nullptr);
  train::RunRecorder recorder(run);
  options.observers = {&recorder};
  ASSIGN_OR_RETURN(run.epochs, train::Fit(local->trainer(), train, test, options, std::cout));
  for (const auto& e : run.epochs) run.seconds += e.seconds;
  return run;
}

absl::Status FitPipeline(rpc::Agent& agent, const RunOptions& c, const std::vector<pipeline::StageSpec>& stages,
                         int splits, const data::Source& train, const data::Source& test, Run& run,
                         const Checkpointing* checkpoints, train::Elastic* elastic, bool traced) {
  ASSIGN_OR_RETURN(auto trainer, CreatePipeline(agent, c, stages, splits));
  if (run.log == nullptr) {
    ASSIGN_OR_RETURN(run.log, OpenRunLog(c, splits));
  }
  train::TrainOptions options = TrainOptionsOf(c, splits, splits * c.replicas, checkpoints);
  train::RunRecorder recorder(run);
  FitWatch watch(*trainer, run, elastic);
  options.observers = {&recorder, &watch};
  if (checkpoints != nullptr && checkpoints->resume) {
    const checkpoint::TrainingState from = checkpoints->resume->state();
    if (GoesOnAfterAFailure(run, from.step)) {
      const KeptSteps kept = KeepStepsUpTo(run, from.step, from.epoch);
      options.fit.gone_on = train::FitOptions::GoneOn{
          *run.last_step_end - std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                   std::chrono::duration<double>(kept.discarded_seconds)),
          kept.epoch_seconds_before, kept.epoch_images_before};
    }
  }
  if (c.data_on == "workers" && trainer->pipeline().replica(0).runs_on_workers()) {
    // Every replica's stage 0 worker reads its share of each batch.
    RETURN_IF_ERROR(
        trainer->ReadOnWorkers(SourceSpecOf(c, true), train.size(), SourceSpecOf(c, false), test.size()));
    std::printf("data: read on %s (the master sends row numbers)\n",
                absl::StrJoin(trainer->readers(), ", ").c_str());
  } else {
    std::printf("data: read on the master%s\n",
                c.data_on == "workers" ? " (a loss computed on the master needs the batches here)" : "");
  }
  run.schedule = trainer->pipeline().replica(0).schedule().name;
  trainer->StartTracing();  // (the first kTracedSteps steps: FitWatch stops it)
  const int64_t start = trace::NowUs();
  RETURN_IF_ERROR(train::Fit(*trainer, train, test, options, std::cout).status());  // (epochs merged as they end)
  RETURN_IF_ERROR(ReportMemory(trainer->pipeline(), c, run));
  // (The evaluations between epochs are on the workers' tracks too.)
  return CollectAndMeasure(*trainer, start, {}, traced, run);
}

namespace {

// The requests per batch between two counts `batches` batches apart, into
// the run and a line on the output.
void RecordMessages(const std::map<std::string, int64_t>& before, const std::map<std::string, int64_t>& after,
                    double batches, Run& run) {
  double total = 0;
  std::string line;
  for (const auto& [kind, d] : pipeline::MessagesBetween(before, after)) {
    run.messages_per_batch[kind] = d / batches;
    total += d / batches;
    absl::StrAppendFormat(&line, "%s%s %g", line.empty() ? "" : ", ", kind, d / batches);
  }
  std::printf("messages_per_batch=%g (%s)\n", total, line.c_str());
}

// A trainer's steps and saves (train::Fit's calls) passed on to `inner`,
// with the requests its saves and their commits send counted apart once
// `counting` is on, so that a batch's count leaves them out. Used on
// Fit's thread; borrows `inner`.
class SavesCountedApart final : public train::Trainer {
 public:
  explicit SavesCountedApart(train::PipelineTrainer& inner) : inner_(inner) {}

  train::StartedStep StartStep(const train::StepBatch& batch) override { return inner_.StartStep(batch); }
  absl::StatusOr<pipeline::Correct> CountCorrect(const at::Tensor& x, const at::Tensor& labels) override {
    return inner_.CountCorrect(x, labels);
  }
  absl::StatusOr<train::Saved> Save(const train::SaveTarget& target, const checkpoint::TrainingState& state,
                                    bool final) override {
    ASSIGN_OR_RETURN(auto before, Count());
    absl::StatusOr<train::Saved> saved = inner_.Save(target, state, final);
    RETURN_IF_ERROR(Apart(before));
    return saved;
  }
  absl::StatusOr<int64_t> Load(const checkpoint::Checkpoint& ck) override { return inner_.Load(ck); }
  absl::StatusOr<std::optional<train::Saved>> CommitSaved(bool wait) override {
    if (!inner_.save_pending()) return inner_.CommitSaved(wait);  // (nothing to send)
    ASSIGN_OR_RETURN(auto before, Count());
    absl::StatusOr<std::optional<train::Saved>> committed = inner_.CommitSaved(wait);
    RETURN_IF_ERROR(Apart(before));
    return committed;
  }

  train::PipelineTrainer& inner() { return inner_; }
  void set_counting(bool on) { counting_ = on; }
  // The requests sent by saves while counting, by kind.
  const std::map<std::string, int64_t>& saves() const { return saves_; }

 private:
  absl::StatusOr<std::map<std::string, int64_t>> Count() {
    if (!counting_) return std::map<std::string, int64_t>{};
    return inner_.pipeline().sent_messages();
  }
  absl::Status Apart(const std::map<std::string, int64_t>& before) {
    if (!counting_) return absl::OkStatus();
    ASSIGN_OR_RETURN(auto after, inner_.pipeline().sent_messages());
    for (const auto& [kind, n] : pipeline::MessagesBetween(before, after)) saves_[kind] += n;
    return absl::OkStatus();
  }

  train::PipelineTrainer& inner_;
  bool counting_ = false;
  std::map<std::string, int64_t> saves_;
};

// What the demo's run of batches does beside training them (train::Fit's
// batch run steps them): each batch's line and record (RecordBatch) with
// the time waited for batches to be made; the master's own trace slices
// ("take batch", "send", "wait", on the track after the workers'); the
// workers' tracing stopped after kTracedSteps batches; the elastic
// supervisor told of each batch; `after_batch` after each one (its time
// out of the batches' and the trace's); and the requests a batch sends,
// counted from the end of the first batch this call trains (its saves'
// left out). Used on Fit's thread; borrows all it is given.
class BatchWatch final : public train::FitObserver {
 public:
  BatchWatch(const RunOptions& c, SavesCountedApart& trainer, int first, bool traced, int64_t start,
             const std::function<void(int)>& after_batch, Run& run, train::Elastic* elastic)
      : c_(c),
        trainer_(trainer),
        pipe_(trainer.inner().pipeline()),
        first_(first),
        traced_(traced),
        start_(start),
        after_batch_(after_batch),
        run_(run),
        elastic_(elastic),
        count_messages_(c.batches - first > 1) {}

  bool Settles(int64_t step) const override {
    // (Messages are counted from the state after the first batch alone.)
    return static_cast<bool>(after_batch_) || (count_messages_ && step == first_ + 1);
  }
  void Spent(int64_t step, const char* phase, std::chrono::steady_clock::time_point begin,
             std::chrono::steady_clock::time_point end) override {
    const int64_t from = MicrosOf(begin), to = MicrosOf(end);
    if (std::string_view(phase) == "take batch") data_wait_ += (to - from) / 1e6;
    if (!traced_) return;
    const int64_t skipped = start_ + PausedBefore(paused_, from);  // (as CollectSlices)
    run_.slices.push_back({static_cast<int>(c_.workers.size()), phase, -1, from - skipped, to - skipped,
                           absl::StrCat("batch ", step - 1)});
  }
  absl::Status AfterStep(const train::StepRecord& s) override {
    const int b = static_cast<int>(s.step - 1);
    RecordBatch(run_, b, s.loss, s.seconds, s.rows);
    if (b + 1 - first_ == kTracedSteps) trainer_.inner().StopTracing();
    run_.last_step_end = std::chrono::steady_clock::now();
    run_.data_wait_seconds.push_back(data_wait_);
    data_wait_ = 0;
    if (elastic_ != nullptr) elastic_->StepDone(s.step);
    if (after_batch_) {
      const int64_t p0 = trace::NowUs();
      after_batch_(b);
      paused_.emplace_back(p0, trace::NowUs());
    }
    if (count_messages_ && b == first_) {
      ASSIGN_OR_RETURN(sent_before_, pipe_.sent_messages());
      trainer_.set_counting(true);
    }
    return absl::OkStatus();
  }

  // After the run: the requests a batch sent, its saves' left out, into
  // the run and a line.
  absl::Status CountMessages() {
    if (!count_messages_) return absl::OkStatus();
    ASSIGN_OR_RETURN(auto sent_after, pipe_.sent_messages());
    for (const auto& [kind, n] : trainer_.saves()) sent_after[kind] -= n;
    RecordMessages(sent_before_, sent_after, c_.batches - first_ - 1, run_);
    return absl::OkStatus();
  }
  // When after_batch ran (trace::NowUs's), for the trace.
  const std::vector<std::pair<int64_t, int64_t>>& paused() const { return paused_; }

 private:
  static int64_t MicrosOf(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
  }

  const RunOptions& c_;
  SavesCountedApart& trainer_;
  parallel::DataParallelPipeline& pipe_;
  const int first_;
  const bool traced_;
  const int64_t start_;
  const std::function<void(int)>& after_batch_;
  Run& run_;
  train::Elastic* const elastic_;
  const bool count_messages_;
  // Seconds waited for batches to be made since the last batch ended: a
  // wait for the next batch counts in the time of the one running then.
  double data_wait_ = 0;
  std::vector<std::pair<int64_t, int64_t>> paused_;
  std::map<std::string, int64_t> sent_before_;
};

}  // namespace

absl::Status TrainPipeline(rpc::Agent& agent, const RunOptions& c, const std::vector<pipeline::StageSpec>& stages,
                           int splits, bool traced, const std::function<void(int)>& after_batch, Run& run,
                           const Checkpointing* checkpoints, train::Elastic* elastic) {
  ASSIGN_OR_RETURN(auto trainer, CreatePipeline(agent, c, stages, splits));
  parallel::DataParallelPipeline& pipe = trainer->pipeline();
  if (run.log == nullptr) {
    ASSIGN_OR_RETURN(run.log, OpenRunLog(c, splits));
  }
  run.schedule = pipe.replica(0).schedule().name;
  auto [options, first] = StartBatchRun(c, checkpoints, run);
  if (options.resume) {
    // (Loaded before the trace starts.)
    RETURN_IF_ERROR(train::Resume(*trainer, *options.resume, checkpoints->identity, std::cout));
    options.resume_loaded = true;
  }
  // (A recovery goes on from an earlier batch: the later ones' times go,
  // and the time since the last one ended, the failure's, counts in the
  // run's; their times stay in it too.)
  if (GoesOnAfterAFailure(run, first)) {
    KeepStepsUpTo(run, first);
    run.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - *run.last_step_end).count();
  }
  trainer->StartTracing();  // (the first kTracedSteps batches)
  const int64_t start = trace::NowUs();
  SavesCountedApart counted(*trainer);
  BatchWatch watch(c, counted, first, traced, start, after_batch, run, elastic);
  options.observers = {&watch};
  const DemoBatches batches(c, first);  // made while the ones before are sent and run
  RETURN_IF_ERROR(train::Fit(counted, batches, *data::NoRows(), options, std::cout).status());
  RETURN_IF_ERROR(watch.CountMessages());
  RETURN_IF_ERROR(ReportMemory(pipe, c, run));
  return CollectAndMeasure(*trainer, start, watch.paused(), traced, run);
}

absl::Status TrainElastic(rpc::Agent& agent, const RunOptions& c, const std::vector<pipeline::StageSpec>& stages,
                          const Checkpointing& checkpoints, Run& run, const Attempt& attempt) {
  train::ElasticOptions o;
  o.max_restarts = c.max_restarts;
  o.rejoin_timeout = absl::Seconds(c.rejoin_timeout);
  o.spares = c.spares;
  o.checkpoint_dir = c.checkpoint_dir;
  o.resumed_from = checkpoints.resume;  // (a --resume cut again is in its own directory)
  o.deterministic = c.deterministic;  // (the first workers were switched when they joined)
  train::Elastic elastic(agent, o, run.log);
  std::vector<std::string> workers = c.all_workers;
  bool first = true;
  RETURN_IF_ERROR(elastic.Supervise(
      workers, std::nullopt, std::cout,
      [&](const std::vector<std::string>& ws, const std::optional<checkpoint::Checkpoint>& from) -> absl::Status {
        RunOptions now = c;  // over the workers of this attempt
        now.all_workers = ws;
        now.workers.assign(ws.begin(), ws.begin() + static_cast<std::ptrdiff_t>(c.workers.size()));
        Checkpointing ck = checkpoints;
        if (!first) {  // a recovery: from the latest checkpoint, cut as it was saved
          ck.resume = from;
          ASSIGN_OR_RETURN(ck.stages, checkpoint::LoadStageSpecs(*from));
        }
        std::vector<pipeline::StageSpec> cut = first ? stages : ck.stages;
        for (pipeline::StageSpec& s : cut) {  // (a run's settings: no checkpoint has them)
          s.recompute = c.recompute;
          s.bf16 = c.precision == "bf16";
        }
        first = false;
        return attempt(now, ck, cut, &elastic);
      }));
  run.recoveries = elastic.recoveries();
  for (const train::Recovery& r : run.recoveries) {
    const std::string by =
        r.replacement == r.lost ? "back under its name" : absl::StrCat("replaced by '", r.replacement, "'");
    std::printf("elastic: '%s' lost after step %lld, %s; went on from step %lld (%lld trained again; the failure "
                "was seen %.2f s after step %lld ended, the next step done %.2f s after that)\n",
                r.lost.c_str(), static_cast<long long>(r.failed_at), by.c_str(),
                static_cast<long long>(r.restored_step), static_cast<long long>(r.steps_redone()),
                r.seconds_to_detect, static_cast<long long>(r.failed_at), r.seconds_lost);
  }
  return absl::OkStatus();
}

absl::StatusOr<Run> TrainOverPipeline(rpc::Agent& agent, const RunOptions& c,
                                      const std::vector<pipeline::StageSpec>& stages, int splits, const Sets& sets,
                                      bool traced, const std::function<void(int)>& after_batch,
                                      const Checkpointing& checkpoints) {
  Run run(splits);
  ASSIGN_OR_RETURN(run.log, OpenRunLog(c, splits));
  RETURN_IF_ERROR(TrainElastic(agent, c, stages, checkpoints, run,
                               [&](const RunOptions& now, const Checkpointing& ck,
                                   const std::vector<pipeline::StageSpec>& cut, train::Elastic* elastic) {
                                 return c.dataset.empty() ? TrainPipeline(agent, now, cut, splits, traced, after_batch,
                                                                          run, &ck, elastic)
                                                          : FitPipeline(agent, now, cut, splits, *sets.train,
                                                                        *sets.test, run, &ck, elastic, traced);
                               }));
  return run;
}

}  // namespace remora::master
