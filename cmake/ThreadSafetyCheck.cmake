# Clang's thread-safety analysis over every remora source (`./run
# thread-safety`, target remora_thread_safety_check): the ABSL_GUARDED_BY
# and ABSL_EXCLUSIVE_LOCKS_REQUIRED annotations are checked instead of only
# read, so touching a guarded field without its mutex, or calling a
# function that needs a lock without holding it, fails the build.
# Syntax only: nothing is linked. Needs clang (g++ has no such analysis).
if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "REMORA_THREAD_SAFETY_CHECK needs clang: -DCMAKE_CXX_COMPILER=clang++-14")
endif()
include(${CMAKE_CURRENT_LIST_DIR}/SourceCheck.cmake)
remora_source_check(remora_thread_safety_check)
target_include_directories(remora_thread_safety_check SYSTEM PRIVATE ${TORCH_INCLUDE_DIRS})
target_compile_options(remora_thread_safety_check PRIVATE
  -Wthread-safety -Werror=thread-safety)
