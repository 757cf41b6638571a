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
#include "pipeline/pipeline.h"
#include "pipeline/stage.h"
#include "channel/devices.h"
#include "base/status_util.h"
#include "runtime/allocator.h"
#include "runtime/threads.h"
#include "runtime/trace.h"
#include "examples/builtins.h"
#include "models/resnet.h"

namespace remora {
namespace {

constexpr int64_t kClasses = 1000;

struct Config {
  std::vector<std::string> workers;
  std::string listen;
  std::vector<int> splits;
  int batches = 3;
  int batch_size = 120;
  int image_size = 128;
  double lr = 0.05;
  int seed = 0;
  std::string partition = "balanced";
  int interleave = 0;  // stages per worker; 0: 2 with balanced, 1 with tutorial
  std::string schedule = "auto";  // pipeline/schedule.h
  int threads = 0;
  bool local = false;
  bool compare_local = false;
  std::string report, trace, timeline;
  int connect_timeout = 60;
  std::string device = "cpu";  // --local and --compare-local train here
  // --model: TorchScript stages trained on random data of this shape.
  std::string model;
  std::vector<int64_t> input_shape = {3, 32, 32};
  int classes = 10;
  std::vector<pipeline::StageSpec> scripts;  // read from --model
};

struct Run {
  explicit Run(int s) : splits(s) {}
  int splits = 0;
  std::string schedule = "local";
  double seconds = 0;
  std::vector<double> batch_seconds;  // every batch's
  std::vector<double> losses;
  std::vector<int64_t> peak_activation_bytes;  // per stage; pipeline runs only
  std::vector<cli::TimelineSlice> slices;
};

// Batch b of the run: the same inputs and targets in every mode. The
// ResNet50 demo: images and one-hot labels (MSE); --model: inputs of
// --input-shape and class indices (cross-entropy).
std::pair<at::Tensor, at::Tensor> MakeBatch(const Config& c, int b) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(int64_t{c.seed} * 7919 + b);
  if (!c.model.empty()) {
    std::vector<int64_t> shape = {c.batch_size};
    shape.insert(shape.end(), c.input_shape.begin(), c.input_shape.end());
    at::Tensor inputs = at::randn(shape, gen, at::TensorOptions());
    return {inputs, at::randint(c.classes, {c.batch_size}, gen, at::TensorOptions(at::kLong))};
  }
  at::Tensor images = at::randn({c.batch_size, 3, c.image_size, c.image_size}, gen, at::TensorOptions());
  at::Tensor labels = at::randint(kClasses, {c.batch_size, 1}, gen, at::TensorOptions(at::kLong));
  at::Tensor one_hot = at::zeros({c.batch_size, kClasses}).scatter_(1, labels, 1.0);
  return {images, one_hot};
}

pipeline::LossFn Loss(const Config& c) {
  return c.model.empty() ? pipeline::MseLoss() : pipeline::CrossEntropyLoss();
}

void PrintBatch(int b, double loss, double seconds) {
  std::printf("batch=%d loss=%.6f seconds=%.3f\n", b, loss, seconds);
  std::fflush(stdout);
}

// Training in this process alone (--local, --compare-local), one batch at
// a time, with the stages the pipeline would run, one after the other.
// Owns its model and optimizer; not thread-safe.
class LocalTrainer {
 public:
  static absl::StatusOr<std::unique_ptr<LocalTrainer>> Create(const Config& c, int splits) {
    const c10::Device device(c.device);
    std::vector<std::unique_ptr<pipeline::StageModule>> stages;
    if (c.model.empty()) {
      stages.push_back(pipeline::WrapModule(
          std::make_shared<models::ResNetShardImpl>(0, models::kResNetBlocks, c.seed, device)));
    }
    for (const auto& spec : c.scripts) {
      ASSIGN_OR_RETURN(auto stage, pipeline::LoadScriptStage(spec.script, spec.name, device));
      stages.push_back(std::move(stage));
    }
    return std::unique_ptr<LocalTrainer>(new LocalTrainer(c, splits, std::move(stages)));
  }

  // Trains batch b and prints its line (after `prefix`).
  absl::Status Step(int b, const char* prefix = "") {
    auto [cpu_inputs, cpu_targets] = MakeBatch(c_, b);
    at::Tensor inputs = cpu_inputs.to(device_), targets = cpu_targets.to(device_);
    const int64_t t0 = trace::NowUs();
    opt_->zero_grad();
    double loss = 0;
    ASSIGN_OR_RETURN(auto xs, pipeline::SplitMicroBatches(inputs, run_.splits));
    ASSIGN_OR_RETURN(auto ts, pipeline::SplitMicroBatches(targets, run_.splits));
    try {
      for (size_t i = 0; i < xs.size(); ++i) {
        const int64_t f0 = trace::NowUs();
        c10::IValue out = xs[i];
        for (auto& stage : stages_) out = stage->Forward(out);
        const int64_t f1 = trace::NowUs();
        at::Tensor l = loss_(out, ts[i]) * (double(xs[i].toTensor().size(0)) / c_.batch_size);
        l.backward();
        run_.slices.push_back({0, "forward", int64_t(i), f0 - start_, f1 - start_, ""});
        run_.slices.push_back({0, "backward", int64_t(i), f1 - start_, trace::NowUs() - start_, ""});
        loss += l.item<double>();
      }
    } catch (...) {
      return StatusFromCurrentException("local training");
    }
    const int64_t s0 = trace::NowUs();
    opt_->step();
    run_.slices.push_back({0, "step", -1, s0 - start_, trace::NowUs() - start_, ""});
    const double seconds = (trace::NowUs() - t0) / 1e6;
    run_.seconds += seconds;
    run_.batch_seconds.push_back(seconds);
    run_.losses.push_back(loss);
    std::printf("%s", prefix);
    PrintBatch(b, loss, seconds);
    return absl::OkStatus();
  }

  Run& run() { return run_; }

 private:
  LocalTrainer(const Config& c, int splits, std::vector<std::unique_ptr<pipeline::StageModule>> stages)
      : c_(c), run_(splits), device_(c.device), stages_(std::move(stages)), loss_(Loss(c)),
        start_(trace::NowUs()) {
    std::vector<at::Tensor> params;
    for (auto& stage : stages_) {
      for (const at::Tensor& p : stage->Parameters()) params.push_back(p);
    }
    opt_ = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(c.lr));
  }

  const Config& c_;
  Run run_;
  const c10::Device device_;
  std::vector<std::unique_ptr<pipeline::StageModule>> stages_;
  pipeline::LossFn loss_;
  std::unique_ptr<torch::optim::SGD> opt_;
  const int64_t start_;
};

absl::StatusOr<Run> TrainLocal(const Config& c, int splits) {
  ASSIGN_OR_RETURN(auto trainer, LocalTrainer::Create(c, splits));
  for (int b = 0; b < c.batches; ++b) RETURN_IF_ERROR(trainer->Step(b));
  return std::move(trainer->run());
}

// Stage boundaries (block indices) for the workers.
absl::StatusOr<std::vector<int>> Partition(Agent& agent, const Config& c) {
  if (c.partition == "tutorial") return models::TutorialSplit();
  int max_splits = *std::max_element(c.splits.begin(), c.splits.end());
  const int64_t probe = std::max<int64_t>(1, std::min<int64_t>(16, c.batch_size / max_splits));
  // Every worker times every block at once: in the pipeline the stages run
  // side by side and share the machine's memory bandwidth and caches, and
  // blocks suffer from that unequally (timed alone on one worker, the split
  // came out up to 9% off the stages' busy times in the trace).
  std::cout << "measuring per-block cost (forward + backward, " << probe << " images of "
            << c.image_size << "x" << c.image_size << ") on " << absl::StrJoin(c.workers, ", ")
            << " at once ..." << std::endl;
  std::vector<Future<c10::IValue>> pending;
  for (const auto& w : c.workers) {
    pending.push_back(agent.rpc_async(w, "resnet.block_costs", {probe, int64_t{c.image_size}},
                                      CallOptions{absl::Minutes(10)}));
  }
  std::vector<double> v;
  for (auto& f : pending) {
    auto costs = f.wait();
    if (!costs.ok()) return costs.status();
    std::vector<double> mine = costs->toDoubleVector();
    if (v.empty()) v.assign(mine.size(), 0.0);
    if (mine.size() != v.size()) return absl::InternalError("workers measured different block counts");
    for (size_t i = 0; i < v.size(); ++i) v[i] += mine[i] / c.workers.size();
  }
  const int n = static_cast<int>(c.workers.size());
  std::vector<int> bounds = models::InterleavedSplit(v, n, c.interleave, max_splits);
  double total = 0;
  for (double x : v) total += x;
  for (int w = 0; w < n; ++w) {
    double part = 0;
    std::vector<std::string> ranges;
    for (int k = w; k + 1 < static_cast<int>(bounds.size()); k += n) {
      for (int b = bounds[k]; b < bounds[k + 1]; ++b) part += v[b];
      ranges.push_back(absl::StrFormat("[%2d, %2d)", bounds[k], bounds[k + 1]));
    }
    std::printf("  %-10s blocks %s  %5.1f%% of the measured cost\n", c.workers[w].c_str(),
                absl::StrJoin(ranges, " + ").c_str(), 100.0 * part / total);
  }
  return bounds;
}

// `after_batch` (if set) runs after each batch, outside its timing.
absl::StatusOr<Run> TrainPipeline(Agent& agent, const Config& c,
                                  const std::vector<pipeline::StageSpec>& stages, int splits,
                                  bool traced,
                                  const std::function<void(int)>& after_batch = nullptr) {
  Run run(splits);
  // Stage k lives on worker k mod n.
  pipeline::PipelineOptions o;
  o.stages = stages;
  o.workers = c.workers;
  o.schedule = c.schedule;
  o.micro_batches = splits;
  o.loss = Loss(c);
  o.optimizer = optim::OptimizerOptions::SGD(c.lr);
  ASSIGN_OR_RETURN(auto pipe, pipeline::Pipeline::Create(agent, std::move(o)));
  std::printf("  schedule %s: %d stages over %zu workers\n", pipe->schedule().name.c_str(),
              pipe->num_stages(), c.workers.size());
  run.schedule = pipe->schedule().name;
  for (const auto& w : c.workers) {
    agent.rpc_sync(w, "trace_enable", {traced}).IgnoreError();
    agent.rpc_sync(w, "trace_collect").IgnoreError();  // drop older slices
  }
  const int64_t start = trace::NowUs();
  std::vector<std::pair<int64_t, int64_t>> paused;  // after_batch's windows
  for (int b = 0; b < c.batches; ++b) {
    auto [images, one_hot] = MakeBatch(c, b);
    const int64_t t0 = trace::NowUs();
    ASSIGN_OR_RETURN(double loss, pipe->train_step(images, one_hot));
    const double seconds = (trace::NowUs() - t0) / 1e6;
    run.seconds += seconds;
    run.batch_seconds.push_back(seconds);
    run.losses.push_back(loss);
    PrintBatch(b, loss, seconds);
    if (after_batch) {
      const int64_t p0 = trace::NowUs();
      after_batch(b);
      paused.emplace_back(p0, trace::NowUs());
    }
  }
  ASSIGN_OR_RETURN(run.peak_activation_bytes, pipe->peak_activation_bytes());
  for (size_t k = 0; k < run.peak_activation_bytes.size(); ++k) {
    std::printf("  stage %zu on %s: peak saved activations %.1f MiB\n", k,
                c.workers[k % c.workers.size()].c_str(), run.peak_activation_bytes[k] / 1048576.0);
  }
  if (traced) {
    for (size_t w = 0; w < c.workers.size(); ++w) {
      auto slices = agent.rpc_sync(c.workers[w], "trace_collect");
      agent.rpc_sync(c.workers[w], "trace_enable", {false}).IgnoreError();
      if (!slices.ok()) return slices.status();
      for (const c10::IValue& s : slices->toListRef()) {
        const c10::ArrayRef<c10::IValue> t = s.toTupleRef().elements().asArrayRef();
        // The timeline leaves out the windows where after_batch ran.
        int64_t skipped = 0;
        for (const auto& [p0, p1] : paused) {
          if (p1 <= t[2].toInt()) skipped += p1 - p0;
        }
        run.slices.push_back({static_cast<int>(w), t[0].toStringRef(), t[1].toInt(),
                              t[2].toInt() - start - skipped, t[3].toInt() - start - skipped,
                              t.size() > 4 ? t[4].toStringRef() : std::string()});
      }
    }
  }
  return run;
}

// The steady-state batch time: the median of the batches after the first
// (the first warms up allocators and caches); the only batch when one ran.
double SteadySeconds(const Run& r) {
  std::vector<double> v(r.batch_seconds.begin() + (r.batch_seconds.size() > 1 ? 1 : 0),
                        r.batch_seconds.end());
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

void PrintSummary(const std::vector<Run>& runs, const Config& c) {
  std::printf("\n%8s %12s %10s %14s %18s %9s\n", "splits", "schedule", "seconds",
              "steady_batch_s", "images_per_second", "speedup");
  for (const Run& r : runs) {
    std::printf("%8d %12s %10.3f %14.3f %18.2f %8.2fx\n", r.splits, r.schedule.c_str(), r.seconds,
                SteadySeconds(r), c.batches * c.batch_size / r.seconds, runs[0].seconds / r.seconds);
  }
}

absl::Status WriteReport(const std::string& path, bool local, const std::vector<Run>& runs,
                         const Config& c) {
  std::ofstream out(path);
  if (!out) return absl::InvalidArgumentError(absl::StrCat("cannot write --report ", path));
  out << "{\"mode\": \"" << (local ? "local" : "pipeline") << "\", \"runs\": [";
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    std::vector<std::string> losses;
    for (double l : r.losses) losses.push_back(absl::StrFormat("%.9g", l));
    std::vector<std::string> batch_seconds;
    for (double b : r.batch_seconds) batch_seconds.push_back(absl::StrFormat("%.6f", b));
    out << (i ? ", " : "") << "{\"splits\": " << r.splits << ", \"schedule\": \"" << r.schedule
        << "\", \"seconds\": " << absl::StrFormat("%.6f", r.seconds)
        << ", \"steady_batch_seconds\": " << absl::StrFormat("%.6f", SteadySeconds(r))
        << ", \"images_per_second\": "
        << absl::StrFormat("%.4f", c.batches * c.batch_size / r.seconds) << ", \"batch_seconds\": ["
        << absl::StrJoin(batch_seconds, ", ") << "], \"losses\": ["
        << absl::StrJoin(losses, ", ") << "], \"stages\": [";
    for (size_t k = 0; k < r.peak_activation_bytes.size(); ++k) {
      out << (k ? ", " : "") << "{\"stage\": " << k << ", \"worker\": \""
          << c.workers[k % c.workers.size()] << "\", \"peak_activation_bytes\": "
          << r.peak_activation_bytes[k] << "}";
    }
    out << "]}";
  }
  out << "]}\n";
  return out.good() ? absl::OkStatus() : absl::DataLossError("writing the report failed");
}

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
  std::string workers, splits = "8";
  c.listen = cli::MasterAddressFromEnv();
  c.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cli::FlagParser flags("master",
                        "Trains ResNet50 as a pipeline over worker processes and reports the "
                        "speedup of each split count.\nStart the workers first: "
                        "worker --name worker1 (see worker --help).");
  flags.AddString("workers", &workers, "comma-separated worker names, one stage each (required unless --local)");
  flags.AddString("listen", &c.listen, "HOST:PORT where workers find the master (MASTER_ADDR/MASTER_PORT also work)");
  flags.AddString("splits", &splits, "micro-batches per batch: one count (8) or a sweep (1,2,4,8)");
  flags.AddInt("batches", &c.batches, "batches per split count");
  flags.AddInt("batch-size", &c.batch_size, "images per batch");
  flags.AddInt("image-size", &c.image_size, "image height and width");
  flags.AddDouble("lr", &c.lr, "SGD learning rate");
  flags.AddInt("seed", &c.seed, "seed of weights and data: same seed, same numbers");
  flags.AddString("partition", &c.partition, "balanced (by measured block cost) or tutorial (2 workers)");
  flags.AddInt("interleave", &c.interleave,
               "stages per worker: with 2, worker k of n also hosts stage k + n, which halves "
               "the pipeline's fill and drain (0: 2 with --partition balanced and 2 to 9 workers, else 1)");
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
                  "train TorchScript stages instead of ResNet50: a directory holding stage0.pt, "
                  "stage1.pt, ... or a comma-separated list of .pt files (stage k runs on worker "
                  "k mod n; random inputs of --input-shape, labels in [0, --classes), cross-entropy)");
  flags.AddString("input-shape", &input_shape, "with --model: one input's shape, e.g. 3,32,32 or 784");
  flags.AddInt("classes", &c.classes, "with --model: the number of classes of the labels");
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
  c.splits = ParseSplits(splits, &error);
  c.workers = cli::SplitList(workers);
  auto fail = [](const std::string& msg) {
    std::cerr << "master: " << msg << "\n";
    return 2;
  };
  if (!error.empty()) return fail(error);
  if (c.batches < 1 || c.batch_size < 1 || c.threads < 1 || c.connect_timeout < 1) {
    return fail("--batches, --batch-size, --threads and --connect-timeout must be >= 1");
  }
  if (c.image_size < 16 || c.image_size > 1024) return fail("--image-size must be in [16, 1024]");
  if (auto d = ParseDevice(c.device, "--device"); !d.ok() || !CheckLocalDevice(*d).ok()) {
    return fail(std::string(d.ok() ? CheckLocalDevice(*d).message() : d.status().message()));
  }
  if (!(c.lr > 0)) return fail("--lr must be > 0");
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
  }
  for (int s : c.splits) {
    if (s > c.batch_size) {
      return fail(absl::StrCat("--splits ", s, " exceeds --batch-size ", c.batch_size,
                               ": every micro-batch needs at least one image"));
    }
  }
  if (!c.local) {
    if (c.workers.empty()) return fail("--workers is required (e.g. --workers worker1,worker2), or use --local");
    if (c.partition != "balanced" && c.partition != "tutorial") {
      return fail("--partition must be balanced or tutorial");
    }
    if (c.interleave < 0) return fail("--interleave must be >= 1, or 0 for the default");
    if (c.schedule != "auto" && std::find(pipeline::ScheduleNames().begin(), pipeline::ScheduleNames().end(),
                                          c.schedule) == pipeline::ScheduleNames().end()) {
      return fail(absl::StrCat("--schedule must be auto, ", absl::StrJoin(pipeline::ScheduleNames(), ", "),
                               "; got '", c.schedule, "'"));
    }
    if (!c.model.empty() && c.scripts.size() % c.workers.size() != 0) {
      return fail(absl::StrCat("--model has ", c.scripts.size(), " stages for ", c.workers.size(),
                               " workers: stage k runs on worker k mod n, so give a multiple of ",
                               c.workers.size(), " stages"));
    }
    if (c.interleave == 0) {
      // One worker has nothing to overlap; past 9 workers there are too few blocks.
      const bool useful = c.workers.size() >= 2 &&
                          c.workers.size() * 2 <= static_cast<size_t>(models::kResNetBlocks);
      c.interleave = c.partition == "balanced" && useful ? 2 : 1;
    }
    if (c.partition == "tutorial" && c.interleave != 1) {
      return fail("--partition tutorial has one stage per worker: drop --interleave");
    }
    if (c.partition == "tutorial" && c.workers.size() != 2) {
      return fail("--partition tutorial splits ResNet50 in two: give exactly two --workers");
    }
    if (c.workers.size() * c.interleave > static_cast<size_t>(models::kResNetBlocks)) {
      return fail(absl::StrCat("--workers times --interleave is at most ", models::kResNetBlocks,
                               " (ResNet50 has that many blocks)"));
    }
    if (auto s = cli::CheckAddress(c.listen, "--listen"); !s.ok()) return fail(std::string(s.message()));
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
  if (c.local) {
    for (int s : c.splits) {
      std::printf("local: splits=%d (%d micro-batches of %d images), %d threads\n", s, s,
                  c.batch_size / s, c.threads);
      auto trained = TrainLocal(c, s);
      if (!trained.ok()) return die(trained.status());
      Run run = std::move(*trained);
      std::printf("splits=%d seconds=%.3f images_per_second=%.2f\n", s, run.seconds,
                  c.batches * c.batch_size / run.seconds);
      runs.push_back(std::move(run));
    }
  } else {
    AgentOptions opts;
    opts.name = "master";
    opts.is_master = true;
    opts.listen_address = c.listen;
    opts.workers = c.workers;
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
              << absl::StrJoin(c.workers, ", ") << std::endl;
    if (auto s = agent->Join(); !s.ok()) return die(s);
    for (const auto& w : agent->workers()) {
      if (w.id != 0) std::cout << "  " << w.name << ": shards on " << w.device << "\n";
    }
    // The stages: the TorchScript files, or ResNet50's blocks as the
    // partition cuts them (stage k: blocks [bounds[k], bounds[k + 1])).
    std::vector<pipeline::StageSpec> stages = c.scripts;
    if (c.model.empty()) {
      auto bounds = Partition(*agent, c);
      if (!bounds.ok()) return die(bounds.status());
      for (size_t k = 0; k + 1 < bounds->size(); ++k) {
        stages.push_back(pipeline::StageSpec::Registered(
            "ResNetShard", {int64_t{(*bounds)[k]}, int64_t{(*bounds)[k + 1]}, int64_t{c.seed}}));
      }
    }
    for (size_t i = 0; i < c.splits.size(); ++i) {
      const int s = c.splits[i];
      const bool last = i + 1 == c.splits.size();
      std::printf("pipeline: splits=%d (%d micro-batches of ~%d images) over %zu workers, %zu stages\n",
                  s, s, c.batch_size / s, c.workers.size(), stages.size());
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
      auto run = TrainPipeline(*agent, c, stages, s, last && !(c.trace.empty() && c.timeline.empty()),
                               after_batch);
      if (!run.ok()) return die(run.status());
      std::printf("splits=%d seconds=%.3f images_per_second=%.2f\n", s, run->seconds,
                  c.batches * c.batch_size / run->seconds);
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
