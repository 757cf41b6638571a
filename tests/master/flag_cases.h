// master's command line checked case by case in a test: the error each bad
// command line gets (tests/master/flags_test.cc, gpt_flags_test.cc).
#pragma once

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_join.h"
#include "master/flags.h"

namespace remora::master::flag_cases {

// The error of `args`, which must not pass.
inline std::string ErrorOf(const std::vector<std::string>& args) {
  auto line = ParseCommandLine(args);
  if (line.ok()) return "(passed)";
  return std::string(line.status().message());
}

struct Case {
  std::vector<std::string> args;
  std::string error;
};

inline void ExpectErrors(const std::vector<Case>& cases) {
  for (const Case& k : cases) {
    EXPECT_THAT(ErrorOf(k.args), ::testing::HasSubstr(k.error)) << absl::StrJoin(k.args, " ");
  }
}

}  // namespace remora::master::flag_cases
