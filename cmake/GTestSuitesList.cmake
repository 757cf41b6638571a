# Writes REMORA_SUITES_OUT: the ctest tests of the test program
# REMORA_SUITES_EXE, from its own listing (each test with the source file
# it is in) and REMORA_SUITES_PLAN, its sources' entries joined with ","
# ("name:SUITES:cost", "name:EACH:cost"; cmake/GTestSuites.cmake).
# Run with cmake -P after a build, or included by ctest (PRE_TEST).
cmake_policy(VERSION 3.16)  # (if(IN_LIST))
foreach(var REMORA_SUITES_EXE REMORA_SUITES_OUT REMORA_SUITES_WORKDIR REMORA_SUITES_PLAN)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "GTestSuitesList.cmake: ${var} is not set")
  endif()
endforeach()
set(_json "${REMORA_SUITES_OUT}.listing.json")
file(REMOVE "${_json}")
execute_process(COMMAND "${REMORA_SUITES_EXE}" --gtest_list_tests "--gtest_output=json:${_json}"
                WORKING_DIRECTORY "${REMORA_SUITES_WORKDIR}"
                OUTPUT_VARIABLE _listing ERROR_VARIABLE _errors
                RESULT_VARIABLE _rc TIMEOUT 180)  # LibTorch starting on a busy machine
if(NOT _rc EQUAL 0 OR NOT EXISTS "${_json}")
  message(FATAL_ERROR "listing the tests of ${REMORA_SUITES_EXE} failed (${_rc}):\n"
          "${_listing}${_errors}")
endif()
file(READ "${_json}" _text)

string(REPLACE "," ";" _plan "${REMORA_SUITES_PLAN}")
set(_sources "")
foreach(_entry IN LISTS _plan)
  string(REPLACE ":" ";" _parts "${_entry}")
  list(GET _parts 0 _name)
  list(GET _parts 1 _mode_${_name})
  list(GET _parts 2 _cost_${_name})
  set(_suites_${_name} "")
  list(APPEND _sources ${_name})
endforeach()

# Every test, and every program it starts, runs with glibc's heap on
# transparent huge pages: a process linked with LibTorch starts in about
# 0.75x the CPU (its static constructors fault a quarter as often), and
# the suite's master and worker runs take 0.67-0.78x
# (docs/testing-and-ci.md, "Where the test suite's time goes").
set(_env "[==[GLIBC_TUNABLES=glibc.malloc.hugetlb=1]==]")
set(_exe "[==[${REMORA_SUITES_EXE}]==]")
set(_dir "[==[${REMORA_SUITES_WORKDIR}]==]")
set(_script "")
string(JSON _suite_count LENGTH "${_text}" testsuites)
if(_suite_count EQUAL 0)
  message(FATAL_ERROR "${REMORA_SUITES_EXE} lists no GoogleTest test:\n${_listing}")
endif()
math(EXPR _last_suite "${_suite_count} - 1")
foreach(_i RANGE ${_last_suite})
  string(JSON _suite_json GET "${_text}" testsuites ${_i})
  string(JSON _suite GET "${_suite_json}" name)
  string(JSON _test_count LENGTH "${_suite_json}" testsuite)
  math(EXPR _last_test "${_test_count} - 1")
  foreach(_j RANGE ${_last_test})
    string(JSON _test GET "${_suite_json}" testsuite ${_j} name)
    string(JSON _file GET "${_suite_json}" testsuite ${_j} file)
    get_filename_component(_source "${_file}" NAME_WE)
    if(NOT DEFINED _mode_${_source})
      message(FATAL_ERROR "${_suite}.${_test} of ${REMORA_SUITES_EXE} is in ${_file}, which is not "
              "one of the program's sources (${_sources}): give its source a remora_test() line")
    endif()
    string(MAKE_C_IDENTIFIER "${_suite}" _id)
    if(NOT _source IN_LIST _sources_of_${_id})
      list(APPEND _sources_of_${_id} ${_source})
    endif()
    if(_mode_${_source} STREQUAL "SUITES")
      if(NOT "${_suite}" IN_LIST _suites_${_source})
        list(APPEND _suites_${_source} "${_suite}")
      endif()
      list(APPEND _tests_${_source}_${_id} "${_suite}.${_test}")
    else()
      set(_name "[==[${_suite}.${_test}]==]")
      string(APPEND _script
             "add_test(${_name} ${_exe} [==[--gtest_filter=${_suite}.${_test}]==])\n"
             "set_tests_properties(${_name} PROPERTIES WORKING_DIRECTORY ${_dir} TIMEOUT 300 "
             "COST ${_cost_${_source}} ENVIRONMENT ${_env} SKIP_REGULAR_EXPRESSION [==[\\[  SKIPPED \\]]==])\n")
    endif()
  endforeach()
endforeach()
# One test for each SUITES source, named by its suites ("Codec.*:Frame.*")
# and run with that filter, except that a suite with tests in another
# source too is given as this source's tests one by one.
foreach(_source IN LISTS _sources)
  set(_names "")
  set(_filters "")
  foreach(_suite IN LISTS _suites_${_source})
    string(MAKE_C_IDENTIFIER "${_suite}" _id)
    list(APPEND _names "${_suite}.*")
    list(LENGTH _sources_of_${_id} _shared)
    if(_shared GREATER 1)
      list(APPEND _filters ${_tests_${_source}_${_id}})
    else()
      list(APPEND _filters "${_suite}.*")
    endif()
  endforeach()
  if(_names)
    list(JOIN _names ":" _name)
    list(JOIN _filters ":" _filter)
    string(APPEND _script
           "add_test([==[${_name}]==] ${_exe} [==[--gtest_filter=${_filter}]==])\n"
           "set_tests_properties([==[${_name}]==] PROPERTIES WORKING_DIRECTORY ${_dir} TIMEOUT 300 "
           "COST ${_cost_${_source}} ENVIRONMENT ${_env})\n")
  endif()
endforeach()
file(WRITE "${REMORA_SUITES_OUT}" "${_script}")
file(REMOVE "${_json}")
