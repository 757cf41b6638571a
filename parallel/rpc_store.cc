#include "parallel/rpc_store.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "parallel/protocol.h"

namespace remora::parallel {
namespace {

// The keys this process hosts (the master's), for every group.
struct Table {
  absl::Mutex mu;
  std::map<std::string, std::string> values ABSL_GUARDED_BY(mu);
};

Table& TheTable() {
  static Table* table = new Table;  // never destroyed: handlers may run late
  return *table;
}

std::vector<uint8_t> BytesOf(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::vector<std::string> Prefixed(const std::string& prefix, const std::vector<std::string>& keys) {
  std::vector<std::string> out;
  for (const auto& k : keys) out.push_back(prefix + k);
  return out;
}

}  // namespace

absl::Status RegisterStoreFunctions(rpc::Registry& registry) {
  RETURN_IF_ERROR(
      registry.RegisterFunction(StoreSetRequest::kFunction, [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
        auto r = rpc::DecodeCallOrThrow<StoreSetRequest>(a);
        Table& t = TheTable();
        base::MutexLock lock(t.mu);
        t.values[r.key] = std::move(r.value);
        return c10::IValue();
      }));
  RETURN_IF_ERROR(
      registry.RegisterFunction(StoreGetRequest::kFunction, [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
        const std::string key = rpc::DecodeCallOrThrow<StoreGetRequest>(a).key;
        Table& t = TheTable();
        base::MutexLock lock(t.mu);
        auto it = t.values.find(key);
        return it == t.values.end() ? c10::IValue() : c10::IValue(it->second);
      }));
  RETURN_IF_ERROR(
      registry.RegisterFunction(StoreAddRequest::kFunction, [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
        const auto r = rpc::DecodeCallOrThrow<StoreAddRequest>(a);
        Table& t = TheTable();
        base::MutexLock lock(t.mu);
        std::string& value = t.values[r.key];
        int64_t n = 0;
        if (!value.empty() && !absl::SimpleAtoi(value, &n)) {
          throw std::invalid_argument(absl::StrCat("store key '", r.key, "' holds no number"));
        }
        n += r.n;
        value = std::to_string(n);
        return n;
      }));
  RETURN_IF_ERROR(registry.RegisterFunction(StoreDeleteRequest::kFunction,
                                            [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
                                              const std::string key = rpc::DecodeCallOrThrow<StoreDeleteRequest>(a).key;
                                              Table& t = TheTable();
                                              base::MutexLock lock(t.mu);
                                              return t.values.erase(key) > 0;
                                            }));
  RETURN_IF_ERROR(
      registry.RegisterFunction(StoreCheckRequest::kFunction, [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
        const std::vector<std::string> keys = rpc::DecodeCallOrThrow<StoreCheckRequest>(a).keys;
        Table& t = TheTable();
        base::MutexLock lock(t.mu);
        for (const auto& k : keys) {
          if (t.values.count(k) == 0) return false;
        }
        return true;
      }));
  return registry.RegisterFunction(
      StoreCountRequest::kFunction, [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
        const std::string prefix = rpc::DecodeCallOrThrow<StoreCountRequest>(a).prefix;
        Table& t = TheTable();
        base::MutexLock lock(t.mu);
        int64_t n = 0;
        for (auto it = t.values.lower_bound(prefix); it != t.values.end() && it->first.rfind(prefix, 0) == 0; ++it) ++n;
        return n;
      });
}

void ClearStoreKeys(const std::string& prefix) {
  Table& t = TheTable();
  base::MutexLock lock(t.mu);
  auto it = t.values.lower_bound(prefix);
  while (it != t.values.end() && it->first.rfind(prefix, 0) == 0) it = t.values.erase(it);
}

RpcStore::RpcStore(rpc::Agent* agent, std::string prefix) : agent_(agent), prefix_(std::move(prefix)) {}

c10::IValue RpcStore::Call(const std::string& function, std::vector<c10::IValue> args, const std::string& key) {
  absl::StatusOr<c10::IValue> r = agent_->rpc_sync(agent_->NameOf(0), function, std::move(args));
  if (!r.ok()) {
    throw std::runtime_error(absl::StrCat("the collectives' store (on '", agent_->NameOf(0), "'): ", function,
                                          key.empty() ? "" : absl::StrCat(" '", key, "'"), ": ",
                                          r.status().message()));
  }
  return std::move(*r);
}

c10::intrusive_ptr<c10d::Store> RpcStore::clone() {
  auto copy = c10::make_intrusive<RpcStore>(agent_, prefix_);
  copy->setTimeout(timeout_);
  return copy;
}

void RpcStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  Call(StoreSetRequest::kFunction,
       rpc::EncodeCall(StoreSetRequest{prefix_ + key, std::string(value.begin(), value.end())}), key);
}

std::vector<uint8_t> RpcStore::get(const std::string& key) {
  wait({key});
  c10::IValue v = Call(StoreGetRequest::kFunction, rpc::EncodeCall(StoreGetRequest{prefix_ + key}), key);
  if (v.isNone()) throw std::runtime_error(absl::StrCat("the collectives' store: key '", key, "' was deleted"));
  return BytesOf(v.toStringRef());
}

int64_t RpcStore::add(const std::string& key, int64_t value) {
  const c10::IValue sum = Call(StoreAddRequest::kFunction, rpc::EncodeCall(StoreAddRequest{prefix_ + key, value}), key);
  if (!sum.isInt()) throw std::runtime_error(absl::StrCat("the collectives' store: add '", key, "' gave no number"));
  return sum.toInt();
}

bool RpcStore::deleteKey(const std::string& key) {
  return Call(StoreDeleteRequest::kFunction, rpc::EncodeCall(StoreDeleteRequest{{prefix_ + key}}), key).toBool();
}

bool RpcStore::check(const std::vector<std::string>& keys) {
  return Call(StoreCheckRequest::kFunction, rpc::EncodeCall(StoreCheckRequest{Prefixed(prefix_, keys)}),
              keys.size() == 1 ? keys[0] : "")
      .toBool();
}

int64_t RpcStore::getNumKeys() {
  return Call(StoreCountRequest::kFunction, rpc::EncodeCall(StoreCountRequest{prefix_}), "").toInt();
}

void RpcStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void RpcStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  const bool forever = timeout == kNoTimeout;
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  // Asked every 1, 2, 4 ... 20 ms: a group's members meet within
  // milliseconds of each other, and no thread of the master waits.
  for (absl::Duration pause = absl::Milliseconds(1); !check(keys);
       pause = std::min(2 * pause, absl::Milliseconds(20))) {
    if (!forever && absl::Now() > deadline) {
      throw std::runtime_error(absl::StrCat("the collectives' store: waited ", timeout.count(), " ms for ",
                                            keys.size() == 1 ? absl::StrCat("key '", keys[0], "'")
                                                             : absl::StrCat(keys.size(), " keys"),
                                            " (did every member of the group start?)"));
    }
    absl::SleepFor(pause);
  }
}

}  // namespace remora::parallel
