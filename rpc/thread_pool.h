// A fixed-size thread pool: where remora runs request handlers and user
// callbacks, so that neither ever runs on one of gRPC's threads. Beside its
// threads it has a lane: one more thread, which runs only the tasks
// scheduled through lane(), one at a time and in order.
//
// Thread-safety: Schedule() (the pool's and the lane's) may be called from
// any thread, including the pool's own. Ownership: the pool owns its threads
// and its lane; the destructor runs every task already scheduled, then joins.
// A task that throws does not end the process: the exception is reported
// (ReportEscapedException) and the thread runs the next task.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace remora::rpc {

// Reports the exception being handled (call only inside a catch block)
// that a task or a future's callback let escape, on stderr, naming
// `where`: what the pool and Future::then do instead of letting it reach
// std::terminate. Whatever that task was to complete is left undone (its
// caller's timeout reports it), so the message asks for a bug report.
void ReportEscapedException(const char* where);

// Something that runs closures later, on threads it owns.
class Executor {
 public:
  virtual ~Executor() = default;
  virtual void Schedule(std::function<void()> task) = 0;
};

class ThreadPool final : public Executor {
 public:
  // The name every pool thread carries (pthread_getname_np).
  static constexpr char kThreadName[] = "remora-pool";
  // The lane thread's name.
  static constexpr char kLaneThreadName[] = "remora-lane";

  // `spin`: how long the lane, and one of the pool's threads at a time,
  // once idle keep looking for their next task (yielding the core) before
  // they sleep (AgentOptions::busy_poll), so that a task scheduled finds a
  // thread awake: while one spins, a task scheduled wakes no sleeping
  // thread unless more are waiting than spinners to take them.
  explicit ThreadPool(int num_threads, absl::Duration spin = absl::ZeroDuration());
  ~ThreadPool() override;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> task) override;
  // The lane: runs what is scheduled through it on one thread of its own,
  // always the same, one task after the other. For work whose thread
  // matters: state that libraries keep per thread (cuDNN's execution plans
  // and handles, an OpenMP team per calling thread) is then built once.
  // Valid as long as the pool.
  Executor* lane() { return &lane_; }
  // Runs every task scheduled (also those the pool's and the lane's tasks
  // schedule meanwhile, on either), then joins the threads; the pool stays a
  // valid object for the tasks that still hold it. Afterwards tasks
  // scheduled are dropped unrun with the pool. Idempotent; the destructor
  // calls it. Not from a pool or lane thread.
  void Stop();

  // Tasks scheduled or running right now, the lane's included.
  int busy() const;

 private:
  class Lane final : public Executor {
   public:
    explicit Lane(ThreadPool* pool) : pool_(pool) {}
    void Schedule(std::function<void()> task) override;

   private:
    ThreadPool* const pool_;
  };

  // Runs the pool's queue, or the lane's (`lane`), until the pool stops
  // with nothing left to run anywhere.
  void Loop(bool lane);
  // Before the lane (`lane`) or a pool thread sleeps: busy-polls for up to
  // spin_ until its queue has a task; a pool thread only while no other
  // does. True when this pool thread spun (counted in pool_spinners_,
  // which its caller takes back under mu_).
  bool Spin(bool lane) ABSL_LOCKS_EXCLUDED(mu_);
  bool DrainedLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<std::function<void()>> lane_queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // on the threads and the lane
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool exiting_ ABSL_GUARDED_BY(mu_) = false;  // drained: every thread leaves
  const absl::Duration spin_;
  // Pool threads spinning (0 or 1): the sleeping ones wake only for tasks
  // beyond what the spinner takes.
  int pool_spinners_ ABSL_GUARDED_BY(mu_) = 0;
  // The tasks not yet taken (queue_'s and lane_queue_'s sizes, read without
  // mu_ by the spinning threads).
  std::atomic<int64_t> pending_{0};
  std::atomic<int64_t> lane_pending_{0};
  std::atomic<bool> stop_asked_{false};  // Stop() was called: spinners stop spinning
  Lane lane_{this};
  std::vector<std::thread> threads_;  // the lane's last
  absl::Mutex stop_mu_;  // one Stop joins at a time
};

}  // namespace remora::rpc
