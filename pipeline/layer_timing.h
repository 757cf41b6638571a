// One layer timed the way a zero-bubble schedule runs it: its forward (F),
// its input's gradient (B) and its parameters' gradients (W) apart, for
// the planner (remora.pipeline.layer_costs; pipeline/planner.h). Internal
// to pipeline/ (not installed).
//
//   LayerTiming t = TimeLayer(*layer, input, device, /*repeats=*/2,
//                             /*input_needs_grad=*/true);
//   t.forward_ms, t.input_ms, t.weight_ms  // the fastest of the runs, each
//   t.output                               // the next layer's input
//
// B and W are autograd::SplitBackward's two passes, as the step
// runners run them under zb1p and zbv; a layer whose graph does not split
// runs its whole backward in B (W then 0), as it would there.
//
// Thread-safety: one thread at a time per layer.
#pragma once

#include <cstdint>

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include "pipeline/stage.h"

namespace remora::pipeline {

struct LayerTiming {
  double forward_ms = 0;
  double input_ms = 0;   // B
  double weight_ms = 0;  // W
  c10::IValue output;    // the last run's forward, detached
};

// Runs `layer` (in training mode) on `input` `repeats` times (at least
// once), its backward from the sum of its floating-point outputs, and
// keeps the fastest of each part. With `input_needs_grad` the input's
// floating-point tensors are leaves that need a gradient, as a stage
// receives them from the one before; without (a model's first layer, fed
// the batch as a pipeline's first stage is) no input's gradient is
// computed, B is 0 and W the whole backward. Throws what the layer throws.
LayerTiming TimeLayer(StageModule& layer, const c10::IValue& input, c10::Device device, int64_t repeats,
                      bool input_needs_grad);

}  // namespace remora::pipeline
