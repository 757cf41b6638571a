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

  // Tasks scheduled or running right now.
  int busy() const;

 private:
  void Loop();

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// The process's compute lane. A worker process hosts pipeline stages and
// behaves as one device: forward passes, backward passes and optimizer
// steps hold a ComputeTurn, so that they run one at a time, each with all
// the intra-op threads, instead of many at once fighting over the cores
// (measured: 8 concurrent backward passes on a 1-thread worker made a
// ResNet50 step twice as slow). Turns are served first come, first served:
// with interleaved stages the order matters, and a simulation of the
// 2-worker, 4-stage pipeline finished a batch about 1% sooner in arrival
// order than in the arbitrary order of a plain mutex. Never hold a turn
// while waiting on another process.
//
// Thread-safety: a turn is taken and given back on one thread; any number
// of threads may wait.
class ComputeTurn {
 public:
  ComputeTurn();   // blocks until every earlier turn has ended
  ~ComputeTurn();  // lets the next one run
  ComputeTurn(const ComputeTurn&) = delete;
  ComputeTurn& operator=(const ComputeTurn&) = delete;

  // Turns held or waited for right now in this process (tests, diagnostics).
  static int64_t Queued();

 private:
  uint64_t ticket_;
};

}  // namespace remora
