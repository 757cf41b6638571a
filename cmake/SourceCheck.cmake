# remora_source_check(<target> [BATCHED]): every remora source (libraries,
# programs, tests, the fuzz harness; the CUDA channel or its stub, as this
# build has it) compiled syntax only into the object library <target>, which
# is not part of `all` and which nothing links. Each source alone, or with
# BATCHED the libraries' sources in the unity build's batches
# (cmake/Unity.cmake; the programs and tests still alone). It gets the
# usage requirements of remora's dependencies (headers, definitions), not
# LibTorch's: the caller
# adds the LibTorch headers and the flags it checks with. Used by
# TorchApiCheck.cmake (another LibTorch's headers) and
# ThreadSafetyCheck.cmake (clang's thread-safety analysis).
function(remora_source_check target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "BATCHED" "" "")
  if(NOT REMORA_BUILD_TESTS)
    message(FATAL_ERROR "${target} checks the tests too: it needs REMORA_BUILD_TESTS=ON")
  endif()
  set(globs)
  foreach(dir ${REMORA_SOURCE_DIRS})
    list(APPEND globs ${PROJECT_SOURCE_DIR}/${dir}/*.cc)
  endforeach()
  file(GLOB sources CONFIGURE_DEPENDS ${globs})
  if(REMORA_WITH_CUDA)
    list(FILTER sources EXCLUDE REGEX "/channel/cuda/stub\\.cc$")
  else()
    list(FILTER sources EXCLUDE REGEX "/channel/cuda/(cuda_channel|ipc|nccl)\\.cc$")
  endif()
  if(arg_BATCHED)
    get_property(batched GLOBAL PROPERTY REMORA_UNITY_BATCHED)
    get_property(units GLOBAL PROPERTY REMORA_UNITY_UNITS)
    list(REMOVE_ITEM sources ${batched})
    list(APPEND sources ${units})
  endif()
  add_library(${target} OBJECT EXCLUDE_FROM_ALL ${sources})
  if(arg_BATCHED AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_compile_options(${target} PRIVATE -Wno-subobject-linkage)  # (cmake/Unity.cmake)
  endif()
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR})
  target_compile_options(${target} PRIVATE -fsyntax-only)
  # (Syntax only: the corpus path needs no value, and one with the
  # clone's path in it would make every source a compiler-cache miss.)
  target_compile_definitions(${target} PRIVATE REMORA_FUZZ_CORPUS="tests/fuzz/corpus")
  target_link_libraries(${target} PRIVATE
    remora_proto gRPC::grpc++ Threads::Threads
    absl::status absl::statusor absl::strings absl::synchronization absl::time
    absl::flat_hash_map absl::flat_hash_set GTest::gmock GTest::gtest)
  if(REMORA_WITH_CUDA)
    target_compile_definitions(${target} PRIVATE REMORA_WITH_CUDA=1)
    target_link_libraries(${target} PRIVATE CUDA::cudart remora::nccl)
  endif()
endfunction()
