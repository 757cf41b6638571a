// Test helpers: a master and N workers as agents in this process, a free
// loopback port, and running the real programs.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "autograd/dist_autograd.h"
#include "launch/cli.h"
#include "rpc/agent.h"
#include "rpc/message.h"
#include "tests/support/proc.h"
#include "tests/support/test_functions.h"

namespace remora {

// Options of an agent named "master" that waits for `workers` to join.
inline rpc::AgentOptions MasterOptions(std::vector<std::string> workers) {
  rpc::AgentOptions m;
  m.name = "master";
  m.is_master = true;
  m.workers = std::move(workers);
  return m;
}

// A master and N workers in this process. `setup`, when given, runs on
// every agent after it started and before it joins (to register request
// kinds, say).
class Group {
 public:
  explicit Group(int n, rpc::AgentOptions base = {},
                 const std::function<void(rpc::Agent&)>& setup = nullptr) {
    EXPECT_TRUE(test_support::RegisterForTests(registry_).ok());
    rpc::AgentOptions m = base;
    m.name = "master";
    m.is_master = true;
    for (int i = 1; i <= n; ++i) m.workers.push_back(absl::StrCat("w", i));
    master_ = std::move(rpc::Agent::Start(m, &registry_).value());
    autograd::Enable(*master_);
    if (setup) setup(*master_);
    std::vector<std::thread> joins;
    for (int i = 1; i <= n; ++i) {
      rpc::AgentOptions w = base;
      w.name = absl::StrCat("w", i);
      w.device_maps.erase(w.name);  // `base`'s maps are the master's: none to itself
      w.master_address = master_->self().address;
      workers_.push_back(std::move(rpc::Agent::Start(w, &registry_).value()));
      autograd::Enable(*workers_.back());
      if (setup) setup(*workers_.back());
    }
    for (auto& w : workers_) {
      joins.emplace_back([&w] { EXPECT_TRUE(w->Join().ok()); });
    }
    EXPECT_TRUE(master_->Join().ok());
    for (auto& t : joins) t.join();
  }

  ~Group() { EXPECT_TRUE(Shutdown().ok()); }

  absl::Status Shutdown() {
    if (stopped_) return absl::OkStatus();
    stopped_ = true;
    std::vector<std::thread> waits;
    for (auto& w : workers_) {
      waits.emplace_back([&w] { EXPECT_TRUE(w->Shutdown().ok()); });
    }
    absl::Status s = master_->Shutdown();
    for (auto& t : waits) t.join();
    return s;
  }

  // Stops every agent at once, as a failing process does: no graceful
  // shutdown, nothing expected of it.
  void StopNow() {
    stopped_ = true;
    for (auto& w : workers_) w->Shutdown(/*graceful=*/false).IgnoreError();
    master_->Shutdown(/*graceful=*/false).IgnoreError();
  }

  rpc::Agent& master() { return *master_; }
  rpc::Agent& worker(int i) { return *workers_[i - 1]; }
  std::vector<rpc::Agent*> all() {
    std::vector<rpc::Agent*> out = {master_.get()};
    for (auto& w : workers_) out.push_back(w.get());
    return out;
  }

  // Waits until every agent's RRef tables are empty.
  bool WaitTablesEmpty(absl::Duration timeout, std::string* why) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      bool empty = true;
      for (rpc::Agent* a : all()) {
        rpc::RRefStats s = a->rref_stats();
        if (s.owners || s.forks || s.live_users || s.pending_users || s.pending_children ||
            s.pending_messages) {
          empty = false;
          *why = absl::StrCat(a->self().name, ": owners=", s.owners, " forks=", s.forks,
                              " live_users=", s.live_users, " pending_users=", s.pending_users,
                              " pending_children=", s.pending_children,
                              " pending_messages=", s.pending_messages);
        }
      }
      if (empty) return true;
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

 private:
  rpc::Registry registry_;
  std::unique_ptr<rpc::Agent> master_;
  std::vector<std::unique_ptr<rpc::Agent>> workers_;
  bool stopped_ = false;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Waits until `log`, where `program` writes, holds `text` (after the first
// `after`, when given), the program has ended, or `timeout` has passed,
// reading it every `poll`; whether the text came.
inline bool AwaitOutput(launch::Subprocess& program, const std::string& log, const std::string& text,
                        absl::Duration timeout, absl::Duration poll = absl::Milliseconds(2),
                        const std::string& after = "") {
  const absl::Time deadline = absl::Now() + timeout;
  auto found = [&] {
    const std::string now = ReadFile(log);
    const size_t from = after.empty() ? 0 : now.find(after);
    return from != std::string::npos && now.find(text, from) != std::string::npos;
  };
  while (!found()) {
    if (!program.running() || absl::Now() >= deadline) return found();
    absl::SleepFor(poll);
  }
  return true;
}

// The folder of the running test program, where the build also puts the
// programs the tests start (bin/). Found at run time, not passed as a
// compile definition: a path in one differs from clone to clone and would
// make every test a compiler-cache miss in a fresh clone.
inline const std::string& BinDir() {
  static const std::string dir = [] {
    const std::string sibling = launch::SiblingProgram("");  // "<bin>/", or "" when unknown
    return sibling.empty() ? std::string(".") : sibling.substr(0, sibling.size() - 1);
  }();
  return dir;
}

// Waits until every thread of process `pid` has stopped (a SIGSTOP sent
// to it takes effect thread by thread, and a thread woken by a message
// may run on a while first), for up to `timeout`; false if they have not.
inline bool AwaitStopped(pid_t pid, absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time until = absl::Now() + timeout;
  while (true) {
    const std::map<int, std::string> states = test_support::ThreadStatus(pid, "State:");
    bool all = !states.empty();  // "T (stopped)", or "t (tracing stop)"
    for (const auto& [tid, state] : states) all = all && (absl::StartsWith(state, "T") || absl::StartsWith(state, "t"));
    if (all) return true;
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
}

// Expects `s` to be an error whose message holds each of `parts`.
inline void ExpectError(const absl::Status& s, const std::vector<std::string>& parts) {
  ASSERT_FALSE(s.ok());
  for (const auto& p : parts) {
    EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' not in: " << s.message();
  }
}

// A file name under the test's temporary directory, unique to this process.
inline std::string TempPath(const std::string& name) {
  return absl::StrCat(testing::TempDir(), "/remora_", getpid(), "_", name);
}

// The stacks of every thread of process `pid`, for a test whose program
// hung: gdb attaches for a moment (a note instead when gdb is missing).
inline std::string StacksOf(pid_t pid) {
  if (access("/usr/bin/gdb", X_OK) != 0) return "(no stacks: /usr/bin/gdb is not installed)\n";
  const std::string out = TempPath(absl::StrCat("stacks_", pid, ".txt"));
  const std::string command = absl::StrCat("timeout 60 /usr/bin/gdb -p ", pid,
                                           " -batch -ex 'thread apply all bt' >", out, " 2>&1");
  if (std::system(command.c_str()) != 0) return absl::StrCat("(gdb failed on ", pid, ")\n", ReadFile(out));
  return absl::StrCat("stacks of the hung process ", pid, ":\n", ReadFile(out));
}

// Runs a program to completion; returns its exit code and its output
// (-1 and, after the output, its threads' stacks when it outlives
// `timeout`).
inline std::pair<int, std::string> RunProgram(const std::vector<std::string>& argv,
                                              absl::Duration timeout = absl::Seconds(60)) {
  const std::string out = TempPath("out.txt");
  auto p = launch::Subprocess::Spawn(argv, out).value();
  auto code = p->Wait(timeout);
  if (!code.ok()) return {-1, ReadFile(out) + StacksOf(p->pid())};
  return {*code, ReadFile(out)};
}

// The TMPDIR the test program started with (./run test points it into the
// build tree, so that the programs' token caches land there). A test that
// points it elsewhere for the programs it starts puts it back with
// RestoreTmpdir(), not unsetenv: those started later would write to /tmp.
inline const std::string kStartTmpdir = getenv("TMPDIR") != nullptr ? getenv("TMPDIR") : "";

inline void RestoreTmpdir() {
  if (kStartTmpdir.empty()) {
    unsetenv("TMPDIR");
  } else {
    setenv("TMPDIR", kStartTmpdir.c_str(), 1);
  }
}

// A certificate authority and one certificate it signed, made with the
// openssl CLI: the certificate names 127.0.0.1 and localhost and serves as
// server and client certificate (each process of a group is both).
struct TestPki {
  std::string ca;    // CA certificate
  std::string cert;  // node certificate, signed by the CA
  std::string key;   // its private key
  rpc::TlsOptions tls() const { return rpc::LoadTlsFiles(cert, key, ca).value(); }
  launch::TlsFiles files() const { return launch::TlsFiles{cert, key, ca}; }
};

// Makes a PKI named `name` under the test's temporary directory (P-256
// keys: fast). Fails the test when openssl is missing or fails.
inline TestPki MakeTestPki(const std::string& name) {
  const std::string dir = TempPath(absl::StrCat("pki_", name));
  const std::string script = absl::StrCat(
      "set -e; mkdir -p '", dir, "'; cd '", dir, "'\n",
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2"
      " -subj '/CN=remora test CA ", name, "' -keyout ca.key -out ca.crt\n",
      "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
      " -subj '/CN=localhost' -keyout node.key -out node.csr\n",
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n"
      "extendedKeyUsage=serverAuth,clientAuth\\nbasicConstraints=CA:FALSE\\n' > node.ext\n",
      "openssl x509 -req -in node.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2"
      " -extfile node.ext -out node.crt\n");
  auto [code, out] = RunProgram({"/bin/sh", "-c", script});
  EXPECT_EQ(code, 0) << "making test certificates with openssl failed (is openssl installed? "
                        "./run installs it):\n"
                     << out;
  return TestPki{dir + "/ca.crt", dir + "/node.crt", dir + "/node.key"};
}

// A bare gRPC client of remora's one method, for hand-built frames and
// garbage: what a buggy or hostile peer would send.
//
// Thread-compatible; owns its channel. Calls block until answered or
// `timeout` passes.
class RawClient {
 public:
  explicit RawClient(const std::string& address,
                     std::shared_ptr<grpc::ChannelCredentials> credentials =
                         grpc::InsecureChannelCredentials())
      : channel_(grpc::CreateChannel(address, std::move(credentials))), stub_(channel_) {}

  // Sends `bytes` as the request of gRPC method `method`; the reply's bytes,
  // or the gRPC error.
  absl::StatusOr<std::string> CallBytes(const std::string& bytes,
                                        absl::Duration timeout = absl::Seconds(10),
                                        const std::string& method = "/remora.Agent/Call",
                                        const std::string& token = "") {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
    if (!token.empty()) context.AddMetadata("remora-token", token);
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::CompletionQueue cq;
    auto call = stub_.PrepareUnaryCall(&context, method, request, &cq);
    call->StartCall();
    grpc::Status status;
    call->Finish(&response, &status, this);
    void* tag = nullptr;
    bool ok = false;
    cq.Next(&tag, &ok);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    std::vector<grpc::Slice> slices;
    std::string out;
    if (response.Dump(&slices).ok()) {
      for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    return out;
  }

  // Sends a frame built from `message`; the parsed reply.
  absl::StatusOr<rpc::InMessage> Call(rpc::OutMessage message, absl::Duration timeout = absl::Seconds(10)) {
    return CallBytesParsed(FrameBytes(std::move(message)), timeout);
  }

  // The bytes of the frame of `message`.
  static std::string FrameBytes(rpc::OutMessage message) {
    grpc::ByteBuffer buffer = rpc::SerializeMessage(std::move(message));
    std::vector<grpc::Slice> slices;
    std::string out;
    if (buffer.Dump(&slices).ok()) {
      for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    return out;
  }

  absl::StatusOr<rpc::InMessage> CallBytesParsed(const std::string& bytes,
                                            absl::Duration timeout = absl::Seconds(10)) {
    auto reply = CallBytes(bytes, timeout);
    if (!reply.ok()) return reply.status();
    grpc::Slice slice(*reply);
    return rpc::ParseMessage(grpc::ByteBuffer(&slice, 1));
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  grpc::GenericStub stub_;
};

// A loopback port that nothing listens on now, for a master that a test
// starts after its workers. Chosen at random in [20000, 32000), below
// Linux's ephemeral range (32768-60999): the kernel's own choice (bind to
// port 0) tends to hand the same port to tests running side by side, and
// an outgoing connection may take an ephemeral port meanwhile. Seen in CI:
// two tests got the same port, and one's workers joined the other's master.
// The master's own default, 29500, and its neighbours are left out.
inline int FreePort() {
  static std::mt19937 random(std::random_device{}() ^ static_cast<unsigned>(getpid()));
  std::uniform_int_distribution<int> pick(20000, 31999);
  for (int attempt = 0;; ++attempt) {
    const int port = pick(random);
    if (port >= 29400 && port < 29600) continue;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (free || attempt > 1000) return port;
  }
}

}  // namespace remora
