# One precompiled header for LibTorch's core (Tensor, IValue, operators).
#
# Parsing those headers takes about 3 s of the 10-14 s that a remora source
# takes to compile at -O3 on the development machines. The header
# is precompiled once per kind of target (below) and every other library,
# program and test reuses it (REUSE_FROM: same compiler flags, so GCC
# accepts it; -Winvalid-pch warns when it does not). remora's sources still
# include what they use: the torch API check (cmake/TorchApiCheck.cmake) and
# the fuzz build compile without it. REMORA_PCH=OFF turns it off.
option(REMORA_PCH "Precompile LibTorch's core headers once and reuse them in every target" ON)

# remora_torch_pch(<directories...>): applies the header to every library
# and executable defined in those directories. Libraries compile with -fPIC
# and executables with -fPIE, and GCC rejects a header precompiled with the
# other, so there are two: remora_channel's for the libraries, worker's for the
# executables.
set(REMORA_TORCH_PCH_HEADERS <ATen/core/Tensor.h> <ATen/core/ivalue.h> <ATen/TensorOperators.h>)
function(remora_torch_pch)
  if(NOT REMORA_PCH)
    return()
  endif()
  target_precompile_headers(remora_channel PRIVATE ${REMORA_TORCH_PCH_HEADERS})
  target_precompile_headers(worker PRIVATE ${REMORA_TORCH_PCH_HEADERS})
  foreach(dir ${ARGN})
    get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
    foreach(target ${targets})
      get_target_property(type ${target} TYPE)
      # Targets marked REMORA_TORCH_FREE (the launcher) include no LibTorch.
      get_target_property(torch_free ${target} REMORA_TORCH_FREE)
      if(torch_free)
        continue()
      endif()
      # Object libraries (remora_torch_cuda_check, at -O0) are left alone.
      if(target MATCHES "^(remora_channel|worker)$")
        continue()
      elseif(type STREQUAL "STATIC_LIBRARY")
        target_precompile_headers(${target} REUSE_FROM remora_channel)
      elseif(type STREQUAL "EXECUTABLE")
        # The test programs reuse the tests' own header (tests/CMakeLists.txt).
        get_target_property(test_pch ${target} REMORA_TEST_PCH)
        if(NOT test_pch)
          target_precompile_headers(${target} REUSE_FROM worker)
        elseif(NOT target STREQUAL "remora_test_pch")
          target_precompile_headers(${target} REUSE_FROM remora_test_pch)
        endif()
        # The header was precompiled with worker's definitions, among them
        # remora_channel's and remora_data's public ones, which a program
        # that links neither (launch_test, the RPC tests) lacks; GCC then
        # ignores the header (-Winvalid-pch). Such programs get them too.
        if(REMORA_WITH_CUDA)
          target_compile_definitions(${target} PRIVATE REMORA_WITH_CUDA=1)
        endif()
        get_target_property(data_defs remora_data INTERFACE_COMPILE_DEFINITIONS)
        if(data_defs)
          target_compile_definitions(${target} PRIVATE ${data_defs})
        endif()
      endif()
    endforeach()
  endforeach()
endfunction()
