// Local links: calls between two agents on one host over a Unix-domain
// socket, beside gRPC.
//
// An asynchronous gRPC call between two processes of one machine opens an
// HTTP/2 stream, and its request and reply each wake a gRPC poller thread
// on the receiving side, which hands the frame on to the thread that works
// on it (docs/measurements.md, "A stage boundary, hop by hop": 255-348 us a
// message one way on the 2-core VM, where a whole `rpc_sync` round trip
// takes about 75 us). A link carries the same frames (rpc/message.h) on one
// connected socket: the caller writes its request on its own thread, one
// reader thread on the callee takes it off the socket and hands it to the
// agent's dispatch, and the reply comes back on the same socket to the
// caller's reader thread.
//
//   caller (LinkClient)                         callee (LinkServer)
//   Send(frame, deadline, done) --[request id|frame]-->  reader: dispatch(frame, slot)
//   reader: done(reply)  <-------[reply id|frame]-----  slot->Reply(frame), any thread
//
// The callee listens on an abstract socket named for its process
// (LinkName: its pid and incarnation, which peers of its host know from the
// rendezvous); a connection starts with a hello that carries the group's
// token (rpc/auth.h), checked as gRPC's metadata is. Requests and replies
// travel in any order, matched by call id. When the callee's process ends,
// its sockets close with it and the calls in flight fail at once;
// deadlines are checked by the caller's reader at least every 100 ms,
// also while it waits for the rest of a record. A peer that is alive but
// stopped (SIGSTOP), hung or paused keeps its socket open; the caller's
// reader finds it as gRPC's keepalive does: while calls are in flight and
// nothing has come for kKeepaliveTime, it sends a ping, which the peer's
// reader answers at once; no answer (or, while a write is stuck, no byte
// taken) within kKeepaliveTimeout more closes the link and fails its calls.
// Anything a link cannot do (another host, TLS, a peer without a link
// server) goes over gRPC as before: the agent falls back on a connect that
// fails.
//
// Thread-safety: all methods may be called from any thread. Ownership: the
// agent owns its LinkServer, and per peer its LinkClient (a shared_ptr: a
// sender holds it while it writes; a closed one is kept until the agent
// goes, since its reader may be the thread that finds it closed). Each
// object joins its own threads when destroyed.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/ids.h"
#include "rpc/stream.h"

namespace remora::rpc {

// Whether this thread is a link server's reader: requests for prompt
// functions (Registry::MarkPrompt) run on it.
bool OnLinkReader();

// The abstract socket name of the link server of the agent with shared
// memory endpoint `e` (its leading NUL included).
std::string LinkName(const base::ShmEndpoint& e);

// The caller's end of a link to one peer.
class LinkClient {
 public:
  // The keepalive's timing, remora's gRPC channels' too (rpc/client.cc),
  // so that a stopped peer fails a call on a link as soon as one on gRPC.
  static constexpr absl::Duration kKeepaliveTime = absl::Seconds(1);
  static constexpr absl::Duration kKeepaliveTimeout = absl::Seconds(2);

  // Runs once per call with its reply frame or why it failed.
  using Done = std::function<void(absl::StatusOr<grpc::ByteBuffer>)>;

  // Connects to the link server at `name` and says hello with `token`;
  // an error when nothing listens there or the server refused the hello
  // (Unavailable), or did not answer it within `timeout` (DeadlineExceeded:
  // its process may be stopped, and may answer later).
  // `busy_poll`: how long the reader, between replies, keeps looking for
  // the next one (yielding the core) before it sleeps in poll().
  static absl::StatusOr<std::shared_ptr<LinkClient>> Connect(const std::string& name,
                                                             const std::string& token,
                                                             absl::Duration timeout,
                                                             absl::Duration busy_poll = absl::ZeroDuration());
  // Fails the calls still in flight (Cancelled) and joins the reader.
  ~LinkClient();
  LinkClient(const LinkClient&) = delete;
  LinkClient& operator=(const LinkClient&) = delete;

  // Sends `frame` as a request; `done` runs exactly once: with the reply,
  // on the reader's thread; with DeadlineExceeded after `deadline`; with
  // Unavailable when the link closes first (on this thread when it is
  // closed already). Never blocks on the reply.
  void Send(const grpc::ByteBuffer& frame, absl::Time deadline, Done done);
  // False once the link closed (the peer ended, or Close).
  bool alive() const { return !closed_.load(); }
  // Closes the link: every call in flight fails with `why`.
  void Close(const absl::Status& why);

 private:
  struct Pending {
    absl::Time deadline;
    Done done;
  };
  LinkClient(int fd, absl::Duration busy_poll) : fd_(fd), busy_poll_(busy_poll) {}
  void ReadLoop();
  // Reads exactly `n` bytes, failing the calls past their deadline (checked
  // when `*next_expiry` has come) while it waits; false when the link
  // closed or failed.
  bool Receive(void* out, size_t n, absl::Time* next_expiry);
  // Fails the calls past their deadline.
  void Expire(absl::Time now);
  // The keepalive, run by the reader while it waits for bytes: pings a
  // quiet peer that owes replies, and closes the link when it does not
  // answer in time.
  void WatchPeer(absl::Time now);

  const int fd_;
  const absl::Duration busy_poll_;
  std::atomic<bool> closed_{false};
  absl::Mutex write_mu_;  // one record on the socket at a time
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Status closed_why_ ABSL_GUARDED_BY(mu_);
  // Bytes of requests written so far: a write that is stuck on a peer
  // that takes none tells the keepalive so.
  std::atomic<uint64_t> sent_bytes_{0};
  // The keepalive's state, the reader's alone: whether bytes came since it
  // last looked (every 100 ms while it waits), since when none have, when
  // the unanswered ping went (InfiniteFuture when none), and sent_bytes_
  // as the reader last saw it.
  bool heard_ = false;
  absl::Time quiet_since_ = absl::Now();
  absl::Time ping_sent_ = absl::InfiniteFuture();
  uint64_t sent_seen_ = 0;
  std::thread reader_;
};

// The callee's end: listens for links from the peers of this host.
class LinkServer {
 public:
  // Hands a request frame to the agent, with the slot for its reply.
  using Dispatch = std::function<void(grpc::ByteBuffer frame, std::shared_ptr<ReplySlot> slot)>;

  // Listens on `name`; every hello must carry `token` (none when empty).
  // A caller refused (a wrong token) is closed without a word: it goes
  // over gRPC, whose refusal says why. `busy_poll`: how long each link's
  // reader, between requests, keeps looking for the next one (yielding the
  // core) before it sleeps.
  static absl::StatusOr<std::unique_ptr<LinkServer>> Listen(const std::string& name,
                                                            std::string token, Dispatch dispatch,
                                                            absl::Duration busy_poll = absl::ZeroDuration());
  ~LinkServer();  // Stop(absl::ZeroDuration())
  LinkServer(const LinkServer&) = delete;
  LinkServer& operator=(const LinkServer&) = delete;

  // Takes no new links or requests, waits up to `grace` for the replies to
  // the requests being handled, then closes every link (their callers' calls
  // in flight fail) and joins the threads. Later replies are dropped (their
  // slots say so). Idempotent.
  void Stop(absl::Duration grace);

 private:
  struct Conn;
  class Slot;
  LinkServer(int fd, std::string token, Dispatch dispatch, absl::Duration busy_poll)
      : fd_(fd), token_(std::move(token)), dispatch_(std::move(dispatch)), busy_poll_(busy_poll) {}
  void AcceptLoop();
  void Serve(std::shared_ptr<Conn> conn);

  const int fd_;
  const std::string token_;
  const Dispatch dispatch_;
  const absl::Duration busy_poll_;
  std::atomic<bool> stopping_{false};
  absl::Mutex mu_;
  std::vector<std::shared_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread acceptor_;
};

}  // namespace remora::rpc
