// Remote references (RRefs) and their reference counting.
//
// An RRef names a value that lives on one worker, its owner. The owner holds
// an OwnerRRef with the value (or a pending value, or the error that creating
// it raised); every other process that holds the RRef holds a UserRRef, one
// per fork: each time an RRef is sent to a process, the receiver becomes a
// new user with a new fork id. The rules are PyTorch's:
//
//  * remote() creates a user at once (its rref id is its fork id); the owner
//    records that fork when the call arrives and confirms it when the value
//    is made (or stores the error).
//  * Sending a user to another process: the sender keeps its user alive as a
//    "pending child" until the receiver accepts it (ChildAccept). A receiver
//    that is not the owner tells the owner (ForkRequest) and uses the RRef
//    only once the owner acknowledged. Sending an owner RRef records the
//    fork directly.
//  * A user that is destroyed tells the owner (UserDelete). The owner frees
//    the value when its last recorded fork is deleted.
//  * Every control message is idempotent, retried on transport errors, and
//    correct in any arrival order; a fetch (to_here) that reaches the owner
//    before the value exists waits for it.
//
// Internal to rpc/ (the public RRef is in rpc/rref.h).
//
// Thread-safety: RRefContext is safe to use from any thread. Ownership: the
// agent owns the RRefContext (through a shared_ptr that every UserRRef also
// holds, so a user that outlives the agent deletes itself quietly).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/agent.pb.h"
#include "rpc/codec.h"
#include "rpc/future.h"
#include "base/ids.h"
#include "rpc/rref.h"

namespace remora::rpc {

class Agent;
class RRefContext;

// Held by a request that waits on an owner RRef of this worker: a method
// call or a fetch, from when it commits to waiting (for the value, for its
// turn on a lane) until it has been answered or starts running
// (RRefContext::StartWaiting). The agent's stop waits for every ticket to
// be done before its server stops, so that what it answered while
// stopping (RRefContext::AbandonWaiting) reaches the caller.
//
// Thread-safety: Done() may be called from any thread, any number of
// times; the first counts. Ownership: shared by the request's callbacks;
// the last one to go calls Done() (a request dropped unanswered is
// answered by its Responder as it goes).
class WaitTicket {
 public:
  struct Count {
    absl::Mutex mu;
    int64_t waiting ABSL_GUARDED_BY(mu) = 0;
  };
  explicit WaitTicket(std::shared_ptr<Count> count);
  ~WaitTicket() { Done(); }
  WaitTicket(const WaitTicket&) = delete;
  WaitTicket& operator=(const WaitTicket&) = delete;

  // The request has been answered, or starts running: it waits no more.
  void Done();

 private:
  const std::shared_ptr<Count> count_;
  std::atomic<bool> done_{false};
};

// The owner's side: the value itself, possibly still being made.
class OwnerRRef final : public RRefImpl {
 public:
  OwnerRRef(base::WorkerId owner, std::string owner_name, base::RRefId id,
            std::weak_ptr<RRefContext> ctx, Executor* executor)
      : RRefImpl(owner, std::move(owner_name), id, std::move(ctx)), value_(executor) {}

  bool isOwner() const override { return true; }
  bool confirmedByOwner() const override { return true; }

  // Completes when the value exists, or with the error creating it raised.
  const Future<c10::IValue>& value() const { return value_; }
  void SetValue(absl::StatusOr<c10::IValue> value) { value_.Complete(std::move(value)); }

  // Runs `fn` after every call with a lower `seq` on the same lane ran (a
  // lane is one caller's user RRef; seq counts from 1). seq 0: at once.
  //
  // A call that never arrives (its caller's request failed in transport)
  // must not stop the lane for good: once calls have waited behind a gap for
  // `gap_timeout` (the caller has given up on the missing one by then), the
  // next arrival on the lane skips the gap and the waiting calls run in
  // order. A call that arrives after its turn was skipped runs at once.
  void RunInOrder(base::WorkerId caller, const base::ForkId& lane, uint64_t seq, std::function<void()> fn,
                  absl::Duration gap_timeout = absl::Seconds(60), absl::Time now = absl::Now());

  // When the owner stops: a value still being made fails with `why` (the
  // calls and fetches waiting for it get that error), and calls waiting
  // behind a gap on a lane are dropped (their callers get an error reply).
  void Abandon(const absl::Status& why);

 private:
  struct Lane {
    uint64_t next = 1;
    std::map<uint64_t, std::function<void()>> waiting;
    absl::Time gap_since;  // when calls started waiting behind the gap
    bool running = false;  // a thread is running this lane's calls
  };

  Future<c10::IValue> value_;
  absl::Mutex lanes_mu_;
  absl::flat_hash_map<std::pair<base::WorkerId, base::ForkId>, Lane> lanes_ ABSL_GUARDED_BY(lanes_mu_);
  bool abandoned_ ABSL_GUARDED_BY(lanes_mu_) = false;  // Abandon ran: nothing parks
};

// A user's side: one fork of a value that lives on `owner`.
class UserRRef final : public RRefImpl {
 public:
  UserRRef(base::WorkerId owner, std::string owner_name, base::RRefId id, base::ForkId fork,
           std::shared_ptr<RRefContext> ctx);
  ~UserRRef() override;

  bool isOwner() const override { return false; }
  bool confirmedByOwner() const override { return confirmed_.ready(); }

  const base::ForkId& fork_id() const { return fork_id_; }
  // Completes when the owner confirmed this user; an error when creating the
  // value failed (remote()) or the owner could not be told (fork).
  const Future<Empty>& confirmed() const { return confirmed_; }
  void Confirm(absl::Status status);
  RRefContext& context() const { return *ctx_; }
  // The sequence number of the next method call made through this user.
  uint64_t NextCallSeq() { return call_seq_.fetch_add(1) + 1; }

 private:
  std::atomic<uint64_t> call_seq_{0};
  const base::ForkId fork_id_;
  const std::shared_ptr<RRefContext> ctx_;
  Future<Empty> confirmed_;
};

// How the RRef layer sends its control messages. Implemented by the agent.
class ControlChannel {
 public:
  virtual ~ControlChannel() = default;
  // Sends `request` to `dst`, retrying transport failures; the future holds
  // the outcome.
  virtual Future<Empty> SendControl(base::WorkerId dst, wire::Request request) = 0;
  // The name of worker `id` (for RRef owner names and messages).
  virtual std::string NameOf(base::WorkerId id) const = 0;
  // Whether `id` is a member of the group.
  virtual bool IsKnown(base::WorkerId id) const = 0;
};

class RRefContext final : public RRefHooks,
                          public std::enable_shared_from_this<RRefContext> {
 public:
  RRefContext(base::WorkerId self, Agent* agent, ControlChannel* channel, Executor* executor);

  base::WorkerId self() const { return self_; }
  // Null once detached.
  Agent* agent() const;
  Executor* executor() const { return executor_; }

  // A new globally unique id created by this worker.
  base::GloballyUniqueId NewId();

  // --- creating RRefs --------------------------------------------------
  // An owner RRef over a value this process holds (PyTorch's RRef(value)).
  c10::intrusive_ptr<OwnerRRef> CreateLocal(c10::IValue value);
  // The user for a remote() to `owner`, pending until the owner confirms.
  c10::intrusive_ptr<UserRRef> CreateUserForRemote(base::WorkerId owner);

  // --- owner side ------------------------------------------------------
  // The owner RRef `id`, made as a placeholder (value pending) when absent.
  c10::intrusive_ptr<OwnerRRef> GetOrCreateOwner(const base::RRefId& id);
  // The owner RRef `id`, or null.
  c10::intrusive_ptr<OwnerRRef> FindOwner(const base::RRefId& id);
  void AddFork(const base::RRefId& id, const base::ForkId& fork);
  bool HasFork(const base::RRefId& id, const base::ForkId& fork) const;
  // Records that user `fork` of `id` is gone; frees the value after the last.
  absl::Status DeleteFork(const base::RRefId& id, const base::ForkId& fork);

  // --- user / parent side ----------------------------------------------
  void AcceptChild(const base::ForkId& fork);
  // The owner answered about user `fork` (remote() reply or fork request):
  // confirms it, or stores the error on it.
  void FinishPendingUser(const base::ForkId& fork, absl::Status status);
  // Called by ~UserRRef: tells the owner, unless already released.
  void OnUserDestroyed(const UserRRef& user);

  // --- codec hooks -----------------------------------------------------
  absl::Status ForkForSend(const c10::IValue& rref, base::WorkerId dst,
                           wire::RRefMeta* out) override;
  absl::StatusOr<c10::IValue> Receive(const wire::RRefMeta& meta,
                                      std::vector<Future<Empty>>* pending) override;

  // --- shutdown --------------------------------------------------------
  // Deletes every user this process still holds (as if destroyed).
  void ReleaseAllUsers();
  // Member `peer` is gone for good (Agent::MarkLost): forks sent to it or
  // of its values are no longer waited for, and users of its values that it
  // never confirmed fail with `why`, so that draining does not wait for it.
  void ForgetPeer(base::WorkerId peer, const absl::Status& why);
  // Waits until no control message, pending user or pending child remains.
  absl::Status WaitDrained(absl::Duration timeout);
  // After this, destroyed users send nothing (the group is gone).
  void Detach();
  // Abandons every owner's pending value and waiting calls with `why` (see
  // OwnerRRef::Abandon), and every owner made later at once: no request
  // waits on this worker past its stop.
  void AbandonWaiting(const absl::Status& why);
  // A ticket for a request that starts waiting on an owner here (see
  // WaitTicket); counted in stats().waiting_requests until done.
  std::shared_ptr<WaitTicket> StartWaiting();
  // Waits up to `timeout` until no request waits on an owner here (after
  // AbandonWaiting: until every waiting request has been answered, which
  // its callback does on the executor). False when some still wait.
  bool AwaitNoneWaiting(absl::Duration timeout);
  bool detached() const;

  RRefStats stats() const;

 private:
  // Whether value `id`, created by this worker, still exists here (or is
  // still being made by a remote() to itself).
  bool KnowsOwnValue(const base::RRefId& id) const;
  // Sends a control message and counts it until it completes.
  Future<Empty> Send(base::WorkerId dst, wire::Request request);
  bool drained() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const base::WorkerId self_;
  Agent* const agent_;
  ControlChannel* const channel_;
  Executor* const executor_;
  std::atomic<uint64_t> next_id_{1};

  mutable absl::Mutex mu_;
  absl::flat_hash_map<base::RRefId, c10::intrusive_ptr<OwnerRRef>> owners_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<base::RRefId, absl::flat_hash_set<base::ForkId>> forks_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<base::ForkId, c10::intrusive_ptr<UserRRef>> pending_users_ ABSL_GUARDED_BY(mu_);
  // Forks of users sent on, until the receiver accepts them: the RRef and
  // where it went.
  struct PendingChild {
    c10::intrusive_ptr<RRefImpl> rref;
    base::WorkerId to = base::kUnknownWorker;
  };
  absl::flat_hash_map<base::ForkId, PendingChild> pending_children_ ABSL_GUARDED_BY(mu_);
  // Users alive here, not yet deleted (raw: each removes itself when destroyed).
  absl::flat_hash_map<base::ForkId, const UserRRef*> live_users_ ABSL_GUARDED_BY(mu_);
  int64_t pending_messages_ ABSL_GUARDED_BY(mu_) = 0;
  bool detached_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status abandoned_ ABSL_GUARDED_BY(mu_);  // AbandonWaiting's reason, once it ran
  // Requests waiting on owners here (StartWaiting's tickets); shared with
  // the tickets, which may outlive this context in callbacks never run.
  const std::shared_ptr<WaitTicket::Count> waiting_ = std::make_shared<WaitTicket::Count>();
};

wire::Guid ToWire(const base::GloballyUniqueId& id);
base::GloballyUniqueId FromWire(const wire::Guid& id);

}  // namespace remora::rpc
