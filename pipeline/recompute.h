// Activation recomputation (StageSpec::recompute, master --recompute): a
// stage's training forward pass as one autograd node that keeps only the
// pass's inputs, runs the forward without autograd's graph, and in its
// backward runs it again with the graph to take the gradients through it.
//
//   c10::IValue y = RecomputedForward(module, x);  // instead of module.Forward(x)
//
// The same values and gradients as module.Forward(x) (bit for bit for
// LibTorch modules and, on a CPU, TorchScript ones; on CUDA TorchScript's
// executor may round differently when it runs a graph without autograd),
// with less held until the backward pass.
//
// Thread-safety: the node's backward uses `module` without a lock: the
// caller keeps the module alive until then and runs nothing else on it at
// the same time (a worker's compute lane runs one action at a time).
#pragma once

#include <functional>

#include <ATen/core/ivalue.h>

#include "pipeline/stage.h"

namespace remora::pipeline {

// `bf16`: the forward passes (the first and the one in the backward pass)
// run under Bf16Autocast.
c10::IValue RecomputedForward(StageModule& module, const c10::IValue& x, bool bf16 = false);

// Mixed precision (StageSpec::precision "bf16"): while it lives, this
// thread's CPU and CUDA autocast compute in bfloat16, as
// torch.autocast(device, dtype=torch.bfloat16) does: matrix products and
// convolutions in bf16, norms, softmax and losses in float32, the
// parameters float32 as they are (their gradients too). `on` false:
// nothing changes. The thread's earlier state comes back when it ends.
// Thread-compatible: one per thread, scoped.
class Bf16Autocast {
 public:
  explicit Bf16Autocast(bool on);
  ~Bf16Autocast();
  Bf16Autocast(const Bf16Autocast&) = delete;
  Bf16Autocast& operator=(const Bf16Autocast&) = delete;

 private:
  const bool on_;
  bool cpu_was_ = false, cuda_was_ = false;
  c10::ScalarType cpu_dtype_was_ = c10::ScalarType::BFloat16, cuda_dtype_was_ = c10::ScalarType::Half;
};

// `value` with its float32 tensors as bf16 (what crosses a stage boundary
// under bf16: half the bytes, the gradient coming back in bf16 too), and
// with its bf16 tensors as float32 (what a loss takes).
c10::IValue ToBf16(const c10::IValue& value);
c10::IValue ToFloat32(const c10::IValue& value);

// `value` with `fn` applied to every tensor inside (tuples and lists too),
// in order (what a stage's input and output may hold).
c10::IValue MapTensors(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor&)>& fn);

}  // namespace remora::pipeline
