// One backward pass split in two, for zero-bubble schedules (Qi et al.,
// "Zero Bubble Pipeline Parallelism"): B, the gradients of a stage's inputs
// (what the previous stage waits for), then later W, the gradients of its
// parameters, from what B kept (internal to autograd/; not installed).
//
//   SplitBackward pass(outputs, output_grads, inputs, params);
//   std::vector<at::Tensor> dx = pass.Inputs().value();    // B: send dx on
//   ...                                                     // other work
//   std::vector<at::Tensor> dw = pass.Weights().value();   // W
//
// B runs the part of the autograd graph that leads to the inputs. Where
// that part meets a path to some parameters (a convolution's or a matrix
// product's node), B leaves those parameters' gradients out and keeps the
// gradient arriving at the node; W later runs from those kept gradients
// down to the parameters only. At a normalization's node (whose weights'
// gradients come from the reductions its input's gradient needs anyway)
// or a TorchScript graph's fused node (which computes every gradient
// whenever it runs) W would redo most of B's work, so B computes those
// parameters' gradients itself: on ResNet50's blocks B + W took 13% more
// than one pass when W ran the batch norms again, 4-5% since.
// B then W gives what one backward pass gives, bitwise, where each
// parameter's gradient comes from one place. Where the graph does not
// allow the split (a parameter reached through two nodes B runs, one after
// the other; a stage that returns its input or a parameter), B runs the whole
// backward pass and W hands out what it computed: split() says which.
//
// Thread-safety: one thread at a time. Ownership: holds the graph (through
// the outputs) and the kept gradients until W ends or it is destroyed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace remora::autograd {

class SplitBackward {
 public:
  // `grads`: one per output (the gradient arriving at it). `inputs` and
  // `params` are leaves; those that need no gradient get none.
  SplitBackward(std::vector<at::Tensor> outputs, std::vector<at::Tensor> grads, std::vector<at::Tensor> inputs,
                std::vector<at::Tensor> params);
  ~SplitBackward();
  SplitBackward(const SplitBackward&) = delete;
  SplitBackward& operator=(const SplitBackward&) = delete;

  // B: the inputs' gradients, in order (undefined where none reaches).
  // Once; an error names what failed.
  absl::StatusOr<std::vector<at::Tensor>> Inputs();
  // W: the parameters' gradients, in order (undefined where none
  // reaches). Once, after Inputs; frees the graph.
  absl::StatusOr<std::vector<at::Tensor>> Weights();

  // Whether B and W are two passes (else B ran the whole backward), and
  // why not, in words ("" when split).
  bool split() const;
  std::string why_not_split() const;
  // Bytes of the gradients kept from B for W.
  int64_t held_bytes() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace remora::autograd
