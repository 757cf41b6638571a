# libstdc++ first among every program's and library's shared libraries.
#
# PyTorch's wheels link libstdc++ statically into libtorch_cpu.so and export
# its code: 2.11's exports the whole of std::filesystem (directory_iterator,
# path::_M_append, status, ...; pytorch/pytorch#133437). The dynamic loader
# binds a symbol to the first library in load order that defines it, and a
# program lists its libraries in link order, libstdc++ last: so remora's
# calls went to the wheel's copy, built by another GCC than the inline code
# in remora's own headers. On a GPU machine (PyTorch 2.11 wheel, g++ 13)
# every test that iterated a directory crashed (checkpoints, image
# folders): this binding is the likely cause, not yet confirmed there
# (docs/cuda-and-libtorch2.md). Naming libstdc++ before everything else
# makes its definitions the ones bound, for remora's code and LibTorch's
# alike; where LibTorch exports nothing of the kind (Debian's
# libtorch-dev) the order changes nothing.
#
# Not under the sanitizers or libFuzzer: their runtime must come first itself.
if(CMAKE_SYSTEM_NAME STREQUAL "Linux" AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang"
   AND NOT REMORA_SANITIZE AND NOT REMORA_FUZZ)
  set(REMORA_STDCXX_FIRST "LINKER:--push-state,--no-as-needed" "-lstdc++" "LINKER:--pop-state")
  add_link_options(${REMORA_STDCXX_FIRST})
  message(STATUS "remora: libstdc++ linked first (a PyTorch wheel's copy of it must not be the one bound)")
endif()
