// Compute settings of a remora process: threads, deterministic kernels.
//
// Thread-safety: call from one thread (main), not while tensors are computed.
#pragma once

namespace remora::runtime {

// Sets this process's compute threads: LibTorch's intra-op threads and, when
// LibTorch's BLAS is OpenBLAS, OpenBLAS's own thread pool (which otherwise
// keeps one spinning thread per core in every process).
void SetComputeThreads(int n);

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
