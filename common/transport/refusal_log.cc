#include "common/transport/refusal_log.h"

#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace ember::transport {
namespace {

std::int64_t to_ms(std::chrono::nanoseconds d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

}  // namespace

struct RefusalLog::Counts {
  std::shared_ptr<spdlog::logger> log;
  std::string what;
  std::chrono::nanoseconds window{};
  std::chrono::steady_clock::time_point window_start{};
  std::size_t logged = 0;      // lines logged in the window
  std::uint64_t unlogged = 0;  // refusals counted instead; the timer runs while > 0
};

Error handshake_dropped_for_room() {
  return Error(ErrorCode::kUnavailable,
               fmt::format("dropped to make room for a new connection: {} handshakes were in "
                           "progress, the most a listener holds (a peer that connects and sends no "
                           "hello holds one for connect_timeout)",
                           kMaxPendingHandshakes));
}

RefusalLog::RefusalLog(std::shared_ptr<spdlog::logger> log, std::string what,
                       std::chrono::nanoseconds window)
    : counts_(std::make_shared<Counts>()) {
  counts_->log = std::move(log);
  counts_->what = std::move(what);
  counts_->window = window;
}

RefusalLog::~RefusalLog() { cancel(); }

void RefusalLog::log(boost::asio::io_context& ctx, spdlog::level::level_enum level,
                     std::string_view line) {
  Counts& c = *counts_;
  const auto now = std::chrono::steady_clock::now();
  if (c.unlogged == 0 && now - c.window_start >= c.window) {
    c.window_start = now;
    c.logged = 0;
  }
  if (c.logged < kLinesPerWindow) {
    ++c.logged;
    c.log->log(level, "{}: {}", c.what, line);
    return;
  }
  // After cancel() (the listener closing) nothing is armed: a pending timer
  // would hold the io_context's work, and the Transport's shutdown, open.
  if (cancelled_ || c.unlogged++ > 0) return;
  c.log->warn("{}: {} refused connections within {} ms; the others until then are counted, not "
              "logged",
              c.what, kLinesPerWindow, to_ms(c.window));
  if (!timer_) timer_ = std::make_unique<boost::asio::steady_timer>(ctx);
  timer_->expires_at(c.window_start + c.window);
  // The counts, not this: the handler may run after the listener is gone.
  timer_->async_wait([counts = counts_](const boost::system::error_code& ec) {
    if (ec) return;
    counts->log->warn("{}: {} more connection(s) refused in those {} ms, not logged", counts->what,
                      counts->unlogged, to_ms(counts->window));
    counts->unlogged = 0;
  });
}

void RefusalLog::cancel() {
  cancelled_ = true;
  if (timer_) timer_->cancel();
  timer_.reset();
  counts_->unlogged = 0;
}

}  // namespace ember::transport
