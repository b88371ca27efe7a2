// Parker: lets one consumer thread sleep on an eventfd while its queue is
// empty, and producers wake it without a lost wake-up.
//
// Protocol (a Dekker-style handshake on `sleeping_` and the queue's
// positions, two seq_cst fences):
//   consumer (prepare_to_park):       producer (notify, after publishing):
//     sleeping_ = true                  [items published: release store]
//     fence(seq_cst)          <--->     fence(seq_cst)
//     if has_items(): sleeping_ = false, do not sleep
//     else: sleep until the eventfd     if sleeping_ and exchange(false):
//           is readable                      write(eventfd, 1)
// The two fences are ordered one way or the other in the single total order
// of seq_cst operations: either the producer's fence comes first, and the
// consumer's re-check sees the published items, or the consumer's fence comes
// first, and the producer sees sleeping_ == true and writes the eventfd. So a
// consumer never sleeps on a queue that holds items a producer has already
// notified about. The exchange makes only one producer per sleep pay for the
// write(2); a wake-up that races with a successful re-check leaves the
// eventfd readable, which only costs the next park a spurious return
// (finish_park() drains the counter and the caller re-checks).
// Producers pay one fence and one load of a line the consumer rarely writes;
// the system call happens only when the consumer really sleeps.
//
// The eventfd (fd()) can be awaited from an event loop instead of wait():
// call prepare_to_park(); if it returns true, wait until fd() is readable
// (epoll, Boost.Asio: see common/ring/asio_waiter.h), then finish_park().
//
// Thread-safety: notify() and wake() from any thread. prepare_to_park(),
// finish_park() and wait() from the single consumer thread.
// Blocking: notify() and wake() never block (one non-blocking write(2) at
// most); wait() blocks up to its timeout. No call allocates except create().
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

#include <sched.h>

#include "common/base/constants.h"
#include "common/base/error.h"

namespace ember::ring {

// How long a waiter polls before it sleeps. Polling is cheap when cores are
// idle and wasteful when threads outnumber cores (Ember's 8 producers on 2
// cores), where a spinning producer takes the core the consumer needs.
struct ParkOptions {
  // Consumer waiting for items (Parker::wait, BlockingMpscRing::*_wait):
  // polls with a pause instruction, then sched_yield() rounds, then sleep
  // on the eventfd.
  std::uint32_t spin_iterations = 128;
  std::uint32_t yield_iterations = 1;
  // Busy polling: after the phases above, keep polling with sched_yield()
  // between checks until this long has passed since the wait began, then
  // sleep. A wake-up through the eventfd costs about 40 us on a virtual
  // machine (two scheduler round trips, measured by bench/pushpull), so a
  // consumer that expects the next item within that window answers faster
  // by polling; sched_yield() hands the core to any other runnable thread,
  // so an oversubscribed machine loses little. Zero: no busy polling. The
  // same idea as Linux's SO_BUSY_POLL (net.core.busy_poll, in microseconds).
  std::chrono::nanoseconds busy_poll{0};
  // Producers waiting for space (BlockingMpscRing push_wait,
  // wait_for_space): the same phases, then sleep on the lane's futex.
  std::uint32_t producer_spin_iterations = 0;
  std::uint32_t producer_yield_iterations = 1;
};

class Parker {
 public:
  // Creates the eventfd (non-blocking, close-on-exec).
  // Errors: kIo when eventfd(2) fails (errno: EMFILE, ENFILE, ENOMEM).
  static Result<std::unique_ptr<Parker>> create(const ParkOptions& options = {});

  Parker(const Parker&) = delete;
  Parker& operator=(const Parker&) = delete;
  ~Parker();

  // Producer side: call after publishing items (after the release store
  // that makes them visible). Wakes the consumer if it is parked.
  void notify() noexcept {
    // seq_cst fence pairs with the fence in prepare_to_park() (see the
    // protocol above).
    fence_seq_cst();
    // relaxed load: ordered by the fence above. relaxed exchange: only
    // dedupes the write(2); item visibility comes from the queue's own
    // release/acquire positions.
    if (sleeping_.load(std::memory_order_relaxed) &&
        sleeping_.exchange(false, std::memory_order_relaxed)) {
      signal();
    }
  }

  // Any thread: makes the eventfd readable unconditionally, so a parked
  // consumer returns from wait() (shutdown, "look at your flags"). If no
  // wait() is in progress, the next one returns early.
  void wake() noexcept {
    // release pairs with the acquire exchange in wait().
    woken_.store(true, std::memory_order_release);
    signal();
  }

  // Consumer side: announces the intent to sleep and re-checks. Returns
  // false (not parked) when has_items() is already true; returns true when
  // the caller must now wait for fd() to become readable and then call
  // finish_park(). has_items() must read the queue's positions.
  template <typename HasItems>
  bool prepare_to_park(HasItems&& has_items) noexcept {
    // relaxed: ordered by the fence below.
    sleeping_.store(true, std::memory_order_relaxed);
    // seq_cst fence pairs with the fence in notify().
    fence_seq_cst();
    if (has_items()) {
      sleeping_.store(false, std::memory_order_relaxed);  // nobody needs to wake us
      return false;
    }
    // relaxed: statistic.
    parks_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // Consumer side, after fd() became readable (or the wait was abandoned):
  // clears the sleeping flag and drains the eventfd counter.
  void finish_park() noexcept;

  // Consumer side: returns true as soon as has_items() is true; spins, then
  // yields, then parks on the eventfd until notified or `timeout` has
  // passed (then returns has_items()). Spurious wake-ups are absorbed.
  // A wake() also ends the wait early, returning has_items().
  template <typename HasItems>
  bool wait(HasItems&& has_items, std::chrono::nanoseconds timeout) {
    for (std::uint32_t i = 0; i < options_.spin_iterations; ++i) {
      if (has_items()) return true;
      cpu_relax();
    }
    for (std::uint32_t i = 0; i < options_.yield_iterations; ++i) {
      if (has_items()) return true;
      sched_yield();
    }
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout;
    if (options_.busy_poll.count() > 0) {
      const auto poll_end = start + std::min(options_.busy_poll, timeout);
      while (std::chrono::steady_clock::now() < poll_end) {
        if (has_items()) return true;
        // acquire pairs with the release store in wake().
        if (woken_.load(std::memory_order_relaxed) && woken_.exchange(false, std::memory_order_acquire)) {
          return has_items();
        }
        sched_yield();
      }
    }
    while (true) {
      if (!prepare_to_park(has_items)) return true;
      const auto now = std::chrono::steady_clock::now();
      const bool readable = now < deadline && wait_readable(deadline - now);
      finish_park();
      if (has_items()) return true;
      // acquire pairs with the release store in wake().
      if (woken_.exchange(false, std::memory_order_acquire)) return false;
      // Not readable: timeout or EINTR. Readable without items: a stale
      // signal from a wake-up that raced with an earlier re-check.
      if (!readable && std::chrono::steady_clock::now() >= deadline) return false;
    }
  }

  // The eventfd; owned by the Parker (do not close it; dup() it to hand it to
  // an event loop that takes ownership).
  int fd() const noexcept { return fd_; }

  // Times the consumer committed to sleeping; times a producer or wake()
  // wrote the eventfd. Statistics, relaxed.
  std::uint64_t num_parks() const noexcept { return parks_.load(std::memory_order_relaxed); }
  std::uint64_t num_signals() const noexcept { return signals_.load(std::memory_order_relaxed); }

  // std::atomic_thread_fence(seq_cst). ThreadSanitizer does not model
  // fences (g++ warns with -Wtsan); that is harmless here because no plain
  // (non-atomic) data is published through these fences, only the decision
  // to sleep or to signal, and the items themselves travel through the
  // queue's release/acquire positions, which TSan does check.
  static void fence_seq_cst() noexcept {
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wtsan"
#endif
    std::atomic_thread_fence(std::memory_order_seq_cst);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  }

  static void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

 private:
  Parker(int fd, const ParkOptions& options) : fd_(fd), options_(options) {}

  void signal() noexcept;
  // Waits up to `timeout` for fd_ to become readable; false on timeout or
  // EINTR.
  bool wait_readable(std::chrono::nanoseconds timeout) noexcept;

  // Read by producers on every notify(); written by the consumer only around
  // a park, so it stays shared in the producers' caches.
  alignas(kFalseSharingBytes) std::atomic<bool> sleeping_{false};
  alignas(kFalseSharingBytes) int fd_;
  ParkOptions options_;
  std::atomic<bool> woken_{false};
  std::atomic<std::uint64_t> parks_{0};
  std::atomic<std::uint64_t> signals_{0};
};

// A sleep/wake flag on a futex, with the same Dekker-style protocol as
// Parker: the sleeper arms the flag, fences, re-checks its condition and
// only then sleeps; the waker changes the condition, fences, and wakes only
// if the flag is armed. Used by BlockingMpscRing for producers that wait for
// space in their lane (one FutexFlag per lane).
//
// Thread-safety: one sleeper at a time (arm/disarm/sleep), any number of
// wakers (armed_after_fence/wake). No call allocates; sleep() blocks.
class alignas(kFalseSharingBytes) FutexFlag {
 public:
  // Sleeper: announce the intent to sleep; then re-check the condition.
  void arm() noexcept {
    // relaxed: ordered by the fence; pairs with armed_after_fence().
    word_.store(1, std::memory_order_relaxed);
    Parker::fence_seq_cst();
  }
  // Sleeper: the condition held after all (or the sleep ended).
  void disarm() noexcept { word_.store(0, std::memory_order_relaxed); }
  // Sleeper, after arm() and a failed re-check: sleeps until wake() or
  // `timeout`. Returns at once if a wake() already came. Spurious returns
  // are possible; the caller re-checks.
  void sleep(std::chrono::nanoseconds timeout) noexcept;

  // Waker, after changing the condition: is a sleeper (about to be) asleep?
  bool armed_after_fence() const noexcept {
    Parker::fence_seq_cst();  // pairs with the fence in arm()
    return word_.load(std::memory_order_relaxed) != 0;  // ordered by the fence
  }
  // Waker: wakes the sleeper if still armed (one waker pays the syscall).
  void wake() noexcept;

  // Futex waits entered and wake-ups issued (statistics, relaxed).
  std::uint64_t num_sleeps() const noexcept { return sleeps_.load(std::memory_order_relaxed); }
  std::uint64_t num_wakes() const noexcept { return wakes_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::uint32_t> word_{0};
  std::atomic<std::uint64_t> sleeps_{0};
  std::atomic<std::uint64_t> wakes_{0};
};

}  // namespace ember::ring
