// A learning-rate schedule: warm-up, then decay, by step number, as
// nanoGPT's get_lr and torchtitan's warm-up + decay schedulers do.
//
//   optim::LrSchedule s{optim::LrSchedule::Kind::kCosine, /*warmup_steps=*/100,
//                       /*decay_steps=*/5000, /*min_lr=*/6e-5};
//   double lr = optim::ScheduledLr(6e-4, s, step);   // step 0 is the first
//
// Step n < warmup_steps runs at lr * (n + 1) / warmup_steps; then the rate
// falls from lr to min_lr over the steps up to decay_steps (cosine: half a
// cosine; linear: a straight line) and stays at min_lr after. kConstant
// keeps lr after the warm-up. Every owner of parameters applies it to its
// own optimizer before each step (optim::MakeOptimizer), counting its steps,
// and saves the count with the optimizer's state so a resumed run goes on
// where it stopped.
//
// Thread-safety: plain values and a pure function.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace remora::optim {

struct LrSchedule {
  enum class Kind { kConstant, kCosine, kLinear };
  Kind kind = Kind::kConstant;
  int64_t warmup_steps = 0;
  int64_t decay_steps = 0;  // the step at which the rate reaches min_lr
  double min_lr = 0.0;

  // Whether the rate ever differs from the optimizer's lr.
  bool scheduled() const { return kind != Kind::kConstant || warmup_steps > 0; }
};

// The learning rate of step `step` (0 for the first) of an optimizer whose
// rate is `lr`.
double ScheduledLr(double lr, const LrSchedule& schedule, int64_t step);

// "constant", "cosine" or "linear"; the name of a kind.
absl::StatusOr<LrSchedule::Kind> LrScheduleKindNamed(const std::string& name);
std::string LrScheduleName(LrSchedule::Kind kind);

}  // namespace remora::optim
