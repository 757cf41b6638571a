// Handlers of the request kinds of calls and RRefs (proto/rref.proto):
// function and method calls, to_here(), and the reference-counting messages
// between an owner and its users (PyTorch's fork request, child accept and
// user delete).
#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "proto/rref.pb.h"
#include "rpc/agent_impl.h"
#include "rpc/link.h"
#include "rpc/request_checks.h"

namespace remora::rpc {
namespace {

// The owner RRef of a remote()'s result, whose id CheckResultRRef accepted;
// its creator is its first user.
c10::intrusive_ptr<OwnerRRef> CreateResultOwner(RRefContext& rrefs, const wire::CallRequest& call) {
  const base::RRefId id = FromWire(call.result_rref());
  c10::intrusive_ptr<OwnerRRef> owner = rrefs.GetOrCreateOwner(id);
  rrefs.AddFork(id, id);
  return owner;
}

// A call's arguments, and the owner RRef a method call targets (`self`).
absl::Status DecodeCall(const wire::CallRequest& call, DecodeContext& ctx, std::vector<c10::IValue>* args,
                        c10::intrusive_ptr<OwnerRRef>* self) {
  args->reserve(call.args_size());
  for (const auto& a : call.args()) {
    auto v = DecodeValue(a, ctx);
    if (!v.ok()) return base::Annotate(v.status(), "decoding the arguments");
    args->push_back(std::move(*v));
  }
  if (!call.has_self()) return absl::OkStatus();
  auto v = DecodeValue(call.self(), ctx);
  if (!v.ok()) return base::Annotate(v.status(), "decoding the RRef");
  auto* owner = v->isRRef() ? dynamic_cast<OwnerRRef*>(v->toRRef().get()) : nullptr;
  if (owner == nullptr) return absl::InvalidArgumentError("a method call must target an RRef owned by the callee");
  *self = c10::intrusive_ptr<OwnerRRef>::unsafe_reclaim_from_nonowning(owner);
  return absl::OkStatus();
}

// Runs `function` (a method of `self`, whose value is ready, when given)
// in autograd context `context_id` and replies; a remote() keeps the result
// in `result_rref` and replies only success or the error. `waiting`, the
// ticket of a method call that waited on `self` (or null), is done once the
// call has been answered with `self`'s error or before the method runs.
void RunCall(Agent::Impl* impl, base::WorkerId from, const std::shared_ptr<Responder>& responder,
             const c10::intrusive_ptr<OwnerRRef>& result_rref, int64_t context_id, std::vector<c10::IValue> args,
             const std::string& function, const c10::intrusive_ptr<OwnerRRef>& self, WaitTicket* waiting) {
  Agent* const agent = impl->agent_;
  ContextIdGuard in_context(context_id);
  CallContext cctx{agent, base::WorkerInfo{}};
  cctx.prompt = OnLinkReader();  // (Dispatch runs only prompt functions there)
  if (const Peer* p = impl->FindPeer(from)) cctx.caller = p->info;
  Future<c10::IValue> out;
  const Args call_args(std::move(args));
  if (self) {
    auto object = self->value().wait();  // ready
    // (A method that runs is no longer waiting: a stop does not wait for it.)
    if (object.ok() && waiting != nullptr) waiting->Done();
    out = Future<c10::IValue>::Ready(
        object.ok() ? agent->registry().InvokeMethod(*object, function, cctx, call_args) : object.status());
  } else {
    out = agent->registry().Invoke(function, cctx, call_args);
  }
  out.then([responder, result_rref](const absl::StatusOr<c10::IValue>& result) {
    if (!result_rref) return responder->ReplyValue(result);
    result_rref->SetValue(result);
    // The caller learns success or the creation error; the value stays.
    responder->ReplyValue(result.ok() ? absl::StatusOr<c10::IValue>(c10::IValue()) : result.status());
  });
  if (waiting != nullptr) waiting->Done();  // (answered above: `out` has no executor)
}

// Runs a registered function, or a method on an owner RRef, once every RRef
// argument is confirmed; a remote() keeps the result as an owner RRef.
void HandleCall(Agent::Impl* impl, Incoming<wire::CallRequest> in,
                std::shared_ptr<Responder> responder) {
  InMessage& message = in.message;
  const wire::Request& request = message.header.request();
  const wire::CallRequest& call = in.body;
  const base::WorkerId from = in.from;
  Agent* const agent = impl->agent_;
  RRefContext& rrefs = *impl->rrefs();
  const Agent::Impl::Membership member{agent};
  // A remote() whose result id is valid gets its owner RRef before any
  // other check, and every refusal below becomes that RRef's value too:
  // the caller's user RRef may already have been forked, and a later user
  // on this worker (a method call on it, an argument, a to_here()) must get
  // the creation error rather than wait for a value that never comes.
  c10::intrusive_ptr<OwnerRRef> result_rref;
  if (call.has_result_rref() && CheckResultRRef(call, from).ok()) {
    result_rref = CreateResultOwner(rrefs, call);
  }
  auto refuse = [&](const absl::Status& why) {
    if (result_rref) result_rref->SetValue(why);
    responder->ReplyError(why);
  };
  if (absl::Status s = CheckCall(call, from); !s.ok()) return refuse(s);
  if (absl::Status s = CheckContext(request, member); !s.ok()) return refuse(s);
  const int64_t context_id = ContextOf(request);
  responder->set_context(context_id);

  std::vector<Future<Empty>> pending;
  std::vector<at::Tensor> grad_tensors;
  DecodeContext ctx{&rrefs, &message.payloads, &pending, &grad_tensors};
  std::vector<c10::IValue> args;
  c10::intrusive_ptr<OwnerRRef> self_rref;
  if (absl::Status s = DecodeCall(call, ctx, &args, &self_rref); !s.ok()) return refuse(s);
  absl::Status recorded = impl->RecordRecv(request.autograd(), from, grad_tensors);
  if (!recorded.ok()) return refuse(recorded);

  // Runs once every RRef argument is confirmed and `self` holds its value.
  auto run = [impl, from, responder, result_rref, context_id, args = std::move(args), function = call.function(),
              self_rref](WaitTicket* waiting) mutable {
    RunCall(impl, from, responder, result_rref, context_id, std::move(args), function, self_rref, waiting);
  };
  const base::ForkId lane = call.has_caller_fork() ? FromWire(call.caller_fork()) : base::ForkId{};
  const uint64_t seq = call.seq();
  const absl::Duration gap = agent->options().rpc_timeout;
  // A method call waits on its owner from here (for the value, for its turn
  // on the lane, or only for the hop to the pool), once its RRef arguments
  // are confirmed: a stop that answers it waits for that answer to go out.
  std::shared_ptr<WaitTicket> waiting = self_rref && pending.empty() ? rrefs.StartWaiting() : nullptr;
  auto after_args = [impl, run = std::move(run), responder, result_rref, self_rref, from, lane, seq, gap,
                     waiting](const absl::StatusOr<Empty>& confirmed) mutable {
    if (!confirmed.ok()) {
      if (result_rref) result_rref->SetValue(confirmed.status());
      return responder->ReplyError(base::Annotate(confirmed.status(), "an RRef argument"));
    }
    if (!self_rref) return run(nullptr);
    if (!waiting) waiting = impl->rrefs()->StartWaiting();
    // Method calls through one user RRef run in the caller's order.
    self_rref->value().then([run = std::move(run), self_rref, from, lane, seq, gap,
                             waiting](const absl::StatusOr<c10::IValue>&) mutable {
      // (Parked on the lane, the call keeps its ticket; dropped unrun, its
      // responder answers it.)
      self_rref->RunInOrder(
          from, lane, seq, [run = std::move(run), waiting]() mutable { run(waiting.get()); }, gap);
    });
  };
  if (pending.empty() && (!self_rref || self_rref->value().ready())) {
    after_args(Empty{});  // common case: run on this thread, no hop
  } else {
    Future<Empty> all = WhenAll(pending, impl->pool_.get());
    all.then(std::move(after_args));
  }
}

// to_here(): answers with the value once it exists.
void HandleFetch(Agent::Impl* impl, const Incoming<wire::FetchRequest>& in,
                 std::shared_ptr<Responder> responder) {
  const wire::Request& request = in.message.header.request();
  const base::RRefId id = FromWire(in.body.rref_id());
  const base::WorkerId from = in.from;
  if (absl::Status s = CheckContext(request, Agent::Impl::Membership{impl->agent_}); !s.ok()) {
    return responder->ReplyError(s);
  }
  responder->set_context(ContextOf(request));
  RRefContext& rrefs = *impl->rrefs();
  c10::intrusive_ptr<OwnerRRef> owner = rrefs.FindOwner(id);
  if (!owner) {
    // The value's remote() has not arrived yet. Wait for it when the asker
    // is a known user: its creator, or a fork the owner recorded.
    const base::ForkId fork = FromWire(in.body.fork_id());
    const bool known_user = (id.worker == from && fork == id) || rrefs.HasFork(id, fork);
    if (!known_user || id.worker == impl->agent_->self().id) {
      return responder->ReplyError(absl::NotFoundError(absl::StrCat(
          "to_here: no RRef ", id.ToString(), " here (already deleted, or never created)")));
    }
    owner = rrefs.GetOrCreateOwner(id);
  }
  // (Waiting from here, for the value or only for the hop to the pool: a
  // stop that answers it waits for that answer to go out.)
  owner->value().then([responder, waiting = rrefs.StartWaiting()](const absl::StatusOr<c10::IValue>& v) {
    responder->ReplyValue(v);
    waiting->Done();
  });
}

}  // namespace

void FailRefusedRemote(Agent::Impl* impl, const wire::Request& request, const absl::Status& why) {
  if (request.kind() != wire::CallRequest::descriptor()->full_name()) return;
  absl::StatusOr<wire::CallRequest> call = wire::RequestBody<wire::CallRequest>(request);
  if (!call.ok() || !call->has_result_rref()) return;
  // Only a member's own id: nobody could ever delete an owner made for
  // anyone else.
  if (!impl->CheckMember(request).ok()) return;
  if (!CheckResultRRef(*call, static_cast<base::WorkerId>(request.from())).ok()) return;
  CreateResultOwner(*impl->rrefs(), *call)->SetValue(why);
}

absl::Status RegisterRRefRequests(Agent::Impl* impl) {
  DispatchTable& t = impl->requests_;
  RETURN_IF_ERROR(t.Register<wire::CallRequest>(
      [impl](Incoming<wire::CallRequest> in, std::shared_ptr<Responder> r) {
        HandleCall(impl, std::move(in), std::move(r));
      }));
  RETURN_IF_ERROR(t.Register<wire::FetchRequest>(
      [impl](Incoming<wire::FetchRequest> in, std::shared_ptr<Responder> r) {
        HandleFetch(impl, in, std::move(r));
      }));
  RETURN_IF_ERROR(t.Register<wire::ForkRequest>(
      [impl](Incoming<wire::ForkRequest> in, std::shared_ptr<Responder> r) {
        const base::RRefId id = FromWire(in.body.rref_id());
        const base::ForkId fork = FromWire(in.body.fork_id());
        if (absl::Status s = CheckIds("fork request", {id, fork},
                                      Agent::Impl::Membership{impl->agent_});
            !s.ok()) {
          return r->ReplyError(s);
        }
        impl->rrefs()->AddFork(id, fork);
        r->Reply(OutMessage{});
      }));
  RETURN_IF_ERROR(t.Register<wire::ChildAccept>(
      [impl](Incoming<wire::ChildAccept> in, std::shared_ptr<Responder> r) {
        impl->rrefs()->AcceptChild(FromWire(in.body.fork_id()));
        r->Reply(OutMessage{});
      }));
  return t.Register<wire::UserDelete>(
      [impl](Incoming<wire::UserDelete> in, std::shared_ptr<Responder> r) {
        // Deletes are idempotent: an unknown or already deleted user is fine.
        r->ReplyStatus(
            impl->rrefs()->DeleteFork(FromWire(in.body.rref_id()), FromWire(in.body.fork_id())));
      });
}

}  // namespace remora::rpc
