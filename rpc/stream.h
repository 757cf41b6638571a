// Streams for blocking calls (rpc_sync, RRef::rpc_sync, to_here): a caller
// that waits for its reply reuses a long-lived gRPC stream to the peer
// instead of opening a unary call.
//
// A unary call opens an HTTP/2 stream, sends headers, the request and
// trailers, and tears the stream down again. On a stream that is already
// open, a call is one message each way, and the waiting thread drives the
// stream's own completion queue itself, so the reply wakes no other thread
// on the way (the rpc_bench figures are in docs/measurements.md).
//
//   caller (SyncStream, one call at a time)     callee (ServerStream)
//   Call(frame) ------------ [id|frame] ------>  read; dispatch(frame, slot)
//     polls its completion queue                 handler runs on the pool
//   <- reply -------------- [id|reply] -------  slot->Reply(reply); next read
//
// Every message is a frame (rpc/message.h) behind the 8-byte id of its call
// (TagFrame); a reply carries its request's id back. A stream carries one
// call at a time: the callee reads the next request only after the reply
// to this one is written, and the caller sends only after its last reply
// came. Streams are pooled per peer; a stream whose call failed or timed
// out is cancelled and dropped, never reused.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace remora::rpc {

// The gRPC method of streams (unary calls use "/remora.Agent/Call").
inline constexpr char kStreamMethod[] = "/remora.Agent/Stream";

// Where a handler's reply goes: a unary call, or a stream with the call's id.
class ReplySlot {
 public:
  virtual ~ReplySlot() = default;
  // Sends `frame` as the reply. False when it cannot go (the call was
  // cancelled, its stream ended, or a reply went already).
  virtual bool Reply(grpc::ByteBuffer frame) = 0;
};

// Takes the next event of `cq`, polling for up to `spin` before sleeping,
// and giving up at `deadline`: how a blocking caller waits for its reply.
grpc::CompletionQueue::NextStatus NextPolling(grpc::CompletionQueue* cq, absl::Duration spin,
                                              absl::Time deadline, void** tag, bool* ok);

// The caller's end of one stream. Used by one thread at a time (the pool of
// streams hands it out); Cancel() may be called from any thread.
// Ownership: the caller owns it; destroying it cancels the stream and
// waits for gRPC to let go of it.
class SyncStream {
 public:
  // Opens a stream on `stub` (the stub's channel must outlive it), with
  // `token` as the kTokenHeader metadata when not empty.
  static std::unique_ptr<SyncStream> Open(grpc::GenericStub* stub, const std::string& token);
  ~SyncStream();
  SyncStream(const SyncStream&) = delete;
  SyncStream& operator=(const SyncStream&) = delete;

  // False once the stream cannot carry another call: a call on it failed,
  // or the callee ended it while it sat idle (its next read failed).
  bool usable();

  // Sends `frame`, runs `sent` (the request is on its way), and waits for
  // the reply until `deadline`, polling for `spin` before each sleep. On
  // any error the stream is unusable afterwards.
  absl::StatusOr<grpc::ByteBuffer> Call(const grpc::ByteBuffer& frame,
                                        const std::function<void()>& sent, absl::Time deadline,
                                        absl::Duration spin);

  // Ends the stream from any thread: a call waiting on it fails.
  void Cancel() { context_.TryCancel(); }

 private:
  SyncStream() = default;
  // Takes one event off cq_ (see NextPolling) and clears its op from
  // pending_; marks the stream broken when the op failed.
  grpc::CompletionQueue::NextStatus Step(absl::Duration spin, absl::Time deadline);
  // Steps until none of `ops` is in flight. False when the stream broke or
  // `deadline` passed (then *timed_out).
  bool Await(unsigned ops, absl::Duration spin, absl::Time deadline, bool* timed_out);
  // Collects the call's status (cancelling it first when `cancel`) and
  // waits until no op is in flight; returns the status.
  absl::Status End(bool cancel);

  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  grpc::ByteBuffer out_;  // the request in flight
  grpc::ByteBuffer in_;   // the reply being read
  uint64_t next_id_ = 1;
  grpc::Status final_status_;  // filled by Finish (in End)
  // Ops started and not yet seen on cq_, one bit each (see stream.cc).
  unsigned pending_ = 0;
  bool broken_ = false;  // an op failed, or a reply came out of turn
  bool ended_ = false;   // End() ran
};

// The callee's end of a stream: reads a request, hands it to `dispatch`
// with a slot for the reply, writes the reply, and only then reads the
// next request (one call at a time). Close() ends the stream once the call
// in hand, if any, has had its reply written (an agent stopping).
//
// Thread-safety: Close() and the slots may be used from any thread.
// Ownership: gRPC owns the reactor (it deletes itself when done); the state
// that slots and the agent hold outlives it.
class ServerStream final : public grpc::ServerGenericBidiReactor {
 public:
  using Dispatch = std::function<void(grpc::ByteBuffer frame, std::shared_ptr<ReplySlot> slot)>;
  class State;

  // `on_done` runs when gRPC is done with the stream (the agent forgets it).
  ServerStream(Dispatch dispatch, std::function<void(const std::shared_ptr<State>&)> on_done);

  const std::shared_ptr<State>& state() const { return state_; }
  // Ends the stream with `status` once the reply in hand is written.
  static void Close(const std::shared_ptr<State>& state, const grpc::Status& status);

  // gRPC's reactions.
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  const Dispatch dispatch_;
  const std::function<void(const std::shared_ptr<State>&)> on_done_;
  std::shared_ptr<State> state_;
};

}  // namespace remora::rpc
