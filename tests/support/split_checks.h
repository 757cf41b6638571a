// A stage's backward pass split in two (autograd/split_backward.h) against
// one whole pass, for tests: B then W must give the same gradients bitwise.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace remora::test_support {

// A stage to split: its forward on the input (run twice, from the same
// random state) and its parameters.
struct SplitCase {
  std::string name;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::vector<at::Tensor> params;
  at::Tensor input;
  bool splits = true;  // whether B and W are two passes
  // Whether B keeps gradients for W (a product's weight is left to W); a
  // TorchScript graph's fused node computes every gradient in B.
  bool kept = true;
};

// One backward pass against B then W, bitwise (GoogleTest failures); also
// that W refuses to run before B or twice, that B keeps what W needs
// (`kept`), and that nothing accumulates into the parameters' .grad.
void ExpectSplitEqualsWhole(const SplitCase& c);

}  // namespace remora::test_support
