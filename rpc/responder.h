// How a request handler answers: a Responder replies exactly once, with a
// message, an error naming this worker, or a value (encoded for the caller:
// RRefs forked, tensors routed to its channel, autograd recorded).
//
// Thread-safety: a responder is used by one handler at a time (it may pass
// between threads, as callbacks do). Ownership: shared by the handler's
// callbacks; dropping the last reference without a reply answers with an
// internal error, so a caller never waits for a reply that will not come.
#pragma once

#include <memory>
#include <string>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "base/ids.h"
#include "rpc/autograd_hooks.h"
#include "rpc/message.h"
#include "rpc/stream.h"

namespace remora::rpc {

class Responder {
 public:
  // What a responder needs of the agent serving the request (Agent::Impl).
  class Server {
   public:
    virtual ~Server() = default;
    // Serializes `message` for the route to `to`, sends it on `slot`, and
    // takes back out-of-band payloads the caller will never read.
    virtual void SendReply(ReplySlot& slot, base::WorkerId to, OutMessage message) = 0;
    // Encodes `value` into `message` as the reply to `to`, recording the
    // send in distributed autograd context `context_id` (or none).
    virtual absl::Status EncodeReplyValue(base::WorkerId to, int64_t context_id,
                                          const c10::IValue& value, OutMessage* message) = 0;
    // This worker's name, for errors.
    virtual const std::string& server_name() const = 0;
  };

  Responder(std::shared_ptr<ReplySlot> slot, Server* server, base::WorkerId to)
      : slot_(std::move(slot)), server_(server), to_(to) {}
  ~Responder();
  Responder(const Responder&) = delete;
  Responder& operator=(const Responder&) = delete;

  void Reply(OutMessage message);
  // `signal`: Error.signal (a master stopped by it refusing a join).
  void ReplyError(const absl::Status& status, int signal = 0);
  // An empty reply when `status` is OK, else the error.
  void ReplyStatus(const absl::Status& status);
  void ReplyValue(absl::StatusOr<c10::IValue> value);
  base::WorkerId to() const { return to_; }
  // The distributed autograd context the reply belongs to (a context id,
  // kNoContext when none).
  void set_context(int64_t context_id) { context_id_ = context_id; }

 private:
  std::shared_ptr<ReplySlot> slot_;
  Server* server_;
  base::WorkerId to_;
  int64_t context_id_ = kNoContext;
  bool replied_ = false;
};

}  // namespace remora::rpc
