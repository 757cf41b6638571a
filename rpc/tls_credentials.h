// gRPC credentials from TlsOptions (rpc/tls.h), for the agent's server and
// its channels. Internal to rpc/: the public header stays free of grpcpp.
//
// Thread-compatible free functions.
#pragma once

#include <memory>

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include "rpc/tls.h"

namespace remora::rpc {

// Credentials for this process's server and for its channels to peers.
// Call CheckTlsOptions first.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const TlsOptions& tls);
std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(const TlsOptions& tls);

}  // namespace remora::rpc
