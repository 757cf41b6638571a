// Agent::Impl: the agent's internals, shared by the files that implement
// them. Not part of the API; include only from rpc/.
//
//   server.cc        the gRPC service: reactors, authentication, dispatch,
//                    Responder
//   client.cc        outgoing calls: unary calls, the stream pool, replies
//   rendezvous.cc    the address book: join, peers, routes
//   shutdown.cc      the graceful protocol, ping, stopping
//   rref_requests.cc handlers of calls, fetches and RRef control messages
//   channel_requests.cc handlers of the CUDA channel's control messages
//   agent.cc         the public Agent and RRef methods
//
// Thread-safety: as documented per member; mutexes are taken in the order
// calls_mu_ -> Peer::stream_mu, mu_ -> Peer::stream_mu, never the other way.
// Ownership: the Agent owns its Impl; the Impl owns the pool, the channels,
// the server and the peers.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "base/mutex_lock.h"
#include "channel/devices.h"
#include "proto/rref.pb.h"
#include "rpc/agent.h"
#include "rpc/dispatch.h"
#include "rpc/link.h"
#include "rpc/message.h"
#include "rpc/responder.h"
#include "rpc/rref_context.h"
#include "rpc/stream.h"
#include "rpc/tls_credentials.h"
#include "rpc/thread_pool.h"

namespace remora::rpc {

// The gRPC method of unary calls; streams use kStreamMethod (rpc/stream.h).
inline constexpr char kUnaryMethod[] = "/remora.Agent/Call";

// Idle streams kept per peer (rpc/stream.h); each holds a call open on both
// sides.
inline constexpr size_t kMaxIdleStreams = 8;

std::chrono::system_clock::time_point DeadlineIn(absl::Duration d);

// gRPC settings of remora's client channels (`server` false) and servers
// (true), applied through `set(name, value)`.
void ApplyChannelArgs(const std::function<void(const char*, int)>& set, int max_message_bytes,
                      bool server);
void ApplyChannelArgs(grpc::ChannelArguments& args, int max_message_bytes);

// The distributed autograd context a request belongs to, or kNoContext.
int64_t ContextOf(const wire::Request& r);

// A member of the group as this agent reaches it.
struct Peer {
  base::WorkerInfo info;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> stub;
  channel::Route route;  // how large payloads reach it
  // Streams to it that no rpc_sync is using (AgentOptions::streams), at
  // most kMaxIdleStreams: a burst of callers does not keep its streams.
  // Taken inside Impl::calls_mu_ (GiveBack) and Impl::mu_ (CancelOutgoing),
  // never the other way round.
  mutable absl::Mutex stream_mu;
  mutable std::vector<std::unique_ptr<SyncStream>> idle_streams ABSL_GUARDED_BY(stream_mu);
  // The local link to it (rpc/link.h), once connected; null before, and
  // for good once a connect was refused (calls go over gRPC). A link that
  // closed is replaced at the next call, and kept in `closed_links`: its
  // reader may be the very thread asking. A peer that did not answer the
  // hello (stopped, say, which its keepalive closed the link for) is asked
  // again from `link_retry_at` on, gRPC carrying its calls meanwhile.
  mutable absl::Mutex link_mu;
  mutable std::shared_ptr<LinkClient> link ABSL_GUARDED_BY(link_mu);
  mutable bool link_refused ABSL_GUARDED_BY(link_mu) = false;
  mutable absl::Time link_retry_at ABSL_GUARDED_BY(link_mu) = absl::InfinitePast();
  mutable std::vector<std::shared_ptr<LinkClient>> closed_links ABSL_GUARDED_BY(link_mu);
};

// One outgoing call in flight, unary or on a stream.
struct ClientCall {
  std::unique_ptr<grpc::ClientContext> context;  // unary calls only
  grpc::ByteBuffer request;
  grpc::ByteBuffer response;
  Future<InMessage> done;
  std::vector<wire::ShmPayload> sent;        // segments to take back if it fails
  std::vector<wire::CudaPayload> cuda_sent;  // CUDA transfers, likewise
};

// Handler registrations of the request kinds that rpc/ owns, each in its
// subsystem's file.
absl::Status RegisterRRefRequests(Agent::Impl* impl);       // rref_requests.cc
absl::Status RegisterChannelRequests(Agent::Impl* impl);    // channel_requests.cc
absl::Status RegisterRendezvousRequests(Agent::Impl* impl); // rendezvous.cc
absl::Status RegisterShutdownRequests(Agent::Impl* impl);   // shutdown.cc

// For a request refused before its handler ran (`why`): when it is a
// remote() from a member with a valid result id, creates the result's owner
// RRef holding `why`, so that later users of that RRef get the creation
// error instead of waiting for a value. Anything else is left alone.
void FailRefusedRemote(Agent::Impl* impl, const wire::Request& request,
                       const absl::Status& why);  // rref_requests.cc

class Agent::Impl final : public grpc::CallbackGenericService,
                          public Responder::Server,
                          public ControlChannel {
 public:
  explicit Impl(Agent* agent);

  // --- ControlChannel (agent.cc) --------------------------------------------
  // Sends `request` (proto/request.h's MakeRequest) from this agent to
  // group member `dst`, retrying transport failures (control messages are
  // idempotent); an error reply completes the future with an error naming
  // `dst`. How a subsystem sends the request kinds it registered.
  Future<Empty> SendControl(base::WorkerId dst, wire::Request request) override;
  std::string NameOf(base::WorkerId id) const override { return agent_->NameOf(id); }
  bool IsKnown(base::WorkerId id) const override { return agent_->IsKnown(id); }

  // --- calls on RRefs (agent.cc), for RRef's methods ------------------------
  // Runs `method` of the module `rref` holds on its owner; with `result`,
  // keeps the value there as that RRef. With `blocking`, the reply is
  // waited for on this thread, as rpc_sync does.
  Future<c10::IValue> CallOnRRef(const RRef& rref, const std::string& method,
                                 std::vector<c10::IValue> args, CallOptions options,
                                 c10::intrusive_ptr<UserRRef> result, bool blocking = false);
  absl::StatusOr<RRef> RemoteOnRRef(const RRef& rref, const std::string& method,
                                    std::vector<c10::IValue> args, CallOptions options);
  Future<c10::IValue> Fetch(const UserRRef& rref, CallOptions options, bool blocking = false);

  // --- server (server.cc) ------------------------------------------------
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* ctx) override;
  // Entry point of every request (on a gRPC thread or a local link's
  // reader): parse, then handle on the pool (or a thread of its own for
  // CUDA payloads; or here, for a prompt function on a link's reader).
  void Dispatch(grpc::ByteBuffer buffer, std::shared_ptr<ReplySlot> slot);
  // Whether `buffer` is a call of a prompt function (Registry::MarkPrompt),
  // not a method's.
  bool IsPromptCall(const grpc::ByteBuffer& buffer) const;
  // Looks the request's kind up in `requests_` and runs its handler.
  void Handle(InMessage message, std::shared_ptr<Responder> responder);
  // The request's sender is a member of the group: waits up to
  // connect_timeout for this agent to join (Unavailable after), then
  // CheckSender.
  absl::Status CheckMember(const wire::Request& request);
  // Responder::Server.
  void SendReply(ReplySlot& slot, base::WorkerId to, OutMessage message) override;
  absl::Status EncodeReplyValue(base::WorkerId to, int64_t context_id, const c10::IValue& value,
                                OutMessage* message) override;
  const std::string& server_name() const override { return agent_->self_.name; }

  // --- client (client.cc) ------------------------------------------------
  // Sends a request as a unary call; the future completes on a gRPC
  // thread, or on this thread before returning when `blocking`.
  Future<InMessage> Transmit(grpc::GenericStub* stub, OutMessage message,
                             absl::Duration timeout, bool wait_for_ready,
                             bool blocking = false, const channel::Route& route = {});
  // Starts the local links' server (AgentOptions::local_links), when
  // this agent can use links; once the server listens and self_ is set.
  void ListenForLinks();
  // The local link to `peer`, connected on first use; null when calls to
  // it go over gRPC (another host, links off here, or its connect failed).
  std::shared_ptr<LinkClient> LinkTo(const Peer& peer);
  // Sends a request on `link`, as Transmit does on gRPC (never blocking).
  Future<InMessage> TransmitOnLink(LinkClient& link, const Peer& peer, OutMessage message,
                                   absl::Duration timeout);
  // Fails every call in flight on a local link (the agent is stopping).
  void CloseLinks();
  // Sends a request on a stream to `peer` (see rpc/stream.h) and waits for
  // the reply on this thread: what Transmit does when `blocking`.
  Future<InMessage> TransmitOnStream(const Peer& peer, OutMessage message,
                                     absl::Duration timeout);
  // Serializes `message` for `route` and registers the call; null once the
  // agent is stopping (the payloads are taken back). The caller sends
  // call->request, then calls FillAll(route, *fills).
  ClientCall* NewCall(OutMessage message, const channel::Route& route, std::vector<ShmFill>* fills);
  // Sends `call` (from NewCall) as a unary call, as Transmit does.
  Future<InMessage> SendUnary(grpc::GenericStub* stub, ClientCall* call, absl::Duration timeout,
                              bool wait_for_ready, bool blocking, const channel::Route& route,
                              std::vector<ShmFill>& fills);
  // Completes `call` with its reply (call->response, when `status` is OK)
  // or `status`, and forgets it.
  void FinishCall(ClientCall* call, base::WorkerId peer, const absl::Status& status);
  // Finishes `call` here, or on a thread of its own when its reply carries
  // CUDA payloads (see RunOwnThread).
  void FinishCallOffGrpc(ClientCall* call, base::WorkerId peer, const absl::Status& status);
  // An idle stream to `peer`, or a new one; registered as in use (null once
  // the agent is stopping).
  std::unique_ptr<SyncStream> TakeStream(const Peer& peer);
  // Puts a stream that `TakeStream` gave back among the idle ones, or drops
  // it when it cannot be used again.
  void GiveBack(const Peer& peer, std::unique_ptr<SyncStream> stream, bool reusable);
  // Sends a request to a group member; errors name it and `what` (e.g.
  // "function 'add'").
  Future<InMessage> SendTo(base::WorkerId dst, OutMessage message, absl::Duration timeout,
                           bool blocking = false, const std::string& what = "control message");
  // Sends `request` (from MakeRequest) to `dst` and waits for the reply.
  absl::Status SendAndWait(base::WorkerId dst, wire::Request request, absl::Duration timeout);
  // Turns a reply into a value (decoding RRefs) and completes `result`.
  void CompleteWithReply(const absl::StatusOr<InMessage>& reply, base::WorkerId from,
                         Future<c10::IValue> result);
  absl::Status ErrorFromReply(const wire::Response& response) const;
  // How messages name the peer `name`: "the master" (the book's id 0; before
  // there is a book, the name "master"), else "worker 'NAME'".
  std::string Who(const std::string& name) const;
  // Runs `call` (a CallRequest) on `dst`: encodes the arguments and `self`,
  // records autograd, sends, and decodes the reply into the result.
  Future<c10::IValue> Call(base::WorkerId dst, wire::CallRequest call,
                           std::vector<c10::IValue> args, const c10::IValue* self,
                           CallOptions options, c10::intrusive_ptr<UserRRef> result,
                           bool blocking = false);
  // Distributed autograd bookkeeping for a message received from / sent to
  // a peer (see rpc/autograd_hooks.h).
  absl::Status RecordRecv(const wire::AutogradMeta& meta, base::WorkerId from,
                          const std::vector<at::Tensor>& grad_tensors);
  void RecordSend(int64_t context_id, base::WorkerId dst, std::vector<at::Tensor> grad_tensors,
                  wire::AutogradMeta* meta);

  // --- the address book (rendezvous.cc) ------------------------------------
  // Whether an id belongs to the group (for rpc/request_checks.h).
  struct Membership {
    const Agent* agent;
    bool operator()(base::WorkerId id) const { return agent->IsKnown(id); }
  };
  absl::StatusOr<base::WorkerId> Resolve(const std::string& name) const;
  const Peer* FindPeer(base::WorkerId id) const;
  // Lets `ctx` send CUDA tensors to `to` (device maps, destinations in `m`).
  void SetDevices(base::WorkerId to, OutMessage* m, EncodeContext* ctx) const;
  // How large payloads reach `id` (inline when unknown).
  channel::Route RouteTo(base::WorkerId id) const;
  void SetBook(std::vector<base::WorkerInfo> book);
  // A member's new incarnation (a rejoin): its peer is replaced (the old
  // one is kept, unused, for calls that still hold it) and its shared
  // memory allowed in place of the old process's.
  void UpdatePeer(const base::WorkerInfo& info);
  // A peer for `info`: its channel, stub and route.
  std::unique_ptr<Peer> MakePeer(const base::WorkerInfo& info) const;
  // Master: tells every member but `info`'s and the lost ones that `info`
  // rejoined, waiting up to `timeout` for each (a member that does not
  // answer is left to the failure detection of the run).
  void AnnounceRejoin(const base::WorkerInfo& info, absl::Duration timeout);
  // Sends request `body` to every member but this agent, `except` and the
  // lost ones, and waits up to `timeout` for each; best effort: a member
  // that does not answer is gone, or the run's failure detection's to find.
  void TellMembers(const google::protobuf::Message& body, base::WorkerId except, absl::Duration timeout);
  void HandleJoin(const wire::JoinRequest& join, std::shared_ptr<Responder> responder);
  // Master, before the group forms: a process that tried to join was
  // refused (`who`: its name or address), and why: a name not expected or
  // a wrong token, which may be a missing worker's. Join gives up as soon
  // as as many have joined or been refused as it expects.
  void NoteRefused(const std::string& who, const std::string& why);
  // Master: Join. Waits until the group forms (every expected worker has
  // joined), or until nothing more can come or the connect timeout, and
  // then returns GiveUpJoining's error.
  absl::Status JoinAsMaster();
  // Master: the error Join returns when the group did not form (who is
  // missing, who was refused and why); the workers that did join are told
  // to exit with it.
  // `hint`: say how to start the missing workers.
  absl::Status GiveUpJoining(const absl::Status& why, bool hint = true);
  // Master, before the group formed: no group will form; the workers that
  // joined are told `text` (and `signal`, when one stopped the master) and
  // exit. False, telling none, when the group has formed.
  bool EndJoining(const std::string& text, int signal = 0);
  // Master: tells every worker the group has ended (ShutdownFinish; with
  // `error`, because the master failed or `signal` stopped it), waiting
  // up to `timeout` for each.
  void FinishWorkers(const std::string& error, absl::Duration timeout, int signal = 0);

  // --- channels (channel_requests.cc) --------------------------------------
  // REMORA_DEBUG=channels: the channel of each of this process's GPUs to `p`.
  void LogCudaChannels(const Peer& p) const;

  // --- stopping (shutdown.cc) ----------------------------------------------
  void HandleProbe(const wire::ShutdownProbe& probe, std::shared_ptr<Responder> responder);
  // Master: a worker's Ping, from the process `incarnation`; an error when
  // that process is no longer the group's `from` (declared lost, or
  // superseded by a new process under its name).
  absl::Status CheckPing(base::WorkerId from, const wire::Ping& ping);
  void CancelOutgoing();
  // The unary gRPC calls this agent's server has open (from the reactor's
  // creation to gRPC's OnDone, its reply sent), and a wait until none is,
  // or `deadline`.
  void UnaryCallOpened();
  void UnaryCallDone();
  void AwaitUnaryCallsDone(absl::Time deadline);
  void Stop();
  // Runs `task` on a thread of its own, or here once Stop() has begun. For
  // frames with CUDA payloads: receiving them waits for their transfers,
  // and NCCL posts a communicator's transfers in order, so frames waiting on
  // pool or gRPC threads could hold up the very frame they wait for (or the
  // replies a pool thread waits for).
  void RunOwnThread(std::function<void()> task);
  // Stops RunOwnThread from starting threads and waits for those running.
  void JoinOwnThreads();

  RRefContext* rrefs() const { return agent_->rrefs_.get(); }

  Agent* const agent_;
  const absl::Duration sync_spin_;  // see AgentOptions::sync_spin
  const bool streams_;              // see AgentOptions::streams
  const bool local_links_;          // AgentOptions::local_links, unless REMORA_LINKS=0
  const bool prompt_here_;          // Registry::MarkPrompt is heeded, unless REMORA_PROMPT=0
  const absl::Duration busy_poll_;  // see AgentOptions::busy_poll
  // Until Stop, which hands it to RetireForGood (futures made before the
  // stop still name it as their executor).
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<channel::ShmChannel> shm_;
  // Plaintext or TLS (AgentOptions::tls), for every channel to a peer.
  const std::shared_ptr<grpc::ChannelCredentials> channel_credentials_;
  std::unique_ptr<channel::CudaChannel> cuda_;
  channel::DeviceMapper devices_;  // set in Start, then read-only
  // Request kinds and their handlers; filled before the server starts
  // (and by Agent::requests() before Join), then read-only.
  DispatchTable requests_;
  std::unique_ptr<grpc::Server> server_;
  absl::Mutex unary_calls_mu_;
  int64_t unary_calls_ ABSL_GUARDED_BY(unary_calls_mu_) = 0;  // see UnaryCallOpened
  // Local links (AgentOptions::local_links): the server for its peers'
  // (set in Start, then read-only). Null when off or not listening, and
  // then this agent calls on none either.
  std::unique_ptr<LinkServer> link_server_;
  std::atomic<int64_t> calls_on_links_{0};
  std::atomic<int64_t> incoming_{0};
  std::atomic<int64_t> outgoing_{0};

  absl::Notification joined_;
  absl::Notification finished_;  // worker: the master ended the group
  absl::Mutex abort_mu_;
  // Worker: why the master ended the group, when it failed (Agent::Abort)
  // or a signal stopped it (that signal).
  std::string abort_error_ ABSL_GUARDED_BY(abort_mu_);
  int abort_signal_ ABSL_GUARDED_BY(abort_mu_) = 0;
  // Worker: why this process must be restarted (Agent::RequireRestart).
  absl::Status restart_ ABSL_GUARDED_BY(abort_mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);  // index = id
  std::map<std::string, base::WorkerId> ids_ ABSL_GUARDED_BY(mu_);
  // Peers replaced by a rejoin: kept, since calls may still hold them.
  std::vector<std::unique_ptr<Peer>> retired_peers_ ABSL_GUARDED_BY(mu_);

  // Master: workers that registered, by name.
  struct Joiner {
    std::string address;
    std::string host_id;
    base::ShmEndpoint shm;
    std::shared_ptr<Responder> responder;
    base::CudaEndpoint cuda;
    std::string device;
  };
  absl::Mutex join_mu_;
  std::map<std::string, Joiner> joiners_ ABSL_GUARDED_BY(join_mu_);
  // Addresses told their name is a live member's (said once each).
  std::set<std::string> told_waiting_ ABSL_GUARDED_BY(join_mu_);
  bool formed_ ABSL_GUARDED_BY(join_mu_) = false;
  bool gave_up_ ABSL_GUARDED_BY(join_mu_) = false;
  absl::Status stop_joining_ ABSL_GUARDED_BY(join_mu_);  // Agent::StopJoining's why
  int gave_up_signal_ ABSL_GUARDED_BY(join_mu_) = 0;  // EndJoining's: a signal stopped the master
  std::vector<base::WorkerInfo> book_ ABSL_GUARDED_BY(join_mu_);
  // Refused joiners (who -> why), before the group formed.
  std::map<std::string, std::string> refused_ ABSL_GUARDED_BY(join_mu_);
  // Second processes under a registered name (address -> name), before the
  // group formed: not counted as refused (the name's worker is here), but
  // said if the group never forms.
  std::map<std::string, std::string> duplicates_ ABSL_GUARDED_BY(join_mu_);
  // Master: workers lost (Agent::MarkLost) and not registered again.
  std::set<std::string> lost_ ABSL_GUARDED_BY(join_mu_);
  // Lost workers whose new process is being announced to the group.
  std::set<std::string> rejoining_ ABSL_GUARDED_BY(join_mu_);

  absl::Mutex calls_mu_;
  absl::flat_hash_set<ClientCall*> calls_ ABSL_GUARDED_BY(calls_mu_);
  // Requests this agent sent, by kind (see Agent::sent_messages).
  mutable absl::Mutex sent_mu_;
  std::map<std::string, int64_t> sent_ ABSL_GUARDED_BY(sent_mu_);
  absl::flat_hash_set<SyncStream*> streams_in_use_ ABSL_GUARDED_BY(calls_mu_);
  std::atomic<int64_t> streams_opened_{0};
  bool stopped_ = false;

  // Streams peers opened to this agent's server; closed (and no new ones
  // taken) when it stops, which would otherwise wait for them.
  absl::Mutex server_streams_mu_;
  absl::flat_hash_set<std::shared_ptr<ServerStream::State>> server_streams_
      ABSL_GUARDED_BY(server_streams_mu_);
  bool server_streams_closed_ ABSL_GUARDED_BY(server_streams_mu_) = false;

  // Threads started by RunOwnThread and not yet done. Shared with them, so
  // that a finishing thread never touches the Impl after Stop() saw zero.
  struct OwnThreads {
    absl::Mutex mu;
    int running ABSL_GUARDED_BY(mu) = 0;
    bool closed ABSL_GUARDED_BY(mu) = false;
  };
  std::shared_ptr<OwnThreads> own_threads_ = std::make_shared<OwnThreads>();
};

}  // namespace remora::rpc
