// Authentication of calls by the group's shared secret (AgentOptions::token,
// REMORA_TOKEN, --token-file): clients attach it to every unary call and
// stream as metadata, servers check it in constant time before a call
// reaches its handler. TLS (rpc/tls.h) authenticates and encrypts the
// connection; the token says the caller belongs to this group.
//
// Thread-safety: plain functions.
#pragma once

#include <string>
#include <string_view>

#include <grpcpp/client_context.h>
#include <grpcpp/generic/async_generic_service.h>

namespace remora::rpc {

// The metadata key that carries the token, on streams and unary calls alike.
inline constexpr char kTokenHeader[] = "remora-token";

// Attaches `token` to a call; nothing when it is empty (no token check).
void AttachToken(grpc::ClientContext* context, const std::string& token);

// Whether a call carries `want` (always true when `want` is empty). Takes
// time that depends on `want`'s length only, not on where a wrong token
// differs.
bool TokenMatches(const grpc::GenericCallbackServerContext& call, const std::string& want);
// The same for a token `got` that came another way (a local link's hello,
// rpc/link.h).
bool TokenEquals(std::string_view got, const std::string& want);

}  // namespace remora::rpc
