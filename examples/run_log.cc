// What the master's runs report as they go: TensorBoard event files
// (--tensorboard) and the batch lines.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "examples/master_runs.h"

namespace remora::master {

absl::StatusOr<std::shared_ptr<train::RunLog>> OpenRunLog(const Config& c, int splits) {
  if (c.tensorboard.empty()) return train::RunLog::Open("");
  return train::RunLog::Open(c.splits.size() > 1 ? absl::StrCat(c.tensorboard, "/splits-", splits) : c.tensorboard);
}

void RecordBatch(Run& run, int b, double loss, double seconds, int64_t rows) {
  run.AddBatch(b, loss, seconds, rows);
  PrintBatch(b, loss, seconds);
}

}  // namespace remora::master
