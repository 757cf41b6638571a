// pipeline::Fit's order of steps, without sockets: each batch's step is
// started before the last one is waited for, except after a step that a
// checkpoint must see alone; a failed step drops the one started after it.
#include "pipeline/fit.h"

#include <sstream>
#include <string>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace remora::pipeline {
namespace {

// 10 rows in batches of 2, file order, one epoch.
struct Recorder {
  data::Dataset train{at::zeros({10, 1}), at::arange(10)};
  data::Dataset test{at::zeros({2, 1}), at::arange(2)};
  FitOptions options;
  std::vector<std::string> log;
  int fail_batch = -1;  // (by its first row / 2)

  Recorder() {
    options.epochs = 1;
    options.batch_size = 2;
    options.shuffle = false;
    options.after_step = [this](const FitPosition& p) {
      log.push_back(absl::StrCat("after", p.step));
      return absl::OkStatus();
    };
  }

  std::ostringstream out;

  absl::StatusOr<std::vector<EpochResult>> Run() {
    return Fit(
        [this](const at::Tensor&, const at::Tensor& y) {
          const int b = static_cast<int>(y[0].item<int64_t>() / 2);
          log.push_back(absl::StrCat("start", b));
          return StartedStep{[this, b]() -> absl::StatusOr<double> {
                               log.push_back(absl::StrCat("wait", b));
                               if (b == fail_batch) return absl::InternalError("the step failed");
                               return 1.0;
                             },
                             [this, b] { log.push_back(absl::StrCat("abandon", b)); }};
        },
        [](const at::Tensor&, const at::Tensor&) -> absl::StatusOr<int64_t> { return 1; }, train, test,
        options, out);
  }
};

TEST(Fit, StartsEachStepBeforeWaitingForTheLastExceptBeforeACheckpoint) {
  Recorder r;
  r.options.settle_after = [](int64_t step) { return step == 3; };
  auto epochs = r.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  EXPECT_EQ(r.log, (std::vector<std::string>{"start0", "start1", "wait0", "after1", "start2", "wait1",
                                             "after2", "wait2", "after3", "start3", "start4", "wait3",
                                             "after4", "wait4", "after5"}));
  ASSERT_EQ(epochs->size(), 1u);
  EXPECT_DOUBLE_EQ((*epochs)[0].train_loss, 1.0);
  EXPECT_EQ((*epochs)[0].images, 10);
  EXPECT_DOUBLE_EQ((*epochs)[0].test_accuracy, 0.5);
}

// A run resumed after the last batch of an epoch (it ended there, and is
// now given more epochs) goes on with the next epoch, without a line for
// the one reported before.
TEST(Fit, AResumedRunAfterAnEpochsLastBatchGoesOnWithTheNext) {
  Recorder r;
  r.options.epochs = 2;
  r.options.start = FitPosition{1, 5, 5.0, 10, 5};
  auto epochs = r.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  ASSERT_EQ(epochs->size(), 1u);
  EXPECT_EQ((*epochs)[0].epoch, 2);
  EXPECT_EQ(r.out.str().find("epoch=1 "), std::string::npos) << r.out.str();
  EXPECT_NE(r.out.str().find("epoch=2 "), std::string::npos) << r.out.str();
  EXPECT_EQ(r.log.back(), "after10");
}

// Resumed mid-epoch: the epoch counts all its images, of which this run
// trained the rest (what images/s is figured from, here and in master's
// splits line).
TEST(Fit, AResumedEpochCountsTheImagesThisRunTrainedApart) {
  Recorder r;
  r.options.start = FitPosition{1, 2, 2.0, 4, 2};
  auto epochs = r.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  ASSERT_EQ(epochs->size(), 1u);
  EXPECT_EQ((*epochs)[0].images, 10);
  EXPECT_EQ((*epochs)[0].trained, 6);
  EXPECT_EQ(r.log.front(), "start2");
}

TEST(Fit, AFailedStepDropsTheStepStartedAfterIt) {
  Recorder r;
  r.fail_batch = 1;
  auto epochs = r.Run();
  ASSERT_FALSE(epochs.ok());
  EXPECT_NE(epochs.status().message().find("epoch 1, batch 2 of 5"), std::string::npos) << epochs.status();
  EXPECT_EQ(r.log, (std::vector<std::string>{"start0", "start1", "wait0", "after1", "start2", "wait1",
                                             "abandon2"}));
}

}  // namespace
}  // namespace remora::pipeline
