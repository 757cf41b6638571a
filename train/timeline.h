// Pictures of a pipeline run: a Chrome/Perfetto trace (JSON) and an SVG
// Gantt chart, one track per worker, one slice per micro-batch forward,
// backward and optimizer step; and the bubble, each worker's idle time
// within the steps, measured from the same slices beside what the
// schedule itself leaves idle.
//
//   train::Bubble b = train::MeasureBubble(run.slices, workers.size()).value();
//   b.schedule_fraction = train::ScheduleBubble(schedule).value();
//   out << train::FormatBubble(b, workers);
//
// Thread-compatible: functions over values the caller owns.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace remora::pipeline {
struct Schedule;
}  // namespace remora::pipeline

namespace remora::train {

struct TimelineSlice {
  int track;             // index into the track names
  // forward, backward, eval, step or allreduce (compute); else a copy or a
  // wait (input, settle, loss reply; the master's take batch, send, wait),
  // which the trace shows on a second row and the SVG leaves out.
  std::string name;
  int64_t micro_batch;   // -1 for none
  int64_t start_us;      // since the run started
  int64_t end_us;
  std::string stage;     // the worker's stage, e.g. "blocks [8, 13)"; may be empty
};

absl::Status WriteChromeTrace(const std::string& path, const std::vector<std::string>& tracks,
                              const std::vector<TimelineSlice>& slices);

// A row per track, named with the stages its slices ran ("worker1:
// stage 0"); each forward (light) and backward (dark) labelled F or B with
// its micro-batch, coloured by micro-batch; the optimizer step grey; idle
// time left white, with each row's idle share of the measured steps at its
// end (MeasureBubble), and a legend. `micro_batches` sets the colour wheel.
absl::Status WriteTimelineSvg(const std::string& path, const std::vector<std::string>& tracks,
                              const std::vector<TimelineSlice>& slices, int micro_batches);

// A worker's time within the measured steps, per step.
struct WorkerTime {
  double busy_s = 0;  // computing: forward, backward, eval, optimizer step, gradient sum
  double idle_s = 0;  // the rest of the step: waiting for activations, gradients or the next batch
  double idle_fraction() const { return busy_s + idle_s > 0 ? idle_s / (busy_s + idle_s) : 0; }
};

// The bubble of a traced pipeline run: over its traced steps after the
// first (which warms up) and before any evaluation, from the first action
// of the second step on any worker to the end of the last step's
// optimizer step on every worker.
struct Bubble {
  int64_t steps = 0;              // steps measured
  double step_s = 0;              // their mean time
  std::vector<WorkerTime> workers;  // per track (worker), per step
  double fraction = 0;            // idle / (workers x step time): the step's bubble
  // What the schedule itself leaves idle (ScheduleBubble); -1: not known.
  double schedule_fraction = -1;
  bool schedule_split = false;  // the schedule splits backward passes (B and W)
};

// Measures the bubble on tracks 0 .. workers - 1 of `slices` (later tracks,
// the master's, are left out). A step ends at each worker's optimizer step
// ("step" slice). FailedPrecondition when a worker traced fewer than two
// steps.
absl::StatusOr<Bubble> MeasureBubble(const std::vector<TimelineSlice>& slices, int workers);

// The fraction of workers x makespan that `schedule` leaves idle when
// every forward and every backward takes the same time (the simulator's,
// pipeline/schedule.h): (S - 1) / (M + S - 1) for GPipe and 1F1B.
absl::StatusOr<double> ScheduleBubble(const pipeline::Schedule& schedule);

// Lines for the console: the step's bubble beside the schedule's, then
// each worker's busy and idle time per step ("  worker1: busy 0.812 s,
// idle 0.203 s (20.0%)").
std::string FormatBubble(const Bubble& b, const std::vector<std::string>& workers);

}  // namespace remora::train
