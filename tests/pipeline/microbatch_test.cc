// Micro-batch split and merge, without sockets.
#include "pipeline/microbatch.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <gtest/gtest.h>

namespace remora::pipeline {
namespace {

TEST(MicroBatch, SplitsIntoExactlyMPartsDifferingByAtMostOne) {
  at::Tensor x = at::arange(10).reshape({10, 1});
  auto parts = SplitMicroBatches(x, 4).value();
  ASSERT_EQ(parts.size(), 4u);
  std::vector<int64_t> rows;
  for (const auto& p : parts) rows.push_back(p.toTensor().size(0));
  EXPECT_EQ(rows, (std::vector<int64_t>{3, 3, 2, 2}));
  // 6 rows into 4: torch.chunk would give 3 parts; this gives 4.
  EXPECT_EQ(SplitMicroBatches(at::arange(6), 4).value().size(), 4u);
  auto merged = MergeMicroBatches(parts).value();
  EXPECT_TRUE(at::allclose(merged.toTensor(), x));
}

TEST(MicroBatch, TuplesAndListsSplitElementByElement) {
  c10::IValue batch = c10::ivalue::Tuple::create(
      {at::arange(8).reshape({4, 2}), int64_t{7}, at::arange(4)});
  auto parts = SplitMicroBatches(batch, 2).value();
  ASSERT_EQ(parts.size(), 2u);
  const auto& e = parts[1].toTupleRef().elements();
  EXPECT_EQ(e[0].toTensor().size(0), 2);
  EXPECT_EQ(e[1].toInt(), 7);  // copied into every micro-batch
  EXPECT_EQ(e[2].toTensor()[0].item<int64_t>(), 2);
  auto merged = MergeMicroBatches(parts).value();
  EXPECT_TRUE(at::allclose(merged.toTupleRef().elements()[0].toTensor(),
                           batch.toTupleRef().elements()[0].toTensor()));
  c10::List<at::Tensor> list({at::arange(6), at::arange(6) * 2});
  auto lparts = SplitMicroBatches(list, 3).value();
  ASSERT_EQ(lparts.size(), 3u);
  EXPECT_TRUE(lparts[2].isList());
  auto lmerged = MergeMicroBatches(lparts).value();
  EXPECT_TRUE(at::allclose(lmerged.toListRef()[1].toTensor(), at::arange(6) * 2));
}

TEST(MicroBatch, TooFewRowsOrNothingToSplitAreClearErrors) {
  auto small = SplitMicroBatches(at::arange(3), 8);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("3 rows cannot be split into 8"), std::string::npos)
      << small.status();
  EXPECT_FALSE(SplitMicroBatches(c10::IValue(int64_t{3}), 2).ok());
  EXPECT_FALSE(SplitMicroBatches(c10::ivalue::Tuple::create({int64_t{1}}), 2).ok());
  EXPECT_FALSE(MergeMicroBatches({}).ok());
}

}  // namespace
}  // namespace remora::pipeline
