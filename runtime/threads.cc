#include "runtime/threads.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

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

void PreferSleepingComputeWaits(char** argv) {
  bool set = false;
  constexpr std::pair<const char*, const char*> kWaits[] = {{"OMP_WAIT_POLICY", "PASSIVE"},
                                                            {"OPENBLAS_THREAD_TIMEOUT", "4"}};
  for (const auto& [name, value] : kWaits) {
    if (std::getenv(name) != nullptr) continue;
    if (setenv(name, value, /*overwrite=*/0) != 0) return;
    set = true;
  }
  if (!set) return;
  execv("/proc/self/exe", argv);
  // (Still here: the program runs on with the libraries' own waits.)
  std::fprintf(stderr, "remora: note: could not restart %s with OMP_WAIT_POLICY=PASSIVE and "
               "OPENBLAS_THREAD_TIMEOUT=4 (%s); LibTorch's and OpenBLAS's threads spin while they wait\n",
               argv[0], std::strerror(errno));
}

void UseDeterministicAlgorithms() {
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::Context& torch = at::globalContext();
  torch.setBenchmarkCuDNN(false);
  torch.setDeterministicCuDNN(true);
  torch.setDeterministicAlgorithms(true, /*warn_only=*/true);
}

}  // namespace remora::runtime
