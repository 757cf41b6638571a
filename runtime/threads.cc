#include "runtime/threads.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

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

void PreferPassiveOpenMpWaits(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/0) != 0) return;
  execv("/proc/self/exe", argv);
  // (Still here: the program runs on with OpenMP's own policy.)
  std::fprintf(stderr, "remora: note: could not restart %s with OMP_WAIT_POLICY=PASSIVE (%s); LibTorch's "
               "threads spin while they wait\n", argv[0], std::strerror(errno));
}

void UseDeterministicAlgorithms() {
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::Context& torch = at::globalContext();
  torch.setBenchmarkCuDNN(false);
  torch.setDeterministicCuDNN(true);
  torch.setDeterministicAlgorithms(true, /*warn_only=*/true);
}

}  // namespace remora::runtime
