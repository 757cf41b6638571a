#include "base/ids.h"

namespace remora::base {
namespace {

bool IsNameChar(char c, bool allow_dot) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c >= '0' && c <= '9') || c == '_' || c == ':' || c == '-' ||
         (allow_dot && c == '.');
}

bool IsValidName(const std::string& name, bool allow_dot) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    if (!IsNameChar(c, allow_dot)) return false;
  }
  return true;
}

}  // namespace

bool IsValidWorkerName(const std::string& name) { return IsValidName(name, false); }
bool IsValidRegisteredName(const std::string& name) { return IsValidName(name, true); }

}  // namespace remora::base
