#include "tests/support/split_checks.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/utils.h>

#include "autograd/split_backward.h"

namespace remora::test_support {

void ExpectSplitEqualsWhole(const SplitCase& c) {
  SCOPED_TRACE(c.name);
  const at::Tensor x = c.input.is_floating_point() ? c.input.detach().requires_grad_(true) : c.input;
  torch::manual_seed(3);
  const at::Tensor y = c.forward(x);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const at::Tensor g = at::randn(y.sizes(), gen, y.options());
  std::vector<at::Tensor> wanted = c.params;
  if (x.requires_grad()) wanted.insert(wanted.begin(), x);
  const std::vector<at::Tensor> whole =
      torch::autograd::grad({y}, wanted, {g}, /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);

  const at::Tensor x2 = c.input.is_floating_point() ? c.input.detach().requires_grad_(true) : c.input;
  torch::manual_seed(3);
  autograd::SplitBackward pass({c.forward(x2)}, {g}, {x2}, c.params);
  EXPECT_EQ(pass.split(), c.splits);
  EXPECT_EQ(pass.why_not_split().empty(), c.splits) << pass.why_not_split();
  EXPECT_FALSE(pass.Weights().ok()) << "W before B";
  auto dx = pass.Inputs();
  ASSERT_TRUE(dx.ok()) << dx.status();
  ASSERT_EQ(dx->size(), 1u);
  if (c.splits && c.kept && x2.requires_grad()) {
    EXPECT_GT(pass.held_bytes(), 0) << "B keeps what W needs";
  }
  auto dw = pass.Weights();
  ASSERT_TRUE(dw.ok()) << dw.status();
  EXPECT_FALSE(pass.Weights().ok()) << "W twice";
  ASSERT_EQ(dw->size(), c.params.size());
  size_t k = 0;
  if (x2.requires_grad()) {
    ASSERT_TRUE((*dx)[0].defined());
    EXPECT_TRUE((*dx)[0].equal(whole[k++])) << "the input's gradient";
  } else {
    EXPECT_FALSE((*dx)[0].defined());
  }
  for (size_t p = 0; p < c.params.size(); ++p, ++k) {
    ASSERT_EQ((*dw)[p].defined(), whole[k].defined()) << "parameter " << p;
    if (whole[k].defined()) {
      EXPECT_TRUE((*dw)[p].equal(whole[k])) << "parameter " << p;
    }
  }
  // Nothing was accumulated into the parameters themselves.
  for (const at::Tensor& p : c.params) EXPECT_FALSE(p.grad().defined());
}

}  // namespace remora::test_support
