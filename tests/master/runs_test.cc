// The master program's pieces in this process (master/runs.h): rows per
// micro-batch for models with batch norm, stages per worker, the demo's
// batches drawn alike on any thread count and made ahead, and what a
// recovery keeps of the steps before its checkpoint; a TorchScript error as
// the program prints it.
#include "master/runs.h"

#include <sstream>
#include <string>
#include <utility>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "launch/error_text.h"
#include "tests/support/script_models.h"
#include "train/report.h"

namespace remora::master {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

pipeline::StageSpec ScriptSpec(const torch::jit::Module& m) {
  std::ostringstream bytes;
  m.save(bytes);
  return pipeline::StageSpec::TorchScript(bytes.str(), "test.pt");
}

// A stage's TorchScript error as master prints it without --verbose:
// remora's words, PyTorch's message and the line it failed at, what
// follows; the interpreter's traceback left out.
TEST(ErrorText, ATorchScriptTracebackIsCutToPyTorchsMessageAndTheLine) {
  torch::jit::Module fc = test_support::ScriptLinear(4, 5, 1, false);
  std::string what;
  try {
    fc.forward({at::ones({2, 3})});
  } catch (const std::exception& e) {
    what = e.what();
  }
  ASSERT_THAT(what, HasSubstr("Traceback of TorchScript")) << what;
  const std::string said = launch::WithoutTorchScriptTraceback(
      absl::StrCat("stage 1 on worker 'w2': forward of micro-batch 0: ", what, "\nthe step failed"));
  EXPECT_THAT(said, ::testing::StartsWith("stage 1 on worker 'w2': forward of micro-batch 0: RuntimeError: "))
      << said;
  EXPECT_THAT(said, HasSubstr("(2x3 and 4x5)")) << said;
  EXPECT_THAT(said, HasSubstr("(at `")) << said;
  EXPECT_THAT(said, ::testing::EndsWith("; --verbose shows the TorchScript traceback)\nthe step failed")) << said;
  EXPECT_THAT(said, ::testing::Not(HasSubstr("Traceback of"))) << said;
  EXPECT_THAT(said, ::testing::Not(HasSubstr("<--- HERE"))) << said;
  EXPECT_EQ(launch::WithoutTorchScriptTraceback("no traceback\nhere"), "no traceback\nhere");
  // Rethrown: the message that names the interpreter again is not the end.
  EXPECT_EQ(launch::WithoutTorchScriptTraceback(absl::StrCat(
                "at x: The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript "
                "(most recent call last):\n  y = f(x)\n      ~ <--- HERE\nRuntimeError: The following operation "
                "failed in the TorchScript interpreter.\nTraceback of TorchScript (most recent call last):\n",
                "def f(x):\n  return x.view(5)\n         ~~~~~~ <--- HERE\nRuntimeError: shape '[5]' is invalid\n")),
            "at x: RuntimeError: shape '[5]' is invalid (at `return x.view(5)`; --verbose shows the TorchScript "
            "traceback)");
}

// A model that normalises by batch statistics needs two rows in each part
// of a batch (a last batch with fewer is dropped); others one.
TEST(Runs, AModelWithBatchNormNeedsTwoRowsPerPart) {
  RunOptions c;
  c.dataset = "fashion-mnist";
  EXPECT_EQ(RowsPerPart(c), 1);  // the small CNN
  c.dataset = "imagefolder:/data";
  EXPECT_EQ(RowsPerPart(c), 2);  // ResNet50
  c.model = "model.pt";
  c.scripts = {ScriptSpec(test_support::ScriptLinear(4, 2, 1, true))};
  EXPECT_EQ(RowsPerPart(c), 1);
  torch::jit::Module model("Model"), norm("Norm");
  norm.register_buffer("running_mean", at::zeros({2}));
  norm.define("def forward(self, x):\n  return x - self.running_mean\n");
  model.register_module("bn", norm);
  model.define("def forward(self, x):\n  return self.bn.forward(x)\n");
  c.scripts.push_back(ScriptSpec(model));
  EXPECT_EQ(RowsPerPart(c), 2);
  // A batch of 8 cut in 4: the last batch needs 8 rows, capped at the batch size.
  c.batch_size = 8;
  EXPECT_EQ(TrainOptionsOf(c, 4, 4, nullptr).fit.min_batch_rows, 8);
  c.batch_size = 6;
  EXPECT_EQ(TrainOptionsOf(c, 4, 4, nullptr).fit.min_batch_rows, 6);
  c.batch_size = 2;
  EXPECT_EQ(TrainOptionsOf(c, 4, 4, nullptr).fit.min_batch_rows, 4);
}

// Stages per worker when --interleave is not given: two where every stage
// gets a layer, but one when --schedule 1f1b asks for one per worker.
TEST(Runs, OneF1BAskedForByNameCutsOneStagePerWorker) {
  RunOptions c;
  c.workers = {"w1", "w2"};
  EXPECT_EQ(StagesPerWorker(c, 16).value(), 2);
  c.schedule = "1f1b";
  EXPECT_EQ(StagesPerWorker(c, 16).value(), 1);
  c.interleave = 2;  // given: kept (the schedule says what it thinks of it)
  EXPECT_EQ(StagesPerWorker(c, 16).value(), 2);
}

// A batch's inputs are drawn row by row from generators of their own: the
// same values on one thread or several, rows unlike each other and unlike
// another batch's, and standard normal.
TEST(Runs, InputsAreTheSameWhateverTheThreadsThatDrawThem) {
  at::Tensor one = at::empty({7, 3, 40, 40});
  FillNormalRows(one, 42, 1);
  for (const int threads : {2, 3, 7, 16}) {
    at::Tensor many = at::full({7, 3, 40, 40}, -1.0f);
    FillNormalRows(many, 42, threads);
    EXPECT_TRUE(many.equal(one)) << threads << " threads";
  }
  EXPECT_FALSE(one[0].equal(one[1]));
  at::Tensor other = at::empty({7, 3, 40, 40});
  FillNormalRows(other, 43, 2);
  EXPECT_FALSE(other[0].equal(one[0]));
  EXPECT_NEAR(one.mean().item<double>(), 0.0, 0.05);
  EXPECT_NEAR(one.std().item<double>(), 1.0, 0.05);
  RunOptions c;  // (the demo's batch: made twice, the same)
  c.batch_size = 16;
  c.image_size = 256;  // (3M numbers: drawn on up to 3 threads)
  auto [x1, y1] = MakeBatch(c, 5).value();
  auto [x2, y2] = MakeBatch(c, 5).value();
  EXPECT_TRUE(x1.equal(x2));
  EXPECT_TRUE(y1.equal(y2));
  at::Tensor serial = at::empty_like(x1);
  FillNormalRows(serial, static_cast<uint64_t>(int64_t{c.seed} * 7919 + 5), 1);
  EXPECT_TRUE(serial.equal(x1));
}

// The demo's batches made ahead are MakeBatch's, in order; a run that stops
// early (an error) leaves no maker thread behind.
TEST(Runs, BatchesMadeAheadAreTheSameBatchesAndStopWithTheRun) {
  RunOptions c;
  c.batch_size = 4;
  c.image_size = 16;
  for (const int makers : {1, 2, 3}) {  // (batches made out of order are taken in order)
    BatchesAhead ahead(c, 2, 9, /*ahead=*/2, makers);
    EXPECT_EQ(ahead.makers(), 1);  // (a second only once Take has waited)
    for (int b = 2; b < 9; ++b) {
      auto taken = ahead.Take(b);
      ASSERT_TRUE(taken.ok()) << taken.status();
      auto [x, y] = *taken;
      auto [want_x, want_y] = MakeBatch(c, b).value();
      EXPECT_TRUE(x.equal(want_x)) << "batch " << b << ", " << makers << " makers";
      EXPECT_TRUE(y.equal(want_y)) << "batch " << b << ", " << makers << " makers";
    }
    EXPECT_EQ(ahead.Take(9).status().code(), absl::StatusCode::kInternal);
    EXPECT_LE(ahead.makers(), makers);
  }
  const absl::Time start = absl::Now();
  {
    BatchesAhead ahead(c, 0, 1000000);
    EXPECT_TRUE(ahead.Take(0).ok());
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// A step that outruns the making starts a second maker: here batch 1 is
// made only once batch 2 is (which one maker could never do), and both
// are taken in order; a batch that fails is the error of its own Take,
// the ones before it are taken as made.
TEST(Runs, ASecondMakerStartsWhenTheTakerWaits) {
  absl::Notification two_made;
  auto make = [&](int b) -> absl::StatusOr<std::pair<at::Tensor, at::Tensor>> {
    if (b == 1 && !two_made.WaitForNotificationWithTimeout(absl::Seconds(60))) {
      return absl::DeadlineExceededError("batch 2 was never made beside batch 1");
    }
    if (b == 4) return absl::ResourceExhaustedError("no memory for batch 4");
    auto batch = std::pair{at::full({1}, static_cast<double>(b)), at::full({1}, -static_cast<double>(b))};
    if (b == 2) two_made.Notify();
    return batch;
  };
  BatchesAhead ahead(make, 0, 8, /*ahead=*/2, /*max_makers=*/2);
  for (int b = 0; b < 4; ++b) {
    auto taken = ahead.Take(b);
    ASSERT_TRUE(taken.ok()) << "batch " << b << ": " << taken.status();
    EXPECT_EQ(taken->first.item<double>(), b);
    EXPECT_EQ(taken->second.item<double>(), -b);
  }
  EXPECT_EQ(ahead.makers(), 2);
  auto failed = ahead.Take(4);
  ASSERT_FALSE(failed.ok());
  EXPECT_THAT(failed.status().message(), HasSubstr("no memory for batch 4"));
}

// A batch that cannot be made (out of memory; here a shape LibTorch
// refuses) is the taker's error, not an exception on the maker's thread
// (which would abort the program).
TEST(Runs, ABatchThatCannotBeMadeIsAnErrorOfTake) {
  RunOptions c;
  c.batch_size = 4;
  c.model = "stages.pt";
  c.input_shape = {-3};
  BatchesAhead ahead(c, 0, 3);
  auto taken = ahead.Take(0);
  ASSERT_FALSE(taken.ok());
  EXPECT_THAT(taken.status().message(), HasSubstr("making batch 0: "));
  EXPECT_THAT(taken.status().message(), HasSubstr("negative"));
}

// An elastic recovery keeps the steps before the checkpoint and counts,
// for the epoch it goes on in, only that epoch's steps: by the epoch each
// step recorded, so an epoch whose first batch took no step (its files
// all skipped) does not reach back into the one before.
TEST(Runs, ARecoveryKeepsTheStepsBeforeItsCheckpointAndCountsItsEpochs) {
  master::Run run;
  train::RunRecorder recorder(run);
  // Epoch 1: steps 1-3; epoch 2: steps 4-6 (its batch 0 took no step, so
  // a checkpoint at step 5 says batch 3 of epoch 2).
  for (int64_t step = 1; step <= 6; ++step) {
    ASSERT_TRUE(recorder.AfterStep(train::StepRecord{step <= 3 ? 1 : 2, step, 0.5, 10 * step, 1.0 * step}).ok());
  }
  const KeptSteps kept = KeepStepsUpTo(run, 5, 2);
  EXPECT_DOUBLE_EQ(kept.epoch_seconds_before, 4 + 5);
  EXPECT_EQ(kept.epoch_images_before, 40 + 50);
  EXPECT_DOUBLE_EQ(kept.discarded_seconds, 6);
  EXPECT_THAT(run.batch_seconds, ElementsAre(1, 2, 3, 4, 5));
  EXPECT_THAT(run.step_rows, ElementsAre(10, 20, 30, 40, 50));
  EXPECT_EQ(run.step_epochs.size(), 5u);

  // A run of batches (epoch 0) counts no epoch; a process that began after
  // step 2 (resumed) holds steps 3-5 from index 0.
  master::Run batches;
  batches.first_step = 2;
  for (int b = 2; b < 5; ++b) batches.AddBatch(b, 0.5, 1.0, 8);
  const KeptSteps none = KeepStepsUpTo(batches, 4);
  EXPECT_DOUBLE_EQ(none.epoch_seconds_before, 0);
  EXPECT_EQ(none.epoch_images_before, 0);
  EXPECT_DOUBLE_EQ(none.discarded_seconds, 1);
  EXPECT_EQ(batches.batch_seconds.size(), 2u);
}

}  // namespace
}  // namespace remora::master
