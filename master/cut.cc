// How the ResNet50 demo, the GPT of a text or a one-file sequential
// --model is cut into stages over the workers: the split points, the
// stages per worker and the balanced partition measured on them.
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_util.h"
#include "pipeline/partition.h"
#include "pipeline/planner.h"
#include "shards/gpt.h"
#include "shards/protocol.h"
#include "shards/resnet.h"
#include "master/runs.h"

namespace remora::master {

std::vector<int> SplitPoints(const RunOptions& c) {
  if (c.model.empty() && !TrainsGpt(c) && c.partition == "tutorial") return {shards::TutorialSplit()[1]};
  return c.split_at;
}

absl::StatusOr<int> StagesPerWorker(const RunOptions& c, int num_layers) {
  const int n = static_cast<int>(c.workers.size());
  const std::vector<int> split_at = SplitPoints(c);
  int per_worker = c.interleave;
  if (per_worker == 0 && !split_at.empty()) {
    const int stages = static_cast<int>(split_at.size()) + 1;
    if (stages % n != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--split-at makes ", stages, " stages for ", n, " workers: stage k runs on worker k mod ",
          n, ", so give a multiple of ", n, " stages (", n - 1, ", ", 2 * n - 1, ", ... split points)"));
    }
    per_worker = stages / n;
  } else if (per_worker == 0) {
    // Two halve the pipeline's fill and drain, where every stage gets a
    // layer; 1f1b and zb1p asked for by name run one stage per worker,
    // zbv two.
    per_worker = c.schedule == "zbv" || (n >= 2 && num_layers >= 2 * n && c.schedule != "1f1b" &&
                                         c.schedule != "zb1p")
                     ? 2
                     : 1;
  }
  if (n * per_worker > num_layers) {
    // (--interleave or --split-at named only where given: its default is
    // one stage per worker when the layers are few.)
    const char* why = c.interleave > 0 ? " (--interleave)" : !split_at.empty() ? " (--split-at)" : "";
    if (c.sequential) {
      std::vector<std::string> fixes;
      const int most = num_layers / per_worker;
      if (most >= 2) fixes.push_back(absl::StrCat("give at most ", most, " workers per pipeline"));
      if (most == 1 && per_worker == 1) fixes.push_back("give one worker per pipeline (it trains the model whole)");
      if (c.interleave > 1) fixes.push_back("a smaller --interleave");
      fixes.push_back("export one TorchScript file per stage (--model DIR of stage0.pt, stage1.pt, ...)");
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot cut ", c.sequential->label(), " into ", n * per_worker, " stages (", n, " workers x ", per_worker,
          " per worker", why, "): it has ", num_layers, num_layers == 1 ? " layer" : " layers",
          " (child modules, or the statements of its forward between which one tensor crosses) and each stage "
          "needs one; ", absl::StrJoin(fixes, ", or ")));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        n, " workers x ", per_worker, " stages per worker", why, " is more stages than the ",
        num_layers, " layers there are to cut"));
  }
  if (!split_at.empty()) {
    RETURN_IF_ERROR(pipeline::SplitAt(num_layers, split_at, n * per_worker).status());
  }
  return per_worker;
}

// The model PartitionStages cuts: the one-file --model, the GPT's parts
// or ResNet50's blocks.
pipeline::SequentialModel ModelToCut(const RunOptions& c) {
  if (c.sequential) return *c.sequential;
  if (TrainsGpt(c)) {
    const std::vector<c10::IValue> args = GptPart(c, 0, 0).args;  // (first, last, the rest)
    return pipeline::SequentialModel::Registered(shards::GptArgs::kFunction,
                                                 static_cast<int>(shards::GptParts(c.layers)),
                                                 std::vector<c10::IValue>(args.begin() + 2, args.end()));
  }
  return pipeline::SequentialModel::Registered("ResNetShard", shards::kResNetBlocks, {int64_t{c.seed}});
}

int LayersToCut(const RunOptions& c) {
  return c.sequential ? c.sequential->num_layers()
         : TrainsGpt(c) ? static_cast<int>(shards::GptParts(c.layers))
                        : shards::kResNetBlocks;
}

namespace {

// One micro-batch of `rows` inputs for timing the layers.
absl::StatusOr<c10::IValue> SampleOf(const RunOptions& c, int64_t rows) {
  if (ReadsText(c)) return c10::IValue(at::zeros({rows, c.seq_len}, at::kLong));  // (the tokens' values cost alike)
  ASSIGN_OR_RETURN(auto batch, MakeBatch(c, 0));
  return c10::IValue(batch.first.slice(0, 0, std::min<int64_t>(rows, batch.first.size(0))).clone());
}

}  // namespace

absl::Status PlanRun(rpc::Agent& agent, RunOptions& c, int64_t batch_rows) {
  if (!c.plan_schedule && !c.plan_splits) return absl::OkStatus();
  const pipeline::SequentialModel model = ModelToCut(c);
  const int n = static_cast<int>(c.workers.size());
  pipeline::PlanOptions o;
  o.workers = n;
  o.batch_rows = std::max<int64_t>(1, batch_rows / c.replicas);  // (one pipeline's)
  if (c.plan_splits) {
    // 1, 2, 4, ... and n, 2n, 4n, ... (interleaved's rounds), at most 32
    // micro-batches of two rows or more (batch norm needs two).
    std::set<int> counts = {1};
    for (int first : {1, n}) {
      for (int m = first; m <= 32 && 2 * m <= o.batch_rows; m *= 2) counts.insert(m);
    }
    o.micro_batches.assign(counts.begin(), counts.end());
  } else {
    o.micro_batches = c.splits;
  }
  if (c.plan_schedule || c.schedule == "auto") {
    // --interleave given keeps to schedules of that many stages per worker.
    o.schedules.clear();
    for (const char* name : {"1f1b", "interleaved", "zb1p", "zbv"}) {
      const int per_worker = std::string(name) == "interleaved" || std::string(name) == "zbv" ? 2 : 1;
      // (B and W apart need the step runners: a named loss.)
      const bool split = std::string(name) == "zb1p" || std::string(name) == "zbv";
      if ((c.interleave == 0 || c.interleave == per_worker) && !(split && Loss(c).name().empty())) {
        o.schedules.push_back(name);
      }
    }
    if (o.schedules.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--interleave ", c.interleave, " with --schedule auto: the "
                                                     "planner's schedules run 1 or 2 stages per worker; give --interleave 1 "
                                                     "or 2, or name a --schedule"));
    }
  } else {
    o.schedules = {c.schedule};
    o.stages_per_worker = c.interleave;  // (0: the schedule's own)
  }
  // Two micro-batch sizes (what the fewest and the most micro-batches
  // give, within 4x of each other: the larger is timed too) and a crossing.
  const int most = *std::max_element(o.micro_batches.begin(), o.micro_batches.end());
  const int64_t small = std::max<int64_t>(1, std::min<int64_t>(16, o.batch_rows / most));
  const int64_t large = std::min<int64_t>(o.batch_rows, 4 * small);
  std::cout << "planning: timing each layer of " << model.label() << " (forward, B and W) at " << small
            << (large != small ? absl::StrCat(" and ", large) : std::string()) << " rows on "
            << absl::StrJoin(c.workers, ", ") << " at once, and a crossing ..." << std::endl;
  ASSIGN_OR_RETURN(const c10::IValue small_sample, SampleOf(c, small));
  RETURN_IF_ERROR(model.Check(small_sample));
  ASSIGN_OR_RETURN(const pipeline::LayerTimes at_small,
                   pipeline::MeasureMeanLayers(agent, model, c.workers, small_sample, /*repeats=*/2));
  pipeline::LayerTimes at_large = at_small;
  std::vector<pipeline::LayerCost> layers;
  if (large != small) {
    ASSIGN_OR_RETURN(const c10::IValue large_sample, SampleOf(c, large));
    ASSIGN_OR_RETURN(at_large, pipeline::MeasureMeanLayers(agent, model, c.workers, large_sample, /*repeats=*/2));
    ASSIGN_OR_RETURN(layers, pipeline::FitLayerCosts(at_small, small, at_large, large));
  } else {  // (one size: no fixed part)
    const std::vector<double> total = at_small.Total();
    for (size_t i = 0; i < total.size(); ++i) {
      pipeline::LayerCost l{0.0, total[i] / static_cast<double>(small)};
      if (total[i] > 0) {
        l.forward_share = at_small.forward_ms[i] / total[i];
        l.input_share = at_small.input_ms[i] / total[i];
      }
      layers.push_back(l);
    }
  }
  // The parts' shares of every layer timed, for the table's heading.
  double parts[3] = {0, 0, 0};
  const pipeline::LayerTimes* timed[] = {&at_small, &at_large};
  for (const pipeline::LayerTimes* t : timed) {
    for (size_t i = 0; i < t->forward_ms.size(); ++i) {
      parts[0] += t->forward_ms[i];
      parts[1] += t->input_ms[i];
      parts[2] += t->weight_ms[i];
    }
  }
  const double all = std::max(1e-12, parts[0] + parts[1] + parts[2]);
  if (n > 1) {
    ASSIGN_OR_RETURN(o.crossing_ms, pipeline::MeasureCrossing(agent, c.workers[0], small_sample));
  }
  ASSIGN_OR_RETURN(const pipeline::Plan plan, pipeline::MakePlan(layers, o));
  const pipeline::Candidate& best = plan.best();
  std::cout << absl::StrFormat("plan (a crossing %.2f ms; of the layers' time as timed, F %.0f%%, B %.0f%%, "
                               "W %.0f%%):\n",
                               o.crossing_ms, 100 * parts[0] / all, 100 * parts[1] / all, 100 * parts[2] / all)
            << plan.Describe()
            << absl::StrFormat("plan: --schedule %s --splits %d, predicted %.1f ms a step\n", best.schedule,
                               best.micro_batches, best.step_ms)
            << std::flush;
  c.schedule = best.schedule;
  c.splits = {best.micro_batches};
  c.interleave = best.stages_per_worker;
  c.split_at.assign(best.bounds.begin() + 1, best.bounds.end() - 1);
  c.planned_step_ms = best.step_ms;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<pipeline::StageSpec>> PartitionStages(rpc::Agent& agent, const RunOptions& c) {
  const pipeline::SequentialModel model = ModelToCut(c);
  pipeline::PartitionOptions p;
  p.split_at = SplitPoints(c);
  ASSIGN_OR_RETURN(p.stages_per_worker, StagesPerWorker(c, model.num_layers()));
  p.schedule = c.schedule;
  p.micro_batches = *std::max_element(c.splits.begin(), c.splits.end());
  if (p.split_at.empty()) {
    // One micro-batch of the largest split count, at most 16 rows.
    const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(16, c.batch_size / p.micro_batches));
    ASSIGN_OR_RETURN(p.sample, SampleOf(c, rows));
    // Every worker times every layer at once: in the pipeline the stages run
    // side by side and share the machine's memory bandwidth and caches, and
    // layers suffer from that unequally (timed alone on one worker, the
    // split came out up to 9% off the stages' busy times in the trace).
    std::cout << "measuring per-layer cost of " << model.label() << " (forward + backward, "
              << rows << " rows) on " << absl::StrJoin(c.workers, ", ") << " at once ..."
              << std::endl;
  }
  auto cut = pipeline::Partition(agent, model, c.workers, p);
  if (!cut.ok() && c.sequential &&
      absl::StrContains(cut.status().message(), ") does not take the ")) {
    // Say where the input's shape came from.
    return absl::Status(cut.status().code(), absl::StrCat(
        cut.status().message(), "; one input is ", absl::StrJoin(c.input_shape, ","),
        c.dataset.empty() ? (c.input_shape_given ? " (--input-shape)" : " (--input-shape's default)")
                          : absl::StrCat(" (--dataset ", c.dataset, "'s images)")));
  }
  if (!cut.ok()) return cut.status();
  std::cout << cut->Describe(c.workers);
  if (c.sequential) {
    // What each stage of a one-file model holds, by its layers' names.
    for (size_t k = 0; k + 1 < cut->bounds.size(); ++k) {
      const int first = cut->bounds[k], last = cut->bounds[k + 1];
      std::cout << "  stage " << k << " on " << c.workers[cut->placement[k]] << ": "
                << model.layer_name(first)
                << (last - first > 1 ? absl::StrCat(last - first > 2 ? " ... " : ", ", model.layer_name(last - 1))
                                     : std::string())
                << "\n";
    }
  }
  std::cout << std::flush;
  return cut->stages;
}

}  // namespace remora::master
