// pipeline::Fit's order of steps, without sockets: each batch's step is
// started before the last one is waited for, except after a step that a
// checkpoint must see alone; a failed step drops the one started after it.
// And CountCorrect's top-1 and top-5 counts.
#include "pipeline/fit.h"

#include <chrono>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ops/arange.h>
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
  bool ran = false;     // steps that run within their start
  double loss = 1.0;    // every step's

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
                               return loss;
                             },
                             [this, b] { log.push_back(absl::StrCat("abandon", b)); }, ran, nullptr};
        },
        [](const at::Tensor&, const at::Tensor&) -> absl::StatusOr<Correct> { return Correct{1, 2, 2}; },
        train, test, options, out);
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
  EXPECT_DOUBLE_EQ((*epochs)[0].test_top5, 1.0);
  EXPECT_NE(r.out.str().find("test_accuracy=0.5000 test_top5=1.0000 "), std::string::npos) << r.out.str();
}

// A step that ran within its start is accounted for at once: its time
// and after_step do not wait for the next step's start (whose work would
// otherwise be timed as this step's, and the last step's as nothing).
TEST(Fit, AStepThatRanWithinItsStartIsAccountedForAtOnce) {
  Recorder r;
  r.ran = true;
  std::vector<double> seconds;
  r.options.on_step = [&seconds](const StepRecord& s) { seconds.push_back(s.seconds); };
  ASSERT_TRUE(r.Run().ok());
  EXPECT_EQ(r.log, (std::vector<std::string>{"start0", "wait0", "after1", "start1", "wait1", "after2", "start2",
                                             "wait2", "after3", "start3", "wait3", "after4", "start4", "wait4",
                                             "after5"}));
  EXPECT_EQ(seconds.size(), 5u);
}

// What a run should not pass over in silence: a last batch too small for
// its micro-batches (left out), a loss that is not finite (the training
// diverged), a run resumed at its end (nothing to train).
TEST(Fit, SaysWhatItLeavesOutAndALossThatIsNotFinite) {
  Recorder r;
  r.options.batch_size = 4;  // 4, 4 and 2 rows
  r.options.min_batch_rows = 3;
  r.loss = std::nan("");
  auto epochs = r.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  EXPECT_EQ((*epochs)[0].images, 8);
  EXPECT_NE(r.out.str().find("fit: the last batch of each epoch, 2 of 10 rows, is left out: its micro-batches "
                             "need at least 3 rows"),
            std::string::npos)
      << r.out.str();
  EXPECT_NE(r.out.str().find("fit: warning: the loss is nan at epoch 1, batch 1: the training diverged"),
            std::string::npos)
      << r.out.str();
  EXPECT_EQ(r.out.str().find("batch 2: the training diverged"), std::string::npos) << "said once";
  // The NaN a diverged run computes has its sign bit set: not written.
  Recorder negative;
  negative.loss = -std::nan("");
  ASSERT_TRUE(negative.Run().ok());
  EXPECT_NE(negative.out.str().find("the loss is nan at epoch 1"), std::string::npos) << negative.out.str();
  EXPECT_NE(negative.out.str().find("epoch=1 train_loss=nan "), std::string::npos) << negative.out.str();
  EXPECT_EQ(negative.out.str().find("-nan"), std::string::npos) << negative.out.str();
  Recorder at_end;
  at_end.options.start = FitPosition{1, 5, 5.0, 10, 5};
  auto none = at_end.Run();
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
  EXPECT_NE(at_end.out.str().find("fit: resumed at the run's end (epoch 1 of --epochs 1): nothing left to train"),
            std::string::npos)
      << at_end.out.str();
}

// Without a test set (an image folder with no val/): no evaluation, and
// the epoch line has no test figures.
TEST(Fit, AnEmptyTestSetIsNotEvaluated) {
  Recorder r;
  r.test = data::Dataset{at::zeros({0, 1}), at::zeros({0}, at::kLong)};
  auto epochs = r.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  ASSERT_EQ(epochs->size(), 1u);
  EXPECT_FALSE((*epochs)[0].evaluated);
  EXPECT_NE(r.out.str().find("epoch=1 train_loss=1.0000 seconds="), std::string::npos) << r.out.str();
  EXPECT_EQ(r.out.str().find("test_"), std::string::npos) << r.out.str();
  Recorder with_test;
  EXPECT_TRUE(with_test.Run().value()[0].evaluated);
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

// Gone on with in the same process after a failure (an elastic
// recovery): the failure's time (since lost_since) counts in the first
// epoch trained, with the resumed epoch's seconds before the checkpoint,
// and its images before it count as trained; when the resumed epoch had
// ended at the checkpoint, the next epoch holds the failure's time.
TEST(Fit, AnEpochGoneOnWithAfterAFailureCountsTheFailuresTime) {
  const auto lost_since = std::chrono::steady_clock::now() - std::chrono::seconds(3);
  Recorder mid;
  mid.options.start = FitPosition{1, 2, 2.0, 4, 2};
  mid.options.gone_on = FitOptions::GoneOn{lost_since, 1.5, 4};
  auto epochs = mid.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  ASSERT_EQ(epochs->size(), 1u);
  EXPECT_GE((*epochs)[0].seconds, 4.5);
  EXPECT_LT((*epochs)[0].seconds, 60);
  EXPECT_EQ((*epochs)[0].images, 10);
  EXPECT_EQ((*epochs)[0].trained, 10);
  // A process that began within the epoch (resumed from a checkpoint at
  // its first step) trained one step of it before the failure: only that
  // step's images count with its time (the others', and their time, were
  // the earlier process's).
  Recorder late;
  late.options.start = FitPosition{1, 2, 2.0, 4, 2};
  late.options.gone_on = FitOptions::GoneOn{lost_since, 0.5, 2};
  epochs = late.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  ASSERT_EQ(epochs->size(), 1u);
  EXPECT_EQ((*epochs)[0].images, 10);
  EXPECT_EQ((*epochs)[0].trained, 8);
  Recorder ended;
  ended.options.epochs = 3;
  ended.options.start = FitPosition{1, 5, 5.0, 10, 5};
  ended.options.gone_on = FitOptions::GoneOn{lost_since, 1.5, 10};
  epochs = ended.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  ASSERT_EQ(epochs->size(), 2u);
  EXPECT_GE((*epochs)[0].seconds, 3.0);  // epoch 2: the failure's time, not epoch 1's before it
  EXPECT_LT((*epochs)[0].seconds, 4.5);
  EXPECT_EQ((*epochs)[0].trained, 10);
  EXPECT_LT((*epochs)[1].seconds, 3.0);  // epoch 3: its own
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

// Top-1: the highest logit is the label's; top-5: the label's logit is
// among the five highest (every row where there are five classes or fewer).
TEST(Fit, CountCorrectCountsTopOneAndTopFive) {
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
TEST(Fit, CountCorrectCountsEveryPositionOfALanguageModel) {
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
