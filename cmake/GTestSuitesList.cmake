# Writes REMORA_SUITES_OUT: one add_test that runs every GoogleTest suite
# of REMORA_SUITES_EXE, listed by its --gtest_list_tests
# (cmake/GTestSuites.cmake).
# Run with cmake -P after a build, or included by ctest (PRE_TEST).
foreach(var REMORA_SUITES_EXE REMORA_SUITES_OUT REMORA_SUITES_WORKDIR REMORA_SUITES_TIMEOUT
        REMORA_SUITES_COST)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "GTestSuitesList.cmake: ${var} is not set")
  endif()
endforeach()
execute_process(COMMAND "${REMORA_SUITES_EXE}" --gtest_list_tests
                WORKING_DIRECTORY "${REMORA_SUITES_WORKDIR}"
                OUTPUT_VARIABLE listing ERROR_VARIABLE listing_errors
                RESULT_VARIABLE rc TIMEOUT 180)  # LibTorch starting on a busy machine
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "listing the tests of ${REMORA_SUITES_EXE} failed (${rc}):\n"
          "${listing}${listing_errors}")
endif()
# A suite's line is its name and a dot at the start of the line (a typed or
# parameterized one adds a comment); its tests' lines are indented.
string(REGEX MATCHALL "(^|\n)[^ \n#]+\\." suite_lines "${listing}")
if(NOT suite_lines)
  message(FATAL_ERROR "${REMORA_SUITES_EXE} lists no GoogleTest suite:\n${listing}")
endif()
set(filter "")
foreach(line IN LISTS suite_lines)
  string(STRIP "${line}" suite)
  string(REGEX REPLACE "\\.$" "" suite "${suite}")
  if(filter)
    string(APPEND filter ":")
  endif()
  string(APPEND filter "${suite}.*")
endforeach()
# One test for the whole executable, named by its filter ("Codec.*:Frame.*").
file(WRITE "${REMORA_SUITES_OUT}"
     "add_test([==[${filter}]==] [==[${REMORA_SUITES_EXE}]==] [==[--gtest_filter=${filter}]==])\n"
     "set_tests_properties([==[${filter}]==] PROPERTIES WORKING_DIRECTORY "
     "[==[${REMORA_SUITES_WORKDIR}]==] TIMEOUT ${REMORA_SUITES_TIMEOUT} COST ${REMORA_SUITES_COST})\n")
