// remora::MutexLock: a scoped lock of an absl::Mutex taken by reference.
//
// absl::MutexLock takes a pointer in Debian 12's Abseil (20220623); Abseil
// 2025 and later take a reference and deprecate the pointer form (and
// Mutex::Lock/Unlock, for lock/unlock), so no one spelling builds cleanly
// on both. This one does, and carries the same thread-safety annotations:
// { MutexLock lock(mu_); ... } holds mu_ until the end of the scope.

#ifndef REMORA_RPC_MUTEX_LOCK_H_
#define REMORA_RPC_MUTEX_LOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace remora::base {
namespace mutex_lock_internal {

// Mutex::lock() where Abseil has it, else Mutex::Lock(); likewise unlock.
template <typename M>
ABSL_NO_THREAD_SAFETY_ANALYSIS auto Lock(M& mu, int) -> decltype(mu.lock()) {
  mu.lock();
}
template <typename M>
ABSL_NO_THREAD_SAFETY_ANALYSIS void Lock(M& mu, long) {
  mu.Lock();
}
template <typename M>
ABSL_NO_THREAD_SAFETY_ANALYSIS auto Unlock(M& mu, int) -> decltype(mu.unlock()) {
  mu.unlock();
}
template <typename M>
ABSL_NO_THREAD_SAFETY_ANALYSIS void Unlock(M& mu, long) {
  mu.Unlock();
}

}  // namespace mutex_lock_internal

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(absl::Mutex& mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) ABSL_NO_THREAD_SAFETY_ANALYSIS
      : mu_(mu) {
    mutex_lock_internal::Lock(mu_, 0);
  }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    mutex_lock_internal::Unlock(mu_, 0);
  }

  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  absl::Mutex& mu_;
};

}  // namespace remora::base

#endif  // REMORA_RPC_MUTEX_LOCK_H_
