// What a listener does with connections it cannot or will not keep: the
// bound on handshakes in progress, and RefusalLog, the log lines of refused
// connections, bounded.
//
// A peer that connects and sends no hello holds a descriptor until
// connect_timeout; without a bound, a client reconnecting in a loop could use
// up the server's descriptors and lock the workers out. Past
// kMaxPendingHandshakes, a listener drops its oldest handshake to make room:
// a worker's hello follows its connect within a round trip, so the oldest is
// the likeliest to be idle (the metrics endpoint bounds its sessions alike).
// Each refusal is one log line; a storm of them (a port scanner, idle peers
// dropped to make room) would flood the log, so RefusalLog writes at most
// kLinesPerWindow per kWindow, says when it starts counting instead, and logs
// the count at the window's end.
//
// Used by the tcp and shm transports' listeners.
//
// Thread-safety: none; every call comes from the one I/O thread that runs the
// listener's io_context (as for AcceptPacer). The count at a window's end is
// logged from that context by a timer, which cancel() or the destructor drops.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <spdlog/common.h>

#include "common/base/error.h"

namespace spdlog {
class logger;
}

namespace ember::transport {

// Handshakes a listener holds in progress at most (see above).
inline constexpr std::size_t kMaxPendingHandshakes = 256;

// The reason given for the oldest handshake dropped to make room (kUnavailable).
Error handshake_dropped_for_room();

class RefusalLog {
 public:
  static constexpr std::size_t kLinesPerWindow = 20;
  static constexpr std::chrono::seconds kWindow{10};

  // Lines begin with `what` (e.g. "listener 127.0.0.1:7070"). `window`:
  // kWindow, shorter in tests.
  RefusalLog(std::shared_ptr<spdlog::logger> log, std::string what,
             std::chrono::nanoseconds window = kWindow);
  ~RefusalLog();
  RefusalLog(const RefusalLog&) = delete;
  RefusalLog& operator=(const RefusalLog&) = delete;

  // Logs "<what>: <line>" at `level`, or counts it when kLinesPerWindow lines
  // were logged in the current window (the first one counted is announced,
  // and a timer on `ctx` logs the count when the window ends).
  void log(boost::asio::io_context& ctx, spdlog::level::level_enum level, std::string_view line);

  // Drops a pending count (it is not logged), and arms no timer after it;
  // for the listener's close.
  void cancel();

 private:
  struct Counts;  // shared with the timer's handler
  std::shared_ptr<Counts> counts_;
  std::unique_ptr<boost::asio::steady_timer> timer_;
  bool cancelled_ = false;
};

}  // namespace ember::transport
