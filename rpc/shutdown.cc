// Stopping: the graceful shutdown protocol (drain RRef deletes, then a
// barrier repeated until no call is in flight anywhere, then finish), the
// worker's wait for it with pings to the master, and tearing an agent down.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "rpc/agent_impl.h"

namespace remora::rpc {

void Agent::Impl::HandleProbe(const wire::ShutdownProbe& probe,
                              std::shared_ptr<Responder> responder) {
  if (probe.release_users()) agent_->rrefs_->ReleaseAllUsers();
  absl::Status drained = agent_->rrefs_->WaitDrained(agent_->options_.shutdown_timeout);
  if (!drained.ok()) return responder->ReplyError(drained);
  OutMessage m;
  // Minus one: this probe itself.
  m.header.mutable_response()->set_active(agent_->active_calls() - 1);
  responder->Reply(std::move(m));
}

absl::Status Agent::Impl::CheckPing(base::WorkerId from, const wire::Ping& ping) {
  if (!agent_->options_.is_master || ping.incarnation() == 0) return absl::OkStatus();
  for (const base::WorkerInfo& w : agent_->workers()) {
    if (w.id != from) continue;
    const bool superseded = w.shm.incarnation != ping.incarnation();
    bool lost;
    {
      base::MutexLock lock(join_mu_);
      // (A rejoining process is in the book and still lost until its join
      // is answered: it is not the one told to go.)
      lost = lost_.count(w.name) > 0 && rejoining_.count(w.name) == 0;
    }
    if (!lost && !superseded) return absl::OkStatus();
    // (A hung process that resumed after its place was given away: without
    // this it would idle on, holding its memory, until the master ends.)
    return absl::FailedPreconditionError(absl::StrCat(
        "the master declared worker '", w.name, "' at ", ping.address(), " lost",
        superseded ? absl::StrCat(", and a new process at ", w.address, " serves its name now") : "",
        ": this process is no longer in the group"));
  }
  return absl::OkStatus();  // (an id the group does not have was refused before)
}

absl::Status RegisterShutdownRequests(Agent::Impl* impl) {
  DispatchTable& t = impl->requests_;
  RETURN_IF_ERROR(t.Register<wire::ShutdownProbe>(
      [impl](Incoming<wire::ShutdownProbe> in, std::shared_ptr<Responder> r) {
        impl->HandleProbe(in.body, std::move(r));
      }));
  RETURN_IF_ERROR(t.Register<wire::Ping>([impl](Incoming<wire::Ping> in, std::shared_ptr<Responder> r) {
    r->ReplyStatus(impl->CheckPing(in.from, in.body));
  }));
  return t.Register<wire::ShutdownFinish>(
      [impl](Incoming<wire::ShutdownFinish> in, std::shared_ptr<Responder> r) {
        if (impl->agent_->options().is_master) {
          return r->ReplyError(absl::PermissionDeniedError("only the master ends the group"));
        }
        if (!in.body.error().empty()) {
          base::MutexLock lock(impl->abort_mu_);
          impl->abort_error_ = in.body.error();
          impl->abort_signal_ = in.body.signal();
        }
        r->Reply(OutMessage{});
        impl->finished_.Notify();
      });
}

void Agent::Impl::RunOwnThread(std::function<void()> task) {
  {
    base::MutexLock lock(own_threads_->mu);
    if (!own_threads_->closed) {
      ++own_threads_->running;
      try {
        std::thread([state = own_threads_, task] {
          task();
          base::MutexLock lock(state->mu);
          --state->running;
        }).detach();
        return;
      } catch (const std::system_error&) {  // no thread to be had: run it here
        --own_threads_->running;
      }
    }
  }
  task();
}

// Stops RunOwnThread from starting threads and waits for those running.
void Agent::Impl::JoinOwnThreads() {
  OwnThreads& state = *own_threads_;
  base::MutexLock lock(state.mu);
  state.closed = true;
  auto done = [&state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) { return state.running == 0; };
  state.mu.Await(absl::Condition(&done));
}

void Agent::Impl::UnaryCallOpened() {
  base::MutexLock lock(unary_calls_mu_);
  ++unary_calls_;
}

void Agent::Impl::UnaryCallDone() {
  base::MutexLock lock(unary_calls_mu_);
  --unary_calls_;
}

void Agent::Impl::AwaitUnaryCallsDone(absl::Time deadline) {
  base::MutexLock lock(unary_calls_mu_);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(unary_calls_mu_) { return unary_calls_ == 0; };
  unary_calls_mu_.AwaitWithDeadline(absl::Condition(&none), deadline);
}

void Agent::Impl::CancelOutgoing() {
  {
    base::MutexLock lock(calls_mu_);
    stopped_ = true;
    for (ClientCall* c : calls_) {
      if (c->context) c->context->TryCancel();
    }
    for (SyncStream* s : streams_in_use_) s->Cancel();
  }
  CloseLinks();  // their calls fail here
  // Idle streams go now; the callers of those in use give them back.
  std::vector<std::unique_ptr<SyncStream>> idle;
  {
    base::MutexLock lock(mu_);
    for (const auto& p : peers_) {
      if (p == nullptr) continue;
      base::MutexLock stream_lock(p->stream_mu);
      for (auto& s : p->idle_streams) idle.push_back(std::move(s));
      p->idle_streams.clear();
    }
  }
  idle.clear();  // each cancelled, and waited for until gRPC let go of it
  // A reply still receiving CUDA payloads stays in calls_ until its
  // transfers end: stopping the channel ends them now.
  cuda_->Stop();
  shm_->Stop();  // replies still going out travel in their frames
  {
    base::MutexLock lock(calls_mu_);
    auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) { return calls_.empty(); };
    calls_mu_.AwaitWithTimeout(absl::Condition(&none), absl::Seconds(10));
  }
}

namespace {

// A stopped agent's pool, kept for the rest of the process: futures made
// before the stop name it (or its lane) as their executor, and one may be
// completed or given a callback after the agent is gone (a reply that
// gRPC delivers late, from a peer killed mid-call; a caller that keeps a
// future). A stopped pool drops what is scheduled on it, as its comment
// says; freed, it would be a use after free. Each is a few KB and no
// thread.
void RetireForGood(std::unique_ptr<ThreadPool> pool) {
  struct Retired {
    absl::Mutex mu;
    std::vector<std::unique_ptr<ThreadPool>> pools ABSL_GUARDED_BY(mu);
  };
  static Retired* const retired = new Retired;  // never destroyed (see above)
  base::MutexLock lock(retired->mu);
  retired->pools.push_back(std::move(pool));
}

}  // namespace

void Agent::Impl::Stop() {
  if (agent_->rrefs_) {
    agent_->rrefs_->Detach();
    // Calls waiting here for a value that will not come now (its remote()
    // never arrived) get their answer before the server stops. The answers
    // are made on the pool, and the server's stop below cuts off what is
    // still unanswered at its deadline (the caller gets gRPC's CANCELLED
    // instead of the cause): they are waited for first. Each needs only a
    // turn on a pool thread; the bound is for a pool whose every thread is
    // held up in a handler.
    agent_->rrefs_->AbandonWaiting(absl::UnavailableError(absl::StrCat(
        "its value was not made before worker '", agent_->self_.name, "' stopped")));
    if (!agent_->rrefs_->AwaitNoneWaiting(absl::Seconds(5))) {
      std::cerr << absl::StrCat("remora: '", agent_->self_.name, "' stops with ",
                                agent_->rrefs_->stats().waiting_requests, " calls on its RRefs still unanswered ",
                                "after 5 s (their answers wait for a pool thread)\n");
    }
  }
  // Peers' streams stay open until closed: the server's Shutdown would
  // wait for them. A request being handled still gets its reply first.
  std::vector<std::shared_ptr<ServerStream::State>> server_streams;
  {
    base::MutexLock lock(server_streams_mu_);
    server_streams_closed_ = true;
    server_streams.assign(server_streams_.begin(), server_streams_.end());
  }
  for (const auto& s : server_streams) {
    ServerStream::Close(s, grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat(
                               "worker '", agent_->self_.name, "' is shutting down")));
  }
  // Local links likewise: the requests being handled get their replies
  // (for as long as gRPC's shutdown waits), then every link closes.
  if (link_server_) link_server_->Stop(absl::Seconds(2));
  if (server_) {
    // gRPC's Shutdown waits, up to its deadline, for each connection to end
    // gracefully, and a caller whose connection sits idle (its calls all on
    // local links, its process not ending yet) does not answer: a group in
    // one process took 2 s more to stop. So the unary calls still being
    // answered are waited for here (their streams closed above, likewise),
    // for as long, and the server stops at once after them.
    AwaitUnaryCallsDone(absl::Now() + absl::Seconds(2));
    server_->Shutdown(DeadlineIn(absl::ZeroDuration()));
  }
  CancelOutgoing();  // stops the CUDA channel too: waiting receives fail
  JoinOwnThreads();
  // Runs what is queued and joins before the pointer goes: a task that
  // runs meanwhile may still ask the agent for its executor.
  if (pool_) {
    pool_->Stop();
    RetireForGood(std::move(pool_));  // (executor() is null from now on)
  }
  if (server_) server_->Wait();
  server_.reset();
}

absl::Status Agent::WaitForShutdown() {
  const absl::Duration period = absl::Seconds(1);
  absl::Time last_contact = absl::Now(), last_tick = last_contact;
  while (!impl_->finished_.WaitForNotificationWithTimeout(period)) {
    // A process that was stopped (SIGSTOP, a frozen VM) counts the
    // master's silence from when it runs again, not from before.
    if (absl::Now() - last_tick > 3 * period) last_contact = absl::Now();
    last_tick = absl::Now();
    if (absl::Status why = restart_required(); !why.ok()) {
      return absl::Status(why.code(), absl::StrCat(
          why.message(), "; stopping, for its supervisor (remora-launch --max-restarts, Slurm, systemd) to start it "
          "again or for the master's --spares to take its place"));
    }
    if (options_.master_timeout <= absl::ZeroDuration() || options_.is_master) continue;
    wire::Ping ping;
    ping.set_address(self_.address);
    ping.set_incarnation(self_.shm.incarnation);
    OutMessage m;
    *m.header.mutable_request() = wire::MakeRequest(ping);
    m.header.mutable_request()->set_from(self_.id);
    auto reply = impl_->SendTo(0, std::move(m), period).wait();
    if (reply.ok() && reply->header.response().has_error()) {
      if (impl_->finished_.HasBeenNotified()) break;
      const absl::Status refused = impl_->ErrorFromReply(reply->header.response());
      return absl::Status(refused.code(), absl::StrCat(refused.message(), "; stopping"));
    }
    if (reply.ok()) {
      last_contact = absl::Now();
    } else if (absl::Now() - last_contact > options_.master_timeout) {
      if (impl_->finished_.HasBeenNotified()) break;
      return absl::UnavailableError(absl::StrCat(
          "worker '", self_.name, "': the master '", NameOf(0), "' has not answered for ",
          absl::FormatDuration(absl::Trunc(absl::Now() - last_contact, absl::Milliseconds(100))), " (",
          reply.status().message(),
          "); the group is gone, stopping"));
    }
  }
  base::MutexLock lock(impl_->abort_mu_);
  if (impl_->abort_signal_ > 0) {
    return absl::CancelledError(absl::StrCat("worker '", self_.name, "': the master '", NameOf(0),
                                             "' was stopped and ended the group: ", impl_->abort_error_));
  }
  if (!impl_->abort_error_.empty()) {
    return absl::AbortedError(absl::StrCat("worker '", self_.name, "': the master '", NameOf(0),
                                           "' failed and ended the group: ", impl_->abort_error_));
  }
  return absl::OkStatus();
}

int Agent::group_ended_by_signal() const {
  base::MutexLock lock(impl_->abort_mu_);
  return impl_->abort_signal_;
}

void Agent::RequireRestart(const absl::Status& why) {
  if (why.ok()) return;
  base::MutexLock lock(impl_->abort_mu_);
  if (impl_->restart_.ok()) impl_->restart_ = why;
}

absl::Status Agent::restart_required() const {
  absl::Status why;
  {
    base::MutexLock lock(impl_->abort_mu_);
    why = impl_->restart_;
  }
  if (why.ok() && impl_->cuda_) why = impl_->cuda_->Stuck();
  if (why.ok()) return why;
  return base::Annotate(why, absl::StrCat("worker '", self_.name, "' must be restarted"));
}

void Agent::Abort(const absl::Status& why) {
  if (!impl_->server_) return;
  TellGroupEnded(why);
  impl_->Stop();
}

void Agent::TellGroupEnded(const absl::Status& why, int signal) {
  if (!impl_->server_ || !options_.is_master) return;
  if (!impl_->joined_.HasBeenNotified() &&
      impl_->EndJoining(absl::StrCat("the master ", signal > 0 ? "was stopped" : "failed",
                                     " before the group formed: ", why.message()),
                        signal)) {
    // The replies are only queued: a signal's caller ends the process
    // next, so the server stops now, which waits for them to be written
    // (Abort's Stop does so anyway).
    if (signal > 0) impl_->server_->Shutdown(DeadlineIn(absl::Seconds(1)));
    return;
  }
  // (Formed meanwhile: told as members once the book is set.)
  impl_->joined_.WaitForNotificationWithTimeout(absl::Seconds(2));
  impl_->FinishWorkers(std::string(why.message()), absl::Seconds(2), signal);
}

void Agent::Impl::FinishWorkers(const std::string& error, absl::Duration timeout, int signal) {
  wire::ShutdownFinish finish;
  finish.set_error(error);
  finish.set_signal(signal);
  TellMembers(finish, agent_->self_.id, timeout);  // (a worker that does not answer is already gone)
}

absl::Status Agent::Shutdown(bool graceful) {
  if (!impl_->server_) return absl::OkStatus();  // already stopped
  absl::Status status;
  if (graceful && impl_->joined_.HasBeenNotified()) {
    if (!options_.is_master) {
      status = WaitForShutdown();
    } else {
      const absl::Time deadline = absl::Now() + options_.shutdown_timeout;
      std::vector<base::WorkerInfo> others;
      for (const auto& w : workers()) {
        if (w.id != self_.id && !IsLost(w.name)) others.push_back(w);  // (the lost are gone)
      }
      bool release = true;
      int64_t last_active = 0;
      while (true) {
        if (release) rrefs_->ReleaseAllUsers();
        status = rrefs_->WaitDrained(deadline - absl::Now());
        if (!status.ok()) break;
        if (deadline - absl::Now() < absl::Milliseconds(50)) {
          status = absl::DeadlineExceededError(absl::StrCat(
              "shutdown: ", last_active, " calls still in flight after ",
              absl::FormatDuration(options_.shutdown_timeout),
              "; a worker is stuck in a call (raise shutdown_timeout if it is just slow)"));
          break;
        }
        int64_t active = active_calls();
        std::vector<Future<InMessage>> replies;
        for (const auto& w : others) {
          wire::ShutdownProbe probe;
          probe.set_release_users(release);
          OutMessage m;
          *m.header.mutable_request() = wire::MakeRequest(probe);
          m.header.mutable_request()->set_from(self_.id);
          replies.push_back(impl_->SendTo(w.id, std::move(m), deadline - absl::Now()));
        }
        release = false;
        std::vector<std::string> failed;
        for (size_t i = 0; i < replies.size(); ++i) {
          auto r = replies[i].wait();
          if (r.ok() && r->header.response().has_error()) {
            r = impl_->ErrorFromReply(r->header.response());
          }
          if (!r.ok()) {
            failed.push_back(absl::StrCat(others[i].name, " (", r.status().message(), ")"));
            continue;
          }
          active += r->header.response().active();
        }
        if (!failed.empty()) {
          status = absl::DeadlineExceededError(absl::StrCat(
              "shutdown: no answer from ", absl::StrJoin(failed, ", ")));
          break;
        }
        if (active == 0) break;
        last_active = active;
        absl::SleepFor(absl::Milliseconds(10));
      }
      // Tell every worker the group is done, even after an error.
      impl_->FinishWorkers("", absl::Seconds(5));
    }
  }
  if (absl::Status why = restart_required(); !why.ok()) {
    if (status.ok()) status = why;  // (the group ended meanwhile: the program must not exit 0)
    // Work that waits on this process's GPU may never end: the stop (which
    // runs what is queued) gets 10 s, then the process ends here.
    auto stopped = std::make_shared<absl::Notification>();
    std::thread([impl = impl_.get(), stopped] {
      impl->Stop();
      stopped->Notify();
    }).detach();
    if (!stopped->WaitForNotificationWithTimeout(absl::Seconds(10))) {
      std::cerr << status.message() << " (its stop did not end within 10 s: exiting now)" << std::endl;
      std::fflush(nullptr);
      _exit(1);
    }
    return status;
  }
  impl_->Stop();
  return status;
}

}  // namespace remora::rpc
