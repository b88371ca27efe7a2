// AsioRingWaiter: awaits "the ring has items" from a Boost.Asio io_context
// instead of blocking a thread in pop_wait().
//
// It owns a boost::asio::posix::stream_descriptor on a dup() of the ring's
// eventfd and runs the Parker protocol around an async wait for
// readability: prepare_to_park(); if the ring is already non-empty the
// completion is posted at once, otherwise async_wait(wait_read) and
// finish_park() when it completes. A producer's notify() makes the eventfd
// readable, which completes the wait on the io_context.
//
// Usage (consumer runs on the io_context):
//   auto waiter = AsioRingWaiter<Ring>::create(io.get_executor(), *ring).value();
//   std::function<void(boost::system::error_code)> on_ready = [&](auto ec) {
//     if (ec) return;                        // cancelled
//     ring->consume(handle, 256);            // drain
//     waiter.async_wait(on_ready);           // and wait again
//   };
//   waiter.async_wait(on_ready);
//
// Ring is any type with prepare_to_park(), finish_park() and wake_fd() with
// BlockingMpscRing's contracts. Only one wait may be outstanding (the ring
// has one consumer). The completion signature is
// void(boost::system::error_code); the handler runs on the waiter's executor
// (an operation_aborted error after cancel() or destruction of the waiter).
//
// Thread-safety: the waiter is used from the io_context's thread(s) like any
// Asio I/O object (not concurrently). The ring must outlive the waiter.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <utility>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/system/error_code.hpp>

#include "common/base/error.h"

namespace ember::ring {

template <typename Ring>
class AsioRingWaiter {
 public:
  // Errors: kIo when dup() of the eventfd fails (EMFILE: raise ulimit -n).
  static Result<AsioRingWaiter> create(const boost::asio::any_io_executor& executor, Ring& ring) {
    const int fd = ::dup(ring.wake_fd());
    if (fd < 0) return make_sys_error(errno, "duplicating the ring's eventfd for Asio failed");
    boost::asio::posix::stream_descriptor descriptor(executor);
    boost::system::error_code ec;
    descriptor.assign(fd, ec);  // takes ownership of fd on success
    if (ec) {
      ::close(fd);
      return make_error(ErrorCode::kIo, "registering the ring's eventfd with Asio failed: {}",
                        ec.message());
    }
    return AsioRingWaiter(ring, std::move(descriptor));
  }

  AsioRingWaiter(AsioRingWaiter&&) noexcept = default;
  AsioRingWaiter& operator=(AsioRingWaiter&&) noexcept = default;

  // Completes with an empty error_code once the ring may hold items (at once,
  // through post(), if it already does). Spurious completions are possible
  // (a stale wake-up); the handler drains and waits again.
  template <typename CompletionToken>
  auto async_wait(CompletionToken&& token) {
    return boost::asio::async_initiate<CompletionToken, void(boost::system::error_code)>(
        [this](auto handler) {
          if (!ring_->prepare_to_park()) {
            boost::asio::post(descriptor_.get_executor(), [h = std::move(handler)]() mutable {
              std::move(h)(boost::system::error_code{});
            });
            return;
          }
          descriptor_.async_wait(
              boost::asio::posix::descriptor_base::wait_read,
              [ring = ring_, h = std::move(handler)](const boost::system::error_code& ec) mutable {
                ring->finish_park();
                std::move(h)(ec);
              });
        },
        token);
  }

  // Cancels an outstanding wait (its handler gets operation_aborted).
  void cancel() {
    boost::system::error_code ignored;
    descriptor_.cancel(ignored);
  }

  boost::asio::any_io_executor get_executor() { return descriptor_.get_executor(); }

 private:
  AsioRingWaiter(Ring& ring, boost::asio::posix::stream_descriptor descriptor)
      : ring_(&ring), descriptor_(std::move(descriptor)) {}

  Ring* ring_;
  boost::asio::posix::stream_descriptor descriptor_;
};

}  // namespace ember::ring
