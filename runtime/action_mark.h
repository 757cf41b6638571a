// Marks in the autograd graph: which pipeline action a backward pass that
// starts from a stage's output belongs to.
//
// A stage marks each output tensor that requires grad with its forward
// action's stage and micro-batch (an identity node). When gradients for that
// output come back, distributed autograd reads the mark from the root it
// starts from, takes the compute lane for the backward action (in the
// schedule's order, see ComputeTurn) and labels the trace slice with it.
#pragma once

#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "runtime/compute_lane.h"

namespace remora::runtime {

struct ActionMarkInfo {
  LaneAction action;  // backward = true: the action a backward pass from here is
  std::string stage;  // the stage's label in traces, e.g. "stage 1"
  // The pass is split (pipeline/split_backward.h): `action` computes the
  // inputs' gradients (B), action.Weight() the parameters' (W), later.
  bool split = false;
  // With `split`: the allocation tag (runtime/allocator.h) B runs under,
  // the forward pass's, so that what it keeps for W counts with the
  // stage's saved activations; -1: none.
  int64_t hold_tag = -1;
};

// `output` behind an identity node that carries `info` (returns `output`
// itself when it does not require grad).
at::Tensor MarkAction(const at::Tensor& output, const ActionMarkInfo& info);

// The mark directly on `root`'s grad_fn, if it has one.
std::optional<ActionMarkInfo> MarkedAction(const at::Tensor& root);

}  // namespace remora::runtime
