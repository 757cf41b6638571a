#include "launch/error_text.h"

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace remora::launch {

namespace {

constexpr absl::string_view kFailed = "The following operation failed in the TorchScript interpreter.";
constexpr absl::string_view kTraceback = "Traceback of TorchScript";

// "RuntimeError: ...", "torch.jit.Error: ...": a dotted name ending in Error
// or Exception, then ": ", at the start of the line.
bool NamesAnError(absl::string_view line) {
  const size_t colon = line.find(": ");
  if (colon == absl::string_view::npos || colon == 0) return false;
  const absl::string_view name = line.substr(0, colon);
  for (char ch : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(ch)) && ch != '_' && ch != '.') return false;
  }
  return absl::EndsWith(name, "Error") || absl::EndsWith(name, "Exception");
}

}  // namespace

std::string WithoutTorchScriptTraceback(absl::string_view message) {
  const std::vector<absl::string_view> lines = absl::StrSplit(message, '\n');
  std::vector<std::string> out;
  for (size_t i = 0; i < lines.size(); ++i) {
    // A traceback starts with the interpreter's line (perhaps after
    // remora's own words on that line) or with its first header.
    size_t at = lines[i].find(kFailed);
    if (at == absl::string_view::npos) at = lines[i].find(kTraceback);
    if (at == absl::string_view::npos) {
      out.emplace_back(lines[i]);
      continue;
    }
    const absl::string_view before = lines[i].substr(0, at);
    // It ends at PyTorch's message: the first line after it that names an
    // error the way Python does ("RuntimeError: ...", "torch.jit.Error: ...").
    std::string here;
    size_t end = i + 1;
    for (; end < lines.size(); ++end) {
      const absl::string_view line = lines[end];
      if (absl::StrContains(line, "<--- HERE") && end > i + 1) {
        here = std::string(absl::StripAsciiWhitespace(lines[end - 1]));
      }
      // (A rethrown one names the interpreter's failure again: its own
      // traceback follows.)
      if (NamesAnError(line) && !absl::StrContains(line, kFailed)) break;
    }
    if (end == lines.size()) {  // (no message after it: leave it whole)
      out.emplace_back(lines[i]);
      continue;
    }
    out.push_back(absl::StrCat(before, lines[end], " (", here.empty() ? "" : absl::StrCat("at `", here, "`; "),
                               "--verbose shows the TorchScript traceback)"));
    i = end;
    // (PyTorch's message ends in a newline: no empty line after it.)
    if (i + 1 < lines.size() && lines[i + 1].empty()) ++i;
  }
  std::string said = absl::StrJoin(out, "\n");
  // (PyTorch's message ends in a newline, which a cut one need not keep.)
  if (said.size() != message.size() || said != message) said = std::string(absl::StripTrailingAsciiWhitespace(said));
  return said;
}

}  // namespace remora::launch
