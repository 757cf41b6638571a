// The registry: what a caller may run on a worker, by name.
//
// Only registered functions, module types and their methods are callable;
// nothing else a request names is executed. A function takes the call's
// context and its arguments and returns one IValue. A module type has a
// factory (what `remote(worker, "Type", args)` runs; the instance stays on
// the worker, inside an owner RRef) and named methods (what
// `rref.rpc_sync("method", args)` runs on that instance).
//
// Functions may throw (c10::Error, std::exception): the caller's future
// completes with the message, and the worker keeps serving.
//
// Thread-safety: register everything before the agent starts serving; after
// that the registry is read-only and safe to read from any thread.
#pragma once

#include <functional>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "rpc/future.h"
#include "base/ids.h"

namespace remora::rpc {

class Agent;

// Where a registered function runs: the serving agent (for nested calls)
// and who called.
struct CallContext {
  Agent* agent = nullptr;
  base::WorkerInfo caller;
  // True when a prompt function (Registry::MarkPrompt) runs on the thread
  // that received its request (a local link's reader): it must not wait
  // there, for another message least of all. Work that might wait goes to
  // agent->executor().
  bool prompt = false;

  // The serving worker's name, for messages; "?" without an agent (a
  // function called directly, as tests do).
  std::string worker_name() const;
};

// A call's arguments. operator[] is bounds-checked: a missing argument
// becomes a clear error for the caller instead of a crash.
class Args {
 public:
  Args() = default;
  explicit Args(std::vector<c10::IValue> values) : values_(std::move(values)) {}

  size_t size() const { return values_.size(); }
  const c10::IValue& operator[](size_t i) const;
  std::vector<c10::IValue>& values() { return values_; }

 private:
  std::vector<c10::IValue> values_;
};

using Function = std::function<c10::IValue(CallContext&, const Args&)>;
// A function that answers later: the call completes with the future. Use it
// for work that waits on other calls, so that no thread waits with it.
using AsyncFunction = std::function<Future<c10::IValue>(CallContext&, const Args&)>;

// A module instance living on its owner worker; held by an owner RRef as an
// IValue capsule. Only its registered methods can be called, one at a time
// (like the lock in each shard of PyTorch's pipeline example).
class RemoteObject : public torch::CustomClassHolder {
 public:
  RemoteObject(std::string type, std::shared_ptr<void> object)
      : type_(std::move(type)), object_(std::move(object)) {}
  const std::string& type() const { return type_; }
  template <typename T>
  T* get() const { return static_cast<T*>(object_.get()); }
  // Held while a method runs.
  absl::Mutex& mutex() const ABSL_LOCK_RETURNED(mu_) { return mu_; }

 private:
  std::string type_;
  std::shared_ptr<void> object_;
  mutable absl::Mutex mu_;
};

// The RemoteObject held by `value`, or null when it holds none.
RemoteObject* AsRemoteObject(const c10::IValue& value);

class Registry {
 public:
  using Method = std::function<c10::IValue(void* self, CallContext&, const Args&)>;
  using Factory = std::function<std::shared_ptr<void>(CallContext&, const Args&)>;

  template <typename T>
  using TypedMethod = std::function<c10::IValue(T&, CallContext&, const Args&)>;

  // Names: 1 to 128 characters of [A-Za-z0-9_.:-]; each name once.
  absl::Status RegisterFunction(const std::string& name, Function fn);
  absl::Status RegisterAsyncFunction(const std::string& name, AsyncFunction fn);

  template <typename T>
  absl::Status RegisterModule(
      const std::string& name,
      std::function<std::shared_ptr<T>(CallContext&, const Args&)> factory,
      std::map<std::string, TypedMethod<T>> methods) {
    std::map<std::string, Method> erased;
    for (auto& entry : methods) {
      TypedMethod<T> m = std::move(entry.second);  // clang: no captured bindings in C++17
      erased[entry.first] = [m](void* self, CallContext& ctx, const Args& args) {
        return m(*static_cast<T*>(self), ctx, args);
      };
    }
    return RegisterModuleType(
        name,
        [factory](CallContext& ctx, const Args& args) -> std::shared_ptr<void> {
          return factory(ctx, args);
        },
        std::move(erased));
  }

  absl::Status RegisterModuleType(const std::string& name, Factory factory,
                                  std::map<std::string, Method> methods);

  bool Contains(const std::string& name) const;

  // Marks function `name` (registered already) as prompt: it never waits,
  // for another message or a lock held across one; it queues its work
  // (on the compute lane, say) and returns, or completes its future later.
  // A request for it that arrives on a local link (rpc/link.h) runs on the
  // link's reader thread instead of going to the pool: one thread hop less
  // on the way of a pipeline's activations and gradients. NotFound when
  // there is no such function. Call before the agent starts.
  absl::Status MarkPrompt(const std::string& name);
  bool IsPrompt(const std::string& name) const;

  // Runs function `name`, or constructs module type `name` (the result is a
  // RemoteObject capsule). Exceptions become errors. The future is ready on
  // return unless `name` is an async function.
  Future<c10::IValue> Invoke(const std::string& name, CallContext& ctx,
                             const Args& args) const;

  // Runs method `method` of the module held by `object`.
  absl::StatusOr<c10::IValue> InvokeMethod(const c10::IValue& object,
                                           const std::string& method,
                                           CallContext& ctx,
                                           const Args& args) const;

 private:
  struct ModuleType {
    Factory factory;
    std::map<std::string, Method> methods;
  };

  absl::Status CheckNewName(const std::string& name) const;

  std::map<std::string, AsyncFunction> functions_;
  std::set<std::string> prompt_;  // functions marked prompt
  std::map<std::string, ModuleType> modules_;
};

}  // namespace remora::rpc
