// FlowControl: the bound on bytes a Connection holds for a slow receiver
// (Options::max_queued_bytes).
//
// acquire() reserves message bytes before they are queued; release() gives
// them back once they are written (tcp) or released by the peer (shm). A
// request that would take the total over the limit waits, unless nothing is
// queued at all (so one message larger than the limit still goes through,
// alone). The uncontended path is one CAS; a releaser takes the mutex only
// when a waiter is registered.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "common/base/error.h"

namespace ember::transport {

class FlowControl {
 public:
  explicit FlowControl(std::uint64_t max_queued_bytes) : max_(max_queued_bytes) {}

  // Reserves `bytes`. When the limit is reached, waits up to `wait` if
  // may_wait (never pass true on an I/O thread: the bytes it would wait for
  // are released there). Errors: kTimeout (limit still reached after the
  // wait, or at once when !may_wait or wait == 0), kClosed (close() was called).
  Status acquire(std::uint64_t bytes, std::chrono::nanoseconds wait, bool may_wait);
  // Returns `bytes` taken by acquire().
  void release(std::uint64_t bytes) noexcept;
  // Fails current and future waits with kClosed (acquire without waiting
  // still succeeds or fails on the count alone: closed Connections check
  // their own flag first).
  void close() noexcept;

  std::uint64_t queued_bytes() const noexcept { return queued_.load(std::memory_order_relaxed); }
  std::uint64_t high_water_bytes() const noexcept {
    return high_water_.load(std::memory_order_relaxed);
  }
  std::uint64_t max_bytes() const noexcept { return max_; }

 private:
  bool try_take(std::uint64_t bytes) noexcept;

  const std::uint64_t max_;
  std::atomic<std::uint64_t> queued_{0};
  std::atomic<std::uint64_t> high_water_{0};
  std::atomic<std::uint32_t> waiters_{0};
  std::atomic<bool> closed_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace ember::transport
