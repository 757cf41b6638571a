// pipeline::CountCorrect's top-1 and top-5 counts and cross-entropy, for
// a classifier's logits and a language model's.
#include "pipeline/accuracy.h"

#include <cmath>
#include <string>

#include <ATen/ops/argmax.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/eq.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace remora::pipeline {
namespace {

// Top-1: the highest logit is the label's; top-5: the label's logit is
// among the five highest (every row where there are five classes or fewer).
TEST(Accuracy, CountCorrectCountsTopOneAndTopFive) {
  // 7 classes; the label's rank in each row: 1st, 2nd, 5th, 6th, 7th.
  const at::Tensor logits = at::tensor({7., 6., 5., 4., 3., 2., 1.}).repeat({5, 1});
  const at::Tensor labels = at::tensor({0, 1, 4, 5, 6}, at::kLong);
  auto c = CountCorrect(logits, labels);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->top1, 1);
  EXPECT_EQ(c->top5, 3);
  EXPECT_EQ(c->rows, 5);
  EXPECT_DOUBLE_EQ(c->accuracy(), 0.2);
  EXPECT_DOUBLE_EQ(c->top5_accuracy(), 0.6);
  // Three classes: top-5 is every row.
  auto few = CountCorrect(logits.slice(1, 0, 3), at::tensor({0, 1, 2, 0, 1}, at::kLong));
  ASSERT_TRUE(few.ok()) << few.status();
  EXPECT_EQ(few->top1, 2);
  EXPECT_EQ(few->top5, 5);
  EXPECT_FALSE(CountCorrect(logits, labels.slice(0, 0, 4)).ok());
  EXPECT_FALSE(CountCorrect(logits.sum(1), labels).ok());
  // The cross-entropy summed over the rows, PyTorch's mean times the rows.
  const double mean = at::cross_entropy_loss(logits, labels).item<double>();
  EXPECT_NEAR(c->loss(), mean, 1e-6 * mean);
  EXPECT_NEAR(c->loss_sum, 5 * mean, 1e-5 * mean);
}

// A language model's logits [rows, T, vocab] against labels [rows, T]:
// every position is a label (items = rows x T), and the loss is the
// causal language-model loss (cross-entropy over every position).
TEST(Accuracy, CountCorrectCountsEveryPositionOfALanguageModel) {
  const at::Tensor logits = at::randn({3, 4, 11}, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor labels = at::randint(11, {3, 4}, at::kLong);
  auto c = CountCorrect(logits, labels);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rows, 3);
  EXPECT_EQ(c->items, 12);
  const at::Tensor flat = logits.reshape({12, 11});
  EXPECT_EQ(c->top1, flat.argmax(1).eq(labels.reshape({12})).sum().item<int64_t>());
  EXPECT_DOUBLE_EQ(c->accuracy(), static_cast<double>(c->top1) / 12);
  const double mean = at::cross_entropy_loss(flat, labels.reshape({12})).item<double>();
  EXPECT_NEAR(c->loss(), mean, 1e-6 * mean);
  // Summed with a classifier's count (items 0: one a row), each counts.
  Correct sum = *c;
  sum += Correct{1, 1, 2};
  EXPECT_EQ(sum.counted(), 14);
  EXPECT_EQ(sum.rows, 5);
  // A shape that is not the labels' and the vocabulary is named.
  auto wrong = CountCorrect(logits.slice(1, 0, 3), labels);
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(std::string(wrong.status().message()), ::testing::HasSubstr("[3, 4, classes]"));
  // A label beyond the classes (a model with too few outputs) is counted
  // wrong and adds no loss; the evaluation goes on.
  auto beyond = CountCorrect(at::zeros({2, 3}), at::tensor({1, 7}, at::kLong));
  ASSERT_TRUE(beyond.ok()) << beyond.status();
  EXPECT_EQ(beyond->top1, 0);
  EXPECT_NEAR(beyond->loss_sum, std::log(3.0), 1e-6);
}

}  // namespace
}  // namespace remora::pipeline
