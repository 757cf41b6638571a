// Activation recomputation (StageSpec::recompute, master --recompute): a
// stage's training forward pass as one autograd node that keeps only the
// pass's inputs, runs the forward without autograd's graph, and in its
// backward runs it again with the graph to take the gradients through it.
//
//   c10::IValue y = RecomputedForward(module, x);  // instead of module.Forward(x)
//
// The same values and gradients as module.Forward(x) (bit for bit for
// LibTorch modules; TorchScript's executor may round differently when it
// runs a graph without autograd), with less held until the backward pass.
//
// Thread-safety: the node's backward uses `module` without a lock: the
// caller keeps the module alive until then and runs nothing else on it at
// the same time (a worker's compute lane runs one action at a time).
#pragma once

#include <functional>

#include <ATen/core/ivalue.h>

#include "pipeline/stage.h"

namespace remora::pipeline {

c10::IValue RecomputedForward(StageModule& module, const c10::IValue& x);

// `value` with `fn` applied to every tensor inside (tuples and lists too),
// in order (what a stage's input and output may hold).
c10::IValue MapTensors(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor&)>& fn);

}  // namespace remora::pipeline
