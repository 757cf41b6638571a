// TLS and mutual TLS for remora's gRPC traffic.
//
// Every process of a group both serves calls and makes them, so a process
// that uses TLS needs its own certificate and key for its server; the same
// pair identifies it as a client. Three modes:
//
//   plaintext    no certificate (the default)
//   TLS          cert + key: servers present their certificate, clients
//                check it against `ca_pem` (or the system's roots when
//                empty); clients present theirs when asked
//   mutual TLS   cert + key + ca: as TLS, and every server also requires a
//                client certificate signed by `ca_pem` from each caller;
//                a caller without one, or with one from another CA, is
//                refused during the handshake, before any request is read
//
// All members of a group must use the same mode: a plaintext peer and a TLS
// peer cannot talk (their calls fail as transport errors, UNAVAILABLE).
// Certificates must name the address peers dial (an IP SAN for 127.0.0.1,
// a DNS SAN for a host name).
//
//   TlsOptions tls = LoadTlsFiles("node.crt", "node.key", "ca.crt").value();
//   options.tls = tls;                      // AgentOptions
//
// The gRPC credentials made from these options are internal to rpc/
// (rpc/tls_credentials.h): this header is plain C++.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace remora::rpc {

struct TlsOptions {
  // PEM text of this process's certificate (chain) and its private key.
  std::string cert_pem;
  std::string key_pem;
  // PEM text of the certificate authority that signs the group's
  // certificates. Set: mutual TLS.
  std::string ca_pem;

  bool enabled() const { return !cert_pem.empty() || !key_pem.empty() || !ca_pem.empty(); }
  bool mutual() const { return !ca_pem.empty(); }
};

// Checks that the options are complete and hold PEM text: a certificate
// needs its key and the reverse, and a CA needs both (this process serves
// calls too), and, where remora was built with OpenSSL, that the key is
// the certificate's. OK for plaintext (nothing set).
absl::Status CheckTlsOptions(const TlsOptions& tls);
// Whether this build checks that a key is its certificate's (with the
// OpenSSL gRPC links; not with a gRPC that brings its own BoringSSL).
bool TlsChecksKeyMatch();

// Reads the three PEM files (`ca_file` may be empty: TLS without client
// certificates) and checks them. Empty `cert_file` and `key_file` and
// `ca_file`: plaintext. Errors name the file and what to do.
absl::StatusOr<TlsOptions> LoadTlsFiles(const std::string& cert_file, const std::string& key_file,
                                        const std::string& ca_file);

// "plaintext", "TLS" or "mutual TLS".
std::string TlsModeName(const TlsOptions& tls);

// A hint for a connection failure: the mode this process uses and what a
// mismatch with the peer looks like.
std::string TlsHint(const TlsOptions& tls);

}  // namespace remora::rpc
