// Where remora's programs are: next to the running one (build/bin/, or the
// installed bin/). Torch-free, so that remora-launch, which links no
// LibTorch, finds master and worker as the other programs find theirs.
#pragma once

#include <string>

namespace remora::launch {

// The path of program `name` next to the running executable: its folder,
// a slash and `name`; `name` alone when /proc/self/exe cannot be read.
std::string SiblingProgram(const std::string& name);

}  // namespace remora::launch
