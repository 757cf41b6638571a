// launch::InterruptHook (launch/interrupt.h): the signal handler writes the
// first signal's number to a pipe (all it may do); a watcher thread reads
// it and runs the hook's function. A later signal kills the process, but
// for the same one again within kRepeat of the first: a terminal's Ctrl-C
// reaches a program and its supervisor (remora-launch), which passes it on,
// and a scheduler signals every process of a job; that is one request.
#include "launch/interrupt.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace remora::launch {
namespace {

int g_pipe[2] = {-1, -1};  // written by the handler, read by the watcher

constexpr int64_t kRepeatNanos = 2'000'000'000;  // kRepeat: 2 s
// When the first signal came (CLOCK_MONOTONIC, ns; claimed first) and
// which it was (published second). The handler may run on several threads
// at once (a signal masks itself only on the thread that handles it).
std::atomic<int64_t> g_first_ns{0};
std::atomic<int> g_first{0};
static_assert(std::atomic<int64_t>::is_always_lock_free && std::atomic<int>::is_always_lock_free,
              "a signal handler may use only lock-free atomics");

int64_t MonotonicNanos() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);  // (async-signal-safe)
  return int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec;
}

void OnSignal(int signo) {
  const int saved = errno;
  const int64_t now = std::max<int64_t>(1, MonotonicNanos());
  int64_t unclaimed = 0;
  if (g_first_ns.compare_exchange_strong(unclaimed, now)) {
    g_first.store(signo, std::memory_order_release);
    const unsigned char b = static_cast<unsigned char>(signo);
    [[maybe_unused]] ssize_t n = write(g_pipe[1], &b, 1);
  } else {
    int first;
    while ((first = g_first.load(std::memory_order_acquire)) == 0) {
      // (claimed on another thread this instant: published next)
    }
    if (signo != first || now - g_first_ns.load() >= kRepeatNanos) {
      signal(signo, SIG_DFL);  // a second request: the signal's own action
      raise(signo);
    }
  }
  errno = saved;
}

// Ends the process by `signo`'s default action, so that its parent sees
// it killed by the signal (WIFSIGNALED) and a shell says 128 + its number;
// exits so if the signal does not end it.
[[noreturn]] void EndBy(int signo) {
  std::signal(signo, SIG_DFL);
  sigset_t only;
  sigemptyset(&only);
  sigaddset(&only, signo);
  pthread_sigmask(SIG_UNBLOCK, &only, nullptr);
  std::raise(signo);
  std::_Exit(128 + signo);
}

absl::Mutex g_mu;
std::function<void(int)>* g_on_signal ABSL_GUARDED_BY(g_mu) = nullptr;

void Watch() {
  unsigned char b = 0;
  while (read(g_pipe[0], &b, 1) != 1) {
  }
  const int signo = b;
  {
    absl::MutexLock lock(&g_mu);
    if (g_on_signal != nullptr) {
      (*g_on_signal)(signo);
      std::fflush(nullptr);
      EndBy(signo);
    }
  }
  EndBy(signo);  // no hook any more: the signal's own action
}

// The pipe, the handlers and the watcher, once per process.
void InstallOnce() {
  static const bool installed = [] {
    if (pipe2(g_pipe, O_CLOEXEC) != 0) return false;
    struct sigaction sa = {};
    sa.sa_handler = OnSignal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGINT);
    sigaddset(&sa.sa_mask, SIGTERM);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    std::thread(Watch).detach();
    return true;
  }();
  (void)installed;
}

}  // namespace

InterruptHook::InterruptHook(std::function<void(int signo)> on_signal) {
  InstallOnce();
  absl::MutexLock lock(&g_mu);
  delete g_on_signal;
  g_on_signal = new std::function<void(int)>(std::move(on_signal));
}

InterruptHook::~InterruptHook() {
  absl::MutexLock lock(&g_mu);
  delete g_on_signal;
  g_on_signal = nullptr;
}

}  // namespace remora::launch
