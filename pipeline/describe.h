// DescribeValue: what a stage or layer was given, in words, for errors
// ("a Float tensor of shape [16, 3, 32, 32]"; a tuple's elements in
// parentheses, in order; "the int 3", "None" and the like for the rest).
// Used by the stage wrapper (pipeline/stage.cc) and the partitioner's
// check of a model on a sample (pipeline/partition.cc).
//
// Thread-safety: a pure function.
#pragma once

#include <string>

#include <ATen/core/ivalue.h>

namespace remora::pipeline {

std::string DescribeValue(const c10::IValue& v);

}  // namespace remora::pipeline
