#include "rpc/rref.h"

#include "rpc/rref_context.h"

#include <set>

#include <ATen/core/jit_type.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/request.h"
#include "proto/rref.pb.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"

namespace remora::rpc {

wire::Guid ToWire(const base::GloballyUniqueId& id) {
  wire::Guid g;
  g.set_worker(id.worker);
  g.set_local(id.local);
  return g;
}

base::GloballyUniqueId FromWire(const wire::Guid& id) {
  return base::GloballyUniqueId{static_cast<base::WorkerId>(id.worker()), id.local()};
}

const c10::TypePtr RRefImpl::type() const {
  return c10::RRefType::create(c10::AnyType::get());
}

Agent* RRefImpl::agent() const {
  auto ctx = weak_ctx_.lock();
  return ctx ? ctx->agent() : nullptr;
}

WaitTicket::WaitTicket(std::shared_ptr<Count> count) : count_(std::move(count)) {
  base::MutexLock lock(count_->mu);
  ++count_->waiting;
}

void WaitTicket::Done() {
  if (done_.exchange(true)) return;
  base::MutexLock lock(count_->mu);
  --count_->waiting;
}

void OwnerRRef::Abandon(const absl::Status& why) {
  value_.Complete(absl::Status(why.code(), absl::StrCat("RRef ", rref_id().ToString(), ": ", why.message())));
  std::vector<std::function<void()>> dropped;
  {
    base::MutexLock lock(lanes_mu_);
    abandoned_ = true;
    for (auto& [key, lane] : lanes_) {
      for (auto& [seq, fn] : lane.waiting) dropped.push_back(std::move(fn));
      lane.waiting.clear();
    }
  }
  dropped.clear();  // outside the lock: each call's responder answers as it goes
}

void OwnerRRef::RunInOrder(base::WorkerId caller, const base::ForkId& lane_id, uint64_t seq,
                           std::function<void()> fn, absl::Duration gap_timeout,
                           absl::Time now) {
  if (seq == 0) return fn();
  const auto key = std::make_pair(caller, lane_id);
  bool late = false;
  std::function<void()> dropped;  // destroyed on return, outside the lock
  {
    base::MutexLock lock(lanes_mu_);
    Lane& lane = lanes_[key];
    late = seq < lane.next;  // its turn was skipped (see the header)
    if (!late && seq == lane.next && !lane.running) {
      lane.running = true;
    } else if (!late && abandoned_) {
      // Nothing waits once the owner has stopped: dropped (after the lock),
      // the call is answered with an error (see Abandon).
      dropped = std::move(fn);
      fn = nullptr;
    } else if (!late) {
      if (lane.waiting.empty()) lane.gap_since = now;
      lane.waiting[seq] = std::move(fn);
      if (lane.running || now - lane.gap_since < gap_timeout) return;
      // The missing calls have been given up on by their caller: go on.
      auto first = lane.waiting.begin();
      lane.next = first->first;
      fn = std::move(first->second);
      lane.waiting.erase(first);
      lane.running = true;
    }
  }
  if (late) return fn();  // late, but not lost
  while (fn) {
    fn();
    base::MutexLock lock(lanes_mu_);
    Lane& lane = lanes_[key];
    ++lane.next;
    auto it = lane.waiting.find(lane.next);
    if (it == lane.waiting.end()) {
      fn = nullptr;
      lane.running = false;
      if (!lane.waiting.empty()) lane.gap_since = absl::Now();  // a new gap
    } else {
      fn = std::move(it->second);
      lane.waiting.erase(it);
    }
  }
}

UserRRef::UserRRef(base::WorkerId owner, std::string owner_name, base::RRefId id, base::ForkId fork,
                   std::shared_ptr<RRefContext> ctx)
    : RRefImpl(owner, std::move(owner_name), id, ctx),
      fork_id_(fork),
      ctx_(std::move(ctx)),
      confirmed_(ctx_->executor()) {}

UserRRef::~UserRRef() { ctx_->OnUserDestroyed(*this); }

void UserRRef::Confirm(absl::Status status) {
  if (status.ok()) {
    confirmed_.SetValue(Empty{});
  } else {
    confirmed_.SetError(std::move(status));
  }
}

RRefContext::RRefContext(base::WorkerId self, Agent* agent, ControlChannel* channel,
                         Executor* executor)
    : self_(self), agent_(agent), channel_(channel), executor_(executor) {}

Agent* RRefContext::agent() const {
  base::MutexLock lock(mu_);
  return detached_ ? nullptr : agent_;
}

base::GloballyUniqueId RRefContext::NewId() {
  return base::GloballyUniqueId{self_, next_id_.fetch_add(1, std::memory_order_relaxed)};
}

c10::intrusive_ptr<OwnerRRef> RRefContext::CreateLocal(c10::IValue value) {
  auto rref = c10::make_intrusive<OwnerRRef>(self_, channel_->NameOf(self_), NewId(),
                                             weak_from_this(), executor_);
  rref->SetValue(std::move(value));
  return rref;
}

c10::intrusive_ptr<UserRRef> RRefContext::CreateUserForRemote(base::WorkerId owner) {
  const base::RRefId id = NewId();
  auto user = c10::make_intrusive<UserRRef>(owner, channel_->NameOf(owner), id, id,
                                            shared_from_this());
  base::MutexLock lock(mu_);
  pending_users_[id] = user;
  live_users_[id] = user.get();
  return user;
}

c10::intrusive_ptr<OwnerRRef> RRefContext::GetOrCreateOwner(const base::RRefId& id) {
  c10::intrusive_ptr<OwnerRRef> owner;
  absl::Status abandoned;
  {
    base::MutexLock lock(mu_);
    auto& slot = owners_[id];
    if (!slot) {
      slot = c10::make_intrusive<OwnerRRef>(self_, channel_->NameOf(self_), id,
                                            weak_from_this(), executor_);
      abandoned = abandoned_;
    }
    owner = slot;
  }
  // Made after this worker stopped waiting for values: it fails at once.
  if (!abandoned.ok()) owner->Abandon(abandoned);
  return owner;
}

c10::intrusive_ptr<OwnerRRef> RRefContext::FindOwner(const base::RRefId& id) {
  base::MutexLock lock(mu_);
  auto it = owners_.find(id);
  return it == owners_.end() ? c10::intrusive_ptr<OwnerRRef>() : it->second;
}

bool RRefContext::KnowsOwnValue(const base::RRefId& id) const {
  base::MutexLock lock(mu_);
  // A remote() this worker made to itself has a user (fork id = rref id)
  // before its owner exists.
  return owners_.contains(id) || live_users_.contains(id) || pending_users_.contains(id);
}

void RRefContext::AddFork(const base::RRefId& id, const base::ForkId& fork) {
  base::MutexLock lock(mu_);
  forks_[id].insert(fork);
}

bool RRefContext::HasFork(const base::RRefId& id, const base::ForkId& fork) const {
  base::MutexLock lock(mu_);
  auto it = forks_.find(id);
  return it != forks_.end() && it->second.contains(fork);
}

absl::Status RRefContext::DeleteFork(const base::RRefId& id, const base::ForkId& fork) {
  c10::intrusive_ptr<OwnerRRef> freed;  // destroyed outside the lock
  {
    base::MutexLock lock(mu_);
    auto it = forks_.find(id);
    // Unknown forks are already deleted: deletes are idempotent.
    if (it == forks_.end() || it->second.erase(fork) == 0) return absl::OkStatus();
    if (!it->second.empty()) return absl::OkStatus();
    forks_.erase(it);
    auto owner = owners_.find(id);
    if (owner != owners_.end()) {
      freed = std::move(owner->second);
      owners_.erase(owner);
    }
  }
  return absl::OkStatus();
}

void RRefContext::AcceptChild(const base::ForkId& fork) {
  c10::intrusive_ptr<RRefImpl> child;  // may be the last reference: dropped unlocked
  base::MutexLock lock(mu_);
  auto it = pending_children_.find(fork);
  if (it == pending_children_.end()) return;  // idempotent
  child = std::move(it->second.rref);
  pending_children_.erase(it);
}

void RRefContext::FinishPendingUser(const base::ForkId& fork, absl::Status status) {
  c10::intrusive_ptr<UserRRef> user;  // may be the last reference: dropped unlocked
  {
    base::MutexLock lock(mu_);
    auto it = pending_users_.find(fork);
    if (it == pending_users_.end()) return;
    user = std::move(it->second);
    pending_users_.erase(it);
  }
  user->Confirm(std::move(status));
}

void RRefContext::ForgetPeer(base::WorkerId peer, const absl::Status& why) {
  std::vector<c10::intrusive_ptr<UserRRef>> unconfirmed;  // confirmed (and maybe dropped) unlocked
  std::vector<c10::intrusive_ptr<RRefImpl>> children;     // likewise dropped unlocked
  {
    base::MutexLock lock(mu_);
    for (auto it = pending_children_.begin(); it != pending_children_.end();) {
      if (it->second.to == peer || it->second.rref->owner() == peer) {
        children.push_back(std::move(it->second.rref));
        pending_children_.erase(it++);
      } else {
        ++it;
      }
    }
    for (auto it = pending_users_.begin(); it != pending_users_.end();) {
      if (it->second->owner() == peer) {
        unconfirmed.push_back(std::move(it->second));
        pending_users_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (auto& user : unconfirmed) user->Confirm(why);
}

void RRefContext::OnUserDestroyed(const UserRRef& user) {
  {
    base::MutexLock lock(mu_);
    if (live_users_.erase(user.fork_id()) == 0 || detached_) return;
  }
  wire::UserDelete del;
  *del.mutable_rref_id() = ToWire(user.rref_id());
  *del.mutable_fork_id() = ToWire(user.fork_id());
  wire::Request request = wire::MakeRequest(del);
  Send(user.owner(), std::move(request));
}

Future<Empty> RRefContext::Send(base::WorkerId dst, wire::Request request) {
  {
    base::MutexLock lock(mu_);
    ++pending_messages_;
  }
  request.set_from(self_);
  Future<Empty> sent = detached() ? Future<Empty>::Ready(absl::CancelledError("stopped"))
                                  : channel_->SendControl(dst, std::move(request));
  // Keep the context alive until the message completed.
  auto self = shared_from_this();
  Future<Empty> done;  // inline: bookkeeping only
  sent.then([self, done](const absl::StatusOr<Empty>& r) mutable {
    {
      base::MutexLock lock(self->mu_);
      --self->pending_messages_;
    }
    done.Complete(r);
  });
  return done;
}

absl::Status RRefContext::ForkForSend(const c10::IValue& value, base::WorkerId dst,
                                      wire::RRefMeta* out) {
  auto* impl = dynamic_cast<RRefImpl*>(value.toRRef().get());
  if (impl == nullptr) {
    return absl::InvalidArgumentError("cannot send an RRef that remora did not create");
  }
  auto rref = c10::intrusive_ptr<RRefImpl>::unsafe_reclaim_from_nonowning(impl);
  if (!channel_->IsKnown(dst)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot send an RRef to unknown worker ", dst));
  }
  const base::ForkId fork = NewId();
  if (rref->isOwner()) {
    if (impl->owner() != self_) {
      return absl::InternalError("owner RRef of another worker");
    }
    base::MutexLock lock(mu_);
    auto& slot = owners_[rref->rref_id()];
    if (!slot) slot = c10::static_intrusive_pointer_cast<OwnerRRef>(rref);
    // Sent to itself: the receiver gets the owner RRef back, no new user.
    if (dst != self_) forks_[rref->rref_id()].insert(fork);
  } else {
    auto* user = static_cast<UserRRef*>(impl);
    if (user->confirmed().ready()) {
      auto confirmed = user->confirmed().wait();
      if (!confirmed.ok()) {
        return base::Annotate(confirmed.status(), "cannot send a failed RRef");
      }
    }
    base::MutexLock lock(mu_);
    pending_children_[fork] = PendingChild{rref, dst};
  }
  out->set_owner(rref->owner());
  *out->mutable_rref_id() = ToWire(rref->rref_id());
  *out->mutable_fork_id() = ToWire(fork);
  out->set_parent(self_);
  return absl::OkStatus();
}

absl::StatusOr<c10::IValue> RRefContext::Receive(const wire::RRefMeta& meta,
                                                 std::vector<Future<Empty>>* pending) {
  const base::WorkerId owner = static_cast<base::WorkerId>(meta.owner());
  const base::WorkerId parent = static_cast<base::WorkerId>(meta.parent());
  if (meta.owner() > base::kUnknownWorker || meta.parent() > base::kUnknownWorker ||
      !channel_->IsKnown(owner) || !channel_->IsKnown(parent)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RRef names unknown workers (owner ", meta.owner(), ", parent ", meta.parent(), ")"));
  }
  const base::RRefId id = FromWire(meta.rref_id());
  const base::ForkId fork = FromWire(meta.fork_id());
  if (!channel_->IsKnown(id.worker) || !channel_->IsKnown(fork.worker)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RRef with an invalid id ", id.ToString(), " / fork ", fork.ToString(),
        ": ids carry the id of a worker of the group"));
  }
  if (owner == self_) {
    // A value this worker created itself exists as long as any user does;
    // one that is missing was deleted (or never existed): waiting for it
    // would wait forever. Values created by remote() of another worker may
    // still be on their way and are waited for.
    if (id.worker == self_ && !KnowsOwnValue(id)) {
      return absl::NotFoundError(absl::StrCat(
          "no RRef ", id.ToString(), " on its owner '", channel_->NameOf(self_),
          "' (already deleted, or never created)"));
    }
    c10::intrusive_ptr<OwnerRRef> rref = GetOrCreateOwner(id);
    if (parent != self_) {
      // A user sent our own RRef back: no user is created here (PyTorch's
      // "phantom fork"); the parent only needs to know it arrived.
      wire::ChildAccept child;
      *child.mutable_fork_id() = meta.fork_id();
      wire::Request accept = wire::MakeRequest(child);
      Send(parent, std::move(accept));
    }
    return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(rref));
  }

  auto user = c10::make_intrusive<UserRRef>(owner, channel_->NameOf(owner), id, fork,
                                            shared_from_this());
  {
    base::MutexLock lock(mu_);
    live_users_[fork] = user.get();
  }
  if (parent == owner) {
    // The owner recorded this fork before sending it.
    user->Confirm(absl::OkStatus());
  } else {
    {
      base::MutexLock lock(mu_);
      pending_users_[fork] = user;
    }
    wire::ForkRequest fork_request;
    *fork_request.mutable_rref_id() = meta.rref_id();
    *fork_request.mutable_fork_id() = meta.fork_id();
    wire::Request request = wire::MakeRequest(fork_request);
    auto self = shared_from_this();
    Send(owner, std::move(request))
        .then([self, fork, parent, owner](const absl::StatusOr<Empty>& r) {
          self->FinishPendingUser(
              fork, r.ok() ? absl::OkStatus()
                           : base::Annotate(r.status(), absl::StrCat(
                                 "telling owner '", self->channel_->NameOf(owner),
                                 "' about an RRef fork")));
          wire::ChildAccept child;
          *child.mutable_fork_id() = ToWire(fork);
          wire::Request accept = wire::MakeRequest(child);
          self->Send(parent, std::move(accept));
        });
    if (pending != nullptr) pending->push_back(user->confirmed());
  }
  return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(user));
}

void RRefContext::ReleaseAllUsers() {
  std::vector<std::pair<base::WorkerId, wire::Request>> deletes;
  {
    base::MutexLock lock(mu_);
    for (const auto& [fork, user] : live_users_) {
      wire::UserDelete del;
      *del.mutable_rref_id() = ToWire(user->rref_id());
      *del.mutable_fork_id() = ToWire(fork);
      wire::Request request = wire::MakeRequest(del);
      deletes.emplace_back(user->owner(), std::move(request));
    }
    live_users_.clear();
  }
  for (auto& [owner, request] : deletes) Send(owner, std::move(request));
}

bool RRefContext::drained() const {
  return pending_messages_ == 0 && pending_users_.empty() && pending_children_.empty();
}

absl::Status RRefContext::WaitDrained(absl::Duration timeout) {
  base::MutexLock lock(mu_);
  auto is_drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return drained(); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&is_drained), timeout)) {
    // The members still owing an answer, by name: whom to look at.
    std::set<std::string> peers;
    for (const auto& [fork, child] : pending_children_) peers.insert(channel_->NameOf(child.to));
    for (const auto& [fork, user] : pending_users_) peers.insert(channel_->NameOf(user->owner()));
    return absl::DeadlineExceededError(absl::StrCat(
        "remote references did not settle within ", absl::FormatDuration(timeout), " (", pending_messages_,
        " control messages in flight, ", pending_users_.size(), " unconfirmed users, ", pending_children_.size(),
        " unaccepted forks", peers.empty() ? "" : absl::StrCat(", waiting on ", absl::StrJoin(peers, ", ")),
        "): is every member still running? A worker that died is left out once the master marks it lost"));
  }
  return absl::OkStatus();
}

bool RRefContext::detached() const {
  base::MutexLock lock(mu_);
  return detached_;
}

void RRefContext::Detach() {
  base::MutexLock lock(mu_);
  detached_ = true;
}

void RRefContext::AbandonWaiting(const absl::Status& why) {
  std::vector<c10::intrusive_ptr<OwnerRRef>> owners;
  {
    base::MutexLock lock(mu_);
    abandoned_ = why;
    for (const auto& [id, owner] : owners_) owners.push_back(owner);
  }
  for (const auto& owner : owners) owner->Abandon(why);
}

std::shared_ptr<WaitTicket> RRefContext::StartWaiting() {
  return std::make_shared<WaitTicket>(waiting_);
}

bool RRefContext::AwaitNoneWaiting(absl::Duration timeout) {
  WaitTicket::Count& count = *waiting_;
  base::MutexLock lock(count.mu);
  auto none = [&count]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(count.mu) { return count.waiting == 0; };
  return count.mu.AwaitWithTimeout(absl::Condition(&none), timeout);
}

RRefStats RRefContext::stats() const {
  RRefStats s;
  {
    base::MutexLock lock(waiting_->mu);
    s.waiting_requests = waiting_->waiting;
  }
  base::MutexLock lock(mu_);
  s.owners = owners_.size();
  for (const auto& [id, forks] : forks_) s.forks += forks.size();
  s.live_users = live_users_.size();
  s.pending_users = pending_users_.size();
  s.pending_children = pending_children_.size();
  s.pending_messages = pending_messages_;
  return s;
}

}  // namespace remora::rpc
