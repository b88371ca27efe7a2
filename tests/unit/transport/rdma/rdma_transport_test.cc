// The rdma transport suite (label rdma): runs where an RDMA device has an
// active port — in CI, inside the Soft-RoCE guest (scripts/rdma-vm/suite.sh);
// elsewhere every test skips and says why.
//
// Parameterised over the receive side's memory:
//  * write:     a registered page pool is the receive allocator, so large
//               messages go by rendezvous + RDMA WRITE with immediate;
//  * fragments: no receive allocator (heap landing memory, not
//               registered): the receiver answers no-grant and large
//               messages go as fragments through the send ring.
// The same checks as the tcp/shm suite (every size intact and in order per
// channel, concurrent senders, 100 keys in one push, concurrent mixed-size
// push/pull between one pair, header fields identical), plus what only rdma
// has: slot caching, credits under a stalled receiver, peer death, rejected
// connections, and the memlock start-up error.
#include <gtest/gtest.h>

#include <random>

#include <fmt/format.h>
#include <thread>

#include "common/config/config.h"
#include "common/memory/page_pool.h"
#include "common/proto/message.h"
#include "common/transport/options_from_config.h"
#include "common/transport/pool_buffer.h"
#include "common/transport/rdma/rdma_transport.h"
#include "common/transport/transport.h"
#include "tests/unit/transport/close_race_util.h"
#include "tests/unit/transport/rdma/rdma_test_util.h"
#include "tests/unit/transport/transport_test_util.h"

namespace ember::transport::rdma {
namespace {

using namespace std::chrono_literals;
using transport::testing::Inbox;
using Clock = std::chrono::steady_clock;

struct Mode {
  const char* name;
  bool pool_receive;  // receive allocator = registered pool (write path)
};

// One side: a page pool registered with an rdma Transport.
struct Side {
  std::unique_ptr<memory::PagePool> pool;
  std::unique_ptr<Transport> transport;
  std::uint32_t region = MemoryLocation::kNoRegion;

  static std::unique_ptr<Side> make(bool pool_receive, std::uint32_t channels = 2,
                                    std::size_t pages = 160, Options o = testing::suite_options()) {
    auto s = std::make_unique<Side>();
    memory::PoolOptions po;
    po.prealloc_pages = pages;
    po.backing = memory::BackingRequest::kPlain;
    po.prefault = false;
    auto pool = memory::PagePool::create(po);
    EMBER_CHECK_MSG(pool.has_value(), "{}", pool.error().to_string());
    s->pool = std::move(*pool);
    o.num_channels = channels;
    if (pool_receive) o.receive_allocator = pool_receive_allocator(*s->pool);
    auto t = Transport::create(o);
    EMBER_CHECK_MSG(t.has_value(), "{}", t.error().to_string());
    s->transport = std::move(*t);
    auto r = register_pool(*s->transport, *s->pool);
    EMBER_CHECK_MSG(r.has_value(), "{}", r.error().to_string());
    s->region = *r;
    return s;
  }
  Buffer buffer(std::size_t bytes) {
    auto b = allocate_buffer(*pool, bytes, region);
    EMBER_CHECK_MSG(b.has_value(), "{}", b.error().to_string());
    return std::move(*b);
  }
};

// Destroys the sides' transports where it goes out of scope: ~Transport
// closes their connections (on_closed runs) and joins their I/O threads.
// Declared after the Inboxes and the state their handlers touch, it runs
// before those are destroyed, so no callback still running (an Inbox records
// a message after its `also` ran, which is what a test may wait on) or still
// to come (on_closed) meets a destroyed one.
struct StopTransports {
  std::vector<Side*> sides;
  ~StopTransports() {
    for (Side* s : sides) s->transport.reset();
  }
};

// Counters of both ends, for failure messages.
std::string dump(const char* who, Connection& c) {
  const ConnectionStats s = c.stats();
  std::string out = fmt::format(
      "{}: sent {} msgs / {} frames, received {} msgs / {} frames, queued {} B, closed {}", who,
      s.messages_sent, s.frames_sent, s.messages_received, s.frames_received, s.queued_bytes,
      c.is_closed());
  if (auto r = rdma_stats(c)) {
    out += fmt::format("; sends {} writes {} rts {} grants {} cached {} released {} fragments {} "
                       "credit msgs {} credit stalls {}",
                       r->sends_posted, r->writes_posted, r->rts_sent, r->grants_received,
                       r->cached_slot_writes, r->slots_released, r->fragments_sent,
                       r->credit_messages_sent, r->credit_stalls);
  }
  return out + "\n" + rdma_debug_state(c);
}

class RdmaSuite : public ::testing::TestWithParam<Mode> {
 protected:
  void SetUp() override {
    auto a = testing::listen_address();
    if (!a) GTEST_SKIP() << testing::skip_reason();
    address_ = *a;
  }
  std::string address_;
};

const std::vector<std::size_t> kSizes = {0, 1, 4095, 4096, 4097, 1u << 20, 64u << 20};

TEST_P(RdmaSuite, EverySizeArrivesIntactAndInOrderPerChannel) {
  auto server = Side::make(GetParam().pool_receive, 2, 96);
  auto client = Side::make(GetParam().pool_receive, 2, 96);
  Inbox server_in, client_in;
  StopTransports stop{{server.get(), client.get()}};
  auto listener = server->transport->listen(address_, {Role::kServer, 0}, server_in.acceptor(),
                                            server_in.handlers());
  ASSERT_TRUE(listener) << listener.error().to_string();
  auto conn = client->transport->connect((*listener)->address(), {Role::kWorker, 3},
                                         client_in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  ASSERT_TRUE(server_in.wait_accepted(1));
  auto server_conn = server_in.accepted_at(0);
  EXPECT_EQ(server_conn->peer().rank, 3u);
  EXPECT_EQ(server_conn->peer().role, Role::kWorker);
  EXPECT_EQ((*conn)->peer().role, Role::kServer);

  // Every size on both channels in both directions, except that each 64 MiB
  // message goes one way per channel (client to server on 0, back on 1):
  // under the emulated guest a 64 MiB transfer takes seconds.
  auto sizes_for = [](bool client_side, std::uint32_t ch) {
    std::vector<std::size_t> v = kSizes;
    if (client_side != (ch == 0)) v.pop_back();
    return v;
  };
  auto send_all = [&](Connection& c, Side& side, bool client_side) {
    for (std::uint32_t ch = 0; ch < 2; ++ch) {
      const std::vector<std::size_t> sizes = sizes_for(client_side, ch);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        Buffer b = side.buffer(sizes[i]);
        transport::testing::fill_pattern(b.bytes(), ch, i);
        Status s = c.send(ch, std::move(b));
        ASSERT_TRUE(s) << s.error().to_string();
      }
      ASSERT_TRUE(c.flush(ch));
    }
  };
  std::thread t([&] { send_all(*server_conn, *server, false); });
  send_all(**conn, *client, true);
  t.join();
  auto closed = [](Inbox& in) {
    auto r = in.closed_reason();
    return r ? r->to_string() : std::string("open");
  };
  for (std::uint32_t ch = 0; ch < 2; ++ch) {
    const auto to_server = sizes_for(true, ch);
    const auto to_client = sizes_for(false, ch);
    ASSERT_TRUE(server_in.wait_count(ch, to_server.size(), 90s))
        << "channel " << ch << ": " << server_in.count(ch) << " arrived; server side " << closed(server_in);
    ASSERT_TRUE(client_in.wait_count(ch, to_client.size(), 90s))
        << "channel " << ch << ": " << client_in.count(ch) << " arrived; client side " << closed(client_in);
    for (auto [in, sizes] : {std::pair{&server_in, to_server}, std::pair{&client_in, to_client}}) {
      std::lock_guard lock(in->mu);
      EXPECT_EQ(in->sizes[ch], sizes);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        EXPECT_TRUE(in->intact[ch][i]) << "size " << sizes[i] << " channel " << ch;
      }
    }
  }
  const auto stats = rdma_stats(**conn);
  ASSERT_TRUE(stats.has_value());
  if (GetParam().pool_receive) {
    EXPECT_GE(stats->writes_posted, 5u);  // 4097 B .. 1 MiB on two channels, 64 MiB on one
    EXPECT_EQ(stats->fragments_sent, 0u);
  } else {
    EXPECT_EQ(stats->writes_posted, 0u);
    EXPECT_GE(stats->fragments_sent, 5u);
  }

  (*conn)->close();
  ASSERT_TRUE(client_in.wait_closed());
  ASSERT_TRUE(server_in.wait_closed());
  EXPECT_EQ(client_in.closed_reason()->code(), ErrorCode::kClosed) << client_in.closed_reason()->to_string();
  EXPECT_EQ(server_in.closed_reason()->code(), ErrorCode::kClosed) << server_in.closed_reason()->to_string();
  EXPECT_EQ(client_in.closed_count, 1);
  EXPECT_FALSE((*conn)->send(0, std::span<const std::byte>()));
}

TEST_P(RdmaSuite, ManySmallMessagesKeepOrderFromConcurrentSenders) {
  Options o = testing::suite_options();
  o.heartbeat_timeout = 120s;  // a stall shows as a stall (with its state), not a timeout
  auto server = Side::make(GetParam().pool_receive, 2, 4, o);
  auto client = Side::make(GetParam().pool_receive, 2, 4, o);
  Inbox server_in, client_in;
  server_in.check_pattern_bytes = false;
  std::mutex seen_mu;
  std::map<std::uint32_t, std::vector<std::uint64_t>> seen;
  bool in_order = true;
  server_in.also = [&](Connection&, Incoming& m) {
    std::uint32_t sender;
    std::uint64_t seq;
    std::memcpy(&sender, m.bytes.data(), 4);
    std::memcpy(&seq, m.bytes.data() + 4, 8);
    std::lock_guard lock(seen_mu);
    auto& v = seen[sender];
    if (!v.empty() && v.back() + 1 != seq) in_order = false;
    v.push_back(seq);
  };
  StopTransports stop{{server.get(), client.get()}};
  auto listener = server->transport->listen(address_, {Role::kServer, 0}, server_in.acceptor(),
                                            server_in.handlers());
  ASSERT_TRUE(listener);
  auto conn = client->transport->connect((*listener)->address(), {Role::kWorker, 0}, client_in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  constexpr int kThreads = 4;
  constexpr std::uint64_t kPerThread = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::uint32_t ch = static_cast<std::uint32_t>(t % 2);
      std::array<std::byte, 64> msg{};
      for (std::uint64_t i = 0; i < kPerThread; ++i) {
        const std::uint32_t sender = static_cast<std::uint32_t>(t);
        std::memcpy(msg.data(), &sender, 4);
        std::memcpy(msg.data() + 4, &i, 8);
        ASSERT_TRUE((*conn)->send(ch, msg));
      }
    });
  }
  for (auto& th : threads) th.join();
  for (std::uint32_t ch = 0; ch < 2; ++ch) {
    ASSERT_TRUE(server_in.wait_count(ch, 2 * kPerThread, 30s))
        << "channel " << ch << ": " << server_in.count(ch) << " arrived\n"
        << dump("client", **conn) << dump("server", *server_in.accepted_at(0))
        << "client closed: " << (client_in.closed_reason() ? client_in.closed_reason()->to_string() : "no")
        << "\nserver closed: " << (server_in.closed_reason() ? server_in.closed_reason()->to_string() : "no");
  }
  std::lock_guard lock(seen_mu);
  EXPECT_TRUE(in_order);
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(seen[static_cast<std::uint32_t>(t)].size(), kPerThread);
  // messages_sent counts send completions, which may trail the receiver.
  const auto deadline = Clock::now() + 10s;
  while ((*conn)->stats().messages_sent < kThreads * kPerThread && Clock::now() < deadline) {
    std::this_thread::yield();
  }
  const ConnectionStats stats = (*conn)->stats();
  EXPECT_EQ(stats.messages_sent, kThreads * kPerThread);
  EXPECT_LT(stats.frames_sent * 10, stats.messages_sent);  // batching
}

// Connection::cork: a corked burst of small messages leaves in full batches
// (see the same test in transport_test.cc); without the cork's effect on the
// flush timer, flush_interval 0 closed a batch whenever the I/O thread ran.
TEST_P(RdmaSuite, ACorkedBurstOfSmallMessagesLeavesInFullBatches) {
  auto server = Side::make(GetParam().pool_receive, 1, 4);
  auto client = Side::make(GetParam().pool_receive, 1, 4);
  Inbox server_in, client_in;
  StopTransports stop{{server.get(), client.get()}};
  auto listener = server->transport->listen(address_, {Role::kServer, 0}, server_in.acceptor(),
                                            server_in.handlers());
  ASSERT_TRUE(listener);
  auto conn = client->transport->connect((*listener)->address(), {Role::kWorker, 0}, client_in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  constexpr std::uint64_t kMessages = 2000;
  constexpr std::size_t kBytes = 96;
  std::uint64_t sent = 0;
  for (int round = 0; round < 3; ++round) {
    const ConnectionStats before = (*conn)->stats();
    (*conn)->cork(0);
    std::vector<std::byte> msg(kBytes);
    for (std::uint64_t i = 0; i < kMessages; ++i) {
      transport::testing::fill_pattern(msg, 0, sent + i);
      ASSERT_TRUE((*conn)->send(0, msg));
    }
    sent += kMessages;
    ASSERT_TRUE((*conn)->flush(0));
    ASSERT_TRUE(server_in.wait_count(0, sent, 30s)) << server_in.count(0) << " arrived";
    // The counters move at send completions, which may trail the receiver.
    const auto deadline = Clock::now() + 10s;
    while ((*conn)->stats().messages_sent < sent && Clock::now() < deadline) std::this_thread::yield();
    const ConnectionStats after = (*conn)->stats();
    ASSERT_EQ(after.messages_sent, sent);
    transport::testing::expect_full_batches(before, after, kMessages, kBytes, round);
  }
  std::lock_guard lock(server_in.mu);
  for (std::size_t i = 0; i < server_in.intact[0].size(); ++i) EXPECT_TRUE(server_in.intact[0][i]) << i;
}

// 100 parameter-server pushes (every header field set) in one burst: all
// arrive, each header decodes to exactly what was encoded, values exact.
TEST_P(RdmaSuite, HundredKeysInOnePushArriveWithEveryHeaderFieldIntact) {
  auto server = Side::make(GetParam().pool_receive, 2, 4);
  auto client = Side::make(GetParam().pool_receive, 2, 4);
  std::vector<proto::Header> sent(100);
  std::vector<std::vector<float>> values(100);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::optional<proto::Header>> got(100);
  std::vector<bool> values_ok(100, false);
  int received = 0;
  Inbox server_in;
  server_in.check_pattern_bytes = false;
  server_in.also = [&](Connection&, Incoming& m) {
    auto view = proto::decode(m.bytes);
    std::lock_guard lock(mu);
    ++received;
    if (!view || view->header.key >= 100) return;
    const std::size_t k = view->header.key;
    got[k] = view->header;
    values_ok[k] = view->payload.size() == values[k].size() * 4 &&
                   std::memcmp(view->payload.data(), values[k].data(), view->payload.size()) == 0;
    cv.notify_all();
  };
  Inbox client_in;
  StopTransports stop{{server.get(), client.get()}};
  auto listener = server->transport->listen(address_, {Role::kServer, 0}, server_in.acceptor(),
                                            server_in.handlers());
  ASSERT_TRUE(listener);
  auto conn = client->transport->connect((*listener)->address(), {Role::kWorker, 5}, client_in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  for (std::size_t k = 0; k < 100; ++k) {
    proto::Header& h = sent[k];
    h.type = proto::MsgType::kPush;
    h.flags = 0;
    h.dtype = proto::DType::kFloat32;
    h.request_id = 0xABCDEF0000ull + k;
    h.key = k;
    h.step = 1000 + k;
    h.num_chunks = 3;
    h.chunk_index = static_cast<std::uint32_t>(k % 3);
    h.worker_rank = 5;
    h.num_elements = (k % 10) * 300 + 1;  // 4 B .. 10.8 KB: batched and large
    h.offset_elements = h.chunk_index * h.num_elements;
    values[k].resize(h.num_elements);
    for (std::size_t i = 0; i < values[k].size(); ++i) values[k][i] = static_cast<float>(k) + 0.5f * i;
    const auto bytes = proto::encode_message(
        h, {}, std::as_bytes(std::span<const float>(values[k].data(), values[k].size())));
    ASSERT_TRUE((*conn)->send(static_cast<std::uint32_t>(k % 2), bytes));
  }
  ASSERT_TRUE((*conn)->flush_all());
  std::unique_lock lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, 60s, [&] { return received >= 100; })) << received << " of 100 arrived";
  for (std::size_t k = 0; k < 100; ++k) {
    ASSERT_TRUE(got[k].has_value()) << "key " << k;
    const proto::Header& a = sent[k];
    const proto::Header& b = *got[k];
    EXPECT_EQ(a.type, b.type);
    EXPECT_EQ(a.flags, b.flags);
    EXPECT_EQ(a.dtype, b.dtype);
    EXPECT_EQ(a.request_id, b.request_id);
    EXPECT_EQ(a.key, b.key);
    EXPECT_EQ(a.step, b.step);
    EXPECT_EQ(a.chunk_index, b.chunk_index);
    EXPECT_EQ(a.num_chunks, b.num_chunks);
    EXPECT_EQ(a.worker_rank, b.worker_rank);
    EXPECT_EQ(a.status, b.status);
    EXPECT_EQ(a.ndim, b.ndim);
    EXPECT_EQ(a.num_elements, b.num_elements);
    EXPECT_EQ(a.offset_elements, b.offset_elements);
    EXPECT_TRUE(values_ok[k]) << "key " << k;
  }
}

// Pushes and pull replies of mixed sizes in both directions at once between
// one pair: every message keeps its boundary and its bytes, in order per
// channel. The server answers each push with a reply of the same size and
// pattern from its own pool (the pull response path).
TEST_P(RdmaSuite, ConcurrentPushesAndPullsOfMixedSizesKeepBoundariesAndValues) {
  auto server = Side::make(GetParam().pool_receive, 2, 64);
  Options co = testing::suite_options();
  co.max_queued_bytes = 32u << 20;  // senders wait before the pool runs dry
  auto client = Side::make(GetParam().pool_receive, 2, 64, co);
  const std::uint32_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  constexpr std::size_t kPerChannel = 40;
  const std::vector<std::size_t> choices = {8, 100, 3000, 4097, 65536, (1u << 20) + 3, 2u << 20};
  std::array<std::vector<std::size_t>, 2> sizes;
  std::mt19937 rng(seed);
  for (auto& v : sizes) {
    for (std::size_t i = 0; i < kPerChannel; ++i) v.push_back(choices[rng() % choices.size()]);
  }
  Inbox server_in, client_in;
  Side* srv = server.get();
  std::atomic<int> echo_errors{0};
  server_in.also = [&, srv](Connection& c, Incoming& m) {
    // Index of this message on its channel = the count recorded before it.
    const std::uint64_t index = server_in.count(m.channel) - 1;
    Buffer reply = srv->buffer(m.bytes.size());
    transport::testing::fill_pattern(reply.bytes(), m.channel + 10, index);
    if (!c.send(m.channel, std::move(reply), {}, 0ns)) echo_errors.fetch_add(1);
  };
  auto listener = server->transport->listen(address_, {Role::kServer, 0}, server_in.acceptor(),
                                            server_in.handlers());
  ASSERT_TRUE(listener);
  client_in.check_pattern_bytes = false;
  std::array<std::atomic<int>, 2> reply_bad{};
  client_in.also = [&](Connection&, Incoming& m) {
    const std::uint64_t index = client_in.count(m.channel) - 1;
    if (transport::testing::check_pattern(m.bytes, m.channel + 10, index)) reply_bad[m.channel]++;
  };
  StopTransports stop{{server.get(), client.get()}};
  auto conn = client->transport->connect((*listener)->address(), {Role::kWorker, 1}, client_in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  std::vector<std::thread> threads;
  for (std::uint32_t ch = 0; ch < 2; ++ch) {
    threads.emplace_back([&, ch] {
      for (std::size_t i = 0; i < kPerChannel; ++i) {
        Buffer b = client->buffer(sizes[ch][i]);
        transport::testing::fill_pattern(b.bytes(), ch, i);
        ASSERT_TRUE((*conn)->send(ch, std::move(b)));
      }
      ASSERT_TRUE((*conn)->flush(ch));
    });
  }
  for (auto& t : threads) t.join();
  for (std::uint32_t ch = 0; ch < 2; ++ch) {
    ASSERT_TRUE(server_in.wait_count(ch, kPerChannel, 90s)) << "channel " << ch;
    ASSERT_TRUE((*listener) != nullptr);
    ASSERT_TRUE(server_in.accepted_at(0)->flush(ch));
    ASSERT_TRUE(client_in.wait_count(ch, kPerChannel, 90s)) << "channel " << ch;
    std::lock_guard lock(server_in.mu);
    EXPECT_EQ(server_in.sizes[ch], sizes[ch]);
    for (std::size_t i = 0; i < kPerChannel; ++i) EXPECT_TRUE(server_in.intact[ch][i]) << ch << "/" << i;
    std::lock_guard lock2(client_in.mu);
    EXPECT_EQ(client_in.sizes[ch], sizes[ch]);
    EXPECT_EQ(reply_bad[ch].load(), 0) << "channel " << ch;
  }
  EXPECT_EQ(echo_errors.load(), 0);
}

// A stream of same-sized large messages needs one rendezvous, not one per
// message; sizes that change ask again, and slots left over are released.
TEST_P(RdmaSuite, RepeatedSizesReuseGrantedSlotsAndChangedSizesAskAgain) {
  auto server = Side::make(GetParam().pool_receive, 1, 24);
  auto client = Side::make(GetParam().pool_receive, 1, 24);
  Inbox server_in, client_in;
  server_in.check_pattern_bytes = false;
  StopTransports stop{{server.get(), client.get()}};
  auto listener = server->transport->listen(address_, {Role::kServer, 0}, server_in.acceptor(),
                                            server_in.handlers());
  ASSERT_TRUE(listener);
  auto conn = client->transport->connect((*listener)->address(), {Role::kWorker, 0}, client_in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  std::size_t n = 0;
  // One at a time, as one key's pushes come one step apart: after each
  // arrival, wait (with a deadline) until the receiver's re-armed slot has
  // reached the sender.
  auto send_one = [&](std::size_t bytes) {
    const std::uint64_t grants = rdma_stats(**conn)->grants_received;
    ASSERT_TRUE((*conn)->send(0, client->buffer(bytes)));
    ++n;
    ASSERT_TRUE(server_in.wait_count(0, n, 30s));
    if (!GetParam().pool_receive) return;
    const auto deadline = Clock::now() + 10s;
    while (rdma_stats(**conn)->grants_received < grants + 1 + (n == 1 ? 1 : 0) &&
           Clock::now() < deadline) {
      std::this_thread::yield();
    }
  };
  for (int i = 0; i < 16; ++i) send_one(256u << 10);
  auto s1 = *rdma_stats(**conn);
  if (!GetParam().pool_receive) {
    EXPECT_EQ(s1.writes_posted, 0u);
    EXPECT_EQ(s1.fragments_sent, 16u);
    EXPECT_LE(s1.rts_sent, 1u);  // one no-grant, then fragments straight away
    return;
  }
  EXPECT_EQ(s1.writes_posted, 16u);
  EXPECT_LE(s1.rts_sent, 2u) << "one rendezvous for the size, not one per message";
  EXPECT_GE(s1.cached_slot_writes, 14u);
  // Six other sizes, none inside an earlier size's [size, 2 x size] window.
  for (std::size_t bytes : {64u << 10, 16u << 10, 600u << 10, 1400u << 10, 3u << 20, 7u << 20}) {
    send_one(bytes);
  }
  auto s2 = *rdma_stats(**conn);
  EXPECT_GE(s2.rts_sent, s1.rts_sent + 6) << "a changed size asks again";
  EXPECT_GE(s2.slots_released, 1u) << "more than kMaxCachedSlots sizes: the oldest slots go back";
  std::lock_guard lock(server_in.mu);
  EXPECT_EQ(server_in.sizes[0].size(), 22u);
}

// A receiver that stops handling messages makes the sender wait (credits,
// then max_queued_bytes), never overrun its receive ring; when it resumes,
// everything accepted arrives in order.
TEST_P(RdmaSuite, StalledReceiverPushesBackAndLosesNothing) {
  auto server = Side::make(GetParam().pool_receive, 1, 4);
  Options co = testing::suite_options(1);
  co.max_queued_bytes = 256u << 10;
  auto client = Side::make(GetParam().pool_receive, 1, 4, co);
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool open = false;
  Inbox server_in, client_in;
  server_in.check_pattern_bytes = false;
  server_in.also = [&](Connection&, Incoming&) {
    std::unique_lock lock(gate_mu);
    gate_cv.wait_for(lock, 60s, [&] { return open; });
  };
  StopTransports stop{{server.get(), client.get()}};
  auto listener = server->transport->listen(address_, {Role::kServer, 0}, server_in.acceptor(),
                                            server_in.handlers());
  ASSERT_TRUE(listener);
  auto conn = client->transport->connect((*listener)->address(), {Role::kWorker, 0}, client_in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  std::vector<std::byte> msg(1000);
  std::uint64_t accepted = 0;
  Status last = ok_status();
  for (int i = 0; i < 100000 && last; ++i) {
    std::memcpy(msg.data(), &accepted, 8);
    last = (*conn)->send(0, msg, 20ms);
    if (last) ++accepted;
    if (i % 16 == 0) (void)(*conn)->flush(0);
  }
  ASSERT_FALSE(last) << "the sender never felt the stalled receiver";
  EXPECT_EQ(last.error().code(), ErrorCode::kTimeout) << last.error().to_string();
  EXPECT_GT(rdma_stats(**conn)->credit_stalls, 0u);
  {
    std::lock_guard lock(gate_mu);
    open = true;
  }
  gate_cv.notify_all();
  ASSERT_TRUE((*conn)->flush(0));
  ASSERT_TRUE(server_in.wait_count(0, accepted, 60s)) << server_in.count(0) << " of " << accepted;
  EXPECT_FALSE(server_in.closed_reason().has_value());
}

// Small send(Buffer)s complete on the caller's thread once copied into a
// batch. ~Transport racing them must still run each completion once, all
// before on_closed and none after ~Transport returned (close_race_test.cc
// checks the same over tcp and shm). Regression: a sender that had just
// copied its payload ran the completion after on_closed.
TEST_P(RdmaSuite, SmallSendCompletionsComeBeforeOnClosed) {
  constexpr int kRounds = 20;
  constexpr int kSenders = 3;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    transport::testing::SenderSide client;
    client.linger_yields = 50;
    Inbox server_in;  // outlives the server's transport (its on_closed)
    server_in.check_pattern_bytes = false;
    auto server = Side::make(GetParam().pool_receive, 1, 16);
    auto client_side = Side::make(GetParam().pool_receive, 1, 16);  // its pool outlives link
    struct {
      std::unique_ptr<Transport> client_tx;  // what SenderSide destroys
    } link;
    link.client_tx = std::move(client_side->transport);
    auto listener = server->transport->listen(address_, {Role::kServer, 0}, server_in.acceptor(),
                                              server_in.handlers());
    ASSERT_TRUE(listener);
    auto conn = link.client_tx->connect((*listener)->address(), {Role::kWorker, 0}, client.handlers());
    ASSERT_TRUE(conn) << conn.error().to_string();
    std::shared_ptr<Connection> c = *conn;
    std::vector<std::thread> senders;
    for (int t = 0; t < kSenders; ++t) {
      senders.emplace_back([&] {
        for (;;) {
          auto [id, done] = client.next();
          Status s = c->send(0, Buffer::heap(64), std::move(done), 5s);
          if (!s) {  // kClosed: the transport is going
            client.note_refusal(s.error());
            break;
          }
          client.count_accepted();
        }
      });
    }
    EXPECT_TRUE(client.wait_accepted(50 + 10 * round)) << client.refusals();
    client.check_close_during_transport_destruction(link, [&] {
      for (auto& t : senders) t.join();
    });
    if (::testing::Test::HasFailure()) break;
  }
}

INSTANTIATE_TEST_SUITE_P(All, RdmaSuite,
                         ::testing::Values(Mode{"write", true}, Mode{"fragments", false}),
                         [](const auto& p) { return std::string(p.param.name); });

// ---------------------------------------------------------------------------

class RdmaErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = testing::listen_address();
    if (!a) GTEST_SKIP() << testing::skip_reason();
    address_ = *a;
    ip_ = address_.substr(0, address_.rfind(':'));
  }
  std::string address_;
  std::string ip_;
};

TEST_F(RdmaErrors, RejectedConnectionsAreErrorsNotHangs) {
  auto server = Side::make(true, 2, 16);
  Inbox server_in;
  StopTransports stop{{server.get()}};
  auto listener = server->transport->listen(address_, {Role::kServer, 0}, server_in.acceptor(),
                                            server_in.handlers());
  ASSERT_TRUE(listener);
  auto timed_connect = [&](Options o) {
    o.connect_timeout = 3s;
    auto t = Transport::create(o);
    EMBER_CHECK(t.has_value());
    Inbox in;
    const auto start = Clock::now();
    auto c = (*t)->connect((*listener)->address(), {Role::kWorker, 0}, in.handlers());
    const auto took = Clock::now() - start;
    EXPECT_LT(took, 5s) << "connect must end by connect_timeout";
    return c;
  };
  {
    Options o = testing::suite_options();
    o.auth_token = "another-jobs-token";
    auto c = timed_connect(o);
    ASSERT_FALSE(c);
    EXPECT_EQ(c.error().code(), ErrorCode::kAuth) << c.error().to_string();
    EXPECT_NE(c.error().message().find("auth_token"), std::string::npos) << c.error().to_string();
  }
  {
    Options o = testing::suite_options(3);
    auto c = timed_connect(o);
    ASSERT_FALSE(c);
    EXPECT_EQ(c.error().code(), ErrorCode::kProtocol) << c.error().to_string();
  }
  EXPECT_GE((*listener)->num_refused(), 2u);
  EXPECT_EQ(server_in.accepted.size(), 0u);
  {
    // Nobody listens on this port: refused at once (the peer's CM rejects).
    auto t = Transport::create(testing::suite_options());
    ASSERT_TRUE(t);
    Inbox in;
    const std::string closed_port = ip_ + ":" + std::to_string(1 + (::getpid() % 20000) + 30000);
    const auto start = Clock::now();
    auto c = (*t)->connect(closed_port, {Role::kWorker, 0}, in.handlers());
    ASSERT_FALSE(c);
    EXPECT_EQ(c.error().code(), ErrorCode::kIo) << c.error().to_string();
    EXPECT_LT(Clock::now() - start, 5s);
  }
  {
    // An address nobody answers for: resolution fails, is retried with
    // backoff, and gives up at connect_timeout.
    Options o = testing::suite_options();
    o.connect_timeout = 2s;
    auto t = Transport::create(o);
    ASSERT_TRUE(t);
    Inbox in;
    std::string unreachable = ip_.substr(0, ip_.rfind('.')) + ".77:7000";
    const auto start = Clock::now();
    auto c = (*t)->connect(unreachable, {Role::kWorker, 0}, in.handlers());
    ASSERT_FALSE(c);
    EXPECT_TRUE(c.error().code() == ErrorCode::kTimeout || c.error().code() == ErrorCode::kIo)
        << c.error().to_string();
    EXPECT_LT(Clock::now() - start, 6s);
  }
  // The listener still works after all that.
  auto good = Side::make(true, 2, 16);
  Inbox in;
  StopTransports stop_good{{good.get()}};
  auto c = good->transport->connect((*listener)->address(), {Role::kWorker, 1}, in.handlers());
  ASSERT_TRUE(c) << c.error().to_string();
  ASSERT_TRUE(server_in.wait_accepted(1));
}

// ~Transport while a connect() waits on the rdma_cm (here: resolving an
// address nobody answers for, retried with backoff until connect_timeout):
// the connect ends at once with kCancelled. Before, ~Transport waited for it
// until connect_timeout (60 s here).
TEST_F(RdmaErrors, DestroyingTheTransportCutsShortAConnectWaitingOnTheCm) {
  Inbox in;  // outlives the transport
  Options o = testing::suite_options();
  o.connect_timeout = 60s;
  auto t = Transport::create(o);
  ASSERT_TRUE(t);
  const std::string unreachable = ip_.substr(0, ip_.rfind('.')) + ".77:7000";
  std::optional<Result<std::shared_ptr<Connection>>> result;
  std::thread connecting([&] { result = (*t)->connect(unreachable, {Role::kWorker, 0}, in.handlers()); });
  // Destroyed only once connect() is inside (counted): from there it may race ~Transport.
  const auto inside_deadline = Clock::now() + 30s;
  while ((*t)->connects_in_progress() == 0 && Clock::now() < inside_deadline) std::this_thread::yield();
  ASSERT_EQ((*t)->connects_in_progress(), 1u);
  const auto start = Clock::now();
  t->reset();
  const auto took = Clock::now() - start;
  connecting.join();
  EXPECT_LT(took, 20s) << "~Transport waited for the connect instead of cancelling it";
  ASSERT_TRUE(result.has_value());
  ASSERT_FALSE(*result);
  EXPECT_EQ(result->error().code(), ErrorCode::kCancelled) << result->error().to_string();
}

TEST_F(RdmaErrors, PeerKilledWhileSendingToUsIsAnErrorNotAHang) {
  auto server = Side::make(true, 1, 32);
  Inbox server_in;
  StopTransports stop{{server.get()}};
  server_in.check_pattern_bytes = false;
  auto listener = server->transport->listen(address_, {Role::kServer, 0}, server_in.acceptor(),
                                            server_in.handlers());
  ASSERT_TRUE(listener);
  testing::Child peer({EMBER_RDMA_TEST_PEER, "client", (*listener)->address(), std::to_string(4u << 20)});
  ASSERT_TRUE(peer.wait_line("CONNECTED", 30s)) << "the peer did not connect";
  ASSERT_TRUE(server_in.wait_count(0, 2, 30s)) << "no message arrived from the peer";
  peer.kill();  // SIGKILL mid-stream
  ASSERT_TRUE(server_in.wait_closed(30s)) << "the death of the peer was never noticed";
  const Error reason = *server_in.closed_reason();
  EXPECT_TRUE(reason.code() == ErrorCode::kIo || reason.code() == ErrorCode::kTimeout)
      << reason.to_string();
}

TEST_F(RdmaErrors, PeerKilledWhileWeSendIsAnErrorNotAHang) {
  testing::Child peer({EMBER_RDMA_TEST_PEER, "server", ip_});
  auto listening = peer.wait_line("LISTENING ", 30s);
  ASSERT_TRUE(listening) << "the peer did not start listening";
  Options co = testing::suite_options(1);
  co.max_queued_bytes = 16u << 20;  // the sender waits before the pool runs dry
  auto client = Side::make(true, 1, 32, co);
  Inbox in;
  StopTransports stop_client{{client.get()}};
  auto conn = client->transport->connect(*listening, {Role::kWorker, 0}, in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  std::atomic<bool> stop{false};
  std::atomic<int> completion_errors{0};
  std::thread sender([&] {
    while (!stop.load()) {
      Status s = (*conn)->send(0, client->buffer(4u << 20), [&](const Status& st) {
        if (!st) completion_errors.fetch_add(1);
      }, 1s);
      if (!s && s.error().code() != ErrorCode::kTimeout) break;  // closed: done
    }
  });
  ASSERT_TRUE(peer.wait_line("RECEIVED", 30s));
  peer.kill();
  const bool noticed = in.wait_closed(30s);
  stop.store(true);
  sender.join();
  ASSERT_TRUE(noticed) << "the death of the peer was never noticed";
  EXPECT_NE(in.closed_reason()->code(), ErrorCode::kClosed) << in.closed_reason()->to_string();
  EXPECT_FALSE((*conn)->send(0, client->buffer(100)));
  // Every pool block handed to send() came back.
  EXPECT_EQ(client->pool->stats().bytes_in_use, 0u);
}

TEST_F(RdmaErrors, TooSmallMemlockLimitIsAStartUpErrorThatSaysHowToRaiseIt) {
  memory::PoolOptions po;
  po.prealloc_pages = 32;  // 64 MiB
  po.backing = memory::BackingRequest::kPlain;
  auto pool = memory::PagePool::create(po);
  ASSERT_TRUE(pool);
  {
    // The transport's threads (rdma_cm, I/O) are made inside the scope, so
    // they too run without CAP_IPC_LOCK, like an unprivileged service.
    testing::ScopedMemlockLimit limit(std::uint64_t{64} << 10);
    auto t = Transport::create(testing::suite_options());
    ASSERT_TRUE(t);
    auto r = register_pool(**t, **pool);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code(), ErrorCode::kConfig);
    const std::string m = r.error().message();
    EXPECT_NE(m.find("RLIMIT_MEMLOCK"), std::string::npos) << m;
    EXPECT_NE(m.find("64 KiB"), std::string::npos) << "names the limit: " << m;
    EXPECT_NE(m.find("64 MiB"), std::string::npos) << "names the amount needed: " << m;
    EXPECT_NE(m.find("LimitMEMLOCK="), std::string::npos) << m;
    EXPECT_NE(m.find("ulimit -l"), std::string::npos) << m;
    // A connection whose rings must be registered privately is refused too.
    Inbox in;
    auto c = (*t)->connect(address_, {Role::kWorker, 0}, in.handlers());
    ASSERT_FALSE(c);
    EXPECT_EQ(c.error().code(), ErrorCode::kConfig) << c.error().to_string();
  }
  // With the limit back, the same registration works.
  auto t2 = Transport::create(testing::suite_options());
  ASSERT_TRUE(t2);
  EXPECT_TRUE(register_pool(**t2, **pool));
}

TEST_F(RdmaErrors, AutoPicksRdmaOnAHostWithAnActiveDevice) {
  config::CommunicationConfig comm;
  comm.transport = config::Transport::kAuto;
  comm.num_channels = 1;
  auto o = options_from_config(comm, /*peer_on_same_host=*/false);
  ASSERT_TRUE(o) << o.error().to_string();
  EXPECT_EQ(o->kind, Kind::kRdma);
  auto local = options_from_config(comm, /*peer_on_same_host=*/true);
  ASSERT_TRUE(local);
  EXPECT_EQ(local->kind, Kind::kShm) << "a same-host (loopback) peer gets shm even with an active port";
  comm.transport = config::Transport::kRdma;
  auto r = options_from_config(comm);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->kind, Kind::kRdma);
  r->auth_token = testing::kToken;
  EXPECT_TRUE(Transport::create(*r));
}

}  // namespace
}  // namespace ember::transport::rdma
