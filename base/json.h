// Values written into JSON text by hand (reports, the evaluator's lines).
//
// JSON has no NaN or infinity: a number that is not finite is written
// `null` (a run that diverged, a rate over no time). Strings are quoted
// with their quotes, backslashes and control characters escaped.
#pragma once

#include <cmath>
#include <string>
#include <string_view>

#include "absl/strings/str_format.h"

namespace remora {

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

}  // namespace remora
