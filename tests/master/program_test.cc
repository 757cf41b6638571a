// The master program's failures as a user meets them: --help and bad
// command lines (each flag's checks are tested in this process,
// flags_test.cc), a busy port, workers refused or never coming; and the
// LibTorch that the build tree's programs load.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "launch/cli.h"
#include "tests/support/master_runs.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/script_models.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;


// The program's side of its flags: --help, exit code 2 for a bad command
// line with the message on stderr, 1 for workers that never register.
TEST(Master, HelpBadFlagsAndMissingWorkersGiveTheirExitCodes) {
  const std::string m = BinDir() + "/master";
  auto check = [&](std::vector<std::string> argv, int want, const std::string& text) {
    argv.insert(argv.begin(), m);
    auto [code, out] = RunProgram(argv, absl::Seconds(60));
    EXPECT_EQ(code, want) << out;
    EXPECT_THAT(out, HasSubstr(text));
  };
  check({"--help"}, 0, "--splits");
  // A default that depends on other flags is said in words, not as the
  // placeholder -1.
  auto [help_code, help] = RunProgram({m, "--help"});
  EXPECT_EQ(help_code, 0);
  EXPECT_THAT(help, Not(HasSubstr("(default: -1)")));
  EXPECT_THAT(help, HasSubstr("0.001 with --model or --dataset)\n"));
  check({"--workers", "a", "--bogus"}, 2, "unknown flag --bogus; see master --help");
  check({"--workers", "a", "--splitz", "2"}, 2, "unknown flag --splitz (did you mean --splits?)");
  check({"--local", "--splits", "0"}, 2, "master: --splits wants positive integers");
  // Waiting, it says every 10 s whom it waits for (every quarter of a
  // shorter --connect-timeout, at least every second).
  // (The first line says 1s, or more where a loaded machine woke it late.)
  auto [wait_code, waiting] = RunProgram(
      {m, "--workers", "ghost", "--listen", absl::StrCat("127.0.0.1:", FreePort()), "--connect-timeout", "4"},
      absl::Seconds(60));
  EXPECT_EQ(wait_code, 1) << waiting;
  EXPECT_THAT(waiting, ::testing::ContainsRegex(
                           "remora: master: waiting for ghost \\(0 of 1 registered; [1-3]s of --connect-timeout 4s\\)"));
  // An output file that cannot be written fails before training, not after,
  // as a bad flag value (2: a supervisor does not restart the job for it).
  check({"--local", "--report", "/proc/none/r.json"}, 2, "--report /proc/none/r.json: cannot write there");
  check({"--local", "--trace", testing::TempDir()}, 2, "(it is a directory)");
  const std::string file = TempPath("not_a_dir");
  std::ofstream(file) << "x";
  check({"--local", "--tensorboard", file}, 2,
        "--tensorboard " + file + ": cannot write into it (a file of that name exists)");
}

// The file a library of `soname` was loaded from, as `text` (ldd's output,
// or /proc/PID/maps) names it, with links resolved; empty if none.
std::string LoadedFrom(const std::string& text, const std::string& soname) {
  const size_t at = text.find("/" + soname);
  if (at == std::string::npos) return "";
  const size_t from = text.find_last_of(" \t\n", at) + 1;
  std::error_code ec;
  const std::filesystem::path file = std::filesystem::canonical(text.substr(from, at + 1 + soname.size() - from), ec);
  return ec ? "" : file.string();
}

// Where the build made a copy of libtorch_cpu without the libraries it never
// uses (cmake/TrimTorch.cmake), the programs and tests of the build tree
// load that copy, and not what only libtorch_cpu needed.
TEST(Programs, LoadTheTrimmedLibTorchWhereTheBuildMadeOne) {
  const std::string maps = ReadFile("/proc/self/maps");
  const std::string dir = BinDir() + "/../torch-trimmed";
  std::ifstream dropped_file(dir + "/.dropped");
  if (!dropped_file) {
#ifdef REMORA_TRIM_TORCH_ON
    // Trimming was asked for and patchelf was there: a LibTorch that loads
    // OpenCV (Debian 12's) should have been trimmed.
    EXPECT_THAT(maps, Not(HasSubstr("/libopencv_core.so"))) << "see cmake/TrimTorch.cmake's line in cmake's output";
#endif
    GTEST_SKIP() << "no " << dir << " (REMORA_TRIM_TORCH off, no patchelf, or nothing to drop)";
  }
  std::string dropped;
  std::getline(dropped_file, dropped);
  // "<soname> without the N libraries ...: libA libB ..."
  const size_t colon = dropped.rfind(": ");
  ASSERT_NE(colon, std::string::npos) << dropped;
  const std::vector<std::string> gone = absl::StrSplit(dropped.substr(colon + 2), ' ', absl::SkipEmpty());
  ASSERT_FALSE(gone.empty()) << dropped;
  const std::string soname = dropped.substr(0, dropped.find(' '));
  const std::string copy = std::filesystem::canonical(dir + "/" + soname).string();

  // Debian 12's OpenCV and FFmpeg were loaded for libtorch_cpu alone; a
  // dropped library that another one needs too (libnuma) stays. (The map
  // names files, libavcodec.so.59.37.100; ldd sonames, libavcodec.so.59:
  // both begin "/libavcodec.so".)
  std::vector<std::string> only_for_torch;
  for (const std::string& library : gone) {
    if (absl::StartsWith(library, "libopencv_") || absl::StartsWith(library, "libav")) {
      only_for_torch.push_back("/" + library.substr(0, library.find(".so") + 3));
    }
  }
  // This test program, from its own memory map; the programs, as the
  // loader resolves them.
  EXPECT_EQ(LoadedFrom(maps, soname), copy);
  for (const std::string& file : only_for_torch) EXPECT_THAT(maps, Not(HasSubstr(file)));
  for (const char* program : {"master", "worker"}) {
    auto [code, ldd] = RunProgram({"/usr/bin/ldd", BinDir() + "/" + program});
    ASSERT_EQ(code, 0) << ldd;
    EXPECT_EQ(LoadedFrom(ldd, soname), copy) << program << ":\n" << ldd;
    for (const std::string& file : only_for_torch) EXPECT_THAT(ldd, Not(HasSubstr(file))) << program;
    auto [help, help_out] = RunProgram({BinDir() + "/" + program, "--help"});
    EXPECT_EQ(help, 0) << help_out;
  }
}

// A --listen port in use is found before the dataset is loaded, in
// remora's words only; a worker's too, before gRPC logs its own.
// --local without --threads times the first batch at each thread count
// (the cores, halved down to 1) and trains with the fastest, saying what
// each took; several threads then sleep while they wait
// (OMP_WAIT_POLICY=PASSIVE and OPENBLAS_THREAD_TIMEOUT=4, set by starting
// the program again), unless the user chose a setting. --threads N is used
// as given, unmeasured.
TEST(Master, LocalWithoutThreadsTrainsOnTheFastestCountMeasuredHere) {
  const std::string model = TempPath("threads_model.pt");
  test_support::ScriptSequential({12, 16, 16, 5}).save(model);
  const std::vector<std::string> run = {BinDir() + "/master", "--local", "--model", model, "--input-shape", "12",
                                        "--classes", "5", "--batches", "3", "--batch-size", "32", "--splits", "1"};
  auto with_env = [&run](std::vector<std::string> env) {
    env.insert(env.begin(), "/usr/bin/env");
    env.insert(env.end(), run.begin(), run.end());
    return env;
  };
  auto [code, out] =
      RunProgram(with_env({"-u", "OMP_WAIT_POLICY", "-u", "OPENBLAS_THREAD_TIMEOUT"}), absl::Seconds(120));
  ASSERT_EQ(code, 0) << out;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int chosen = 0;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::ConsumePrefix(&line, "local: ") && !absl::StartsWith(line, "splits=")) {
      ASSERT_TRUE(absl::SimpleAtoi(line.substr(0, line.find(' ')), &chosen)) << line;
    }
  }
  ASSERT_GE(chosen, 1) << out;
  EXPECT_LE(chosen, cores);
  EXPECT_THAT(out, HasSubstr(absl::StrCat("local: splits=1 (1 micro-batch of 32 images), ", chosen,
                                          chosen == 1 ? " thread\n" : " threads\n")));
  if (cores == 1) {
    EXPECT_THAT(out, HasSubstr("local: 1 thread (this machine has one core)"));
    return;
  }
  // Both ends of the range were timed; several threads sleep while waiting.
  EXPECT_THAT(out, HasSubstr(absl::StrCat("(the fastest here: ", cores, " threads ")));
  EXPECT_THAT(out, HasSubstr(", 1 thread "));
  EXPECT_THAT(out, HasSubstr("OMP_WAIT_POLICY=PASSIVE, OPENBLAS_THREAD_TIMEOUT=4;"));
  // A setting of the user's own is kept (the other is still set).
  auto [active_code, active] = RunProgram(with_env({"OMP_WAIT_POLICY=active"}), absl::Seconds(120));
  ASSERT_EQ(active_code, 0) << active;
  EXPECT_THAT(active, HasSubstr("OMP_WAIT_POLICY=active, OPENBLAS_THREAD_TIMEOUT=4;"));
  // Given, the count is used as it is.
  std::vector<std::string> given = run;
  given.insert(given.end(), {"--threads", "1"});
  auto [given_code, one] = RunProgram(given, absl::Seconds(120));
  ASSERT_EQ(given_code, 0) << one;
  EXPECT_THAT(one, Not(HasSubstr("the fastest here")));
  EXPECT_THAT(one, HasSubstr("local: splits=1 (1 micro-batch of 32 images), 1 thread\n"));
}

TEST(Master, ABusyListenPortFailsBeforeTheDatasetLoads) {
  const std::string data = TempPath("busy_idx");
  test_support::WriteToyIdx(data, 64, 16);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  socklen_t len = sizeof(a);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const std::string addr = absl::StrCat("127.0.0.1:", ntohs(a.sin_port));
  auto [code, out] = RunProgram({BinDir() + "/master", "--workers", "worker1", "--listen", addr, "--dataset",
                                 "idx:" + data},
                                absl::Seconds(60));
  auto [wcode, wout] = RunProgram({BinDir() + "/worker", "--name", "w1", "--listen", addr, "--connect-timeout", "1"});
  close(fd);
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("--listen " + addr + ": the port is in use"));
  EXPECT_THAT(out, Not(HasSubstr("training and")));  // the dataset line
  EXPECT_EQ(wcode, 1) << wout;
  EXPECT_THAT(wout, HasSubstr("worker: --listen " + addr + ": the port is in use"));
  for (const std::string& said : {out, wout}) EXPECT_THAT(said, Not(HasSubstr("Address already in use")));  // gRPC's
}

// A worker under a name not in --workers, or one holding the wrong token:
// the master fails as soon as every expected worker has joined or been
// refused (not at --connect-timeout), naming the refused one and why, and
// the worker that joined is told to exit.
TEST(Master, RefusedWorkersFailTheMasterAtOnceNamingThemAndTheJoinedWorkerExits) {
  const std::string token = TempPath("token"), wrong = TempPath("wrong-token");
  std::ofstream(token) << "the-run-s-secret\n";
  std::ofstream(wrong) << "another-secret\n";
  struct Case {
    std::string name, token, want;
  };
  for (const Case& c : {Case{"wroker2", token, "'wroker2' at "}, Case{"worker2", wrong, "wrong token"}}) {
    SCOPED_TRACE(c.want);
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto worker1 = launch::Subprocess::Spawn({BinDir() + "/worker", "--name", "worker1", "--master", addr,
                                           "--token-file", token},
                                          TempPath("worker1.log"));
    auto worker2 = launch::Subprocess::Spawn({BinDir() + "/worker", "--name", c.name, "--master", addr,
                                           "--token-file", c.token},
                                          TempPath("worker2.log"));
    ASSERT_TRUE(worker1.ok() && worker2.ok());
    const absl::Time start = absl::Now();
    auto [code, out] = RunProgram({BinDir() + "/master", "--workers", "worker1,worker2", "--listen", addr,
                                   "--token-file", token, "--connect-timeout", "60"},
                                  absl::Seconds(90));
    EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << "the master waited out --connect-timeout";
    EXPECT_EQ(code, 1) << out;
    EXPECT_THAT(out, HasSubstr("worker2 did not register"));
    EXPECT_THAT(out, HasSubstr("was refused"));
    EXPECT_THAT(out, HasSubstr(c.want));
    if (c.name == "wroker2") {
      EXPECT_THAT(out, HasSubstr("not in --workers"));
    }
    // worker1 joined and was told the group did not form.
    EXPECT_NE((*worker1)->Wait(absl::Seconds(20)).value_or(0), 0);
    EXPECT_THAT(ReadFile(TempPath("worker1.log")), HasSubstr("worker 'worker1': joining the master at " + addr));
    EXPECT_THAT(ReadFile(TempPath("worker1.log")), HasSubstr("was accepted by the master at " + addr));
    EXPECT_THAT(ReadFile(TempPath("worker1.log")), HasSubstr("the group did not form"));
    EXPECT_THAT(ReadFile(TempPath("worker1.log")), Not(HasSubstr("master 'master' at")));  // said once
    (*worker2)->Wait(absl::Seconds(20)).IgnoreError();
  }
}

// A stage that fails at its first step (stage 1 takes 8 features, stage 0
// gives 16): master prints remora's words, what the stage was given and
// PyTorch's message on one line, without the TorchScript interpreter's
// traceback, which --verbose prints whole.
TEST(Master, AFailedStageIsOneLineAndVerboseShowsTheTraceback) {
  const std::string first = TempPath("failing_stage0.pt"), second = TempPath("failing_stage1.pt");
  test_support::ScriptLinear(12, 16, 1, true).save(first);
  test_support::ScriptLinear(8, 5, 2, false).save(second);
  const std::vector<std::string> args = {"--model", first + "," + second, "--input-shape", "12", "--classes", "5",
                                         "--batches", "1", "--batch-size", "8", "--splits", "2"};
  auto [code, out] = test_support::RunPipeline(2, args, {}, /*worker_code=*/1);
  EXPECT_EQ(code, 1) << out;
  const std::string said = test_support::LineStarting(out, "master: ");
  EXPECT_THAT(said, HasSubstr("on worker 'worker2', forward of micro-batch 0 given a Float tensor of shape [4, 16]: "
                              "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x16 and 8x5) (at `"))
      << out;
  EXPECT_THAT(said, HasSubstr("; --verbose shows the TorchScript traceback)")) << out;
  EXPECT_THAT(out, Not(HasSubstr("Traceback of TorchScript"))) << out;
  std::vector<std::string> verbose = args;
  verbose.push_back("--verbose");
  auto [verbose_code, verbose_out] = test_support::RunPipeline(2, verbose, {}, /*worker_code=*/1);
  EXPECT_EQ(verbose_code, 1) << verbose_out;
  EXPECT_THAT(verbose_out, HasSubstr("Traceback of TorchScript")) << verbose_out;
}

// The evaluator meets a model that fails the way the master does
// (Master.AFailedStageIsOneLineAndVerboseShowsTheTraceback): PyTorch's
// message and line without the TorchScript traceback, which --verbose
// shows. The model, a scripted GPT, trains in batches but fails on one row
// at a time (its narrow needs a second row); the evaluator takes the
// run's --seq-len from the checkpoint. (generate samples the built-in GPT
// only: its stages are no TorchScript.)
TEST(Evaluator, AFailedModelIsOneLineAndVerboseShowsTheTraceback) {
  torch::jit::Module gpt = test_support::ScriptByteGpt(R"(def forward(self, idx):
  pos = torch.arange(idx.size(1))
  x = self.wte.forward(idx) + torch.embedding(self.wpe, pos)
  x = self.h0.forward(x)
  x = self.h1.forward(x)
  return self.head.forward(x) + 0 * torch.narrow(x, 0, 1, 1).sum()
)");
  const std::string model = TempPath("failing_gpt.pt");
  gpt.save(model);
  const std::string text = test_support::WriteText("failing_gpt.txt");
  const std::string dir = test_support::FreshDir("failing_gpt");
  const std::string ckpt = dir + "/ckpt";
  setenv("TMPDIR", dir.c_str(), 1);  // (the tokens)
  auto [code, out] = test_support::RunPipeline(2, {"--model", model, "--dataset", "text:" + text, "--seq-len", "16",
                                                   "--batch-size", "8", "--splits", "2", "--epochs", "1",
                                                   "--train-rows", "16", "--checkpoint-dir", ckpt});
  RestoreTmpdir();
  ASSERT_EQ(code, 0) << out;
  std::vector<std::string> argv = {BinDir() + "/evaluator", "--checkpoint-dir", ckpt, "--dataset", "text:" + text,
                                   "--once", "--batch-size", "1"};
  auto [failed, said] = RunProgram(argv, absl::Seconds(60));
  EXPECT_EQ(failed, 1) << said;
  EXPECT_THAT(said, HasSubstr("evaluator: --seq-len 16")) << said;
  const std::string line = test_support::LineStarting(said, "evaluator: the model of ");
  EXPECT_THAT(line, HasSubstr("'s held-out windows: ")) << said;
  EXPECT_THAT(line, HasSubstr("(is --dataset the training's, and --seq-len?)")) << said;  // (not --image-size)
  EXPECT_THAT(line, HasSubstr("RuntimeError: start (1) + length (1) exceeds dimension size (1)")) << said;
  EXPECT_THAT(line, HasSubstr("; --verbose shows the TorchScript traceback)")) << said;
  EXPECT_THAT(said, Not(HasSubstr("Traceback of TorchScript"))) << said;
  argv.push_back("--verbose");
  auto [verbose_failed, verbose_said] = RunProgram(argv, absl::Seconds(60));
  EXPECT_EQ(verbose_failed, 1) << verbose_said;
  EXPECT_THAT(verbose_said, HasSubstr("Traceback of TorchScript")) << verbose_said;
}

// messages_per_batch counts the batches' requests, not the checkpoints':
// a run saving after every batch sends the same per batch as one that
// never saves (save_owner_file and its RRefs' ChildAccepts once doubled it).
TEST(Master, MessagesPerBatchLeaveCheckpointsOut) {
  const std::string model = TempPath("messages_model.pt");
  test_support::ScriptSequential({12, 16, 16, 5}).save(model);
  const std::vector<std::string> args = {"--model", model, "--input-shape", "12", "--classes", "5", "--batches", "3",
                                         "--batch-size", "8", "--splits", "2"};
  auto [plain_code, plain] = test_support::RunPipeline(2, args);
  ASSERT_EQ(plain_code, 0) << plain;
  std::vector<std::string> saving = args;
  const std::string report = TempPath("messages_report.json");
  saving.insert(saving.end(), {"--checkpoint-dir", test_support::FreshDir("messages_ckpt"), "--checkpoint-every",
                               "1", "--report", report});
  auto [code, out] = test_support::RunPipeline(2, saving);
  ASSERT_EQ(code, 0) << out;
  const std::string line = test_support::LineStarting(out, "messages_per_batch=");
  EXPECT_THAT(line, Not(HasSubstr("checkpoint")));
  EXPECT_THAT(line, Not(HasSubstr("ChildAccept")));
  EXPECT_THAT(line, HasSubstr("function 'remora.pipeline.run' 2"));  // one per worker
  // The same kinds and counts as without checkpoints, less the heartbeats
  // and probes, which go by the second (a slower run has more).
  auto kinds = [](const std::string& l) {
    std::vector<std::string> kept;
    const size_t open = l.find('(');
    for (absl::string_view entry : absl::StrSplit(l.substr(open + 1, l.rfind(')') - open - 1), ", ")) {
      if (!absl::StrContains(entry, "remora.wire.Ping") && !absl::StrContains(entry, "remora.pipeline.alive")) {
        kept.emplace_back(entry);
      }
    }
    return kept;
  };
  const std::string plain_line = test_support::LineStarting(plain, "messages_per_batch=");
  ASSERT_NE(line.find('('), std::string::npos) << line;
  ASSERT_NE(plain_line.find('('), std::string::npos) << plain_line;
  EXPECT_EQ(kinds(line), kinds(plain_line)) << line << "\n" << plain_line;
  EXPECT_THAT(ReadFile(report), Not(HasSubstr("remora.checkpoint.save_owner_file")));
}

// --busy-poll-us on the master and its workers changes when threads sleep,
// not what they compute: the same losses as without (the master says it
// polls; the workers' line is checked in tests/integration/benches_test.cc).
TEST(Master, BusyPollingMasterAndWorkersTrainAsWithout) {
  const std::string model = TempPath("busy_poll_model.pt");
  test_support::ScriptSequential({12, 16, 16, 5}).save(model);
  std::vector<std::vector<double>> losses;
  for (const bool busy : {false, true}) {
    const std::string report = TempPath(busy ? "busy_poll_report.json" : "sleeping_report.json");
    const std::vector<std::string> args = {"--model", model, "--input-shape", "12", "--classes", "5", "--batches", "4",
                                           "--batch-size", "8", "--splits", "2", "--report", report};
    std::vector<std::string> common;
    if (busy) common = {"--busy-poll-us", "1000"};
    auto [code, out] = test_support::RunPipeline(2, args, common);
    ASSERT_EQ(code, 0) << out;
    EXPECT_EQ(absl::StrContains(out, "(plaintext, busy-polling 1000 us), waiting for"), busy) << out;
    const std::vector<std::vector<double>> runs = test_support::ReportLosses(ReadFile(report));
    ASSERT_EQ(runs.size(), 1u) << out;
    losses.push_back(runs[0]);
  }
  ASSERT_EQ(losses[0].size(), 4u);
  test_support::ExpectSameLosses(losses[1], losses[0], "busy-polling");
}

}  // namespace
}  // namespace remora
