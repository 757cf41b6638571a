#include "rpc/tls.h"

#include "rpc/tls_credentials.h"

#include <memory>
#include <string>

#ifndef REMORA_TLS_KEY_CHECK
#define REMORA_TLS_KEY_CHECK 0
#endif
#if REMORA_TLS_KEY_CHECK
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#endif

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_util.h"

namespace remora::rpc {
namespace {

bool HasPemBlock(const std::string& pem, const char* label) {
  return absl::StrContains(pem, absl::StrCat("-----BEGIN ", label, "-----"));
}

bool HasPrivateKey(const std::string& pem) {
  // PKCS#8 ("PRIVATE KEY"), and the traditional "RSA/EC PRIVATE KEY".
  return absl::StrContains(pem, "-----BEGIN ") && absl::StrContains(pem, "PRIVATE KEY-----");
}

#if REMORA_TLS_KEY_CHECK
// That the certificate and the key parse, and that the key is the
// certificate's: else gRPC's server fails to start, and says why only in
// its own log lines.
absl::Status CheckKeyMatches(const std::string& cert_pem, const std::string& key_pem) {
  auto bio = [](const std::string& pem) {
    return std::unique_ptr<BIO, decltype(&BIO_free)>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())),
                                                     &BIO_free);
  };
  auto cert_bio = bio(cert_pem), key_bio = bio(key_pem);
  if (cert_bio == nullptr || key_bio == nullptr) return absl::ResourceExhaustedError("TLS: out of memory");
  std::unique_ptr<X509, decltype(&X509_free)> cert(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr),
                                                   &X509_free);
  // (No passphrase callback: an encrypted key fails to read, not prompts.)
  static pem_password_cb* const no_passphrase = [](char*, int, int, void*) { return -1; };
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, no_passphrase, nullptr), &EVP_PKEY_free);
  const bool matches = cert != nullptr && key != nullptr && X509_check_private_key(cert.get(), key.get()) == 1;
  ERR_clear_error();  // (this thread's OpenSSL errors: said below)
  if (cert == nullptr) {
    return absl::InvalidArgumentError("TLS: the certificate's PEM block cannot be read as an X.509 certificate");
  }
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        "TLS: the private key cannot be read (remora takes an unencrypted PEM key: is it encrypted with a "
        "passphrase, or cut short?)");
  }
  if (!matches) {
    return absl::InvalidArgumentError(
        "TLS: the private key is not the certificate's: give the key the certificate was issued for "
        "(--tls-key beside its --tls-cert)");
  }
  return absl::OkStatus();
}
#endif

}  // namespace

bool TlsChecksKeyMatch() { return REMORA_TLS_KEY_CHECK != 0; }

absl::Status CheckTlsOptions(const TlsOptions& tls) {
  if (!tls.enabled()) return absl::OkStatus();
  if (tls.cert_pem.empty() || tls.key_pem.empty()) {
    if (!tls.cert_pem.empty()) {
      return absl::InvalidArgumentError(
          "TLS: a certificate is given without its private key; give both (--tls-cert and "
          "--tls-key)");
    }
    if (!tls.key_pem.empty()) {
      return absl::InvalidArgumentError(
          "TLS: a private key is given without its certificate; give both (--tls-cert and "
          "--tls-key)");
    }
    return absl::InvalidArgumentError(
        "TLS: a CA is given without a certificate and key; every process serves calls, so "
        "each needs its own (--tls-cert and --tls-key beside --tls-ca)");
  }
  if (!HasPemBlock(tls.cert_pem, "CERTIFICATE")) {
    return absl::InvalidArgumentError(
        "TLS: the certificate holds no PEM certificate ('-----BEGIN CERTIFICATE-----')");
  }
  if (!HasPrivateKey(tls.key_pem)) {
    return absl::InvalidArgumentError(
        "TLS: the private key holds no PEM private key ('-----BEGIN ... PRIVATE KEY-----')");
  }
  if (!tls.ca_pem.empty() && !HasPemBlock(tls.ca_pem, "CERTIFICATE")) {
    return absl::InvalidArgumentError(
        "TLS: the CA holds no PEM certificate ('-----BEGIN CERTIFICATE-----')");
  }
#if REMORA_TLS_KEY_CHECK
  return CheckKeyMatches(tls.cert_pem, tls.key_pem);
#else
  return absl::OkStatus();
#endif
}

absl::StatusOr<TlsOptions> LoadTlsFiles(const std::string& cert_file, const std::string& key_file,
                                        const std::string& ca_file) {
  TlsOptions tls;
  if (cert_file.empty() != key_file.empty()) {
    return absl::InvalidArgumentError(
        cert_file.empty()
            ? "--tls-key is given without --tls-cert: give both (this process's certificate "
              "and its private key)"
            : "--tls-cert is given without --tls-key: give both (this process's certificate "
              "and its private key)");
  }
  if (!ca_file.empty() && cert_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-ca needs --tls-cert and --tls-key too: every process serves calls, so each "
        "needs its own certificate");
  }
  struct File {
    const std::string& path;
    const char* flag;
    std::string* out;
    const char* label;  // nullptr: a private key
  };
  for (const File& f : {File{cert_file, "--tls-cert", &tls.cert_pem, "CERTIFICATE"},
                        File{key_file, "--tls-key", &tls.key_pem, nullptr},
                        File{ca_file, "--tls-ca", &tls.ca_pem, "CERTIFICATE"}}) {
    if (f.path.empty()) continue;
    auto text = base::ReadWholeFile(f.path, f.flag);
    if (!text.ok()) return text.status();
    const bool ok = f.label ? HasPemBlock(*text, f.label) : HasPrivateKey(*text);
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          f.flag, " ", f.path, " holds no PEM ", f.label ? "certificate" : "private key",
          " (expected '-----BEGIN ", f.label ? f.label : "... PRIVATE KEY", "-----')"));
    }
    *f.out = std::move(*text);
  }
  // (The key against its certificate: a bad flag value, said before the
  // program starts anything.)
  if (!cert_file.empty()) {
    RETURN_IF_ERROR(
        base::Annotate(CheckTlsOptions(tls), absl::StrCat("--tls-cert ", cert_file, " with --tls-key ", key_file)));
  }
  return tls;
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const TlsOptions& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      tls.mutual() ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_root_certs = tls.ca_pem;
  options.pem_key_cert_pairs.push_back({tls.key_pem, tls.cert_pem});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(const TlsOptions& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls.ca_pem;  // empty: the system's roots
  options.pem_private_key = tls.key_pem;
  options.pem_cert_chain = tls.cert_pem;
  return grpc::SslCredentials(options);
}

std::string TlsModeName(const TlsOptions& tls) {
  if (!tls.enabled()) return "plaintext";
  return tls.mutual() ? "mutual TLS" : "TLS";
}

std::string TlsHint(const TlsOptions& tls) {
  if (!tls.enabled()) {
    return "this process talks plaintext; a peer that uses TLS refuses it (give every process "
           "--tls-cert/--tls-key/--tls-ca, or none)";
  }
  return absl::StrCat(
      "this process talks ", TlsModeName(tls),
      "; a plaintext peer, a peer whose certificate is not signed by the CA or does not name "
      "its address, or (mutual TLS) a peer without a certificate from the CA fails like this");
}

}  // namespace remora::rpc
