// TLS and mutual TLS between in-process agents, with certificates made by
// the openssl CLI at test time.
#include <atomic>
#include <fstream>
#include <thread>

#include <ATen/ops/allclose.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "proto/request.h"
#include "proto/rref.pb.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;

// One CA for the whole suite, another for the "foreign" certificates.
const TestPki& Pki() {
  static const TestPki* pki = new TestPki(MakeTestPki("main"));
  return *pki;
}
const TestPki& OtherPki() {
  static const TestPki* pki = new TestPki(MakeTestPki("other"));
  return *pki;
}

// A master without workers, serving a registry whose one function counts
// its calls: a call that ran is a call that got through.
//
// Owns its agent and registry; calls() may be read from any thread.
class CountingMaster {
 public:
  explicit CountingMaster(rpc::AgentOptions options) {
    EXPECT_TRUE(registry_
                    .RegisterFunction("count",
                                      [this](rpc::CallContext&, const rpc::Args&) -> c10::IValue {
                                        return int64_t{++calls_};
                                      })
                    .ok());
    options.name = "master";
    options.is_master = true;
    agent_ = rpc::Agent::Start(options, &registry_).value();
    EXPECT_TRUE(agent_->Join().ok());
  }
  ~CountingMaster() { EXPECT_TRUE(agent_->Shutdown().ok()); }

  rpc::Agent& agent() { return *agent_; }
  int calls() const { return calls_.load(); }

  // The frame of a call to "count" as the master itself would send it.
  static rpc::OutMessage CountCall() {
    rpc::OutMessage m;
    m.header.mutable_request()->set_from(0);
    wire::CallRequest count;
    count.set_function("count");
    *m.header.mutable_request() = wire::MakeRequest(count);
    m.header.mutable_request()->set_from(0);
    return m;
  }

 private:
  rpc::Registry registry_;
  std::atomic<int> calls_{0};
  std::unique_ptr<rpc::Agent> agent_;
};

std::string Read(const std::string& path) { return ReadFile(path); }

std::shared_ptr<grpc::ChannelCredentials> ClientCredentials(const std::string& root,
                                                            const std::string& cert,
                                                            const std::string& key) {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = root;
  o.pem_cert_chain = cert;
  o.pem_private_key = key;
  return grpc::SslCredentials(o);
}

TEST(Tls, MutualTlsGroupRunsCallsAndRRefs) {
  rpc::AgentOptions base;
  base.tls = Pki().tls();
  Group group(2, base);
  rpc::Agent& master = group.master();
  EXPECT_EQ(master.rpc_sync("w1", "add", {int64_t{40}, int64_t{2}}).value().toInt(), 42);
  {
    rpc::RRef s1 = master.remote("w1", "Affine", {int64_t{5}, int64_t{4}, int64_t{1}}).value();
    rpc::RRef s2 = master.remote("w2", "Affine", {int64_t{4}, int64_t{3}, int64_t{2}}).value();
    at::Tensor w1 = s1.rpc_sync("weight").value().toTensor();
    at::Tensor w2 = s2.rpc_sync("weight").value().toTensor();
    at::Tensor x = at::randn({2, 5});
    // worker2 fetches worker1's result from worker1: a TLS call between workers.
    rpc::RRef y = s1.remote("forward", {master.local_rref(x)}).value();
    auto z = s2.rpc_sync("forward", {y});
    ASSERT_TRUE(z.ok()) << z.status();
    EXPECT_TRUE(at::allclose(z->toTensor(), at::matmul(at::matmul(x, w1.t()), w2.t()), 1e-5,
                             1e-6));
  }
  std::string why;
  EXPECT_TRUE(group.WaitTablesEmpty(absl::Seconds(20), &why)) << why;
}

TEST(Tls, ClientsWithoutACertificateFromTheCaAreRefusedAndNothingRuns) {
  rpc::AgentOptions options;
  options.tls = Pki().tls();
  CountingMaster master(options);
  const std::string address = master.agent().self().address;
  const std::string ca = Read(Pki().ca);

  // No client certificate: the server requires one.
  RawClient anonymous(address, ClientCredentials(ca, "", ""));
  auto r1 = anonymous.Call(CountingMaster::CountCall(), absl::Seconds(5));
  EXPECT_FALSE(r1.ok());
  EXPECT_EQ(r1.status().code(), absl::StatusCode::kUnavailable) << r1.status();

  // A certificate from another CA.
  RawClient foreign(address, ClientCredentials(ca, Read(OtherPki().cert), Read(OtherPki().key)));
  auto r2 = foreign.Call(CountingMaster::CountCall(), absl::Seconds(5));
  EXPECT_FALSE(r2.ok());
  EXPECT_EQ(r2.status().code(), absl::StatusCode::kUnavailable) << r2.status();

  // Plaintext against the TLS server.
  RawClient plaintext(address);
  auto r3 = plaintext.Call(CountingMaster::CountCall(), absl::Seconds(5));
  EXPECT_FALSE(r3.ok());
  EXPECT_EQ(r3.status().code(), absl::StatusCode::kUnavailable) << r3.status();

  EXPECT_EQ(master.calls(), 0);

  // The same call with the CA's certificate gets through.
  RawClient member(address, ClientCredentials(ca, Read(Pki().cert), Read(Pki().key)));
  auto ok = member.Call(CountingMaster::CountCall(), absl::Seconds(10));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(ok->header.response().has_error()) << ok->header.response().error().message();
  EXPECT_EQ(master.calls(), 1);
}

TEST(Tls, ServerFromAnotherCaIsRefusedByTheClient) {
  rpc::AgentOptions options;
  options.tls = OtherPki().tls();
  CountingMaster master(options);
  // Trusts only the main CA: the server's certificate does not verify.
  RawClient client(master.agent().self().address,
                   ClientCredentials(Read(Pki().ca), Read(Pki().cert), Read(Pki().key)));
  auto r = client.Call(CountingMaster::CountCall(), absl::Seconds(5));
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(master.calls(), 0);
}

// A master and a worker, one of them with TLS: returns the worker's join
// status, after checking that the master's join fails too. The two wait
// side by side, each for 2 s.
absl::Status JoinWithMismatchedTls(bool master_tls) {
  rpc::Registry registry;
  rpc::AgentOptions m = MasterOptions({"w1"});
  m.connect_timeout = absl::Seconds(2);
  if (master_tls) m.tls = Pki().tls();
  auto master = rpc::Agent::Start(m, &registry).value();
  rpc::AgentOptions w;
  w.name = "w1";
  w.master_address = master->self().address;
  w.connect_timeout = absl::Seconds(2);
  if (!master_tls) w.tls = Pki().tls();
  auto worker = rpc::Agent::Start(w, &registry).value();
  absl::Status master_join;
  std::thread master_joins([&] { master_join = master->Join(); });
  absl::Status s = worker->Join();
  master_joins.join();
  EXPECT_FALSE(master_join.ok());
  return s;
}

TEST(Tls, PlaintextWorkerCannotJoinATlsMasterAndSaysWhy) {
  absl::Status s = JoinWithMismatchedTls(/*master_tls=*/true);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("plaintext"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("--tls-cert"));
}

TEST(Tls, TlsWorkerCannotJoinAPlaintextMasterAndSaysWhy) {
  absl::Status s = JoinWithMismatchedTls(/*master_tls=*/false);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("mutual TLS"));
}

TEST(Tls, IncompleteOrInvalidOptionsAreClearErrors) {
  rpc::Registry registry;
  const rpc::TlsOptions good = Pki().tls();
  auto start = [&](rpc::TlsOptions tls) {
    rpc::AgentOptions o;
    o.name = "w1";
    o.tls = std::move(tls);
    return rpc::Agent::Start(o, &registry).status();
  };
  EXPECT_THAT(std::string(start(rpc::TlsOptions{good.cert_pem, "", ""}).message()),
              HasSubstr("without its private key"));
  EXPECT_THAT(std::string(start(rpc::TlsOptions{"", good.key_pem, ""}).message()),
              HasSubstr("without its certificate"));
  EXPECT_THAT(std::string(start(rpc::TlsOptions{"", "", good.ca_pem}).message()),
              HasSubstr("CA is given without a certificate"));
  EXPECT_THAT(std::string(start(rpc::TlsOptions{"not pem", good.key_pem, ""}).message()),
              HasSubstr("no PEM certificate"));
  EXPECT_THAT(std::string(start(rpc::TlsOptions{good.cert_pem, "not pem", ""}).message()),
              HasSubstr("no PEM private key"));
  EXPECT_THAT(std::string(start(rpc::TlsOptions{good.cert_pem, good.key_pem, "junk"}).message()),
              HasSubstr("CA holds no PEM"));
  // A key that does not belong to the certificate, or PEM blocks that do
  // not parse: named before gRPC's server would fail on them (where this
  // build checks them; else the server cannot start).
  absl::Status mismatched = start(rpc::TlsOptions{good.cert_pem, Read(OtherPki().key), good.ca_pem});
  const std::string cut_key = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
  const std::string cut_cert = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
  if (rpc::TlsChecksKeyMatch()) {
    EXPECT_THAT(std::string(mismatched.message()), HasSubstr("'w1': TLS: the private key is not the certificate's"));
    EXPECT_THAT(std::string(start(rpc::TlsOptions{good.cert_pem, cut_key, ""}).message()),
                HasSubstr("the private key cannot be read"));
    EXPECT_THAT(std::string(start(rpc::TlsOptions{cut_cert, good.key_pem, ""}).message()),
                HasSubstr("cannot be read as an X.509 certificate"));
  } else {
    EXPECT_THAT(std::string(mismatched.message()), HasSubstr("TLS certificate"));
  }

  // Files, as the programs load them.
  const TestPki& p = Pki();
  EXPECT_TRUE(rpc::LoadTlsFiles("", "", "").ok());
  EXPECT_FALSE(rpc::LoadTlsFiles("", "", "").value().enabled());
  EXPECT_TRUE(rpc::LoadTlsFiles(p.cert, p.key, "").value().enabled());
  EXPECT_TRUE(rpc::LoadTlsFiles(p.cert, p.key, p.ca).value().mutual());
  EXPECT_THAT(std::string(rpc::LoadTlsFiles(p.cert, "", "").status().message()),
              HasSubstr("--tls-cert is given without --tls-key"));
  EXPECT_THAT(std::string(rpc::LoadTlsFiles("", p.key, "").status().message()),
              HasSubstr("--tls-key is given without --tls-cert"));
  EXPECT_THAT(std::string(rpc::LoadTlsFiles("", "", p.ca).status().message()),
              HasSubstr("--tls-ca needs --tls-cert and --tls-key"));
  const std::string missing = TempPath("absent.crt");
  absl::Status unreadable = rpc::LoadTlsFiles(missing, p.key, p.ca).status();
  EXPECT_THAT(std::string(unreadable.message()), HasSubstr("cannot read --tls-cert " + missing));
  // A directory is an error naming the flag, not an exception from reading it.
  EXPECT_EQ(rpc::LoadTlsFiles(testing::TempDir(), p.key, "").status().message(),
            "--tls-cert " + testing::TempDir() + " is a directory; give a file");
  EXPECT_THAT(std::string(rpc::LoadTlsFiles(p.key, p.key, p.ca).status().message()),
              HasSubstr("--tls-cert " + p.key + " holds no PEM certificate"));
  EXPECT_THAT(std::string(rpc::LoadTlsFiles(p.cert, p.cert, p.ca).status().message()),
              HasSubstr("--tls-key " + p.cert + " holds no PEM private key"));
  if (rpc::TlsChecksKeyMatch()) {
    EXPECT_THAT(std::string(rpc::LoadTlsFiles(p.cert, OtherPki().key, p.ca).status().message()),
                HasSubstr("--tls-cert " + p.cert + " with --tls-key " + OtherPki().key +
                          ": TLS: the private key is not the certificate's"));
  }
}

}  // namespace
}  // namespace remora
