// AcceptPacer: what a listener does when accept() fails.
//
// A failed accept (EMFILE/ENFILE when the process or the system runs out of
// file descriptors, ENOBUFS, ENOMEM, ...) leaves the pending connection in
// the listen backlog and the listening socket readable, so accepting again at
// once would spin on the same error. The listener instead calls failed(),
// which logs one warning per episode and calls `retry` after kRetry on the
// listener's io_context; the first accept that succeeds afterwards calls
// succeeded(), which logs the recovery once. Connecting peers wait in the
// backlog meanwhile (workers up to their connect_timeout).
//
// Used by the tcp and shm transports' listeners and the server's metrics
// endpoint; the same pause as a libuv or nginx accept loop after EMFILE.
//
// Thread-safety: none; every call comes from the one I/O thread that runs
// `ctx`. The timer is created on the first failure and destroyed by cancel()
// or the destructor, on that thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

namespace spdlog {
class logger;
}

namespace ember::transport {

class AcceptPacer {
 public:
  // The pause between a failed accept and the next try.
  static constexpr std::chrono::milliseconds kRetry{100};

  // `log` receives the warning and the recovery line, which begin with
  // `what` (for example "listener 127.0.0.1:7000" or "metrics endpoint").
  AcceptPacer(std::shared_ptr<spdlog::logger> log, std::string what);
  ~AcceptPacer();
  AcceptPacer(const AcceptPacer&) = delete;
  AcceptPacer& operator=(const AcceptPacer&) = delete;

  // An accept failed with `error` (its message): warns if this starts an
  // episode, then calls `retry` on `ctx` after kRetry unless cancel() runs
  // first. `retry` must check itself whether the listener closed meanwhile.
  void failed(boost::asio::io_context& ctx, std::string_view error, std::function<void()> retry);

  // An accept succeeded: ends an episode (logged once at info).
  void succeeded();

  // True between failed() and the next succeeded().
  bool failing() const noexcept { return failing_; }

  // Drops a pending retry (its `retry` is not called); for the listener's close.
  void cancel();

 private:
  std::shared_ptr<spdlog::logger> log_;
  std::string what_;
  std::unique_ptr<boost::asio::steady_timer> timer_;
  bool failing_ = false;
};

}  // namespace ember::transport
