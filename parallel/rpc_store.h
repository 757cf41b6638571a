// The collectives' rendezvous store over remora's agents: a c10d::Store
// whose keys live in the master process and travel on the group's own
// calls, so they carry its token and TLS and open no port of their own (a
// c10d TCPStore takes any connection on its port).
//
//   RETURN_IF_ERROR(parallel::RegisterStoreFunctions(registry));   // master, before Agent::Start
//   auto store = c10::make_intrusive<parallel::RpcStore>(agent, "remora-dp-7/");   // any member
//   store->set("k", {1, 2});  store->get("k");                      // waits for a key
//
// A member's get() and wait() ask the master every few milliseconds until
// the keys are there or the store's timeout passes (no thread of the
// master waits for them). Keys are kept until ClearStoreKeys(prefix).
//
// Thread-safety: an RpcStore may be used from any thread (c10d calls it
// from Gloo's); the master's table is guarded by a mutex. Ownership: an
// RpcStore borrows its agent, which must outlive it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/status.h"
#include "rpc/agent.h"
#include "rpc/registry.h"

namespace remora::parallel {

// Registers remora.store.* (set, get, add, delete, check, count) in the
// registry of the process that hosts the keys: the master.
absl::Status RegisterStoreFunctions(rpc::Registry& registry);

// Removes the keys that start with `prefix` from this process's table.
void ClearStoreKeys(const std::string& prefix);

class RpcStore final : public c10d::Store {
 public:
  // Keys are `prefix` + key in the table of member 0 (the master).
  RpcStore(rpc::Agent* agent, std::string prefix);

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  // A store of the same keys. Newer LibTorch's Store declares clone() pure
  // virtual, older ones (1.13, 2.6) not at all: this overrides it where it
  // exists, hence no `override`.
  virtual c10::intrusive_ptr<c10d::Store> clone();  // NOLINT(modernize-use-override)

 private:
  // Calls `function` (a remora.store.* call, parallel/protocol.h) on the
  // master; throws std::runtime_error naming the store and the key when the
  // call fails.
  c10::IValue Call(const std::string& function, std::vector<c10::IValue> args, const std::string& key);

  rpc::Agent* const agent_;
  const std::string prefix_;
};

}  // namespace remora::parallel
