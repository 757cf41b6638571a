# Programs and tests in the build tree start on a copy of LibTorch's
# libtorch_cpu that names only the libraries it uses (cmake/trim_torch.sh):
# on Debian 12 a process then loads 38 of them for LibTorch, not 286, and
# starts in about half the CPU time (docs/testing-and-ci.md, "Where the test
# suite's time goes"). The copy, DIR/torch-trimmed/<soname>, comes first in
# the build tree's RUNPATH; the loader takes it for the soname, and
# libtorch.so's own reference to it finds it loaded. Installed programs
# keep the system's library (install drops the build tree's RUNPATH).
#
# Needs patchelf (./run installs it); without it, or for a LibTorch that
# uses all it names or finds its libraries relative to itself (PyTorch's
# wheels), nothing changes. -DREMORA_TRIM_TORCH=OFF turns it off (the
# compile-only trees do).
option(REMORA_TRIM_TORCH "Start programs in the build tree on a copy of libtorch_cpu without the libraries it never uses" ON)
set(_remora_trim_dir "${CMAKE_BINARY_DIR}/torch-trimmed")
set(_remora_trimmed OFF)
if(REMORA_TRIM_TORCH)
  find_program(REMORA_PATCHELF patchelf)
  # The file LibTorch's own target links (find_library could find another
  # one first, in /usr/local/lib).
  set(_remora_torch_cpu "")
  if(TARGET torch_cpu)
    get_target_property(_remora_configs torch_cpu IMPORTED_CONFIGURATIONS)
    foreach(_remora_config IN LISTS _remora_configs ITEMS "")
      if(_remora_config)
        get_target_property(_remora_location torch_cpu IMPORTED_LOCATION_${_remora_config})
      else()
        get_target_property(_remora_location torch_cpu IMPORTED_LOCATION)
      endif()
      if(_remora_location)
        set(_remora_torch_cpu "${_remora_location}")
        break()
      endif()
    endforeach()
  endif()
  if(NOT REMORA_PATCHELF)
    message(STATUS "remora: no patchelf: programs load libtorch_cpu with every library it names")
  elseif(NOT _remora_torch_cpu)
    message(STATUS "remora: LibTorch has no torch_cpu target with a file: nothing to trim")
  else()
    set(_remora_trim "${CMAKE_CURRENT_LIST_DIR}/trim_torch.sh")
    execute_process(
      COMMAND "${_remora_trim}" "${_remora_torch_cpu}" "${_remora_trim_dir}"
      RESULT_VARIABLE _remora_trim_rc OUTPUT_VARIABLE _remora_trim_out ERROR_VARIABLE _remora_trim_err
      OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_remora_trim_rc EQUAL 0)
      string(REGEX REPLACE ":.*" "" _remora_trim_out "${_remora_trim_out}")
      message(STATUS "remora: build tree's programs load ${_remora_trim_out}")
      list(PREPEND CMAKE_BUILD_RPATH "${_remora_trim_dir}")
      set(_remora_trimmed ON)
      # Every build checks it again (quickly, by the file's size, times and
      # inode): a LibTorch upgraded under this tree gets a new copy, or none,
      # never an old one beside its new libtorch.so.
      add_custom_target(remora_torch_trimmed ALL
        COMMAND "${_remora_trim}" "${_remora_torch_cpu}" "${_remora_trim_dir}" refresh VERBATIM)
    else()
      message(STATUS "remora: libtorch_cpu used as it is: ${_remora_trim_out}${_remora_trim_err}")
    endif()
  endif()
endif()
if(NOT _remora_trimmed)
  # (A copy from an earlier configuration would no longer be loaded.)
  file(REMOVE_RECURSE "${_remora_trim_dir}")
  add_custom_target(remora_torch_trimmed)  # (nothing to check; ./run demo names it)
endif()
