// Compute thread settings of a remora process.
//
// Thread-safety: call from one thread (main), not while tensors are computed.
#pragma once

namespace remora::runtime {

// Sets this process's compute threads: LibTorch's intra-op threads and, when
// LibTorch's BLAS is OpenBLAS, OpenBLAS's own thread pool (which otherwise
// keeps one spinning thread per core in every process).
void SetComputeThreads(int n);

}  // namespace remora::runtime
