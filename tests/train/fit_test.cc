// train::Fit's loop, without sockets, on a trainer of the test's own: each
// batch's step is started before the last one is waited for, except
// before a checkpoint; a failed step drops the one started after it; what
// it leaves out and a loss that is not finite are said; resumed and
// recovered epochs count their images and time.
#include "train/fit.h"

#include <chrono>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace remora::train {
namespace {

// 10 rows in batches of 2, file order, one epoch; each step's start, wait,
// accounting (an observer's AfterStep), abandon and save logged.
class Recorder : public Trainer {
 public:
  data::Dataset train{at::zeros({10, 1}), at::arange(10)};
  data::Dataset test{at::zeros({2, 1}), at::arange(2)};
  TrainOptions o;
  std::vector<std::string> log;
  int fail_batch = -1;          // (by its first row / 2)
  bool over_at_start = false;   // steps that run within their start
  double loss = 1.0;            // every step's
  std::vector<checkpoint::TrainingState> saved;
  std::ostringstream out;

  Recorder() {
    o.fit.epochs = 1;
    o.fit.batch_size = 2;
    o.fit.shuffle = false;
  }

  absl::StatusOr<std::vector<EpochResult>> Run() {
    TrainOptions logged = o;
    FitFunctions steps;
    steps.step = [this](const StepRecord& s) { log.push_back(absl::StrCat("step", s.step)); };
    logged.observers.insert(logged.observers.begin(), &steps);
    return Fit(*this, data::InMemory(train), data::InMemory(test), logged, out);
  }

  StartedStep StartStep(const StepBatch& batch) override {
    const int b = static_cast<int>(batch.y[0].item<int64_t>() / 2);
    log.push_back(absl::StrCat("start", b));
    return StartedStep(
        [this, b]() -> absl::StatusOr<double> {
          log.push_back(absl::StrCat("wait", b));
          if (b == fail_batch) return absl::InternalError("the step failed");
          return loss;
        },
        [this, b] { log.push_back(absl::StrCat("abandon", b)); }, over_at_start);
  }
  absl::StatusOr<pipeline::Correct> CountCorrect(const at::Tensor&, const at::Tensor&) override {
    return pipeline::Correct{1, 2, 2};
  }
  absl::StatusOr<Saved> Save(const SaveTarget& target, const checkpoint::TrainingState& state, bool) override {
    log.push_back(absl::StrCat("save", state.step));
    saved.push_back(state);
    return Saved{target.dir, 1, state.step, false};
  }
  absl::StatusOr<int64_t> Load(const checkpoint::Checkpoint&) override {
    return absl::UnimplementedError("not in this test");
  }
};

TEST(Fit, StartsEachStepBeforeWaitingForTheLastExceptBeforeACheckpoint) {
  Recorder r;
  r.o.checkpoints.dir = testing::TempDir() + "/fit_checkpoints";
  r.o.checkpoint_every = 3;
  auto epochs = r.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  EXPECT_EQ(r.log, (std::vector<std::string>{"start0", "start1", "wait0", "step1", "start2", "wait1", "step2",
                                             "wait2", "step3", "save3", "start3", "start4", "wait3", "step4",
                                             "wait4", "step5", "save5"}));
  ASSERT_EQ(epochs->size(), 1u);
  EXPECT_DOUBLE_EQ((*epochs)[0].train_loss, 1.0);
  EXPECT_EQ((*epochs)[0].images, 10);
  EXPECT_DOUBLE_EQ((*epochs)[0].test_accuracy, 0.5);
  EXPECT_DOUBLE_EQ((*epochs)[0].test_top5, 1.0);
  EXPECT_NE(r.out.str().find("test_accuracy=0.5000 test_top5=1.0000 "), std::string::npos) << r.out.str();
}

// An observer that settles a step sees it alone (the next step starts
// after its AfterStep), is told of the evaluations within and after each
// epoch, and stops the fit with an error that names the step.
class Watcher final : public FitObserver {
 public:
  explicit Watcher(std::vector<std::string>& log) : log_(log) {}
  int64_t settle = -1, fail = -1;

  bool Settles(int64_t step) const override { return step == settle; }
  absl::Status AfterStep(const StepRecord& s) override {
    log_.push_back(absl::StrCat("watch", s.step));
    if (s.step == fail) return absl::InternalError("the observer failed");
    return absl::OkStatus();
  }
  void Evaluated(int64_t step, const pipeline::Correct& tested) override {
    log_.push_back(absl::StrCat("eval", step, "/", tested.rows));
  }
  void EpochEnded(const EpochResult& e) override { log_.push_back(absl::StrCat("epoch", e.epoch)); }

 private:
  std::vector<std::string>& log_;
};

TEST(Fit, ObserversSeeEachStepEvaluationAndEpochAndMaySettleOrStopIt) {
  Recorder r;
  Watcher watch(r.log);
  watch.settle = 2;
  r.o.eval_every = 4;
  r.o.observers = {&watch};
  ASSERT_TRUE(r.Run().ok());
  EXPECT_EQ(r.log, (std::vector<std::string>{"start0", "start1", "wait0", "step1", "watch1", "wait1", "step2",
                                             "watch2", "start2", "start3", "wait2", "step3", "watch3", "wait3",
                                             "step4", "watch4", "eval4/2", "start4", "wait4", "step5", "watch5",
                                             "epoch1"}));
  Recorder failing;
  Watcher stop(failing.log);
  stop.fail = 2;
  failing.o.observers = {&stop};
  auto epochs = failing.Run();
  ASSERT_FALSE(epochs.ok());
  EXPECT_EQ(epochs.status().message(), "after epoch 1, batch 2: the observer failed");
  EXPECT_EQ(failing.log, (std::vector<std::string>{"start0", "start1", "wait0", "step1", "watch1", "start2",
                                                   "wait1", "step2", "watch2", "abandon2"}));
}

// A step over at its start is accounted for at once: its time and its
// checkpoint do not wait for the next step's start (whose work would
// otherwise be timed as this step's, and the last step's as nothing).
TEST(Fit, AStepOverAtItsStartIsAccountedForAtOnce) {
  Recorder r;
  r.over_at_start = true;
  std::vector<double> seconds;
  FitFunctions timing;
  timing.step = [&seconds](const StepRecord& s) { seconds.push_back(s.seconds); };
  r.o.observers = {&timing};
  ASSERT_TRUE(r.Run().ok());
  EXPECT_EQ(r.log, (std::vector<std::string>{"start0", "wait0", "step1", "start1", "wait1", "step2", "start2",
                                             "wait2", "step3", "start3", "wait3", "step4", "start4", "wait4",
                                             "step5"}));
  EXPECT_EQ(seconds.size(), 5u);
}

// What a run should not pass over in silence: a last batch too small for
// its micro-batches (left out), a loss that is not finite (the training
// diverged), a run resumed at its end (nothing to train).
TEST(Fit, SaysWhatItLeavesOutAndALossThatIsNotFinite) {
  Recorder r;
  r.o.fit.batch_size = 4;  // 4, 4 and 2 rows
  r.o.fit.min_batch_rows = 3;
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
  at_end.o.fit.start = FitPosition{1, 5, 5.0, 10, 5};
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
  r.o.fit.epochs = 2;
  r.o.fit.start = FitPosition{1, 5, 5.0, 10, 5};
  auto epochs = r.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  ASSERT_EQ(epochs->size(), 1u);
  EXPECT_EQ((*epochs)[0].epoch, 2);
  EXPECT_EQ(r.out.str().find("epoch=1 "), std::string::npos) << r.out.str();
  EXPECT_NE(r.out.str().find("epoch=2 "), std::string::npos) << r.out.str();
  EXPECT_EQ(r.log.back(), "step10");
}

// Resumed mid-epoch: the epoch counts all its images, of which this run
// trained the rest (what images/s is figured from, here and in master's
// splits line).
TEST(Fit, AResumedEpochCountsTheImagesThisRunTrainedApart) {
  Recorder r;
  r.o.fit.start = FitPosition{1, 2, 2.0, 4, 2};
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
  mid.o.fit.start = FitPosition{1, 2, 2.0, 4, 2};
  mid.o.fit.gone_on = FitOptions::GoneOn{lost_since, 1.5, 4};
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
  late.o.fit.start = FitPosition{1, 2, 2.0, 4, 2};
  late.o.fit.gone_on = FitOptions::GoneOn{lost_since, 0.5, 2};
  epochs = late.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  ASSERT_EQ(epochs->size(), 1u);
  EXPECT_EQ((*epochs)[0].images, 10);
  EXPECT_EQ((*epochs)[0].trained, 8);
  Recorder ended;
  ended.o.fit.epochs = 3;
  ended.o.fit.start = FitPosition{1, 5, 5.0, 10, 5};
  ended.o.fit.gone_on = FitOptions::GoneOn{lost_since, 1.5, 10};
  epochs = ended.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  ASSERT_EQ(epochs->size(), 2u);
  EXPECT_GE((*epochs)[0].seconds, 3.0);  // epoch 2: the failure's time, not epoch 1's before it
  EXPECT_LT((*epochs)[0].seconds, 4.5);
  EXPECT_EQ((*epochs)[0].trained, 10);
  EXPECT_LT((*epochs)[1].seconds, 3.0);  // epoch 3: its own
}

// A run of batches (the demo's): the set gone over once, in order, its
// steps numbered from 1; its checkpoints say epoch 0 and keep every
// step's loss; the run's last step saved once, as the final checkpoint; a
// resume goes on at the batch after the checkpoint's with the losses
// before it; no progress or epoch lines.
TEST(Fit, ABatchRunKeepsItsLossesInItsCheckpointsAndGoesOnFromThem) {
  Recorder r;
  r.o.fit.batch_run = true;
  r.o.fit.epochs = 3;      // (one pass all the same)
  r.o.fit.shuffle = true;  // (in order all the same)
  r.o.checkpoints.dir = testing::TempDir() + "/fit_batch_run";
  r.o.checkpoint_every = 5;
  auto epochs = r.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  EXPECT_EQ(r.log, (std::vector<std::string>{"start0", "start1", "wait0", "step1", "start2", "wait1", "step2",
                                             "start3", "wait2", "step3", "start4", "wait3", "step4", "wait4",
                                             "step5", "save5"}));
  ASSERT_EQ(r.saved.size(), 1u);
  EXPECT_EQ(r.saved[0].epoch, 0);
  EXPECT_EQ(r.saved[0].batch, 5);
  EXPECT_EQ(r.saved[0].losses, std::vector<double>(5, 1.0));
  EXPECT_EQ(r.out.str().find("epoch"), std::string::npos) << r.out.str();
  EXPECT_EQ(r.out.str().find("batches"), std::string::npos) << r.out.str();
  EXPECT_NE(r.out.str().find("checkpoint: step 5 in "), std::string::npos) << r.out.str();

  Recorder resumed;
  resumed.o.fit.batch_run = true;
  resumed.o.checkpoints.dir = testing::TempDir() + "/fit_batch_run_resumed";
  checkpoint::Checkpoint ck;
  ck.dir = "a checkpoint of step 2";
  ck.manifest.step = 2;
  ck.manifest.batch = 2;
  ck.manifest.losses = {3.0, 2.0};
  resumed.o.resume = ck;
  resumed.o.resume_loaded = true;  // (the Recorder cannot load one)
  resumed.loss = 0.5;
  epochs = resumed.Run();
  ASSERT_TRUE(epochs.ok()) << epochs.status();
  EXPECT_EQ(resumed.log.front(), "start2");
  EXPECT_EQ(resumed.log.back(), "save5");
  ASSERT_EQ(resumed.saved.size(), 1u);
  EXPECT_EQ(resumed.saved[0].losses, (std::vector<double>{3.0, 2.0, 0.5, 0.5, 0.5}));
  EXPECT_EQ(resumed.out.str().find("resumed from"), std::string::npos) << "loaded before: " << resumed.out.str();

  Recorder failing;
  failing.o.fit.batch_run = true;
  failing.fail_batch = 3;
  epochs = failing.Run();
  ASSERT_FALSE(epochs.ok());
  EXPECT_EQ(epochs.status().message(), "batch 4 of 5: the step failed");
}

// Observers are told where the loop's time went on each step, in order:
// its batch taken, its step sent, the wait for its end.
class Phases final : public FitObserver {
 public:
  explicit Phases(std::vector<std::string>& log) : log_(log) {}
  void Spent(int64_t step, const char* phase, std::chrono::steady_clock::time_point begin,
             std::chrono::steady_clock::time_point end) override {
    log_.push_back(absl::StrCat(phase, "/", step, begin <= end ? "" : " (ends before it begins)"));
  }

 private:
  std::vector<std::string>& log_;
};

TEST(Fit, ObserversAreToldWhereEachStepsTimeWent) {
  Recorder r;
  r.o.fit.batch_size = 4;  // three steps (rows 0-3, 4-7, 8-9: the Recorder's batches 0, 2 and 4)
  Phases phases(r.log);
  r.o.observers = {&phases};
  ASSERT_TRUE(r.Run().ok());
  EXPECT_EQ(r.log, (std::vector<std::string>{"take batch/1", "start0", "send/1", "take batch/2", "start2",
                                             "send/2", "wait0", "wait/1", "step1", "take batch/3", "start4",
                                             "send/3", "wait2", "wait/2", "step2", "wait4", "wait/3", "step3"}));
}

TEST(Fit, AFailedStepDropsTheStepStartedAfterIt) {
  Recorder r;
  r.fail_batch = 1;
  auto epochs = r.Run();
  ASSERT_FALSE(epochs.ok());
  EXPECT_NE(epochs.status().message().find("epoch 1, batch 2 of 5"), std::string::npos) << epochs.status();
  EXPECT_EQ(r.log, (std::vector<std::string>{"start0", "start1", "wait0", "step1", "start2", "wait1",
                                             "abandon2"}));
}

}  // namespace
}  // namespace remora::train
