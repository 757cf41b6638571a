// Several hosts on one machine: three network namespaces joined by a
// bridge (in a fourth), each with its own address on 10.47.0.0/24, which
// exists only inside these namespaces (no default route: nothing leaves
// them). The master runs in the first, a worker in each of the others, all
// started by remora-launch from torchrun's variables, and they train over
// gRPC between the namespaces. Root only (creating namespaces needs
// CAP_SYS_ADMIN); skipped with the reason otherwise. The namespaces are
// removed when each test ends, passed or failed.
#include <signal.h>
#include <unistd.h>

#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kIp[] = "/sbin/ip";
constexpr int kRanks = 3;

std::string Address(int rank) { return absl::StrCat("10.47.0.", rank + 1); }

// Runs a shell script; its exit code and output.
std::pair<int, std::string> Shell(const std::string& script) {
  return RunProgram({"/bin/sh", "-c", script}, absl::Seconds(30));
}

// The namespaces of one test: "remora-t<pid>-hub" holds the bridge,
// "remora-t<pid>-<r>" is rank r's host with eth0 at Address(r).
class NetNamespaces : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces";
    if (access(kIp, X_OK) != 0) GTEST_SKIP() << "needs " << kIp << " (Debian's iproute2; ./run installs it)";
    RemoveStaleNamespaces();
    prefix_ = absl::StrCat("remora-t", getpid(), "-");
    // A root without the means (a chroot whose / is no mount point, no
    // CAP_SYS_ADMIN) cannot make namespaces at all: say so and skip.
    const std::string probe_ns = prefix_ + "probe";
    auto [probe, why] = Shell(absl::StrCat(kIp, " netns add ", probe_ns, " && ", kIp, " -n ", probe_ns,
                                           " link set lo up; rc=$?; ", kIp, " netns del ", probe_ns,
                                           " 2>/dev/null; exit $rc"));
    if (probe != 0) GTEST_SKIP() << "cannot create network namespaces here: " << why;
    std::string script = absl::StrCat("set -e\n", kIp, " netns add ", prefix_, "hub\n", kIp,
                                      " -n ", prefix_, "hub link add br0 type bridge\n", kIp, " -n ",
                                      prefix_, "hub link set br0 up\n");
    for (int r = 0; r < kRanks; ++r) {
      const std::string ns = Namespace(r);
      absl::StrAppend(&script, kIp, " netns add ", ns, "\n",
                      kIp, " -n ", ns, " link set lo up\n",
                      kIp, " link add eth0 netns ", ns, " type veth peer name p", r, " netns ",
                      prefix_, "hub\n",
                      kIp, " -n ", prefix_, "hub link set p", r, " master br0 up\n",
                      kIp, " -n ", ns, " addr add ", Address(r), "/24 dev eth0\n",
                      kIp, " -n ", ns, " link set eth0 up\n");
    }
    created_ = true;
    auto [code, out] = Shell(script);
    if (code != 0 && out.find("Operation not permitted") != std::string::npos) {
      GTEST_SKIP() << "cannot create network namespaces here (no CAP_SYS_ADMIN?): " << out;
    }
    ASSERT_EQ(code, 0) << "setting up the namespaces failed:\n" << out;
  }

  void TearDown() override {
    ranks_.clear();  // kills what still runs
    if (!created_) return;
    std::string script;
    for (int r = 0; r < kRanks; ++r) {
      absl::StrAppend(&script, kIp, " netns del ", Namespace(r), " 2>/dev/null; ");
    }
    absl::StrAppend(&script, kIp, " netns del ", prefix_, "hub 2>/dev/null; ", kIp, " netns list");
    auto [code, list] = Shell(script);
    EXPECT_THAT(list, Not(HasSubstr(prefix_))) << "the namespaces were not all removed";
  }

  // Namespaces left by a test process that died (SIGKILL, a crash).
  static void RemoveStaleNamespaces() {
    auto [code, list] = Shell(absl::StrCat(kIp, " netns list"));
    for (absl::string_view line : absl::StrSplit(list, '\n', absl::SkipEmpty())) {
      std::string name(line.substr(0, line.find(' ')));
      int pid = 0;
      if (name.rfind("remora-t", 0) != 0) continue;
      const std::string digits = name.substr(8, name.find('-', 8) - 8);
      if (!absl::SimpleAtoi(digits, &pid) || pid <= 0 || kill(pid, 0) == 0) continue;
      Shell(absl::StrCat(kIp, " netns del ", name));
    }
  }

  std::string Namespace(int rank) const { return absl::StrCat(prefix_, rank); }

  // Starts rank `rank` in its namespace through remora-launch, with
  // torchrun's variables; its output goes to Output(rank).
  void StartRank(int rank, const std::vector<std::string>& args,
                 const std::vector<std::string>& env = {}) {
    std::vector<std::string> argv = {kIp,
                                     "netns",
                                     "exec",
                                     Namespace(rank),
                                     "/usr/bin/env",
                                     absl::StrCat("RANK=", rank),
                                     absl::StrCat("WORLD_SIZE=", kRanks),
                                     "LOCAL_RANK=0",
                                     "MASTER_ADDR=" + Address(0),
                                     "MASTER_PORT=29500",
                                     "REMORA_DEBUG=channels"};
    argv.insert(argv.end(), env.begin(), env.end());
    argv.push_back(BinDir() + "/remora-launch");
    argv.insert(argv.end(), args.begin(), args.end());
    if (ranks_.size() <= static_cast<size_t>(rank)) ranks_.resize(rank + 1);
    ranks_[rank] = launch::Subprocess::Spawn(argv, Output(rank)).value();
  }

  std::string Output(int rank) const { return TempPath(absl::StrCat("netns_rank", rank, ".txt")); }

  // Waits for rank `rank` to exit; its exit code, or -1 after `timeout`.
  int Wait(int rank, absl::Duration timeout) {
    auto code = ranks_[rank]->Wait(timeout);
    return code.ok() ? *code : -1;
  }

  // Waits until Output(rank) holds `text`; false after `timeout`.
  bool WaitForOutput(int rank, const std::string& text, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (ReadFile(Output(rank)).find(text) != std::string::npos) return true;
      if (!ranks_[rank]->running()) return false;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return false;
  }

  std::string prefix_;
  bool created_ = false;
  std::vector<std::unique_ptr<launch::Subprocess>> ranks_;
};

const std::vector<std::string> kTrain = {"--batches", "2", "--batch-size", "8", "--image-size",
                                         "32", "--splits", "2", "--connect-timeout", "60"};

std::vector<std::string> With(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST_F(NetNamespaces, ThreeHostsTrainOverGrpcAndNeverChooseSharedMemory) {
  for (int r = 0; r < kRanks; ++r) StartRank(r, With(kTrain, {"--", "--threads", "1"}));
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(Wait(r, absl::Seconds(240)), 0) << "rank " << r << ":\n" << ReadFile(Output(r));
  }
  const std::string master = ReadFile(Output(0));
  EXPECT_THAT(master, HasSubstr("master at 10.47.0.1:29500 for worker1,worker2"));
  EXPECT_THAT(master, HasSubstr("batch=1 loss="));
  // Processes of one machine, but each in its own network namespace: other
  // hosts, so gRPC, never shared memory (REMORA_DEBUG=channels logs it).
  EXPECT_THAT(master, HasSubstr("'master' -> 'worker1': payloads >= 65536 bytes via grpc"));
  EXPECT_THAT(master, HasSubstr("'master' -> 'worker2': payloads >= 65536 bytes via grpc"));
  for (int r = 0; r < kRanks; ++r) EXPECT_THAT(ReadFile(Output(r)), Not(HasSubstr("via shm")));
  // Each worker serves on its own host's address, found from the route to
  // the master.
  EXPECT_THAT(ReadFile(Output(1)), HasSubstr("serving at 10.47.0.2:"));
  EXPECT_THAT(ReadFile(Output(2)), HasSubstr("serving at 10.47.0.3:"));
}

// Cutting worker2's link mid-training: the master fails within 10 s naming
// worker2 (gRPC keepalive finds the silent peer), and worker1, whose master
// is gone, exits non-zero.
TEST_F(NetNamespaces, ACutLinkFailsTheMasterNamingTheWorkerAndTheOtherWorkerExits) {
  for (int r = 0; r < kRanks; ++r) {
    StartRank(r, {"--batches", "100000", "--batch-size", "8", "--image-size", "32", "--splits",
                  "2", "--", "--threads", "1"});
  }
  ASSERT_TRUE(WaitForOutput(0, "batch=1 ", absl::Seconds(180))) << ReadFile(Output(0));
  auto [code, out] = Shell(absl::StrCat(kIp, " -n ", Namespace(2), " link set eth0 down"));
  ASSERT_EQ(code, 0) << out;
  const absl::Time cut = absl::Now();
  const int master_code = Wait(0, absl::Seconds(10));
  const absl::Duration noticed = absl::Now() - cut;
  const std::string master = ReadFile(Output(0));
  ASSERT_NE(master_code, -1) << "the master still runs 10 s after worker2's link went down:\n"
                             << master;
  EXPECT_NE(master_code, 0) << master;
  EXPECT_THAT(master, HasSubstr("worker2"));
  std::cerr << "the master failed " << absl::FormatDuration(noticed)
            << " after the link went down\n";
  const int worker1 = Wait(1, absl::Seconds(60));
  EXPECT_NE(worker1, -1) << "worker1 did not exit:\n" << ReadFile(Output(1));
  EXPECT_NE(worker1, 0) << ReadFile(Output(1));
}

// A CA and, for each rank, a certificate naming its address (IP SAN), plus
// one for the master that names another host.
struct ClusterPki {
  std::string ca;
  std::vector<std::string> certs, keys;
  std::string wrong_cert, wrong_key;
};

ClusterPki MakeClusterPki() {
  const std::string dir = TempPath("netns_pki");
  std::string script = absl::StrCat(
      "set -e; rm -rf '", dir, "'; mkdir -p '", dir, "'; cd '", dir, "'\n",
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2"
      " -subj '/CN=remora cluster CA' -keyout ca.key -out ca.crt 2>/dev/null\n",
      "cert() {  # NAME SAN\n",
      "  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj \"/CN=$1\""
      " -keyout $1.key -out $1.csr 2>/dev/null\n",
      "  printf 'subjectAltName=%s\\nextendedKeyUsage=serverAuth,clientAuth\\n"
      "basicConstraints=CA:FALSE\\n' \"$2\" > $1.ext\n",
      "  openssl x509 -req -in $1.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2"
      " -extfile $1.ext -out $1.crt 2>/dev/null\n",
      "}\n");
  ClusterPki pki;
  pki.ca = dir + "/ca.crt";
  for (int r = 0; r < kRanks; ++r) {
    absl::StrAppend(&script, "cert rank", r, " IP:", Address(r), "\n");
    pki.certs.push_back(absl::StrCat(dir, "/rank", r, ".crt"));
    pki.keys.push_back(absl::StrCat(dir, "/rank", r, ".key"));
  }
  absl::StrAppend(&script, "cert wrong DNS:elsewhere.example\n");
  pki.wrong_cert = dir + "/wrong.crt";
  pki.wrong_key = dir + "/wrong.key";
  auto [code, out] = Shell(script);
  EXPECT_EQ(code, 0) << "making certificates with openssl failed:\n" << out;
  return pki;
}

std::vector<std::string> TlsFlags(const ClusterPki& pki, const std::string& cert,
                                  const std::string& key) {
  return {"--tls-cert", cert, "--tls-key", key, "--tls-ca", pki.ca};
}

// Mutual TLS between the namespaces: each process's certificate names its
// IP address, which is what its peers dial.
TEST_F(NetNamespaces, MutualTlsWithEachHostsIpAddressInItsCertificate) {
  const ClusterPki pki = MakeClusterPki();
  for (int r = 0; r < kRanks; ++r) {
    StartRank(r, With(With(kTrain, TlsFlags(pki, pki.certs[r], pki.keys[r])),
                      {"--", "--threads", "1"}));
  }
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(Wait(r, absl::Seconds(240)), 0) << "rank " << r << ":\n" << ReadFile(Output(r));
  }
  const std::string master = ReadFile(Output(0));
  EXPECT_THAT(master, HasSubstr("master listening at 10.47.0.1:29500 (mutual TLS)"));
  EXPECT_THAT(master, HasSubstr("batch=1 loss="));
}

// A master whose certificate names another host: the workers refuse it and
// say why.
TEST_F(NetNamespaces, AMasterCertificateForAnotherNameIsRefusedWithAClearMessage) {
  const ClusterPki pki = MakeClusterPki();
  // The workers start once the master listens and give up after 3 s, the
  // master 12 s after it listened: it still listens when they do, however
  // slow they are to start (seconds, under the sanitizers), so their last
  // error is the certificate's.
  StartRank(0, With(With(kTrain, TlsFlags(pki, pki.wrong_cert, pki.wrong_key)),
                    {"--connect-timeout", "12"}));
  ASSERT_TRUE(WaitForOutput(0, "master listening at", absl::Seconds(60))) << ReadFile(Output(0));
  for (int r = 1; r < kRanks; ++r) {
    StartRank(r, With(TlsFlags(pki, pki.certs[r], pki.keys[r]), {"--connect-timeout", "3"}));
  }
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_GT(Wait(r, absl::Seconds(60)), 0) << "rank " << r << ":\n" << ReadFile(Output(r));
  }
  const std::string worker = ReadFile(Output(1));
  EXPECT_THAT(worker, HasSubstr("10.47.0.1:29500"));
  EXPECT_THAT(worker, HasSubstr("Peer name 10.47.0.1 is not in peer certificate"));
  EXPECT_THAT(ReadFile(Output(0)), HasSubstr("did not register"));
}

}  // namespace
}  // namespace remora
