// A fixed-size thread pool: where remora runs request handlers and user
// callbacks, so that neither ever runs on one of gRPC's threads.
//
// Thread-safety: Schedule() may be called from any thread, including the
// pool's own. Ownership: the pool owns its threads; the destructor runs every
// task already scheduled, then joins.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace remora {

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

  explicit ThreadPool(int num_threads);
  ~ThreadPool() override;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> task) override;
  // Runs every task scheduled (also those the pool's tasks schedule
  // meanwhile), then joins the threads; the pool stays a valid object for
  // the tasks that still hold it. Afterwards tasks scheduled are dropped
  // unrun with the pool. Idempotent; the destructor calls it. Not from a
  // pool thread.
  void Stop();

  // Tasks scheduled or running right now.
  int busy() const;

 private:
  void Loop();

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
  absl::Mutex stop_mu_;  // one Stop joins at a time
};

}  // namespace remora
