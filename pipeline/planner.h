// The schedule simulator as a planner: a step's time predicted for each
// schedule and micro-batch count from what the model's layers cost, so
// that `--schedule auto` and `--splits auto` pick the fastest.
//
//   // Each layer's F, B and W, timed at two micro-batch sizes
//   // (pipeline::MeasureMeanLayers, pipeline/partition.h):
//   auto layers = pipeline::FitLayerCosts(at_8_rows, 8, at_32_rows, 32).value();
//   pipeline::PlanOptions o;
//   o.workers = 2;
//   o.batch_rows = 64;
//   o.schedules = {"1f1b", "zb1p"};
//   o.micro_batches = {1, 2, 4, 8};
//   o.crossing_ms = 0.4;
//   pipeline::Plan plan = pipeline::MakePlan(layers, o).value();
//   std::cout << plan.Describe();  // a table, the chosen row marked
//   plan.best().schedule, plan.best().micro_batches, plan.best().bounds
//
// The model: a layer costs fixed_ms + per_row_ms x rows for a micro-batch
// of `rows` (the fixed part is what small micro-batches waste: kernel
// launches, dispatch, the runner's own work per action); a stage costs the
// sum of its layers; of a layer's cost, the forward, the input's gradient
// (B) and the weights' (W) each take the share they took when timed (a
// third each, the split the zero-bubble paper assumes, where only totals
// are given); every activation or gradient that passes
// from one worker to another arrives `crossing_ms` after it was made.
// Each candidate is cut as Partition would cut it and run through
// Predict. The default candidates hold about 1F1B's activations or a
// little more (interleaved); gpipe, which holds every micro-batch at once,
// is one only when named. A micro-batch is batch_rows / m rows (the
// pipeline's are that, give or take one).
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/schedule.h"

namespace remora::pipeline {

// What one stage's actions take for one micro-batch, in milliseconds. A
// schedule without W actions runs B and W as one backward.
struct StageTimes {
  double forward_ms = 0;
  double input_ms = 0;   // B: the input's gradient
  double weight_ms = 0;  // W: the parameters' gradients
};

// A schedule run with measured times.
struct Timing {
  double makespan_ms = 0;
  std::vector<double> idle_ms;      // per worker: makespan - its busy time
  std::vector<int> peak_in_flight;  // per stage, as Simulation's
  double bubble() const;            // idle / (workers x makespan)
};

// Runs `schedule` (each worker its actions in order, each as soon as its
// inputs are there) with stage k's actions taking `stages[k]`, an action
// whose input was made on another worker starting no sooner than
// `crossing_ms` after that. With F, B and W 1 (W 0 where the schedule does
// not split backward passes) and no crossing it gives Simulate's makespan,
// idle times and peaks. Errors as Simulate's, and
// InvalidArgument for a stage count other than the schedule's or a
// negative time.
absl::StatusOr<Timing> Predict(const Schedule& schedule, const std::vector<StageTimes>& stages,
                               double crossing_ms);

// The cut of layers whose F, B and W are `layers` (one StageTimes per
// layer) into `schedule`'s stages whose predicted step (Predict) is
// shortest. Where a worker hosts several stages (zbv's V) the stages
// balanced one by one (BalancedSplit) can leave one worker busier than the
// others; the prediction sees workers, dependencies and the split
// backward. Every cut is tried where there are at most a few thousand;
// beyond, from the balanced cut, runs of neighbouring bounds move a layer
// at a time while the prediction improves (within 3% of the best cut on
// random layers).
// Returns the stages + 1 bounds; errors as BalancedSplit's and Predict's.
absl::StatusOr<std::vector<int>> PredictedSplit(const Schedule& schedule, const std::vector<StageTimes>& layers,
                                                double crossing_ms);

// A layer's forward + backward for a micro-batch of `rows` rows, and the
// shares of it that the forward (F) and the input's gradient (B) take; the
// weights' gradients (W) take the rest.
struct LayerCost {
  double fixed_ms = 0;
  double per_row_ms = 0;
  double forward_share = 1.0 / 3;
  double input_share = 1.0 / 3;
  double at(double rows) const { return fixed_ms + per_row_ms * rows; }
  double weight_share() const {
    const double rest = 1.0 - forward_share - input_share;
    return rest > 0 ? rest : 0.0;  // (never below 0 by rounding)
  }
};

// Each layer's F, B and W in milliseconds at one micro-batch size, as the
// workers time them (remora.pipeline.layer_costs).
struct LayerTimes {
  std::vector<double> forward_ms;
  std::vector<double> input_ms;
  std::vector<double> weight_ms;
  std::vector<double> Total() const;  // F + B + W, per layer
};

// The line through each layer's two timings (`ms_a` at `rows_a` rows,
// `ms_b` at `rows_b`). Timing noise can make a layer look cheaper at more
// rows (then a fixed cost, the smaller count's timing) or dearer per row
// than in all (then the line through 0 and the larger count's timing): its
// slope and intercept are kept at 0 or more. InvalidArgument for
// lists of different lengths or row counts that are not two different
// positive numbers.
absl::StatusOr<std::vector<LayerCost>> FitLayerCosts(const std::vector<double>& ms_a, int64_t rows_a,
                                                     const std::vector<double>& ms_b, int64_t rows_b);
// The same through each layer's totals, with its F and B shares those of
// both timings together (a third each for a layer timed at 0). Also
// InvalidArgument for parts of different lengths or below 0.
absl::StatusOr<std::vector<LayerCost>> FitLayerCosts(const LayerTimes& a, int64_t rows_a, const LayerTimes& b,
                                                     int64_t rows_b);

struct PlanOptions {
  int workers = 1;
  int64_t batch_rows = 1;  // a batch's rows (one replica's)
  // Candidates: schedules by name (pipeline/schedule.h; interleaved and
  // zbv place two stages on each worker) and micro-batch counts. A pair
  // the schedule cannot run (too few layers for its stages, micro-batches
  // that interleaved cannot group, more micro-batches than rows) is listed
  // with why and not chosen.
  std::vector<std::string> schedules = {"1f1b", "interleaved", "zb1p", "zbv"};
  std::vector<int> micro_batches = {1, 2, 4, 8};
  // Stages per worker for every schedule; 0: two for interleaved and zbv,
  // one for the others.
  int stages_per_worker = 0;
  double crossing_ms = 0;
};

struct Candidate {
  std::string schedule;
  int micro_batches = 0;
  int stages_per_worker = 1;
  std::vector<int> bounds;   // stage k has layers [bounds[k], bounds[k + 1])
  double step_ms = 0;        // predicted
  double bubble = 0;         // predicted idle share
  int64_t peak_rows = 0;     // most rows of activations one stage holds at once (a worker
                             // of interleaved or zbv hosts two stages)
  std::string why_not;       // not empty: the pair cannot run (and was not timed)
};

struct Plan {
  std::vector<Candidate> candidates;  // schedules x micro-batch counts, in the order given
  int chosen = -1;                    // the fastest that can run (ties: fewer micro-batches)
  const Candidate& best() const { return candidates[chosen]; }
  // A table: schedule, micro-batches, predicted step and bubble, peak rows
  // held, the chosen one marked; pairs that cannot run with why.
  std::string Describe() const;
};

// Predicts every candidate pair for `layers` and picks the fastest.
// InvalidArgument when no pair can run (saying why for each) or the
// options are out of range.
absl::StatusOr<Plan> MakePlan(const std::vector<LayerCost>& layers, const PlanOptions& options);

}  // namespace remora::pipeline
