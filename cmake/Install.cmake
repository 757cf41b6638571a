# `cmake --install build [--prefix P]`: remora's libraries, headers and
# programs, and a CMake package, so that a project of its own builds
# against remora with
#
#   find_package(remora REQUIRED)      # CMAKE_PREFIX_PATH=P
#   target_link_libraries(app PRIVATE remora::pipeline remora::examples)
#
# Targets (remora::<folder>): base proto trace runtime data channel rpc autograd
# optim pipeline parallel checkpoint ps shards launch examples (examples: what the stock worker
# registers, RegisterStockWorker). The public headers (public-headers.txt) keep
# their folders under include/remora (#include "pipeline/pipeline.h"). The
# package finds the same dependencies (LibTorch, gRPC, protobuf, Abseil,
# zlib, and the CUDA toolkit and NCCL when the channel has them) with the
# hints this build used; gRPC, protobuf, CUDA and NCCL only to link them
# (cmake/PrivateDeps.cmake).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(REMORA_INSTALL_LIBRARIES base proto trace runtime data channel rpc autograd optim pipeline parallel checkpoint ps shards
    launch_env launch train examples)
set(_remora_install_targets)
foreach(name ${REMORA_INSTALL_LIBRARIES})
  set_target_properties(remora_${name} PROPERTIES EXPORT_NAME ${name})
  list(APPEND _remora_install_targets remora_${name})
endforeach()
# A program of one's own links libstdc++ first too (cmake/StdcxxFirst.cmake).
if(REMORA_STDCXX_FIRST)
  target_link_options(remora_base INTERFACE ${REMORA_STDCXX_FIRST})
endif()
install(TARGETS ${_remora_install_targets} EXPORT remoraTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS worker master evaluator generate remora-launch rpc_demo rpc_bench collective_bench soak RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# The public headers are those public-headers.txt lists (it says what they
# may include); every other header is internal.
file(STRINGS ${PROJECT_SOURCE_DIR}/public-headers.txt REMORA_PUBLIC_HEADERS REGEX "^[^#].*[.]h$")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/public-headers.txt)
foreach(header ${REMORA_PUBLIC_HEADERS})
  get_filename_component(_remora_header_dir ${header} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/${header}
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/remora/${_remora_header_dir})
endforeach()
# The list, installed beside the package, for scripts/package_check.sh.
string(REPLACE ";" "\n" _remora_header_lines "${REMORA_PUBLIC_HEADERS}")
file(GENERATE OUTPUT ${CMAKE_BINARY_DIR}/remora-public-headers.txt CONTENT "${_remora_header_lines}\n")

set(REMORA_PACKAGE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/remora)
install(EXPORT remoraTargets NAMESPACE remora:: DESTINATION ${REMORA_PACKAGE_DIR})
# remora::rpc links OpenSSL's libcrypto where gRPC came with it (rpc/CMakeLists.txt).
get_property(REMORA_WITH_OPENSSL GLOBAL PROPERTY REMORA_WITH_OPENSSL)
if(NOT REMORA_WITH_OPENSSL)
  set(REMORA_WITH_OPENSSL OFF)
endif()
configure_package_config_file(cmake/remoraConfig.cmake.in
                              ${CMAKE_BINARY_DIR}/remoraConfig.cmake
                              INSTALL_DESTINATION ${REMORA_PACKAGE_DIR})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/remoraConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/remoraConfig.cmake ${CMAKE_BINARY_DIR}/remoraConfigVersion.cmake
              ${CMAKE_BINARY_DIR}/remora-public-headers.txt
              cmake/RemoraRe2.cmake cmake/TorchCudaCompat.cmake
        DESTINATION ${REMORA_PACKAGE_DIR})
