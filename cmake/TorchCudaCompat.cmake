# Included before find_package(Torch): gives LibTorch's CUDA config what it
# expects of the CUDA toolkit where newer toolkits no longer have it.
#
# The Caffe2 config of LibTorch 2.x (share/cmake/Caffe2/public/cuda.cmake)
# links its target torch::nvtoolsext to CUDA::nvToolsExt unless it finds
# the NVTX3 headers in PyTorch's own source tree, which an installed
# LibTorch never has. CUDA 13 (and late 12.x) dropped the nvToolsExt
# library (NVTX3 is header-only), FindCUDAToolkit then defines no
# CUDA::nvToolsExt, and CMake stops at generation with "The link interface
# of target torch::nvtoolsext contains: CUDA::nvToolsExt but the target was
# not found". Here CUDA::nvToolsExt stands for the header-only NVTX3
# instead (remora itself makes no NVTX calls). Nothing happens without a
# CUDA toolkit, or where the toolkit still has the library.
#
# The toolkit is looked for as LibTorch's config and CMake's CUDA language
# will look (CUDAToolkit_ROOT, else the nvcc on PATH, else /usr/local/cuda),
# never pointed elsewhere: the results are cached, and LibTorch stops at
# "two conflicting CUDA versions" if its nvcc is not this toolkit's.
find_package(CUDAToolkit QUIET)
if(CUDAToolkit_FOUND AND NOT TARGET CUDA::nvToolsExt)
  add_library(CUDA::nvToolsExt INTERFACE IMPORTED)
  if(TARGET CUDA::nvtx3)
    set_property(TARGET CUDA::nvToolsExt PROPERTY INTERFACE_LINK_LIBRARIES CUDA::nvtx3)
  else()
    set_property(TARGET CUDA::nvToolsExt PROPERTY INTERFACE_INCLUDE_DIRECTORIES
                 ${CUDAToolkit_INCLUDE_DIRS})
  endif()
  message(STATUS "remora: CUDA toolkit ${CUDAToolkit_VERSION} has no nvToolsExt library: "
                 "CUDA::nvToolsExt is its header-only NVTX3, for LibTorch's CUDA config")
endif()
