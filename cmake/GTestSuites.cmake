# remora_gtest_suites(TARGET [TIMEOUT SECONDS] [COST SECONDS]): one ctest
# test for all the GoogleTest suites of TARGET, named by their filter
# ("Codec.*:Frame.*") and run as `TARGET --gtest_filter=Codec.*:Frame.*`.
#
# Why: gtest_discover_tests makes one ctest test, hence one process, per
# test, and every process of a test linked with LibTorch pays about 0.75 s
# of CPU before main() (loading and initialising LibTorch; 2.3 s under the
# sanitizers), more than most unit tests take. For executables of quick
# in-process tests, one process for all keeps `ctest -R Suite` (the name
# holds every suite's) and saves that time for every other test.
# Executables whose tests start real programs keep gtest_discover_tests:
# one test per process, run in parallel, each with its own timeout.
#
# The suites are listed after each build (`TARGET --gtest_list_tests`),
# as gtest_discover_tests does; where the tests cannot run after the
# build (CMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST: LibTorch 2.6
# with CUDA but no GPU libraries here), when ctest starts.
set(_REMORA_GTEST_SUITES_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/GTestSuitesList.cmake)

function(remora_gtest_suites target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TIMEOUT;COST" "")
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 300)
  endif()
  if(NOT arg_COST)
    set(arg_COST 0)
  endif()
  set(suites_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites.cmake")
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_include.cmake")
  if(CMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE STREQUAL "PRE_TEST")
    string(CONCAT content "set(REMORA_SUITES_EXE [==[$<TARGET_FILE:${target}>]==])\n"
           "set(REMORA_SUITES_OUT [==[${suites_file}]==])\n"
           "set(REMORA_SUITES_WORKDIR [==[${CMAKE_CURRENT_BINARY_DIR}]==])\n"
           "set(REMORA_SUITES_TIMEOUT ${arg_TIMEOUT})\n"
           "set(REMORA_SUITES_COST ${arg_COST})\n"
           "if(EXISTS \"\${REMORA_SUITES_EXE}\")\n"
           "  include([==[${_REMORA_GTEST_SUITES_SCRIPT}]==])\n"
           "  include([==[${suites_file}]==])\n"
           "else()\n"
           "  add_test(${target}_NOT_BUILT ${target}_NOT_BUILT)\n"
           "endif()\n")
    file(GENERATE OUTPUT "${include_file}" CONTENT "${content}")
  else()
    add_custom_command(TARGET ${target} POST_BUILD
      COMMAND ${CMAKE_COMMAND} -D "REMORA_SUITES_EXE=$<TARGET_FILE:${target}>"
              -D "REMORA_SUITES_OUT=${suites_file}" -D "REMORA_SUITES_WORKDIR=${CMAKE_CURRENT_BINARY_DIR}"
              -D "REMORA_SUITES_TIMEOUT=${arg_TIMEOUT}" -D "REMORA_SUITES_COST=${arg_COST}"
              -P "${_REMORA_GTEST_SUITES_SCRIPT}"
      BYPRODUCTS "${suites_file}"
      VERBATIM)
    file(WRITE "${include_file}"
         "if(EXISTS [==[${suites_file}]==])\n"
         "  include([==[${suites_file}]==])\n"
         "else()\n"
         "  add_test(${target}_NOT_BUILT ${target}_NOT_BUILT)\n"
         "endif()\n")
  endif()
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${include_file}")
endfunction()
