# `cmake --install build [--prefix P]`: remora's libraries, headers and
# programs, and a CMake package, so that a project of its own builds
# against remora with
#
#   find_package(remora REQUIRED)      # CMAKE_PREFIX_PATH=P
#   target_link_libraries(app PRIVATE remora::pipeline remora::examples)
#
# Targets (remora::<folder>): base proto runtime data channel rpc autograd
# optim pipeline parallel checkpoint ps models launch examples (examples: what the stock worker
# registers, RegisterStockWorker). Headers keep their folders under
# include/remora (#include "pipeline/pipeline.h"). The package finds the
# same dependencies (LibTorch, gRPC, protobuf, Abseil, zlib, and the CUDA
# toolkit and NCCL when the channel has them) with the hints this build
# used.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(REMORA_INSTALL_LIBRARIES base proto runtime data channel rpc autograd optim pipeline parallel checkpoint ps models
    launch_env launch examples)
set(_remora_install_targets)
foreach(name ${REMORA_INSTALL_LIBRARIES})
  set_target_properties(remora_${name} PROPERTIES EXPORT_NAME ${name})
  list(APPEND _remora_install_targets remora_${name})
endforeach()
install(TARGETS ${_remora_install_targets} EXPORT remoraTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS worker master evaluator remora-launch rpc_demo rpc_bench collective_bench soak RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
foreach(dir base proto runtime data channel channel/shm channel/cuda rpc autograd optim pipeline parallel checkpoint ps
            models launch examples)
  file(GLOB _remora_headers ${PROJECT_SOURCE_DIR}/${dir}/*.h)
  install(FILES ${_remora_headers} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/remora/${dir})
endforeach()
install(DIRECTORY ${CMAKE_BINARY_DIR}/proto/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/remora/proto
        FILES_MATCHING PATTERN "*.pb.h")

set(REMORA_PACKAGE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/remora)
install(EXPORT remoraTargets NAMESPACE remora:: DESTINATION ${REMORA_PACKAGE_DIR})
configure_package_config_file(cmake/remoraConfig.cmake.in
                              ${CMAKE_BINARY_DIR}/remoraConfig.cmake
                              INSTALL_DESTINATION ${REMORA_PACKAGE_DIR})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/remoraConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/remoraConfig.cmake ${CMAKE_BINARY_DIR}/remoraConfigVersion.cmake
              cmake/RemoraRe2.cmake cmake/TorchCudaCompat.cmake
        DESTINATION ${REMORA_PACKAGE_DIR})
