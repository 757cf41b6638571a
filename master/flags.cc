#include "master/flags.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/ids.h"
#include "base/status_util.h"
#include "channel/devices.h"
#include "checkpoint/checkpoint.h"
#include "master/checkpoint_flags.h"
#include "optim/lr_schedule.h"
#include "rpc/agent.h"
#include "data/datasets.h"
#include "shards/cnn.h"
#include "shards/resnet.h"
#include "parallel/process_group.h"
#include "pipeline/partition.h"
#include "pipeline/pipeline.h"
#include "pipeline/schedule.h"

namespace remora::master {

namespace {

absl::StatusOr<std::vector<int>> ParseSplits(const std::string& text) {
  std::vector<int> out;
  const std::vector<std::string> parts = launch::SplitList(text);
  if (!parts.empty() && launch::HasEmptyPart(text)) {
    return Bad(absl::StrCat("--splits '", text, "' has an empty count (two commas, or one at an end)"));
  }
  for (const auto& part : parts) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1) {
      return Bad(absl::StrCat("--splits wants positive integers like 8 or 1,2,4,8; got '", text, "'"));
    }
    out.push_back(v);
  }
  if (out.empty()) return Bad("--splits is empty");
  return out;
}

// --splits auto, and --schedule auto given, ask the planner, which times
// the layers of a model the master cuts itself. --splits auto where it
// cannot: what to give instead. --schedule auto there keeps its rule (as
// before the planner): `plan_schedule` is cleared. Empty when fine.
std::string CheckPlanFlags(RunOptions& c, const Flags& f, bool ps_mode, bool cut) {
  if (!c.plan_schedule && !c.plan_splits) return "";
  const std::string why =
      c.local   ? "--local trains in one process, with no pipeline to plan"
      : ps_mode ? "--mode ps trains with a parameter server, not a pipeline"
      : !cut    ? (!c.model.empty() && c.scripts.size() > 1 ? "--model's stage files are cut already"
                   : !c.model.empty()                        ? "one worker per pipeline trains the model whole"
                                                             : "the built-in small CNN's blocks are spread over "
                                                               "the workers as they are")
      : !c.split_at.empty() || !f.split_at.empty() ? "--split-at fixes the cut"
      : c.partition == "tutorial"                  ? "--partition tutorial fixes the cut"
      : !c.resume.empty() ? "--resume keeps the schedule and count its checkpoint was written under"
                          : "";
  if (!why.empty()) {
    if (!c.plan_splits) {
      c.plan_schedule = false;
      return "";
    }
    return absl::StrCat("--splits auto plans a pipeline from its layers' measured times (ResNet50, the GPT of "
                        "--dataset text:, a one-file --model cut over the workers), but ", why,
                        ": give --splits N", c.plan_schedule ? " (and --schedule auto keeps its rule there)" : "");
  }
  if (c.interleave > 2 && (c.plan_schedule || c.schedule == "auto")) {
    return absl::StrCat("--interleave ", c.interleave, ": the planner's schedules run one stage per worker (1f1b, "
                        "zb1p) or two (interleaved, zbv); give --interleave 1 or 2, or name --schedule interleaved");
  }
  if (c.plan_schedule && !c.plan_splits && c.splits.size() > 1) {
    return absl::StrCat("--schedule auto plans one micro-batch count, and --splits ", f.splits,
                        " sweeps several: give one --splits, or --splits auto");
  }
  return "";
}

// The numbers and choices that need no file and no other flag's meaning.
absl::Status CheckValues(const Flags& f, const RunOptions& c) {
  if (f.given.count("batch-size") && f.batch_size < 1) return Bad("--batch-size must be >= 1");
  if (c.optimizer != "sgd" && c.optimizer != "adam" && c.optimizer != "adamw") {
    return Bad(absl::StrCat("--optimizer must be sgd, adam or adamw; got '", c.optimizer, "'"));
  }
  if (!(c.weight_decay >= 0)) return Bad("--weight-decay must be 0 or more");
  if (!(c.clip_grad_norm >= 0)) return Bad("--clip-grad-norm must be 0 (no clipping) or more");
  if (c.epochs < 1) return Bad("--epochs must be >= 1");
  if (auto kind = optim::LrScheduleKindNamed(c.lr_schedule); !kind.ok()) {
    return Bad(absl::StrCat("--lr-schedule must be constant, cosine or linear; got '", c.lr_schedule, "'"));
  }
  if (c.warmup_steps < 0) return Bad("--warmup-steps must be 0 or more");
  if (c.eval_every < 0) return Bad("--eval-every must be 0 (after each epoch only) or more");
  if (c.decay_steps < 0) return Bad("--decay-steps must be 0 (the run's steps) or more");
  if (f.given.count("min-lr") && !(c.min_lr >= 0)) return Bad("--min-lr must be 0 or more");
  if (c.momentum < 0 || c.momentum >= 1) return Bad("--momentum must be in [0, 1)");
  RETURN_IF_ERROR(launch::CheckAtLeast({{"batches", c.batches, 1},
                                        {"batch-size", c.batch_size, 1},
                                        {"threads", c.threads, 1},
                                        {"connect-timeout", c.connect_timeout, 1}}));
  RETURN_IF_ERROR(launch::CheckBusyPollFlag(c.busy_poll_us, absl::ToInt64Microseconds(rpc::kMaxBusyPoll)));
  if (c.image_size < 16 || c.image_size > 1024) return Bad("--image-size must be in [16, 1024]");
  if (c.threads > launch::kMaxThreads) {
    return Bad(absl::StrCat("--threads must be at most ", launch::kMaxThreads, "; got ", c.threads));
  }
  auto device = channel::ParseDevice(c.device, "--device");
  if (!device.ok()) return Bad(std::string(device.status().message()));
  if (auto s = channel::CheckLocalDevice(*device); !s.ok()) return Bad(std::string(s.message()));
  if (!(c.lr > 0)) return Bad(absl::StrCat("--lr must be > 0; got ", c.lr));
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"timeline", c.timeline},
                                   {"curves", c.curves}}) {
    if (!path.empty() && !absl::EndsWithIgnoreCase(path, ".svg")) {
      return Bad(absl::StrCat("--", flag, " writes an SVG picture: give a FILE.svg; got '", path, "'"));
    }
  }
  if (!c.dataset.empty()) {
    if (auto s = data::CheckDatasetName(c.dataset); !s.ok()) return Bad(std::string(s.message()));
    if (c.data_threads < 1 || c.data_threads > 256) return Bad("--data-threads must be in [1, 256]");
    if (c.data_on != "workers" && c.data_on != "master") {
      return Bad(absl::StrCat("--data-on must be workers or master; got '", c.data_on, "'"));
    }
    if (c.prefetch < 0 || c.prefetch > 64) return Bad("--prefetch must be in [0, 64]");
  }
  if (!(c.val_fraction >= 0 && c.val_fraction < 1)) return Bad("--val-fraction must be in [0, 1)");
  if (c.val_fraction > 0 && !ReadsImageFolder(c) && !ReadsText(c)) {
    return Bad("--val-fraction holds images out of an image folder's training images (or the tail of a text): "
               "give --dataset imagefolder:DIR or text:PATH (the other datasets have their own test set)");
  }
  if (c.tie_embeddings && f.given.count("tie-embeddings") && !TrainsGpt(c)) {
    return Bad(absl::StrCat(
        "--tie-embeddings ties the built-in GPT's token embedding and head (--dataset text:PATH without --model); ",
        c.model.empty() ? "this run trains no GPT" : "a --model's stages are trained as they were written: tie its "
                                                      "weights in the model itself (nanoGPT's lm_head.weight = "
                                                      "wte.weight) and cut it as one stage, or leave the flag off"));
  }
  if (ReadsText(c)) {
    RETURN_IF_ERROR(launch::CheckAtLeast(
        {{"layers", c.layers, 1}, {"d-model", c.d_model, 1}, {"heads", c.heads, 1}, {"seq-len", c.seq_len, 1}}));
    if (c.d_model % c.heads != 0) {
      return Bad(absl::StrCat("--d-model ", c.d_model, " must be a multiple of --heads ", c.heads,
                              " (each head takes d-model / heads of it)"));
    }
    if (c.seq_len > 65536) return Bad(absl::StrCat("--seq-len must be at most 65536; got ", c.seq_len));
    if (!c.tokenizer.empty()) RETURN_IF_ERROR(TextVocabOf(c).status());  // (a model it can read)
  } else if (!c.tokenizer.empty()) {
    return Bad("--tokenizer tokenises a text: give --dataset text:PATH too");
  }
  if (c.peak_tflops < 0) return Bad("--peak-tflops must be > 0 (or 0: not given)");
  if (!c.dataset.empty() && c.compare_local) {
    return Bad("--compare-local compares the ResNet50 demo or --model batches; with --dataset, "
               "run --local separately and compare the epoch lines");
  }
  return absl::OkStatus();
}

// This machine's memory in GiB (0: unknown).
double MemoryGiB() { return static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE) / (1 << 30); }

// The random batches of the demo and of --model (no --dataset) are made
// whole on the master, two ahead of the one being sent: a batch over a
// quarter of this machine's memory is refused before anything starts.
absl::Status CheckBatchFits(const RunOptions& c) {
  if (!c.dataset.empty()) return absl::OkStatus();
  double values = static_cast<double>(c.batch_size);
  std::string what;
  if (c.model.empty()) {
    values *= 3.0 * c.image_size * c.image_size;
    what = absl::StrCat(" of 3x", c.image_size, "x", c.image_size, " images");
  } else {
    for (int64_t d : c.input_shape) values *= static_cast<double>(d);
    what = absl::StrCat(" of --input-shape ", absl::StrJoin(c.input_shape, ","));
  }
  const double gib = values * 4 / (1 << 30);
  const double memory = MemoryGiB();
  if (memory <= 0 || gib <= memory / 4) return absl::OkStatus();
  return Bad(absl::StrFormat("--batch-size %d%s is %.4g GiB a batch, and the master holds three at once: more "
                             "than a quarter of this machine's %.1f GiB of memory; give a smaller --batch-size%s",
                             c.batch_size, what, gib, memory, c.model.empty() ? " or --image-size" : ""));
}

// ResNet50 trained in this process on the CPU (--local, or
// --compare-local's baseline at one micro-batch) keeps one micro-batch's
// activations at a time: about 2.2 KB per input pixel of each image.
// Far beyond the memory, the kernel would kill the process with no message.
absl::Status CheckActivationsFit(const RunOptions& c) {
  const double memory = MemoryGiB();
  const bool on_gpu = absl::StartsWith(c.device, "cuda");  // (its memory is the GPU's)
  if (!(c.local || c.compare_local) || !c.model.empty() || TrainsSmallCnn(c) || on_gpu || memory <= 0) {
    return absl::OkStatus();
  }
  const int fewest = c.compare_local || c.splits.empty() ? 1 : *std::min_element(c.splits.begin(), c.splits.end());
  const int64_t rows = (c.batch_size + fewest - 1) / fewest;
  const double activations = 2200.0 * rows * c.image_size * c.image_size / (1 << 30);
  if (activations <= memory * 0.75) return absl::OkStatus();
  return Bad(absl::StrFormat("one process trains micro-batches of %d images at %dx%d here, and ResNet50 keeps "
                             "about %.3g GiB of activations for each: more than this machine's %.1f GiB of "
                             "memory can hold; give a smaller --image-size or --batch-size, or more --splits",
                             rows, c.image_size, c.image_size, activations, memory));
}

// --model's stages, read; a one-file sequential model to cut kept whole.
absl::Status ReadModel(const Flags& f, RunOptions& c) {
  c.input_shape.clear();
  bool bad = false;
  // Not given: with --dataset, the dataset's images (set once it is
  // loaded: FitInputShape), else one 3x32x32 image.
  c.input_shape_given = !f.input_shape.empty();
  const std::string shape = c.input_shape_given ? f.input_shape : "3,32,32";
  for (const auto& part : launch::SplitList(shape)) {
    int64_t v = 0;
    bad |= !absl::SimpleAtoi(part, &v) || v < 1;
    c.input_shape.push_back(v);
  }
  if (bad || c.input_shape.empty()) {
    return Bad(absl::StrCat("--input-shape wants positive sizes like 3,32,32; got '", shape, "'"));
  }
  if (ReadsImageFolder(c) && c.input_shape_given) {
    // An image folder's images are cropped to squares of --image-size:
    // that flag, not --input-shape, sets the model's input.
    const std::vector<int64_t> images = {3, c.image_size, c.image_size};
    if (c.input_shape != images) {
      const auto& s = c.input_shape;
      const bool square = s.size() == 3 && s[0] == 3 && s[1] == s[2];
      return Bad(absl::StrCat(
          "--input-shape ", shape, " does not match --dataset ", c.dataset, "'s images, 3,", c.image_size, ",",
          c.image_size, ": an image folder's images are 3 x S x S at --image-size S; ",
          square ? absl::StrCat("give --image-size ", s[1], " (and leave --input-shape out)")
                 : "leave --input-shape out, and give --image-size for the side the model takes"));
    }
  }
  if (c.classes < 1) return Bad("--classes must be >= 1");
  auto scripts = pipeline::TorchScriptStages(c.model);
  if (!scripts.ok()) return Bad(std::string(scripts.status().message()));
  c.scripts = std::move(*scripts);
  // One file over several workers: a sequential model to cut. (--local
  // trains the file whole, cut or not.)
  std::error_code ec;
  if (c.scripts.size() == 1 && c.workers.size() > 1 && !std::filesystem::is_directory(c.model, ec)) {
    auto model = pipeline::SequentialModel::TorchScript(c.scripts[0].script, c.scripts[0].name);
    if (model.ok()) {
      c.sequential = std::make_shared<const pipeline::SequentialModel>(std::move(*model));
    } else if (!c.local) {
      return Bad(std::string(model.status().message()));
    }
    // A forward that returns more than the logits (a tuple) is no chain of
    // its children, and the last stage's output goes to cross-entropy:
    // said now, not as a cut that does not fit the layers.
    const std::string& output = model.ok() ? c.sequential->output_type() : "";
    if (!c.local && !output.empty() && output != "Tensor") {
      return Bad(absl::StrCat(
          "--model ", c.model, " cannot be cut into stages: its forward returns ", output,
          ", not one tensor of logits, and the last stage's output goes to cross-entropy; return the logits alone "
          "(compute the loss outside forward), or export one TorchScript file per stage (--model DIR of stage0.pt, "
          "stage1.pt, ...: each stage's forward takes the one before's output, the last returns the logits)"));
    }
  }
  if (c.local) {
    // (Built here next anyway: a file that is no TorchScript is a bad flag,
    // as over workers, not a failure after the run began.)
    for (const pipeline::StageSpec& spec : c.scripts) {
      if (auto stage = pipeline::BuildStage(spec, c10::Device(c10::kCPU)); !stage.ok()) {
        return Bad(std::string(stage.status().message()));
      }
    }
  }
  return absl::OkStatus();
}

// The workers, the topology and how the model is cut: what a run over
// workers needs, checked before any worker is waited for.
absl::Status CheckWorkers(const Flags& f, const RunOptions& c, bool ps_mode, bool cut) {
  if (c.workers.empty()) return Bad("--workers is required (e.g. --workers worker1,worker2), or use --local");
  const int n = static_cast<int>(c.all_workers.size());
  if (f.pipeline_stages < 0) return Bad("--pipeline-stages must be >= 1, or 0 for --workers / --replicas");
  if (n % c.replicas != 0 || (f.pipeline_stages > 0 && f.pipeline_stages * c.replicas != n)) {
    return Bad(absl::StrCat("--replicas ", c.replicas,
                            f.pipeline_stages > 0 ? absl::StrCat(" x --pipeline-stages ", f.pipeline_stages) : "",
                            " does not match the ", n, " --workers: give P x R workers, replica r on workers "
                            "r*P .. r*P + P - 1"));
  }
  if (c.replicas > 1 && !parallel::HaveGloo()) {
    return Bad("--replicas needs Gloo, which this build of remora lacks (install libgloo-dev and rebuild)");
  }
  if (c.partition != "balanced" && c.partition != "tutorial") return Bad("--partition must be balanced or tutorial");
  if (c.interleave < 0) return Bad("--interleave must be >= 1, or 0 for the default");
  if (c.interleave > 1 && (c.schedule == "1f1b" || c.schedule == "gpipe" || c.schedule == "zb1p")) {
    return Bad(absl::StrCat("--interleave ", c.interleave, " puts several stages on each worker, which --schedule ",
                            c.schedule, " does not run: give --schedule interleaved (or auto), or no --interleave"));
  }
  if (c.schedule == "zbv" && c.interleave != 0 && c.interleave != 2) {
    return Bad(absl::StrCat("--schedule zbv runs two stages per worker (a V: worker k hosts stage k and stage "
                            "2 n - 1 - k), not --interleave ", c.interleave, ": leave --interleave out"));
  }
  if (!ps_mode && !c.model.empty() && !c.sequential && c.scripts.size() % c.workers.size() != 0) {
    return Bad(absl::StrCat("--model has ", c.scripts.size(), " stages for ", c.workers.size(),
                            " workers: stage k runs on worker k mod n, so give a multiple of ",
                            c.workers.size(), " stages"));
  }
  if (!ps_mode && c.workers.size() == 1 && c.scripts.size() > 1) {
    // Found here, not once the workers have joined: stage k's output is a
    // call to stage k + 1's worker, which must be another.
    const size_t stages = c.scripts.size();
    const std::string topology =
        c.replicas > 1 ? absl::StrCat("--replicas ", c.replicas, " over the ", n, " --workers leaves 1 worker per "
                                      "pipeline")
                       : "the pipeline has 1 worker (--workers " + c.workers[0] + ")";
    return Bad(absl::StrCat(
        "--model has ", stages, " stage files and ", topology, ", but consecutive stages must run on different "
        "workers: give ", stages, " workers per pipeline (", c.replicas > 1 ? "" : "--workers with ",
        stages * c.replicas, " names", c.replicas > 1 ? absl::StrCat(" in --workers for --replicas ", c.replicas) : "",
        "), or export the model as one nn.Sequential file, which the master cuts into as many stages as a pipeline "
        "has workers"));
  }
  if (!ps_mode && TrainsSmallCnn(c) &&
      c.workers.size() * (c.schedule == "zbv" ? 2 : 1) > static_cast<size_t>(shards::kSmallCnnBlocks)) {
    return Bad(absl::StrCat("--dataset's small CNN has ", shards::kSmallCnnBlocks, " blocks: give at most ",
                            c.schedule == "zbv" ? absl::StrCat(shards::kSmallCnnBlocks / 2, " --workers for zbv's "
                                                               "two stages per worker")
                                                : "that many --workers"));
  }
  if (!ps_mode && c.schedule == "zbv" && !c.model.empty() && !c.sequential &&
      c.scripts.size() != 2 * c.workers.size() / std::max(1, c.replicas)) {
    const size_t per_pipeline = c.workers.size() / std::max(1, c.replicas);
    return Bad(absl::StrCat("--schedule zbv runs two stages per worker (a V) and --model has ", c.scripts.size(),
                            " stage files for ", per_pipeline, " workers per pipeline: give ", 2 * per_pipeline,
                            " stage files, or a one-file model that the master cuts"));
  }
  if (c.partition == "tutorial" && (!c.model.empty() || TrainsGpt(c) || c.workers.size() != 2)) {
    return Bad("--partition tutorial splits ResNet50 in two: give exactly two --workers and no --model");
  }
  if (c.partition == "tutorial" && c.interleave > 1 && c.split_at.empty()) {
    return Bad(absl::StrCat("--partition tutorial cuts ResNet50 into exactly 2 stages, one per worker: not with "
                            "--interleave ", c.interleave, " (leave --partition out for the balanced cut)"));
  }
  if (cut && !ps_mode) {
    // The cut's counts and split points.
    const int layers = LayersToCut(c);
    auto per_worker = StagesPerWorker(c, layers);
    if (!per_worker.ok()) return Bad(std::string(per_worker.status().message()));
    if (c.schedule == "zbv" && *per_worker != 2) {
      return Bad(absl::StrCat("--schedule zbv runs two stages per worker (a V), and --split-at makes ", *per_worker,
                              " per worker: give 2 n - 1 split points for n workers per pipeline"));
    }
    if (*per_worker > 1 && c.workers.size() == 1 && c.schedule != "zbv") {
      // (--interleave, where given, sets the count: StagesPerWorker.)
      const char* flag = c.interleave > 0 ? "--interleave" : "--split-at";
      return Bad(absl::StrCat(*per_worker, " stages on the one worker of ", c.replicas > 1 ? "each" : "the",
                              " pipeline (", flag, "): consecutive stages must run on different workers; give 2 or "
                              "more workers per pipeline, or leave ", flag, " out"));
    }
  }
  return launch::CheckAddress(c.listen, launch::AddressSource("--listen", c.listen));
}

}  // namespace

Flags DefaultFlags() {
  Flags f;
  f.config.listen = launch::MasterAddressFromEnv();
  f.config.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return f;
}

absl::StatusOr<CommandLine> Check(Flags f) {
  CommandLine line;
  auto security = launch::LoadSecurity(f.security);
  if (!security.ok()) return Bad(std::string(security.status().message()));
  line.security = std::move(*security);
  line.ps = f.ps;
  RunOptions& c = line.config;
  c = std::move(f.config);
  const bool splits_given = !f.splits.empty();
  line.ps_mode = f.mode == "ps";
  c.all_workers = launch::SplitList(f.workers);
  c.spares = launch::SplitList(f.spares);
  // SplitList drops empty names: "a,,b" is a typo, not a shorter list.
  for (const auto& [flag, text] : {std::make_pair("workers", f.workers), std::make_pair("spares", f.spares)}) {
    if (launch::HasEmptyPart(text)) {
      return Bad(absl::StrCat("--", flag, " '", text, "' has an empty name (two commas, or one at an end)"));
    }
  }
  std::set<std::string> named;
  for (const std::string& w : c.all_workers) {
    if (!base::IsValidWorkerName(w)) {
      return Bad(absl::StrCat("--workers: invalid worker name '", w, "': use 1 to 128 characters of [A-Za-z0-9_:-]"));
    }
    if (w == "master") return Bad("--workers: 'master' is the master's own name; name the workers otherwise");
    if (!named.insert(w).second) return Bad(absl::StrCat("--workers: '", w, "' is named twice"));
  }
  // One stage per replica is plain data parallelism: one micro-batch per
  // replica by default, as DDP trains (micro-batches only pay in a pipeline).
  const bool one_stage_per_replica =
      c.replicas > 1 && c.all_workers.size() == static_cast<size_t>(c.replicas);
  // --splits auto: planned once the workers have timed the layers; one
  // micro-batch stands in until then (what every count's checks below
  // pass where any count can run).
  c.plan_splits = f.splits == "auto";
  c.plan_schedule = f.given.count("schedule") > 0 && c.schedule == "auto";
  auto splits = ParseSplits(c.plan_splits  ? "1"
                            : splits_given ? f.splits
                                           : (line.ps_mode || one_stage_per_replica ? "1" : "8"));
  if (!splits.ok()) return splits.status();
  c.splits = std::move(*splits);
  c.workers = c.all_workers;  // replica 0's (checked below)
  if (c.replicas >= 1 && c.all_workers.size() % c.replicas == 0) {
    c.workers.resize(c.all_workers.size() / c.replicas);
  }
  if (f.mode != "pipeline" && !line.ps_mode) {
    return Bad(absl::StrCat("--mode must be pipeline or ps; got '", f.mode, "'"));
  }
  if (launch::HasEmptyPart(f.split_at)) {
    return Bad(absl::StrCat("--split-at '", f.split_at, "' has an empty index (two commas, or one at an end)"));
  }
  // Layer numbers, or submodules of a one-file --model (resolved below,
  // once the model is read).
  std::vector<std::string> split_names;
  for (const auto& part : launch::SplitList(f.split_at)) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v)) {
      split_names.push_back(part);
      continue;
    }
    if (v < 1) {
      return Bad(absl::StrCat("--split-at wants layer numbers like 8 or 5,9,14, or submodule names like "
                              "layer2,layer4; got '", f.split_at, "'"));
    }
    c.split_at.push_back(v);
  }
  c.batch_size = f.given.count("batch-size") ? f.batch_size : (c.dataset.empty() ? 128 : 64);
  // Adam at SGD's rates diverges (the demo's loss reached 1e4 at 0.05);
  // 0.001 is PyTorch's default for it.
  const bool demo = c.dataset.empty() && c.model.empty();
  // A GPT trains with Adam unless told otherwise (as nanoGPT and the
  // field do: SGD barely moves a transformer), on 5% of its text held out.
  if (ReadsText(c) && !f.given.count("optimizer")) c.optimizer = "adam";
  if (ReadsText(c) && !f.given.count("val-fraction")) c.val_fraction = 0.05;
  const bool adam = c.optimizer == "adam" || c.optimizer == "adamw";
  c.lr = f.given.count("lr") ? f.lr : (demo ? (adam ? 0.0001 : 0.05) : (adam ? 0.001 : 0.01));
  if (auto s = CheckValues(f, c); !s.ok()) return s;
  // Workers started elsewhere, and a resume from another directory, read
  // the same folder.
  if (!c.dataset.empty()) c.dataset = data::AbsoluteDatasetName(c.dataset);
  if (!c.model.empty()) {
    if (auto s = ReadModel(f, c); !s.ok()) return s;
  }
  if (!split_names.empty()) {
    if (!c.sequential) {
      return Bad(absl::StrCat("--split-at ", f.split_at, " names submodules, which only a one-file --model cut "
                              "over several workers has; give layer numbers (like 5,9,14)"));
    }
    if (!c.split_at.empty()) {
      return Bad(absl::StrCat("--split-at ", f.split_at, " mixes layer numbers and submodule names; give one or "
                              "the other"));
    }
    for (const std::string& name : split_names) {
      auto layer = c.sequential->LayerNamed(name);
      if (!layer.ok()) return Bad(absl::StrCat("--split-at ", name, ": ", layer.status().message()));
      if (*layer == 0) {
        return Bad(absl::StrCat("--split-at ", name, ": ", name, " begins the model; a cut goes before a later "
                                "layer"));
      }
      c.split_at.push_back(*layer);
    }
  }
  if (auto s = CheckBatchFits(c); !s.ok()) return s;
  if (auto s = CheckActivationsFit(c); !s.ok()) return s;
  const bool cut = c.model.empty() ? !TrainsSmallCnn(c) : c.sequential != nullptr;
  // (--local trains the whole model in one process: --split-at is noted
  // as having no effect there, not refused.)
  if (!c.split_at.empty() && !cut && !c.local) {
    if (c.model.empty()) {
      return Bad(absl::StrCat("--split-at cuts ResNet50; --dataset ", c.dataset, " trains the built-in small CNN, whose ",
                              shards::kSmallCnnBlocks, " blocks are spread over the --workers already: leave "
                              "--split-at out"));
    }
    return Bad(absl::StrCat("--split-at cuts a one-file --model; --model ", c.model, " is ",
                            c.scripts.size() == 1 ? "one stage file" : absl::StrCat(c.scripts.size(), " stage files"),
                            ", cut already: leave --split-at out, or give the whole model as one TorchScript file to "
                            "cut it where --split-at says"));
  }
  if (c.zero != 0 && c.zero != 1) return Bad("--zero must be 0 or 1");
  if (c.precision != "fp32" && c.precision != "bf16") {
    return Bad(absl::StrCat("--precision must be fp32 or bf16; got '", c.precision, "'"));
  }

  if (auto s = launch::CheckAtLeast({{"replicas", c.replicas, 1},
                                     {"bucket-mb", c.bucket_mb, 1},
                                     {"collective-timeout", c.collective_timeout, 1}});
      !s.ok()) {
    return Bad(std::string(s.message()));
  }
  if (line.ps_mode) c.schedule = "ps";  // what its checkpoints record
  // (A typo is one with --local too, where the schedule is not used.)
  const auto& names = pipeline::ScheduleNames();
  if (!line.ps_mode && c.schedule != "auto" && std::find(names.begin(), names.end(), c.schedule) == names.end()) {
    return Bad(absl::StrCat("--schedule must be auto, ", absl::StrJoin(names, ", "), "; got '", c.schedule, "'"));
  }
  if (auto e = CheckPsFlags(c, f.ps, line.ps_mode, splits_given, f.pipeline_stages); !e.empty()) return Bad(e);
  if (!c.local) {
    if (auto s = CheckWorkers(f, c, line.ps_mode, cut); !s.ok()) return s;
  }
  // (After the workers: a topology that does not fit says so first.)
  if (c.schedule == "interleaved" && !c.local && !c.workers.empty() && !c.plan_splits) {
    for (int s : c.splits) {
      if (s % static_cast<int>(c.workers.size()) != 0) {
        return Bad(absl::StrCat("--schedule interleaved runs micro-batches in rounds of one per worker: --splits ",
                                s, " is not a multiple of the ", c.workers.size(), " pipeline workers: give --splits ",
                                std::max<int>(1, s / static_cast<int>(c.workers.size())) * c.workers.size(),
                                " (or another multiple), or --schedule 1f1b"));
      }
    }
  }
  for (int s : c.splits) {
    if (s * c.replicas > c.batch_size) {
      return Bad(absl::StrCat("--splits ", s, c.replicas > 1 ? absl::StrCat(" x --replicas ", c.replicas) : "",
                              " exceeds --batch-size ", c.batch_size,
                              ": every micro-batch needs at least one image; give --splits ",
                              std::max<int64_t>(1, c.batch_size / c.replicas), " or fewer, or --batch-size ",
                              int64_t{s} * c.replicas, " or more"));
    }
  }
  // A batch norm in training fails on one row (LibTorch: "Expected more than
  // 1 value per channel"); the stages are looked at only where it matters.
  for (int s : c.splits) {
    const int64_t parts = int64_t{s} * c.replicas, rows = c.batch_size / parts;
    if (line.ps_mode || rows >= 2 || RowsPerPart(c) < 2) continue;
    // Fewer splits help only where one split per replica leaves 2 rows
    // (not at --splits 1 already, nor with too many replicas).
    const int64_t fewer = c.batch_size / (2 * c.replicas);
    const std::string splits_fix = fewer >= 1 ? absl::StrCat("--splits ", fewer, " or fewer, or ") : "";
    const std::string cut = absl::StrCat("--splits ", s,
                                         c.replicas > 1 ? absl::StrCat(" x --replicas ", c.replicas) : "");
    return Bad(absl::StrCat(cut, " cuts --batch-size ", c.batch_size, " into micro-batches of ", rows, " image, and ",
                            c.model.empty() ? "ResNet50" : "the --model",
                            "'s batch norm needs 2 or more in each: give ", splits_fix, "--batch-size ", 2 * parts,
                            " or more (2 images x ", cut, ")"));
  }
  if (auto s = CheckCheckpoints(line, f.given, cut); !s.ok()) return s;
  // (After --resume auto is resolved: a fresh directory resumes nothing.)
  if (auto e = CheckPlanFlags(c, f, line.ps_mode, cut); !e.empty()) return Bad(e);
  if (auto s = CheckElastic(line); !s.ok()) return s;
  if (c.replicas > 1 && (!line.security.token.empty() || line.security.tls.enabled()) &&
      !f.insecure_collectives) {
    return Bad(absl::StrCat(
        "--replicas with ", line.security.tls.enabled() ? "TLS" : "a token",
        ": data parallelism's gradients go over Gloo's connections between the replicas, which neither check "
        "the token nor encrypt: they cross the network in clear text; give --insecure-collectives to accept "
        "that on a trusted network, or train without --replicas"));
  }
  c.threads_auto = !f.given.count("threads");
  c.coordinator_threads =
      line.ps_mode || (f.given.count("threads") && !c.compare_local) ? c.threads : 1;
  if (std::string unused = UnusedFlags(f.given, c); !unused.empty()) {
    line.note = line.note.empty() ? unused : absl::StrCat(line.note, "\n", unused);
  }
  return line;
}

absl::StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args) {
  std::vector<std::string> storage = {"master"};
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : storage) argv.push_back(a.data());
  Flags flags = DefaultFlags();
  launch::FlagParser parser("master", "");
  AddFlags(parser, &flags);
  int code = 0;
  if (!parser.Parse(static_cast<int>(argv.size()), argv.data(), &code)) {
    return Bad(absl::StrCat("the parser stopped with exit code ", code, " (it printed why)"));
  }
  flags.given = parser.given();
  return Check(std::move(flags));
}

// (The optimizer the flags give: runs.h.)
optim::OptimizerOptions OptimizerOf(const RunOptions& c) {
  optim::LrSchedule schedule;
  schedule.kind = optim::LrScheduleKindNamed(c.lr_schedule).value_or(optim::LrSchedule::Kind::kConstant);
  schedule.warmup_steps = c.warmup_steps;
  schedule.decay_steps = c.decay_steps;
  schedule.min_lr = c.min_lr >= 0 ? c.min_lr : c.lr / 10;
  if (c.optimizer == "adam") return optim::OptimizerOptions::Adam(c.lr).set_schedule(schedule);
  if (c.optimizer == "adamw") {
    return optim::OptimizerOptions::AdamW(c.lr)
        .set_weight_decay(c.weight_decay)
        .set_decay_all(c.decay_all)
        .set_schedule(schedule);
  }
  const bool demo = c.dataset.empty() && c.model.empty();
  return optim::OptimizerOptions::SGD(c.lr).set_momentum(demo ? 0.0 : c.momentum).set_schedule(schedule);
}

std::string DescribeSchedule(const optim::OptimizerOptions& o) {
  const optim::LrSchedule& s = o.schedule;
  if (!s.scheduled()) return "";
  std::string out = optim::LrScheduleName(s.kind);
  if (s.warmup_steps > 0) absl::StrAppend(&out, " warmup-steps=", s.warmup_steps);
  if (s.kind != optim::LrSchedule::Kind::kConstant) {
    absl::StrAppend(&out, " min-lr=", s.min_lr, " decay-steps=",
                    s.decay_steps > 0 ? absl::StrCat(s.decay_steps) : "the run's last");
  }
  return out;
}

}  // namespace remora::master
