// The master program's training runs (master::, behind master/run.h's
// RunMaster): the ResNet50 demo, TorchScript stages (--model) and datasets
// (--dataset), as a pipeline over workers or in this process (--local),
// with their figures and reports. master/flags.h turns the
// command line into these options.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "checkpoint/checkpoint.h"
#include "base/status_util.h"
#include "pipeline/microbatch.h"
#include "pipeline/stage.h"
#include "data/datasets.h"
#include "data/source.h"
#include "optim/distributed_optimizer.h"
#include "parallel/data_parallel.h"
#include "pipeline/partition.h"
#include "pipeline/pipeline.h"
#include "rpc/agent.h"
#include "train/elastic.h"
#include "train/events.h"
#include "train/fit.h"
#include "train/local_trainer.h"
#include "train/report.h"

namespace remora::master {

// LibTorch 1.13 runs a CPU convolution with a 1x1 kernel and
// stride 1 through oneDNN only when the batch has at least this many rows
// or the process more than one intra-op thread; a one-thread worker falls
// back to a slower path below it (measured on ResNet50: 8 micro-batches
// of 15 rows took 1.23x the time of one batch of 120 rows on one thread,
// 8 of 16 rows 0.98x that of 128).
inline constexpr int kOneDnnRows = 16;

constexpr int64_t kClasses = 1000;

struct RunOptions {
  // One replica's pipeline workers (the first P of --workers); all_workers:
  // every worker, replica by replica (--replicas R: P x R).
  std::vector<std::string> workers;
  std::vector<std::string> all_workers;
  int replicas = 1;
  int bucket_mb = 25;
  bool overlap = true;
  int collective_timeout = 10;  // seconds
  int zero = 0;  // ZeRO stage with --replicas: 0 or 1
  std::string listen;
  std::vector<int> splits;
  int batches = 3;
  int batch_size = 128;  // 16 rows per micro-batch at --splits 8 (kOneDnnRows)
  int image_size = 128;
  double lr = 0.05;
  int seed = 0;
  std::string partition = "balanced";
  std::vector<int> split_at;  // explicit cuts (--split-at): first layer of stages 1, 2, ...
  int interleave = 0;  // stages per worker; 0: 2 with balanced, 1 with tutorial
  std::string schedule = "auto";  // pipeline/schedule.h
  // --schedule auto given, --splits auto: the planner (pipeline/planner.h)
  // picks the schedule and the micro-batch count from the layers' measured
  // costs (PlanRun), and its prediction is printed beside the measured step.
  bool plan_schedule = false;
  bool plan_splits = false;
  double planned_step_ms = 0;  // set by PlanRun
  int threads = 0;  // --local's and --compare-local's training
  // --threads not given: --local and --compare-local on a CPU time a few
  // steps at each thread count first and train with the fastest
  // (FastestLocalThreads); `threads` is then the choice.
  bool threads_auto = false;
  // This process's intra-op threads while workers train: 1 (it slices
  // batches and waits; more would spin beside the workers on their cores)
  // unless --threads is given outside --compare-local; --threads with
  // --mode ps (the master steps the model).
  int coordinator_threads = 1;
  bool local = false;
  bool compare_local = false;
  // --deterministic: reproducible kernels here and on every worker
  // (runtime::UseDeterministicAlgorithms).
  bool deterministic = false;
  // --recompute: each stage's training forward keeps only its input and
  // runs again in the backward pass (pipeline::StageSpec::recompute).
  bool recompute = false;
  // --precision fp32|bf16: bf16 autocast in every stage, activations and
  // their gradients bf16 between stages (pipeline::StageSpec::bf16).
  std::string precision = "fp32";
  std::string report, trace, timeline;
  // --tensorboard DIR: the scalars as TensorBoard event files; --curves
  // FILE.svg: the loss and accuracy curves drawn at the end.
  std::string tensorboard, curves;
  int connect_timeout = 60;
  int busy_poll_us = 0;  // --busy-poll-us: the master's rpc::AgentOptions::busy_poll
  std::string device = "cpu";  // --local and --compare-local train here
  // --model: TorchScript stages trained on random data of this shape.
  std::string model;
  std::vector<int64_t> input_shape = {3, 32, 32};
  bool input_shape_given = false;  // by --input-shape
  int classes = 10;
  std::vector<pipeline::StageSpec> scripts;  // read from --model
  // --model is one file of a sequential model, cut into stages over the
  // workers (pipeline/partition.h): the model, loaded once (scripts holds
  // its file's bytes too).
  std::shared_ptr<const pipeline::SequentialModel> sequential;
  // --dataset: epochs over a real dataset, the test accuracy after each.
  std::string dataset;     // fashion-mnist, idx:DIR, cifar10:DIR, imagefolder:DIR or text:PATH
  // --dataset text:PATH: the built-in GPT (shards/gpt.h) over byte tokens
  // (vocabulary 256) or a SentencePiece model's (--tokenizer FILE),
  // windows of seq_len tokens.
  std::string tokenizer;
  int layers = 4;
  int d_model = 128;
  int heads = 4;
  int seq_len = 64;
  // --tie-embeddings: the GPT's head is its token embedding's weight (one
  // parameter in one process; over workers a copy on each end, their
  // gradients summed each step: pipeline::PipelineOptions::tied_first).
  bool tie_embeddings = true;
  // A device's peak TFLOP/s for the model FLOPs utilisation of a GPT run
  // (--peak-tflops; 0: not given, none printed).
  double peak_tflops = 0;
  // Where batches are read: "workers" (each replica's stage 0 worker reads
  // its rows itself; the master sends only row indices) or "master" (the
  // master reads them and sends the tensors).
  std::string data_on = "workers";
  // An image folder's reading: decoding threads, batches read ahead,
  // unreadable files left out (counted) instead of failing the batch.
  int data_threads = 4;
  int prefetch = 2;
  bool skip_bad_images = false;
  // An image folder without val/: the fraction of its training images held
  // out as the test set (0: none, and no test accuracy).
  double val_fraction = 0;
  int epochs = 3;
  int eval_every = 0;  // --eval-every: steps between evaluations within an epoch (0: none)
  bool shuffle = true;
  std::string optimizer = "sgd";  // or adam, adamw
  double weight_decay = 0.1;       // AdamW's decoupled weight decay (--weight-decay)
  bool decay_all = false;          // --decay-all: biases and norm weights decay too
  double clip_grad_norm = 0;       // --clip-grad-norm: the whole model's gradient norm at most this (0: off)
  double momentum = 0.9;          // SGD's, with --dataset and --model
  // The learning rate by step (optim/lr_schedule.h): --lr-schedule
  // constant, cosine or linear after --warmup-steps, down to --min-lr
  // (below 0: lr / 10) at --decay-steps (0: the run's last step, set by
  // SetDecaySteps once the data is known).
  std::string lr_schedule = "constant";
  int warmup_steps = 0;
  double min_lr = -1;
  int decay_steps = 0;
  int train_rows = 0;             // --dataset: the first N training images (0: all)
  // Checkpoints (checkpoint/checkpoint.h): where, how often (steps; 0:
  // only at the end), how many kept; --resume: the directory to go on from.
  std::string checkpoint_dir;
  int checkpoint_every = 0;
  int keep = 3;
  std::string resume;
  // Pipelines' checkpoints: the step waits only for the copies, the files
  // are written in the background (--checkpoint-background).
  bool checkpoint_background = true;
  // Elastic recovery (train/elastic.h): failures recovered from (0: none),
  // how long to wait for a lost worker to register again (seconds), and
  // the workers standing by to take a lost one's place.
  int max_restarts = 0;
  int rejoin_timeout = 60;
  std::vector<std::string> spares;
};

// A run's checkpoints: what they record of the run and the checkpoint it
// resumes from (--resume), with the stages that was saved from. Read by
// the training loop's thread.
struct Checkpointing {
  checkpoint::RunIdentity identity;
  std::optional<checkpoint::Checkpoint> resume;
  std::vector<pipeline::StageSpec> stages;  // resume's
  // Resumed under another cut than the checkpoint's (other workers,
  // --interleave or --split-at): the model is cut as the flags say, and
  // the checkpoint is written again for that cut (checkpoint::Relayout)
  // before it is loaded.
  bool relayout = false;

  // Where the run saves (--checkpoint-dir, --keep; none when empty).
  train::SaveTarget Target(const RunOptions& c) const {
    return {c.checkpoint_dir, c.keep, identity, c.checkpoint_background};
  }
};

// The run's identity, as checkpoints record it.
checkpoint::RunIdentity IdentityOf(const RunOptions& c, int splits);

// A run's record (train/report.h): its batches or epochs, memory,
// messages, timeline slices and log.
using Run = train::RunRecord;

// The run's log (train/report.h), its events in --tensorboard's DIR
// (DIR/splits-N when --splits sweeps); an error when DIR cannot be made.
absl::StatusOr<std::shared_ptr<train::RunLog>> OpenRunLog(const RunOptions& c, int splits);

// Batch b of the ResNet50 demo or --model runs: the same in every mode;
// an error naming the batch when it cannot be made (out of memory).
absl::StatusOr<std::pair<at::Tensor, at::Tensor>> MakeBatch(const RunOptions& c, int b);

// Fills each row of `t` (its dimension 0) with standard normals from a
// generator of the row's own, seeded from `batch_seed` and the row, on
// `threads` threads (rows split evenly): the same values whatever the
// number of threads. (LibTorch draws one generator's numbers serially:
// the demo's 25 MB of them a batch at 128x128 took 25-40 ms of one core.)
// MakeBatch draws its inputs so, on a thread per 1M numbers, at most 8.
void FillNormalRows(at::Tensor& t, uint64_t batch_seed, int threads);

// Batches [first, end) of MakeBatch, made at most `ahead` before they are
// taken, on a thread of its own, so that a pipeline's master sends one
// batch while the next are made. A step faster than making a batch would
// be held to its pace: the first time Take waits for a batch after the
// first, another maker thread starts, up to `max_makers`. The batches are
// MakeBatch's, whichever thread made them.
//
// Thread-safety: Take is called from one thread, in order; the maker
// threads are this object's, joined by the destructor. `c` (or what `make`
// uses) must outlive it.
class BatchesAhead {
 public:
  using MakeFn = std::function<absl::StatusOr<std::pair<at::Tensor, at::Tensor>>(int b)>;

  // MakeBatch(c, b) for each batch.
  BatchesAhead(const RunOptions& c, int first, int end, int ahead = 2, int max_makers = 2);
  // `make(b)` for each batch, on the maker threads (tests).
  BatchesAhead(MakeFn make, int first, int end, int ahead = 2, int max_makers = 2);
  ~BatchesAhead();
  BatchesAhead(const BatchesAhead&) = delete;
  BatchesAhead& operator=(const BatchesAhead&) = delete;

  // Batch b: the next one not taken yet (blocks until it is made), or why
  // it or one before it could not be made (out of memory).
  absl::StatusOr<std::pair<at::Tensor, at::Tensor>> Take(int b);

  // Maker threads started so far; from the taker's thread only.
  int makers() const { return static_cast<int>(makers_.size()); }

 private:
  void Make();  // a maker thread: the next batch not claimed, while there is room

  const MakeFn make_;
  const int first_;       // the first batch (the one Take always waits for)
  const int end_;
  const int ahead_;       // batches made or being made and not taken, at most
  const int max_makers_;  // maker threads, at most
  absl::Mutex mu_;
  std::map<int, std::pair<at::Tensor, at::Tensor>> made_ ABSL_GUARDED_BY(mu_);  // by batch
  int next_taken_ ABSL_GUARDED_BY(mu_);  // the batch Take returns next
  int next_made_ ABSL_GUARDED_BY(mu_);   // the batch the next free maker makes
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);  // why batch failed_at_ was not made
  int failed_at_ ABSL_GUARDED_BY(mu_) = 0;
  // Started by the constructor and by Take, joined by the destructor: the
  // taker's thread alone touches it. Last: started once the fields above
  // are.
  std::vector<std::thread> makers_;
};
// The demo's (or a --model run's) c.batches batches of MakeBatch as a
// training set for train::Fit's batch runs (FitOptions::batch_run): batch
// b is rows [b * c.batch_size, (b + 1) * c.batch_size), made ahead from
// batch `first` (BatchesAhead).
//
// Thread-safety: Get is to be asked for whole batches in order from
// `first` (Fit's way with prefetch 0); another row range is an error
// naming it. `c` must outlive it.
class DemoBatches final : public data::Source {
 public:
  DemoBatches(const RunOptions& c, int first);

  int64_t size() const override { return batches_ * batch_size_; }
  absl::StatusOr<data::Batch> Get(const at::Tensor& rows, int epoch) const override;

 private:
  const int64_t batch_size_;
  const int64_t batches_;
  mutable absl::Mutex mu_;
  // (Made ahead while Fit waits for steps; Get takes them.)
  mutable BatchesAhead ahead_ ABSL_GUARDED_BY(mu_);
};
// The demo's run of batches as train::Fit's batch run (FitOptions::
// batch_run): c's batch size, `checkpoints`' target, cadence and resume
// (null: none). A resumed run keeps the checkpoint's losses in `run` and
// goes on at batch `first`; the caller loads the checkpoint or leaves it
// to Fit.
struct BatchRunStart {
  train::TrainOptions options;
  int first = 0;  // the next batch
};
BatchRunStart StartBatchRun(const RunOptions& c, const Checkpointing* checkpoints, Run& run);
pipeline::LossFn Loss(const RunOptions& c);
void PrintBatch(int b, double loss, double seconds);
// Batch b's loss and time: into `run`, its log, and a line on the output.
void RecordBatch(Run& run, int b, double loss, double seconds, int64_t rows);

// Training in this process alone (--local, --compare-local): the run's
// whole model (WholeModelStages) in a train::LocalTrainer, with the demo's
// batches and their records. Not thread-safe.
class LocalRun {
 public:
  static absl::StatusOr<std::unique_ptr<LocalRun>> Create(const RunOptions& c, int splits);

  // Trains batch b of the demo or --model run and prints its line (after
  // `prefix`).
  absl::Status Step(int b, const char* prefix = "");
  train::LocalTrainer& trainer() { return *trainer_; }
  Run& run() { return run_; }

 private:
  LocalRun(const RunOptions& c, int splits, std::unique_ptr<train::LocalTrainer> trainer);

  const RunOptions& c_;
  Run run_;
  std::unique_ptr<train::LocalTrainer> trainer_;
  const int64_t start_;
};

// How --local's threads were chosen: each count timed, and the fastest.
struct ThreadChoice {
  struct Timed {
    int threads = 0;
    double seconds = 0;  // the median timed step, or the warm step where that alone decided
    bool warm_only = false;
  };
  int threads = 1;
  std::vector<Timed> timed;  // in the order tried
  double probe_seconds = 0;  // the whole measurement
  int64_t rows = 0;          // the rows of each step timed
  // "1 thread (the fastest here: 1 thread 0.212 s a step, 2 threads 0.530 s)"
  std::string Describe() const;
};

// The thread count that trains the run's whole model fastest in this
// process on this machine, measured: the machine's cores, then halved down
// to 1 (the counts 1, 2, 4, ... up to the cores), each on a throwaway
// trainer at `splits` and the same batch (`x`, `y`; only its first 32
// rows, or 2 per micro-batch, where a cold step on those takes 0.25 s or
// more: a large model's operations share alike at either size, and its
// whole batch may take seconds a step). One cold step, then a warm step
// at each count (a count whose warm step takes 1.5x the fastest's and
// 0.2 s more is ruled out), then the counts left in turn for at least a
// second (at most 25 rounds), the lowest median chosen: a step each, or,
// where a warm step takes under 50 ms, blocks of four after an untimed
// step at the new count (a team just resized or woken costs a short step
// a good part of its time, which a run at one count pays once). LibTorch's
// intra-op pool and OpenBLAS's are set together
// (runtime::SetComputeThreads), so neither oversubscribes the other; the
// process is left at the choice. The run's own model and generators are
// untouched except the global generator, which the caller seeds again.
absl::StatusOr<ThreadChoice> FastestLocalThreads(const RunOptions& c, int splits, const at::Tensor& x,
                                                 const at::Tensor& y);

// The model whole, as one process trains it (--local, --mode ps):
// --model's stages, the small CNN (--dataset), or ResNet50.
std::vector<pipeline::StageSpec> WholeModelStages(const RunOptions& c);

absl::StatusOr<Run> TrainLocal(const RunOptions& c, int splits);

// The optimizer of a run: SGD with --momentum (the demo: none) or Adam.
optim::OptimizerOptions OptimizerOf(const RunOptions& c);
// Its schedule as the console and checkpoints name it ("cosine
// warmup-steps=100 min-lr=6e-05 decay-steps=5000"; "" when constant).
std::string DescribeSchedule(const optim::OptimizerOptions& o);
// Rows each part of a batch (a micro-batch, a replica's or a worker's
// share) needs in training: 2 where the model normalises by batch
// statistics (ResNet50; a --model with a BatchNorm's running_mean buffer:
// one row has no variance to normalise by), else 1.
int64_t RowsPerPart(const RunOptions& c);
// The train/ loop's options of a --dataset run at `splits`, whose batches
// are cut into `parts` (a last batch too small for RowsPerPart rows in each
// is dropped), with the run's checkpoints (when given).
train::TrainOptions TrainOptionsOf(const RunOptions& c, int splits, int64_t parts,
                                   const Checkpointing* checkpoints);

// --dataset's sets as the runs read them: in memory (fashion-mnist, idx:,
// cifar10:) or from an image folder's files as batches need them
// (imagefolder:DIR: DIR/train or DIR itself, and DIR/val or the
// --val-fraction held out, at --image-size). Not movable:
// the sources refer to the sets held here.
struct Sets {
  Sets() = default;
  Sets(const Sets&) = delete;
  Sets& operator=(const Sets&) = delete;
  data::Dataset train_set, test_set;  // in memory (none for an image folder)
  std::unique_ptr<data::Source> train, test;  // test: no rows where there is none
  std::string no_test;                         // why there is no test set (empty: there is one)
  int64_t classes = 0;                         // an image folder's (0: not counted here)
  // An image folder's files that are not images (not read), and a few.
  int64_t unlisted = 0;
  std::vector<std::string> unlisted_examples;
  std::vector<int64_t> shape;  // one image's, [C, H, W] (text: [T], a window's tokens)
  std::string text;            // a text corpus's description (empty: images)
  std::string Describe() const;
};
// `resuming`: the run goes on from a checkpoint, whose directory keeps the
// image folder's listing of the run that saved it (read, so that the rows
// are the same files); a fresh run lists the folder again.
absl::StatusOr<std::unique_ptr<Sets>> LoadDataset(const RunOptions& c, bool resuming);
// --dataset's training or test split as a worker opens it (--data-on
// workers: pipeline/worker_data.h).
data::SourceSpec SourceSpecOf(const RunOptions& c, bool train);
// --dataset imagefolder:DIR; and whether the run trains the small CNN
// (--dataset in memory without --model; an image folder without --model
// trains ResNet50).
bool ReadsImageFolder(const RunOptions& c);
bool TrainsSmallCnn(const RunOptions& c);
// --dataset text:PATH; and whether the run trains the built-in GPT (text
// without --model).
bool ReadsText(const RunOptions& c);
bool TrainsGpt(const RunOptions& c);
// The text's vocabulary: 256 (bytes), or --tokenizer's (read once).
absl::StatusOr<int64_t> TextVocabOf(const RunOptions& c);
// Parts [first, last) of the built-in GPT as one stage ("Gpt"); the
// partitioner cuts its parts (embedding, --layers blocks, head) by their
// measured cost, as ResNet50's blocks (PartitionStages).
pipeline::StageSpec GptPart(const RunOptions& c, int64_t first, int64_t last);
// Where a text run's tokens are written once and read after: beside the
// checkpoints (--checkpoint-dir), else in the temporary directory, named
// after the text's absolute path.
std::string TokenCacheOf(const RunOptions& c);
// A GPT run's tokens a row (--seq-len; 0 for other runs) and training
// FLOPs a token (shards::GptTrainFlopsPerToken; 0 for other runs).
int64_t TokensPerRow(const RunOptions& c);
double TrainFlopsPerToken(const RunOptions& c);
// The small CNN's blocks split into one contiguous stage per worker.
std::vector<pipeline::StageSpec> SmallCnnStages(const RunOptions& c);
// Epochs over the dataset, in this process or as a pipeline of `stages`;
// `traced`: where each step spent its time goes into the run's slices
// (--trace, --timeline).
absl::StatusOr<Run> FitLocal(const RunOptions& c, int splits, const data::Source& train, const data::Source& test,
                             bool traced = false);
// Into `run` (its log opened when not yet); each step is reported to
// `elastic` when set.
absl::Status FitPipeline(rpc::Agent& agent, const RunOptions& c, const std::vector<pipeline::StageSpec>& stages,
                         int splits, const data::Source& train, const data::Source& test, Run& run,
                         const Checkpointing* checkpoints = nullptr, train::Elastic* elastic = nullptr,
                         bool traced = false);
// ResNet50's stage boundaries (block indices) for the workers.
// The split points of --split-at, or of --partition tutorial.
std::vector<int> SplitPoints(const RunOptions& c);
// Stages per worker for cutting `num_layers` layers: --interleave, else as
// many as the split points make, else 2 where every stage gets a layer;
// an error when the split points or the counts do not fit.
absl::StatusOr<int> StagesPerWorker(const RunOptions& c, int num_layers);
// The layers PartitionStages cuts at: a one-file --model's children, the
// GPT's parts (embedding, blocks, head) or ResNet50's blocks.
int LayersToCut(const RunOptions& c);
// --schedule auto and --splits auto: times every layer of the model to cut
// at two micro-batch sizes and a boundary crossing, predicts each schedule
// and micro-batch count (pipeline::MakePlan), prints the table and sets
// `c`'s schedule, splits, stages per worker and cut to the fastest. OK and
// nothing done when neither is asked for.
absl::Status PlanRun(rpc::Agent& agent, RunOptions& c, int64_t batch_rows);
// The stages of the ResNet50 demo, of the GPT or of a sequential --model,
// cut by --partition / --split-at / --interleave and printed.
absl::StatusOr<std::vector<pipeline::StageSpec>> PartitionStages(rpc::Agent& agent, const RunOptions& c);
// The demo's (or a --model run's) c.batches batches over the workers, as
// train::Fit's batch run of DemoBatches: `after_batch` (if set) runs
// after each batch, outside its timing. Into `run`, as FitPipeline.
absl::Status TrainPipeline(rpc::Agent& agent, const RunOptions& c, const std::vector<pipeline::StageSpec>& stages,
                           int splits, bool traced, const std::function<void(int)>& after_batch, Run& run,
                           const Checkpointing* checkpoints = nullptr, train::Elastic* elastic = nullptr);
// One attempt of an elastic run: over the workers of `now`, from `ck`
// (its resume set after a recovery), with the stages `cut`; each step is
// told to `elastic`.
using Attempt = std::function<absl::Status(const RunOptions& now, const Checkpointing& ck,
                                           const std::vector<pipeline::StageSpec>& cut, train::Elastic* elastic)>;
// Runs `attempt` over c.all_workers with `stages`, and with --max-restarts
// again after each recovery (train/elastic.h), from the latest checkpoint
// over the workers that replaced the lost ones, the stages cut as that
// checkpoint was saved; each recovery is a line on the output, an entry in
// run.recoveries and run/recoveries in run.log (open it first).
absl::Status TrainElastic(rpc::Agent& agent, const RunOptions& c, const std::vector<pipeline::StageSpec>& stages,
                          const Checkpointing& checkpoints, Run& run, const Attempt& attempt);
// Appends the epochs a Fit returned to run.epochs, replacing those from
// the first of them on (an attempt after a recovery goes on inside an
// epoch), and sums run.seconds over them.
void MergeEpochs(Run& run, const std::vector<train::EpochResult>& epochs);
// Whether this run goes on from step `from` after a failure in this
// process (an elastic recovery: it trained before); else (its first
// attempt) notes that it begins after `from` (run.first_step).
bool GoesOnAfterAFailure(Run& run, int64_t from);
// Keeps the times of the steps up to `from` (the ones after it are
// trained again); returns the seconds and images of the kept steps of
// `epoch` (from 1: the epoch `from` is in; those this process trained;
// 0: none) and the seconds of the dropped.
struct KeptSteps {
  double epoch_seconds_before = 0;
  int64_t epoch_images_before = 0;
  double discarded_seconds = 0;
};
KeptSteps KeepStepsUpTo(Run& run, int64_t from, int epoch = 0);
// One split count's pipeline run over the workers: TrainPipeline, or
// FitPipeline with --dataset; with --max-restarts, recovered from the
// latest checkpoint when a worker is lost (train/elastic.h), a line on the
// output and an entry in the run's record for each recovery.
absl::StatusOr<Run> TrainOverPipeline(rpc::Agent& agent, const RunOptions& c,
                                      const std::vector<pipeline::StageSpec>& stages, int splits, const Sets& sets,
                                      bool traced, const std::function<void(int)>& after_batch,
                                      const Checkpointing& checkpoints);
// Fills run.stage_memory from every replica of `pipe` and prints
// "  [replica R, ]stage K on W: peak saved activations X MiB" per stage,
// then each replica's optimizer state.
absl::Status ReportMemory(parallel::DataParallelPipeline& pipe, const RunOptions& c, Run& run);
// Images a second of run `r`, "%.2f", or "-" when it trained nothing.
std::string ImagesPerSecond(const Run& r);
void PrintSummary(const std::vector<Run>& runs, const RunOptions& c);
// --report: the runs as JSON (train::WriteReport), mode "local", "ps" or
// "pipeline".
absl::Status WriteReport(const std::string& path, bool local, const std::vector<Run>& runs, const RunOptions& c);

}  // namespace remora::master
