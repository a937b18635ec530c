#pragma once
// Makes a new std::mutex one that a thread finding it taken spins on briefly before it sleeps
// (glibc's adaptive mutex). For a lock that several threads take for a few hundred nanoseconds
// each, many times per request (the ferry:// client's, taken by every lane for every answer): with
// a plain mutex the loser sleeps in the kernel and the holder pays a wake-up system call as it lets
// go, each longer than the work under the lock. It stays a std::mutex, so std::condition_variable
// and the standard locks take it as they are.
#include <mutex>
#include <type_traits>

#include <pthread.h>

namespace ferry::detail {

// `m`: constructed and never locked yet.
inline void make_adaptive([[maybe_unused]] std::mutex& m) noexcept {
#ifdef __GLIBC__  // PTHREAD_MUTEX_ADAPTIVE_NP is glibc's; elsewhere the mutex stays as it is
  static_assert(std::is_same_v<std::mutex::native_handle_type, pthread_mutex_t*>, "std::mutex is not a pthread mutex here");
  pthread_mutexattr_t a;
  pthread_mutexattr_init(&a);
  pthread_mutexattr_settype(&a, PTHREAD_MUTEX_ADAPTIVE_NP);
  pthread_mutex_init(m.native_handle(), &a);
  pthread_mutexattr_destroy(&a);
#endif
}

}  // namespace ferry::detail
