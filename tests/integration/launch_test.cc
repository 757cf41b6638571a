// remora-launch, the real program: flags and errors, the command each rank
// gets under torchrun's and Slurm's variables (--dry-run), and a group of
// three ranks that trains under torchrun's variables, and one whose killed
// worker and master remora-launch --max-restarts brings back; and how the
// programs end on a signal (Ctrl-C, SIGTERM), which it restarts.
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <torch/version.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "runtime/cpus.h"
#include "tests/support/master_runs.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/proc.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const std::string kLaunch = BinDir() + "/remora-launch";

// remora-launch with exactly `env` as its environment (env -i), plus
// this process's LD_LIBRARY_PATH: where the libraries live on a machine
// that keeps them outside the loader's paths (scripts/gpu_check.sh).
std::pair<int, std::string> Launch(const std::vector<std::string>& env,
                                   const std::vector<std::string>& args,
                                   absl::Duration timeout = absl::Seconds(60)) {
  std::vector<std::string> argv = {"/usr/bin/env", "-i", "PATH=/usr/bin:/bin"};
  if (const char* libs = std::getenv("LD_LIBRARY_PATH")) {
    argv.push_back(absl::StrCat("LD_LIBRARY_PATH=", libs));
  }
  argv.insert(argv.end(), env.begin(), env.end());
  argv.push_back(kLaunch);
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProgram(argv, timeout);
}

// Subprocess::Spawn's `env`: the child gets the entries (one replacing
// this process's own variable of that name), this process keeps its own.
TEST(Subprocess, TheChildGetsTheEnvironmentEntriesOnTopOfOurs) {
  const std::string dir = testing::TempDir();
  const std::string out = dir + "/spawn_env.txt";
  ASSERT_EQ(setenv("REMORA_SPAWN_TEST_KEPT", "ours", 1), 0);  // (no other thread runs in this test)
  ASSERT_EQ(setenv("REMORA_SPAWN_TEST_REPLACED", "ours", 1), 0);
  auto child = launch::Subprocess::Spawn(
      {"/bin/sh", "-c", "echo \"$REMORA_SPAWN_TEST_KEPT $REMORA_SPAWN_TEST_REPLACED $REMORA_SPAWN_TEST_NEW\""}, out,
      {"REMORA_SPAWN_TEST_REPLACED=theirs", "REMORA_SPAWN_TEST_NEW=x=y"});
  ASSERT_TRUE(child.ok()) << child.status();
  auto code = (*child)->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  std::ifstream f(out);
  std::string line;
  std::getline(f, line);
  EXPECT_EQ(line, "ours theirs x=y");
  EXPECT_STREQ(std::getenv("REMORA_SPAWN_TEST_REPLACED"), "ours");
  EXPECT_EQ(std::getenv("REMORA_SPAWN_TEST_NEW"), nullptr);
  auto bad = launch::Subprocess::Spawn({"/bin/true"}, "", {"NO_EQUALS_SIGN"});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("'NO_EQUALS_SIGN' is not NAME=VALUE"));
}

// A process that joined a process group ignores SIGPIPE
// (ProcessGroup::Join); a program it starts gets the default action back.
TEST(Subprocess, TheChildGetsSigpipesDefaultAction) {
  const std::string out = testing::TempDir() + "/spawn_sigpipe.txt";
  struct sigaction before = {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &before), 0);
  signal(SIGPIPE, SIG_IGN);
  auto child = launch::Subprocess::Spawn({"/bin/sh", "-c", "grep '^SigIgn:' /proc/self/status"}, out);
  sigaction(SIGPIPE, &before, nullptr);
  ASSERT_TRUE(child.ok()) << child.status();
  ASSERT_EQ((*child)->Wait(absl::Seconds(30)).value_or(-1), 0);
  std::ifstream f(out);
  std::string label, mask;
  f >> label >> mask;
  ASSERT_EQ(label, "SigIgn:");
  const uint64_t ignored = std::stoull(mask, nullptr, 16);
  EXPECT_EQ(ignored & (uint64_t{1} << (SIGPIPE - 1)), 0u) << mask;
}

// A worker told to stop (SIGTERM from a scheduler, Ctrl-C) says so and
// ends by the signal (a shell says 128 + it), so that a supervisor can
// tell it from a worker whose master was stopped (which exits 128 + it).
TEST(Worker, ASignalIsSaidAndTheWorkerExitsWith128PlusIt) {
  const std::string log = TempPath("signalled_worker.log");
  auto worker = launch::Subprocess::Spawn({BinDir() + "/worker", "--name", "w1", "--master",
                                           absl::StrCat("127.0.0.1:", FreePort()), "--connect-timeout", "60"},
                                          log)
                    .value();
  AwaitOutput(*worker, log, "joining the master", absl::Seconds(30), absl::Milliseconds(20));
  worker->Signal(SIGTERM);
  EXPECT_EQ(worker->Wait(absl::Seconds(30)).value_or(-1), 128 + SIGTERM) << ReadFile(log);
  EXPECT_TRUE(worker->killed_by_signal());
  EXPECT_THAT(ReadFile(log), HasSubstr("worker 'w1': stopped by a signal (Terminated); exiting"));
}

// --cpus auto: each worker on this host pins every one of its threads to
// its share of the cores, in worker order, once the group has formed.
TEST(Worker, CpusAutoPinsEveryThreadOfEachWorkerToItsShareOfTheCores) {
  test_support::TestWorkers workers(2, "worker", {"--cpus", "auto"});
  const std::vector<int> all = runtime::AllowedCpus();
  for (int i = 0; i < 2; ++i) {
    const std::string share = runtime::CpuListText(runtime::ShareOfCpus(all, i, 2));
    // (The worker pins once its own Join returns: polled for up to 10 s.)
    std::vector<std::string> seen;
    for (int tries = 0; tries < 100; ++tries) {
      seen.clear();
      for (const auto& [tid, cpus] : test_support::ThreadStatus(workers.worker(i).pid(), "Cpus_allowed_list:")) {
        seen.push_back(cpus);
      }
      if (!seen.empty() && std::all_of(seen.begin(), seen.end(), [&](const std::string& c) { return c == share; })) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_THAT(seen, ::testing::Each(share)) << "w" << i + 1;
    EXPECT_GT(seen.size(), 1u);
  }
}

// Ctrl-C (SIGINT) on a master ends its group: the workers are told and
// exit at once (not after the 10 s of silence that find a master dead),
// and the master ends by the signal (a shell says 130); the workers exit
// 130 (not killed by it: a supervisor restarts neither, where it restarts
// a worker that a signal killed).
TEST(Master, ASignalEndsTheGroupAndTheWorkersExitAtOnce) {
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  std::vector<std::unique_ptr<launch::Subprocess>> workers;
  for (const std::string name : {"w1", "w2"}) {
    workers.push_back(launch::Subprocess::Spawn({BinDir() + "/worker", "--name", name, "--master", addr, "--threads", "1"},
                                             TempPath(name + "_interrupted.log"))
                          .value());
  }
  const std::string log = TempPath("interrupted_master.log");
  auto master = launch::Subprocess::Spawn({BinDir() + "/master", "--workers", "w1,w2", "--listen", addr, "--batches",
                                        "1000", "--batch-size", "8", "--image-size", "32", "--splits", "2"},
                                       log)
                    .value();
  AwaitOutput(*master, log, "batch=2 ", absl::Seconds(120), absl::Milliseconds(20));
  ASSERT_TRUE(master->running()) << ReadFile(log);
  // Twice, as a terminal's Ctrl-C reaches the master and its
  // remora-launch, which passes it on: one request, which the master
  // still tells its workers (InterruptHook.TheSameSignalAgain... shows
  // the second no longer kills it before it can).
  master->Signal(SIGINT);
  absl::SleepFor(absl::Milliseconds(2));
  master->Signal(SIGINT);
  EXPECT_EQ(master->Wait(absl::Seconds(30)).value_or(-1), 130) << ReadFile(log);
  EXPECT_TRUE(master->killed_by_signal());
  const absl::Time ended = absl::Now();
  EXPECT_THAT(ReadFile(log), HasSubstr("master: the master was stopped by a signal (Interrupt); ending the group"));
  for (size_t i = 0; i < workers.size(); ++i) {
    EXPECT_EQ(workers[i]->Wait(absl::Seconds(30)).value_or(0), 130);
    EXPECT_FALSE(workers[i]->killed_by_signal());
    EXPECT_THAT(ReadFile(TempPath(absl::StrCat("w", i + 1, "_interrupted.log"))),
                HasSubstr("was stopped and ended the group: the master was stopped by a signal"));
  }
  EXPECT_LT(absl::Now() - ended, absl::Seconds(5));
}

// master --local, stopped by a signal, says so and ends by it (as the
// master of a group does), also where SIGINT came in ignored (a script's
// background job).
TEST(Master, ALocalRunStoppedByASignalSaysSoAndEndsByIt) {
  const std::string log = TempPath("interrupted_local.log");
  auto master = launch::Subprocess::Spawn({"/bin/sh", "-c", "trap '' INT; exec \"$0\" \"$@\"", BinDir() + "/master",
                                           "--local", "--batches", "1000", "--batch-size", "8", "--image-size",
                                           "32", "--splits", "1", "--threads", "1"},
                                          log)
                    .value();
  AwaitOutput(*master, log, "batch=1 ", absl::Seconds(120), absl::Milliseconds(20));
  ASSERT_TRUE(master->running()) << ReadFile(log);
  master->Signal(SIGINT);
  EXPECT_EQ(master->Wait(absl::Seconds(30)).value_or(-1), 130) << ReadFile(log);
  EXPECT_TRUE(master->killed_by_signal());
  EXPECT_THAT(ReadFile(log), HasSubstr("master: stopped by a signal (Interrupt); exiting"));
}

// A master stopped while it waits for its group tells the workers that
// joined as stopped (they exit 143, which remora-launch does not restart;
// they exited 1, as after a master's failure, and were restarted).
TEST(Master, ASignalBeforeTheGroupFormedEndsTheJoinedWorkersAsStopped) {
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  auto worker = launch::Subprocess::Spawn({BinDir() + "/worker", "--name", "w1", "--master", addr, "--threads", "1"},
                                          TempPath("early_signal_w1.log"))
                    .value();
  const std::string log = TempPath("early_signal_master.log");
  auto master = launch::Subprocess::Spawn({BinDir() + "/master", "--workers", "w1,w2", "--listen", addr, "--batches",
                                           "1", "--batch-size", "8", "--image-size", "32", "--splits", "2",
                                           "--connect-timeout", "16"},
                                          log)
                    .value();
  // (The master says who it still waits for every quarter of its
  // --connect-timeout, 4 s here.)
  AwaitOutput(*master, log, "1 of 2 registered", absl::Seconds(60), absl::Milliseconds(50));
  ASSERT_TRUE(master->running()) << ReadFile(log);
  master->Signal(SIGTERM);
  EXPECT_EQ(master->Wait(absl::Seconds(30)).value_or(-1), 143) << ReadFile(log);
  EXPECT_EQ(worker->Wait(absl::Seconds(30)).value_or(-1), 143) << ReadFile(TempPath("early_signal_w1.log"));
  EXPECT_FALSE(worker->killed_by_signal());
  EXPECT_THAT(ReadFile(TempPath("early_signal_w1.log")),
              HasSubstr("the master was stopped before the group formed: the master was stopped by a signal "
                        "(Terminated)"));
}

// A worker that exits 128 + SIGTERM (as a worker does whose master a
// SIGTERM stopped) is said to have, beside the bare code, and is not
// restarted: its master is gone for good.
TEST(RemoraLaunch, AnExitOf128PlusASignalNamesTheSignal) {
  const std::string program = TempPath("exits_143.sh");
  {
    std::ofstream f(program);
    f << "#!/bin/sh\nexit 143\n";
  }
  ASSERT_EQ(chmod(program.c_str(), 0755), 0);
  auto [code, out] = Launch({"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29999"},
                            {"--worker-program", program, "--max-restarts", "1", "--restart-delay", "0",
                             "--checkpoint-dir", TempPath("exits_143_ckpt"), "--resume", "auto"});
  EXPECT_EQ(code, 143) << out;
  EXPECT_THAT(out, HasSubstr("worker 'worker1' exited with code 143 (128 + signal 15, Terminated: as a worker "
                             "exits whose master that signal stopped): not restarted"));
  EXPECT_THAT(out, Not(HasSubstr("restarting")));
}

// A worker killed by SIGTERM on its own (`kill PID`: remora-launch was not
// signalled) is lost like any other and started again; the master so
// killed ended its group, and is not.
TEST(RemoraLaunch, AWorkerKilledByASignalIsRestartedAndTheMasterIsNot) {
  const std::string program = TempPath("kills_itself.sh");
  {
    std::ofstream f(program);
    f << "#!/bin/sh\nkill -TERM $$\nsleep 30\n";
  }
  ASSERT_EQ(chmod(program.c_str(), 0755), 0);
  const std::vector<std::string> flags = {"--max-restarts", "1", "--restart-delay", "0", "--checkpoint-dir",
                                          TempPath("kills_itself_ckpt"), "--resume", "auto"};
  std::vector<std::string> worker_flags = {"--worker-program", program};
  worker_flags.insert(worker_flags.end(), flags.begin(), flags.end());
  auto [worker, worker_out] =
      Launch({"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29999"}, worker_flags);
  EXPECT_EQ(worker, 128 + SIGTERM) << worker_out;
  EXPECT_THAT(worker_out, HasSubstr("worker 'worker1' was killed by signal 15 (Terminated); restarting it in 0 s "
                                    "(restart 1 of 1)"));
  EXPECT_THAT(worker_out, HasSubstr("after 1 restarts (--max-restarts 1): giving up"));
  std::vector<std::string> master_flags = {"--master-program", program};
  master_flags.insert(master_flags.end(), flags.begin(), flags.end());
  auto [master, master_out] =
      Launch({"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", absl::StrCat("MASTER_PORT=", FreePort())},
             master_flags);
  EXPECT_EQ(master, 128 + SIGTERM) << master_out;
  EXPECT_THAT(master_out, HasSubstr("the master was killed by signal 15 (Terminated): not restarted"));
  EXPECT_THAT(master_out, Not(HasSubstr("restarting")));
}

TEST(RemoraLaunch, HelpAndBadFlags) {
  auto [help, help_out] = Launch({}, {"--help"});
  EXPECT_EQ(help, 0);
  EXPECT_THAT(help_out, HasSubstr("SLURM_JOB_NODELIST"));
  EXPECT_THAT(help_out, HasSubstr("MASTER_ADDR"));
  EXPECT_THAT(help_out, HasSubstr("--host-id"));
  auto [workers, workers_out] = Launch({"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1"},
                                       {"--workers", "a,b"});
  EXPECT_EQ(workers, 2);
  EXPECT_THAT(workers_out, HasSubstr("--workers is not for remora-launch"));
  auto [env, env_out] = Launch({}, {"--env", "mpi"});
  EXPECT_EQ(env, 2);
  EXPECT_THAT(env_out, HasSubstr("auto, torchrun or slurm"));
  auto [no_value, no_value_out] = Launch({}, {"--listen"});
  EXPECT_EQ(no_value, 2);
  EXPECT_THAT(no_value_out, HasSubstr("--listen needs a value"));
}

TEST(RemoraLaunch, MissingOrContradictoryEnvironmentIsAnErrorListingWhatWasFound) {
  auto [none, none_out] = Launch({"MASTER_PORT=29999"}, {"--dry-run"});
  EXPECT_EQ(none, 2);
  EXPECT_THAT(none_out, HasSubstr("no cluster environment"));
  EXPECT_THAT(none_out, HasSubstr("Found: MASTER_PORT=29999."));
  auto [bad, bad_out] = Launch({"SLURM_PROCID=4", "SLURM_NTASKS=4", "SLURM_JOB_NODELIST=n[1-2]"},
                               {"--dry-run"});
  EXPECT_EQ(bad, 2);
  EXPECT_THAT(bad_out, HasSubstr("SLURM_PROCID=4 is not below SLURM_NTASKS=4"));
  EXPECT_THAT(bad_out, HasSubstr("SLURM_JOB_NODELIST=n[1-2]"));
}

TEST(RemoraLaunch, EachRankGetsItsRoleUnderTorchrunAndSlurm) {
  const std::vector<std::string> torchrun = {"WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1",
                                             "MASTER_PORT=29611"};
  auto env = [](std::vector<std::string> e, const std::string& more) {
    e.push_back(more);
    return e;
  };
  auto [m, m_out] = Launch(env(torchrun, "RANK=0"),
                           {"--dry-run", "--batches", "2", "--token-file", "tok", "--", "--threads", "1"});
  EXPECT_EQ(m, 0) << m_out;
  EXPECT_THAT(m_out, HasSubstr("rank 0 of 3 (torchrun, local rank 0): master at 127.0.0.1:29611"));
  EXPECT_THAT(m_out, HasSubstr("/master --batches 2 --token-file tok --listen 127.0.0.1:29611 "
                               "--workers worker1,worker2\n"));
  auto [w, w_out] = Launch(env(torchrun, "RANK=2"),
                           {"--dry-run", "--batches", "2", "--token-file", "tok", "--", "--threads", "1"});
  EXPECT_EQ(w, 0) << w_out;
  EXPECT_THAT(w_out, HasSubstr("/worker --token-file tok --threads 1 --name worker2 --master "
                               "127.0.0.1:29611 --listen 127.0.0.1:0\n"));
  EXPECT_THAT(w_out, Not(HasSubstr("--batches")));

  // Slurm: rank 0's host is the node list's first, here a name that resolves.
  const std::vector<std::string> slurm = {"SLURM_NTASKS=4", "SLURM_JOB_NODELIST=localhost",
                                          "SLURM_NODEID=0"};
  auto [s0, s0_out] = Launch(env(env(slurm, "SLURM_PROCID=0"), "SLURM_LOCALID=0"),
                             {"--dry-run", "--host-id", "box7"});
  EXPECT_EQ(s0, 0) << s0_out;
  EXPECT_THAT(s0_out, HasSubstr("rank 0 of 4 (slurm, node localhost, local rank 0)"));
  EXPECT_THAT(s0_out, HasSubstr("--listen 127.0.0.1:29500 --workers worker1,worker2,worker3"));
  EXPECT_THAT(s0_out, HasSubstr("REMORA_HOST_ID=box7"));
  // The role runs with glibc's heap on huge pages, unless glibc's tunables are given.
  EXPECT_THAT(s0_out, HasSubstr("\nGLIBC_TUNABLES=glibc.malloc.hugetlb=1\n"));
  auto [s3, s3_out] = Launch(
      env(env(env(slurm, "SLURM_PROCID=3"), "SLURM_LOCALID=3"), "GLIBC_TUNABLES=glibc.malloc.check=0"), {"--dry-run"});
  EXPECT_EQ(s3, 0) << s3_out;
  EXPECT_THAT(s3_out, HasSubstr("--name worker3 --master 127.0.0.1:29500 --listen 127.0.0.1:0"));
  EXPECT_THAT(s3_out, Not(HasSubstr("GLIBC_TUNABLES")));
}

TEST(RemoraLaunch, TheMastersAddressMustBeThisHostsAndNeverTheWildcardUnasked) {
  // 192.0.2.1 (TEST-NET-1) is no address of this host.
  auto [away, away_out] = Launch({"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=192.0.2.1"}, {"--dry-run"});
  EXPECT_EQ(away, 1);
  EXPECT_THAT(away_out, HasSubstr("192.0.2.1 is not an address of this host"));
  EXPECT_THAT(away_out, HasSubstr("Set MASTER_ADDR to this host's address, or pass --listen"));
  auto [any, any_out] = Launch({"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=0.0.0.0"}, {"--dry-run"});
  EXPECT_EQ(any, 1);
  EXPECT_THAT(any_out, HasSubstr("MASTER_ADDR is 0.0.0.0, which workers cannot reach"));
  auto [asked, asked_out] = Launch({"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=0.0.0.0"},
                                   {"--dry-run", "--listen", "0.0.0.0:29612"});
  EXPECT_EQ(asked, 0) << asked_out;
  EXPECT_THAT(asked_out, HasSubstr("--listen 0.0.0.0:29612"));
  auto [unknown, unknown_out] =
      Launch({"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=no-such-host.invalid"}, {"--dry-run"});
  EXPECT_EQ(unknown, 1);
  EXPECT_THAT(unknown_out, HasSubstr("cannot resolve host 'no-such-host.invalid'"));
  EXPECT_THAT(unknown_out, HasSubstr("from MASTER_ADDR"));
}

// Three ranks started as torchrun starts them train the smallest demo:
// rank 0 is the master, ranks 1 and 2 the workers.
TEST(RemoraLaunch, ThreeRanksTrainUnderTorchrunsVariables) {
  const std::string port = absl::StrCat(FreePort());
  std::vector<std::unique_ptr<launch::Subprocess>> ranks;
  std::vector<std::string> outputs;
  for (int rank = 0; rank < 3; ++rank) {
    outputs.push_back(TempPath(absl::StrCat("launch_rank", rank, ".txt")));
    ranks.push_back(launch::Subprocess::Spawn(
                        {"/usr/bin/env", absl::StrCat("RANK=", rank), "WORLD_SIZE=3",
                         absl::StrCat("LOCAL_RANK=", rank), "MASTER_ADDR=127.0.0.1",
                         "MASTER_PORT=" + port, kLaunch, "--batches", "1", "--batch-size", "8",
                         "--image-size", "32", "--splits", "2", "--partition", "tutorial",
                         "--connect-timeout", "60", "--", "--threads", "1"},
                        outputs.back())
                        .value());
  }
  for (int rank = 0; rank < 3; ++rank) {
    auto code = ranks[rank]->Wait(absl::Seconds(240));
    ASSERT_TRUE(code.ok()) << "rank " << rank << " did not exit: " << ReadFile(outputs[rank]);
    EXPECT_EQ(*code, 0) << "rank " << rank << ":\n" << ReadFile(outputs[rank]);
  }
  const std::string master = ReadFile(outputs[0]);
  EXPECT_THAT(master, HasSubstr("remora-launch: rank 0 of 3 (torchrun, local rank 0): master at "
                                "127.0.0.1:" + port));
  EXPECT_THAT(master, HasSubstr("batch=0 loss="));
  EXPECT_THAT(ReadFile(outputs[2]), HasSubstr("worker 'worker2' at 127.0.0.1:0 joining"));
}

// `ranks` ranks under torchrun's variables on one port, each remora-launch
// with `args`; their outputs in `outputs`.
std::vector<std::unique_ptr<launch::Subprocess>> StartRanks(int ranks, const std::vector<std::string>& args,
                                                         const std::string& tag, std::vector<std::string>* outputs) {
  const std::string port = absl::StrCat(FreePort());
  std::vector<std::unique_ptr<launch::Subprocess>> out;
  for (int rank = 0; rank < ranks; ++rank) {
    outputs->push_back(TempPath(absl::StrCat(tag, "_rank", rank, ".txt")));
    std::vector<std::string> argv = {"/usr/bin/env", absl::StrCat("RANK=", rank), absl::StrCat("WORLD_SIZE=", ranks),
                                     "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port, kLaunch};
    argv.insert(argv.end(), args.begin(), args.end());
    out.push_back(launch::Subprocess::Spawn(argv, outputs->back()).value());
  }
  return out;
}

// The line of `text` that starts with `prefix` ("" when none).
std::string LineStarting(const std::string& text, const std::string& prefix) {
  const size_t at = text.rfind("\n" + prefix);
  if (at == std::string::npos) return "";
  return text.substr(at + 1, text.find('\n', at + 1) - at - 1);
}

// Under remora-launch --max-restarts 2 (which the master gets too): a
// worker SIGKILLed mid-training is started again under its name by its
// remora-launch and the master puts it back in its place and goes on from
// the last checkpoint, the other worker untouched; then the master itself
// is SIGKILLed: its remora-launch starts it again, it goes on from the last
// checkpoint (--resume auto), the workers' remora-launch start them again
// once they find the master gone, and the job ends by itself with the
// losses of a job that never failed. Without --resume auto the restarts
// are refused.
TEST(RemoraLaunch, MaxRestartsBringsKilledProcessesBackAndTheJobGoesOnFromItsCheckpoint) {
  auto [refused, refused_out] =
      Launch({"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1"}, {"--dry-run", "--max-restarts", "1"});
  EXPECT_EQ(refused, 2) << refused_out;  // (a bad flag: retried by no supervisor)
  EXPECT_THAT(refused_out, HasSubstr("give it --checkpoint-dir DIR --resume auto"));
  EXPECT_THAT(refused_out, HasSubstr("rank 1 is a worker, but every rank is given the same command"));
  auto [bad, bad_out] = Launch({"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1"}, {"--restart-delay", "-1"});
  EXPECT_EQ(bad, 2) << bad_out;
  EXPECT_THAT(bad_out, HasSubstr("--restart-delay wants seconds in 0..3600, not '-1'"));
  // --spares 1: the last worker rank stands by; the master gets
  // --max-restarts from remora-launch's.
  auto [spare, spare_out] =
      Launch({"RANK=0", "WORLD_SIZE=4", "MASTER_ADDR=127.0.0.1"},
             {"--dry-run", "--spares", "1", "--max-restarts", "2", "--checkpoint-dir", "c", "--resume", "auto"});
  EXPECT_EQ(spare, 0) << spare_out;
  EXPECT_THAT(spare_out, HasSubstr("--max-restarts 2"));
  EXPECT_THAT(spare_out, HasSubstr("--workers worker1,worker2 --spares worker3"));
  auto [no_worker, no_worker_out] =
      Launch({"RANK=0", "WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1"}, {"--dry-run", "--spares", "2"});
  EXPECT_EQ(no_worker, 2) << no_worker_out;
  EXPECT_THAT(no_worker_out, HasSubstr("--spares 2 leaves no worker to train"));

  const std::string data = TempPath("launch_restart_idx");
  test_support::WriteToyIdx(data, 320, 50);  // 10 batches of 32 per epoch
  auto args = [&](const std::string& ckpt) {
    std::filesystem::remove_all(ckpt);  // a repeated test starts fresh
    return std::vector<std::string>{"--max-restarts",  "2",    "--restart-delay",   "1",    "--dataset",
                                    "idx:" + data,     "--epochs", "3",             "--batch-size", "32",
                                    "--splits",        "2",    "--threads",         "1",    "--checkpoint-dir",
                                    ckpt,              "--checkpoint-every", "3",   "--resume", "auto",
                                    "--connect-timeout", "60", "--",                "--threads", "1",
                                    "--master-timeout", "2"};
  };
  // Uninterrupted, for the losses.
  std::vector<std::string> whole_out;
  auto whole = StartRanks(3, args(TempPath("launch_whole_ckpt")), "launch_whole", &whole_out);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(whole[rank]->Wait(absl::Seconds(240)).value_or(-1), 0) << ReadFile(whole_out[rank]);
  }
  const std::string want = LineStarting(ReadFile(whole_out[0]), "epoch=3 ");
  ASSERT_NE(want, "") << ReadFile(whole_out[0]);

  std::vector<std::string> outputs;
  auto ranks = StartRanks(3, args(TempPath("launch_restart_ckpt")), "launch_restart", &outputs);
  auto wait_for = [&](const std::string& text) {
    return AwaitOutput(*ranks[0], outputs[0], text, absl::Seconds(120), absl::Milliseconds(5));
  };
  // Rank r's program: remora-launch's child.
  auto kill_program = [&](int rank, int signo) {
    std::ifstream children(absl::StrCat("/proc/", ranks[rank]->pid(), "/task/", ranks[rank]->pid(), "/children"));
    pid_t program = 0;
    return children >> program && kill(program, signo) == 0;
  };
  // The worker is stopped by a SIGTERM sent to it alone (as `kill PID`
  // does): lost like any other, it is started again; the master dies.
  ASSERT_TRUE(wait_for("checkpoint: step 6 ")) << ReadFile(outputs[0]);
  ASSERT_TRUE(kill_program(2, SIGTERM)) << "rank 2 runs no worker";
  ASSERT_TRUE(wait_for("checkpoint: step 15 ")) << ReadFile(outputs[0]);
  ASSERT_TRUE(kill_program(0, SIGKILL)) << "rank 0 runs no master";
  for (int rank = 0; rank < 3; ++rank) {
    auto code = ranks[rank]->Wait(absl::Seconds(240));
    ASSERT_TRUE(code.ok()) << "rank " << rank << " did not exit: " << ReadFile(outputs[rank]);
    EXPECT_EQ(*code, 0) << "rank " << rank << ":\n" << ReadFile(outputs[rank]);
  }
  const std::string master = ReadFile(outputs[0]);
  EXPECT_THAT(master, HasSubstr("starting fresh (--resume auto)"));
  EXPECT_THAT(master, HasSubstr("elastic: lost 'worker2' after step "));
  EXPECT_THAT(master, HasSubstr("elastic: 'worker2' is back"));
  EXPECT_THAT(master, HasSubstr("the master was killed by signal 9 (Killed); restarting it in 1 s (restart 1 of 2)"));
  EXPECT_THAT(master, HasSubstr("resumed from "));
  EXPECT_THAT(ReadFile(outputs[2]),
              HasSubstr("worker 'worker2' was killed by signal 15 (Terminated); restarting it in 1 s "
                        "(restart 1 of 2)"));
  // worker1 kept its process through worker2's loss; it left with the
  // master.
  EXPECT_THAT(ReadFile(outputs[1]),
              HasSubstr("worker 'worker1' exited with code 1; restarting it in 1 s (restart 1 of 2)"));
  EXPECT_THAT(ReadFile(outputs[1]), Not(HasSubstr("restart 2 of 2")));
  // The same losses (equal to the printed digits where training is
  // bitwise reproducible, as with Debian's LibTorch; close elsewhere).
  auto value = [](const std::string& line, const std::string& key) {
    const size_t at = line.find(key + "=");
    return at == std::string::npos ? -1.0 : std::atof(line.c_str() + at + key.size() + 1);
  };
  const std::string got = LineStarting(master, "epoch=3 ");
  EXPECT_NEAR(value(got, "train_loss"), value(want, "train_loss"), 2e-4) << got << "\n" << want;
  EXPECT_NEAR(value(got, "test_accuracy"), value(want, "test_accuracy"), 0.021) << got << "\n" << want;
  // And the same final parameters: bitwise with Debian's LibTorch 1.13
  // (OpenBLAS), where training is reproducible, close elsewhere.
  const test_support::StageDifference d =
      test_support::CompareStages(TempPath("launch_whole_ckpt"), TempPath("launch_restart_ckpt"));
  EXPECT_LT(d.largest, 1e-5);
#if TORCH_VERSION_MAJOR < 2
  EXPECT_TRUE(d.equal) << d.largest;
#endif
}

}  // namespace
}  // namespace remora
