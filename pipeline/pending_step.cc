// The step protocol's waits on the master: the replies a step owes, the
// first failure among them and its root cause, and the liveness probes of
// workers that stay silent (pipeline/pending_step.h, pipeline/pipeline.h).
#include "pipeline/pending_step.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "pipeline/pipeline.h"
#include "rpc/future.h"

namespace remora::pipeline {

namespace {

// Waits until every reply has come or one has failed; returns the index of
// the first that failed (with its error in `status`), or -1. While replies
// are pending, every `probe_every` each worker still owing one is probed
// ("remora.pipeline.alive"), and one that does not answer within
// `probe_timeout` (stopped, hung, cut off) is the failure, named.
int FirstFailure(rpc::Agent& agent, const std::vector<std::string>& workers,
                 std::vector<rpc::Future<c10::IValue>>& replies, absl::Status* status,
                 absl::Duration probe_every, absl::Duration probe_timeout) {
  // (Replies due within microseconds are looked for before this thread
  // sleeps, where the agent busy-polls.)
  if (const int polled = rpc::PollForOutcome(replies, agent.busy_poll(), status); polled != rpc::kPollStillPending) {
    return polled == rpc::kPollAllSucceeded ? -1 : polled;
  }
  struct Outcome {
    absl::Mutex mu;
    std::vector<bool> replied ABSL_GUARDED_BY(mu);
    int first_failed ABSL_GUARDED_BY(mu) = -1;
    absl::Status status ABSL_GUARDED_BY(mu);
  };
  auto outcome = std::make_shared<Outcome>();
  {
    base::MutexLock lock(outcome->mu);
    outcome->replied.assign(replies.size(), false);
  }
  for (size_t i = 0; i < replies.size(); ++i) {
    replies[i].then([outcome, i](const absl::StatusOr<c10::IValue>& r) {
      base::MutexLock lock(outcome->mu);
      outcome->replied[i] = true;
      if (!r.ok() && outcome->first_failed < 0) {
        outcome->first_failed = static_cast<int>(i);
        outcome->status = r.status();
      }
    });
  }
  auto settled = +[](Outcome* o) ABSL_EXCLUSIVE_LOCKS_REQUIRED(o->mu) {
    return o->first_failed >= 0 ||
           std::find(o->replied.begin(), o->replied.end(), false) == o->replied.end();
  };
  for (;;) {
    std::vector<size_t> owing;
    {
      base::MutexLock lock(outcome->mu);
      if (outcome->mu.AwaitWithTimeout(absl::Condition(settled, outcome.get()), probe_every)) {
        if (outcome->first_failed >= 0) *status = outcome->status;
        return outcome->first_failed;
      }
      for (size_t i = 0; i < replies.size(); ++i) {
        if (!outcome->replied[i]) owing.push_back(i);
      }
    }
    // A worker that is stopped or hung answers nothing, and nothing else
    // would tell: probe those that still owe their reply.
    std::vector<rpc::Future<c10::IValue>> probes;
    rpc::CallOptions quick;
    quick.timeout = probe_timeout;
    for (size_t i : owing) {
      probes.push_back(agent.rpc_async(workers[i], "remora.pipeline.alive", {}, quick));
    }
    for (size_t k = 0; k < owing.size(); ++k) {
      if (auto r = probes[k].wait(); !r.ok()) {
        *status = absl::DeadlineExceededError(absl::StrCat(
            "worker '", workers[owing[k]], "' did not answer a liveness probe within ",
            absl::FormatDuration(probe_timeout), " while its reply was awaited (is it stopped, "
            "hung or cut off?): ", r.status().message()));
        return static_cast<int>(owing[k]);
      }
    }
  }
}

// After the first failure (`first`, `*status`) and the abandon: the failure
// to report. A worker that could not be reached (UNAVAILABLE: dead, cut
// off) caused the others' failures, so its error wins when it comes within
// `grace`; returns its index, else `first`.
int RootFailure(std::vector<rpc::Future<c10::IValue>>& replies, int first, absl::Status* status,
                absl::Duration grace) {
  if (status->code() == absl::StatusCode::kUnavailable) return first;
  const absl::Time deadline = absl::Now() + grace;
  for (size_t i = 0; i < replies.size(); ++i) {
    if (static_cast<int>(i) == first) continue;
    auto r = replies[i].wait_for(std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!r.ok() && r.status().code() == absl::StatusCode::kUnavailable) {
      *status = r.status();
      return static_cast<int>(i);
    }
  }
  return first;
}

}  // namespace

std::vector<std::string> UnansweringWorkers(rpc::Agent& agent, const std::vector<std::string>& workers,
                                            absl::Duration timeout, std::vector<absl::Status>* why) {
  rpc::CallOptions quick;
  quick.timeout = timeout;
  std::vector<std::pair<std::string, rpc::Future<c10::IValue>>> probes;
  for (const auto& w : workers) {
    if (std::none_of(probes.begin(), probes.end(), [&w](const auto& p) { return p.first == w; })) {
      probes.emplace_back(w, agent.rpc_async(w, "remora.pipeline.alive", {}, quick));
    }
  }
  std::vector<std::string> silent;
  for (auto& [name, reply] : probes) {
    const absl::StatusOr<c10::IValue>& answer = reply.wait();
    if (answer.ok()) continue;
    silent.push_back(name);
    if (why != nullptr) why->push_back(answer.status());
  }
  return silent;
}

int WaitForReplies(rpc::Agent& agent, const std::vector<std::string>& workers,
                   std::vector<rpc::Future<c10::IValue>>& replies, const std::function<void()>& abandon,
                   absl::Status* status) {
  int failed = FirstFailure(agent, workers, replies, status, absl::Seconds(2), absl::Seconds(5));
  if (failed < 0) return -1;
  abandon();
  return RootFailure(replies, failed, status, absl::Seconds(2));
}

PendingStep PendingStep::Done(absl::StatusOr<double> loss) { return PendingStep(std::move(loss)); }

PendingStep::PendingStep(rpc::Agent& agent, std::vector<std::string> workers,
                         std::vector<rpc::Future<c10::IValue>> replies, std::vector<int> loss_replies,
                         std::function<void()> abandon, Where where, std::function<void()> over)
    : agent_(&agent),
      workers_(std::move(workers)),
      replies_(std::move(replies)),
      loss_replies_(std::move(loss_replies)),
      abandon_(std::move(abandon)),
      where_(std::move(where)),
      over_(std::move(over)) {}

absl::StatusOr<double> PendingStep::wait() {
  if (done_) return *done_;
  // The first error (a worker's own: the others are told to abandon the
  // batch only after it) is the step's.
  absl::Status status;
  if (const int i = WaitForReplies(*agent_, workers_, replies_, abandon_, &status); i >= 0) {
    done_ = base::Annotate(status, where_(i));
  } else {
    // (A reply is the loss, or [loss, gradient norm] with clipping; every
    // replica's norm is the same: after their sum.)
    double loss = 0;
    for (int i : loss_replies_) {
      const c10::IValue reply = *replies_[i].wait();
      if (reply.isDouble()) {
        loss += reply.toDouble();
      } else {
        const std::vector<double> pair = reply.toDoubleVector();  // (a tuple travels as a list)
        loss += pair.at(0);
        grad_norm_ = pair.at(1);
      }
    }
    done_ = loss;
  }
  if (over_) over_();
  return *done_;
}

void PendingStep::abandon() {
  if (!done_ && abandon_) abandon_();
}

StartedStep Started(PendingStep pending) {
  if (pending.over_at_start()) return StartedStep::Done(pending.wait());
  auto step = std::make_shared<PendingStep>(std::move(pending));
  return StartedStep([step] { return step->wait(); }, [step] { step->abandon(); }, /*over_at_start=*/false,
                     [step] { return step->grad_norm(); });
}

}  // namespace remora::pipeline
