// Stands for a PyTorch wheel's libtorch_cpu.so, which carries a copy of
// libstdc++'s std::filesystem and exports it (cmake/StdcxxFirst.cmake):
// one function of it, defined to give a wrong answer, in a shared library
// that StdcxxFirst's test links.
#include <filesystem>

namespace std::filesystem {

file_status status(const path&) { return file_status(file_type::regular); }

}  // namespace std::filesystem

// What makes a program need this library (as a program needs LibTorch).
extern "C" int remora_stdcxx_copy_linked() { return 1; }
