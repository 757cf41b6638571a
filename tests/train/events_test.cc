// TensorBoard event files (train/events.h), the curves' SVG
// (train/curves.h) and the timeline's bubble and picture (train/
// timeline.h), without a training run; the master's --tensorboard and
// --curves are checked in tests/models/resnet_test.cc (batch runs) and
// tests/data/imagefolder_master_test.cc (epochs).
#include "train/events.h"

#include <filesystem>
#include <fstream>
#include <iterator>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/support/test_group.h"
#include "pipeline/schedule.h"
#include "train/curves.h"
#include "train/timeline.h"

namespace remora::train {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void Spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(Crc32c, MatchesTheCastagnoliCheckValueAndTFRecordsMask) {
  EXPECT_EQ(Crc32c("123456789"), 0xe3069283u);  // the standard check value of CRC-32C
  EXPECT_EQ(Crc32c(""), 0u);
  const uint32_t c = Crc32c("123456789");
  EXPECT_EQ(MaskedCrc32c("123456789"), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(EventWriter, WritesScalarsThatReadBackWithTheirStepsAndTheFileVersion) {
  const std::string dir = TempPath("tensorboard_roundtrip");
  std::filesystem::remove_all(dir);
  std::string path;
  {
    auto writer = EventWriter::Open(dir + "/run");
    ASSERT_TRUE(writer.ok()) << writer.status();
    path = (*writer)->path();
    EXPECT_THAT(path, HasSubstr("/run/events.out.tfevents."));
    for (int step = 1; step <= 3; ++step) {
      ASSERT_TRUE((*writer)->AddScalar("step/loss", step, 1.0 / step, 1000.0 + step).ok());
    }
    ASSERT_TRUE((*writer)->AddScalar("epoch/test_accuracy", 1, 0.875).ok());
    ASSERT_TRUE((*writer)->AddRestart(3).ok());
  }  // closed: flushed
  std::string version;
  std::vector<int64_t> restarts;
  auto scalars = ReadScalars(path, &version, &restarts);
  EXPECT_EQ(restarts, std::vector<int64_t>{3});
  ASSERT_TRUE(scalars.ok()) << scalars.status();
  EXPECT_EQ(version, "brain.Event:2");
  ASSERT_EQ(scalars->size(), 4u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ((*scalars)[i].tag, "step/loss");
    EXPECT_EQ((*scalars)[i].step, i + 1);
    EXPECT_FLOAT_EQ((*scalars)[i].value, 1.0f / (i + 1));
    EXPECT_DOUBLE_EQ((*scalars)[i].wall_time, 1001.0 + i);
  }
  EXPECT_EQ((*scalars)[3].tag, "epoch/test_accuracy");
  EXPECT_FLOAT_EQ((*scalars)[3].value, 0.875f);
  // TFRecord's framing by hand: the first record's length, and its CRCs.
  const std::string bytes = Slurp(path);
  ASSERT_GT(bytes.size(), 16u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  ASSERT_LE(12 + n + 4, bytes.size());
  auto u32 = [&bytes](size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<unsigned char>(bytes[at + i])} << (8 * i);
    return v;
  };
  EXPECT_EQ(u32(8), MaskedCrc32c(bytes.substr(0, 8)));
  EXPECT_EQ(u32(12 + n), MaskedCrc32c(bytes.substr(12, n)));
  EXPECT_THAT(bytes.substr(12, n), HasSubstr("brain.Event:2"));
  // The restart mark, the last record, as TensorFlow's Event has it: step 3
  // (field 2), then session_log (field 7, length-delimited: 0x3a) with
  // status START (field 1 = 1), before the record's data CRC.
  EXPECT_EQ(bytes.substr(bytes.size() - 4 - 6, 6), std::string("\x10\x03\x3a\x02\x08\x01", 6));
}

TEST(EventWriter, ACorruptOrCutFileIsDataLossNamingTheRecord) {
  const std::string dir = TempPath("tensorboard_corrupt");
  std::filesystem::remove_all(dir);
  std::string path;
  {
    auto writer = EventWriter::Open(dir);
    ASSERT_TRUE(writer.ok()) << writer.status();
    path = (*writer)->path();
    ASSERT_TRUE((*writer)->AddScalar("step/loss", 1, 0.5).ok());
  }
  const std::string good = Slurp(path);
  std::string flipped = good;
  flipped[good.size() - 6] ^= 0x01;  // inside the last record's Event
  Spit(path, flipped);
  auto bad = ReadScalars(path);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("bad data CRC"));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(path));
  Spit(path, good.substr(0, good.size() - 3));
  auto cut = ReadScalars(path);
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(cut.status().message()), HasSubstr("cut short"));
}

TEST(EventWriter, ADirectoryThatCannotBeMadeIsAnErrorNamingIt) {
  const std::string file = TempPath("tensorboard_not_a_dir");
  Spit(file, "x");
  auto writer = EventWriter::Open(file + "/run");
  ASSERT_FALSE(writer.ok());
  EXPECT_THAT(std::string(writer.status().message()), HasSubstr(file + "/run"));
}

TEST(Curves, DrawsAPolylinePerSeriesWithItsLegendAndLeavesEmptyPanelsOut) {
  Panel loss{"training loss", "step", {{"splits=1", {{1, 2.0}, {2, 1.5}, {3, 1.0}}}, {"splits=<2>", {{1, 2.1}}}}};
  Panel accuracy{"test accuracy", "epoch", {{"", {}}}};
  const std::string svg = CurvesSvg({loss, accuracy});
  EXPECT_THAT(svg, HasSubstr("<svg"));
  EXPECT_THAT(svg, HasSubstr("training loss"));
  EXPECT_THAT(svg, ::testing::Not(HasSubstr("test accuracy")));
  EXPECT_THAT(svg, HasSubstr("splits=&lt;2&gt;"));  // escaped
  size_t polylines = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1)) ++polylines;
  EXPECT_EQ(polylines, 2u);
  EXPECT_THAT(svg, HasSubstr("<circle"));  // the one-point series
  EXPECT_THAT(CurvesSvg({}), HasSubstr("no training steps to draw"));
}

// Two workers, three steps (the first left out): worker1 computes 80 us
// of the 120 us from the second step's first action to the last step's
// end, worker2 60 us (its gradient sum overlaps its backward and counts
// once); the master's track is not a worker's.
std::vector<TimelineSlice> TwoWorkersThreeSteps() {
  return {{0, "forward", 0, 0, 10, "stage 0"},   {0, "step", -1, 10, 12, ""},
          {1, "forward", 0, 5, 15, "stage 1"},   {1, "step", -1, 15, 17, ""},
          {0, "forward", 0, 20, 30, "stage 0"},  {1, "forward", 0, 30, 40, "stage 1"},
          {1, "backward", 0, 40, 50, "stage 1"}, {1, "allreduce", -1, 45, 55, ""},
          {1, "step", -1, 50, 60, ""},           {0, "backward", 0, 50, 70, "stage 0"},
          {0, "step", -1, 70, 80, ""},           {0, "forward", 0, 80, 90, "stage 0"},
          {1, "forward", 0, 90, 100, "stage 1"}, {1, "backward", 0, 100, 110, "stage 1"},
          {1, "step", -1, 110, 120, ""},         {0, "backward", 0, 110, 130, "stage 0"},
          {0, "step", -1, 130, 140, ""},         {0, "input", 0, 60, 80, ""},
          {2, "send", -1, 0, 140, ""}};
}

TEST(Bubble, IdleIsEachWorkersStepLessItsCompute) {
  absl::StatusOr<Bubble> b = MeasureBubble(TwoWorkersThreeSteps(), 2);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->steps, 2);
  EXPECT_DOUBLE_EQ(b->step_s, 60e-6);
  ASSERT_EQ(b->workers.size(), 2u);
  EXPECT_DOUBLE_EQ(b->workers[0].busy_s, 40e-6);
  EXPECT_DOUBLE_EQ(b->workers[0].idle_s, 20e-6);
  EXPECT_DOUBLE_EQ(b->workers[1].busy_s, 30e-6);
  EXPECT_DOUBLE_EQ(b->workers[1].idle_s, 30e-6);
  EXPECT_DOUBLE_EQ(b->fraction, 100.0 / 240);
  EXPECT_DOUBLE_EQ(b->schedule_fraction, -1);
  b->schedule_fraction = 0.2;
  const std::string lines = FormatBubble(*b, {"worker1", "worker2"});
  EXPECT_THAT(lines, HasSubstr("bubble: 41.7% of each step idle over 2 steps after the first (0.000 s a step); "
                               "the schedule alone leaves 20.0%"));
  EXPECT_THAT(lines, HasSubstr("  worker2: busy 0.000 s, idle 0.000 s (50.0%)\n"));
}

TEST(Bubble, NeedsTwoStepsOnEveryWorker) {
  std::vector<TimelineSlice> one = TwoWorkersThreeSteps();
  one.resize(4);  // a step each
  absl::StatusOr<Bubble> b = MeasureBubble(one, 2);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("two traced steps on every worker"));
  EXPECT_FALSE(MeasureBubble(TwoWorkersThreeSteps(), 0).ok());
}

// The simulator's unit-time bubble: (S - 1) / (M + S - 1) for GPipe and
// 1F1B; less for the interleaved schedule at the same micro-batches.
TEST(Bubble, TheSchedulesOwnIsTheTextbookFraction) {
  for (const char* name : {"gpipe", "1f1b"}) {
    for (auto [workers, micro_batches] : {std::pair{2, 4}, {2, 8}, {4, 8}}) {
      auto schedule = pipeline::MakeSchedule(name, workers, 1, micro_batches);
      ASSERT_TRUE(schedule.ok()) << schedule.status();
      auto f = ScheduleBubble(*schedule);
      ASSERT_TRUE(f.ok()) << f.status();
      EXPECT_DOUBLE_EQ(*f, double(workers - 1) / (micro_batches + workers - 1)) << name << " " << workers;
    }
  }
  auto interleaved = pipeline::MakeSchedule("interleaved", 2, 2, 4);
  ASSERT_TRUE(interleaved.ok()) << interleaved.status();
  EXPECT_LT(ScheduleBubble(*interleaved).value(), 0.2);
}

TEST(Timeline, RowsNameTheirStagesAndIdleShareWithALegend) {
  const std::string path = TempPath("bubble_timeline.svg");
  ASSERT_TRUE(WriteTimelineSvg(path, {"worker1", "worker2"}, TwoWorkersThreeSteps(), 1).ok());
  const std::string svg = Slurp(path);
  for (const char* part : {">worker1<", ">stage 0<", ">stage 1<", ">idle 33%<", ">idle 50%<", ">F0<", ">B0<",
                           "forward of micro-batch 0", "optimizer step"}) {
    EXPECT_THAT(svg, HasSubstr(part)) << part;
  }
  EXPECT_THAT(svg, Not(HasSubstr(">W0<")));
  // A split backward's weight part has its own legend entry.
  std::vector<TimelineSlice> split = TwoWorkersThreeSteps();
  split.push_back({1, "weight", 0, 55, 58, "stage 1"});
  ASSERT_TRUE(WriteTimelineSvg(path, {"worker1", "worker2"}, split, 1).ok());
  for (const char* part : {">W0<", "its weights' gradient", "its input's gradient"}) {
    EXPECT_THAT(Slurp(path), HasSubstr(part)) << part;
  }
  EXPECT_FALSE(WriteTimelineSvg("/nonexistent/dir/t.svg", {"w"}, {}, 1).ok());
}

}  // namespace
}  // namespace remora::train
