#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace remora::optim {

constexpr double kPi = 3.14159265358979323846;

double ScheduledLr(double lr, const LrSchedule& s, int64_t step) {
  if (step < s.warmup_steps) return lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  if (s.kind == LrSchedule::Kind::kConstant) return lr;
  const int64_t span = s.decay_steps - s.warmup_steps;
  const double done =
      span <= 0 ? 1.0 : std::clamp(static_cast<double>(step - s.warmup_steps) / static_cast<double>(span), 0.0, 1.0);
  if (s.kind == LrSchedule::Kind::kLinear) return lr + (s.min_lr - lr) * done;
  return s.min_lr + (lr - s.min_lr) * 0.5 * (1.0 + std::cos(kPi * done));
}

absl::StatusOr<LrSchedule::Kind> LrScheduleKindNamed(const std::string& name) {
  if (name == "constant") return LrSchedule::Kind::kConstant;
  if (name == "cosine") return LrSchedule::Kind::kCosine;
  if (name == "linear") return LrSchedule::Kind::kLinear;
  return absl::InvalidArgumentError(
      absl::StrCat("learning-rate schedule must be constant, cosine or linear; got '", name, "'"));
}

std::string LrScheduleName(LrSchedule::Kind kind) {
  switch (kind) {
    case LrSchedule::Kind::kConstant: return "constant";
    case LrSchedule::Kind::kCosine: return "cosine";
    case LrSchedule::Kind::kLinear: return "linear";
  }
  return "unknown";
}

}  // namespace remora::optim
