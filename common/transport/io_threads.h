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
// Thread-safety: context(i), pick() and on_io_thread() may be called from
// any thread. stop() must not be called from one of the I/O threads.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

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
  // Lets every context run out of work (no more pending operations or
  // handlers), then joins the threads. The owner first closes every I/O
  // object (sockets, timers) served here, so the contexts drain. Idempotent.
  void join_when_idle();
  // Stops every context at once and joins the threads; handlers still
  // queued are destroyed without running (when the contexts are destroyed).
  // Idempotent.
  void stop();

 private:
  IoThreads() = default;
  using Guard = boost::asio::executor_work_guard<boost::asio::io_context::executor_type>;
  std::vector<std::unique_ptr<boost::asio::io_context>> contexts_;
  std::vector<Guard> guards_;
  std::vector<std::thread> threads_;
  std::atomic<std::uint32_t> next_{0};
  bool stopped_ = false;
};

}  // namespace ember::transport
