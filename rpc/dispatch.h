// The agent's dispatch table: which handler serves each kind of request.
//
// A request's kind is the full protobuf name of its body message
// (wire::Request.kind and .body, proto/agent.proto). The subsystem that owns
// a message registers its handler here; the agent looks the kind up for every
// request it serves. Adding a request kind therefore touches only the
// subsystem's .proto file and its handler file, never the agent:
//
//   table.Register<wire::ForkRequest>(
//       [](Incoming<wire::ForkRequest> in, std::shared_ptr<Responder> r) {
//         ... in.body.rref_id() ...
//         r->Reply(OutMessage{});
//       });
//
//   agent.SendControl(dst, MakeRequest(fork_request));  // the sending side
//
// Handlers run on the agent's thread pool, never on gRPC's threads, and
// answer through their Responder exactly once (rpc/responder.h). Before a
// handler runs, the agent has checked that the sender belongs to the group
// (except for kinds registered with `before_join`, which rendezvous serves).
//
// Thread-safety: thread-safe. A kind registered after the agent started
// serving (Agent::requests() before Join()) is unknown to requests that
// came before. Entries are never removed, so what Find() returns stays
// valid as long as the table. Ownership: the agent owns its table; handlers
// are copied in.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/mutex_lock.h"
#include "proto/request.h"
#include "rpc/message.h"
#include "rpc/responder.h"

namespace remora::rpc {

// A request as its handler receives it: the sender, the parsed body, and
// the whole message (its header's autograd metadata, and the payloads that
// the body's tensors refer to).
template <typename Body>
struct Incoming {
  base::WorkerId from = base::kUnknownWorker;
  Body body;
  InMessage message;
};

class DispatchTable {
 public:
  using Handler = std::function<void(InMessage message, std::shared_ptr<Responder> responder)>;
  struct Entry {
    Handler handler;
    // Served before this process joined the group, from senders it does
    // not know yet (rendezvous).
    bool before_join = false;
  };

  // Registers the handler of requests whose body is a `Body`; fails when
  // that kind has a handler already.
  template <typename Body, typename F>
  absl::Status Register(F handler, bool before_join = false) {
    Handler raw = [handler = std::move(handler)](InMessage message,
                                                 std::shared_ptr<Responder> responder) {
      auto body = wire::RequestBody<Body>(message.header.request());
      if (!body.ok()) return responder->ReplyError(body.status());
      Incoming<Body> in{static_cast<base::WorkerId>(message.header.request().from()),
                        std::move(*body), std::move(message)};
      handler(std::move(in), std::move(responder));
    };
    return Add(Body::descriptor()->full_name(), Entry{std::move(raw), before_join});
  }

  // The entry of `kind`, or null.
  const Entry* Find(const std::string& kind) const {
    base::MutexLock lock(mu_);
    auto it = entries_.find(kind);
    return it == entries_.end() ? nullptr : &it->second;
  }

 private:
  absl::Status Add(const std::string& kind, Entry entry) {
    base::MutexLock lock(mu_);
    if (!entries_.emplace(kind, std::move(entry)).second) {
      return absl::AlreadyExistsError(
          absl::StrCat("request kind '", kind, "' already has a handler"));
    }
    return absl::OkStatus();
  }

  mutable absl::Mutex mu_;
  // A node map: entries stay where they are when others are added.
  absl::node_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace remora::rpc
