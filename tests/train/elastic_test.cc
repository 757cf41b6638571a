// Elastic training with the real programs: a job that loses workers goes
// on by itself from its last checkpoint, with a spare taking a killed
// worker's place, a restarted worker standing by in turn, and a killed
// worker started again under its name, and ends bitwise equal to a job
// that lost none (where LibTorch trains reproducibly); the same with
// replicas (ZeRO-1) and with the parameter server; a worker restarted on its own port
// rejoins as a new process; a job that loses more workers than
// --max-restarts allows fails saying so; the flags' misuse is refused; a
// worker that must be restarted fails the probe and exits; a job resumed
// under another cut recovers from the checkpoint written for that cut.
#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "tests/support/master_runs.h"
#include "train/elastic.h"
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

// A job under test: the stock workers `names` and a master training over
// `pipeline` (JobArgv with `flags`), logging to files named after `tag`.
struct Job {
  std::string addr, log;
  std::vector<std::unique_ptr<launch::Subprocess>> workers;
  std::unique_ptr<launch::Subprocess> master;
};
Job StartJob(const std::string& tag, const std::vector<std::string>& names, const std::string& pipeline,
             const std::string& data, const std::vector<std::string>& flags) {
  Job job;
  job.addr = absl::StrCat("127.0.0.1:", FreePort());
  job.workers = StartWorkers(names, job.addr, tag);
  job.log = TempPath(tag + "_master.log");
  job.master = launch::Subprocess::Spawn(JobArgv(pipeline, job.addr, data, flags), job.log).value();
  return job;
}

// Whether the job's master wrote `text` (after its first `after`, when
// given) while it ran, within 120 s; the failure shows the master's output.
::testing::AssertionResult Reached(const Job& job, const std::string& text, const std::string& after = "") {
  if (AwaitOutput(*job.master, job.log, text, absl::Seconds(120), absl::Milliseconds(2), after)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "the master did not write '" << text << "'"
                                       << (after.empty() ? "" : " after '" + after + "'") << ":\n"
                                       << ReadFile(job.log);
}

// SIGKILLs the job's worker `i` and, once the master waits for a worker
// to register again as `name`, starts a new process under that name
// (logging to files named after `tag`), as a supervisor would.
::testing::AssertionResult RestartWhenAwaited(Job& job, size_t i, const std::string& name, const std::string& tag) {
  job.workers[i]->Signal(SIGKILL);
  ::testing::AssertionResult awaited = Reached(job, absl::StrCat("for a worker to register again as '", name, "'"));
  if (!awaited) return awaited;
  job.workers[i]->Wait(absl::Seconds(10)).IgnoreError();
  job.workers[i] = StartWorker(name, job.addr, tag);
  return ::testing::AssertionSuccess();
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
  // (30 epochs of 10 steps: time for the restarts in between. With
  // --deterministic, each worker that takes a lost one's place is switched
  // as the first ones were.)
  const std::vector<std::string> saves = {"--checkpoint-every", "3", "--keep", "2", "--epochs", "30",
                                          "--deterministic"};
  ASSERT_TRUE(RunWhole(data, whole, saves));
  const std::string report = TempPath("elastic_report.json"), board = FreshDir("elastic_tensorboard");
  std::vector<std::string> flags = saves;
  flags.insert(flags.end(), {"--checkpoint-dir", elastic, "--max-restarts", "3", "--spares", "s1",
                             "--rejoin-timeout", "60", "--report", report, "--tensorboard", board});
  Job job = StartJob("elastic", {"w1", "w2", "s1"}, "w1,w2", data, flags);
  ASSERT_TRUE(Reached(job, "checkpoint: step 6 "));
  job.workers[1]->Signal(SIGKILL);
  job.workers[1]->Wait(absl::Seconds(10)).IgnoreError();
  job.workers[1] = StartWorker("w2", job.addr, "elastic_w2_again");  // joins once the master found it lost
  ASSERT_TRUE(Reached(job, "checkpoint: step ", "worker 'w2' registered again"));
  job.workers[0]->Signal(SIGKILL);
  ASSERT_TRUE(Reached(job, "checkpoint: step ", "elastic: recovery 2 of 3"));
  ASSERT_TRUE(RestartWhenAwaited(job, 2, "s1", "elastic_s1_again"));
  const int code = job.master->Wait(absl::Seconds(200)).value_or(-1);
  const std::string out = ReadFile(job.log);
  ASSERT_EQ(code, 0) << out;
  for (size_t i : {1, 2}) EXPECT_EQ(job.workers[i]->Wait(absl::Seconds(30)).value_or(-1), 0) << "worker " << i;

  EXPECT_THAT(out, HasSubstr("s1: spare, standing by"));
  EXPECT_THAT(out, HasSubstr("elastic: spare 's1' takes the place of 'w2'"));
  EXPECT_THAT(out, HasSubstr("elastic: recovery 1 of 3: going on over w1,s1 from the checkpoint of step "));
  EXPECT_THAT(out, HasSubstr("elastic: 'w2', back since a spare took its place, takes the place of 'w1'"));
  EXPECT_THAT(out, HasSubstr("elastic: recovery 2 of 3: going on over w2,s1 from the checkpoint of step "));
  EXPECT_THAT(out, HasSubstr("elastic: 's1' is back"));
  EXPECT_THAT(out, HasSubstr("elastic: recovery 3 of 3: going on over w2,s1 from the checkpoint of step "));
  EXPECT_THAT(out, HasSubstr("checkpoint: step 300 in " + elastic));
  // w2 came back as a new process and took w1's place: switched too.
  EXPECT_THAT(ReadFile(TempPath("elastic_w2_again_w2.log")),
              HasSubstr("worker 'w2': deterministic algorithms (the master's --deterministic)"));
  // Each recovery's steps to train again: from its checkpoint to the step
  // after which the worker was lost (the count once read 0 every time).
  const std::regex lost("elastic: lost [^\n]* after step ([0-9]+) ");
  const std::regex going("from the checkpoint of step ([0-9]+) \\(([0-9]+) steps? to train again\\)");
  std::vector<int64_t> failed_at;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), lost); it != std::sregex_iterator(); ++it) {
    failed_at.push_back(std::stoll((*it)[1]));
  }
  ASSERT_EQ(failed_at.size(), 3u) << out;
  size_t k = 0;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), going); it != std::sregex_iterator(); ++it, ++k) {
    ASSERT_LT(k, failed_at.size());
    EXPECT_EQ(std::stoll((*it)[2]), failed_at[k] - std::stoll((*it)[1])) << (*it)[0];
  }
  EXPECT_EQ(k, 3u);
  // The report lists the recoveries; TensorBoard has run/recoveries.
  const std::string json = ReadFile(report);
  EXPECT_THAT(json, HasSubstr("\"recoveries\": [{\"lost\": \"w2\", \"replacement\": \"s1\""));
  EXPECT_THAT(json, HasSubstr("{\"lost\": \"w1\", \"replacement\": \"w2\""));
  EXPECT_THAT(json, HasSubstr("{\"lost\": \"s1\", \"replacement\": \"s1\""));
  std::vector<int64_t> restarts;
  const auto recoveries = test_support::ScalarsIn(board, "run/recoveries", &restarts);
  ASSERT_EQ(recoveries.size(), 3u);
  EXPECT_EQ(recoveries[2].value, 3);
  // Each recovery marks a restart at the step after its checkpoint's, so
  // that TensorBoard shows the steps trained again once.
  std::vector<int64_t> went_on_after;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), going); it != std::sregex_iterator(); ++it) {
    went_on_after.push_back(std::stoll((*it)[1]) + 1);
  }
  EXPECT_EQ(restarts, went_on_after);
  // Every epoch and step is reported once, the attempts' that failed
  // included, and the run's time holds the failures' (it once counted only
  // the epochs of the last attempt, from where it went on).
  EXPECT_EQ(test_support::ReportEpochs(json).size(), 30u) << json;
  const auto steps = test_support::ReportNumbers(json, "batch_seconds");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].size(), 300u);
  std::smatch run_seconds;
  ASSERT_TRUE(std::regex_search(json, run_seconds, std::regex("\"seconds\": ([0-9.]+), \"steady_batch")));
  double failures = 0;
  const std::regex lost_time("\"seconds_to_detect\": ([0-9.]+), [^}]*\"seconds_lost\": ([0-9.]+)");
  for (auto it = std::sregex_iterator(json.begin(), json.end(), lost_time); it != std::sregex_iterator(); ++it) {
    failures += std::stod((*it)[1]) + std::stod((*it)[2]);
  }
  EXPECT_GT(failures, 0) << json;
  EXPECT_GE(std::stod(run_seconds[1]), failures) << json;

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
  // (A cosine schedule after a warm-up: the restored shares go on from the
  // step count their checkpoint holds, or the job would not end equal.)
  const std::vector<std::string> flags = {"--replicas", "2", "--zero", "1", "--checkpoint-every", "3",
                                          "--lr-schedule", "cosine", "--warmup-steps", "2"};
  ASSERT_TRUE(RunWhole(data, whole, flags));
  std::vector<std::string> more = flags;
  more.insert(more.end(), {"--checkpoint-dir", elastic, "--max-restarts", "1", "--spares", "s1"});
  Job job = StartJob("elastic_dp", {"w1", "w2", "s1"}, "w1,w2", data, more);
  ASSERT_TRUE(Reached(job, "checkpoint: step 6 "));
  job.workers[1]->Signal(SIGKILL);
  const int code = job.master->Wait(absl::Seconds(200)).value_or(-1);
  const std::string out = ReadFile(job.log);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("elastic: spare 's1' takes the place of 'w2'"));
  EXPECT_THAT(out, HasSubstr("2 replicas"));
  EXPECT_THAT(out, HasSubstr("ZeRO-1: optimizer state sharded"));
  ExpectEndsEqual(data, whole, elastic, flags);
}

// The parameter server over two server processes: server b is SIGKILLed
// after the checkpoint of step 6 and the spare takes its partition (restored
// from the checkpoint); then compute worker w2 after step 15, started
// again under its name. The job ends where one that lost none ends.
TEST(Elastic, ALostParameterServerPartitionAndComputeWorkerAreReplaced) {
  const std::string data = ToyData();
  const std::string whole = FreshDir("elastic_ps_whole"), elastic = FreshDir("elastic_ps_ckpt");
  const std::vector<std::string> flags = {"--mode", "ps", "--ps-partitions", "2", "--checkpoint-every", "3",
                                          "--lr-schedule", "linear", "--warmup-steps", "2"};
  const std::vector<std::string> names = {"a", "b", "w1", "w2"};
  ASSERT_TRUE(RunWhole(data, whole, flags, names));
  std::vector<std::string> more = flags;
  more.insert(more.end(), {"--checkpoint-dir", elastic, "--max-restarts", "2", "--spares", "s1"});
  Job job = StartJob("elastic_ps", {"a", "b", "w1", "w2", "s1"}, "a,b,w1,w2", data, more);
  ASSERT_TRUE(Reached(job, "checkpoint: step 6 "));
  job.workers[1]->Signal(SIGKILL);
  ASSERT_TRUE(Reached(job, "checkpoint: step 15 "));
  ASSERT_TRUE(RestartWhenAwaited(job, 3, "w2", "elastic_ps_rejoined"));
  const int code = job.master->Wait(absl::Seconds(200)).value_or(-1);
  const std::string out = ReadFile(job.log);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("elastic: spare 's1' takes the place of 'b'"));
  EXPECT_THAT(out, HasSubstr("s1: server of partition 1"));
  EXPECT_THAT(out, HasSubstr("elastic: 'w2' is back"));
  for (size_t i : {0, 2, 3, 4}) EXPECT_EQ(job.workers[i]->Wait(absl::Seconds(30)).value_or(-1), 0) << "worker " << i;
  ExpectEndsEqual(data, whole, elastic, flags, names);
}

// A worker that hangs (SIGSTOP) is lost as a dead one is, once it leaves
// a liveness probe or gRPC's keepalive unanswered: the spare takes its
// place and the job ends. The hung process, resumed, learns from the
// master that its place is taken and exits 1 (for its supervisor to start
// it again), instead of idling on. The job runs ZB-V (w2 holds stages 1
// and 2 of the V, split backward passes), and ends where one that lost
// none ends.
TEST(Elastic, AHungWorkerIsReplacedByASpare) {
  const std::string data = ToyData();
  const std::string dir = FreshDir("elastic_hung"), whole = FreshDir("elastic_hung_whole");
  const std::vector<std::string> zbv = {"--schedule", "zbv", "--checkpoint-every", "3"};
  ASSERT_TRUE(RunWhole(data, whole, zbv));
  std::vector<std::string> flags = zbv;
  flags.insert(flags.end(), {"--checkpoint-dir", dir, "--max-restarts", "1", "--spares", "s1"});
  Job job = StartJob("elastic_hung", {"w1", "w2", "s1"}, "w1,w2", data, flags);
  ASSERT_TRUE(Reached(job, "checkpoint: step 6 "));
  job.workers[1]->Signal(SIGSTOP);
  EXPECT_TRUE(AwaitStopped(job.workers[1]->pid()));
  const bool replaced = Reached(job, "elastic: spare 's1' takes the place of 'w2'");
  job.workers[1]->Signal(SIGCONT);
  const int hung_code = job.workers[1]->Wait(absl::Seconds(30)).value_or(-1);
  const int code = job.master->Wait(absl::Seconds(120)).value_or(-1);
  const std::string out = ReadFile(job.log);
  job.workers[1]->Signal(SIGKILL);
  ASSERT_TRUE(replaced) << out;
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(hung_code, 1);
  EXPECT_THAT(ReadFile(TempPath("elastic_hung_w2.log")), HasSubstr("the master declared worker 'w2' at 127.0.0.1:"));
  EXPECT_THAT(ReadFile(TempPath("elastic_hung_w2.log")), HasSubstr(" lost: this process is no longer in the group"));
  // Found as a hang, not a crash: by the step's liveness probe, gRPC's
  // keepalive or the local link's, whichever fires first.
  EXPECT_THAT(out, ::testing::AnyOf(HasSubstr("did not answer a liveness probe"),
                                    HasSubstr("keepalive watchdog timeout"),
                                    HasSubstr("answered no keepalive ping")));
  EXPECT_THAT(out, HasSubstr("elastic: lost 'w2' after step "));
  // Each worker counted lost says why: here its probe timed out, or found
  // the connection gone (gRPC's keepalive or the link's closed it first).
  const std::string probe_failed =
      "elastic: 'w2' counts as lost: its probe (5s at most) failed: function 'remora.pipeline.alive' on worker 'w2' ";
  EXPECT_THAT(out, ::testing::AnyOf(HasSubstr(probe_failed + "timed out after 5s"),
                                    HasSubstr(probe_failed + "at 127.0.0.1:")));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("elastic: 'w1' counts as lost")));
  EXPECT_THAT(out, HasSubstr("elastic: spare 's1' takes the place of 'w2'"));
  EXPECT_THAT(out, HasSubstr("checkpoint: step 30 in " + dir));
  // The summary says how long the hang took to show: at least the probe's
  // wait, within the step's 10 s bound and some.
  const std::string summary = test_support::LineStarting(out, "elastic: 'w2' lost after step ");
  double showed = -1;
  const std::string seen = "the failure was seen ";
  const size_t at = summary.find(seen);
  if (at != std::string::npos) showed = std::atof(summary.c_str() + at + seen.size());
  EXPECT_GT(showed, 0.5) << summary;
  EXPECT_LT(showed, 30) << summary;
  EXPECT_THAT(out, HasSubstr("schedule zbv: 4 stages over 2 workers"));
  ExpectEndsEqual(data, whole, dir, zbv);
}

// A worker restarted on the port it had (a fixed --listen) is a new process
// all the same (the master tells processes apart by the random number each
// draws): it takes the lost one's place, and is not told it was lost.
TEST(Elastic, AWorkerRestartedOnItsOwnPortRejoinsAsANewProcess) {
  rpc::Registry registry;
  auto master = rpc::Agent::Start(MasterOptions({"w1"}), &registry).value();
  const std::vector<std::string> argv = {BinDir() + "/worker", "--name", "w1", "--master", master->self().address,
                                         "--listen", absl::StrCat("127.0.0.1:", FreePort()), "--threads", "1"};
  auto first = launch::Subprocess::Spawn(argv).value();
  ASSERT_TRUE(master->Join().ok());
  first->Signal(SIGKILL);
  first->Wait(absl::Seconds(10)).IgnoreError();
  ASSERT_TRUE(master->MarkLost("w1").ok());
  const std::string log = TempPath("same_port_w1.log");
  auto again = launch::Subprocess::Spawn(argv, log).value();
  ASSERT_TRUE(master->AwaitRejoin("w1", absl::Seconds(30)).ok()) << ReadFile(log);
  EXPECT_TRUE(master->rpc_sync("w1", "remora.pipeline.alive").ok());
  absl::SleepFor(absl::Seconds(2.5));  // (its pings: two at least)
  EXPECT_TRUE(again->running()) << ReadFile(log);
  EXPECT_TRUE(master->Shutdown().ok());
  EXPECT_EQ(again->Wait(absl::Seconds(30)).value_or(-1), 0) << ReadFile(log);
}

// A worker that must be restarted (the CUDA channel finds its GPU work
// waiting behind a copy that will never complete) answers the elastic
// probe with why, so the master counts it as lost, and exits 1 within
// seconds, for its supervisor to start it again or a spare to take its
// place (the replacement itself is the tests above).
TEST(Elastic, AWorkerThatMustBeRestartedFailsTheProbeAndExits) {
  test_support::TestWorkers workers(2, "test_worker");  // for require_restart
  workers.ExpectUncleanShutdown();
  rpc::Agent& master = workers.master();
  ASSERT_TRUE(pipeline::UnansweringWorkers(master, {"w1", "w2"}, absl::Seconds(5)).empty());
  ASSERT_TRUE(master.rpc_sync("w2", "require_restart", {std::string("its GPU stream is stuck")}).ok());
  // (The worker stops at its next second: a probe before that hears why,
  // as the function's error; one after finds it stopping or gone.)
  auto probe = master.rpc_sync("w2", "remora.pipeline.alive");
  ASSERT_FALSE(probe.ok());
  if (probe.status().code() == absl::StatusCode::kInternal) {
    EXPECT_THAT(probe.status().message(), HasSubstr("worker 'w2' must be restarted: its GPU stream is stuck"));
  }
  EXPECT_EQ(pipeline::UnansweringWorkers(master, {"w1", "w2"}, absl::Seconds(5)), std::vector<std::string>{"w2"});
  EXPECT_EQ(workers.worker(1).Wait(absl::Seconds(15)).value_or(-1), 1);
  EXPECT_TRUE(workers.worker(0).running());
}

// A worker lost before the first checkpoint: nothing to go on from; the
// job fails as without --max-restarts, saying why.
TEST(Elastic, ALossBeforeTheFirstCheckpointFailsTheJobSayingSo) {
  const std::string data = ToyData();
  const std::string dir = FreshDir("elastic_early");
  Job job = StartJob("elastic_early", {"w1", "w2"}, "w1,w2", data,
                     {"--checkpoint-dir", dir, "--checkpoint-every", "1000", "--max-restarts", "1"});
  ASSERT_TRUE(Reached(job, "data: read on"));
  job.workers[1]->Signal(SIGKILL);
  const int code = job.master->Wait(absl::Seconds(60)).value_or(-1);
  const std::string out = ReadFile(job.log);
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("worker 'w2' lost, and there is nothing to go on from: no complete checkpoint in " +
                             dir + " (one is complete once its manifest.json is written); giving up"));
}

// --max-restarts 1: w2 is killed and comes back; killed again, the job
// fails saying why.
TEST(Elastic, ALossBeyondMaxRestartsFailsTheJobSayingSo) {
  const std::string data = ToyData();
  const std::string dir = FreshDir("elastic_twice");
  Job job = StartJob("elastic_twice", {"w1", "w2"}, "w1,w2", data,
                     {"--checkpoint-dir", dir, "--checkpoint-every", "3", "--max-restarts", "1",
                      "--rejoin-timeout", "60"});
  ASSERT_TRUE(Reached(job, "checkpoint: step 6 "));
  ASSERT_TRUE(RestartWhenAwaited(job, 1, "w2", "elastic_twice_again"));
  ASSERT_TRUE(Reached(job, "checkpoint: step 12 "));
  job.workers[1]->Signal(SIGKILL);
  const int code = job.master->Wait(absl::Seconds(60)).value_or(-1);
  const std::string out = ReadFile(job.log);
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("elastic: 'w2' is back"));
  EXPECT_THAT(out, HasSubstr("worker 'w2' lost after 1 recovery (--max-restarts 1): giving up"));
  EXPECT_EQ(job.workers[0]->Wait(absl::Seconds(30)).value_or(-1), 1) << "the master ends the group";
}

// master --resume under another cut (the GPT saved over two workers, resumed
// over three), then w2 lost before the run saves a step of its own: the
// directory's latest checkpoint is still the two-worker cut's, and the
// recovery goes on from the one written again for three, ending as the
// resumed run that lost nothing.
TEST(Elastic, ALossAfterAResumeUnderAnotherCutGoesOnFromTheCheckpointCutAgain) {
  const std::string text = test_support::WriteText("elastic_cut.txt");
  const std::string dir = FreshDir("elastic_cut");
  setenv("TMPDIR", dir.c_str(), 1);  // (the tokens)
  const std::string ckpt = dir + "/ckpt", whole = dir + "/whole";
  // Six steps an epoch (48 rows in batches of 8); the resumed runs cut
  // where --split-at says (a measured cut may differ between them).
  auto gpt = [&](int epochs, std::vector<std::string> more) {
    std::vector<std::string> args = {"--dataset", "text:" + text, "--layers", "3", "--d-model", "32", "--heads", "2",
                                     "--seq-len", "16", "--batch-size", "8", "--train-rows", "48", "--splits", "2",
                                     "--schedule", "1f1b", "--seed", "5", "--threads", "1", "--epochs",
                                     std::to_string(epochs)};
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  auto [saved, saved_out] = test_support::RunPipeline(2, gpt(1, {"--checkpoint-dir", ckpt}));
  ASSERT_EQ(saved, 0) << saved_out;
  auto [resumed, resumed_out] =
      test_support::RunPipeline(3, gpt(20, {"--resume", ckpt, "--split-at", "2,3", "--checkpoint-dir", whole}));
  ASSERT_EQ(resumed, 0) << resumed_out;

  Job job;
  job.addr = absl::StrCat("127.0.0.1:", FreePort());
  job.workers = StartWorkers({"w1", "w2", "w3"}, job.addr, "elastic_cut");
  job.log = TempPath("elastic_cut_master.log");
  std::vector<std::string> argv = {BinDir() + "/master", "--workers", "w1,w2,w3", "--listen", job.addr};
  for (const std::string& a : gpt(20, {"--resume", ckpt, "--split-at", "2,3", "--checkpoint-dir", ckpt,
                                       "--checkpoint-every", "1000", "--max-restarts", "1", "--rejoin-timeout",
                                       "60"})) {
    argv.push_back(a);
  }
  job.master = launch::Subprocess::Spawn(argv, job.log).value();
  ASSERT_TRUE(Reached(job, "cut again: 3 stages over 3 workers"));
  ASSERT_TRUE(RestartWhenAwaited(job, 1, "w2", "elastic_cut_again"));
  const int code = job.master->Wait(absl::Seconds(200)).value_or(-1);
  const std::string out = ReadFile(job.log);
  ASSERT_EQ(code, 0) << out;
  // Both attempts load the checkpoint written for three workers.
  const std::string loaded = "resumed from " + ckpt + "/relayout-step-00000006: step 6";
  const size_t first = out.find(loaded);
  ASSERT_NE(first, std::string::npos) << out;
  EXPECT_NE(out.find(loaded, first + 1), std::string::npos) << out;
  EXPECT_THAT(out, HasSubstr("'w2' lost after step 6, back under its name; went on from step 6 (0 trained again"))
      << out;
  const StageDifference after = CompareStages(whole, ckpt);
  EXPECT_TRUE(after.equal || after.largest < 1e-5) << after.largest;
}

}  // namespace
}  // namespace remora::train
