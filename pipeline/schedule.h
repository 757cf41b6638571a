// Pipeline schedules as data: for each worker, the ordered list of the
// forward and backward actions of its stages for one batch. Workers run
// their actions in exactly this order (see ComputeTurn and LaneAction).
//
//   auto s = pipeline::MakeSchedule("1f1b", /*workers=*/2, /*stages_per_worker=*/1,
//                                   /*micro_batches=*/8).value();
//   s.actions[0]  // worker 0: F0 F1 B0 F2 B1 ... B7 (stage 0)
//
// Stage k lives on worker k % workers (with several stages per worker:
// Megatron-LM's interleaved "virtual" stages), except in zbv's V. The
// generators:
//
//   gpipe        every forward, then every backward (any stages per worker)
//   1f1b         PipeDream-flush: stage s runs (stages - s - 1) warm-up
//                forwards, then alternates one forward and one backward,
//                then drains; it holds at most (stages - s) micro-batches'
//                activations instead of all of them (one stage per worker)
//   interleaved  interleaved 1F1B over virtual stages (Megatron-LM): 1F1B
//                in groups of `workers` micro-batches, chunk by chunk; the
//                fill and drain shrink by the stages per worker (two or more
//                stages per worker; micro-batches a multiple of workers)
//   zb1p         ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"):
//                1F1B with each backward split into B (the input's
//                gradient, on the critical path) and W (the weights',
//                which can wait); stage s runs W(i) after B(i + s), so it
//                holds at most `stages` micro-batches (1F1B's peak, stage
//                0's) and the W's fill the drain (one stage per worker;
//                the step runners, with a named loss, run it).
//   zbv          ZB-V (the same paper): two stages per worker in a V,
//                stage k and stage 2 workers - 1 - k on worker k, so that
//                worker 0 holds the first and the last; the order is
//                built by running the pipeline with unit F, B and W times,
//                each worker taking the first ready of: a forward (the
//                second leg's first) while it holds fewer than 2 workers
//                micro-batches of its two half-size stages (1F1B's peak,
//                on worker 0), B, W (or B before F where that ends
//                sooner). From 2 workers micro-batches on, each worker
//                idles workers - 1 units, what the first forward takes to
//                reach the last worker, against 1F1B's 6 (workers - 1) in
//                the same half-stage units. B and W as in zb1p.
//
// Thread-safety: plain values.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace remora::pipeline {

struct Action {
  // kBackward is the whole backward pass, or in a schedule with kWeight
  // actions only its input part (B); kWeight the weights' part (W).
  enum Kind { kForward, kBackward, kWeight };
  Kind kind = kForward;
  int stage = 0;
  int micro_batch = 0;

  friend bool operator==(const Action& a, const Action& b) {
    return a.kind == b.kind && a.stage == b.stage && a.micro_batch == b.micro_batch;
  }
  std::string ToString() const;  // "F3@1": forward of micro-batch 3 through stage 1; "B3@1", "W3@1"
};

struct Schedule {
  std::string name;
  int workers = 0;
  int stages = 0;  // workers * stages per worker
  int micro_batches = 0;
  std::vector<std::vector<Action>> actions;  // per worker, in order
  std::vector<int> placement;                // stage k's worker; empty: k % workers

  int WorkerOf(int stage) const { return placement.empty() ? stage % workers : placement[stage]; }
  // Whether backward passes are split into B and W actions.
  bool SplitsBackward() const;
  std::string ToString() const;  // one line per worker
};

// The schedule names MakeSchedule knows.
const std::vector<std::string>& ScheduleNames();

// Where schedule `name` places each of `workers * stages_per_worker`
// stages: stage k on worker result[k] (k % workers but for zbv's V).
std::vector<int> StagePlacement(const std::string& name, int workers, int stages_per_worker);

// A schedule by name; InvalidArgument for unknown names and shapes the
// generator does not take (with what to do instead).
absl::StatusOr<Schedule> MakeSchedule(const std::string& name, int workers,
                                      int stages_per_worker, int micro_batches);

// What running a schedule gives (a worker runs one action at a time, in
// its order, as soon as the action's inputs are ready: F(s, i) after
// F(s - 1, i); B(s, i) after B(s + 1, i), or F(s, i) on the last stage;
// W(s, i) after B(s, i)).
struct Simulation {
  int makespan = 0;                // time units for the whole batch
  std::vector<int> idle;           // per worker: makespan - its busy time
  std::vector<int> peak_in_flight; // per stage: most micro-batches forwarded
                                   // and not yet through their backward
                                   // (their W, where split) at once
};

// How long actions take, in time units. A split schedule's B takes
// `input` and its W `weight`; a whole backward pass takes both.
struct ActionCosts {
  int forward = 1;
  int input = 1;
  int weight = 1;
};

// Checks that every forward and backward of every (stage, micro-batch)
// appears exactly once (and its W, in a split schedule), on the stage's
// worker, and that the orders can run (no worker waits forever: the
// dependencies above are respected), and simulates it with each action
// taking one unit. FailedPrecondition names the first problem.
absl::StatusOr<Simulation> Simulate(const Schedule& schedule);
// The same with actions taking `costs` (each at least 1).
absl::StatusOr<Simulation> Simulate(const Schedule& schedule, const ActionCosts& costs);

}  // namespace remora::pipeline
