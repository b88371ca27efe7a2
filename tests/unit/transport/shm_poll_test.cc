// Connection::poll over shm: a thread that is about to wait consumes what has
// arrived itself (transport.h). Checks that every message is delivered once,
// in order per channel, never by two threads at once; that send completions
// run once whoever reclaims them; that what a poller leaves behind reaches
// the I/O thread when it sleeps on its doorbell; and that a torn-down
// connection's poll() delivers nothing.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "common/transport/transport.h"
#include "tests/unit/transport/transport_test_util.h"

namespace ember::transport {
namespace {

using namespace std::chrono_literals;
using testing::Inbox;
using testing::MemfdRegion;

Options shm_options(std::chrono::nanoseconds busy_poll) {
  Options o;
  o.kind = Kind::kShm;
  o.num_channels = 2;
  o.num_io_threads = 2;
  o.busy_poll = busy_poll;
  o.max_message_bytes = std::uint64_t{16} << 20;
  o.max_queued_bytes = std::uint64_t{64} << 20;
  // Liveness is not under test: 60 s, so that busy pollers beside a TSan
  // build on 2 loaded cores cannot starve a heartbeat into a close.
  o.heartbeat_interval = 200ms;
  o.heartbeat_timeout = 60s;
  return o;
}

// A server and a client transport over shm, connected; the client side's
// messages checked for order and exclusivity per channel.
struct PollPair {
  Inbox server_in, client_in;  // before the transports: on_closed may run into them
  // The registered memory before the transports, so it outlives them: a
  // transport's I/O thread may still release a lent Buffer of it while the
  // transport shuts down (TSan saw the region's condition variable
  // destroyed under an I/O thread's notify).
  std::unique_ptr<MemfdRegion> server_mem, client_mem;
  std::unique_ptr<Transport> server_tx, client_tx;
  std::unique_ptr<Listener> listener;
  std::shared_ptr<Connection> client, server;

  // Per channel: a handler running (two at once is a violation), the next
  // sequence number expected, and who delivered.
  std::atomic<bool> in_handler[2] = {false, false};
  std::uint64_t next_seq[2] = {0, 0};  // written by the channel's current consumer only
  std::atomic<int> overlaps{0}, out_of_order{0};
  std::atomic<std::uint64_t> on_pollers{0};
  std::mutex poller_mu;  // guards pollers: deliveries on these threads count as polled
  std::vector<std::thread::id> pollers;

  bool is_poller(std::thread::id id) {
    std::lock_guard lock(poller_mu);
    return std::find(pollers.begin(), pollers.end(), id) != pollers.end();
  }

  void setup(const std::string& tag, std::chrono::nanoseconds client_busy_poll) {
    auto s = Transport::create(shm_options(1ms));
    ASSERT_TRUE(s) << s.error().to_string();
    server_tx = std::move(*s);
    auto c = Transport::create(shm_options(client_busy_poll));
    ASSERT_TRUE(c) << c.error().to_string();
    client_tx = std::move(*c);
    server_mem = std::make_unique<MemfdRegion>(std::size_t{64} << 20);
    client_mem = std::make_unique<MemfdRegion>(std::size_t{64} << 20);
    auto sid = server_tx->register_memory(server_mem->region());
    ASSERT_TRUE(sid);
    server_mem->set_region_id(*sid);
    auto cid = client_tx->register_memory(client_mem->region());
    ASSERT_TRUE(cid);
    client_mem->set_region_id(*cid);
    client_in.check_pattern_bytes = false;
    client_in.also = [this](Connection&, Incoming& m) {
      const std::uint32_t ch = m.channel;
      if (in_handler[ch].exchange(true)) overlaps.fetch_add(1);
      std::uint64_t seq = 0;
      std::memcpy(&seq, m.bytes.data(), sizeof seq);
      if (seq != next_seq[ch]) out_of_order.fetch_add(1);
      next_seq[ch] = seq + 1;
      if (is_poller(std::this_thread::get_id())) on_pollers.fetch_add(1);
      in_handler[ch].store(false);
    };
    auto l = server_tx->listen("@ember-poll-" + tag + "-" + std::to_string(::getpid()),
                               {Role::kServer, 0}, server_in.acceptor(), server_in.handlers());
    ASSERT_TRUE(l) << l.error().to_string();
    listener = std::move(*l);
    auto conn = client_tx->connect(listener->address(), {Role::kWorker, 0}, client_in.handlers());
    ASSERT_TRUE(conn) << conn.error().to_string();
    client = *conn;
    ASSERT_TRUE(server_in.wait_accepted(1));
    server = server_in.accepted_at(0);
  }

  // Message `seq` on `ch`: small (through the ring) or, every 16th, a large
  // one lent from the server's registered memory (16 KiB: the region's 4096
  // of them outnumber the lanes' credits, so none is reused while lent); the
  // first 8 bytes are seq.
  void send(std::uint32_t ch, std::uint64_t seq) {
    if (seq % 16 == 15) {
      Buffer b = server_mem->make(16 << 10);
      std::memcpy(b.data(), &seq, sizeof seq);
      ASSERT_TRUE(server->send(ch, std::move(b)));
    } else {
      std::array<std::byte, 48> msg{};
      std::memcpy(msg.data(), &seq, sizeof seq);
      ASSERT_TRUE(server->send(ch, msg));
    }
  }

  ~PollPair() {
    if (client) client->close();
    client_in.wait_closed(5s);
  }
};

TEST(ShmPoll, PollersAndTheIoThreadDeliverEachMessageOnceInOrderNeverTwoAtOnce) {
  PollPair p;
  ASSERT_NO_FATAL_FAILURE(p.setup("order", 1ms));
  constexpr std::uint64_t kPerChannel = 20000;
  std::atomic<bool> stop{false};
  std::vector<std::thread> pollers;
  for (int t = 0; t < 3; ++t) {
    pollers.emplace_back([&] {
      {
        std::lock_guard lock(p.poller_mu);
        p.pollers.push_back(std::this_thread::get_id());
      }
      while (!stop.load()) {
        if (!p.client->poll()) std::this_thread::yield();
      }
    });
  }
  // Client-side large sends too: their completions are reclaimed by whoever
  // consumes the release ring (a poller or the I/O thread), exactly once.
  std::atomic<int> completions{0};
  constexpr int kClientLarge = 64;
  std::thread client_sender([&] {
    for (int i = 0; i < kClientLarge; ++i) {
      Buffer b = p.client_mem->make(256 << 10);
      ASSERT_TRUE(p.client->send(static_cast<std::uint32_t>(i % 2), std::move(b),
                                 [&](const Status& s) {
                                   EXPECT_TRUE(s) << s.error().to_string();
                                   completions.fetch_add(1);
                                 }));
    }
  });
  std::thread other_channel([&] {
    for (std::uint64_t i = 0; i < kPerChannel; ++i) p.send(1, i);
    ASSERT_TRUE(p.server->flush(1));
  });
  for (std::uint64_t i = 0; i < kPerChannel; ++i) p.send(0, i);
  ASSERT_TRUE(p.server->flush(0));
  other_channel.join();
  client_sender.join();
  const bool all0 = p.client_in.wait_count(0, kPerChannel);
  const bool all1 = p.client_in.wait_count(1, kPerChannel);
  const bool released = p.client_mem->wait_all_released();
  // Three threads polling without pause against one I/O thread: some
  // messages are theirs, else poll() consumes nothing. Which thread wins the
  // lane is the scheduler's choice (on 2 loaded cores the I/O thread can win
  // all 40000), so more bursts follow until a poller has delivered one; a
  // poll() that never consumes fails after 500 bursts.
  std::uint64_t extra = 0;
  for (int burst = 0; burst < 500 && p.on_pollers.load() == 0 && all0; ++burst) {
    for (int i = 0; i < 64; ++i) p.send(0, kPerChannel + extra++);
    ASSERT_TRUE(p.server->flush(0));
    ASSERT_TRUE(p.client_in.wait_count(0, kPerChannel + extra));
  }
  stop.store(true);
  for (auto& t : pollers) t.join();
  ASSERT_TRUE(all0 && all1) << p.client_in.count(0) << " and " << p.client_in.count(1) << " of "
                            << kPerChannel << " per channel";
  EXPECT_EQ(p.client_in.count(0), kPerChannel + extra);
  EXPECT_EQ(p.client_in.count(1), kPerChannel);
  EXPECT_EQ(p.overlaps.load(), 0) << "two threads ran on_message for one channel at once";
  EXPECT_EQ(p.out_of_order.load(), 0);
  EXPECT_TRUE(released);
  EXPECT_EQ(completions.load(), kClientLarge);
  EXPECT_TRUE(p.server_mem->wait_all_released()) << "the client kept a lent payload";
  EXPECT_GT(p.on_pollers.load(), 0u) << "no poller consumed a message in " << extra
                                     << " more after the first 40000";
}

TEST(ShmPoll, WhatAPollerLeavesReachesTheIoThreadAsleepOnItsDoorbell) {
  // busy_poll = 0: the client's I/O thread parks on its doorbell as soon as
  // it is idle. A poller keeps the server from ringing while it consumes;
  // what arrives after its last look must wake the I/O thread.
  PollPair p;
  ASSERT_NO_FATAL_FAILURE(p.setup("handback", 0ns));
  constexpr int kRounds = 200;
  constexpr std::uint64_t kBurst = 50;
  std::uint64_t sent = 0;
  for (int r = 0; r < kRounds; ++r) {
    std::atomic<bool> go{false}, stop{false};
    std::thread poller([&] {
      {
        std::lock_guard lock(p.poller_mu);
        p.pollers.push_back(std::this_thread::get_id());
      }
      go.store(true);
      // Without pause: owning the lane most of the time, so messages are
      // published between its last look and its hand-back.
      while (!stop.load()) (void)p.client->poll();
    });
    while (!go.load()) std::this_thread::yield();
    for (std::uint64_t i = 0; i < kBurst; ++i) {
      p.send(0, sent++);
      ASSERT_TRUE(p.server->flush(0));
    }
    stop.store(true);
    poller.join();
    // Nobody polls now: the rest is the I/O thread's. (A message stranded in
    // the lane would wait for the next one's doorbell: there is none.)
    ASSERT_TRUE(p.client_in.wait_count(0, sent, 20s))
        << "round " << r << ": " << p.client_in.count(0) << " of " << sent
        << " arrived; the rest waits in the lane with nobody to consume it";
  }
  EXPECT_EQ(p.overlaps.load(), 0);
  EXPECT_EQ(p.out_of_order.load(), 0);
}

TEST(ShmPoll, AClosedConnectionDeliversNothingMoreThroughPoll) {
  PollPair p;
  ASSERT_NO_FATAL_FAILURE(p.setup("closed", 1ms));
  for (std::uint64_t i = 0; i < 100; ++i) p.send(0, i);
  ASSERT_TRUE(p.server->flush(0));
  ASSERT_TRUE(p.client_in.wait_count(0, 100));
  p.client->close();
  ASSERT_TRUE(p.client_in.wait_closed());
  EXPECT_FALSE(p.client->poll());
  EXPECT_EQ(p.client_in.count(0), 100u);
}

TEST(TcpPoll, ConsumesNothingOnTheCallingThread) {
  Inbox server_in, client_in;
  Options o = shm_options(1ms);
  o.kind = Kind::kTcp;
  auto server_tx = Transport::create(o);
  ASSERT_TRUE(server_tx);
  auto client_tx = Transport::create(o);
  ASSERT_TRUE(client_tx);
  auto listener = (*server_tx)->listen("127.0.0.1:0", {Role::kServer, 0}, server_in.acceptor(),
                                       server_in.handlers());
  ASSERT_TRUE(listener);
  auto conn = (*client_tx)->connect((*listener)->address(), {Role::kWorker, 0}, client_in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  EXPECT_FALSE((*conn)->poll());
  (*conn)->close();
  EXPECT_TRUE(client_in.wait_closed());
}

}  // namespace
}  // namespace ember::transport
