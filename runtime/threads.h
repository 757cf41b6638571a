// Compute settings of a remora process: threads, deterministic kernels.
//
// Thread-safety: call from one thread (main), not while tensors are computed.
#pragma once

#include <string>

namespace remora::runtime {

// Sets this process's compute threads: LibTorch's intra-op threads and, when
// LibTorch's BLAS is OpenBLAS, OpenBLAS's own thread pool (which otherwise
// keeps one spinning thread per core in every process).
void SetComputeThreads(int n);

// Makes the compute threads sleep when they wait for work instead of
// spinning: LibTorch's OpenMP threads (OMP_WAIT_POLICY=PASSIVE) and
// OpenBLAS's own (OPENBLAS_THREAD_TIMEOUT=4, its shortest spin before a
// sleep; its default spins about 2^28 cycles, calling sched_yield, after
// every BLAS call). Spinning threads take the cores from the threads with
// work wherever cores are shared (a worker beside its master, another
// process, one pool's threads beside the other's). Measured on the 2-core
// VM: with PyTorch 1.13, 40 steps of a small transformer took 4.3-4.7x as
// long at 2 threads as at 1 while another process was busy, and about as
// long once OpenMP's threads slept; remora's small CNN at 2 threads took
// 11 ms or 20-24 ms a step from one run to the next while OpenBLAS's
// thread spun, 11-12 ms in every run once it slept (docs/measurements.md).
// Both libraries read their setting once, as they are loaded, so a program
// calls this as soon as it knows that it will compute on more than one
// thread, before it opens, prints or starts anything: where either
// variable is not set (a user's own setting is kept), it sets it and
// starts the program again in place (execv of /proc/self/exe: the same
// process id and arguments; LibTorch loads again, about a second on the
// 2-core VM, which is why one-thread processes do not call it); it returns
// once both are in place, or when that fails (said on stderr).
void PreferSleepingComputeWaits(char** argv);

// The two settings above as this process has them, for a log line:
// "OMP_WAIT_POLICY=PASSIVE, OPENBLAS_THREAD_TIMEOUT=4", each one not set
// named as its library's default.
std::string ComputeWaits();

// Makes LibTorch choose reproducible kernels, as PyTorch's
// torch.use_deterministic_algorithms(True, warn_only=True) with cuDNN's
// benchmark off: cuDNN's deterministic algorithms, and cuBLAS's fixed
// workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8, unless set already: it must be
// in place before the process's first cuBLAS call). An operation without a
// deterministic implementation prints LibTorch's warning and runs anyway.
// Runs of one program on one machine then repeat bit for bit where the
// summation order is fixed (the same threads, the same micro-batches).
void UseDeterministicAlgorithms();

}  // namespace remora::runtime
