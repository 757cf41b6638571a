#include "rpc/registry.h"

#include <stdexcept>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "rpc/agent.h"

namespace remora::rpc {

std::string CallContext::worker_name() const { return agent != nullptr ? agent->self().name : "?"; }

const c10::IValue& Args::operator[](size_t i) const {
  if (i >= values_.size()) {
    throw std::out_of_range(absl::StrCat("argument ", i, " was requested but ",
                                         values_.size(), " were given"));
  }
  return values_[i];
}

RemoteObject* AsRemoteObject(const c10::IValue& value) {
  if (!value.isCapsule()) return nullptr;
  return dynamic_cast<RemoteObject*>(value.toCapsule().get());
}

absl::Status Registry::CheckNewName(const std::string& name) const {
  if (!base::IsValidRegisteredName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid registered name '", name,
        "': use 1 to 128 characters of [A-Za-z0-9_.:-]"));
  }
  if (Contains(name)) {
    return absl::AlreadyExistsError(
        absl::StrCat("'", name, "' is already registered"));
  }
  return absl::OkStatus();
}

absl::Status Registry::RegisterFunction(const std::string& name, Function fn) {
  if (!fn) return absl::InvalidArgumentError(absl::StrCat("function '", name, "' is empty"));
  return RegisterAsyncFunction(name, [fn = std::move(fn)](CallContext& ctx, const Args& args) {
    return Future<c10::IValue>::Ready(fn(ctx, args));
  });
}

absl::Status Registry::RegisterAsyncFunction(const std::string& name, AsyncFunction fn) {
  RETURN_IF_ERROR(CheckNewName(name));
  if (!fn) return absl::InvalidArgumentError(absl::StrCat("function '", name, "' is empty"));
  functions_.emplace(name, std::move(fn));
  return absl::OkStatus();
}

absl::Status Registry::RegisterModuleType(const std::string& name, Factory factory,
                                          std::map<std::string, Method> methods) {
  RETURN_IF_ERROR(CheckNewName(name));
  for (const auto& [method, fn] : methods) {
    if (!base::IsValidRegisteredName(method)) {
      return absl::InvalidArgumentError(
          absl::StrCat("module '", name, "': invalid method name '", method, "'"));
    }
  }
  modules_.emplace(name, ModuleType{std::move(factory), std::move(methods)});
  return absl::OkStatus();
}

absl::Status Registry::MarkPrompt(const std::string& name) {
  if (functions_.count(name) == 0) {
    return absl::NotFoundError(absl::StrCat("no function '", name, "' to mark prompt"));
  }
  prompt_.insert(name);
  return absl::OkStatus();
}

bool Registry::IsPrompt(const std::string& name) const { return prompt_.count(name) > 0; }

bool Registry::Contains(const std::string& name) const {
  return functions_.count(name) > 0 || modules_.count(name) > 0;
}

Future<c10::IValue> Registry::Invoke(const std::string& name, CallContext& ctx,
                                     const Args& args) const {
  using Result = Future<c10::IValue>;
  if (auto it = functions_.find(name); it != functions_.end()) {
    try {
      return it->second(ctx, args);
    } catch (...) {
      return Result::Ready(base::StatusFromCurrentException(absl::StrCat("function '", name, "'")));
    }
  }
  if (auto it = modules_.find(name); it != modules_.end()) {
    try {
      std::shared_ptr<void> object = it->second.factory(ctx, args);
      if (!object) {
        return Result::Ready(absl::InternalError(
            absl::StrCat("module '", name, "': factory returned null")));
      }
      return Result::Ready(c10::IValue::make_capsule(
          c10::make_intrusive<RemoteObject>(name, std::move(object))));
    } catch (...) {
      return Result::Ready(
          base::StatusFromCurrentException(absl::StrCat("constructing module '", name, "'")));
    }
  }
  // (remora's own names come with the training group's functions: the
  // usual cause is a worker program that left them out.)
  const bool remoras = absl::StartsWith(name, "remora.");
  return Result::Ready(absl::NotFoundError(absl::StrCat(
      "no function or module named '", name, "' is registered; register it before the worker starts serving",
      remoras ? " (remora's own functions: call train::RegisterWorkerFunctions(registry) in the program's "
                "registration, the function it gives launch::WorkerMain)"
              : "")));
}

absl::StatusOr<c10::IValue> Registry::InvokeMethod(const c10::IValue& object,
                                                   const std::string& method,
                                                   CallContext& ctx,
                                                   const Args& args) const {
  RemoteObject* obj = AsRemoteObject(object);
  if (obj == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot call method '", method,
        "': the RRef does not hold a module (it holds a ", object.tagKind(), ")"));
  }
  auto type = modules_.find(obj->type());
  if (type == modules_.end()) {
    return absl::InternalError(absl::StrCat("module type '", obj->type(), "' vanished"));
  }
  auto m = type->second.methods.find(method);
  if (m == type->second.methods.end()) {
    std::vector<std::string> names;
    for (const auto& [n, fn] : type->second.methods) names.push_back(n);
    return absl::NotFoundError(absl::StrCat("module '", obj->type(), "' has no method '",
                                            method, "' (it has: ", absl::StrJoin(names, ", "),
                                            ")"));
  }
  try {
    base::MutexLock lock(obj->mutex());
    return m->second(obj->get<void>(), ctx, args);
  } catch (...) {
    return base::StatusFromCurrentException(
        absl::StrCat("method '", obj->type(), ".", method, "'"));
  }
}

}  // namespace remora::rpc
