// Pictures of a pipeline run: a Chrome/Perfetto trace (JSON) and an SVG
// Gantt chart, one track per worker, one slice per micro-batch forward,
// backward and optimizer step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

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

// `micro_batches` sets the colour wheel: one hue per micro-batch.
absl::Status WriteTimelineSvg(const std::string& path, const std::vector<std::string>& tracks,
                              const std::vector<TimelineSlice>& slices, int micro_batches);

}  // namespace remora::train
