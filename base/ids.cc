#include "base/ids.h"

#include <random>

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

uint64_t RandomIncarnation() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{rd()} << 32) ^ rd();
  return v;
}

}  // namespace remora::base
