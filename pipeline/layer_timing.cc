#include "pipeline/layer_timing.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ops/ones_like.h>
#include <torch/cuda.h>

#include "absl/status/status.h"
#include "autograd/split_backward.h"
#include "pipeline/recompute.h"
#include "trace/trace.h"

namespace remora::pipeline {
namespace {

void Synchronize(c10::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

double MsSince(int64_t start_us) { return static_cast<double>(trace::NowUs() - start_us) / 1000.0; }

// The tensors of `v` that need a gradient.
std::vector<at::Tensor> GradTensors(const c10::IValue& v) {
  std::vector<at::Tensor> out;
  MapTensors(v, [&out](const at::Tensor& t) {
    if (t.requires_grad()) out.push_back(t);
    return t;
  });
  return out;
}

}  // namespace

LayerTiming TimeLayer(StageModule& layer, const c10::IValue& input, c10::Device device, int64_t repeats,
                      bool input_needs_grad) {
  // A fresh leaf for each floating-point input, as a stage receives it.
  // (A first stage's batch needs no gradient: timing the first layer's
  // input gradient, which ResNet50's stem takes half its backward on,
  // made the first stage look dearer than it runs.)
  const c10::IValue in = MapTensors(input, [input_needs_grad](const at::Tensor& t) {
    return t.is_floating_point() ? t.detach().requires_grad_(input_needs_grad) : t;
  });
  const std::vector<at::Tensor> inputs = GradTensors(in);
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : layer.Parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  LayerTiming best;
  best.forward_ms = best.input_ms = best.weight_ms = std::numeric_limits<double>::infinity();
  c10::IValue out;
  for (int64_t rep = 0; rep < std::max<int64_t>(1, repeats); ++rep) {
    Synchronize(device);
    int64_t start = trace::NowUs();
    out = layer.Forward(in);
    Synchronize(device);
    best.forward_ms = std::min(best.forward_ms, MsSince(start));
    std::vector<at::Tensor> outputs = GradTensors(out);
    double input_ms = 0, weight_ms = 0;
    if (!outputs.empty()) {
      // (The gradient of a sum of the outputs: ones.)
      std::vector<at::Tensor> grads;
      for (const at::Tensor& o : outputs) grads.push_back(at::ones_like(o));
      start = trace::NowUs();
      autograd::SplitBackward pass(std::move(outputs), std::move(grads), inputs, params);
      // (Without inputs to differentiate, B has nothing to do: the pass's
      // set-up counts with W, and B is 0.)
      absl::Status failed = pass.Inputs().status();
      if (!inputs.empty()) {
        Synchronize(device);
        input_ms = MsSince(start);
        start = trace::NowUs();
      }
      if (failed.ok()) failed = pass.Weights().status();
      Synchronize(device);
      weight_ms = MsSince(start);
      if (!failed.ok()) throw std::runtime_error(std::string(failed.message()));
    }
    best.input_ms = std::min(best.input_ms, input_ms);
    best.weight_ms = std::min(best.weight_ms, weight_ms);
  }
  best.output = MapTensors(out, [](const at::Tensor& t) { return t.detach(); });
  return best;
}

}  // namespace remora::pipeline
