// Closes racing the data path, across transports: a Connection that ends
// (its Transport destroyed, its peer gone) while other threads are inside
// send() writing inline must still keep transport.h's promises: every
// accepted send completes exactly once, and before on_closed; nothing of the
// Connection runs after ~Transport returned. Run these under TSan too
// (label unit-tsan): the races are the point.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/transport/shm/uds.h"
#include "common/transport/stream_io.h"
#include "common/transport/transport.h"
#include "tests/unit/transport/close_race_util.h"
#include "tests/unit/transport/transport_test_util.h"

namespace ember::transport {
namespace {

using namespace std::chrono_literals;
using testing::Inbox;
using testing::SenderSide;

// A Transport pair of Options::kind and one Connection from `side`'s
// transport to the other's listener (tcp on 127.0.0.1, shm on an abstract
// socket named per process and link). open() ASSERTs (use
// ASSERT_NO_FATAL_FAILURE).
struct Link {
  Inbox server_in;
  std::unique_ptr<Transport> server_tx;
  std::unique_ptr<Transport> client_tx;
  std::unique_ptr<Listener> listener;
  std::shared_ptr<Connection> conn;

  template <class Side>
  void open(const Options& o, Side& side) {
    server_in.check_pattern_bytes = false;
    auto s = Transport::create(o);
    ASSERT_TRUE(s) << s.error().to_string();
    server_tx = std::move(*s);
    auto c = Transport::create(o);
    ASSERT_TRUE(c) << c.error().to_string();
    client_tx = std::move(*c);
    static std::atomic<int> links{0};
    const std::string where = o.kind == Kind::kShm ? "@ember-close-race-link-" + std::to_string(::getpid()) +
                                                         "-" + std::to_string(links++)
                                                   : "127.0.0.1:0";
    auto l = server_tx->listen(where, {Role::kServer, 0}, server_in.acceptor(), server_in.handlers());
    ASSERT_TRUE(l) << l.error().to_string();
    listener = std::move(*l);
    auto k = client_tx->connect(listener->address(), {Role::kWorker, 0}, side.handlers());
    ASSERT_TRUE(k) << k.error().to_string();
    conn = *k;
  }
};

Options tcp_options() {
  Options o;
  o.kind = Kind::kTcp;
  o.num_channels = 1;
  o.num_io_threads = 1;
  o.max_message_bytes = std::uint64_t{16} << 20;
  o.max_queued_bytes = std::uint64_t{64} << 20;
  // Long: a close in these tests comes from the test, never from a timeout.
  o.heartbeat_interval = 1s;
  o.heartbeat_timeout = 30s;
  return o;
}

// tcp, inline writes (Options::inline_write_bytes): a sender thread is often
// inside sendmsg, or running the completions of what it just wrote, when
// ~Transport tears its Connection down on the I/O thread. What it dropped
// (or finished) there must complete before on_closed runs, and so before
// ~Transport returns (regression: a teardown during the caller's system call
// announced on_closed at once and left the dropped sends' completions, and
// the socket's close, to the caller thread afterwards).
TEST(TcpCloseRace, InlineWritersCompleteEverySendBeforeOnClosed) {
  constexpr int kRounds = 30;
  // Large messages (over a batch) that the socket buffer takes whole.
  constexpr std::size_t kPayloadBytes = std::size_t{64} << 10;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    SenderSide client;
    Link link;
    ASSERT_NO_FATAL_FAILURE(link.open(tcp_options(), client));
    std::shared_ptr<Connection> c = link.conn;

    std::vector<std::byte> payload(kPayloadBytes);
    std::thread sender([&] {
      for (;;) {
        // At most two in flight: the channel stays idle enough that the
        // sender, not the I/O thread, makes most writes.
        if (!client.wait_in_flight_below(2)) break;
        auto [id, done] = client.next();
        // Borrowed: the sender spends its time in send(), not filling memory.
        Buffer b = Buffer::borrow(payload);
        Status s = c->send(0, std::move(b), std::move(done), 5s);
        if (!s) break;  // kClosed: the transport is going
        client.count_accepted();
      }
    });
    // Destroy the client's transport while the sender is busy.
    EXPECT_TRUE(client.wait_accepted(2 + round % 4));  // (not ASSERT: the sender must be stopped)
    client.check_close_during_transport_destruction(link, [&] { sender.join(); });
    if (::testing::Test::HasFailure()) break;
  }
}

// Buffers the transport copies inside send(), with a completion: small ones
// (tcp: into a batch, and without batching written inline by the caller;
// shm: into a ring slot) and, over shm, large heap Buffers (outside every
// registered region: copied through the ring in fragments). The completion
// runs on the caller thread inside send(). A teardown by ~Transport on the
// I/O thread in the meantime must wait for that completion before on_closed
// (regressions: tcp ran the completion outside the channel's writer count,
// shm after the send had left the channel; either way on_closed could come
// first and ~Transport could return before it ran). Over tcp the large
// rounds are sent from the Buffer and complete on the I/O thread.
class SmallSendCloseRace : public ::testing::TestWithParam<Kind> {};

TEST_P(SmallSendCloseRace, SmallSendCompletionsComeBeforeOnClosed) {
  constexpr int kRounds = 60;
  constexpr int kSenders = 3;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    // Rounds 0, 1 of every 4: far below a batch; 2, 3: over a ring slot.
    const std::size_t kPayloadBytes = round % 4 < 2 ? 64 : std::size_t{64} << 10;
    SenderSide client;
    client.linger_yields = 20;
    Options o = tcp_options();
    o.kind = GetParam();
    o.batching = round % 2 == 0;  // tcp off: every send() writes inline; on: copies into the batch
    Link link;
    ASSERT_NO_FATAL_FAILURE(link.open(o, client));
    std::shared_ptr<Connection> c = link.conn;

    std::vector<std::thread> senders;
    for (int t = 0; t < kSenders; ++t) {
      senders.emplace_back([&] {
        for (;;) {
          auto [id, done] = client.next();
          Buffer b = Buffer::heap(kPayloadBytes);
          Status s = c->send(0, std::move(b), std::move(done), 5s);
          if (!s) {  // kClosed: the transport is going
            client.note_refusal(s.error());
            break;
          }
          client.count_accepted();
        }
      });
    }
    // Large rounds: fewer (each 64 KiB copied; slow under TSan), enough that
    // senders are mid-send at the destruction.
    EXPECT_TRUE(client.wait_accepted(kPayloadBytes == 64 ? 50 + 10 * round : 10 + round / 2))
        << client.refusals() << "; the receiving side "
        << (link.server_in.closed ? "closed: " + link.server_in.closed->to_string() : std::string("is open"));
    client.check_close_during_transport_destruction(link, [&] {
      for (auto& t : senders) t.join();
    });
    if (::testing::Test::HasFailure()) break;
  }
}

INSTANTIATE_TEST_SUITE_P(All, SmallSendCloseRace, ::testing::Values(Kind::kTcp, Kind::kShm),
                         [](const auto& p) { return std::string(kind_name(p.param)); });

// A listening Transport destroyed while a peer's handshake completes: the
// Connection its listener makes at that moment (its last handshake handler
// was already running when ~Transport began) must be closed as well, or
// ~Transport waits for that Connection's I/O objects forever. The moment of
// destruction sweeps over the handshake, round by round (a spin on the
// clock: a chosen delay, not a wait for a condition).
class AcceptCloseRace : public ::testing::TestWithParam<Kind> {};

TEST_P(AcceptCloseRace, DestroyingTheListeningTransportMidHandshakeNeverHangs) {
  constexpr int kRounds = 40;
  const Kind kind = GetParam();
  Options o = tcp_options();
  o.kind = kind;
  o.num_channels = 4;  // more set-up work between handshake and Connection
  o.connect_timeout = 5s;
  std::chrono::nanoseconds handshake_time{0};
  for (int round = -1; round < kRounds; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    Inbox server_in, client_in;
    server_in.check_pattern_bytes = false;
    auto server = Transport::create(o);
    ASSERT_TRUE(server) << server.error().to_string();
    auto client = Transport::create(o);
    ASSERT_TRUE(client) << client.error().to_string();
    std::unique_ptr<Transport> server_tx = std::move(*server);
    std::unique_ptr<Transport> client_tx = std::move(*client);
    const std::string where = kind == Kind::kShm
                                  ? "@ember-accept-race-" + std::to_string(::getpid()) + "-" +
                                        std::to_string(round)
                                  : "127.0.0.1:0";
    auto l = server_tx->listen(where, {Role::kServer, 0}, server_in.acceptor(),
                               server_in.handlers());
    ASSERT_TRUE(l) << l.error().to_string();
    std::unique_ptr<Listener> listener = std::move(*l);
    const std::string address = listener->address();
    std::atomic<bool> connecting{false};
    std::shared_ptr<Connection> conn;
    const auto start = std::chrono::steady_clock::now();
    std::thread connector([&] {
      connecting.store(true);
      auto c = client_tx->connect(address, {Role::kWorker, 0}, client_in.handlers());
      if (c) conn = *c;  // may fail: the server goes away meanwhile
    });
    if (round < 0) {
      // Calibration: how long a whole handshake takes here.
      connector.join();
      ASSERT_TRUE(conn);
      ASSERT_TRUE(server_in.wait_accepted(1));
      handshake_time = std::chrono::steady_clock::now() - start;
    } else {
      while (!connecting.load()) std::this_thread::yield();
      const auto at = start + handshake_time * (round + 1) / kRounds * 5 / 4;
      while (std::chrono::steady_clock::now() < at) {
      }
    }
    std::promise<void> destroyed;
    std::future<void> done = destroyed.get_future();
    std::thread destroyer([&] {
      listener.reset();
      server_tx.reset();
      destroyed.set_value();
    });
    if (done.wait_for(10s) != std::future_status::ready) {
      ADD_FAILURE() << "~Transport hung: a Connection accepted during its shutdown was never "
                       "closed";
      // Unblock it: close what the listener handed out (an orderly close
      // with the live client).
      std::lock_guard lock(server_in.mu);
      for (auto& c : server_in.accepted) c->close(0ns);
    }
    destroyer.join();
    if (connector.joinable()) connector.join();
    client_tx.reset();
    if (::testing::Test::HasFailure()) break;
  }
}

INSTANTIATE_TEST_SUITE_P(All, AcceptCloseRace, ::testing::Values(Kind::kTcp, Kind::kShm),
                         [](const auto& p) { return std::string(kind_name(p.param)); });

// Work handed to a Transport's I/O threads after ~Transport joined them
// never runs, and what it holds (a Connection, a Listener's state) holds the
// Transport's core, which holds the queue it sits in: a leak. Both ways in
// must be refused (transport.h, thread model): a Listener destroyed after its
// Transport, and a Connection::close() that began before ~Transport closed
// the Connection but posts its goodbye after the threads are gone.
class LateCloseRace : public ::testing::TestWithParam<Kind> {
 protected:
  Options options() const {
    Options o = tcp_options();
    o.kind = GetParam();
    return o;
  }
  std::string where(int round) const {
    return GetParam() == Kind::kShm ? "@ember-late-close-" + std::to_string(::getpid()) + "-" +
                                          std::to_string(round)
                                    : "127.0.0.1:0";
  }
};

TEST_P(LateCloseRace, ListenerDestroyedAfterItsTransportIsFreed) {
  Inbox server_in, client_in;
  // Held by the Listener's state (its on_accept) and nothing else.
  auto token = std::make_shared<int>(0);
  const std::weak_ptr<int> watch = token;
  auto server = Transport::create(options());
  ASSERT_TRUE(server) << server.error().to_string();
  auto client = Transport::create(options());
  ASSERT_TRUE(client) << client.error().to_string();
  auto l = (*server)->listen(where(0), {Role::kServer, 0},
                             [token, accept = server_in.acceptor()](std::shared_ptr<Connection> c) {
                               accept(std::move(c));
                             },
                             server_in.handlers());
  ASSERT_TRUE(l) << l.error().to_string();
  token.reset();
  // One peer, so the listener has done its work once.
  auto conn = (*client)->connect((*l)->address(), {Role::kWorker, 0}, client_in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  ASSERT_TRUE(server_in.wait_accepted(1));
  server->reset();  // the Transport first ...
  EXPECT_EQ(server_in.closed_count, 1);
  std::unique_ptr<Listener> listener = std::move(*l);
  EXPECT_FALSE(listener->address().empty());  // still usable
  listener.reset();  // ... then its Listener
  EXPECT_TRUE(watch.expired()) << "the Listener's state (and its Transport's core) leaked";
  (*conn)->close(0ns);
  EXPECT_TRUE(client_in.wait_closed());
}

TEST_P(LateCloseRace, CloseRacingTransportDestructionLeaksNothing) {
  constexpr int kRounds = 40;
  std::chrono::nanoseconds destroy_time{0};
  for (int round = -1; round < kRounds; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    Inbox server_in, client_in;
    server_in.check_pattern_bytes = false;
    auto server = Transport::create(options());
    ASSERT_TRUE(server) << server.error().to_string();
    auto client = Transport::create(options());
    ASSERT_TRUE(client) << client.error().to_string();
    auto l = (*server)->listen(where(round + 1), {Role::kServer, 0}, server_in.acceptor(),
                               server_in.handlers());
    ASSERT_TRUE(l) << l.error().to_string();
    auto conn = (*client)->connect((*l)->address(), {Role::kWorker, 0}, client_in.handlers());
    ASSERT_TRUE(conn) << conn.error().to_string();
    std::shared_ptr<Connection> c = std::move(*conn);
    const std::weak_ptr<Connection> watch = c;
    std::atomic<bool> go{false};
    std::chrono::steady_clock::time_point start;
    std::thread closer;
    if (round >= 0) {
      // The moment of close() sweeps over ~Transport, round by round (a
      // spin on the clock: a chosen delay, not a wait for a condition).
      const auto delay = destroy_time * round / kRounds;
      closer = std::thread([&, delay] {
        while (!go.load()) std::this_thread::yield();
        while (std::chrono::steady_clock::now() < start + delay) {
        }
        c->close(50ms);
      });
    }
    start = std::chrono::steady_clock::now();
    go.store(true);
    client->reset();
    if (round < 0) destroy_time = std::chrono::steady_clock::now() - start;  // calibration
    if (closer.joinable()) closer.join();
    EXPECT_EQ(client_in.closed_count, 1);
    c->close(0ns);  // after ~Transport: a no-op
    c.reset();
    EXPECT_TRUE(watch.expired()) << "the Connection (and its Transport's core) leaked: work "
                                    "was posted to an I/O thread that had been joined";
    l->reset();
    server->reset();
    if (::testing::Test::HasFailure()) break;
  }
}

// The server stops when its last peer goes: on_closed (on an I/O thread,
// while ~Transport runs) destroys the Listener. Its close is posted to I/O
// context 0 from whichever I/O thread ran on_closed; thread 0 must still be
// there to run it (regression: ~Transport went on to join as soon as the
// last channel's I/O objects were gone, before its on_closed returned, so
// an idle thread 0 could leave first and the Listener's state leaked).
TEST_P(LateCloseRace, ListenerDestroyedByOnClosedDuringTransportDestructionIsFreed) {
  constexpr int kRounds = 8;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    Options o = options();
    o.num_io_threads = 2;  // channel 1, and so perhaps on_closed, on thread 1
    o.num_channels = 2;
    Inbox server_in, client_in;
    server_in.check_pattern_bytes = false;
    auto token = std::make_shared<int>(0);
    const std::weak_ptr<int> watch = token;
    std::mutex mu;
    std::unique_ptr<Listener> listener;
    Handlers h = server_in.handlers();
    h.on_closed = [&, inner = h.on_closed](Connection& c, const Error& e) {
      inner(c, e);
      // Long enough for an idle I/O thread to leave, were the threads being
      // joined already (a spin on the clock: a chosen delay).
      const auto until = std::chrono::steady_clock::now() + 20ms;
      while (std::chrono::steady_clock::now() < until) {
      }
      std::unique_ptr<Listener> l;
      {
        std::lock_guard lock(mu);
        l = std::move(listener);
      }
    };
    auto server = Transport::create(o);
    ASSERT_TRUE(server) << server.error().to_string();
    auto client = Transport::create(o);
    ASSERT_TRUE(client) << client.error().to_string();
    auto l = (*server)->listen(where(round), {Role::kServer, 0},
                               [token, accept = server_in.acceptor()](std::shared_ptr<Connection> c) {
                                 accept(std::move(c));
                               },
                               h);
    ASSERT_TRUE(l) << l.error().to_string();
    token.reset();
    auto conn = (*client)->connect((*l)->address(), {Role::kWorker, 0}, client_in.handlers());
    ASSERT_TRUE(conn) << conn.error().to_string();
    ASSERT_TRUE(server_in.wait_accepted(1));
    {
      std::lock_guard lock(mu);
      listener = std::move(*l);
    }
    server->reset();
    {
      std::lock_guard lock(mu);
      EXPECT_EQ(listener, nullptr) << "on_closed did not run during ~Transport";
    }
    {
      std::lock_guard lock(server_in.mu);
      server_in.accepted.clear();
    }
    EXPECT_TRUE(watch.expired()) << "the Listener's state (and its Transport's core) leaked";
    client->reset();
    if (::testing::Test::HasFailure()) break;
  }
}

INSTANTIATE_TEST_SUITE_P(All, LateCloseRace, ::testing::Values(Kind::kTcp, Kind::kShm),
                         [](const auto& p) { return std::string(kind_name(p.param)); });

// Transport::connect() on one thread while another destroys the same
// Transport (transport.h, Lifetimes): connect() either finishes before the
// I/O threads are joined, and its Connection is closed by ~Transport like
// the others (on_closed once, with kCancelled), or is refused (kCancelled,
// or kClosed when the peer went too); it never hangs, and ~Transport neither
// waits for a connect() stuck in a handshake nor returns while one still
// uses the Transport (regression: ~Transport did not know of connect(), so a
// handshake that finished after it returned built its Connection on a freed
// Transport and on I/O threads that had been joined).
class ConnectCloseRace : public ::testing::TestWithParam<Kind> {
 protected:
  Options options() const {
    Options o = tcp_options();
    o.kind = GetParam();
    // Long: a connect() that returns only at its timeout counts as a hang
    // below (kDeadline is shorter).
    o.connect_timeout = 60s;
    return o;
  }
  static constexpr auto kDeadline = 15s;

  // The outcome of one connect() on a thread of its own.
  struct Connector {
    std::mutex mu;
    std::condition_variable cv;
    bool returned = false;
    std::optional<Result<std::shared_ptr<Connection>>> result;
    std::thread thread;

    // `tx` may be destroyed by another thread once tx->connects_in_progress()
    // counts this call (or it returned).
    void start(Transport* tx, std::string address, Handlers handlers) {
      thread = std::thread([this, tx, address = std::move(address), handlers = std::move(handlers)] {
        auto r = tx->connect(address, {Role::kWorker, 0}, handlers);
        std::lock_guard lock(mu);
        result.emplace(std::move(r));
        returned = true;
        cv.notify_all();
      });
    }
    bool has_returned() {
      std::lock_guard lock(mu);
      return returned;
    }
    bool wait_returned(std::chrono::milliseconds timeout) {
      std::unique_lock lock(mu);
      return cv.wait_for(lock, timeout, [&] { return returned; });
    }
  };

  // Destroys `tx` on a thread of its own; true when ~Transport returned
  // within `timeout` (the thread is joined by join()).
  struct Destroyer {
    std::promise<void> destroyed;
    std::future<void> done = destroyed.get_future();
    std::thread thread;
    void start(std::unique_ptr<Transport>& tx) {
      thread = std::thread([this, &tx] {
        tx.reset();
        destroyed.set_value();
      });
    }
    bool wait(std::chrono::milliseconds timeout) {
      return done.wait_for(timeout) == std::future_status::ready;
    }
    void join() {
      if (thread.joinable()) thread.join();
    }
  };

  // What connect() returned, checked against the contract: a Connection got
  // on_closed exactly once (during ~Transport, which has returned) and is
  // freed once dropped; an error is a refusal and no on_closed ran.
  // Returns whether a Connection came back.
  static bool check_outcome(Connector& connector, SenderSide& side) {
    std::shared_ptr<Connection> conn;
    {
      std::lock_guard lock(connector.mu);
      if (!connector.result) return false;
      if (*connector.result) {
        conn = std::move(**connector.result);
        connector.result.reset();
      } else {
        const Error& e = connector.result->error();
        EXPECT_TRUE(e.code() == ErrorCode::kCancelled || e.code() == ErrorCode::kClosed)
            << "connect() failed other than by a refusal: " << e.to_string();
      }
    }
    std::lock_guard lock(side.mu);
    if (!conn) {
      EXPECT_EQ(side.closed_calls, 0) << "on_closed ran for a Connection never handed out";
      return false;
    }
    EXPECT_EQ(side.closed_calls, 1)
        << "the Connection connect() returned did not get on_closed exactly once during ~Transport";
    EXPECT_TRUE(conn->is_closed());
    const std::weak_ptr<Connection> watch = conn;
    conn->close(0ns);  // after ~Transport: a no-op
    conn.reset();
    EXPECT_TRUE(watch.expired()) << "the Connection (and its Transport's core) leaked";
    return true;
  }
};

// The moment of destruction sweeps over the whole connect(), round by round
// (a spin on the clock: a chosen delay, not a wait for a condition), from a
// twentieth of a connect() after the call to twice its length, and never
// before the connect() has started (Transport::connects_in_progress). Four
// channels: more handshakes and more set-up between them.
TEST_P(ConnectCloseRace, DestroyingTheTransportDuringConnectNeverHangsOrLeaks) {
  constexpr int kRounds = 40;
  Options o = options();
  o.num_channels = 4;
  Inbox server_in;
  server_in.check_pattern_bytes = false;
  auto server = Transport::create(o);
  ASSERT_TRUE(server) << server.error().to_string();
  std::unique_ptr<Transport> server_tx = std::move(*server);
  const std::string where = GetParam() == Kind::kShm
                                ? "@ember-connect-race-" + std::to_string(::getpid())
                                : "127.0.0.1:0";
  auto l = server_tx->listen(where, {Role::kServer, 0}, server_in.acceptor(), server_in.handlers());
  ASSERT_TRUE(l) << l.error().to_string();
  std::unique_ptr<Listener> listener = std::move(*l);
  std::chrono::nanoseconds connect_time{0};
  int connected = 0, refused = 0;
  for (int round = -1; round < kRounds; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    SenderSide side;
    auto client = Transport::create(o);
    ASSERT_TRUE(client) << client.error().to_string();
    std::unique_ptr<Transport> client_tx = std::move(*client);
    Connector connector;
    const auto start = std::chrono::steady_clock::now();
    connector.start(client_tx.get(), listener->address(), side.handlers());
    if (round < 0) {
      // Calibration: how long a whole connect() takes here.
      ASSERT_TRUE(connector.wait_returned(kDeadline));
      connect_time = std::chrono::steady_clock::now() - start;
      connector.thread.join();
      ASSERT_TRUE(connector.result && *connector.result)
          << connector.result->error().to_string();
      connector.result.reset();
      client_tx.reset();
      EXPECT_EQ(side.closed_calls, 1);
      continue;
    }
    // Not before connect() is inside (counted by connects_in_progress()):
    // a connect() that starts after ~Transport returned is a call on a freed
    // object (the connector thread can be preempted for any time before it
    // gets there). A connect() that already returned is fine too.
    {
      const auto deadline = std::chrono::steady_clock::now() + kDeadline;
      while (client_tx->connects_in_progress() == 0 && !connector.has_returned() &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
      }
      ASSERT_TRUE(client_tx->connects_in_progress() > 0 || connector.has_returned())
          << "connect() neither started nor returned";
    }
    const auto at = start + connect_time * 2 * (round + 1) / kRounds;
    while (std::chrono::steady_clock::now() < at) {
    }
    Destroyer destroyer;
    destroyer.start(client_tx);
    const bool destroyed = destroyer.wait(kDeadline);
    EXPECT_TRUE(destroyed) << "~Transport hung while connect() was in progress";
    const bool returned = connector.wait_returned(kDeadline);
    EXPECT_TRUE(returned) << "connect() hung while its Transport was destroyed";
    // A hang ends at connect_timeout; the joins wait for it.
    destroyer.join();
    connector.thread.join();
    if (check_outcome(connector, side)) {
      ++connected;
    } else {
      ++refused;
    }
    if (::testing::Test::HasFailure()) break;
  }
  std::cout << "[          ] " << connected << " round(s) connected, " << refused
            << " refused\n";
  listener.reset();
  server_tx.reset();
}

// A peer that accepts and reads the hello, then never answers: connect()
// waits in its handshake when ~Transport begins. ~Transport must cancel it
// (kCancelled) rather than wait out connect_timeout, and the connect() must
// not go on waiting for a peer on behalf of a Transport that is gone.
TEST_P(ConnectCloseRace, DestroyingTheTransportCancelsAConnectStalledInTheHandshake) {
  const bool shm = GetParam() == Kind::kShm;
  // The silent peer: a bare listening socket.
  const int lfd = shm ? ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)
                      : ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(lfd, 0) << std::strerror(errno);
  std::string address;
  if (shm) {
    address = "@ember-connect-stall-" + std::to_string(::getpid());
    auto sa = shm::make_address(address);
    ASSERT_TRUE(sa) << sa.error().to_string();
    ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&sa->first), sa->second), 0)
        << std::strerror(errno);
  } else {
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0) << std::strerror(errno);
    socklen_t len = sizeof sa;
    ASSERT_EQ(::getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len), 0);
    address = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
  }
  ASSERT_EQ(::listen(lfd, 4), 0) << std::strerror(errno);

  SenderSide side;
  auto client = Transport::create(options());
  ASSERT_TRUE(client) << client.error().to_string();
  std::unique_ptr<Transport> client_tx = std::move(*client);
  Connector connector;
  connector.start(client_tx.get(), address, side.handlers());
  // Accepted, and the hello is in: connect() now waits for the reply.
  const auto deadline = std::chrono::steady_clock::now() + kDeadline;
  pollfd p{lfd, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 15000), 1) << "connect() never reached the peer";
  const int peer = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
  ASSERT_GE(peer, 0) << std::strerror(errno);
  EXPECT_TRUE(stream_io::wait_ready(peer, POLLIN, deadline, "hello"));

  Destroyer destroyer;
  destroyer.start(client_tx);
  const bool destroyed = destroyer.wait(kDeadline);
  EXPECT_TRUE(destroyed) << "~Transport waited for a connect() stalled in its handshake";
  const bool returned = connector.wait_returned(kDeadline);
  EXPECT_TRUE(returned) << "connect() still waits for its peer after its Transport was destroyed";
  // Unblocks whichever hung: connect() then reads end of stream.
  ::close(peer);
  destroyer.join();
  connector.thread.join();
  {
    std::lock_guard lock(connector.mu);
    ASSERT_TRUE(connector.result);
    ASSERT_FALSE(*connector.result) << "a handshake nobody answered gave a Connection";
    EXPECT_EQ(connector.result->error().code(), ErrorCode::kCancelled)
        << "got " << connector.result->error().to_string();
  }
  EXPECT_FALSE(check_outcome(connector, side));
  ::close(lfd);
}

INSTANTIATE_TEST_SUITE_P(All, ConnectCloseRace, ::testing::Values(Kind::kTcp, Kind::kShm),
                         [](const auto& p) { return std::string(kind_name(p.param)); });

}  // namespace
}  // namespace ember::transport
