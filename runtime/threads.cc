#include "runtime/threads.h"

#include <dlfcn.h>

#include <cstdlib>

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

void UseDeterministicAlgorithms() {
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::Context& torch = at::globalContext();
  torch.setBenchmarkCuDNN(false);
  torch.setDeterministicCuDNN(true);
  torch.setDeterministicAlgorithms(true, /*warn_only=*/true);
}

}  // namespace remora::runtime
