#include "launch/program_path.h"

#include <unistd.h>

namespace remora::launch {

std::string SiblingProgram(const std::string& name) {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return name;
  const std::string self(buf, n);
  return self.substr(0, self.rfind('/') + 1) + name;
}

}  // namespace remora::launch
