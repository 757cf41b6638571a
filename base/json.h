// Values written into JSON text by hand (reports, the evaluator's lines).
//
// JSON has no NaN or infinity: a number that is not finite is written
// `null` (a run that diverged, a rate over no time). Strings are quoted
// with their quotes, backslashes and control characters escaped.
#pragma once

#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/strings/str_format.h"

namespace remora::base {

// `v` with `digits` after the point, or null.
inline std::string JsonFixed(int digits, double v) {
  return std::isfinite(v) ? absl::StrFormat("%.*f", digits, v) : "null";
}

// `v` to 9 significant digits, or null.
inline std::string JsonGeneral(double v) { return std::isfinite(v) ? absl::StrFormat("%.9g", v) : "null"; }

// `s` as a JSON string, quotes included.
inline std::string JsonQuoted(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// The text of `key`'s value in `line`, one flat JSON object as the
// functions above write it: a string with its quotes (still escaped), a
// number, true, false or null. Empty when `line` has no such key. (A key's
// name inside a string value has its quotes escaped, so it is not found.)
inline std::string_view JsonValueText(std::string_view line, std::string_view key) {
  const std::string pattern = "\"" + std::string(key) + "\": ";
  const size_t at = line.find(pattern);
  if (at == std::string_view::npos) return {};
  const size_t begin = at + pattern.size();
  size_t end = begin;
  if (end < line.size() && line[end] == '"') {
    for (++end; end < line.size() && line[end] != '"'; ++end) {
      if (line[end] == '\\') ++end;
    }
    return end < line.size() ? line.substr(begin, end + 1 - begin) : std::string_view();
  }
  while (end < line.size() && line[end] != ',' && line[end] != '}') ++end;
  return line.substr(begin, end - begin);
}

// `key`'s number in `line` (see JsonValueText); NaN where it is null, not
// a number, or not there.
inline double JsonNumber(std::string_view line, std::string_view key) {
  const std::string text(JsonValueText(line, key));
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  return !text.empty() && end == text.c_str() + text.size() ? v : std::nan("");
}

}  // namespace remora::base
