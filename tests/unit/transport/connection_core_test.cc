// Unit tests of common/transport/connection_core.h, the close bookkeeping
// tcp, shm and rdma share: which reason on_closed reports and when, the send
// checks, the drain timer, the transport registry's shutdown, and the shared
// error texts. A FakeConnection stands in for a transport: its "parts"
// finish when the test says so.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include <boost/asio/io_context.hpp>

#include "common/transport/connection_core.h"

namespace ember::transport {
namespace {

using namespace std::chrono_literals;

// What the handlers saw, waited on with a deadline.
struct Seen {
  std::mutex mu;
  std::condition_variable cv;
  int closed_calls = 0;
  std::optional<Error> reason;
  int messages = 0;
  std::size_t message_bytes = 0;

  Handlers handlers() {
    Handlers h;
    h.on_message = [this](Connection&, Incoming&& m) {
      std::lock_guard lock(mu);
      ++messages;
      message_bytes += m.bytes.size();
    };
    h.on_closed = [this](Connection&, const Error& e) {
      std::lock_guard lock(mu);
      ++closed_calls;
      reason = e;
      cv.notify_all();
    };
    return h;
  }
  int closed() {
    std::lock_guard lock(mu);
    return closed_calls;
  }
};

PeerInfo worker_peer() {
  PeerInfo p;
  p.role = Role::kWorker;
  p.rank = 3;
  p.num_channels = 2;
  p.address = "10.0.0.2:5000";
  return p;
}

constexpr std::uint64_t kMaxMessageBytes = 1000;

class FakeConnection final : public ConnectionCore {
 public:
  FakeConnection(Handlers handlers, std::size_t lanes, boost::asio::io_context* ctx = nullptr)
      : ConnectionCore(worker_peer(), std::move(handlers), /*max_queued_bytes=*/1 << 20,
                       kMaxMessageBytes),
        lanes_(lanes),
        ctx_(ctx) {}

  Status send(std::uint32_t channel, std::span<const std::byte> bytes,
              std::chrono::nanoseconds) override {
    return check_send(channel, bytes.size());
  }
  Status send(std::uint32_t channel, Buffer&& payload, SendCompletion,
              std::chrono::nanoseconds) override {
    return check_send(channel, payload.size());
  }
  Status flush(std::uint32_t channel) override {
    EMBER_TRY(check_channel(channel));
    if (is_closed()) return closed_error();
    return ok_status();
  }
  Status flush_all() override {
    if (is_closed()) return closed_error();
    return ok_status();
  }
  void close(std::chrono::nanoseconds drain) override {
    if (!begin_close()) return;
    closes.fetch_add(1);
    if (ctx_ != nullptr) arm_drain_timer(*ctx_, drain);
  }

  // One part's I/O objects are gone (what a channel's teardown ends with).
  void finish_part() {
    if (!part_finished(lanes_)) return;
    if (ctx_ != nullptr) cancel_drain_timer(*ctx_);
    announce_closed();
  }
  void finish_all() {
    for (std::size_t i = 0; i < lanes_; ++i) finish_part();
  }
  Error reason_for_teardown() const { return failure_reason(); }

  std::atomic<int> teardowns{0};
  std::atomic<int> closes{0};
  std::function<void()> on_teardown;  // runs inside start_teardown

 private:
  std::size_t lane_count() const noexcept override { return lanes_; }
  void start_teardown() override {
    teardowns.fetch_add(1);
    if (on_teardown) on_teardown();
  }

  const std::size_t lanes_;
  boost::asio::io_context* ctx_;
};

std::span<const std::byte> bytes_of(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

TEST(ConnectionCore, FirstFailureWinsAndOnClosedRunsOnceAfterTheLastPart) {
  Seen seen;
  auto c = std::make_shared<FakeConnection>(seen.handlers(), 2);
  EXPECT_FALSE(c->is_closed());
  c->fail(Error(ErrorCode::kIo, "first"));
  c->fail(Error(ErrorCode::kTimeout, "second"));
  EXPECT_EQ(c->teardowns.load(), 1) << "teardown starts once, with the first failure";
  EXPECT_TRUE(c->is_closed());
  EXPECT_TRUE(c->failing());
  EXPECT_EQ(c->reason_for_teardown().message(), "first");
  EXPECT_EQ(seen.closed(), 0) << "not before every part finished";
  c->finish_part();
  EXPECT_EQ(seen.closed(), 0);
  c->finish_part();
  ASSERT_EQ(seen.closed(), 1);
  EXPECT_EQ(seen.reason->code(), ErrorCode::kIo);
  EXPECT_EQ(seen.reason->message(), "first");
  // Flow control is closed with the Connection: a sender that would have to
  // wait for room gets kClosed at once instead.
  ASSERT_TRUE(c->flow().acquire(1 << 20, 0s, /*may_wait=*/false));  // fills the bound
  const auto start = std::chrono::steady_clock::now();
  auto waited = c->flow().acquire(1, 10s, /*may_wait=*/true);
  ASSERT_FALSE(waited);
  EXPECT_EQ(waited.error().code(), ErrorCode::kClosed);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(ConnectionCore, OrderlyCloseReportsWhichSideClosedFirst) {
  {
    Seen seen;
    auto c = std::make_shared<FakeConnection>(seen.handlers(), 1);
    c->close(1s);
    c->close(1s);
    c->peer_goodbye();  // the peer's goodbye after ours does not change who closed
    EXPECT_EQ(c->closes.load(), 1) << "close() is idempotent";
    EXPECT_FALSE(c->failing());
    c->finish_all();
    ASSERT_EQ(seen.closed(), 1);
    EXPECT_EQ(seen.reason->code(), ErrorCode::kClosed);
    EXPECT_EQ(seen.reason->message(), "connection closed by this side");
  }
  {
    Seen seen;
    auto c = std::make_shared<FakeConnection>(seen.handlers(), 1);
    c->peer_goodbye();
    EXPECT_EQ(c->closes.load(), 1) << "the peer's goodbye starts our close";
    c->close(1s);
    EXPECT_EQ(c->closes.load(), 1);
    c->finish_all();
    ASSERT_EQ(seen.closed(), 1);
    EXPECT_EQ(seen.reason->message(), "connection closed by the peer");
  }
}

TEST(ConnectionCore, SendAndFlushNameTheChannelTheLimitAndThePeer) {
  Seen seen;
  auto c = std::make_shared<FakeConnection>(seen.handlers(), 2);
  EXPECT_TRUE(c->send(1, bytes_of("ok"), 1s));
  auto bad = c->send(2, bytes_of("x"), 1s);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(bad.error().message(), "channel 2 does not exist: this connection has 2 channels (0..1)");
  EXPECT_EQ(c->flush(7).error().code(), ErrorCode::kInvalidArgument);
  auto big = c->send(0, Buffer::heap(kMaxMessageBytes + 1), {}, 1s);
  ASSERT_FALSE(big);
  EXPECT_EQ(big.error().code(), ErrorCode::kTooLarge);
  EXPECT_NE(big.error().message().find("max_message_size"), std::string::npos) << big.error().message();
  EXPECT_TRUE(c->send(0, Buffer::heap(kMaxMessageBytes), {}, 1s)) << "the limit itself is allowed";

  c->close(1s);
  auto closed = c->send(0, bytes_of("late"), 1s);
  ASSERT_FALSE(closed);
  EXPECT_EQ(closed.error().code(), ErrorCode::kClosed);
  EXPECT_EQ(closed.error().message(), "connection to worker 3 at 10.0.0.2:5000 is closed");
  EXPECT_EQ(c->flush(0).error().code(), ErrorCode::kClosed);
  EXPECT_EQ(c->flush_all().error().code(), ErrorCode::kClosed);
  c->finish_all();
}

TEST(ConnectionCore, SuppressedConnectionNeverAnnouncesItsClose) {
  Seen seen;
  auto c = std::make_shared<FakeConnection>(seen.handlers(), 1);
  c->suppress_on_closed();
  c->fail(Error(ErrorCode::kIo, "set-up failed"));
  c->finish_all();
  EXPECT_EQ(seen.closed(), 0);
}

TEST(ConnectionCore, DeliverCountsTheMessageAndHandsItOn) {
  Seen seen;
  auto c = std::make_shared<FakeConnection>(seen.handlers(), 1);
  const std::string payload = "hello";
  Incoming m;
  m.bytes = bytes_of(payload);
  c->deliver(std::move(m));
  c->messages_sent.fetch_add(2);
  EXPECT_EQ(seen.messages, 1);
  EXPECT_EQ(seen.message_bytes, payload.size());
  const ConnectionStats s = c->stats();
  EXPECT_EQ(s.messages_received, 1u);
  EXPECT_EQ(s.bytes_received, payload.size());
  EXPECT_EQ(s.messages_sent, 2u);
  EXPECT_EQ(c->peer().rank, 3u);
  EXPECT_EQ(c->num_channels(), 2u);
  EXPECT_EQ(c->describe_peer(), "worker 3 at 10.0.0.2:5000");
}

// Runs `ctx` on its own thread until it has no work; joined by the caller.
std::future<void> run_async(boost::asio::io_context& ctx) {
  return std::async(std::launch::async, [&ctx] { ctx.run(); });
}

TEST(ConnectionCore, DrainTimerFailsACloseThatDoesNotFinish) {
  Seen seen;
  boost::asio::io_context ctx;
  auto c = std::make_shared<FakeConnection>(seen.handlers(), 1, &ctx);
  std::promise<void> torn_down;
  c->on_teardown = [&] { torn_down.set_value(); };
  c->close(20ms);
  auto runner = run_async(ctx);
  ASSERT_EQ(torn_down.get_future().wait_for(10s), std::future_status::ready)
      << "the drain timer should have failed the Connection";
  ASSERT_EQ(runner.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(c->failing());
  c->finish_all();
  ctx.restart();
  ctx.run();  // the timer's (no-op) cancellation
  ASSERT_EQ(seen.closed(), 1);
  EXPECT_EQ(seen.reason->code(), ErrorCode::kClosed);
  EXPECT_NE(seen.reason->message().find("drain time"), std::string::npos) << seen.reason->message();
  EXPECT_EQ(c.use_count(), 1) << "no handler holds the Connection any more";
}

TEST(ConnectionCore, DrainTimerIsCancelledWhenTheCloseFinishes) {
  Seen seen;
  boost::asio::io_context ctx;
  auto c = std::make_shared<FakeConnection>(seen.handlers(), 2, &ctx);
  c->close(1h);
  ASSERT_EQ(ctx.run_one(), 1u);  // arms the timer
  c->finish_all();               // posts its cancellation
  auto runner = run_async(ctx);
  ASSERT_EQ(runner.wait_for(10s), std::future_status::ready)
      << "a cancelled timer leaves the context without work";
  EXPECT_EQ(c->teardowns.load(), 0);
  ASSERT_EQ(seen.closed(), 1);
  EXPECT_EQ(seen.reason->message(), "connection closed by this side");
  EXPECT_EQ(c.use_count(), 1);
}

TEST(ConnectionCore, NoDrainTimerIsArmedOnceTheCloseFinished) {
  Seen seen;
  boost::asio::io_context ctx;
  auto c = std::make_shared<FakeConnection>(seen.handlers(), 1, &ctx);
  c->close(1h);     // posts the arming
  c->finish_all();  // finishes before the arming runs
  auto runner = run_async(ctx);
  ASSERT_EQ(runner.wait_for(10s), std::future_status::ready) << "the timer must not have been armed";
  EXPECT_EQ(c->teardowns.load(), 0);
  EXPECT_EQ(seen.closed(), 1);
}

TEST(TransportRegistry, ShutDownClosesListenersFailsLiveConnectionsAndWaitsForIoObjects) {
  TransportRegistry registry;
  Seen seen;
  Seen gone_seen;
  auto live = std::make_shared<FakeConnection>(seen.handlers(), 1);
  auto gone = std::make_shared<FakeConnection>(gone_seen.handlers(), 1);
  registry.add_connection(live);
  registry.add_connection(gone);
  gone.reset();
  ASSERT_EQ(registry.live_connections().size(), 1u);

  bool listener_closed = false;
  registry.add_listener_closer([&] { listener_closed = true; });
  // The live connection's channel is an I/O object; its teardown finishes
  // on another thread, as on an I/O thread.
  registry.io_object_added();
  std::thread io;
  live->on_teardown = [&] {
    io = std::thread([&] {
      live->finish_part();
      registry.io_object_removed();
    });
  };
  registry.shut_down();  // returns only once the object is gone
  io.join();
  EXPECT_TRUE(listener_closed);
  ASSERT_EQ(seen.closed(), 1);
  EXPECT_EQ(seen.reason->code(), ErrorCode::kCancelled);
  EXPECT_EQ(seen.reason->message(), "the transport is shutting down");
  EXPECT_EQ(gone_seen.closed(), 0);
}

TEST(TransportErrors, HeartbeatTimeoutNamesThePeerAndEndsWithTheTroubleshootingAnchor) {
  const Error e = heartbeat_timeout_error("worker 1 at 127.0.0.1:4000 on channel 2", 1234567890ns);
  EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  EXPECT_EQ(e.message(),
            "nothing received from worker 1 at 127.0.0.1:4000 on channel 2 for 1234 ms "
            "(heartbeat_timeout): the peer is dead or stalled; see "
            "docs/troubleshooting.md#worker-loss");
  // As the server logs it: "worker <r> (<addr>) lost: <to_string()>".
  const std::string logged = e.to_string();
  EXPECT_TRUE(logged.ends_with("see docs/troubleshooting.md#worker-loss")) << logged;
}

TEST(TransportErrors, ListenAndConnectNeedBothHandlers) {
  Handlers h;
  h.on_message = [](Connection&, Incoming&&) {};
  auto s = require_handlers(h, "listen");
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(s.error().message(), "listen: on_message and on_closed are required");
  h.on_closed = [](Connection&, const Error&) {};
  EXPECT_TRUE(require_handlers(h, "connect"));
}

struct FakeListenerState {
  int closes = 0;
  std::string address() const { return "127.0.0.1:1"; }
  std::uint64_t num_refused() const noexcept { return 4; }
  void close() { ++closes; }
};

TEST(ListenerHandle, ForwardsToItsStateAndClosesItWhenDestroyed) {
  auto state = std::make_shared<FakeListenerState>();
  {
    std::unique_ptr<Listener> l = std::make_unique<ListenerHandle<FakeListenerState>>(state);
    EXPECT_EQ(l->address(), "127.0.0.1:1");
    EXPECT_EQ(l->num_refused(), 4u);
    EXPECT_EQ(state->closes, 0);
  }
  EXPECT_EQ(state->closes, 1);
}

}  // namespace
}  // namespace ember::transport
