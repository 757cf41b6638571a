#include "rpc/auth.h"

namespace remora::rpc {

void AttachToken(grpc::ClientContext* context, const std::string& token) {
  if (!token.empty()) context->AddMetadata(kTokenHeader, token);
}

bool TokenMatches(const grpc::GenericCallbackServerContext& call, const std::string& want) {
  if (want.empty()) return true;
  auto it = call.client_metadata().find(kTokenHeader);
  if (it == call.client_metadata().end()) return false;
  return TokenEquals(std::string_view(it->second.data(), it->second.size()), want);
}

bool TokenEquals(std::string_view got, const std::string& want) {
  if (want.empty()) return true;
  // No early exit on a mismatch.
  unsigned char diff = got.size() != want.size();
  for (size_t i = 0; i < want.size(); ++i) {
    diff |= static_cast<unsigned char>(want[i] ^ (i < got.size() ? got.data()[i] : 0));
  }
  return diff == 0;
}

}  // namespace remora::rpc
