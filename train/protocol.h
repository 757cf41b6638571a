// The calls a training program makes on its workers besides the
// subsystems' own (those live in each subsystem's protocol.h): tracing the
// workers' actions for the timeline, and their deterministic algorithms.
// One struct each (rpc/call.h), used by both sides.
//
// Thread-safety: plain structs.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/ivalue.h>

#include "rpc/call.h"

namespace remora::train {

// Starts or stops recording the worker's action slices (runtime/trace.h).
struct TraceEnableRequest {
  static constexpr char kFunction[] = "trace_enable";
  bool on = false;
  template <typename Fields>
  void Visit(Fields& f) {
    f("on", on);
  }
};

// "trace_collect" (no arguments) replies with the slices recorded since the
// last call: a list of these, as tuples.
inline constexpr char kTraceCollect[] = "trace_collect";
struct TraceSliceValue {
  static constexpr char kFunction[] = "trace_collect (a slice)";
  std::string name;
  int64_t micro_batch = -1;
  int64_t start_us = 0;
  int64_t end_us = 0;
  std::string stage;
  template <typename Fields>
  void Visit(Fields& f) {
    f("name", name)("micro_batch", micro_batch)("start_us", start_us)("end_us", end_us)("stage", stage);
  }
};

// (no arguments): runtime::UseDeterministicAlgorithms on the worker.
inline constexpr char kUseDeterministicAlgorithms[] = "use_deterministic_algorithms";

}  // namespace remora::train
