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
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <filesystem>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "autograd/dist_autograd.h"
#include "launch/cli.h"
#include "examples/timeline.h"
#include "optim/distributed_optimizer.h"
#include "pipeline/microbatch.h"
#include "parallel/process_group.h"
#include "pipeline/partition.h"
#include "pipeline/pipeline.h"
#include "pipeline/stage.h"
#include "channel/devices.h"
#include "base/status_util.h"
#include "runtime/allocator.h"
#include "runtime/threads.h"
#include "runtime/trace.h"
#include "examples/builtins.h"
#include "examples/master_runs.h"
#include "examples/ps_runs.h"
#include "models/cnn.h"
#include "models/resnet.h"

namespace remora {
namespace {

using namespace master;  // NOLINT: the program and its runs

std::vector<int> ParseSplits(const std::string& text, std::string* error) {
  std::vector<int> out;
  for (const auto& part : cli::SplitList(text)) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1) {
      *error = absl::StrCat("--splits wants positive integers like 8 or 1,2,4,8; got '", text, "'");
      return {};
    }
    out.push_back(v);
  }
  if (out.empty()) *error = "--splits is empty";
  return out;
}

int Main(int argc, char** argv) {
  Config c;
  std::string workers, splits;
  c.listen = cli::MasterAddressFromEnv();
  c.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cli::FlagParser flags("master",
                        "Trains ResNet50 as a pipeline over worker processes and reports the "
                        "speedup of each split count.\nStart the workers first: "
                        "worker --name worker1 (see worker --help).");
  flags.AddString("workers", &workers,
                  "comma-separated worker names (required unless --local): one pipeline over "
                  "them, or with --replicas R, R pipelines of P = n / R workers each, replica r on "
                  "workers r*P .. r*P + P - 1");
  std::string mode = "pipeline";
  flags.AddString("mode", &mode,
                  "pipeline (the model cut into stages over the workers) or ps (a parameter server: "
                  "the master, or --ps-shards servers, hold the model and optimizer; every step each worker pulls the "
                  "parameters and pushes the gradient of its share of the batch; see "
                  "docs/parameter-server.md)");
  PsFlags ps_flags;
  flags.AddInt("ps-shards", &ps_flags.shards,
               "with --mode ps: K server processes holding a partition of the parameters and its "
               "optimizer each: the first K --workers (0 or 1: the master holds them)");
  flags.AddInt("backup-workers", &ps_flags.backup_workers,
               "with --mode ps: k; each step goes on with the first n - k gradient sets and drops "
               "the stragglers' (0: synchronous, equal to one process on the whole batch)");
  flags.AddInt("replicas", &c.replicas,
               "data parallelism: copies of the pipeline, each training its share of every "
               "batch, gradients summed per stage over c10d's Gloo (1: none)");
  int pipeline_stages = 0;
  flags.AddInt("pipeline-stages", &pipeline_stages,
               "workers per pipeline, P (0: --workers / --replicas); P x --replicas must be the "
               "worker count");
  flags.AddInt("bucket-mb", &c.bucket_mb, "with --replicas: MiB of gradients summed per bucket");
  flags.AddBool("overlap", &c.overlap,
                "with --replicas: start summing a stage's gradients as its last backward pass "
                "ends, beside the other backward passes (false: after all of them)");
  flags.AddInt("zero", &c.zero,
               "with --replicas: 1 shards the optimizer state over each stage's replicas "
               "(ZeRO-1: each steps its share and sends it to the others); 0: every replica "
               "holds all of it");
  flags.AddInt("collective-timeout", &c.collective_timeout,
               "with --replicas: seconds a replica waits for the others in a collective before "
               "the step fails");
  flags.AddString("listen", &c.listen, "HOST:PORT where workers find the master (MASTER_ADDR/MASTER_PORT also work)");
  flags.AddString("splits", &splits, "micro-batches per batch: one count (8) or a sweep (1,2,4,8)");
  flags.AddInt("batches", &c.batches, "batches per split count");
  int batch_size = -1;
  flags.AddInt("batch-size", &batch_size, "images per batch (default 128; 64 with --dataset)");
  flags.AddInt("image-size", &c.image_size, "image height and width");
  double lr = -1;
  flags.AddDouble("lr", &lr, "learning rate (default 0.05 for the ResNet50 demo, 0.01 with --model or --dataset)");
  flags.AddInt("seed", &c.seed, "seed of weights and data: same seed, same numbers");
  flags.AddString("partition", &c.partition,
                  "how ResNet50 or a one-file sequential --model is cut into stages: balanced (by "
                  "each layer's forward + backward time, measured on the workers) or tutorial "
                  "(ResNet50 in two, torchvision's split)");
  std::string split_at;
  flags.AddString("split-at", &split_at,
                  "explicit cuts instead of --partition: the first layer of stages 1, 2, ... "
                  "(e.g. 8 or 5,9,14; workers x --interleave stages)");
  flags.AddInt("interleave", &c.interleave,
               "stages per worker: with 2, worker k of n also hosts stage k + n, which halves "
               "the pipeline's fill and drain (0: 2 with --partition balanced when every stage "
               "gets a layer, else 1)");
  flags.AddString("schedule", &c.schedule,
                  "gpipe, 1f1b (one stage per worker), interleaved (several stages per worker) "
                  "or auto: interleaved with several stages per worker, else 1f1b");
  flags.AddInt("threads", &c.threads, "intra-op threads of this process (used by --local)");
  flags.AddBool("local", &c.local, "train in this process alone, no workers");
  flags.AddBool("compare-local", &c.compare_local,
                "also train --local --splits 1 in this process, batch by batch between the last "
                "split count's batches, and print the ratio");
  flags.AddString("report", &c.report, "write a JSON report to this file");
  flags.AddString("trace", &c.trace, "write a Chrome/Perfetto trace of the last split count");
  flags.AddString("timeline", &c.timeline, "write an SVG Gantt chart of the last split count");
  flags.AddInt("connect-timeout", &c.connect_timeout, "seconds to wait for all workers to register");
  flags.AddString("device", &c.device,
                  "where --local and --compare-local train: cpu or cuda:N (workers choose their "
                  "own with worker --device)");
  std::string input_shape = "3,32,32";
  flags.AddString("model", &c.model,
                  "train TorchScript instead of ResNet50: a directory holding stage0.pt, "
                  "stage1.pt, ... or a comma-separated list of .pt files (stage k runs on worker "
                  "k mod n), or one .pt file of a scripted nn.Sequential, cut into stages over the "
                  "workers by --partition or --split-at; random inputs of --input-shape, labels in "
                  "[0, --classes), cross-entropy");
  flags.AddString("input-shape", &input_shape, "with --model: one input's shape, e.g. 3,32,32 or 784");
  flags.AddInt("classes", &c.classes, "with --model: the number of classes of the labels");
  flags.AddString("dataset", &c.dataset,
                  "train on a real dataset for --epochs and print the test accuracy after each: "
                  "fashion-mnist (Debian's dataset-fashion-mnist), idx:DIR (MNIST-format IDX "
                  "files) or cifar10:DIR (CIFAR-10's binary version); the model is a small CNN "
                  "over the workers (1 to 4), or the --model stages; cross-entropy");
  flags.AddInt("epochs", &c.epochs, "with --dataset: epochs to train");
  flags.AddBool("shuffle", &c.shuffle, "with --dataset: shuffle each epoch by --seed (false: file order)");
  flags.AddString("optimizer", &c.optimizer, "sgd or adam (the ResNet50 demo: plain SGD)");
  flags.AddDouble("momentum", &c.momentum, "SGD momentum with --model or --dataset");
  flags.AddInt("train-rows", &c.train_rows, "with --dataset: train on the first N images only (0: all)");
  flags.AddString("checkpoint-dir", &c.checkpoint_dir,
                  "save checkpoints here (each worker writes its shard; a shared or same-path directory)");
  flags.AddInt("checkpoint-every", &c.checkpoint_every,
               "with --checkpoint-dir: save every N steps (0: only when training ends)");
  flags.AddInt("keep", &c.keep, "with --checkpoint-dir: how many checkpoints to keep");
  flags.AddString("resume", &c.resume,
                  "go on from the latest checkpoint in this directory (the same flags as the run that wrote it)");
  cli::SecurityFiles security_files;
  flags.AddSecurityFlags(&security_files);
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  auto security = cli::LoadSecurity(security_files);
  if (!security.ok()) {
    std::cerr << "master: " << security.status().message() << "\n";
    return 2;
  }
  runtime::TuneAllocator();
  runtime::InstallCachingCpuAllocator();
  std::string error;
  const bool splits_given = !splits.empty();
  const bool ps_mode = mode == "ps";
  c.splits = ParseSplits(splits_given ? splits : (ps_mode ? "1" : "8"), &error);
  c.all_workers = cli::SplitList(workers);
  c.workers = c.all_workers;  // replica 0's (checked below)
  if (c.replicas >= 1 && c.all_workers.size() % c.replicas == 0) {
    c.workers.resize(c.all_workers.size() / c.replicas);
  }
  auto fail = [](const std::string& msg) {
    std::cerr << "master: " << msg << "\n";
    return 2;
  };
  if (!error.empty()) return fail(error);
  if (mode != "pipeline" && !ps_mode) return fail(absl::StrCat("--mode must be pipeline or ps; got '", mode, "'"));
  for (const auto& part : cli::SplitList(split_at)) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1) {
      return fail(absl::StrCat("--split-at wants layer indices like 8 or 5,9,14; got '", split_at, "'"));
    }
    c.split_at.push_back(v);
  }
  c.batch_size = batch_size > 0 ? batch_size : (c.dataset.empty() ? 128 : 64);
  c.lr = lr != -1 ? lr : (c.dataset.empty() && c.model.empty() ? 0.05 : 0.01);
  if (batch_size == 0 || batch_size < -1) return fail("--batch-size must be >= 1");
  if (c.optimizer != "sgd" && c.optimizer != "adam") return fail("--optimizer must be sgd or adam");
  if (c.epochs < 1) return fail("--epochs must be >= 1");
  if (c.momentum < 0 || c.momentum >= 1) return fail("--momentum must be in [0, 1)");
  if (c.batches < 1 || c.batch_size < 1 || c.threads < 1 || c.connect_timeout < 1) {
    return fail("--batches, --batch-size, --threads and --connect-timeout must be >= 1");
  }
  if (c.image_size < 16 || c.image_size > 1024) return fail("--image-size must be in [16, 1024]");
  if (auto d = ParseDevice(c.device, "--device"); !d.ok() || !CheckLocalDevice(*d).ok()) {
    return fail(std::string(d.ok() ? CheckLocalDevice(*d).message() : d.status().message()));
  }
  if (!(c.lr > 0)) return fail("--lr must be > 0");
  if (!c.dataset.empty() && c.compare_local) {
    return fail("--compare-local compares the ResNet50 demo or --model batches; with --dataset, "
                "run --local separately and compare the epoch lines");
  }
  if (!c.model.empty()) {
    c.input_shape.clear();
    bool bad = false;
    for (const auto& part : cli::SplitList(input_shape)) {
      int64_t v = 0;
      bad |= !absl::SimpleAtoi(part, &v) || v < 1;
      c.input_shape.push_back(v);
    }
    if (bad || c.input_shape.empty()) {
      return fail(absl::StrCat("--input-shape wants positive sizes like 3,32,32; got '", input_shape, "'"));
    }
    if (c.classes < 1) return fail("--classes must be >= 1");
    auto scripts = pipeline::TorchScriptStages(c.model);
    if (!scripts.ok()) return fail(std::string(scripts.status().message()));
    c.scripts = std::move(*scripts);
    // One file over several workers: a sequential model to cut.
    std::error_code ec;
    if (c.scripts.size() == 1 && c.workers.size() > 1 && !std::filesystem::is_directory(c.model, ec)) {
      // (--local trains the file whole, cut or not.)
      auto model = pipeline::SequentialModel::TorchScript(c.scripts[0].script, c.scripts[0].name);
      if (model.ok()) {
        c.sequential = std::make_shared<const pipeline::SequentialModel>(std::move(*model));
      } else if (!c.local) {
        return fail(std::string(model.status().message()));
      }
    }
  }
  const bool cut = c.model.empty() ? c.dataset.empty() : c.sequential != nullptr;
  if (!c.split_at.empty() && !cut) {
    return fail("--split-at cuts ResNet50 or a one-file sequential --model over several workers; "
                "these stages are given already");
  }
  for (int s : c.splits) {
    if (s * c.replicas > c.batch_size) {
      return fail(absl::StrCat("--splits ", s, c.replicas > 1 ? absl::StrCat(" x --replicas ", c.replicas) : "",
                               " exceeds --batch-size ", c.batch_size,
                               ": every micro-batch needs at least one image"));
    }
  }
  if (c.zero != 0 && c.zero != 1) return fail("--zero must be 0 or 1");
  if (c.replicas < 1 || c.bucket_mb < 1 || c.collective_timeout < 1) {
    return fail("--replicas, --bucket-mb and --collective-timeout must be >= 1");
  }
  if (ps_mode) c.schedule = "ps";  // what its checkpoints record
  if (auto e = CheckPsFlags(c, ps_flags, ps_mode, splits_given, pipeline_stages); !e.empty()) return fail(e);
  if (!c.local) {
    if (c.workers.empty()) return fail("--workers is required (e.g. --workers worker1,worker2), or use --local");
    const int n = static_cast<int>(c.all_workers.size());
    if (pipeline_stages < 0) return fail("--pipeline-stages must be >= 1, or 0 for --workers / --replicas");
    if (n % c.replicas != 0 || (pipeline_stages > 0 && pipeline_stages * c.replicas != n)) {
      return fail(absl::StrCat(
          "--replicas ", c.replicas, pipeline_stages > 0 ? absl::StrCat(" x --pipeline-stages ", pipeline_stages) : "",
          " does not match the ", n, " --workers: give P x R workers, replica r on workers r*P .. "
          "r*P + P - 1"));
    }
    if (c.replicas > 1 && !parallel::HaveGloo()) {
      return fail("--replicas needs Gloo, which this build of remora lacks (install libgloo-dev and rebuild)");
    }
    if (c.partition != "balanced" && c.partition != "tutorial") {
      return fail("--partition must be balanced or tutorial");
    }
    if (c.interleave < 0) return fail("--interleave must be >= 1, or 0 for the default");
    if (!ps_mode && c.schedule != "auto" && std::find(pipeline::ScheduleNames().begin(), pipeline::ScheduleNames().end(),
                                          c.schedule) == pipeline::ScheduleNames().end()) {
      return fail(absl::StrCat("--schedule must be auto, ", absl::StrJoin(pipeline::ScheduleNames(), ", "),
                               "; got '", c.schedule, "'"));
    }
    if (!ps_mode && !c.model.empty() && !c.sequential && c.scripts.size() % c.workers.size() != 0) {
      return fail(absl::StrCat("--model has ", c.scripts.size(), " stages for ", c.workers.size(),
                               " workers: stage k runs on worker k mod n, so give a multiple of ",
                               c.workers.size(), " stages"));
    }
    if (!ps_mode && !c.dataset.empty() && c.model.empty() &&
        c.workers.size() > static_cast<size_t>(models::kSmallCnnBlocks)) {
      return fail(absl::StrCat("--dataset's small CNN has ", models::kSmallCnnBlocks,
                               " blocks: give at most that many --workers"));
    }
    if (c.partition == "tutorial" && (!c.model.empty() || c.workers.size() != 2)) {
      return fail("--partition tutorial splits ResNet50 in two: give exactly two --workers and no --model");
    }
    if (cut && !ps_mode) {
      // The cut's counts and split points, checked before any worker waits.
      const int layers = c.sequential ? c.sequential->num_layers() : models::kResNetBlocks;
      if (auto s = StagesPerWorker(c, layers); !s.ok()) return fail(std::string(s.status().message()));
    }
    if (auto s = cli::CheckAddress(c.listen, "--listen"); !s.ok()) return fail(std::string(s.message()));
  }
  // Checkpoints: the flags, and the checkpoint to resume, checked before
  // any worker waits.
  Checkpointing checkpoints;
  if (c.checkpoint_every < 0 || c.keep < 1 || c.train_rows < 0) {
    return fail("--checkpoint-every and --train-rows must be >= 0, --keep >= 1");
  }
  if (!c.checkpoint_dir.empty() || !c.resume.empty()) {
    if (c.local) return fail("--checkpoint-dir and --resume save and load workers' stages: not with --local");
    if (c.splits.size() != 1) return fail("--checkpoint-dir and --resume train one --splits count, not a sweep");
    if (c.zero != 0) return fail("--checkpoint-dir and --resume do not save ZeRO-1's sharded optimizer state yet");
    if (c.compare_local) return fail("--compare-local does not go with --checkpoint-dir or --resume");
    checkpoints.identity = IdentityOf(c, c.splits[0]);
  }
  if (!c.resume.empty()) {
    auto ck = checkpoint::Latest(c.resume);
    if (!ck.ok()) return fail(std::string(ck.status().message()));
    if (auto s = checkpoint::CheckMatches(*ck, checkpoints.identity); !s.ok()) return fail(std::string(s.message()));
    if (!ps_mode && ck->manifest.shards_size() != static_cast<int>(c.workers.size())) {
      return fail(absl::StrCat("checkpoint ", ck->manifest_path, " has ", ck->manifest.shards_size(),
                               " shards, one per pipeline worker: give ", ck->manifest.shards_size(),
                               " workers per replica, not ", c.workers.size()));
    }
    auto stages = checkpoint::LoadStageSpecs(*ck);
    if (!stages.ok()) return fail(std::string(stages.status().message()));
    checkpoints.stages = std::move(*stages);
    if (c.checkpoint_dir.empty()) {  // go on saving beside it
      c.checkpoint_dir = ck->dir == c.resume ? std::filesystem::path(ck->dir).parent_path().string() : c.resume;
    }
    checkpoints.resume = std::move(*ck);
  }
  runtime::SetComputeThreads(c.threads);

  std::vector<Run> runs;
  std::unique_ptr<LocalTrainer> local_baseline;  // --compare-local
  absl::Status baseline_status;
  std::unique_ptr<Agent> agent;
  Registry registry;
  if (auto s = examples::RegisterStockWorker(registry); !s.ok()) return fail(std::string(s.message()));
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
    opts.token = security->token;
    opts.tls = security->tls;
    auto started = Agent::Start(opts, &registry);
    if (!started.ok()) return die(started.status());
    agent = std::move(*started);
    dist_autograd::Enable(*agent);
    std::cout << "master listening at " << agent->self().address << " (" << TlsModeName(security->tls)
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
