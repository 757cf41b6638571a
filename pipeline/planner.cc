#include "pipeline/planner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_util.h"
#include "pipeline/partition.h"

namespace remora::pipeline {

double Timing::bubble() const {
  double idle = 0;
  for (double x : idle_ms) idle += x;
  const double all = makespan_ms * static_cast<double>(idle_ms.size());
  return all > 0 ? idle / all : 0;
}

namespace {

// An error for times that do not fit the schedule (a count other than its
// stages', a negative one). (Predict also asks Simulate about the order.)
absl::Status CheckTimes(const Schedule& schedule, const std::vector<StageTimes>& stages, double crossing_ms) {
  if (static_cast<int>(stages.size()) != schedule.stages) {
    return absl::InvalidArgumentError(absl::StrCat("predict: ", stages.size(), " stage times for the ",
                                                   schedule.stages, " stages of schedule ", schedule.name));
  }
  for (const StageTimes& t : stages) {
    if (t.forward_ms < 0 || t.input_ms < 0 || t.weight_ms < 0) {
      return absl::InvalidArgumentError("predict: a stage time is negative");
    }
  }
  if (crossing_ms < 0) return absl::InvalidArgumentError("predict: the crossing time is negative");
  return absl::OkStatus();
}

// The most micro-batches each stage holds at once. A stage's actions are
// all on its worker, in that worker's order, so the order gives what the
// stage holds over time (until its backward, or its W where it splits).
std::vector<int> PeakInFlight(const Schedule& schedule, bool split) {
  std::vector<int> peak(schedule.stages, 0), held(schedule.stages, 0);
  for (int w = 0; w < schedule.workers; ++w) {
    for (const Action& a : schedule.actions[w]) {
      if (a.kind == Action::kForward) {
        ++held[a.stage];
      } else if (a.kind == (split ? Action::kWeight : Action::kBackward)) {
        --held[a.stage];
      }
      peak[a.stage] = std::max(peak[a.stage], held[a.stage]);
    }
  }
  return peak;
}

// Predict's run, of a schedule Simulate accepted and times CheckTimes
// accepted.
Timing RunOrders(const Schedule& schedule, const std::vector<StageTimes>& stages, double crossing_ms) {
  const int n = schedule.workers, S = schedule.stages;
  const bool split = schedule.SplitsBackward();
  auto duration = [&](const Action& a) {
    const StageTimes& t = stages[a.stage];
    if (a.kind == Action::kForward) return t.forward_ms;
    if (a.kind == Action::kWeight) return t.weight_ms;
    return split ? t.input_ms : t.input_ms + t.weight_ms;
  };
  std::map<std::tuple<int, int, int>, double> end;  // (kind, stage, micro-batch) -> when it ended
  // When `a`'s input is there; none while the action making it has not
  // been placed yet.
  auto ready = [&](const Action& a) -> std::optional<double> {
    auto after = [&](Action::Kind kind, int stage) -> std::optional<double> {
      auto it = end.find({kind, stage, a.micro_batch});
      if (it == end.end()) return std::nullopt;
      const bool crosses = schedule.WorkerOf(stage) != schedule.WorkerOf(a.stage);
      return it->second + (crosses ? crossing_ms : 0.0);
    };
    if (a.kind == Action::kForward) {
      return a.stage == 0 ? std::optional<double>(0.0) : after(Action::kForward, a.stage - 1);
    }
    if (a.kind == Action::kWeight) return after(Action::kBackward, a.stage);
    return a.stage == S - 1 ? after(Action::kForward, a.stage) : after(Action::kBackward, a.stage + 1);
  };
  // Each worker runs its order; an action's start depends only on its
  // worker's previous action and its input, so workers can be advanced in
  // any order as long as inputs are placed first.
  Timing timing;
  std::vector<size_t> next(n, 0);
  std::vector<double> free_at(n, 0), busy(n, 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (int w = 0; w < n; ++w) {
      const std::vector<Action>& order = schedule.actions[w];
      while (next[w] < order.size()) {
        const Action& a = order[next[w]];
        const std::optional<double> input = ready(a);
        if (!input) break;
        const double d = duration(a);
        const double start = std::max(free_at[w], *input);
        end[{a.kind, a.stage, a.micro_batch}] = start + d;
        free_at[w] = start + d;
        busy[w] += d;
        timing.makespan_ms = std::max(timing.makespan_ms, start + d);
        ++next[w];
        moved = true;
      }
    }
  }
  // (Simulate ran the same orders to the end, so every action was placed.)
  timing.idle_ms.resize(n);
  for (int w = 0; w < n; ++w) timing.idle_ms[w] = timing.makespan_ms - busy[w];
  timing.peak_in_flight = PeakInFlight(schedule, split);
  return timing;
}

// Stage k's times: the sum of `layers` [bounds[k], bounds[k + 1]).
std::vector<StageTimes> SumStages(const std::vector<StageTimes>& layers, const std::vector<int>& bounds) {
  std::vector<StageTimes> stages(bounds.size() - 1);
  for (size_t k = 0; k + 1 < bounds.size(); ++k) {
    for (int i = bounds[k]; i < bounds[k + 1]; ++i) {
      stages[k].forward_ms += layers[i].forward_ms;
      stages[k].input_ms += layers[i].input_ms;
      stages[k].weight_ms += layers[i].weight_ms;
    }
  }
  return stages;
}

}  // namespace

absl::StatusOr<Timing> Predict(const Schedule& schedule, const std::vector<StageTimes>& stages,
                               double crossing_ms) {
  RETURN_IF_ERROR(CheckTimes(schedule, stages, crossing_ms));
  // The order's validity (every action once, on its stage's worker) is
  // Simulate's to check; its unit-time run is cheap beside a step.
  RETURN_IF_ERROR(Simulate(schedule).status());
  return RunOrders(schedule, stages, crossing_ms);
}

namespace {

// Up to this many cuts PredictedSplit tries every one (a few ms: ResNet50's
// 18 blocks in four stages are 680).
constexpr double kEveryCutUpTo = 5000;

// Whether `layers` layers have at most `limit` cuts into `parts` stages,
// C(layers - 1, parts - 1).
bool AtMostCuts(int layers, int parts, double limit) {
  double cuts = 1;
  for (int i = 1; i < parts; ++i) {
    cuts = cuts * (layers - i) / i;
    if (cuts > limit) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::vector<int>> PredictedSplit(const Schedule& schedule, const std::vector<StageTimes>& layers,
                                                double crossing_ms) {
  std::vector<double> totals;
  for (const StageTimes& l : layers) totals.push_back(l.forward_ms + l.input_ms + l.weight_ms);
  ASSIGN_OR_RETURN(std::vector<int> bounds, BalancedSplit(totals, schedule.stages));
  // (The order is checked once, not for each of up to thousands of cuts.)
  RETURN_IF_ERROR(Simulate(schedule).status());
  const auto step_ms = [&](const std::vector<int>& b) -> absl::StatusOr<double> {
    const std::vector<StageTimes> stages = SumStages(layers, b);
    RETURN_IF_ERROR(CheckTimes(schedule, stages, crossing_ms));
    return RunOrders(schedule, stages, crossing_ms).makespan_ms;
  };
  ASSIGN_OR_RETURN(double best_ms, step_ms(bounds));
  const int n = static_cast<int>(layers.size()), parts = schedule.stages;
  if (AtMostCuts(n, parts, kEveryCutUpTo)) {
    // Every cut (first to last in order; ties keep the balanced one).
    std::vector<int> b(parts + 1, n);
    for (int k = 0; k < parts; ++k) b[k] = k;
    for (;;) {
      ASSIGN_OR_RETURN(const double ms, step_ms(b));
      if (ms < best_ms * (1 - 1e-9)) best_ms = ms, bounds = b;
      int k = parts - 1;  // the last inner bound that can move on
      while (k >= 1 && b[k] == n - (parts - k)) --k;
      if (k < 1) break;
      ++b[k];
      for (int j = k + 1; j < parts; ++j) b[j] = b[j - 1] + 1;
    }
    return bounds;
  }
  // Too many to try: each round takes the best of the moves by one layer
  // of any run of neighbouring bounds together (one bound alone is stuck
  // where a layer must cross several stages to even the workers out); the
  // step gets strictly shorter every round, so the climb ends.
  for (bool moved = true; moved;) {
    moved = false;
    std::vector<int> best_bounds;
    for (int first = 1; first < parts; ++first) {
      for (int last = first; last < parts; ++last) {
        for (const int by : {-1, 1}) {
          std::vector<int> b = bounds;
          for (int k = first; k <= last; ++k) b[k] += by;
          if (b[first] <= b[first - 1] || b[last] >= b[last + 1]) continue;
          ASSIGN_OR_RETURN(const double ms, step_ms(b));
          if (ms < best_ms * (1 - 1e-9)) best_ms = ms, best_bounds = std::move(b);
        }
      }
    }
    if (!best_bounds.empty()) bounds = std::move(best_bounds), moved = true;
  }
  return bounds;
}

absl::StatusOr<std::vector<LayerCost>> FitLayerCosts(const std::vector<double>& ms_a, int64_t rows_a,
                                                     const std::vector<double>& ms_b, int64_t rows_b) {
  if (ms_a.size() != ms_b.size()) {
    return absl::InvalidArgumentError(absl::StrCat("fitting layer costs: ", ms_a.size(), " timings at ", rows_a,
                                                   " rows but ", ms_b.size(), " at ", rows_b));
  }
  if (rows_a < 1 || rows_b < 1 || rows_a == rows_b) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fitting layer costs needs timings at two different positive row counts, not ", rows_a, " and ", rows_b));
  }
  std::vector<LayerCost> out;
  for (size_t i = 0; i < ms_a.size(); ++i) {
    LayerCost c;
    const bool a_fewer = rows_a < rows_b;
    const double few_ms = a_fewer ? ms_a[i] : ms_b[i], many_ms = a_fewer ? ms_b[i] : ms_a[i];
    const double few = static_cast<double>(a_fewer ? rows_a : rows_b), many = static_cast<double>(a_fewer ? rows_b : rows_a);
    c.per_row_ms = std::max(0.0, (many_ms - few_ms) / (many - few));
    c.fixed_ms = few_ms - c.per_row_ms * few;
    if (c.fixed_ms < 0) {  // (dearer per row than in all: through 0 instead)
      c.fixed_ms = 0;
      c.per_row_ms = std::max(0.0, many_ms) / many;
    }
    out.push_back(c);
  }
  return out;
}

std::vector<double> LayerTimes::Total() const {
  std::vector<double> out;
  for (size_t i = 0; i < forward_ms.size() && i < input_ms.size() && i < weight_ms.size(); ++i) {
    out.push_back(forward_ms[i] + input_ms[i] + weight_ms[i]);
  }
  return out;
}

absl::StatusOr<std::vector<LayerCost>> FitLayerCosts(const LayerTimes& a, int64_t rows_a, const LayerTimes& b,
                                                     int64_t rows_b) {
  for (const LayerTimes* t : {&a, &b}) {
    const size_t n = t->forward_ms.size();
    if (t->input_ms.size() != n || t->weight_ms.size() != n) {
      return absl::InvalidArgumentError(absl::StrCat("fitting layer costs: ", n, " forward timings but ",
                                                     t->input_ms.size(), " of B and ", t->weight_ms.size(), " of W"));
    }
    for (size_t i = 0; i < n; ++i) {
      if (t->forward_ms[i] < 0 || t->input_ms[i] < 0 || t->weight_ms[i] < 0) {
        return absl::InvalidArgumentError(absl::StrCat("fitting layer costs: layer ", i, " timed below 0 ms"));
      }
    }
  }
  ASSIGN_OR_RETURN(std::vector<LayerCost> out, FitLayerCosts(a.Total(), rows_a, b.Total(), rows_b));
  for (size_t i = 0; i < out.size(); ++i) {
    const double forward = a.forward_ms[i] + b.forward_ms[i], input = a.input_ms[i] + b.input_ms[i];
    const double total = forward + input + a.weight_ms[i] + b.weight_ms[i];
    if (total > 0) {
      out[i].forward_share = forward / total;
      out[i].input_share = input / total;
    }
  }
  return out;
}

namespace {

// One schedule at one micro-batch count: cut, timed, or why it cannot run.
Candidate Evaluate(const std::vector<LayerCost>& layers, const PlanOptions& o, const std::string& name, int m) {
  Candidate c;
  c.schedule = name;
  c.micro_batches = m;
  c.stages_per_worker = o.stages_per_worker > 0 ? o.stages_per_worker : name == "interleaved" || name == "zbv" ? 2 : 1;
  const int n = o.workers, parts = n * c.stages_per_worker;
  if (m > o.batch_rows) {
    c.why_not = absl::StrCat("more micro-batches than the batch's ", o.batch_rows, " rows");
    return c;
  }
  if (parts > static_cast<int>(layers.size())) {
    c.why_not = absl::StrCat(parts, " stages need ", parts, " layers; the model has ", layers.size());
    return c;
  }
  absl::StatusOr<Schedule> schedule = MakeSchedule(name, n, c.stages_per_worker, m);
  if (!schedule.ok()) {
    c.why_not = std::string(schedule.status().message());
    return c;
  }
  const double rows = static_cast<double>(o.batch_rows) / m;
  std::vector<double> costs;
  std::vector<StageTimes> layer_times;
  for (const LayerCost& l : layers) {
    costs.push_back(l.at(rows));
    layer_times.push_back({costs.back() * l.forward_share, costs.back() * l.input_share,
                           costs.back() * l.weight_share()});
  }
  absl::StatusOr<std::vector<int>> bounds = name == "zbv" ? PredictedSplit(*schedule, layer_times, o.crossing_ms)
                                                          : InterleavedSplit(costs, n, c.stages_per_worker, m);
  if (!bounds.ok()) {
    c.why_not = std::string(bounds.status().message());
    return c;
  }
  c.bounds = *bounds;
  absl::StatusOr<Timing> t = Predict(*schedule, SumStages(layer_times, c.bounds), o.crossing_ms);
  if (!t.ok()) {
    c.why_not = std::string(t.status().message());
    return c;
  }
  c.step_ms = t->makespan_ms;
  c.bubble = t->bubble();
  c.peak_rows = (o.batch_rows + m - 1) / m * *std::max_element(t->peak_in_flight.begin(), t->peak_in_flight.end());
  return c;
}

}  // namespace

absl::StatusOr<Plan> MakePlan(const std::vector<LayerCost>& layers, const PlanOptions& o) {
  if (o.workers < 1 || o.batch_rows < 1 || layers.empty() || o.crossing_ms < 0 || o.stages_per_worker < 0) {
    return absl::InvalidArgumentError(absl::StrCat("plan: needs a worker, a row, a layer and a crossing time of 0 "
                                                   "or more; got ", o.workers, " workers, ", o.batch_rows, " rows, ",
                                                   layers.size(), " layers, ", o.crossing_ms, " ms"));
  }
  if (o.schedules.empty() || o.micro_batches.empty()) {
    return absl::InvalidArgumentError("plan: no schedules or no micro-batch counts to choose from");
  }
  Plan plan;
  for (const std::string& name : o.schedules) {
    for (int m : o.micro_batches) {
      if (m < 1) return absl::InvalidArgumentError(absl::StrCat("plan: ", m, " micro-batches"));
      plan.candidates.push_back(Evaluate(layers, o, name, m));
      const Candidate& c = plan.candidates.back();
      if (!c.why_not.empty()) continue;
      if (plan.chosen < 0) {
        plan.chosen = static_cast<int>(plan.candidates.size()) - 1;
        continue;
      }
      const Candidate& best = plan.best();
      // Within a part in a million is a tie, which fewer micro-batches win.
      const bool tie = std::abs(c.step_ms - best.step_ms) <= 1e-6 * best.step_ms;
      if (tie ? c.micro_batches < best.micro_batches : c.step_ms < best.step_ms) {
        plan.chosen = static_cast<int>(plan.candidates.size()) - 1;
      }
    }
  }
  if (plan.chosen < 0) {
    std::vector<std::string> why;
    for (const Candidate& c : plan.candidates) {
      why.push_back(absl::StrCat(c.schedule, " at ", c.micro_batches, " micro-batches: ", c.why_not));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("no schedule and micro-batch count can run: ", absl::StrJoin(why, "; ")));
  }
  return plan;
}

std::string Plan::Describe() const {
  std::string out = absl::StrFormat("  %-12s %6s %12s %7s %10s\n", "schedule", "splits", "step (pred.)", "bubble",
                                    "peak rows");
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    const char* mark = static_cast<int>(i) == chosen ? "*" : " ";
    if (!c.why_not.empty()) {
      absl::StrAppendFormat(&out, "%s %-12s %6d  cannot run: %s\n", mark, c.schedule, c.micro_batches, c.why_not);
      continue;
    }
    absl::StrAppendFormat(&out, "%s %-12s %6d %9.1f ms %6.1f%% %10d\n", mark, c.schedule, c.micro_batches,
                          c.step_ms, 100 * c.bubble, c.peak_rows);
  }
  return out;
}

}  // namespace remora::pipeline
