// IoThreads: the I/O threads of a Transport, one boost::asio::io_context each
// (no context is shared between threads, so handlers on one context never
// run concurrently and need no strand).
//
// Each thread runs its context until stop(); the contexts hold a work guard,
// so they do not return while idle. Thread i is pinned to cpu_affinity[i %
// size] when the list is non-empty (a failure is logged once, not fatal:
// containers often forbid some CPUs).
//
// Busy polling: with busy_poll > 0 a thread that ran out of ready handlers
// keeps polling its context (a non-blocking epoll_wait, then sched_yield())
// for up to busy_poll before it blocks in epoll_wait. A blocked thread costs
// a wake-up on the next event (about 40 us on a virtual machine); a polling
// one sees it at once. The same trade as Linux's SO_BUSY_POLL.
//
// Posting: work for a context goes through post(), never straight to
// boost::asio::post, from any thread that is not one of these I/O threads.
// Once join_when_idle() or stop() began, such a post is refused (false) and
// its handler destroyed on the caller's thread: queued behind a thread that
// has already left, it would never run and, holding what owns this object
// (a Connection, a Listener, their Transport's core), never be freed either.
// An I/O thread's own posts always go through: it is running, and the owner
// joins only once every I/O object is gone and the last on_closed returned
// (tcp and shm count a Connection's last part until then), so the handlers
// still running at the join post nothing to another context.
//
// Thread-safety: context(i), pick(), post() and on_io_thread() may be called
// from any thread. stop() must not be called from one of the I/O threads.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include "common/base/error.h"

namespace ember::transport {

class IoThreads {
 public:
  // Starts `num_threads` threads named "ember-io-<i>". Errors: kIo when a
  // thread cannot be started (std::system_error is caught here).
  static Result<std::unique_ptr<IoThreads>> start(
      std::uint32_t num_threads, const std::vector<int>& cpu_affinity,
      std::chrono::nanoseconds busy_poll = std::chrono::nanoseconds{0});
  ~IoThreads();  // stop()
  IoThreads(const IoThreads&) = delete;
  IoThreads& operator=(const IoThreads&) = delete;

  std::uint32_t size() const noexcept { return static_cast<std::uint32_t>(contexts_.size()); }
  boost::asio::io_context& context(std::uint32_t index) { return *contexts_[index % size()]; }
  // Round-robin choice of a context for a new stream.
  boost::asio::io_context& pick() {
    return context(next_.fetch_add(1, std::memory_order_relaxed));
  }
  // True on any I/O thread of any IoThreads in this process... of this one.
  bool on_io_thread() const noexcept;
  // Queues `handler` on `ctx` (one of context(i)). False, with the handler
  // not run and destroyed by the caller, when called off the I/O threads
  // after join_when_idle() or stop() began (see the top of this file). Never
  // blocks; thread-safe.
  template <class Handler>
  [[nodiscard]] bool post(boost::asio::io_context& ctx, Handler&& handler) {
    if (on_io_thread()) {
      boost::asio::post(ctx, std::forward<Handler>(handler));
      return true;
    }
    // Pairs with close_gate(): either it sees this poster counted and waits
    // until it is done, or this poster sees the gate closed (both seq_cst).
    posting_.fetch_add(1, std::memory_order_seq_cst);
    const bool open = !gate_closed_.load(std::memory_order_seq_cst);
    if (open) boost::asio::post(ctx, std::forward<Handler>(handler));
    posting_.fetch_sub(1, std::memory_order_release);  // pairs with close_gate's acquire
    return open;
  }
  // Lets every context run out of work (no more pending operations or
  // handlers), then joins the threads. The owner first closes every I/O
  // object (sockets, timers) served here, so the contexts drain. Idempotent.
  void join_when_idle();
  // Stops every context at once and joins the threads; handlers still
  // queued are destroyed without running (when the contexts are destroyed).
  // Idempotent.
  void stop();
  // Refuses post() from other threads from now on and waits (spinning: a
  // post takes microseconds) for those already past the check. Both calls
  // above do it first; an owner that still drains its contexts with posts of
  // its own (boost::asio::post) before stop() calls it once every I/O object
  // is closed: what others queued before runs ahead of those posts (each
  // context is FIFO). Idempotent; any thread.
  void close_gate() noexcept;

 private:
  IoThreads() = default;
  using Guard = boost::asio::executor_work_guard<boost::asio::io_context::executor_type>;
  std::vector<std::unique_ptr<boost::asio::io_context>> contexts_;
  std::vector<Guard> guards_;
  std::vector<std::thread> threads_;
  std::atomic<std::uint32_t> next_{0};
  std::atomic<bool> gate_closed_{false};
  std::atomic<std::uint32_t> posting_{0};  // threads inside post() past the increment
  bool stopped_ = false;
};

}  // namespace ember::transport
