// Test helpers: a master and N workers as agents in this process, a free
// loopback port, and running the real programs.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "autograd/dist_autograd.h"
#include "examples/cli.h"
#include "rpc/agent.h"
#include "shards/builtins.h"

namespace remora {

// A master and N workers in this process.
class Group {
 public:
  explicit Group(int n, AgentOptions base = {}) {
    EXPECT_TRUE(shards::RegisterAll(registry_).ok());
    AgentOptions m = base;
    m.name = "master";
    m.is_master = true;
    for (int i = 1; i <= n; ++i) m.workers.push_back(absl::StrCat("w", i));
    master_ = std::move(Agent::Start(m, &registry_).value());
    dist_autograd::Enable(*master_);
    std::vector<std::thread> joins;
    for (int i = 1; i <= n; ++i) {
      AgentOptions w = base;
      w.name = absl::StrCat("w", i);
      w.master_address = master_->self().address;
      workers_.push_back(std::move(Agent::Start(w, &registry_).value()));
      dist_autograd::Enable(*workers_.back());
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

  Agent& master() { return *master_; }
  Agent& worker(int i) { return *workers_[i - 1]; }
  std::vector<Agent*> all() {
    std::vector<Agent*> out = {master_.get()};
    for (auto& w : workers_) out.push_back(w.get());
    return out;
  }

  // Waits until every agent's RRef tables are empty.
  bool WaitTablesEmpty(absl::Duration timeout, std::string* why) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      bool empty = true;
      for (Agent* a : all()) {
        RRefStats s = a->rref_stats();
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
  Registry registry_;
  std::unique_ptr<Agent> master_;
  std::vector<std::unique_ptr<Agent>> workers_;
  bool stopped_ = false;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A file name under the test's temporary directory, unique to this process.
inline std::string TempPath(const std::string& name) {
  return absl::StrCat(testing::TempDir(), "/remora_", getpid(), "_", name);
}

// Runs a program to completion; returns its exit code and its output.
inline std::pair<int, std::string> RunProgram(const std::vector<std::string>& argv,
                                              absl::Duration timeout = absl::Seconds(60)) {
  const std::string out = TempPath("out.txt");
  auto p = cli::Subprocess::Spawn(argv, out).value();
  auto code = p->Wait(timeout);
  return {code.ok() ? *code : -1, ReadFile(out)};
}

inline int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace remora
