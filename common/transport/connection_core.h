// The part of a transport that tcp, shm and rdma share: how a Connection
// ends, how a Transport shuts down, and the thin Listener handle. Each
// implementation keeps its own data path (batches, rings, queue pairs) and
// its own teardown of I/O objects; this file holds the bookkeeping around
// them, written once so the three cannot drift apart.
//
// ConnectionCore (a Connection base) owns what every implementation kept a
// copy of: the peer, the Handlers, the FlowControl, the counters behind
// stats(), and the close state machine. Its invariant is the one of
// transport.h: on_closed runs at most once, after every part of the
// Connection (channel, control link) has finished, with
//   * the first failure passed to fail(), when there was one;
//   * otherwise kClosed, "connection closed by this side" or "... by the
//     peer", whichever side began the orderly close first.
// A derived class implements start_teardown() (post each channel's
// teardown to its I/O thread) and calls part_finished() once per part
// whose I/O objects are gone.
//
// TransportRegistry counts a Transport's live I/O objects and its connect()
// calls in progress, and remembers its Connections and Listeners, so that
// the destructor can close them all, cut short the connects and wait
// (shut_down()).
//
// Thread-safety: every ConnectionCore and TransportRegistry method may be
// called from any thread unless its comment names one. Nothing here blocks
// except TransportRegistry::wait_no_io_objects() and shut_down().
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "common/base/error.h"
#include "common/transport/flow_control.h"
#include "common/transport/transport.h"

namespace ember::transport {

// Where the "worker lost" log lines point operators (docs/troubleshooting.md
// must keep this anchor).
inline constexpr std::string_view kWorkerLossDoc = "docs/troubleshooting.md#worker-loss";

// The error a Connection closes with when nothing (data or heartbeat)
// arrived from its peer for longer than Options::heartbeat_timeout:
// kTimeout, "nothing received from <source> for <N> ms (heartbeat_timeout):
// the peer is dead or stalled; see docs/troubleshooting.md#worker-loss".
// `source` names the peer and the stream, e.g. "worker 3 at 10.0.0.2:5000 on
// channel 1"; `silent` is how long nothing arrived (printed in whole ms).
// The server logs it as the tail of "worker <r> (<addr>) lost: timeout: ...".
Error heartbeat_timeout_error(std::string_view source, std::chrono::nanoseconds silent);

// Transport::listen() and connect() need both handlers. Errors:
// kInvalidArgument "<call>: on_message and on_closed are required".
Status require_handlers(const Handlers& handlers, std::string_view call);

// ---------------------------------------------------------------------------
class ConnectionCore : public Connection {
 public:
  ConnectionCore(PeerInfo peer, Handlers handlers, std::uint64_t max_queued_bytes,
                 std::uint64_t max_message_bytes);
  ~ConnectionCore() override = default;

  // --- Connection: the same for every transport ---
  const PeerInfo& peer() const noexcept final { return peer_; }
  bool is_closed() const noexcept final { return closing_.load(std::memory_order_acquire); }
  ConnectionStats stats() const noexcept final;

  // --- for the implementation (its channels, listener and transport) ---

  // Closes the Connection with `reason` unless it already failed (the first
  // reason wins and is what on_closed reports): marks it closing and
  // failing, closes the flow control (waiting senders get kClosed), then
  // calls start_teardown() once.
  void fail(Error reason);
  bool failing() const noexcept { return failing_.load(std::memory_order_acquire); }

  // The peer said goodbye: unless this side is already closing, the close
  // is recorded as the peer's and close(kPeerGoodbyeDrain) starts ours.
  void peer_goodbye();

  // One message in: counts it and runs Handlers::on_message. I/O thread of
  // the message's channel.
  void deliver(Incoming&& message);

  // For a Connection that never reached the user (set-up failed):
  // on_closed will not run.
  void suppress_on_closed() noexcept { announce_closed_.store(false); }

  // "worker 3 at 127.0.0.1:43121" (role, rank, address of the peer).
  std::string describe_peer() const;

  FlowControl& flow() noexcept { return flow_; }

  // Counters (relaxed; see ConnectionStats). Incremented by the data path.
  std::atomic<std::uint64_t> messages_sent{0}, messages_received{0}, bytes_sent{0},
      bytes_received{0}, frames_sent{0}, frames_received{0}, write_syscalls{0}, read_syscalls{0},
      heartbeats_sent{0}, heartbeats_received{0}, tx_progress{0};

 protected:
  // How long the close answering a peer's goodbye may drain.
  static constexpr std::chrono::seconds kPeerGoodbyeDrain{1};

  // Number of channels made so far (the range send()/flush() accept).
  virtual std::size_t lane_count() const noexcept = 0;
  // Starts tearing down every channel (posting each teardown to its I/O
  // thread); called once, by the first fail(), on the failing thread.
  virtual void start_teardown() = 0;

  // Sets the peer once the handshake names it (set-up, before start).
  void set_peer_info(PeerInfo peer) { peer_ = std::move(peer); }

  // The start of close(): false when the Connection was already closing
  // (close() is then a no-op); true the first time, which also records the
  // close as this side's unless the peer's goodbye came first.
  bool begin_close();

  // Errors for send()/flush(): kInvalidArgument (channel out of range),
  // kClosed, kTooLarge (over max_message_bytes).
  Status check_send(std::uint32_t channel, std::size_t bytes) const;
  Status check_channel(std::uint32_t channel) const;
  tl::unexpected<Error> closed_error() const;

  // One part (channel or control link) finished. True for the last of
  // `num_parts`: the Connection is then finished (closing, flow control
  // closed) and the caller runs announce_closed().
  bool part_finished(std::size_t num_parts);
  bool finished() const noexcept { return finished_.load(std::memory_order_acquire); }
  // The failure reason if fail() ran, else kClosed "closed".
  Error failure_reason() const;
  // Runs on_closed once with the reason described at the top of this file
  // (unless suppressed). Call after part_finished() returned true.
  void announce_closed();

  // tcp and rdma: bounds an orderly close. On `ctx` (one of the Connection's
  // I/O threads), unless the Connection finished first, arms a timer that
  // fails it with kClosed ("orderly close did not finish within the drain
  // time") after `drain`. cancel_drain_timer() (after the last
  // part_finished()) cancels it on the same context.
  void arm_drain_timer(boost::asio::io_context& ctx, std::chrono::nanoseconds drain);
  void cancel_drain_timer(boost::asio::io_context& ctx);

 private:
  void set_closed_by(bool by_us);
  std::shared_ptr<ConnectionCore> shared_core() {
    return std::static_pointer_cast<ConnectionCore>(shared_from_this());
  }

  PeerInfo peer_;
  Handlers handlers_;
  FlowControl flow_;
  const std::uint64_t max_message_bytes_;
  std::atomic<bool> closing_{false};
  std::atomic<bool> failing_{false};
  std::atomic<bool> finished_{false};
  std::atomic<bool> announce_closed_{true};
  std::atomic<std::size_t> parts_finished_{0};
  // Guards the fields below; finished_ is also set under it, so a drain
  // timer is either armed before the Connection finished (and then
  // cancelled) or not at all.
  mutable std::mutex mu_;
  std::optional<Error> reason_;
  bool closed_by_us_ = true;
  bool closed_by_set_ = false;
  std::shared_ptr<boost::asio::steady_timer> drain_timer_;  // on the context given to arm_drain_timer
};

// ---------------------------------------------------------------------------
// The live objects of one Transport.
class TransportRegistry {
 public:
  TransportRegistry() = default;
  ~TransportRegistry();
  TransportRegistry(const TransportRegistry&) = delete;
  TransportRegistry& operator=(const TransportRegistry&) = delete;

  // A Transport::connect() in progress, from begin_connect() until this is
  // destroyed (at connect()'s end, after its Connection, if any, went to
  // add_connection()). shut_down() waits for it, so the registry (held by
  // the caller) must outlive it. cancel_fd(): an eventfd that becomes
  // readable when shut_down() begins; the connect passes it to every
  // blocking wait of its handshake (stream_io), which then fail with
  // kCancelled instead of holding ~Transport up to connect_timeout.
  class ConnectScope {
   public:
    ConnectScope(ConnectScope&& other) noexcept
        : registry_(std::exchange(other.registry_, nullptr)), cancel_fd_(other.cancel_fd_) {}
    ConnectScope& operator=(ConnectScope&&) = delete;
    ~ConnectScope() {
      if (registry_ != nullptr) registry_->end_connect();
    }
    int cancel_fd() const noexcept { return cancel_fd_; }

   private:
    friend class TransportRegistry;
    ConnectScope(TransportRegistry* registry, int cancel_fd)
        : registry_(registry), cancel_fd_(cancel_fd) {}
    TransportRegistry* registry_;
    int cancel_fd_;
  };
  // The start of connect(), on the caller's thread. Errors: kCancelled
  // ("the transport is shutting down") once shut_down() began; kIo when the
  // eventfd (made by the first connect) cannot be created.
  Result<ConnectScope> begin_connect();
  // connect() calls between begin_connect() and their return.
  std::size_t connects_in_progress();

  // I/O objects (channels, control links, acceptors) not yet destroyed.
  void io_object_added();
  void io_object_removed();
  void wait_no_io_objects();  // blocks until the count is zero

  // Connections handed to the user (kept weakly). Once shut_down() began,
  // the Connection is failed instead (kCancelled), at once: on_closed runs
  // for it as for the others, and the caller may still hand it out.
  void add_connection(const std::shared_ptr<ConnectionCore>& connection);
  std::vector<std::shared_ptr<ConnectionCore>> live_connections();

  // How to close a Listener's state when the Transport goes first.
  void add_listener_closer(std::function<void()> closer);

  // What every Transport destructor does first: closes each Listener,
  // cancels the connect() calls in progress, fails each live Connection with
  // kCancelled ("the transport is shutting down"; on_closed runs for those
  // still open), then waits until no connect() is in progress and no I/O
  // object is left (a connect that finished its handshake meanwhile hands
  // its Connection to add_connection(), which fails it: it closes too).
  // Blocks; must not run on an I/O thread (the caller checks).
  void shut_down();

 private:
  void end_connect();

  std::mutex mu_;
  std::condition_variable cv_;
  std::size_t live_io_objects_ = 0;
  std::size_t connects_in_progress_ = 0;
  int connect_cancel_fd_ = -1;  // eventfd, made by the first begin_connect()
  std::vector<std::weak_ptr<ConnectionCore>> connections_;
  std::vector<std::function<void()>> listener_closers_;
  bool shutting_down_ = false;  // shut_down() has taken its list of connections
};

// ---------------------------------------------------------------------------
// The user's Listener: a handle on the implementation's listener state
// (State has address(), num_refused() and close(); close() is idempotent and
// thread-safe). Destroying the handle stops accepting.
template <class State>
class ListenerHandle final : public Listener {
 public:
  explicit ListenerHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}
  ~ListenerHandle() override { state_->close(); }
  ListenerHandle(const ListenerHandle&) = delete;
  ListenerHandle& operator=(const ListenerHandle&) = delete;

  std::string address() const override { return state_->address(); }
  std::uint64_t num_refused() const noexcept override { return state_->num_refused(); }

 private:
  std::shared_ptr<State> state_;
};

}  // namespace ember::transport
