// Failure modes: refused handshakes (token, version, garbage), peers that
// reset mid-frame, trickle bytes, fall silent or send garbage frames, slow
// receivers, and many connections at once. tcp peers are driven by hand
// (raw_peer.h) where the failure needs byte-level control.
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <thread>

#include <spdlog/sinks/ostream_sink.h>

#include "common/base/logging.h"
#include "common/transport/control.h"
#include "common/transport/shm/uds.h"
#include "common/transport/transport.h"
#include "common/wire/batch_encoder.h"
#include "common/wire/frame_decoder.h"
#include "tests/unit/transport/raw_peer.h"
#include "tests/unit/transport/transport_test_util.h"

namespace ember::transport {
namespace {

using namespace std::chrono_literals;
using testing::Inbox;
using testing::RawTcpPeer;

Options tcp_options() {
  Options o;
  o.kind = Kind::kTcp;
  o.num_channels = 1;
  o.heartbeat_interval = 100ms;
  // Long: no test with these options is about liveness (the two that are
  // set their own timeouts). A RawTcpPeer never sends a heartbeat, so with a short timeout
  // a test that is slow to reach its point (TSan on a loaded 2-core CI
  // machine) sees the server close by heartbeat_timeout first: a flush()
  // fails with kClosed, or the close reason is kTimeout instead of the
  // malformed frame the test provoked; and the healthy connections that must
  // stay up would be closed by an I/O thread stalled that long.
  o.heartbeat_timeout = 30s;
  return o;
}

std::string shm_address(const std::string& tag) {
  return "@ember-fail-" + tag + "-" + std::to_string(::getpid());
}

handshake::Hello good_hello() {
  handshake::Hello h;
  h.role = Role::kWorker;
  h.kind = Kind::kTcp;
  h.rank = 5;
  h.num_channels = 1;
  h.channel = 0;
  h.session_id = 42;
  return h;
}

struct Server {
  Inbox inbox;  // first: destroyed last, after the transport ran on_closed into it
  std::unique_ptr<Transport> transport;
  std::unique_ptr<Listener> listener;
  explicit Server(Options o, std::string address = "127.0.0.1:0") {
    auto t = Transport::create(std::move(o));
    EMBER_CHECK_MSG(t.has_value(), "{}", t.error().to_string());
    transport = std::move(*t);
    auto l = transport->listen(address, {Role::kServer, 0}, inbox.acceptor(), inbox.handlers());
    EMBER_CHECK_MSG(l.has_value(), "{}", l.error().to_string());
    listener = std::move(*l);
  }
};

bool wait_refused(Listener& l, std::uint64_t n) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  // The refusal is counted on the listener's thread right after the reply
  // was written; the client saw the reply, so this is a short wait.
  while (l.num_refused() < n) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

class TokenTest : public ::testing::TestWithParam<Kind> {};

TEST_P(TokenTest, WrongTokenIsRefusedWithAClearErrorOnBothSides) {
  Inbox in;  // before the transports: on_closed may run into it until they are gone
  Options so = tcp_options();
  so.kind = GetParam();
  so.auth_token = "s3cret";
  const std::string addr = GetParam() == Kind::kShm ? shm_address("token") : "127.0.0.1:0";
  Server server(so, addr);
  Options co = so;
  co.auth_token = "wrong";
  auto client = Transport::create(co);
  ASSERT_TRUE(client);
  auto conn = (*client)->connect(server.listener->address(), {Role::kWorker, 1}, in.handlers());
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.error().code(), ErrorCode::kAuth) << conn.error().to_string();
  EXPECT_NE(conn.error().message().find("wrong auth token"), std::string::npos) << conn.error().message();
  EXPECT_TRUE(wait_refused(*server.listener, 1));

  // No token at all.
  co.auth_token = "";
  auto client2 = Transport::create(co);
  ASSERT_TRUE(client2);
  auto conn2 = (*client2)->connect(server.listener->address(), {Role::kWorker, 1}, in.handlers());
  ASSERT_FALSE(conn2);
  EXPECT_EQ(conn2.error().code(), ErrorCode::kAuth);
  EXPECT_NE(conn2.error().message().find("sent no auth token"), std::string::npos);

  // The right token works.
  co.auth_token = "s3cret";
  auto client3 = Transport::create(co);
  ASSERT_TRUE(client3);
  auto conn3 = (*client3)->connect(server.listener->address(), {Role::kWorker, 1}, in.handlers());
  ASSERT_TRUE(conn3) << conn3.error().to_string();
  EXPECT_TRUE(server.inbox.wait_accepted(1));
  EXPECT_EQ(server.inbox.accepted.size(), 1u);
}

TEST_P(TokenTest, ChannelCountMismatchIsRefused) {
  Inbox in;  // before the transports: on_closed may run into it until they are gone
  Options so = tcp_options();
  so.kind = GetParam();
  so.num_channels = 2;
  const std::string addr = GetParam() == Kind::kShm ? shm_address("chan") : "127.0.0.1:0";
  Server server(so, addr);
  Options co = so;
  co.num_channels = 3;
  auto client = Transport::create(co);
  ASSERT_TRUE(client);
  auto conn = (*client)->connect(server.listener->address(), {Role::kWorker, 1}, in.handlers());
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.error().code(), ErrorCode::kProtocol);
  EXPECT_NE(conn.error().message().find("asks for 3 channels but this listener uses 2"),
            std::string::npos)
      << conn.error().message();
}

INSTANTIATE_TEST_SUITE_P(All, TokenTest, ::testing::Values(Kind::kTcp, Kind::kShm),
                         [](const auto& p) { return std::string(kind_name(p.param)); });

// Peers that connect and send no hello are bounded: past 256 handshakes in
// progress the oldest is dropped, so idle connections cannot hold every
// descriptor until connect_timeout and lock workers out; and a storm of
// refusals is logged as 20 lines and a count, not a line each (helper-82).
TEST(TcpListen, IdleHandshakesAreBoundedAndRefusalsAreNotLoggedOneByOne) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto tcp_logger = log::logger("tcp");
  tcp_logger->sinks().push_back(sink);
  struct Unsink {
    std::shared_ptr<spdlog::logger> l;
    std::shared_ptr<spdlog::sinks::sink> s;
    ~Unsink() { std::erase(l->sinks(), s); }
  } unsink{tcp_logger, sink};
  Inbox in;  // before the transports: on_closed may run into it until they are gone
  Options o = tcp_options();
  o.connect_timeout = 60s;  // no idle peer is refused for its timeout within the test
  Server server(o);
  constexpr int kIdle = 300;
  std::vector<std::unique_ptr<RawTcpPeer>> idle;
  for (int i = 0; i < kIdle; ++i) {
    idle.push_back(std::make_unique<RawTcpPeer>());
    ASSERT_TRUE(idle.back()->connect(server.listener->address()));
  }
  // The oldest 44 were dropped to make room.
  EXPECT_TRUE(wait_refused(*server.listener, kIdle - 256));
  EXPECT_TRUE(idle.front()->wait_eof());
  // A worker still gets in.
  auto client = Transport::create(tcp_options());
  ASSERT_TRUE(client);
  auto conn = (*client)->connect(server.listener->address(), {Role::kWorker, 1}, in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  EXPECT_TRUE(server.inbox.wait_accepted(1));
  const std::string text = out.str();
  std::size_t lines = 0;
  for (std::size_t at = text.find(": refused "); at != std::string::npos;
       at = text.find(": refused ", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 20u) << text;
  EXPECT_NE(text.find("dropped to make room for a new connection: 256 handshakes were in progress"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("20 refused connections within 10000 ms; the others until then are counted, "
                      "not logged"),
            std::string::npos)
      << text;
}

// The shm listener bounds its handshakes alike (only same-user peers get in,
// but a stuck one should not lock the others out either).
TEST(ShmListen, IdleHandshakesAreBounded) {
  Options o = tcp_options();
  o.kind = Kind::kShm;
  o.connect_timeout = 60s;  // no idle peer is refused for its timeout within the test
  Server server(o, shm_address("idle"));
  auto addr = shm::make_address(server.listener->address());
  ASSERT_TRUE(addr) << addr.error().to_string();
  std::vector<int> idle;
  struct Closer {
    std::vector<int>& fds;
    ~Closer() {
      for (int fd : fds) ::close(fd);
    }
  } closer{idle};
  for (int i = 0; i < 300; ++i) {
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
    ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&addr->first), addr->second), 0)
        << "connection " << i << ": " << std::strerror(errno);
  }
  EXPECT_TRUE(wait_refused(*server.listener, 300 - 256));
  // The oldest was closed by the listener.
  pollfd p{idle.front(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 10000), 1);
  char byte;
  EXPECT_LE(::recv(idle.front(), &byte, 1, 0), 0);
  Inbox in;
  auto client = Transport::create(o);
  ASSERT_TRUE(client);
  auto conn = (*client)->connect(server.listener->address(), {Role::kWorker, 1}, in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  EXPECT_TRUE(server.inbox.wait_accepted(1));
}

TEST(TcpListen, NonLoopbackAddressNeedsAToken) {
  Inbox in;  // before the transports: on_closed may run into it until they are gone
  auto t = Transport::create(tcp_options());
  ASSERT_TRUE(t);
  auto l = (*t)->listen("0.0.0.0:0", {Role::kServer, 0}, in.acceptor(), in.handlers());
  ASSERT_FALSE(l);
  EXPECT_EQ(l.error().code(), ErrorCode::kConfig);
  EXPECT_NE(l.error().message().find("auth_token"), std::string::npos);
  EXPECT_FALSE((*t)->listen("not-an-address", {Role::kServer, 0}, in.acceptor(), in.handlers()));
}

TEST(TcpHandshake, VersionMismatchNamesBothVersions) {
  Server server(tcp_options());
  RawTcpPeer peer;
  ASSERT_TRUE(peer.connect(server.listener->address()));
  handshake::Hello h = good_hello();
  h.version = 99;
  auto reply = peer.handshake(h);
  ASSERT_TRUE(reply) << reply.error().to_string();
  EXPECT_EQ(reply->status, ErrorCode::kVersionMismatch);
  EXPECT_NE(reply->text.find("speaks version " + std::to_string(kProtocolVersion)), std::string::npos) << reply->text;
  EXPECT_NE(reply->text.find("speaks version 99"), std::string::npos) << reply->text;
  EXPECT_TRUE(peer.wait_eof());
  EXPECT_TRUE(wait_refused(*server.listener, 1));
}

TEST(TcpHandshake, ClientReportsAServerOfAnotherVersion) {
  Inbox in;  // before the transports: on_closed may run into it until they are gone
  // A fake listener that accepts with version 7.
  auto fake = Transport::create(tcp_options());  // only for its address helpers: a plain socket below
  ASSERT_TRUE(fake);
  const int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::listen(lfd, 1), 0);
  socklen_t len = sizeof sa;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
  std::thread server([&] {
    const int fd = ::accept(lfd, nullptr, nullptr);
    auto deadline = std::chrono::steady_clock::now() + 10s;
    auto hello = stream_io::read_message(
        fd, [](std::span<const std::byte> p) { return handshake::hello_bytes_missing(p); }, deadline,
        "fake");
    handshake::Reply r;
    r.version = 7;
    r.num_channels = 1;
    (void)stream_io::write_all(fd, handshake::encode(r), deadline, "fake");
    ::close(fd);
  });
  auto conn = (*fake)->connect("127.0.0.1:" + std::to_string(ntohs(sa.sin_port)), {Role::kWorker, 0},
                               in.handlers());
  server.join();
  ::close(lfd);
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.error().code(), ErrorCode::kVersionMismatch);
  EXPECT_NE(conn.error().message().find("this side speaks version " + std::to_string(kProtocolVersion)), std::string::npos);
  EXPECT_NE(conn.error().message().find("speaks version 7"), std::string::npos);
}

// A healthy connection that must keep working while other peers misbehave.
struct HealthyPair {
  Inbox in;  // first: destroyed last
  std::unique_ptr<Transport> client;
  std::shared_ptr<Connection> conn;
  explicit HealthyPair(const std::string& address, Options o = tcp_options()) {
    auto t = Transport::create(std::move(o));
    EMBER_CHECK(t.has_value());
    client = std::move(*t);
    auto c = client->connect(address, {Role::kWorker, 9}, in.handlers());
    EMBER_CHECK_MSG(c.has_value(), "{}", c.error().to_string());
    conn = *c;
  }
};

TEST(TcpFailure, GarbageSendingPeersAreRejectedAndOthersUnaffected) {
  Server server(tcp_options());
  server.inbox.check_pattern_bytes = false;
  HealthyPair good(server.listener->address());
  ASSERT_TRUE(server.inbox.wait_accepted(1));
  const std::array<std::byte, 4> ping{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  ASSERT_TRUE(good.conn->send(0, ping));
  ASSERT_TRUE(good.conn->flush(0));
  ASSERT_TRUE(server.inbox.wait_count(0, 1));

  // 1. Garbage instead of a hello: refused before a Connection exists.
  RawTcpPeer junk;
  ASSERT_TRUE(junk.connect(server.listener->address()));
  std::vector<std::byte> garbage(200);
  for (std::size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<std::byte>(i * 37 + 11);
  ASSERT_TRUE(junk.send(garbage));
  EXPECT_TRUE(junk.wait_eof());
  EXPECT_TRUE(wait_refused(*server.listener, 1));

  // 2. A valid hello, then garbage frames: that Connection closes with
  //    kMalformedFrame; the listener and the good connection carry on.
  RawTcpPeer bad;
  ASSERT_TRUE(bad.connect(server.listener->address()));
  auto reply = bad.handshake(good_hello());
  ASSERT_TRUE(reply);
  ASSERT_EQ(reply->status, ErrorCode::kOk);
  ASSERT_TRUE(server.inbox.wait_accepted(2));
  ASSERT_TRUE(bad.send(garbage));
  EXPECT_TRUE(bad.wait_eof());
  ASSERT_TRUE(server.inbox.wait_closed());
  EXPECT_EQ(server.inbox.closed_reason()->code(), ErrorCode::kMalformedFrame)
      << server.inbox.closed_reason()->to_string();
  EXPECT_NE(server.inbox.closed_reason()->message().find("bad frame from"), std::string::npos);

  ASSERT_TRUE(good.conn->send(0, ping));
  ASSERT_TRUE(good.conn->flush(0));
  EXPECT_TRUE(server.inbox.wait_count(0, 2));
  EXPECT_FALSE(good.conn->is_closed());
}

// Frames as a peer writes them: one batch of `count` small items, then one
// large single frame of `large` bytes.
std::vector<std::byte> valid_stream(std::size_t count, std::size_t large) {
  std::vector<std::byte> out;
  auto enc = wire::BatchEncoder::create({.batch_threshold_bytes = 4096});
  std::vector<std::byte> buf(4096);
  enc->begin(buf);
  for (std::size_t i = 0; i < count; ++i) {
    std::vector<std::byte> m(10 + i);
    testing::fill_pattern(m, 0, i);
    EMBER_CHECK(enc->try_add(m));
  }
  auto frame = enc->finish();
  out.insert(out.end(), frame.begin(), frame.end());
  std::vector<std::byte> payload(large);
  testing::fill_pattern(payload, 0, count);
  std::array<std::byte, wire::kSinglePrefixBytes> prefix;
  auto single = wire::encode_single(prefix, payload);
  EMBER_CHECK(single.has_value());
  out.insert(out.end(), single->prefix.begin(), single->prefix.end());
  out.insert(out.end(), payload.begin(), payload.end());
  out.insert(out.end(), single->padding.begin(), single->padding.end());
  return out;
}

// Options::payload_checksum: a large message's frame leaves its payload out
// of the CRC (frame flag 0x0001) by default and covers it when true; the raw
// peer reads the frames as they cross the socket and checks both forms.
TEST(TcpWire, LargeFramesCoverTheirPayloadOnlyWithPayloadChecksum) {
  for (const bool payload_checksum : {false, true}) {
    SCOPED_TRACE(payload_checksum ? "payload_checksum = true" : "payload_checksum = false");
    Options o = tcp_options();
    o.payload_checksum = payload_checksum;
    Server server(o);
    RawTcpPeer peer;
    ASSERT_TRUE(peer.connect(server.listener->address()));
    ASSERT_TRUE(peer.handshake(good_hello()));
    ASSERT_TRUE(server.inbox.wait_accepted(1));
    std::vector<std::byte> payload(100000);
    testing::fill_pattern(payload, 0, 7);
    auto conn = server.inbox.accepted_at(0);
    ASSERT_TRUE(conn->send(0, payload));
    ASSERT_TRUE(conn->flush(0));
    // Heartbeats (batch frames) may come first; read up to the single frame.
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    for (;;) {
      std::vector<std::byte> frame(wire::kHeaderBytes);
      ASSERT_TRUE(stream_io::read_exact(peer.fd(), frame, deadline, "frame header"));
      const wire::FrameHeaderWire h = wire::load_header(frame.data());
      ASSERT_GE(h.frame_bytes, wire::kHeaderBytes);
      frame.resize(h.frame_bytes);
      ASSERT_TRUE(stream_io::read_exact(
          peer.fd(), std::span<std::byte>(frame).subspan(wire::kHeaderBytes), deadline, "frame"));
      if (h.kind != static_cast<std::uint8_t>(wire::FrameKind::kSingle)) {
        EXPECT_EQ(h.flags, 0) << "batch frames are always covered whole";
        continue;
      }
      EXPECT_EQ(h.flags, payload_checksum ? 0 : wire::kFrameFlagPrefixChecksum);
      auto decoded = wire::decode_frame(frame);
      ASSERT_TRUE(decoded) << decoded.error().to_string();
      const auto item = decoded->item(0);
      EXPECT_TRUE(std::equal(item.payload.begin(), item.payload.end(), payload.begin(), payload.end()));
      // A flipped payload byte fails the check only when the payload is covered.
      frame[wire::kSinglePrefixBytes + 5000] ^= std::byte{0x40};
      EXPECT_EQ(wire::decode_frame(frame).has_value(), !payload_checksum);
      break;
    }
  }
}

TEST(TcpFailure, ShortReadsOneByteAtATimeStillDeliverEveryMessage) {
  Server server(tcp_options());
  RawTcpPeer peer;
  ASSERT_TRUE(peer.connect(server.listener->address()));
  ASSERT_TRUE(peer.handshake(good_hello()));
  ASSERT_TRUE(server.inbox.wait_accepted(1));
  const auto stream = valid_stream(5, 10000);
  for (std::byte b : stream) ASSERT_TRUE(peer.send(std::span<const std::byte>(&b, 1)));
  ASSERT_TRUE(server.inbox.wait_count(0, 6));
  std::lock_guard lock(server.inbox.mu);
  EXPECT_EQ(server.inbox.sizes[0], (std::vector<std::size_t>{10, 11, 12, 13, 14, 10000}));
  for (bool ok : server.inbox.intact[0]) EXPECT_TRUE(ok);
  EXPECT_TRUE(server.inbox.large[0][5]);
}

TEST(TcpFailure, PeerResetMidFrameClosesThatConnectionWithAnError) {
  Server server(tcp_options());
  HealthyPair good(server.listener->address());
  ASSERT_TRUE(server.inbox.wait_accepted(1));
  RawTcpPeer peer;
  ASSERT_TRUE(peer.connect(server.listener->address()));
  ASSERT_TRUE(peer.handshake(good_hello()));
  ASSERT_TRUE(server.inbox.wait_accepted(2));
  const auto stream = valid_stream(3, 1 << 20);
  // Half of the large frame, then a reset.
  ASSERT_TRUE(peer.send(std::span<const std::byte>(stream).first(stream.size() / 2)));
  peer.reset();
  ASSERT_TRUE(server.inbox.wait_closed());
  const Error e = *server.inbox.closed_reason();
  EXPECT_TRUE(e.code() == ErrorCode::kIo || e.code() == ErrorCode::kMalformedFrame) << e.to_string();
  EXPECT_FALSE(good.conn->is_closed());
}

TEST(TcpFailure, EndOfStreamMidFrameIsReportedAsTruncated) {
  Server server(tcp_options());
  RawTcpPeer peer;
  ASSERT_TRUE(peer.connect(server.listener->address()));
  ASSERT_TRUE(peer.handshake(good_hello()));
  ASSERT_TRUE(server.inbox.wait_accepted(1));
  const auto stream = valid_stream(3, 100000);
  ASSERT_TRUE(peer.send(std::span<const std::byte>(stream).first(stream.size() - 100)));
  ::shutdown(peer.fd(), SHUT_WR);
  ASSERT_TRUE(server.inbox.wait_closed());
  EXPECT_EQ(server.inbox.closed_reason()->code(), ErrorCode::kMalformedFrame);
  EXPECT_NE(server.inbox.closed_reason()->message().find("mid-frame"), std::string::npos)
      << server.inbox.closed_reason()->to_string();
  EXPECT_EQ(server.inbox.count(0), 3u);  // the complete batch before the cut was delivered
}

TEST(TcpFailure, SilentPeerIsDeclaredDeadAfterTheHeartbeatTimeout) {
  Options o = tcp_options();
  o.heartbeat_interval = 50ms;
  o.heartbeat_timeout = 300ms;
  Server server(o);
  RawTcpPeer peer;  // handshakes, then never sends a heartbeat
  ASSERT_TRUE(peer.connect(server.listener->address()));
  ASSERT_TRUE(peer.handshake(good_hello()));
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(server.inbox.wait_closed(30s));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(server.inbox.closed_reason()->code(), ErrorCode::kTimeout);
  EXPECT_NE(server.inbox.closed_reason()->message().find("heartbeat_timeout"), std::string::npos);
  // The server logs this as "worker <r> (<addr>) lost: <reason>": the line
  // ends with where the operator reads on.
  EXPECT_TRUE(server.inbox.closed_reason()->to_string().ends_with(
      "the peer is dead or stalled; see docs/troubleshooting.md#worker-loss"))
      << server.inbox.closed_reason()->to_string();
  // Not before the timeout (less the few ms between the server's start of
  // the clock and ours), and well before anything else would close it (a
  // loaded TSan run can be seconds late; nothing else closes it at all).
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 20s);
}

TEST(TcpHeartbeat, IdleButHealthyConnectionsStayUp) {
  Options o = tcp_options();
  // 25 heartbeats per timeout: a heartbeat may be late by up to 4.8 s before
  // the connection is (wrongly, for this test) closed. With 20 ms / 200 ms a
  // test process or I/O thread descheduled for 0.2 s (TSan on a loaded
  // 2-core CI machine) loses the connection although heartbeats work.
  o.heartbeat_interval = 200ms;
  o.heartbeat_timeout = 5s;
  Server server(o);
  HealthyPair good(server.listener->address(), o);
  ASSERT_TRUE(server.inbox.wait_accepted(1));
  // Two and a half heartbeat timeouts pass: the connection must not be
  // closed in that time (the condition waited for must not happen).
  auto server_conn = server.inbox.accepted_at(0);
  EXPECT_FALSE(server.inbox.wait_closed(12s));
  EXPECT_FALSE(good.in.wait_closed(1ms));
  EXPECT_GE(server_conn->stats().heartbeats_received, 10u);
  EXPECT_GE(good.conn->stats().heartbeats_received, 10u);
  EXPECT_FALSE(server.inbox.closed_reason().has_value());
  EXPECT_FALSE(good.conn->is_closed());
}

class SlowReceiverTest : public ::testing::TestWithParam<Kind> {};

TEST_P(SlowReceiverTest, SenderWaitsThenFailsAndMemoryStaysBounded) {
  Inbox in;  // before the transports: on_closed may run into it until they are gone
  Options o = tcp_options();
  o.kind = GetParam();
  o.heartbeat_timeout = 20s;  // the receiver is stalled on purpose
  o.heartbeat_interval = 1s;
  o.max_queued_bytes = 4u << 20;
  o.ring_slots = 64;
  const std::string addr = GetParam() == Kind::kShm ? shm_address("slow") : "127.0.0.1:0";
  Server server(o, addr);
  server.inbox.check_pattern_bytes = false;
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool open = false;
  server.inbox.also = [&](Connection&, Incoming&) {
    std::unique_lock lock(gate_mu);
    gate_cv.wait(lock, [&] { return open; });  // the receiver is stuck until the test opens it
  };
  auto ct = Transport::create(o);
  ASSERT_TRUE(ct);
  testing::MemfdRegion mem(std::size_t{64} << 20);
  auto rid = (*ct)->register_memory(mem.region());
  ASSERT_TRUE(rid);
  mem.set_region_id(*rid);
  auto conn = (*ct)->connect(server.listener->address(), {Role::kWorker, 0}, in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  constexpr std::size_t kMsg = 256 << 10;
  std::size_t accepted = 0;
  Status last = ok_status();
  for (int i = 0; i < 2000; ++i) {  // 500 MiB offered; far more than any buffer
    Buffer b = mem.make(kMsg);
    last = (*conn)->send(0, std::move(b), {}, 50ms);
    if (!last) break;
    ++accepted;
  }
  ASSERT_FALSE(last);
  EXPECT_EQ(last.error().code(), ErrorCode::kTimeout) << last.error().to_string();
  EXPECT_NE(last.error().message().find("max_queued_bytes"), std::string::npos) << last.error().message();
  const ConnectionStats s = (*conn)->stats();
  EXPECT_LE(s.queued_bytes_high_water, o.max_queued_bytes + kMsg);
  EXPECT_LT(accepted, 2000u);
  {
    std::lock_guard lock(gate_mu);
    open = true;
  }
  gate_cv.notify_all();
  ASSERT_TRUE(server.inbox.wait_count(0, accepted));
  EXPECT_TRUE(mem.wait_all_released());
}

TEST_P(SlowReceiverTest, SmallMessagesAlsoStopAtTheBound) {
  Inbox in;  // before the transports: on_closed may run into it until they are gone
  Options o = tcp_options();
  o.kind = GetParam();
  o.heartbeat_timeout = 20s;
  o.heartbeat_interval = 1s;
  o.max_queued_bytes = 1u << 20;
  o.ring_slots = 16;
  const std::string addr = GetParam() == Kind::kShm ? shm_address("slow-small") : "127.0.0.1:0";
  Server server(o, addr);
  server.inbox.check_pattern_bytes = false;
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool open = false;
  server.inbox.also = [&](Connection&, Incoming&) {
    std::unique_lock lock(gate_mu);
    gate_cv.wait(lock, [&] { return open; });
  };
  auto ct = Transport::create(o);
  ASSERT_TRUE(ct);
  auto conn = (*ct)->connect(server.listener->address(), {Role::kWorker, 0}, in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  std::array<std::byte, 1000> msg{};
  std::size_t accepted = 0;
  Status last = ok_status();
  for (int i = 0; i < 200000; ++i) {  // 200 MB offered
    last = (*conn)->send(0, msg, 20ms);
    if (!last) break;
    ++accepted;
  }
  ASSERT_FALSE(last);
  EXPECT_EQ(last.error().code(), ErrorCode::kTimeout) << last.error().to_string();
  EXPECT_LE((*conn)->stats().queued_bytes_high_water, o.max_queued_bytes + msg.size());
  {
    std::lock_guard lock(gate_mu);
    open = true;
  }
  gate_cv.notify_all();
  ASSERT_TRUE((*conn)->flush(0));
  EXPECT_TRUE(server.inbox.wait_count(0, accepted));
}

INSTANTIATE_TEST_SUITE_P(All, SlowReceiverTest, ::testing::Values(Kind::kTcp, Kind::kShm),
                         [](const auto& p) { return std::string(kind_name(p.param)); });

class ManyConnectionsTest : public ::testing::TestWithParam<Kind> {};

TEST_P(ManyConnectionsTest, SixtyFourConnectionsAtOnceEachGetTheirEcho) {
  std::vector<std::unique_ptr<Inbox>> inboxes;  // before the transports: on_closed may run into it until they are gone
  Options o = tcp_options();
  o.kind = GetParam();
  o.num_channels = 2;
  o.ring_slots = 16;
  o.num_io_threads = 2;
  // Long: this test is about many handshakes at once, not liveness. Under TSan
  // on a loaded 2-core machine (CI, 2026-12-01; here with 3 busy loops beside
  // it, 15 of 15 runs), the 64 shm set-ups took the test's I/O threads long
  // enough that a connection saw no heartbeat for 2 s and was closed by
  // heartbeat_timeout before its echo was sent.
  o.heartbeat_interval = 1s;
  o.heartbeat_timeout = 30s;
  // Likewise a connect that waits behind 63 others' handshakes (default 10 s).
  o.connect_timeout = 60s;
  const std::string addr = GetParam() == Kind::kShm ? shm_address("many") : "127.0.0.1:0";
  Server server(o, addr);
  server.inbox.check_pattern_bytes = false;
  server.inbox.also = [](Connection& c, Incoming& m) {
    // Echo on the same channel.
    (void)c.send(m.channel, m.bytes);
    (void)c.flush(m.channel);
  };
  auto ct = Transport::create(o);
  ASSERT_TRUE(ct);
  constexpr int kConns = 64;
  std::vector<std::shared_ptr<Connection>> conns(kConns);
  for (int i = 0; i < kConns; ++i) inboxes.push_back(std::make_unique<Inbox>());
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < kConns; i += 8) {
        inboxes[i]->check_pattern_bytes = false;
        auto c = (*ct)->connect(server.listener->address(), {Role::kWorker, static_cast<std::uint32_t>(i)},
                                inboxes[i]->handlers());
        if (!c) {
          ++failures;
          continue;
        }
        conns[i] = *c;
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(failures.load(), 0);
  ASSERT_TRUE(server.inbox.wait_accepted(kConns));
  for (int i = 0; i < kConns; ++i) {
    const std::uint32_t id = static_cast<std::uint32_t>(i);
    const auto* p = reinterpret_cast<const std::byte*>(&id);
    const Status sent = conns[i]->send(id % 2, std::span<const std::byte>(p, 4));
    ASSERT_TRUE(sent) << "connection " << i << ": " << sent.error().to_string() << "; closed by "
                      << (inboxes[i]->closed ? inboxes[i]->closed->to_string() : std::string("nothing yet"));
    const Status flushed = conns[i]->flush(id % 2);
    ASSERT_TRUE(flushed) << "connection " << i << ": " << flushed.error().to_string();
  }
  for (int i = 0; i < kConns; ++i) {
    ASSERT_TRUE(inboxes[i]->wait_count(static_cast<std::uint32_t>(i % 2), 1)) << "connection " << i;
  }
  for (auto& c : conns) c->close();
  for (auto& in : inboxes) EXPECT_TRUE(in->wait_closed());
}

INSTANTIATE_TEST_SUITE_P(All, ManyConnectionsTest, ::testing::Values(Kind::kTcp, Kind::kShm),
                         [](const auto& p) { return std::string(kind_name(p.param)); });

}  // namespace
}  // namespace ember::transport
