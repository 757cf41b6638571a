# gRPC's CMake config needs re2::re2, which Debian's libre2-dev ships only
# as a pkg-config file: an imported target found directly instead. Included
# before find_package(gRPC) here and by remora's installed package config.
find_package(Threads REQUIRED)
if(NOT TARGET re2::re2)
  find_path(REMORA_RE2_INCLUDE_DIR re2/re2.h)
  find_library(REMORA_RE2_LIBRARY re2 PATH_SUFFIXES x86_64-linux-gnu)
  if(REMORA_RE2_INCLUDE_DIR AND REMORA_RE2_LIBRARY)
    add_library(re2::re2 INTERFACE IMPORTED)
    set_target_properties(re2::re2 PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${REMORA_RE2_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES "${REMORA_RE2_LIBRARY};Threads::Threads")
    set(re2_FOUND TRUE)
  endif()
endif()
