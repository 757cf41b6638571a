# `cmake --install build [--prefix P]`: remora's libraries, headers and
# programs, and a CMake package, so that a project of its own builds
# against remora with
#
#   find_package(remora REQUIRED)      # CMAKE_PREFIX_PATH=P
#   target_link_libraries(app PRIVATE remora::pipeline remora::examples)
#
# Targets (remora::<folder>): base proto trace runtime data channel rpc autograd
# optim pipeline parallel checkpoint ps shards launch examples (examples: what the stock worker
# registers, RegisterStockWorker). The public headers (listed below) keep
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
# The public headers: what a user's program includes, and what those
# include. They include only the C++ standard library, LibTorch and Abseil
# (never protobuf's generated headers, grpcpp, CUDA or NCCL, nor the
# channels' or the agent's internals); scripts/package_check.sh compiles
# each alone, installed, with poisoned protobuf/gRPC/CUDA headers first on
# the include path. A header added here must keep that true.
set(REMORA_PUBLIC_HEADERS
    base/ids.h base/lines.h base/mutex_lock.h base/status_util.h
    channel/stats.h
    rpc/agent.h rpc/autograd_hooks.h rpc/call.h rpc/future.h rpc/registry.h rpc/rref.h rpc/rref_args.h
    rpc/thread_pool.h rpc/tls.h
    runtime/compute_lane.h
    autograd/dist_autograd.h
    optim/distributed_optimizer.h optim/lr_schedule.h
    data/datasets.h data/imagefolder.h data/source.h
    pipeline/fit.h pipeline/microbatch.h pipeline/partition.h pipeline/pipeline.h pipeline/planner.h pipeline/schedule.h
    pipeline/stage.h pipeline/worker_data.h
    parallel/data_parallel.h parallel/process_group.h
    checkpoint/checkpoint.h
    ps/parameter_server.h ps/shards.h
    shards/cnn.h shards/mlp.h shards/resnet.h shards/stage_types.h
    launch/cli.h launch/cluster_env.h launch/local_group.h launch/program_path.h launch/worker_main.h
    train/curves.h train/elastic.h train/events.h train/fit.h train/local_trainer.h train/pipeline_trainer.h train/ps_trainer.h
    train/report.h train/timeline.h train/trainer.h train/worker_functions.h
    examples/stock_worker.h)
foreach(header ${REMORA_PUBLIC_HEADERS})
  get_filename_component(_remora_header_dir ${header} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/${header}
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/remora/${_remora_header_dir})
endforeach()
# The list, installed beside the package, for the check above.
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
