// Elastic training with the real programs: a job that loses workers goes
// on by itself from its last checkpoint, with a spare taking a killed
// worker's place, a restarted worker standing by in turn, and a killed
// worker started again under its name, and ends bitwise equal to a job
// that lost none (where LibTorch trains reproducibly); the same with
// replicas (ZeRO-1) and with the parameter server; a job that loses more workers than
// --max-restarts allows fails saying so; the flags' misuse is refused.
#include <algorithm>
#include <csignal>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "tests/support/master_runs.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/test_group.h"

namespace remora::train {
namespace {

using ::testing::HasSubstr;
using test_support::CompareStages;
using test_support::FreshDir;
using test_support::MasterArgv;
using test_support::StageDifference;
using test_support::StartWorkers;

// Waits until the file `log` holds `text` (after the first `after`, when
// given), while `master` runs (120 s at most); whether it does.
bool WaitFor(const std::string& log, const std::string& text, launch::Subprocess& master,
             const std::string& after = "") {
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (true) {
    const std::string now = ReadFile(log);
    const size_t from = after.empty() ? 0 : now.find(after);
    if (from != std::string::npos && now.find(text, from) != std::string::npos) return true;
    if (!master.running() || absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
}

// A worker of the stock program, alone (to start one again under a name).
std::unique_ptr<launch::Subprocess> StartWorker(const std::string& name, const std::string& addr,
                                                const std::string& tag) {
  return std::move(StartWorkers({name}, addr, tag)[0]);
}

// MasterArgv, less its --splits 2 when `more` asks for --mode ps (which
// takes no --splits).
std::vector<std::string> JobArgv(const std::string& workers, const std::string& addr, const std::string& data,
                                 const std::vector<std::string>& more) {
  std::vector<std::string> argv = MasterArgv(workers, addr, data, more);
  if (std::find(more.begin(), more.end(), "ps") != more.end()) {
    auto at = std::find(argv.begin(), argv.end(), "--splits");
    argv.erase(at, at + 2);
  }
  return argv;
}

// Runs the uninterrupted job of `master_flags` over `names` into a fresh
// `dir`; false (a test failure) when it fails.
bool RunWhole(const std::string& data, const std::string& dir, std::vector<std::string> master_flags,
              const std::vector<std::string>& names = {"w1", "w2"}) {
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = StartWorkers(names, addr, dir.substr(dir.rfind('/') + 1));
  master_flags.insert(master_flags.end(), {"--checkpoint-dir", dir});
  auto [code, out] = RunProgram(JobArgv(absl::StrJoin(names, ","), addr, data, master_flags), absl::Seconds(200));
  EXPECT_EQ(code, 0) << out;
  return code == 0;
}

// The elastic job's final stages (in `elastic`) against the uninterrupted
// job's (in `whole`): bitwise equal where a second uninterrupted job ends
// bitwise equal to the first (Debian's LibTorch), else within 1e-5.
void ExpectEndsEqual(const std::string& data, const std::string& whole, const std::string& elastic,
                     const std::vector<std::string>& master_flags,
                     const std::vector<std::string>& names = {"w1", "w2"}) {
  const StageDifference after = CompareStages(whole, elastic);
  if (after.equal) return;
  const std::string again = FreshDir("elastic_again_ckpt");
  ASSERT_TRUE(RunWhole(data, again, master_flags, names));
  const StageDifference twice = CompareStages(whole, again);
  ASSERT_FALSE(twice.equal) << "two uninterrupted jobs end bitwise equal here, but the elastic one ended "
                            << after.largest << " away";
  EXPECT_LT(after.largest, 1e-5);
}

std::string ToyData() {
  const std::string data = std::filesystem::path(TempPath("elastic_toy")).lexically_normal().string();
  test_support::WriteToyIdx(data, 320, 100);  // 10 batches of 32 per epoch, 3 epochs
  return data;
}

TEST(Elastic, FlagsAreCheckedBeforeAnyWorkerIsWaitedFor) {
  const std::string data = ToyData();
  struct Case {
    std::vector<std::string> flags;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--max-restarts", "1"}, "give --checkpoint-dir DIR"},
      {{"--spares", "s1"}, "give --max-restarts N too"},
      {{"--max-restarts", "-1"}, "must be >= 0"},
      {{"--max-restarts", "1", "--checkpoint-dir", TempPath("elastic_flags"), "--spares", "w1"}, "'w1' is named twice"},
      {{"--max-restarts", "1", "--local"}, "not with --local"},
  };
  for (const Case& c : cases) {
    auto [code, out] = RunProgram(MasterArgv("w1,w2", "127.0.0.1:1", data, c.flags));
    EXPECT_EQ(code, 2) << out;
    EXPECT_THAT(out, HasSubstr(c.says)) << absl::StrJoin(c.flags, " ");
  }
}

// Three losses in one job, each recovered another way: w2 is SIGKILLed
// after the checkpoint of step 6 and the spare s1 takes its place; w2 is
// started again and stands by; w1 is SIGKILLed after the next checkpoint
// and w2 takes its place; s1 is SIGKILLed after the next and, nothing
// standing by, is started again under its name. The job goes on by itself and ends where a
// job that lost no worker ends.
TEST(Elastic, AJobThatLosesWorkersGoesOnAndEndsEqualToOneThatLostNone) {
  const std::string data = ToyData();
  const std::string whole = FreshDir("elastic_whole"), elastic = FreshDir("elastic_ckpt");
  // (30 epochs of 10 steps: time for the restarts in between.)
  const std::vector<std::string> saves = {"--checkpoint-every", "3", "--keep", "2", "--epochs", "30"};
  ASSERT_TRUE(RunWhole(data, whole, saves));
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = StartWorkers({"w1", "w2", "s1"}, addr, "elastic");
  const std::string log = TempPath("elastic_master.log"), report = TempPath("elastic_report.json");
  const std::string board = FreshDir("elastic_tensorboard");
  auto master = launch::Subprocess::Spawn(
                    MasterArgv("w1,w2", addr, data,
                               {"--checkpoint-dir", elastic, saves[0], saves[1], saves[2], saves[3], saves[4],
                                saves[5], "--max-restarts", "3", "--spares", "s1", "--rejoin-timeout", "60",
                                "--report", report, "--tensorboard", board}),
                    log)
                    .value();
  ASSERT_TRUE(WaitFor(log, "checkpoint: step 6 ", *master)) << ReadFile(log);
  workers[1]->Signal(SIGKILL);
  workers[1]->Wait(absl::Seconds(10)).IgnoreError();
  workers[1] = StartWorker("w2", addr, "elastic_w2_again");  // joins once the master found it lost
  ASSERT_TRUE(WaitFor(log, "checkpoint: step ", *master, "worker 'w2' registered again")) << ReadFile(log);
  workers[0]->Signal(SIGKILL);
  ASSERT_TRUE(WaitFor(log, "checkpoint: step ", *master, "elastic: recovery 2 of 3")) << ReadFile(log);
  workers[2]->Signal(SIGKILL);
  ASSERT_TRUE(WaitFor(log, "for a worker to register again as 's1'", *master)) << ReadFile(log);
  workers[2]->Wait(absl::Seconds(10)).IgnoreError();
  workers[2] = StartWorker("s1", addr, "elastic_s1_again");
  const int code = master->Wait(absl::Seconds(200)).value_or(-1);
  const std::string out = ReadFile(log);
  ASSERT_EQ(code, 0) << out;
  for (size_t i : {1, 2}) EXPECT_EQ(workers[i]->Wait(absl::Seconds(30)).value_or(-1), 0) << "worker " << i;

  EXPECT_THAT(out, HasSubstr("s1: spare, standing by"));
  EXPECT_THAT(out, HasSubstr("elastic: spare 's1' takes the place of 'w2'"));
  EXPECT_THAT(out, HasSubstr("elastic: recovery 1 of 3: going on over w1,s1 from the checkpoint of step "));
  EXPECT_THAT(out, HasSubstr("elastic: 'w2', back since a spare took its place, takes the place of 'w1'"));
  EXPECT_THAT(out, HasSubstr("elastic: recovery 2 of 3: going on over w2,s1 from the checkpoint of step "));
  EXPECT_THAT(out, HasSubstr("elastic: 's1' is back"));
  EXPECT_THAT(out, HasSubstr("elastic: recovery 3 of 3: going on over w2,s1 from the checkpoint of step "));
  EXPECT_THAT(out, HasSubstr("checkpoint: step 300 in " + elastic));
  // The report lists the recoveries; TensorBoard has run/recoveries.
  const std::string json = ReadFile(report);
  EXPECT_THAT(json, HasSubstr("\"recoveries\": [{\"lost\": \"w2\", \"replacement\": \"s1\""));
  EXPECT_THAT(json, HasSubstr("{\"lost\": \"w1\", \"replacement\": \"w2\""));
  EXPECT_THAT(json, HasSubstr("{\"lost\": \"s1\", \"replacement\": \"s1\""));
  const auto recoveries = test_support::ScalarsIn(board, "run/recoveries");
  ASSERT_EQ(recoveries.size(), 3u);
  EXPECT_EQ(recoveries[2].value, 3);

  ExpectEndsEqual(data, whole, elastic, saves);
}

// Data parallelism with ZeRO-1 (each replica holds a share of the SGD
// momentum; checkpoints gather it): replica w2 of two is SIGKILLed after
// the checkpoint of step 6; the spare takes its place (its gradient group
// rebuilt with the new pipeline, its share of the momentum restored) and
// the job ends where one that lost none ends.
TEST(Elastic, AReplicaLostInDataParallelismIsReplacedAndTheJobEndsEqual) {
  const std::string data = ToyData();
  const std::string whole = FreshDir("elastic_dp_whole"), elastic = FreshDir("elastic_dp_ckpt");
  const std::vector<std::string> flags = {"--replicas", "2", "--zero", "1", "--checkpoint-every", "3"};
  ASSERT_TRUE(RunWhole(data, whole, flags));
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = StartWorkers({"w1", "w2", "s1"}, addr, "elastic_dp");
  const std::string log = TempPath("elastic_dp_master.log");
  std::vector<std::string> more = flags;
  more.insert(more.end(), {"--checkpoint-dir", elastic, "--max-restarts", "1", "--spares", "s1"});
  auto master = launch::Subprocess::Spawn(MasterArgv("w1,w2", addr, data, more), log).value();
  ASSERT_TRUE(WaitFor(log, "checkpoint: step 6 ", *master)) << ReadFile(log);
  workers[1]->Signal(SIGKILL);
  const int code = master->Wait(absl::Seconds(200)).value_or(-1);
  const std::string out = ReadFile(log);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("elastic: spare 's1' takes the place of 'w2'"));
  EXPECT_THAT(out, HasSubstr("2 replicas"));
  EXPECT_THAT(out, HasSubstr("ZeRO-1: optimizer state sharded"));
  ExpectEndsEqual(data, whole, elastic, flags);
}

// The parameter server over two server processes: server b is SIGKILLed
// after the checkpoint of step 6 and the spare takes its shard (restored
// from the checkpoint); then compute worker w2 after step 15, started
// again under its name. The job ends where one that lost none ends.
TEST(Elastic, ALostParameterServerShardAndComputeWorkerAreReplaced) {
  const std::string data = ToyData();
  const std::string whole = FreshDir("elastic_ps_whole"), elastic = FreshDir("elastic_ps_ckpt");
  const std::vector<std::string> flags = {"--mode", "ps", "--ps-shards", "2", "--checkpoint-every", "3"};
  const std::vector<std::string> names = {"a", "b", "w1", "w2"};
  ASSERT_TRUE(RunWhole(data, whole, flags, names));
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = StartWorkers({"a", "b", "w1", "w2", "s1"}, addr, "elastic_ps");
  const std::string log = TempPath("elastic_ps_master.log");
  std::vector<std::string> more = flags;
  more.insert(more.end(), {"--checkpoint-dir", elastic, "--max-restarts", "2", "--spares", "s1"});
  auto master = launch::Subprocess::Spawn(JobArgv("a,b,w1,w2", addr, data, more), log).value();
  ASSERT_TRUE(WaitFor(log, "checkpoint: step 6 ", *master)) << ReadFile(log);
  workers[1]->Signal(SIGKILL);
  ASSERT_TRUE(WaitFor(log, "checkpoint: step 15 ", *master)) << ReadFile(log);
  workers[3]->Signal(SIGKILL);
  ASSERT_TRUE(WaitFor(log, "for a worker to register again as 'w2'", *master)) << ReadFile(log);
  workers[3]->Wait(absl::Seconds(10)).IgnoreError();
  workers[3] = StartWorker("w2", addr, "elastic_ps_rejoined");
  const int code = master->Wait(absl::Seconds(200)).value_or(-1);
  const std::string out = ReadFile(log);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("elastic: spare 's1' takes the place of 'b'"));
  EXPECT_THAT(out, HasSubstr("s1: server of shard 1"));
  EXPECT_THAT(out, HasSubstr("elastic: 'w2' is back"));
  for (size_t i : {0, 2, 3, 4}) EXPECT_EQ(workers[i]->Wait(absl::Seconds(30)).value_or(-1), 0) << "worker " << i;
  ExpectEndsEqual(data, whole, elastic, flags, names);
}

// A worker that hangs (SIGSTOP) is lost as a dead one is, once it leaves
// a liveness probe unanswered: the spare takes its place and the job ends.
TEST(Elastic, AHungWorkerIsReplacedByASpare) {
  const std::string data = ToyData();
  const std::string dir = FreshDir("elastic_hung");
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = StartWorkers({"w1", "w2", "s1"}, addr, "elastic_hung");
  const std::string log = TempPath("elastic_hung_master.log");
  auto master = launch::Subprocess::Spawn(
                    MasterArgv("w1,w2", addr, data, {"--checkpoint-dir", dir, "--checkpoint-every", "3",
                                                     "--max-restarts", "1", "--spares", "s1"}),
                    log)
                    .value();
  ASSERT_TRUE(WaitFor(log, "checkpoint: step 6 ", *master)) << ReadFile(log);
  workers[1]->Signal(SIGSTOP);
  const int code = master->Wait(absl::Seconds(120)).value_or(-1);
  const std::string out = ReadFile(log);
  workers[1]->Signal(SIGKILL);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("did not answer a liveness probe"));
  EXPECT_THAT(out, HasSubstr("elastic: spare 's1' takes the place of 'w2'"));
  EXPECT_THAT(out, HasSubstr("checkpoint: step 30 in " + dir));
}

// A worker lost before the first checkpoint: nothing to go on from; the
// job fails as without --max-restarts, saying why.
TEST(Elastic, ALossBeforeTheFirstCheckpointFailsTheJobSayingSo) {
  const std::string data = ToyData();
  const std::string dir = FreshDir("elastic_early");
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = StartWorkers({"w1", "w2"}, addr, "elastic_early");
  const std::string log = TempPath("elastic_early_master.log");
  auto master = launch::Subprocess::Spawn(
                    MasterArgv("w1,w2", addr, data, {"--checkpoint-dir", dir, "--checkpoint-every", "1000",
                                                     "--max-restarts", "1"}),
                    log)
                    .value();
  ASSERT_TRUE(WaitFor(log, "data: read on", *master)) << ReadFile(log);
  workers[1]->Signal(SIGKILL);
  const int code = master->Wait(absl::Seconds(60)).value_or(-1);
  const std::string out = ReadFile(log);
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("worker 'w2' lost, and there is no complete checkpoint in " + dir));
}

// --max-restarts 1: w2 is killed and comes back; killed again, the job
// fails saying why.
TEST(Elastic, ALossBeyondMaxRestartsFailsTheJobSayingSo) {
  const std::string data = ToyData();
  const std::string dir = FreshDir("elastic_twice");
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto workers = StartWorkers({"w1", "w2"}, addr, "elastic_twice");
  const std::string log = TempPath("elastic_twice_master.log");
  auto master = launch::Subprocess::Spawn(MasterArgv("w1,w2", addr, data,
                                                     {"--checkpoint-dir", dir, "--checkpoint-every", "3",
                                                      "--max-restarts", "1", "--rejoin-timeout", "60"}),
                                          log)
                    .value();
  ASSERT_TRUE(WaitFor(log, "checkpoint: step 6 ", *master)) << ReadFile(log);
  workers[1]->Signal(SIGKILL);
  ASSERT_TRUE(WaitFor(log, "for a worker to register again as 'w2'", *master)) << ReadFile(log);
  workers[1]->Wait(absl::Seconds(10)).IgnoreError();
  workers[1] = StartWorker("w2", addr, "elastic_twice_again");
  ASSERT_TRUE(WaitFor(log, "checkpoint: step 12 ", *master)) << ReadFile(log);
  workers[1]->Signal(SIGKILL);
  const int code = master->Wait(absl::Seconds(60)).value_or(-1);
  const std::string out = ReadFile(log);
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("elastic: 'w2' is back"));
  EXPECT_THAT(out, HasSubstr("worker 'w2' lost after 1 recovery (--max-restarts 1): giving up"));
  EXPECT_EQ(workers[0]->Wait(absl::Seconds(30)).value_or(-1), 1) << "the master ends the group";
}

}  // namespace
}  // namespace remora::train
