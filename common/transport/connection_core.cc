// ConnectionCore, TransportRegistry and the shared error texts; see
// connection_core.h.
#include "common/transport/connection_core.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>

#include <boost/asio/post.hpp>

#include "common/base/units.h"

namespace ember::transport {

Error heartbeat_timeout_error(std::string_view source, std::chrono::nanoseconds silent) {
  return Error(ErrorCode::kTimeout,
               fmt::format("nothing received from {} for {} ms (heartbeat_timeout): the peer is dead "
                           "or stalled; see {}",
                           source, std::chrono::duration_cast<std::chrono::milliseconds>(silent).count(),
                           kWorkerLossDoc));
}

Status require_handlers(const Handlers& handlers, std::string_view call) {
  if (!handlers.on_message || !handlers.on_closed) {
    return make_error(ErrorCode::kInvalidArgument, "{}: on_message and on_closed are required", call);
  }
  return ok_status();
}

// ---------------------------------------------------------------------------
// ConnectionCore.

ConnectionCore::ConnectionCore(PeerInfo peer, Handlers handlers, std::uint64_t max_queued_bytes,
                               std::uint64_t max_message_bytes)
    : peer_(std::move(peer)),
      handlers_(std::move(handlers)),
      flow_(max_queued_bytes),
      max_message_bytes_(max_message_bytes) {}

ConnectionStats ConnectionCore::stats() const noexcept {
  ConnectionStats s;
  s.messages_sent = messages_sent.load(std::memory_order_relaxed);
  s.messages_received = messages_received.load(std::memory_order_relaxed);
  s.bytes_sent = bytes_sent.load(std::memory_order_relaxed);
  s.bytes_received = bytes_received.load(std::memory_order_relaxed);
  s.frames_sent = frames_sent.load(std::memory_order_relaxed);
  s.frames_received = frames_received.load(std::memory_order_relaxed);
  s.write_syscalls = write_syscalls.load(std::memory_order_relaxed);
  s.read_syscalls = read_syscalls.load(std::memory_order_relaxed);
  s.heartbeats_sent = heartbeats_sent.load(std::memory_order_relaxed);
  s.heartbeats_received = heartbeats_received.load(std::memory_order_relaxed);
  s.tx_progress = tx_progress.load(std::memory_order_relaxed);
  s.queued_bytes = flow_.queued_bytes();
  s.queued_bytes_high_water = flow_.high_water_bytes();
  return s;
}

void ConnectionCore::fail(Error reason) {
  {
    std::lock_guard lock(mu_);
    if (reason_) return;
    reason_ = std::move(reason);
  }
  // Release: a thread that sees failing() or is_closed() also sees reason_
  // (it reads it under mu_ anyway); pairs with the acquire loads there.
  failing_.store(true, std::memory_order_release);
  closing_.store(true, std::memory_order_release);
  flow_.close();
  start_teardown();
}

void ConnectionCore::peer_goodbye() {
  if (closing_.load(std::memory_order_acquire)) return;
  set_closed_by(/*by_us=*/false);
  close(kPeerGoodbyeDrain);
}

void ConnectionCore::deliver(Incoming&& message) {
  messages_received.fetch_add(1, std::memory_order_relaxed);
  bytes_received.fetch_add(message.bytes.size(), std::memory_order_relaxed);
  handlers_.on_message(*this, std::move(message));
}

std::string ConnectionCore::describe_peer() const {
  return fmt::format("{} {} at {}", role_name(peer_.role), peer_.rank, peer_.address);
}

bool ConnectionCore::begin_close() {
  if (closing_.exchange(true)) return false;
  set_closed_by(/*by_us=*/true);
  return true;
}

void ConnectionCore::set_closed_by(bool by_us) {
  std::lock_guard lock(mu_);
  if (!closed_by_set_) {
    closed_by_set_ = true;
    closed_by_us_ = by_us;
  }
}

Status ConnectionCore::check_channel(std::uint32_t channel) const {
  const std::size_t n = lane_count();
  if (channel >= n) {
    return make_error(ErrorCode::kInvalidArgument,
                      "channel {} does not exist: this connection has {} channels (0..{})", channel, n,
                      n - 1);
  }
  return ok_status();
}

Status ConnectionCore::check_send(std::uint32_t channel, std::size_t bytes) const {
  EMBER_TRY(check_channel(channel));
  if (closing_.load(std::memory_order_acquire)) return closed_error();
  if (bytes > max_message_bytes_) {
    return make_error(ErrorCode::kTooLarge,
                      "message of {} exceeds max_message_size {}; cut it into chunks or raise "
                      "[communication] max_message_size",
                      format_bytes(bytes), format_bytes(max_message_bytes_));
  }
  return ok_status();
}

tl::unexpected<Error> ConnectionCore::closed_error() const {
  return make_error(ErrorCode::kClosed, "connection to {} is closed", describe_peer());
}

bool ConnectionCore::part_finished(std::size_t num_parts) {
  if (++parts_finished_ != num_parts) return false;
  {
    std::lock_guard lock(mu_);
    finished_.store(true, std::memory_order_release);
  }
  closing_.store(true, std::memory_order_release);
  flow_.close();
  return true;
}

Error ConnectionCore::failure_reason() const {
  std::lock_guard lock(mu_);
  return reason_ ? *reason_ : Error(ErrorCode::kClosed, "closed");
}

void ConnectionCore::announce_closed() {
  Error reason;
  {
    std::lock_guard lock(mu_);
    if (reason_) {
      reason = *reason_;
    } else {
      reason = Error(ErrorCode::kClosed, closed_by_us_ ? "connection closed by this side"
                                                        : "connection closed by the peer");
    }
  }
  if (announce_closed_.load() && handlers_.on_closed) handlers_.on_closed(*this, reason);
}

void ConnectionCore::arm_drain_timer(boost::asio::io_context& ctx, std::chrono::nanoseconds drain) {
  auto self = shared_core();
  auto timer = std::make_shared<boost::asio::steady_timer>(ctx);
  boost::asio::post(ctx, [self, timer, drain] {
    std::lock_guard lock(self->mu_);
    if (self->finished_.load(std::memory_order_acquire)) return;
    self->drain_timer_ = timer;
    timer->expires_after(drain);
    // The handler holds the Connection until the timer fires or is
    // cancelled (cancel_drain_timer, or the context's shutdown).
    timer->async_wait([self, timer](const boost::system::error_code& ec) {
      if (ec) return;
      self->fail(Error(ErrorCode::kClosed,
                       "orderly close did not finish within the drain time; connection torn down"));
    });
  });
}

void ConnectionCore::cancel_drain_timer(boost::asio::io_context& ctx) {
  std::shared_ptr<boost::asio::steady_timer> timer;
  {
    std::lock_guard lock(mu_);
    timer = std::move(drain_timer_);
  }
  if (timer) boost::asio::post(ctx, [timer] { timer->cancel(); });
}

// ---------------------------------------------------------------------------
// TransportRegistry.

void TransportRegistry::io_object_added() {
  std::lock_guard lock(mu_);
  ++live_io_objects_;
}

void TransportRegistry::io_object_removed() {
  std::lock_guard lock(mu_);
  if (--live_io_objects_ == 0) cv_.notify_all();
}

TransportRegistry::~TransportRegistry() {
  if (connect_cancel_fd_ >= 0) ::close(connect_cancel_fd_);
}

Result<TransportRegistry::ConnectScope> TransportRegistry::begin_connect() {
  std::lock_guard lock(mu_);
  if (shutting_down_) return make_error(ErrorCode::kCancelled, "the transport is shutting down");
  if (connect_cancel_fd_ < 0) {
    connect_cancel_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (connect_cancel_fd_ < 0) return make_sys_error(errno, "connect: eventfd()");
  }
  ++connects_in_progress_;
  return ConnectScope(this, connect_cancel_fd_);
}

std::size_t TransportRegistry::connects_in_progress() {
  std::lock_guard lock(mu_);
  return connects_in_progress_;
}

void TransportRegistry::end_connect() {
  std::lock_guard lock(mu_);
  if (--connects_in_progress_ == 0) cv_.notify_all();
}

void TransportRegistry::wait_no_io_objects() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return live_io_objects_ == 0; });
}

void TransportRegistry::add_connection(const std::shared_ptr<ConnectionCore>& connection) {
  {
    std::lock_guard lock(mu_);
    if (!shutting_down_) {
      // Forget Connections that are gone, so a long-lived server that sees
      // many reconnects does not keep their (weakly held) control blocks.
      std::erase_if(connections_,
                    [](const std::weak_ptr<ConnectionCore>& w) { return w.expired(); });
      connections_.push_back(connection);
      return;
    }
  }
  // shut_down() already failed the Connections it knew of. This one comes
  // from a handshake that finished meanwhile (its listener's close was
  // still queued behind it): it closes too, or shut_down() would wait for
  // its I/O objects forever.
  connection->fail(Error(ErrorCode::kCancelled, "the transport is shutting down"));
}

std::vector<std::shared_ptr<ConnectionCore>> TransportRegistry::live_connections() {
  std::lock_guard lock(mu_);
  std::vector<std::shared_ptr<ConnectionCore>> out;
  for (auto& w : connections_) {
    if (auto s = w.lock()) out.push_back(std::move(s));
  }
  return out;
}

void TransportRegistry::add_listener_closer(std::function<void()> closer) {
  std::lock_guard lock(mu_);
  listener_closers_.push_back(std::move(closer));
}

void TransportRegistry::shut_down() {
  std::vector<std::function<void()>> closers;
  {
    std::lock_guard lock(mu_);
    closers.swap(listener_closers_);
  }
  for (auto& close_listener : closers) close_listener();
  {
    // From here add_connection() fails what it is given (a listener's close
    // is asynchronous: a handshake on its I/O thread may finish after this).
    // begin_connect() refuses from here on, and the connects in progress
    // wake up (the eventfd stays readable).
    std::lock_guard lock(mu_);
    shutting_down_ = true;
    if (connect_cancel_fd_ >= 0) {
      const std::uint64_t one = 1;
      // Cannot fail: the counter is far from its maximum.
      [[maybe_unused]] const ssize_t n = ::write(connect_cancel_fd_, &one, sizeof one);
    }
  }
  for (auto& c : live_connections()) {
    c->fail(Error(ErrorCode::kCancelled, "the transport is shutting down"));
  }
  // The connects first: one may still add I/O objects (its Connection,
  // failed by add_connection(), tears them down on the I/O threads, which
  // run until the join that follows this call).
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return connects_in_progress_ == 0 && live_io_objects_ == 0; });
}

}  // namespace ember::transport
