// What the master's runs report as they go: TensorBoard event files
// (--tensorboard) and the batch lines.
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "train/runs.h"

namespace remora::train::runs {

absl::StatusOr<std::shared_ptr<train::RunLog>> OpenRunLog(const RunOptions& c, int splits) {
  if (c.tensorboard.empty()) return train::RunLog::Open("");
  return train::RunLog::Open(c.splits.size() > 1 ? absl::StrCat(c.tensorboard, "/splits-", splits) : c.tensorboard);
}

void RecordBatch(Run& run, int b, double loss, double seconds, int64_t rows) {
  // (Said where the losses turn not finite: once for a run that diverged.)
  const bool first_not_finite = !std::isfinite(loss) && (run.losses.empty() || std::isfinite(run.losses.back()));
  run.AddBatch(b, loss, seconds, rows);
  PrintBatch(b, loss, seconds);
  if (first_not_finite) {
    std::printf("warning: the loss is %g at batch %d: the training diverged (a lower --lr?); it goes on\n", loss, b);
  }
}

}  // namespace remora::train::runs
