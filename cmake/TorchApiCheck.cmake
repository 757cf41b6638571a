# Compile-checks remora against another LibTorch's headers (`./run torch2-check`).
#
# GPU machines build remora against LibTorch 2.x with CUDA; the development
# machines have Debian 12's LibTorch 1.13 (CPU). REMORA_TORCH_CHECK_PREFIX
# names an unpacked LibTorch whose <prefix>/include holds ATen/, c10/ and
# torch/ (the run script unpacks Debian's packages of LibTorch 2.x there).
# Every remora source, the channel's LibTorch-CUDA code (REMORA_TORCH_CUDA)
# and the GPU tests included, is then compiled against those headers,
# syntax only (the libraries' sources in the unity build's batches, one
# parse of LibTorch's headers a batch, as the build compiles them; each
# source alone is what the thread-safety check compiles), into the target
# remora_torch_api_check
# (not part of `all`: nothing links it, since the libraries are not
# unpacked). The headers it reads are listed in each object's .d file; the
# run script fails the check when one of them came from the LibTorch of this
# build (a header the other LibTorch no longer has).
get_filename_component(_remora_check_include "${REMORA_TORCH_CHECK_PREFIX}/include" ABSOLUTE)
if(NOT EXISTS "${_remora_check_include}/ATen/ATen.h")
  message(FATAL_ERROR "REMORA_TORCH_CHECK_PREFIX: no ATen/ATen.h under ${_remora_check_include}")
endif()

include(${CMAKE_CURRENT_LIST_DIR}/SourceCheck.cmake)
remora_source_check(remora_torch_api_check BATCHED)
# Ahead of every other directory, this build's LibTorch included.
target_include_directories(remora_torch_api_check SYSTEM BEFORE PRIVATE
  ${_remora_check_include} ${_remora_check_include}/torch/csrc/api/include)
# What LibTorch's CMake config gives its users (torch_cpu, torch_cuda).
target_compile_definitions(remora_torch_api_check PRIVATE
  USE_DISTRIBUTED USE_C10D_GLOO USE_RPC USE_TENSORPIPE)
if(REMORA_WITH_CUDA)
  # The channel's LibTorch-CUDA code wherever the c10/cuda headers are:
  # LibTorch built with CUDA has them all; a CPU build (Debian's) lacks only
  # the generated one, for which cmake/torch_cuda_shim stands in.
  set(_remora_check_torch_cuda "")
  if(EXISTS "${_remora_check_include}/c10/cuda/CUDAStream.h")
    set(_remora_check_torch_cuda REMORA_TORCH_CUDA=1 USE_C10D_NCCL)
    if(NOT EXISTS "${_remora_check_include}/c10/cuda/impl/cuda_cmake_macros.h")
      target_include_directories(remora_torch_api_check SYSTEM PRIVATE
                                 ${PROJECT_SOURCE_DIR}/cmake/torch_cuda_shim)
    endif()
    message(STATUS "remora: torch API check: ${_remora_check_include}, with its c10/cuda")
  else()
    message(STATUS "remora: torch API check: ${_remora_check_include}, without c10/cuda")
  endif()
  target_compile_definitions(remora_torch_api_check PRIVATE ${_remora_check_torch_cuda})
endif()
