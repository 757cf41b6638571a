# A faster linker. Every program and test links the remora libraries, gRPC,
# Abseil and LibTorch; GNU ld (bfd) spends seconds on each of them (3.7 s
# for agent_test on the 2-core VM, against 0.6 s with lld and 0.4 s with
# gold), and linking is the part of a build that the compiler cache cannot
# save. REMORA_LINKER picks one: AUTO (the default) takes lld, else gold,
# whichever this compiler can use; `bfd` (or `default`) keeps the
# compiler's own. `./run` installs lld.
set(REMORA_LINKER AUTO CACHE STRING "Linker: AUTO (lld, else gold, else the compiler's), lld, gold, bfd or default")
set_property(CACHE REMORA_LINKER PROPERTY STRINGS AUTO lld gold bfd default)

include(CheckCXXSourceCompiles)
# remora_linker_works(NAME VAR): whether -fuse-ld=NAME links a program here.
function(remora_linker_works name var)
  set(CMAKE_REQUIRED_LINK_OPTIONS -fuse-ld=${name})
  set(CMAKE_REQUIRED_QUIET ON)
  check_cxx_source_compiles("int main() { return 0; }" ${var})
endfunction()

# The candidates, in order of preference; the first that links is used.
if(REMORA_LINKER STREQUAL "AUTO")
  set(_remora_candidates lld gold)
elseif(REMORA_LINKER MATCHES "^(lld|gold)$")
  set(_remora_candidates ${REMORA_LINKER})
elseif(REMORA_LINKER MATCHES "^(bfd|default)$")
  set(_remora_candidates "")
else()
  message(FATAL_ERROR "remora: REMORA_LINKER must be AUTO, lld, gold, bfd or default, "
          "not '${REMORA_LINKER}'")
endif()
set(_remora_linker "")
foreach(_remora_candidate IN LISTS _remora_candidates)
  string(TOUPPER "REMORA_LINKER_${_remora_candidate}_WORKS" _remora_var)
  remora_linker_works(${_remora_candidate} ${_remora_var})
  if(${_remora_var})
    set(_remora_linker ${_remora_candidate})
    break()
  endif()
endforeach()
if(NOT _remora_linker AND REMORA_LINKER MATCHES "^(lld|gold)$")
  message(FATAL_ERROR "remora: REMORA_LINKER=${REMORA_LINKER}, but ${CMAKE_CXX_COMPILER} cannot "
          "link with -fuse-ld=${REMORA_LINKER} (install it, or use -DREMORA_LINKER=AUTO)")
endif()
if(_remora_linker)
  add_link_options(-fuse-ld=${_remora_linker})
  message(STATUS "remora: linking with ${_remora_linker}")
else()
  message(STATUS "remora: linking with the compiler's default linker")
endif()
