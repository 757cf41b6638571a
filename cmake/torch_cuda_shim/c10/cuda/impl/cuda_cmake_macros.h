// Stand-in for the header a CUDA build of LibTorch generates at its own
// build time. Debian's CPU-only libtorch-dev ships c10/cuda's headers
// without it; remora needs it only to compile-check the CUDA channel's
// LibTorch-CUDA code on such machines (remora_torch_cuda_check in
// cmake/RemoraCuda.cmake), never to link.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
