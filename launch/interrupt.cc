// launch::InterruptHook (launch/interrupt.h): the signal handler writes the
// signal's number to a pipe (all it may do); a watcher thread reads it and
// runs the hook's function.
#include "launch/interrupt.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
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

void OnSignal(int signo) {
  const unsigned char b = static_cast<unsigned char>(signo);
  const int saved = errno;
  [[maybe_unused]] ssize_t n = write(g_pipe[1], &b, 1);
  errno = saved;
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
      std::_Exit(128 + signo);
    }
  }
  // No hook any more: the signal's own action.
  std::signal(signo, SIG_DFL);
  std::raise(signo);
}

// The pipe, the handlers (reset to the default after the first signal, so
// that a second one kills) and the watcher, once per process.
void InstallOnce() {
  static const bool installed = [] {
    if (pipe2(g_pipe, O_CLOEXEC) != 0) return false;
    struct sigaction sa = {};
    sa.sa_handler = OnSignal;
    sa.sa_flags = SA_RESTART | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
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
