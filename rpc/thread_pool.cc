#include "rpc/thread_pool.h"

#include <pthread.h>

#include <iostream>

#include "absl/time/clock.h"
#include "base/mutex_lock.h"
#include "base/spin.h"
#include "base/status_util.h"

namespace remora::rpc {

void ReportEscapedException(const char* where) {
  const absl::Status status = base::StatusFromCurrentException(where);
  std::cerr << "remora: " << status.message()
            << " (caught before it could end the process; what it was to complete is left undone, "
               "and the caller's timeout reports it: this is a bug, please report it)"
            << std::endl;
}

ThreadPool::ThreadPool(int num_threads, absl::Duration spin) : spin_(spin) {
  if (num_threads < 1) num_threads = 1;
  threads_.reserve(num_threads + 1);
  for (int i = 0; i <= num_threads; ++i) {
    const bool lane = i == num_threads;
    threads_.emplace_back([this, lane] {
      pthread_setname_np(pthread_self(), lane ? kLaneThreadName : kThreadName);
      Loop(lane);
    });
  }
}

ThreadPool::~ThreadPool() { Stop(); }

void ThreadPool::Stop() {
  base::MutexLock stop(stop_mu_);
  stop_asked_.store(true, std::memory_order_release);
  {
    base::MutexLock lock(mu_);
    stopping_ = true;
  }
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void ThreadPool::Schedule(std::function<void()> task) {
  base::MutexLock lock(mu_);
  queue_.push_back(std::move(task));
  pending_.fetch_add(1, std::memory_order_release);
}

void ThreadPool::Lane::Schedule(std::function<void()> task) {
  base::MutexLock lock(pool_->mu_);
  pool_->lane_queue_.push_back(std::move(task));
  pool_->lane_pending_.fetch_add(1, std::memory_order_release);
}

int ThreadPool::busy() const {
  base::MutexLock lock(mu_);
  return running_ + static_cast<int>(queue_.size() + lane_queue_.size());
}

// A running task may still schedule more, on the pool or on the lane: no
// thread leaves while one runs. Once one leaves, all do (exiting_), and
// what is scheduled later from outside is dropped: a thread that waited
// for its own queue would otherwise wait forever on a task left on the
// queue of a thread already gone.
bool ThreadPool::DrainedLocked() const {
  return exiting_ || (stopping_ && running_ == 0 && queue_.empty() && lane_queue_.empty());
}

bool ThreadPool::Spin(bool lane) {
  std::atomic<int64_t>& pending = lane ? lane_pending_ : pending_;
  if (pending.load(std::memory_order_acquire) > 0) return false;
  if (!lane) {
    // One pool thread spins at a time; the others sleep at once.
    base::MutexLock lock(mu_);
    if (pool_spinners_ > 0 || !queue_.empty() || stopping_) return false;
    ++pool_spinners_;
  }
  base::SpinUntil(spin_, [&] {
    return pending.load(std::memory_order_acquire) > 0 || stop_asked_.load(std::memory_order_acquire);
  });
  return !lane;
}

void ThreadPool::Loop(bool lane) {
  const bool spins = spin_ > absl::ZeroDuration();
  while (true) {
    std::function<void()> task;
    const bool spun = spins && Spin(lane);
    {
      base::MutexLock lock(mu_);
      // (No longer spinning: the sleepers' condition counts this thread
      // out again, and the unlock that follows re-checks it.)
      if (spun) --pool_spinners_;
      auto ready = [this, lane]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        const bool waiting = lane ? !lane_queue_.empty() : queue_.size() > static_cast<size_t>(pool_spinners_);
        return waiting || DrainedLocked();
      };
      mu_.Await(absl::Condition(&ready));
      if (DrainedLocked()) {  // stopping, and nothing left anywhere
        exiting_ = true;
        return;
      }
      std::deque<std::function<void()>>& queue = lane ? lane_queue_ : queue_;
      task = std::move(queue.front());
      queue.pop_front();
      (lane ? lane_pending_ : pending_).fetch_sub(1, std::memory_order_relaxed);
      ++running_;
    }
    try {
      task();
    } catch (...) {
      ReportEscapedException(lane ? "a task on the agent's lane threw" : "a task on the agent's thread pool threw");
    }
    task = nullptr;  // destroy captures outside the lock
    base::MutexLock lock(mu_);
    --running_;
  }
}

}  // namespace remora::rpc
