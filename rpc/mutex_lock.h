// remora::MutexLock: a scoped lock of an absl::Mutex taken by reference.
//
// absl::MutexLock takes a pointer in Debian 12's Abseil (20220623); Abseil
// 2025 and later take a reference and deprecate the pointer form, so
// neither spelling builds cleanly on both. This one does, and carries the
// same thread-safety annotations: { MutexLock lock(mu_); ... } holds mu_
// until the end of the scope.

#ifndef REMORA_RPC_MUTEX_LOCK_H_
#define REMORA_RPC_MUTEX_LOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace remora {

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(absl::Mutex& mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_.Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_.Unlock(); }

  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  absl::Mutex& mu_;
};

}  // namespace remora

#endif  // REMORA_RPC_MUTEX_LOCK_H_
