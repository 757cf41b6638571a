# remora_gtest_program(TARGET): the ctest tests of a test program that
# holds several GoogleTest sources (tests/CMakeLists.txt, remora_test()),
# each source registered the way its entry in the target's property
# REMORA_TEST_PLAN says ("name:SUITES:cost" or "name:EACH:cost", name being
# the source's file name without .cc):
#
# - SUITES: one ctest test for all the suites of that source, named by
#   their filter ("Codec.*:Frame.*") and run as
#   `TARGET --gtest_filter=Codec.*:Frame.*`. Every process of a test linked
#   with LibTorch pays about 0.75 s of CPU before main() (2.3 s under the
#   sanitizers), more than most in-process unit tests take: one process
#   for a source's quick tests saves that for each of them, and keeps
#   `ctest -R Suite` (the name holds every suite's).
# - EACH: one ctest test per test ("Suite.Test", as gtest_discover_tests
#   names them), for sources whose tests start real programs: run in
#   parallel, each with its own timeout; a test that skips reads as
#   skipped.
#
# Which source a test comes from is what the program's own listing says
# (`--gtest_list_tests --gtest_output=json`: every test with its file).
# The tests are listed after each build, as gtest_discover_tests does;
# where the tests cannot run after the build
# (CMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST: LibTorch 2.6 with
# CUDA but no GPU libraries here), when ctest starts.
set(_REMORA_GTEST_SUITES_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/GTestSuitesList.cmake)

function(remora_gtest_program target)
  set(suites_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_tests.cmake")
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_tests_include.cmake")
  # (The plan's entries joined with "," : a list's ";" would split the
  # custom command's argument.)
  set(plan "$<JOIN:$<TARGET_PROPERTY:${target},REMORA_TEST_PLAN>,,>")
  if(CMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE STREQUAL "PRE_TEST")
    string(CONCAT content "set(REMORA_SUITES_EXE [==[$<TARGET_FILE:${target}>]==])\n"
           "set(REMORA_SUITES_OUT [==[${suites_file}]==])\n"
           "set(REMORA_SUITES_WORKDIR [==[${CMAKE_CURRENT_BINARY_DIR}]==])\n"
           "set(REMORA_SUITES_PLAN [==[${plan}]==])\n"
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
              -D "REMORA_SUITES_PLAN=${plan}"
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
