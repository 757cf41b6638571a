# The CUDA channel's dependencies (see channel/cuda/cuda_channel.h).
#
# REMORA_CUDA (AUTO, ON, OFF) decides whether the channel is compiled:
#   REMORA_WITH_CUDA   the CUDA toolkit (runtime, headers) and NCCL >= 2.14
#                      were found: channel/cuda/ is compiled and linked
#                      against CUDA::cudart and NCCL. This does not need a GPU
#                      or a CUDA build of LibTorch: CPU-only machines compile
#                      it too, so that CI keeps it building.
#   REMORA_TORCH_CUDA  LibTorch itself was built with CUDA (torch_cuda /
#                      c10_cuda): the channel orders its copies against
#                      LibTorch's current CUDA stream with events. Without it,
#                      the channel synchronises the device on the host instead.
# Without the toolkit or NCCL everything CUDA is left out and the stub
# (channel/cuda/stub.cc) answers with "this build has no CUDA".
set(REMORA_WITH_CUDA OFF)
set(REMORA_TORCH_CUDA OFF)
string(TOUPPER "${REMORA_CUDA}" _remora_cuda)
if(NOT _remora_cuda MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "REMORA_CUDA must be AUTO, ON or OFF, not '${REMORA_CUDA}'")
endif()

if(_remora_cuda STREQUAL "OFF")
  message(STATUS "remora: CUDA channel left out (REMORA_CUDA=OFF)")
else()
  # The CUDA toolkit was looked for before LibTorch, in this scope
  # (cmake/TorchCudaCompat.cmake): CUDAToolkit_FOUND and CUDA:: targets.
  # A PyTorch wheel loads its own NCCL (site-packages/nvidia/nccl, found by
  # its RPATH). Two NCCLs in one process share one soname and whichever loads
  # first serves both, so prefer the wheel's: beside torch/, Torch_DIR is
  # torch/share/cmake/Torch. NCCL_ROOT still comes first.
  get_filename_component(_remora_wheel_nccl "${Torch_DIR}/../../../../nvidia/nccl" ABSOLUTE)
  set(_remora_cuda_hints ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT} /usr/local/cuda)
  find_path(REMORA_NCCL_INCLUDE_DIR nccl.h
            HINTS ENV NCCL_ROOT ${_remora_wheel_nccl} ${CUDAToolkit_INCLUDE_DIRS}
                  /usr/local/cuda/include
            PATH_SUFFIXES include)
  # Wheels ship libnccl.so.2 without the libnccl.so link.
  # NAMES_PER_DIR: the first directory with either name wins, so a system
  # libnccl.so does not beat the wheel's libnccl.so.2.
  find_library(REMORA_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
               HINTS ENV NCCL_ROOT ${_remora_wheel_nccl} ${_remora_cuda_hints}
               PATH_SUFFIXES lib lib64)
  set(_remora_nccl_version "")
  if(REMORA_NCCL_INCLUDE_DIR)
    file(STRINGS "${REMORA_NCCL_INCLUDE_DIR}/nccl.h" _remora_nccl_code
         REGEX "^#define NCCL_VERSION_CODE [0-9]+")
    string(REGEX REPLACE "^#define NCCL_VERSION_CODE ([0-9]+).*" "\\1" _remora_nccl_code
           "${_remora_nccl_code}")
    if(_remora_nccl_code)
      set(_remora_nccl_version "${_remora_nccl_code}")
    endif()
  endif()
  set(_remora_missing "")
  if(NOT CUDAToolkit_FOUND)
    list(APPEND _remora_missing "the CUDA toolkit (set CUDAToolkit_ROOT)")
  endif()
  if(NOT REMORA_NCCL_INCLUDE_DIR OR NOT REMORA_NCCL_LIBRARY)
    list(APPEND _remora_missing "NCCL (nccl.h and libnccl; set NCCL_ROOT)")
  elseif(_remora_nccl_version AND _remora_nccl_version LESS 21400)
    list(APPEND _remora_missing "NCCL >= 2.14 (found version code ${_remora_nccl_version})")
  endif()
  if(_remora_missing)
    string(REPLACE ";" " and " _remora_missing_text "${_remora_missing}")
    if(_remora_cuda STREQUAL "ON")
      message(FATAL_ERROR "remora: REMORA_CUDA=ON but ${_remora_missing_text} not found")
    endif()
    message(STATUS "remora: CUDA channel left out: ${_remora_missing_text} not found "
                   "(CUDA tensors cross through host memory when LibTorch has CUDA)")
  else()
    set(REMORA_WITH_CUDA ON)
    if(NOT TARGET remora::nccl)
      add_library(remora::nccl UNKNOWN IMPORTED)
      set_target_properties(remora::nccl PROPERTIES
        IMPORTED_LOCATION "${REMORA_NCCL_LIBRARY}"
        INTERFACE_INCLUDE_DIRECTORIES "${REMORA_NCCL_INCLUDE_DIR}")
    endif()
    message(STATUS "remora: CUDA channel on: CUDA toolkit ${CUDAToolkit_VERSION} at "
                   "${CUDAToolkit_INCLUDE_DIRS}, NCCL ${REMORA_NCCL_LIBRARY} "
                   "(version code ${_remora_nccl_version})")
  endif()
endif()

# Does LibTorch itself have CUDA? (Its CMake config defines these only then.)
if(TARGET torch_cuda OR TARGET c10_cuda OR TORCH_CUDA_LIBRARIES)
  set(_remora_torch_has_cuda ON)
else()
  set(_remora_torch_has_cuda OFF)
endif()
if(REMORA_WITH_CUDA AND _remora_torch_has_cuda)
  set(REMORA_TORCH_CUDA ON)
  message(STATUS "remora: LibTorch has CUDA: copies are ordered with events on its current stream")
elseif(REMORA_WITH_CUDA)
  message(STATUS "remora: LibTorch has no CUDA (CPU build): the CUDA channel is compiled, "
                 "synchronises on the host, and finds no CUDA tensors to move here")
elseif(_remora_torch_has_cuda)
  message(STATUS "remora: LibTorch has CUDA but the channel is left out: CUDA tensors are "
                 "staged through host memory")
endif()

# A CPU-only LibTorch links the channel without LibTorch's CUDA API, so the
# code that GPU machines build (REMORA_TORCH_CUDA: event ordering on
# LibTorch's current stream, in the channel and in the GPU tests) would go
# unchecked. Where this LibTorch's c10/cuda headers are installed anyway
# (Debian's libtorch-dev has them), REMORA_TORCH_CUDA_CHECK is on and
# remora_torch_cuda_check() compiles that variant too, into objects that
# nothing links: CI then fails on code that would not compile on a GPU
# machine.
set(REMORA_TORCH_CUDA_CHECK OFF)
if(REMORA_WITH_CUDA AND NOT REMORA_TORCH_CUDA)
  # This LibTorch's own headers only, never another install's.
  find_path(REMORA_C10_CUDA_INCLUDE c10/cuda/CUDAStream.h PATHS ${TORCH_INCLUDE_DIRS}
            NO_DEFAULT_PATH)
  if(REMORA_C10_CUDA_INCLUDE)
    set(REMORA_TORCH_CUDA_CHECK ON)
    message(STATUS "remora: the LibTorch-CUDA code is compile-checked against "
                   "${REMORA_C10_CUDA_INCLUDE}/c10/cuda")
  else()
    message(STATUS "remora: no c10/cuda headers: the LibTorch-CUDA code is not compile-checked")
  endif()
endif()

# remora_torch_cuda_check(<target> SOURCES <sources...> LIBS <link libraries...>):
# the sources compiled with REMORA_TORCH_CUDA into the object library <target>.
function(remora_torch_cuda_check target)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_library(${target} OBJECT ${ARG_SOURCES})
  target_compile_definitions(${target} PRIVATE REMORA_TORCH_CUDA=1)
  target_compile_options(${target} PRIVATE -O0)
  if(NOT EXISTS "${REMORA_C10_CUDA_INCLUDE}/c10/cuda/impl/cuda_cmake_macros.h")
    # Only a CUDA build of LibTorch generates it: a one-line stand-in.
    target_include_directories(${target} SYSTEM PRIVATE ${PROJECT_SOURCE_DIR}/cmake/torch_cuda_shim)
  endif()
  target_link_libraries(${target} PRIVATE ${ARG_LIBS})
endfunction()
