# Checks that a page's quoted code is what the quoted file holds: every
# fenced code block of PAGE that follows a line
#
#   <!-- quoted from PATH -->
#
# (PATH relative to ROOT) must appear in that file verbatim, so that what
# the page shows is what the build compiles (and, for examples/custom_model,
# what Package.CustomModelBuildsAgainstTheInstalledPackage runs). A page
# without such a line fails too: the check would check nothing.
#
#   cmake -DROOT=<source dir> -DPAGE=docs/writing-your-own-master.md -P cmake/CheckDocQuotes.cmake
#
# Code holds semicolons, which CMake's lists split on: the texts are only
# searched and cut as strings here, never iterated as lists.
cmake_minimum_required(VERSION 3.18)
if(NOT ROOT OR NOT PAGE)
  message(FATAL_ERROR "usage: cmake -DROOT=<source dir> -DPAGE=<page> -P CheckDocQuotes.cmake")
endif()
file(READ "${ROOT}/${PAGE}" rest)
set(marker "<!-- quoted from ")
set(checked 0)
while(TRUE)
  string(FIND "${rest}" "${marker}" at)
  if(at EQUAL -1)
    break()
  endif()
  string(LENGTH "${marker}" marker_length)
  math(EXPR from "${at} + ${marker_length}")
  string(SUBSTRING "${rest}" ${from} -1 rest)
  string(FIND "${rest}" " -->" end)
  if(end EQUAL -1)
    message(FATAL_ERROR "${PAGE}: a '${marker}' line without its ' -->'")
  endif()
  string(SUBSTRING "${rest}" 0 ${end} path)
  # The block: from the line after the next opening fence to the closing one.
  string(FIND "${rest}" "```" open)
  if(open EQUAL -1)
    message(FATAL_ERROR "${PAGE}: no code block after '${marker}${path} -->'")
  endif()
  string(SUBSTRING "${rest}" ${open} -1 rest)
  string(FIND "${rest}" "\n" line_end)
  math(EXPR line_end "${line_end} + 1")
  string(SUBSTRING "${rest}" ${line_end} -1 rest)
  string(FIND "${rest}" "\n```" close)
  if(close EQUAL -1)
    message(FATAL_ERROR "${PAGE}: the code block quoted from ${path} is not closed")
  endif()
  math(EXPR close "${close} + 1")  # (the block's last newline is part of it)
  string(SUBSTRING "${rest}" 0 ${close} block)
  string(SUBSTRING "${rest}" ${close} -1 rest)
  if(NOT EXISTS "${ROOT}/${path}")
    message(FATAL_ERROR "${PAGE} quotes ${path}, which does not exist")
  endif()
  file(READ "${ROOT}/${path}" source)
  string(FIND "${source}" "${block}" found)
  if(found EQUAL -1)
    # Name the first line of the block that the file does not hold.
    set(first_missing "")
    string(FIND "${block}" "\n" nl)
    set(left "${block}")
    while(NOT nl EQUAL -1)
      string(SUBSTRING "${left}" 0 ${nl} line)
      math(EXPR nl "${nl} + 1")
      string(SUBSTRING "${left}" ${nl} -1 left)
      string(FIND "${source}" "${line}\n" line_at)
      if(line_at EQUAL -1)
        set(first_missing "${line}")
        break()
      endif()
      string(FIND "${left}" "\n" nl)
    endwhile()
    set(why "")
    if(NOT first_missing STREQUAL "")
      set(why " (the file has no line '${first_missing}')")
    endif()
    message(FATAL_ERROR "${PAGE}: its code block quoted from ${path} is not in that file as it stands${why}: "
                        "quote the file again, or change both together")
  endif()
  math(EXPR checked "${checked} + 1")
endwhile()
if(checked EQUAL 0)
  message(FATAL_ERROR "${PAGE}: no '${marker}PATH -->' line: nothing quoted to check")
endif()
message(STATUS "${PAGE}: ${checked} quoted code blocks are what their files hold")
