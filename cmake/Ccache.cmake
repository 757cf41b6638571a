# A compiler cache: when ccache is installed (./run installs it), every
# compilation goes through it, so a fresh clone, CI's included, rebuilds
# only what changed since any earlier build on the machine.
#
# Paths are made relative to the source tree (CCACHE_BASEDIR), so clones in
# different folders share entries; the sloppiness settings let ccache cache
# compilations that use the precompiled LibTorch header (cmake/TorchPch.cmake),
# whose .gch ccache hashes in place of the header's timestamps. The inode
# cache keeps each header's hash by inode and timestamps: a hit otherwise
# rehashes the thousands of LibTorch headers a source includes (codec.cc:
# 1.4 s for a hit without it, 0.2 s with it, on the 2-core VM). The cache is
# ccache's own (~/.cache/ccache, 5 GB at most by default; `ccache -s` shows
# it). -DREMORA_CCACHE=OFF, or a CMAKE_CXX_COMPILER_LAUNCHER of one's own,
# turns this off.
option(REMORA_CCACHE "Compile through ccache when it is installed" ON)
if(REMORA_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(REMORA_CCACHE_PROGRAM ccache)
  if(REMORA_CCACHE_PROGRAM)
    set(CMAKE_CXX_COMPILER_LAUNCHER
        ${CMAKE_COMMAND} -E env CCACHE_BASEDIR=${CMAKE_SOURCE_DIR} CCACHE_INODECACHE=true
        CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
        ${REMORA_CCACHE_PROGRAM})
    message(STATUS "remora: compiling through ${REMORA_CCACHE_PROGRAM}")
  endif()
endif()
