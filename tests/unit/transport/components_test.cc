// Unit tests of the transport's pure parts: the handshake codec, option
// validation, Buffer ownership, flow control, the pool adapter and the
// mapping from the [communication] config table.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <boost/asio/io_context.hpp>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "common/config/config.h"
#include "common/memory/page_pool.h"
#include "common/transport/accept_pacer.h"
#include "common/transport/refusal_log.h"
#include "common/transport/control.h"
#include "common/transport/flow_control.h"
#include "common/transport/handshake.h"
#include "common/transport/options_from_config.h"
#include "common/transport/pool_buffer.h"
#include "common/transport/transport.h"
#include "tests/unit/transport/transport_test_util.h"

namespace ember::transport {
namespace {

using namespace std::chrono_literals;

TEST(Handshake, HelloAndReplyRoundTrip) {
  handshake::Hello h;
  h.role = Role::kWorker;
  h.kind = Kind::kShm;
  h.rank = 17;
  h.num_channels = 4;
  h.channel = 3;
  h.session_id = 0x1122334455667788ull;
  h.max_message_bytes = 1 << 20;
  h.token = "tok";
  auto bytes = handshake::encode(h);
  ASSERT_EQ(bytes.size(), handshake::kHelloFixedBytes + 3);
  EXPECT_EQ(*handshake::hello_bytes_missing(std::span(bytes).first(5)), handshake::kHelloFixedBytes - 5);
  EXPECT_EQ(*handshake::hello_bytes_missing(std::span(bytes).first(10)), bytes.size() - 10);
  EXPECT_EQ(*handshake::hello_bytes_missing(bytes), 0u);
  auto d = handshake::decode_hello(bytes);
  ASSERT_TRUE(d) << d.error().to_string();
  EXPECT_EQ(d->rank, 17u);
  EXPECT_EQ(d->kind, Kind::kShm);
  EXPECT_EQ(d->channel, 3u);
  EXPECT_EQ(d->session_id, h.session_id);
  EXPECT_EQ(d->token, "tok");

  handshake::Reply r;
  r.status = ErrorCode::kAuth;
  r.rank = 2;
  r.num_channels = 4;
  r.text = "no";
  auto rb = handshake::encode(r);
  auto rd = handshake::decode_reply(rb);
  ASSERT_TRUE(rd);
  EXPECT_EQ(rd->status, ErrorCode::kAuth);
  EXPECT_EQ(rd->text, "no");
}

TEST(Handshake, MalformedHellosAreProtocolErrors) {
  handshake::Hello h;
  auto bytes = handshake::encode(h);
  auto bad = bytes;
  bad[0] = std::byte{'X'};
  EXPECT_EQ(handshake::hello_bytes_missing(bad).error().code(), ErrorCode::kProtocol);
  EXPECT_NE(handshake::hello_bytes_missing(bad).error().message().find("not an Ember"), std::string::npos);
  bad = bytes;
  bad[8] = std::byte{9};  // role
  EXPECT_EQ(handshake::decode_hello(bad).error().code(), ErrorCode::kProtocol);
  bad = bytes;
  bad[9] = std::byte{0};  // kind
  EXPECT_EQ(handshake::decode_hello(bad).error().code(), ErrorCode::kProtocol);
  bad = bytes;
  bad[20] = std::byte{5};  // channel 5 of 1
  EXPECT_EQ(handshake::decode_hello(bad).error().code(), ErrorCode::kProtocol);
  bad = bytes;
  bad[6] = std::byte{0xFF};  // token length 0x..FF
  bad[7] = std::byte{0xFF};
  EXPECT_EQ(handshake::hello_bytes_missing(bad).error().code(), ErrorCode::kProtocol);
  bad = bytes;
  bad.push_back(std::byte{0});  // trailing byte
  EXPECT_FALSE(handshake::decode_hello(bad));
}

TEST(Handshake, MalformedRepliesAreProtocolErrors) {
  handshake::Reply r;
  r.text = "ok";
  const auto bytes = handshake::encode(r);
  ASSERT_TRUE(handshake::decode_reply(bytes));
  struct Case {
    std::size_t at;
    std::byte value;
    const char* what;
  };
  for (const Case c : {Case{8, std::byte{0xFF}, "unknown status"}, Case{10, std::byte{7}, "unknown role"},
                       Case{11, std::byte{1}, "reserved reply bytes"},
                       Case{22, std::byte{1}, "reserved reply bytes"}}) {
    auto bad = bytes;
    bad[c.at] = c.value;
    const auto d = handshake::decode_reply(bad);
    ASSERT_FALSE(d) << c.what;
    EXPECT_EQ(d.error().code(), ErrorCode::kProtocol) << c.what;
    EXPECT_NE(d.error().message().find(c.what), std::string::npos) << d.error().message();
  }
  // A listener of another version may use codes this one does not know: its
  // reply decodes, so the caller names the version mismatch.
  auto newer = bytes;
  newer[4] = std::byte{static_cast<unsigned char>(kProtocolVersion + 1)};
  newer[8] = std::byte{0xFF};
  newer[11] = std::byte{1};
  const auto d = handshake::decode_reply(newer);
  ASSERT_TRUE(d) << d.error().to_string();
  EXPECT_EQ(d->version, kProtocolVersion + 1);
}

TEST(Handshake, CheckHelloNamesTheProblem) {
  handshake::Expectations e;
  e.kind = Kind::kTcp;
  e.num_channels = 2;
  e.auth_token = "secret";
  handshake::Hello h;
  h.num_channels = 2;
  h.token = "secret";
  EXPECT_TRUE(handshake::check_hello(h, e));
  h.version = 3;
  auto s = handshake::check_hello(h, e);
  EXPECT_EQ(s.error().code(), ErrorCode::kVersionMismatch);
  EXPECT_NE(s.error().message().find("speaks version " + std::to_string(kProtocolVersion)), std::string::npos);
  EXPECT_NE(s.error().message().find("speaks version 3"), std::string::npos);
  h.version = kProtocolVersion;
  h.token = "secreT";
  EXPECT_EQ(handshake::check_hello(h, e).error().code(), ErrorCode::kAuth);
  h.token = "secret";
  h.kind = Kind::kShm;
  EXPECT_EQ(handshake::check_hello(h, e).error().code(), ErrorCode::kProtocol);
  h.kind = Kind::kTcp;
  h.num_channels = 1;
  h.channel = 0;
  EXPECT_EQ(handshake::check_hello(h, e).error().code(), ErrorCode::kProtocol);
  EXPECT_TRUE(handshake::tokens_equal("abc", "abc"));
  EXPECT_FALSE(handshake::tokens_equal("abc", "abd"));
  EXPECT_FALSE(handshake::tokens_equal("abc", "abcd"));
}

TEST(Control, PayloadRoundTripAndRejectsJunk) {
  auto p = control_payload(ControlType::kGoodbye);
  EXPECT_EQ(parse_control(p), ControlType::kGoodbye);
  p[3] = std::byte{1};
  EXPECT_FALSE(parse_control(p));
  EXPECT_FALSE(parse_control(std::span<const std::byte>(p).first(4)));
}

TEST(Options, ValidateNamesTheFieldAndTheFix) {
  EXPECT_TRUE(Options{}.validate());
  auto expect_bad = [](Options o, const char* word) {
    auto s = o.validate();
    ASSERT_FALSE(s) << word;
    EXPECT_EQ(s.error().code(), ErrorCode::kConfig);
    EXPECT_NE(s.error().message().find(word), std::string::npos) << s.error().message();
  };
  Options o;
  o.batch_threshold_bytes = 100;
  expect_bad(o, "batch_threshold");
  o = Options{};
  o.num_channels = 0;
  expect_bad(o, "channels");
  o = Options{};
  o.num_io_threads = 0;
  expect_bad(o, "io_threads");
  o = Options{};
  o.heartbeat_timeout = o.heartbeat_interval;
  expect_bad(o, "heartbeat_timeout");
  o = Options{};
  o.max_queued_bytes = 10;
  expect_bad(o, "max_queued_bytes");
  o = Options{};
  o.kind = Kind::kShm;
  o.ring_slots = 1000;
  expect_bad(o, "ring_buffer_size");
  o = Options{};
  o.max_message_bytes = 0;
  expect_bad(o, "max_message_size");
  o = Options{};
  o.kind = Kind::kRdma;
  auto t = Transport::create(o);
  ASSERT_FALSE(t);
  EXPECT_EQ(t.error().code(), ErrorCode::kUnavailable);
}

TEST(Buffer, AdoptReleasesExactlyOnceAfterMoves) {
  int released = 0;
  struct Owner {
    int* count;
    explicit Owner(int* c) : count(c) {}
    Owner(Owner&& o) noexcept : count(o.count) { o.count = nullptr; }
    ~Owner() {
      if (count) ++*count;
    }
  };
  std::array<std::byte, 16> mem{};
  {
    Buffer a = Buffer::adopt(mem, MemoryLocation{7, 4096, 1}, Owner(&released));
    EXPECT_EQ(a.size(), 16u);
    EXPECT_EQ(a.location().fd, 7);
    Buffer b = std::move(a);
    EXPECT_TRUE(a.empty());
    Buffer c;
    c = std::move(b);
    b = Buffer::heap(100);  // b owns something else now
    EXPECT_EQ(released, 0);
    c.truncate(4);
    EXPECT_EQ(c.size(), 4u);
  }
  EXPECT_EQ(released, 1);
  // A large owner goes to the heap and is still released once.
  struct Big {
    int* count;
    char pad[200] = {};
    explicit Big(int* c) : count(c) {}
    Big(Big&& o) noexcept : count(o.count) { o.count = nullptr; }
    ~Big() {
      if (count) ++*count;
    }
  };
  {
    Buffer big = Buffer::adopt(mem, {}, Big(&released));
    Buffer moved = std::move(big);
    moved.reset();
    EXPECT_EQ(released, 2);
  }
  EXPECT_EQ(released, 2);
  Buffer h = Buffer::heap(5000);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(h.data()) % 4096, 0u);
  EXPECT_EQ(h.data()[4999], std::byte{0});
}

TEST(FlowControl, BoundsWaitsAndWakes) {
  FlowControl f(100);
  EXPECT_TRUE(f.acquire(60, 0ms, false));
  EXPECT_TRUE(f.acquire(40, 0ms, false));
  auto s = f.acquire(1, 0ms, false);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kTimeout);
  EXPECT_NE(s.error().message().find("max_queued_bytes"), std::string::npos);
  EXPECT_FALSE(f.acquire(1, 20ms, true));  // times out
  std::thread releaser([&] { f.release(60); });
  EXPECT_TRUE(f.acquire(50, 10s, true));   // woken by the release
  releaser.join();
  EXPECT_EQ(f.queued_bytes(), 90u);
  EXPECT_EQ(f.high_water_bytes(), 100u);
  f.release(90);
  EXPECT_TRUE(f.acquire(500, 0ms, false));  // one message over the bound passes alone
  std::thread closer([&] { f.close(); });
  auto c = f.acquire(1, 10s, true);
  closer.join();
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error().code(), ErrorCode::kClosed);
}

// The process's resident set, in bytes (/proc/self/statm).
std::size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t total_pages = 0, resident_pages = 0;
  statm >> total_pages >> resident_pages;
  return resident_pages * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

// Buffer::heap_lazy is what a received large message falls back to (above
// the pool's largest block, or with the pool exhausted): a peer that
// declares a 256 MiB message and sends little of it must not make 256 MiB
// resident.
TEST(Buffer, LargeHeapBufferIsResidentOnlyWhereWritten) {
  constexpr std::size_t kBytes = std::size_t{256} << 20;
  constexpr std::size_t kWritten = std::size_t{32} << 20;
  const std::size_t before = resident_bytes();
  Buffer b = Buffer::heap_lazy(kBytes);
  ASSERT_EQ(b.size(), kBytes);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % 4096, 0u);
  const std::size_t allocated = resident_bytes();
  EXPECT_LT(allocated, before + (std::size_t{16} << 20)) << "allocating made the body resident";
  std::memset(b.data(), 0x5a, kWritten);  // what arrived
  EXPECT_GE(resident_bytes(), allocated + kWritten / 2);
  // Zero-initialised where nothing was written.
  for (std::size_t at : {kWritten, kBytes / 2, kBytes - 1}) EXPECT_EQ(b.data()[at], std::byte{0}) << at;
  EXPECT_EQ(b.data()[kWritten - 1], std::byte{0x5a});
  Buffer small = Buffer::heap_lazy(5000);  // below the mapping size: zeroed the same
  for (std::size_t i = 0; i < small.size(); ++i) ASSERT_EQ(small.data()[i], std::byte{0}) << i;
}

TEST(PoolBuffer, BlocksTravelAsBuffersAndReturnToThePool) {
  memory::PoolOptions po;
  po.prealloc_pages = 4;
  po.backing = memory::BackingRequest::kPlain;
  auto pool = memory::PagePool::create(po);
  ASSERT_TRUE(pool) << pool.error().to_string();
  auto b = allocate_buffer(**pool, 10000, 3);
  ASSERT_TRUE(b);
  EXPECT_EQ(b->size(), 10000u);
  EXPECT_EQ(b->location().fd, (*pool)->fd());
  EXPECT_EQ(b->location().region_id, 3u);
  EXPECT_EQ((*pool)->base() + b->location().fd_offset, b->data());
  EXPECT_EQ((*pool)->stats().bytes_in_use, 16384u);
  b->reset();
  EXPECT_EQ((*pool)->stats().bytes_in_use, 0u);
  auto alloc = pool_receive_allocator(**pool);
  auto r = alloc(5000);
  ASSERT_TRUE(r);
  EXPECT_TRUE((*pool)->contains(r->data()));
  auto too_big = alloc(std::uint64_t{1} << 30);
  ASSERT_FALSE(too_big);
  EXPECT_EQ(too_big.error().code(), ErrorCode::kTooLarge);
}

TEST(OptionsFromConfig, MapsEveryCommunicationKey) {
  config::CommunicationConfig c;
  c.transport = config::Transport::kShm;
  c.batch_threshold_bytes = 8192;
  c.flush_interval = 50us;
  c.busy_poll = 300us;
  c.ring_buffer_slots = 256;
  c.num_channels = 3;
  c.zero_copy = config::ZeroCopy::kSendfile;
  c.payload_checksum = true;
  c.num_io_threads = 2;
  c.heartbeat_interval = 2s;
  c.heartbeat_timeout = 7s;
  c.max_message_bytes = 1 << 20;
  c.max_queued_bytes = 2 << 20;
  c.auth_token = "t";
  auto o = options_from_config(c);
  ASSERT_TRUE(o) << o.error().to_string();
  EXPECT_EQ(o->kind, Kind::kShm);
  EXPECT_EQ(o->batch_threshold_bytes, 8192u);
  EXPECT_EQ(o->flush_interval, 50us);
  EXPECT_EQ(o->busy_poll, 300us);
  EXPECT_EQ(o->ring_slots, 256u);
  EXPECT_EQ(o->num_channels, 3u);
  EXPECT_EQ(o->zero_copy, ZeroCopy::kSendfile);
  EXPECT_TRUE(o->payload_checksum);
  EXPECT_EQ(o->num_io_threads, 2u);
  EXPECT_EQ(o->heartbeat_interval, 2s);
  EXPECT_EQ(o->heartbeat_timeout, 7s);
  EXPECT_EQ(o->max_message_bytes, 1u << 20);
  EXPECT_EQ(o->max_queued_bytes, 2u << 20);
  EXPECT_EQ(o->auth_token, "t");
  c.transport = config::Transport::kAuto;
  EXPECT_EQ(options_from_config(c, true)->kind, Kind::kShm);
  EXPECT_EQ(options_from_config(c, false)->kind, Kind::kTcp);
  c.transport = config::Transport::kRdma;
  auto rdma = options_from_config(c);
  if (rdma) {
    EXPECT_EQ(rdma->kind, Kind::kRdma);  // a build with the rdma transport
  } else {
    EXPECT_EQ(rdma.error().code(), ErrorCode::kUnavailable) << rdma.error().to_string();
  }
}

TEST(SendErrors, BadChannelTooLargeAndClosedAreValues) {
  testing::Inbox sin, cin;  // before the transports: on_closed may run into it until they are gone
  Options o;
  o.max_message_bytes = 1 << 20;
  auto server = Transport::create(o);
  auto client = Transport::create(o);
  ASSERT_TRUE(server && client);
  auto l = (*server)->listen("127.0.0.1:0", {Role::kServer, 0}, sin.acceptor(), sin.handlers());
  ASSERT_TRUE(l);
  auto c = (*client)->connect((*l)->address(), {Role::kWorker, 0}, cin.handlers());
  ASSERT_TRUE(c);
  std::array<std::byte, 8> m{};
  auto s = (*c)->send(1, m);
  EXPECT_EQ(s.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.error().message().find("channel 1 does not exist"), std::string::npos);
  std::vector<std::byte> big((1 << 20) + 1);
  EXPECT_EQ((*c)->send(0, big).error().code(), ErrorCode::kTooLarge);
  int completions = 0;
  EXPECT_EQ((*c)->send(0, Buffer::heap(2 << 20), [&](const Status&) { ++completions; }).error().code(),
            ErrorCode::kTooLarge);
  EXPECT_EQ(completions, 0);
  (*c)->close();
  ASSERT_TRUE(cin.wait_closed());
  EXPECT_EQ((*c)->send(0, m).error().code(), ErrorCode::kClosed);
  EXPECT_EQ((*c)->flush(0).error().code(), ErrorCode::kClosed);
  Handlers none;
  EXPECT_EQ((*client)->connect((*l)->address(), {Role::kWorker, 0}, none).error().code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ((*client)->connect("127.0.0.1:1", {Role::kWorker, 0}, cin.handlers()).error().code(),
            ErrorCode::kIo);
}

TEST(IoThreads, CallbacksRunOnThreadsPinnedToTheConfiguredCpu) {
  testing::Inbox sin, cin;  // before the transports: on_closed may run into it until they are gone
  Options o;
  o.cpu_affinity = {0};
  auto server = Transport::create(o);
  auto client = Transport::create(Options{});
  ASSERT_TRUE(server && client);
  std::mutex mu;
  int cpus_in_mask = -1;
  bool cpu0 = false;
  bool on_io = false;
  Transport* server_raw = server->get();
  sin.also = [&](Connection&, Incoming&) {
    cpu_set_t set;
    CPU_ZERO(&set);
    pthread_getaffinity_np(pthread_self(), sizeof set, &set);
    std::lock_guard lock(mu);
    cpus_in_mask = CPU_COUNT(&set);
    cpu0 = CPU_ISSET(0, &set);
    on_io = server_raw->on_io_thread();
  };
  auto l = (*server)->listen("127.0.0.1:0", {Role::kServer, 0}, sin.acceptor(), sin.handlers());
  ASSERT_TRUE(l);
  auto c = (*client)->connect((*l)->address(), {Role::kWorker, 0}, cin.handlers());
  ASSERT_TRUE(c);
  std::array<std::byte, 8> m{};
  ASSERT_TRUE((*c)->send(0, m));
  ASSERT_TRUE((*c)->flush(0));
  ASSERT_TRUE(sin.wait_count(0, 1));
  std::lock_guard lock(mu);
  EXPECT_EQ(cpus_in_mask, 1);
  EXPECT_TRUE(cpu0);
  EXPECT_TRUE(on_io);
  EXPECT_FALSE((*server)->on_io_thread());
}

// A listener whose accept fails (EMFILE) waits AcceptPacer::kRetry before the
// next try, warns once per episode and says once when accepting works again.
TEST(AcceptPacer, RetriesAfterThePauseAndLogsEachEpisodeOnce) {
  std::ostringstream out;
  auto log = std::make_shared<spdlog::logger>(
      "accept-pacer-test", std::make_shared<spdlog::sinks::ostream_sink_st>(out));
  log->set_level(spdlog::level::info);
  log->set_pattern("%l %v");
  boost::asio::io_context ctx;
  AcceptPacer pacer(log, "listener 127.0.0.1:7000");
  EXPECT_FALSE(pacer.failing());

  int retries = 0;
  const auto start = std::chrono::steady_clock::now();
  pacer.failed(ctx, "Too many open files", [&] { ++retries; });
  // A second failure before the retry re-arms the one timer: one retry, one warning.
  pacer.failed(ctx, "Too many open files", [&] { ++retries; });
  EXPECT_TRUE(pacer.failing());
  ctx.run();
  EXPECT_EQ(retries, 1);
  EXPECT_GE(std::chrono::steady_clock::now() - start, AcceptPacer::kRetry);
  const std::string warning =
      "warning listener 127.0.0.1:7000: cannot accept a connection (Too many open files); "
      "retrying every 100 ms";
  EXPECT_NE(out.str().find(warning), std::string::npos) << out.str();
  EXPECT_EQ(out.str().find(warning), out.str().rfind(warning)) << out.str();

  pacer.succeeded();
  pacer.succeeded();
  EXPECT_FALSE(pacer.failing());
  const std::string recovered = "info listener 127.0.0.1:7000: accepting connections again";
  EXPECT_NE(out.str().find(recovered), std::string::npos) << out.str();
  EXPECT_EQ(out.str().find(recovered), out.str().rfind(recovered)) << out.str();

  // A new episode warns again; cancel() (the listener closing) drops its retry.
  pacer.failed(ctx, "No buffer space available", [&] { ++retries; });
  pacer.cancel();
  ctx.restart();
  ctx.run();
  EXPECT_EQ(retries, 1);
  EXPECT_NE(out.str().find("(No buffer space available)"), std::string::npos) << out.str();
}

// A storm of refusals: kLinesPerWindow lines, one saying the rest are
// counted, and their count when the window ends; the next window logs again.
// cancel() (the listener closing) drops a pending count.
TEST(RefusalLog, LogsTheFirstLinesOfAWindowThenTheCountOfTheRest) {
  std::ostringstream out;
  auto log = std::make_shared<spdlog::logger>(
      "refusal-log-test", std::make_shared<spdlog::sinks::ostream_sink_st>(out));
  log->set_level(spdlog::level::info);
  log->set_pattern("%l %v");
  boost::asio::io_context ctx;
  RefusalLog refusals(log, "listener 127.0.0.1:7000", std::chrono::milliseconds(200));
  const auto count = [&](const std::string& needle) {
    const std::string text = out.str();
    std::size_t n = 0;
    for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
    return n;
  };
  for (int i = 0; i < 50; ++i) refusals.log(ctx, spdlog::level::warn, fmt::format("refused peer {}", i));
  EXPECT_EQ(count("warning listener 127.0.0.1:7000: refused peer "), RefusalLog::kLinesPerWindow)
      << out.str();
  EXPECT_EQ(count("20 refused connections within 200 ms; the others until then are counted, not "
                  "logged"),
            1u)
      << out.str();
  ctx.run();  // the window's end
  EXPECT_EQ(count("30 more connection(s) refused in those 200 ms, not logged"), 1u) << out.str();
  refusals.log(ctx, spdlog::level::info, "refused peer 50");
  EXPECT_EQ(count("info listener 127.0.0.1:7000: refused peer 50"), 1u) << out.str();

  RefusalLog closing(log, "listener 127.0.0.1:7001", std::chrono::milliseconds(50));
  for (int i = 0; i < 25; ++i) closing.log(ctx, spdlog::level::warn, "refused");
  closing.cancel();
  // A refusal after the close (a handshake timer that had fired) arms nothing.
  closing.log(ctx, spdlog::level::warn, "refused");
  ctx.restart();
  ctx.run();
  EXPECT_EQ(count("listener 127.0.0.1:7001: 5 more"), 0u) << out.str();
  EXPECT_EQ(count("listener 127.0.0.1:7001: 1 more"), 0u) << out.str();
}

// Before any accept failed, succeeded() logs nothing.
TEST(AcceptPacer, SuccessWithoutAFailureLogsNothing) {
  std::ostringstream out;
  auto log = std::make_shared<spdlog::logger>(
      "accept-pacer-quiet", std::make_shared<spdlog::sinks::ostream_sink_st>(out));
  log->set_level(spdlog::level::trace);
  AcceptPacer pacer(log, "metrics endpoint");
  pacer.succeeded();
  EXPECT_TRUE(out.str().empty()) << out.str();
}

}  // namespace
}  // namespace ember::transport
