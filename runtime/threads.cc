#include "runtime/threads.h"

#include <dlfcn.h>

#include <ATen/Parallel.h>

namespace remora::runtime {

void SetComputeThreads(int n) {
  at::set_num_threads(n);
  using SetThreads = void (*)(int);
  if (auto* set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set(n);
  }
}

}  // namespace remora::runtime
