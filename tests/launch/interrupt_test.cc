// launch/interrupt.h: a process with an InterruptHook, forked from this
// one, runs the hook's function on the first SIGINT/SIGTERM and then ends
// by that signal; the same signal again within 2 s is the same request,
// and any other later signal kills it at once. No LibTorch.
#include "launch/interrupt.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace remora::launch {
namespace {

struct Ended {
  int signal = 0;     // the signal that killed the child (0: it exited)
  bool told = false;  // whether its hook's function ran to its end
};

// Forks a child whose hook sleeps `hook_ms` and then says so on a pipe;
// sends it each of `signals` (signal, ms to wait before it) once the hook
// is in place, and reaps it.
Ended Interrupt(int hook_ms, const std::vector<std::pair<int, int>>& signals) {
  int ready[2], told[2];
  EXPECT_EQ(pipe(ready), 0);
  EXPECT_EQ(pipe(told), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(ready[0]);
    close(told[0]);
    InterruptHook hook([hook_ms, fd = told[1]](int) {
      std::this_thread::sleep_for(std::chrono::milliseconds(hook_ms));
      [[maybe_unused]] ssize_t n = write(fd, "t", 1);
    });
    [[maybe_unused]] ssize_t n = write(ready[1], "r", 1);
    alarm(30);  // (a child that nothing ends fails the test instead of hanging it)
    for (;;) pause();
  }
  close(ready[1]);
  close(told[1]);
  char b = 0;
  EXPECT_EQ(read(ready[0], &b, 1), 1);
  for (const auto& [signo, after_ms] : signals) {
    std::this_thread::sleep_for(std::chrono::milliseconds(after_ms));
    kill(child, signo);
  }
  int status = 0;
  EXPECT_EQ(waitpid(child, &status, 0), child);
  Ended out;
  out.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  out.told = read(told[0], &b, 1) == 1;
  close(ready[0]);
  close(told[0]);
  return out;
}

TEST(InterruptHook, TheHookRunsAndTheProcessEndsByTheSignal) {
  const Ended e = Interrupt(50, {{SIGTERM, 0}});
  EXPECT_EQ(e.signal, SIGTERM);
  EXPECT_TRUE(e.told);
}

// A terminal's Ctrl-C reaches a program and its remora-launch, which
// passes it on: the second SIGINT must not cut the first one's telling.
TEST(InterruptHook, TheSameSignalAgainWithinTwoSecondsIsTheSameRequest) {
  const Ended e = Interrupt(400, {{SIGINT, 0}, {SIGINT, 50}, {SIGINT, 100}});
  EXPECT_EQ(e.signal, SIGINT);
  EXPECT_TRUE(e.told);
}

TEST(InterruptHook, AnotherSignalOrTheSameOneLaterKillsAtOnce) {
  const Ended other = Interrupt(5000, {{SIGINT, 0}, {SIGTERM, 100}});
  EXPECT_EQ(other.signal, SIGTERM);
  EXPECT_FALSE(other.told);
  const Ended later = Interrupt(6000, {{SIGINT, 0}, {SIGINT, 3000}});
  EXPECT_EQ(later.signal, SIGINT);
  EXPECT_FALSE(later.told);
}

}  // namespace
}  // namespace remora::launch
