#include "base/mutex_lock.h"
#include "rpc/thread_pool.h"

#include <pthread.h>

namespace remora {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads < 1) num_threads = 1;
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this] {
      pthread_setname_np(pthread_self(), kThreadName);
      Loop();
    });
  }
}

ThreadPool::~ThreadPool() { Stop(); }

void ThreadPool::Stop() {
  MutexLock stop(stop_mu_);
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void ThreadPool::Schedule(std::function<void()> task) {
  MutexLock lock(mu_);
  queue_.push_back(std::move(task));
}

int ThreadPool::busy() const {
  MutexLock lock(mu_);
  return running_ + static_cast<int>(queue_.size());
}

void ThreadPool::Loop() {
  while (true) {
    std::function<void()> task;
    {
      MutexLock lock(mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    task();
    task = nullptr;  // destroy captures outside the lock
    MutexLock lock(mu_);
    --running_;
  }
}

}  // namespace remora
