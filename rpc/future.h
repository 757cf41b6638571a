// Future<T>: the result of an asynchronous operation, a value or an error.
//
// A future completes exactly once: the first SetValue/SetError wins and
// every later one returns false. wait() blocks until completion; then()
// registers a callback that runs once the future completes, on the future's
// executor (never on the thread that completed it, which may be one of
// gRPC's). A future without an executor runs callbacks inline; remora uses
// that only for its own short bookkeeping. A callback that throws is
// reported on stderr (ReportEscapedException), never ends the process.
//
// Thread-safety: every method may be called from any thread. Ownership:
// copies share one state; the state lives while any copy or pending
// callback holds it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/optional.h"
#include "base/mutex_lock.h"
#include "base/spin.h"
#include "base/status_util.h"
#include "rpc/thread_pool.h"

namespace remora::rpc {

// The value type of futures that carry no value.
struct Empty {};

template <typename T>
class Future {
 public:
  using Callback = std::function<void(const absl::StatusOr<T>&)>;

  // A pending future whose callbacks run on `executor` (may be null).
  explicit Future(Executor* executor = nullptr)
      : state_(std::make_shared<State>(executor)) {}

  static Future Ready(absl::StatusOr<T> result, Executor* executor = nullptr) {
    Future f(executor);
    f.Complete(std::move(result));
    return f;
  }

  bool SetValue(T value) { return Complete(std::move(value)); }
  bool SetError(absl::Status status) {
    if (status.ok()) status = absl::InternalError("SetError called with OK");
    return Complete(std::move(status));
  }
  // Completes with `result`; returns false when already completed.
  bool Complete(absl::StatusOr<T> result) {
    std::vector<Callback> callbacks;
    {
      base::MutexLock lock(state_->mu);
      if (state_->result.has_value()) return false;
      state_->result = std::move(result);
      callbacks.swap(state_->callbacks);
    }
    for (auto& cb : callbacks) Dispatch(std::move(cb));
    return true;
  }

  bool ready() const {
    base::MutexLock lock(state_->mu);
    return state_->result.has_value();
  }

  // Blocks until completed; returns the result (a copy).
  absl::StatusOr<T> wait() const {
    base::MutexLock lock(state_->mu);
    state_->mu.Await(absl::Condition(&HasValue, &state_->result));
    return *state_->result;
  }

  // Blocks at most `timeout`; DEADLINE_EXCEEDED when still pending.
  absl::StatusOr<T> wait_for(absl::Duration timeout) const {
    base::MutexLock lock(state_->mu);
    if (!state_->mu.AwaitWithTimeout(
            absl::Condition(&HasValue, &state_->result), timeout)) {
      return absl::DeadlineExceededError("future not completed in time");
    }
    return *state_->result;
  }

  // Runs `cb(result)` once completed, on the executor.
  void then(Callback cb) const {
    {
      base::MutexLock lock(state_->mu);
      if (!state_->result.has_value()) {
        state_->callbacks.push_back(std::move(cb));
        return;
      }
    }
    Dispatch(std::move(cb));
  }

  Executor* executor() const { return state_->executor; }

 private:
  struct State {
    explicit State(Executor* e) : executor(e) {}
    absl::Mutex mu;
    absl::optional<absl::StatusOr<T>> result ABSL_GUARDED_BY(mu);
    std::vector<Callback> callbacks ABSL_GUARDED_BY(mu);
    Executor* const executor;
  };

  static bool HasValue(absl::optional<absl::StatusOr<T>>* r) {
    return r->has_value();
  }

  // Runs `cb` with the (completed, immutable) result.
  void Dispatch(Callback cb) const {
    auto state = state_;
    auto run = [state, cb = std::move(cb)]() {
      const absl::StatusOr<T>* result;
      {
        base::MutexLock lock(state->mu);
        result = &*state->result;  // never changes once set
      }
      // (A callback that throws must not end the process: on a pool
      // thread, or inline on the completing one, which may be gRPC's.)
      try {
        cb(*result);
      } catch (...) {
        ReportEscapedException("a future's callback threw");
      }
    };
    if (state_->executor != nullptr) {
      state_->executor->Schedule(std::move(run));
    } else {
      run();
    }
  }

  std::shared_ptr<State> state_;
};

// Completes when every future in `futures` has; with the first error if any
// failed. Callbacks of the result run on `executor`.
template <typename T>
Future<Empty> WhenAll(const std::vector<Future<T>>& futures,
                      Executor* executor = nullptr) {
  Future<Empty> all(executor);
  if (futures.empty()) {
    all.SetValue(Empty{});
    return all;
  }
  struct Counter {
    absl::Mutex mu;
    size_t left ABSL_GUARDED_BY(mu);
    absl::Status first_error ABSL_GUARDED_BY(mu);
  };
  auto counter = std::make_shared<Counter>();
  {
    base::MutexLock lock(counter->mu);
    counter->left = futures.size();
  }
  for (const auto& f : futures) {
    f.then([counter, all](const absl::StatusOr<T>& r) mutable {
      absl::Status done_status;
      bool done = false;
      {
        base::MutexLock lock(counter->mu);
        if (!r.ok() && counter->first_error.ok()) counter->first_error = r.status();
        done = --counter->left == 0;
        done_status = counter->first_error;
      }
      if (done) {
        if (done_status.ok()) {
          all.SetValue(Empty{});
        } else {
          all.SetError(done_status);
        }
      }
    });
  }
  return all;
}

// What PollForOutcome found, beside a failed future's index.
inline constexpr int kPollAllSucceeded = -1;
inline constexpr int kPollStillPending = -2;

// Busy-polls `futures` (yielding the core) for up to `spin`, for a caller
// that would otherwise sleep on replies due within microseconds
// (AgentOptions::busy_poll): the index of a failed one (the lowest of those
// a look finds failed; its error in `*failure`), kPollAllSucceeded once
// every one has completed without failing, or kPollStillPending when
// `spin` ran out first (at once when it is not positive).
template <typename T>
int PollForOutcome(const std::vector<Future<T>>& futures, absl::Duration spin, absl::Status* failure) {
  std::vector<bool> done(futures.size(), false);
  size_t left = futures.size();
  int outcome = kPollStillPending;
  base::SpinUntil(spin, [&] {
    for (size_t i = 0; i < futures.size(); ++i) {
      if (done[i] || !futures[i].ready()) continue;
      if (absl::StatusOr<T> r = futures[i].wait(); !r.ok()) {
        *failure = r.status();
        outcome = static_cast<int>(i);
        return true;
      }
      done[i] = true;
      --left;
    }
    if (left == 0) outcome = kPollAllSucceeded;
    return left == 0;
  });
  return outcome;
}

// Fan-out's other half: waits for every future in `futures` — all of them,
// also after one failed, so that no call is left running — and returns
// their values in order, or the error of the first (in order) that failed,
// prefixed by `what(i)` when given (e.g. "saving owner file 1 on worker 'w2'").
template <typename T>
absl::StatusOr<std::vector<T>> WaitAll(const std::vector<Future<T>>& futures,
                                       const std::function<std::string(size_t)>& what = nullptr) {
  std::vector<T> values;
  values.reserve(futures.size());
  absl::Status first;
  for (size_t i = 0; i < futures.size(); ++i) {
    absl::StatusOr<T> r = futures[i].wait();
    if (!r.ok()) {
      if (first.ok()) first = what ? base::Annotate(r.status(), what(i)) : r.status();
    } else if (first.ok()) {
      values.push_back(*std::move(r));
    }
  }
  if (!first.ok()) return first;
  return values;
}

}  // namespace remora::rpc
