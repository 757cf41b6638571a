#include "runtime/threads.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <ATen/Context.h>
#include <ATen/Parallel.h>

namespace remora::runtime {

void SetComputeThreads(int n) {
  at::set_num_threads(n);
  using SetThreads = void (*)(int);
  if (auto* set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set(n);
  }
}

namespace {

// What PreferSleepingComputeWaits sets, and what a log says of one unset.
struct Wait {
  const char* name;
  const char* value;
  const char* unset;
};
constexpr Wait kWaits[] = {{"OMP_WAIT_POLICY", "PASSIVE", "(OpenMP's default)"},
                           {"OPENBLAS_THREAD_TIMEOUT", "4", "(OpenBLAS's default)"}};

}  // namespace

void PreferSleepingComputeWaits(char** argv) {
  bool set = false;
  for (const Wait& w : kWaits) {
    if (std::getenv(w.name) != nullptr) continue;
    if (setenv(w.name, w.value, /*overwrite=*/0) != 0) return;
    set = true;
  }
  if (!set) return;
  execv("/proc/self/exe", argv);
  // (Still here: the program runs on with the libraries' own waits.)
  const int error = errno;
  std::fprintf(stderr, "remora: note: could not restart %s with %s (%s); LibTorch's and OpenBLAS's threads "
               "spin while they wait\n", argv[0], ComputeWaits().c_str(), std::strerror(error));
}

std::string ComputeWaits() {
  std::string line;
  for (const Wait& w : kWaits) {
    const char* value = std::getenv(w.name);
    line += std::string(line.empty() ? "" : ", ") + w.name + "=" + (value != nullptr ? value : w.unset);
  }
  return line;
}

void UseDeterministicAlgorithms() {
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::Context& torch = at::globalContext();
  torch.setBenchmarkCuDNN(false);
  torch.setDeterministicCuDNN(true);
  torch.setDeterministicAlgorithms(true, /*warn_only=*/true);
}

}  // namespace remora::runtime
