// Bad requests reach a real ember-server through a raw protocol client (the
// transport with hand-made messages): each class gets its error reply, or a
// closed connection for that worker only, while a well-behaved worker
// carries on. Also: --check-config on bad files, --print-config, metrics.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/proto/message.h"
#include "common/transport/transport.h"
#include "common/wire/batch_encoder.h"
#include "tests/integration/server/harness.h"
#include "tests/integration/server/workers.h"
#include "tests/unit/transport/raw_peer.h"
#include "worker/worker.h"

namespace ember::test {
namespace {

using proto::Header;
using proto::MsgType;

// A worker that speaks the protocol by hand.
class RawClient {
 public:
  // `region`: memory registered with the transport before connecting (shm
  // shares it with the server as region 0).
  RawClient(const std::string& address, std::uint32_t rank,
            transport::Kind kind = transport::Kind::kTcp,
            std::optional<transport::Transport::Region> region = std::nullopt)
      : rank_(rank) {
    transport::Options o;
    o.kind = kind;
    o.num_channels = 1;
    o.heartbeat_interval = 100ms;
    o.heartbeat_timeout = 5s;
    auto t = transport::Transport::create(o);
    EXPECT_TRUE(t) << t.error().to_string();
    transport_ = std::move(*t);
    if (region) {
      EXPECT_TRUE(transport_->register_memory(*region));
    }
    transport::Handlers h;
    h.on_message = [this](transport::Connection&, transport::Incoming&& m) {
      std::lock_guard lock(mutex_);
      inbox_.emplace_back(m.bytes.begin(), m.bytes.end());
      cv_.notify_all();
    };
    h.on_closed = [this](transport::Connection&, const Error& e) {
      std::lock_guard lock(mutex_);
      closed_ = e;
      cv_.notify_all();
    };
    auto c = transport_->connect(address, {transport::Role::kWorker, rank}, h);
    EXPECT_TRUE(c) << c.error().to_string();
    if (c) conn_ = *c;
  }
  ~RawClient() {
    if (conn_) conn_->close();
    transport_.reset();
  }

  void send(const std::vector<std::byte>& bytes) {
    ASSERT_TRUE(conn_->send(0, bytes));
    ASSERT_TRUE(conn_->flush(0));
  }
  // Sends a message the server answers by closing the connection. The batch
  // may leave on the flush timer and the server may close before flush()
  // runs, so flush() failing with kClosed is an outcome, not a failure; the
  // caller checks closed() for the reason.
  void send_closing(const std::vector<std::byte>& bytes) {
    ASSERT_TRUE(conn_->send(0, bytes));
    const Status flushed = conn_->flush(0);
    if (!flushed) {
      ASSERT_EQ(flushed.error().code(), ErrorCode::kClosed) << flushed.error().to_string();
    }
  }
  void send(Header h, std::span<const std::uint64_t> dims = {}, std::vector<float> data = {}) {
    h.worker_rank = rank_;
    h.request_id = ++next_id_;
    send(proto::encode_message(h, dims, std::as_bytes(std::span<const float>(data))));
  }
  // The next reply, decoded; nullopt after 10 s or when the connection closed.
  std::optional<proto::Header> reply(std::string* text = nullptr) {
    std::unique_lock lock(mutex_);
    if (!cv_.wait_for(lock, 10s, [&] { return !inbox_.empty() || closed_; }) || inbox_.empty()) {
      return std::nullopt;
    }
    last_ = std::move(inbox_.front());
    inbox_.pop_front();
    auto m = proto::decode(last_);
    EXPECT_TRUE(m) << m.error().to_string();
    if (!m) return std::nullopt;
    if (text != nullptr) *text = std::string(m->text());
    return m->header;
  }
  // The next message as raw bytes (a payload that follows its header);
  // empty after 10 s or when the connection closed.
  std::vector<std::byte> next_raw() {
    std::unique_lock lock(mutex_);
    if (!cv_.wait_for(lock, 10s, [&] { return !inbox_.empty() || closed_; }) || inbox_.empty()) {
      return {};
    }
    std::vector<std::byte> out = std::move(inbox_.front());
    inbox_.pop_front();
    return out;
  }
  // Sends a pull of `n` floats of `key` with a reply placement.
  void send_placed_pull(std::uint64_t key, std::uint64_t n, std::uint32_t region,
                        std::uint64_t offset) {
    Header h = keyed_header(proto::MsgType::kPull, key, n);
    h.flags = proto::kFlagInPlace;
    h.worker_rank = rank_;
    h.request_id = ++next_id_;
    const auto body = proto::encode_body(proto::ReplyPlacement{region, 0, offset});
    send(proto::encode_message(h, {}, body));
  }
  static Header keyed_header(proto::MsgType type, std::uint64_t key, std::uint64_t n) {
    Header h;
    h.type = type;
    h.dtype = proto::DType::kFloat32;
    h.key = key;
    h.num_elements = n;
    return h;
  }
  // Waits for the connection to close; its reason.
  std::optional<Error> closed() {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, 10s, [&] { return closed_.has_value(); });
    return closed_;
  }

 private:
  std::uint32_t rank_;
  std::uint64_t next_id_ = 0;
  std::unique_ptr<transport::Transport> transport_;
  std::shared_ptr<transport::Connection> conn_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::vector<std::byte>> inbox_;
  std::optional<Error> closed_;
  std::vector<std::byte> last_;
};

Header keyed(MsgType type, std::uint64_t key, std::uint64_t n, std::uint64_t step = 0) {
  Header h;
  h.type = type;
  h.dtype = proto::DType::kFloat32;
  h.key = key;
  h.step = step;
  h.num_elements = n;
  return h;
}

class BadRequests : public ::testing::Test {
 protected:
  void SetUp() override {
    spec.num_workers = 2;
    spec.consistency = "asp";
    server = std::make_unique<ServerProcess>(dir, spec, 0);
    ASSERT_TRUE(server->ok());
    // The well-behaved worker (rank 0) with a registered key.
    auto w = Worker::create(worker_config(spec, {server->address()}, 0));
    ASSERT_TRUE(w) << w.error().to_string();
    good = std::move(*w);
    ASSERT_TRUE(good->init(1, shape, std::vector<float>{1, 2, 3, 4}).wait());
  }
  // The good worker still gets service.
  void expect_good_worker_served() {
    std::vector<float> p(4);
    ASSERT_TRUE(good->push(1, std::vector<float>{0, 0, 0, 0}).wait());
    auto r = good->pull(1, p).wait();
    ASSERT_TRUE(r) << r.error().to_string();
  }
  void expect_error(RawClient& c, ErrorCode code, const std::string& needle) {
    std::string text;
    auto h = c.reply(&text);
    ASSERT_TRUE(h);
    EXPECT_EQ(h->status, code) << text;
    EXPECT_NE(text.find(needle), std::string::npos) << text;
  }

  TempDir dir;
  ClusterSpec spec;
  std::unique_ptr<ServerProcess> server;
  std::unique_ptr<Worker> good;
  const std::uint64_t shape[1] = {4};
};

TEST_F(BadRequests, UnknownKeyGetsNotFound) {
  RawClient c(server->address(), 1);
  c.send(keyed(MsgType::kPull, 999, 4));
  expect_error(c, ErrorCode::kNotFound, "key 999");
  c.send(keyed(MsgType::kPush, 999, 1), {}, {1.0f});
  expect_error(c, ErrorCode::kNotFound, "key 999");
  expect_good_worker_served();
  EXPECT_NE(server->log().find("bad request from worker 1"), std::string::npos) << server->log();
}

TEST_F(BadRequests, ShapeMismatchOnInitAndOnPush) {
  RawClient c(server->address(), 1);
  Header init = keyed(MsgType::kInit, 1, 4);
  init.flags = proto::kFlagNoData;
  init.ndim = 2;
  const std::uint64_t dims[] = {2, 2};
  c.send(init, dims);
  expect_error(c, ErrorCode::kShapeMismatch, "[4]");
  c.send(keyed(MsgType::kPush, 1, 3), {}, {1, 2, 3});
  expect_error(c, ErrorCode::kShapeMismatch, "holds 4 elements");
  expect_good_worker_served();
}

// An init whose chunking is not the job's (placement::chunk_plan with the
// server's partition_bytes) is refused and stores nothing: it used to be
// stored, checkpointed, and then refused by every restart ("written with
// another partition_bytes"), taking the job's checkpoints with it.
TEST_F(BadRequests, InitWithAnotherChunkLayoutIsRefused) {
  RawClient c(server->address(), 1);
  const std::uint64_t dims[] = {4};
  Header half = keyed(MsgType::kInit, 600, 2);  // [4] as 2 chunks of 2: the job has 1
  half.ndim = 1;
  half.num_chunks = 2;
  c.send(half, dims, {1, 2});
  expect_error(c, ErrorCode::kInvalidArgument, "cuts it into 1 chunk(s)");
  half.chunk_index = 1;
  half.offset_elements = 2;
  c.send(half, dims, {3, 4});
  expect_error(c, ErrorCode::kInvalidArgument, "partition_bytes");
  // One chunk of the right count, but not all of the tensor.
  Header part = keyed(MsgType::kInit, 601, 3);
  part.ndim = 1;
  c.send(part, dims, {1, 2, 3});
  expect_error(c, ErrorCode::kInvalidArgument, "chunk 0 being elements [0, +4)");
  // A 2^40-element shape sent as one 1-element chunk.
  const std::uint64_t huge[] = {std::uint64_t{1} << 40};
  Header tiny = keyed(MsgType::kInit, 602, 1);
  tiny.ndim = 1;
  c.send(tiny, huge, {1});
  expect_error(c, ErrorCode::kInvalidArgument, "key 602");
  for (const std::uint64_t key : {600, 601, 602}) {
    c.send(keyed(MsgType::kPull, key, 4));
    expect_error(c, ErrorCode::kNotFound, fmt::format("key {}", key));
  }
  expect_good_worker_served();
}

TEST_F(BadRequests, DtypeMismatch) {
  RawClient c(server->address(), 1);
  Header push = keyed(MsgType::kPush, 1, 4);
  push.dtype = proto::DType::kFloat16;
  c.send(push, {}, {1.0f, 2.0f});  // 8 bytes = 4 float16
  expect_error(c, ErrorCode::kShapeMismatch, "float16");
  Header init = keyed(MsgType::kInit, 77, 2);
  init.dtype = proto::DType::kBFloat16;
  init.ndim = 1;
  const std::uint64_t dims[] = {2};
  c.send(init, dims, {1.0f});
  expect_error(c, ErrorCode::kInvalidArgument, "bfloat16");
  expect_good_worker_served();
}

TEST_F(BadRequests, BadLearningRateIsRefused) {
  RawClient c(server->address(), 1);
  Header h;
  h.type = MsgType::kSetLearningRate;
  h.dtype = proto::DType::kFloat64;
  h.num_elements = 1;
  h.worker_rank = 1;
  h.request_id = 5;
  const auto v = proto::encode_f64(-1.0);
  c.send(proto::encode_message(h, {}, v));
  expect_error(c, ErrorCode::kInvalidArgument, "learning rate");
}

TEST_F(BadRequests, MalformedMessageClosesOnlyThatConnection) {
  RawClient c(server->address(), 1);
  std::vector<std::byte> garbage(100, std::byte{0x5A});
  c.send_closing(garbage);
  auto reason = c.closed();
  ASSERT_TRUE(reason);
  expect_good_worker_served();
  EXPECT_NE(server->log().find("closing the connection of worker 1"), std::string::npos)
      << server->log();
  const std::string metrics = http_get(server->metrics_address(), "/metrics");
  EXPECT_EQ(metrics.find("ember_server_bad_messages_total 0"), std::string::npos) << metrics;
  // The reason is logged once; the close that follows says who closed it,
  // not "lost: ... without goodbye (crashed or reset)".
  const auto said = [&] {
    return server->log().find("disconnected: this server closed the connection") !=
           std::string::npos;
  };
  for (int i = 0; i < 200 && !said(); ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(said()) << server->log();
  EXPECT_EQ(server->log().find(") lost: "), std::string::npos) << server->log();
}

// Frames the decoder refuses close their connection and count as bad
// messages, whatever the field: a bad magic, another wire version, or
// frame_bytes over the limit (the last two were not counted, helper-82).
TEST_F(BadRequests, EveryRefusedFrameIsCountedAsABadMessage) {
  auto refused_frame = [&](std::uint32_t magic, std::uint8_t version, std::uint32_t frame_bytes) {
    transport::testing::RawTcpPeer peer;
    ASSERT_TRUE(peer.connect(server->address()));
    transport::handshake::Hello hello;
    hello.rank = 1;
    hello.session_id = 0xF00D + frame_bytes;
    auto reply = peer.handshake(hello);
    ASSERT_TRUE(reply && reply->status == ErrorCode::kOk);
    wire::FrameHeaderWire h{};
    h.magic = magic;
    h.version = version;
    h.kind = static_cast<std::uint8_t>(wire::FrameKind::kSingle);
    h.item_count = 1;
    h.frame_bytes = frame_bytes;
    std::vector<std::byte> bytes(64);
    std::memcpy(bytes.data(), &h, sizeof h);
    ASSERT_TRUE(peer.send(bytes));
    EXPECT_TRUE(peer.wait_eof());
  };
  refused_frame(0x12345678u, wire::kVersion, 64);
  refused_frame(wire::kMagic, 99, 64);
  refused_frame(wire::kMagic, wire::kVersion, 0xFFFFFFF8u);
  std::string metrics;
  const auto counted = [&] {
    metrics = http_get(server->metrics_address(), "/metrics");
    return metrics.find("\nember_server_bad_messages_total 3\n") != std::string::npos;
  };
  for (int i = 0; i < 200 && !counted(); ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(counted()) << metrics;
  expect_good_worker_served();
}

TEST_F(BadRequests, RankThatDisagreesWithHandshakeClosesConnection) {
  RawClient c(server->address(), 1);
  Header h = keyed(MsgType::kPull, 1, 4);
  h.worker_rank = 0;  // the handshake said 1
  c.send_closing(proto::encode_message(h, {}, {}));
  ASSERT_TRUE(c.closed());
  expect_good_worker_served();
}

TEST_F(BadRequests, RankOutsideTheJobIsRefused) {
  RawClient c(server->address(), 7);
  // Its join is answered with the reason, then the server closes.
  Header join;
  join.type = MsgType::kJoin;
  const proto::JoinRequestBody body{2, 1, 0, 0};
  const auto body_bytes = proto::encode_body(body);
  join.worker_rank = 7;
  join.request_id = 1;
  c.send_closing(proto::encode_message(join, {}, body_bytes));
  expect_error(c, ErrorCode::kConfig, "rank 7 is outside this job: it has 2 worker(s)");
  ASSERT_TRUE(c.closed());
  expect_good_worker_served();
  EXPECT_NE(server->log().find("refusing worker"), std::string::npos) << server->log();
}

// A peer whose handshake says it is a server is closed at once, and the log
// says so, not that its rank is outside the job (it used to).
TEST_F(BadRequests, APeerThatSaysItIsAServerIsRefusedAsSuch) {
  transport::Options o;
  o.kind = transport::Kind::kTcp;
  o.num_channels = 1;
  auto t = transport::Transport::create(o);
  ASSERT_TRUE(t) << t.error().to_string();
  std::mutex mu;
  std::condition_variable cv;
  bool closed = false;
  transport::Handlers h;
  h.on_message = [](transport::Connection&, transport::Incoming&&) {};
  h.on_closed = [&](transport::Connection&, const Error&) {
    std::lock_guard lock(mu);
    closed = true;
    cv.notify_all();
  };
  auto c = (*t)->connect(server->address(), {transport::Role::kServer, 0}, h);
  if (c) {
    std::unique_lock lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, 10s, [&] { return closed; })) << "the server kept the connection";
  }
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (server->log().find("serves only workers") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_NE(server->log().find("its handshake says it is a server, and ember-server serves only "
                               "workers"),
            std::string::npos)
      << server->log();
  EXPECT_EQ(server->log().find("this job has 2 worker(s)"), std::string::npos) << server->log();
  expect_good_worker_served();
}

TEST_F(BadRequests, WorkerWithAnotherClusterTableFailsToJoin) {
  ClusterSpec other = spec;
  other.num_workers = 3;
  auto w = Worker::create(worker_config(other, {server->address()}, 1));
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error().code(), ErrorCode::kConfig) << w.error().to_string();
  EXPECT_NE(w.error().message().find("[cluster]"), std::string::npos) << w.error().to_string();
}

// A process refused at its join never was a worker of the job: its rank is
// neither lost when it goes (bsp, "fail": the others' round would fail) nor
// back while it is there (a lost rank would count as present again).
// A bsp job of two ranks under `loss_policy`: the server, and rank 0 with
// key 1 (2 floats, 1 and 1) registered.
struct RankZeroOfTwo {
  TempDir dir;
  ClusterSpec spec;
  std::unique_ptr<ServerProcess> server;
  std::unique_ptr<Worker> w0;
  static constexpr std::uint64_t kShape[] = {2};

  explicit RankZeroOfTwo(const std::string& loss_policy) {
    spec.num_workers = 2;
    spec.loss_policy = loss_policy;
    server = std::make_unique<ServerProcess>(dir, spec, 0);
    if (!server->ok()) return;
    auto w = Worker::create(worker_config(spec, {server->address()}, 0));
    EXPECT_TRUE(w) << w.error().to_string();
    if (!w) return;
    w0 = std::move(*w);
    EXPECT_TRUE(w0->init(1, kShape, std::vector<float>{1, 1}).wait());
  }
  bool ok() const { return server->ok() && w0 != nullptr; }
};

TEST(BadRequestsBsp, AWorkerRefusedAtJoinIsNotItsRanksLoss) {
  RankZeroOfTwo job("fail");
  ASSERT_TRUE(job.ok());
  const ClusterSpec& spec = job.spec;
  ServerProcess& server = *job.server;
  const auto& w0 = job.w0;
  const auto& shape = RankZeroOfTwo::kShape;
  ASSERT_TRUE(w0->push(1, std::vector<float>{2, 2}).wait());
  std::vector<float> p(2);
  Handle pull = w0->pull(1, p);  // waits for rank 1's push of step 0
  ClusterSpec other = spec;
  other.num_workers = 3;
  auto stray = Worker::create(worker_config(other, {server.address()}, 1));
  ASSERT_FALSE(stray);
  EXPECT_EQ(stray.error().code(), ErrorCode::kConfig) << stray.error().to_string();
  // Its connection has closed (the worker closes it on the refusal); had
  // it been rank 1's, the pull would fail with kWorkerLost by now.
  EXPECT_FALSE(pull.wait_for(1500ms).has_value());
  EXPECT_FALSE(pull.ready()) << server.log();
  auto w1 = Worker::create(worker_config(spec, {server.address()}, 1));
  ASSERT_TRUE(w1) << w1.error().to_string();
  ASSERT_TRUE((*w1)->init(1, shape, std::vector<float>{1, 1}).wait());
  ASSERT_TRUE((*w1)->push(1, std::vector<float>{4, 4}).wait());
  auto r = pull.wait();
  ASSERT_TRUE(r) << r.error().to_string();
  EXPECT_FLOAT_EQ(p[0], 1.0f - 0.1f * 3.0f);  // sgd, lr 0.1, the mean of 2 and 4
  EXPECT_EQ(server.log().find("rejoining"), std::string::npos) << server.log();
}

// The refused connection is answered and closed: it cannot go on as the
// rank (two live connections for one rank once the real worker came), and
// a member that sends a bad join later is lost, not forgotten.
TEST(BadRequestsBsp, ARefusedJoinIsAnsweredThenClosed) {
  RankZeroOfTwo job("fail");
  ASSERT_TRUE(job.ok());
  RawClient stray(job.server->address(), 1);
  Header h;
  h.type = MsgType::kJoin;
  h.worker_rank = 1;
  h.request_id = 1;
  const auto body = proto::encode_body(proto::JoinRequestBody{3, 1, 0, 0});  // 3 workers, not 2
  stray.send(proto::encode_message(h, {}, body));
  std::string text;
  auto reply = stray.reply(&text);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->status, ErrorCode::kConfig) << text;
  EXPECT_NE(text.find("different [cluster] table"), std::string::npos) << text;
  ASSERT_TRUE(stray.closed().has_value()) << "the server left the refused connection open";
  // Its rank's worker joins as usual meanwhile.
  auto w1 = Worker::create(worker_config(job.spec, {job.server->address()}, 1));
  ASSERT_TRUE(w1) << w1.error().to_string();

  w1->reset();  // rank 1 leaves in order: "fail" fails it
  // Until the server has seen that close, a new connection as rank 1 is
  // refused as a second live one ("rank 1 is already connected").
  const auto seen_by = std::chrono::steady_clock::now() + 10s;
  while (job.server->log().find("disconnected") == std::string::npos &&
         std::chrono::steady_clock::now() < seen_by) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_NE(job.server->log().find("disconnected"), std::string::npos) << job.server->log();

  // A connection that spoke as rank 1 (a push: rank 1 is back) and then
  // sends a bad join is rank 1's loss when it is closed: rank 0's next round
  // fails at once instead of waiting for a rank that has no connection.
  RawClient member(job.server->address(), 1);
  member.send(keyed(MsgType::kPush, 1, 2, 0), {}, {4, 4});
  std::string push_text;
  ASSERT_TRUE(member.reply(&push_text)) << push_text;
  ASSERT_TRUE(job.w0->push(1, std::vector<float>{2, 2}).wait());
  std::vector<float> p(2);
  ASSERT_TRUE(job.w0->pull(1, p).wait());  // round 0: both pushes
  h.request_id = 2;
  member.send(proto::encode_message(h, {}, body));
  ASSERT_TRUE(member.closed().has_value());
  ASSERT_TRUE(job.w0->push(1, std::vector<float>{2, 2}).wait());
  auto r = job.w0->pull(1, p).wait_for(10s);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kWorkerLost) << r.error().to_string();
}

TEST(BadRequestsBsp, AWorkerRefusedAtJoinDoesNotBringALostRankBack) {
  RankZeroOfTwo job("shrink");
  ASSERT_TRUE(job.ok());
  const ClusterSpec& spec = job.spec;
  ServerProcess& server = *job.server;
  const auto& w0 = job.w0;
  {
    RawClient gone(server.address(), 1);  // rank 1 connects and leaves: excluded
  }
  ClusterSpec other = spec;
  other.partition_bytes = "1MB";
  auto stray = Worker::create(worker_config(other, {server.address()}, 1));
  ASSERT_FALSE(stray);
  EXPECT_EQ(stray.error().code(), ErrorCode::kConfig) << stray.error().to_string();
  // Rank 1 stays excluded: rounds close with rank 0 alone.
  for (std::uint64_t step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    ASSERT_TRUE(w0->push(1, std::vector<float>{1, 1}).wait());
    std::vector<float> p(2);
    auto r = w0->pull(1, p).wait_for(10s);
    ASSERT_TRUE(r) << r.error().to_string() << "\n" << server.log();
  }
  const std::string log = server.log();
  EXPECT_EQ(log.find("rejoining"), std::string::npos) << log;
  EXPECT_NE(log.find("different [server] partition_bytes"), std::string::npos) << log;
  // A worker of the job that comes back is back.
  auto w1 = Worker::create(worker_config(spec, {server.address()}, 1));
  ASSERT_TRUE(w1) << w1.error().to_string();
  // (The server logs it before its join reply; the file may lag a little.)
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (server.log().find("(rejoining)") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_NE(server.log().find("worker 1 (127.0.0.1:"), std::string::npos) << server.log();
  EXPECT_NE(server.log().find("is back (rejoining)"), std::string::npos) << server.log();
}

// Servers of one job that disagree on consistency or [optimizer] would update
// the chunks of one tensor two ways (a helper's run: asp on one of three
// servers gave chunks at -40 beside -20, nothing logged). The worker compares
// the servers' join replies and refuses the one that differs, naming both.
TEST(BadRequestsServers, ServersWithDifferentSettingsAreRefusedAtJoin) {
  struct Case {
    std::vector<std::string> server1_args;
    std::vector<std::string> expected;
  };
  const Case cases[] = {
      {{"--set", "server.consistency=asp"},
       {"runs consistency \"asp\", on_worker_loss \"wait\", but server 0 (",
        ") runs consistency \"bsp\", on_worker_loss \"wait\"",
        "Give every server the same [server] consistency, staleness and on_worker_loss"}},
      {{"--set", "optimizer.type=adam"},
       {"applies optimizer \"adam\", but server 0 (", ") applies optimizer \"sgd\""}},
      {{"--set", "optimizer.learning_rate=0.2"},
       {"has other [optimizer] numbers than server 0 (",
        "Give every server the same [optimizer] table"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.server1_args[1]);
    TempDir dir;
    ClusterSpec spec;
    spec.num_servers = 2;
    ServerProcess s0(dir, spec, 0);
    ServerProcess s1(dir, spec, 1, c.server1_args);
    ASSERT_TRUE(s0.ok() && s1.ok());
    auto w = Worker::create(worker_config(spec, {s0.address(), s1.address()}, 0));
    ASSERT_FALSE(w) << "a worker joined servers with different settings";
    EXPECT_EQ(w.error().code(), ErrorCode::kConfig) << w.error().to_string();
    const std::string text = w.error().to_string();
    EXPECT_NE(text.find("server 1 (" + s1.address() + ") "), std::string::npos) << text;
    for (const std::string& e : c.expected) EXPECT_NE(text.find(e), std::string::npos) << text;
  }
  // The same settings join, also after a worker set another learning rate
  // at run time (the check is of the configured numbers), and with another
  // value of a number the optimizer does not use (sgd has no beta2).
  TempDir dir;
  ClusterSpec spec;
  spec.num_servers = 2;
  spec.num_workers = 2;
  ServerProcess s0(dir, spec, 0);
  ServerProcess s1(dir, spec, 1, {"--set", "optimizer.beta2=0.5"});
  ASSERT_TRUE(s0.ok() && s1.ok());
  auto w0 = Worker::create(worker_config(spec, {s0.address(), s1.address()}, 0));
  ASSERT_TRUE(w0) << w0.error().to_string();
  ASSERT_TRUE((*w0)->set_learning_rate(0.5).wait());
  auto w1 = Worker::create(worker_config(spec, {s0.address(), s1.address()}, 1));
  EXPECT_TRUE(w1) << w1.error().to_string();
}

// Servers restarted with a new [optimizer] table are compared with what the
// others say now, not with what they said before their restart: restarted
// one at a time, the first differs from the second until that one is back
// too; then the worker carries on (it used to refuse both for good).
TEST(BadRequestsServers, ServersRestartedWithNewSettingsAreComparedAsTheyRunNow) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_servers = 2;
  std::vector<std::unique_ptr<ServerProcess>> first;
  std::vector<std::string> addresses;
  for (std::uint32_t i = 0; i < 2; ++i) {
    first.push_back(std::make_unique<ServerProcess>(dir, spec, i));
    ASSERT_TRUE(first.back()->ok());
    addresses.push_back(first.back()->address());
  }
  auto w = Worker::create(worker_config(spec, addresses, 0));
  ASSERT_TRUE(w) << w.error().to_string();
  ASSERT_TRUE((*w)->set_learning_rate(0.5).wait());
  std::vector<std::unique_ptr<Process>> again(2);
  auto restart = [&](std::uint32_t i) {
    first[i]->process().signal(SIGTERM);
    ASSERT_TRUE(first[i]->process().wait_exit(20s));
    again[i] = std::make_unique<Process>(
        server_binary(),
        std::vector<std::string>{"--config", (dir / fmt::format("server{}.toml", i)).string(),
                                 "--listen", addresses[i], "--set",
                                 fmt::format("server.server_index={}", i), "--set",
                                 "optimizer.learning_rate=0.25"},
        dir / fmt::format("again{}.log", i));
    ASSERT_TRUE(again[i]->wait_line("ember-server ready", 30s));
  };
  restart(0);
  auto r = (*w)->set_learning_rate(0.5).wait();
  ASSERT_FALSE(r) << "server 0 runs another learning rate than server 1 now";
  EXPECT_EQ(r.error().code(), ErrorCode::kConfig) << r.error().to_string();
  EXPECT_NE(r.error().to_string().find("has other [optimizer] numbers than server 1"),
            std::string::npos)
      << r.error().to_string();
  restart(1);
  // Server 0's refused connection and server 1's old one are gone: both
  // join again and agree.
  auto now = (*w)->set_learning_rate(0.5).wait();
  EXPECT_TRUE(now) << now.error().to_string();
}

// A server the worker refuses at its join receives nothing else: while one
// thread reconnects and joins, the other senders wait for the join to end
// instead of using the new connection at once. Here eight threads change the
// learning rate after server 0 came back with another one; each is refused,
// and server 0 never applies a rate (it would log it).
TEST(BadRequestsServers, NothingButTheJoinReachesAServerTheWorkerRefuses) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_servers = 2;
  std::vector<std::unique_ptr<ServerProcess>> servers;
  std::vector<std::string> addresses;
  for (std::uint32_t i = 0; i < 2; ++i) {
    servers.push_back(std::make_unique<ServerProcess>(dir, spec, i));
    ASSERT_TRUE(servers.back()->ok());
    addresses.push_back(servers.back()->address());
  }
  auto w = Worker::create(worker_config(spec, addresses, 0));
  ASSERT_TRUE(w) << w.error().to_string();
  ASSERT_TRUE((*w)->set_learning_rate(0.5).wait());
  servers[0]->process().signal(SIGTERM);
  ASSERT_TRUE(servers[0]->process().wait_exit(20s));
  Process again(server_binary(),
                {"--config", (dir / "server0.toml").string(), "--listen", addresses[0], "--set",
                 "server.server_index=0", "--set", "optimizer.learning_rate=0.25"},
                dir / "again.log");
  ASSERT_TRUE(again.wait_line("ember-server ready", 30s)) << read_file(dir / "again.log");
  constexpr std::uint32_t kThreads = 8;
  std::vector<Result<std::uint64_t>> results(kThreads);
  std::vector<std::thread> threads;
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] { results[t] = (*w)->set_learning_rate(0.75).wait(); });
  }
  for (auto& t : threads) t.join();
  // Each call fails. At least one with the refusal: the others waited for
  // that join (and share its outcome), or came after it and were refused by
  // a join of their own, or, while the server still held the refused
  // connection of rank 0, were told that rank 0 is already connected.
  std::uint32_t refused = 0;
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    ASSERT_FALSE(results[t]) << "thread " << t << " changed the rate of a refused server";
    const Error& e = results[t].error();
    if (e.code() != ErrorCode::kConfig) continue;
    ++refused;
    EXPECT_NE(e.to_string().find("has other [optimizer] numbers than server 1"), std::string::npos)
        << e.to_string();
  }
  EXPECT_GE(refused, 1u);
  again.signal(SIGTERM);
  ASSERT_TRUE(again.wait_exit(20s));
  const std::string log = read_file(dir / "again.log");
  EXPECT_EQ(log.find("set the learning rate"), std::string::npos) << log;
}

// Over shm a server is found by the text of its address: a --listen spelled
// otherwise than its [cluster] servers entry is a server no worker of that
// config finds. The server warns at start, and the worker's error says why.
TEST(BadRequestsServers, ShmListenSpelledOtherwiseThanTheServerListIsNamed) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  const std::uint32_t port = 20000 + (static_cast<std::uint32_t>(::getpid()) * 389) % 40000;
  const std::string entry = fmt::format("localhost:{}", port);
  const std::string listen = fmt::format("127.0.0.1:{}", port);
  write_file(dir / "shm.toml", cluster_toml(spec, {entry}));
  Process server(server_binary(), {"--config", (dir / "shm.toml").string(), "--listen", listen},
                 dir / "server.log");
  ASSERT_TRUE(server.wait_line("ember-server ready", 30s)) << read_file(dir / "server.log");
  const std::string log = read_file(dir / "server.log");
  EXPECT_NE(log.find(fmt::format("listening over shm as '@ember-{}', but [cluster] servers names "
                                 "this server '{}': shm workers look for '@ember-{}'",
                                 listen, entry, entry)),
            std::string::npos)
      << log;
  config::Config c = worker_config(spec, {entry}, 0);
  ASSERT_TRUE(config::set_value(c, "worker.connect_retries", "1"));
  auto w = Worker::create(c);
  ASSERT_FALSE(w);
  EXPECT_NE(w.error().to_string().find("'localhost:7000' and '127.0.0.1:7000' are two names"),
            std::string::npos)
      << w.error().to_string();
  // Nothing accepts tcp there: no transport-mismatch hint.
  EXPECT_EQ(w.error().to_string().find("accepts tcp"), std::string::npos) << w.error().to_string();
}

// An shm worker pointed at a tcp server: the error says that the server
// accepts tcp there and that the transports must agree, not only the shm
// connect hint.
TEST(BadRequestsServers, ShmWorkerAtATcpServerIsToldTheTransportsDiffer) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "tcp";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  ClusterSpec shm = spec;
  shm.transport = "shm";
  config::Config c = worker_config(shm, {server.address()}, 0);
  ASSERT_TRUE(config::set_value(c, "worker.connect_retries", "1"));
  auto w = Worker::create(c);
  ASSERT_FALSE(w);
  const std::string text = w.error().to_string();
  EXPECT_NE(text.find(fmt::format("but something accepts tcp at {}: if that is this job's "
                                  "ember-server, its [communication] transport is not this "
                                  "worker's \"shm\"; give workers and servers the same transport",
                                  server.address())),
            std::string::npos)
      << text;
  // The tcp server carries on: a tcp worker joins and works.
  auto ok = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_TRUE(ok) << ok.error().to_string();
  const std::uint64_t shape[] = {2};
  EXPECT_TRUE((*ok)->init(1, shape, std::vector<float>{1, 2}).wait());
  // The server logged the probe as harmless, at info level, not as a failed
  // handshake. (Its log is a file the server appends to: read it until the
  // line is there, for at most 10 s.)
  const std::string probe = "connected and closed without sending a hello";
  std::string log = server.log();
  for (const auto end = std::chrono::steady_clock::now() + 10s;
       log.find(probe) == std::string::npos && std::chrono::steady_clock::now() < end;
       log = server.log()) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_NE(log.find(probe), std::string::npos) << log;
  EXPECT_NE(log.find("[info] [tcp] listener"), std::string::npos) << log;
  EXPECT_EQ(log.find("during the handshake"), std::string::npos) << log;
}

// A reply placement (proto::kFlagInPlace) the server cannot write — past
// the end of the worker's region, an unknown region, or over tcp, where no
// worker memory is mapped — is ignored: the data comes as usual, one
// warning per connection, and a good placement is written in place.
TEST(BadRequestsInPlace, UnusablePlacementGetsTheDataInstead) {
  for (const char* kind : {"shm", "tcp"}) {
    SCOPED_TRACE(kind);
    TempDir dir;
    ClusterSpec spec;
    spec.transport = kind;
    spec.num_workers = 2;
    spec.consistency = "asp";
    ServerProcess server(dir, spec, 0);
    ASSERT_TRUE(server.ok());
    auto good = Worker::create(worker_config(spec, {server.address()}, 0));
    ASSERT_TRUE(good) << good.error().to_string();
    constexpr std::uint64_t n = 3000;  // 12000 bytes: a large reply
    std::vector<float> init(n);
    for (std::uint64_t i = 0; i < n; ++i) init[i] = static_cast<float>(i) * 0.5f;
    const std::uint64_t shape[1] = {n};
    ASSERT_TRUE((*good)->init(5, shape, init).wait());

    constexpr std::size_t kRegion = std::size_t{2} << 20;
    const int fd = ::memfd_create("ember-raw-client", MFD_CLOEXEC);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, kRegion), 0);
    void* base = ::mmap(nullptr, kRegion, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ASSERT_NE(base, MAP_FAILED);
    const bool shm = std::string(kind) == "shm";
    {
      // The shm listener's name for host:port (proto::endpoint_address).
      RawClient c(shm ? "@ember-" + server.address() : server.address(), 1,
                  shm ? transport::Kind::kShm : transport::Kind::kTcp,
                  transport::Transport::Region{base, kRegion, fd});
      auto expect_data = [&](const char* what) {
        SCOPED_TRACE(what);
        auto h = c.reply();
        ASSERT_TRUE(h);
        EXPECT_EQ(h->status, ErrorCode::kOk);
        EXPECT_EQ(h->flags & proto::kFlagInPlace, 0);
        ASSERT_NE(h->flags & proto::kFlagPayloadFollows, 0);
        const std::vector<std::byte> data = c.next_raw();
        ASSERT_EQ(data.size(), n * 4);
        EXPECT_EQ(std::memcmp(data.data(), init.data(), data.size()), 0);
      };
      if (shm) {
        c.send_placed_pull(5, n, 0, 8192);  // good: written in place
        auto h = c.reply();
        ASSERT_TRUE(h);
        EXPECT_EQ(h->status, ErrorCode::kOk);
        EXPECT_NE(h->flags & proto::kFlagInPlace, 0);
        EXPECT_EQ(h->num_elements, n);
        EXPECT_EQ(std::memcmp(static_cast<std::byte*>(base) + 8192, init.data(), n * 4), 0);
      }
      c.send_placed_pull(5, n, 0, kRegion - 100);  // runs past the end of the region
      expect_data("past the end");
      c.send_placed_pull(5, n, 7, 0);  // no region 7
      expect_data("unknown region");
      // The server and the good worker carry on.
      std::vector<float> p(n);
      ASSERT_TRUE((*good)->pull(5, p).wait());
      EXPECT_EQ(p, init);
    }
    ::munmap(base, kRegion);
    ::close(fd);
    const std::string log = server.log();
    const auto at = log.find("reply placement not usable");
    ASSERT_NE(at, std::string::npos) << log;
    EXPECT_EQ(log.find("reply placement not usable", at + 1), std::string::npos) << "warned twice:\n"
                                                                                  << log;
    EXPECT_NE(log.find(shm ? "outside the mapped region" : "only shm does"), std::string::npos)
        << log;
  }
}

// A raw worker of rank 1 for the SlowReceiver tests: connected (with
// `receive_buffer` as SO_RCVBUF when > 0) and past the handshake; frames of
// pulls it sends are made by pull_frame.
struct RawPullPeer {
  transport::testing::RawTcpPeer peer;
  std::uint64_t next_id = 0;
  Status connect(const std::string& address, int receive_buffer) {
    EMBER_TRY(peer.connect(address, receive_buffer));
    transport::handshake::Hello hello;
    hello.rank = 1;
    hello.session_id = 0x5107;
    EMBER_ASSIGN_OR_RETURN(auto reply, peer.handshake(hello));
    if (reply.status != ErrorCode::kOk) return make_error(reply.status, "{}", reply.text);
    return ok_status();
  }
  // One single frame holding a pull of `n` floats of `key`.
  std::vector<std::byte> pull_frame(std::uint64_t key, std::uint64_t n) {
    Header h = keyed(MsgType::kPull, key, n);
    h.worker_rank = 1;
    h.request_id = ++next_id;
    const auto message = proto::encode_message(h, {}, {});
    std::array<std::byte, wire::kSinglePrefixBytes> prefix;
    auto f = wire::encode_single(prefix, message);
    EXPECT_TRUE(f);
    std::vector<std::byte> out(f->prefix.begin(), f->prefix.end());
    out.insert(out.end(), message.begin(), message.end());
    out.insert(out.end(), f->padding.begin(), f->padding.end());
    return out;
  }
};

// A server for 2 workers, asp, with a 4 MiB queue per connection.
class SlowReceiver : public ::testing::Test {
 protected:
  void SetUp() override {
    spec.num_workers = 2;
    spec.consistency = "asp";
    server = std::make_unique<ServerProcess>(
        dir, spec, 0,
        std::vector<std::string>{"--set", "communication.max_message_size=4MB", "--set",
                                 "communication.max_queued_bytes=4MB"});
    ASSERT_TRUE(server->ok());
  }
  TempDir dir;
  ClusterSpec spec;
  std::unique_ptr<ServerProcess> server;
};

// A worker that sends requests but reads none of the replies: its send queue
// fills (max_queued_bytes), and a shard thread waiting for room served nobody
// else; the server waited 30 s per reply, for every reply, while the peer kept
// the connection alive (helper-82). Now, once no reply has left for twice
// heartbeat_timeout (2 s here), the connection is closed, logged once with the
// peer.
TEST_F(SlowReceiver, AWorkerThatReadsNoRepliesIsClosedAndTheOthersAreServed) {
  auto good = Worker::create(worker_config(spec, {server->address()}, 0));
  ASSERT_TRUE(good) << good.error().to_string();
  const std::uint64_t shape[] = {4};
  ASSERT_TRUE((*good)->init(1, shape, std::vector<float>{1, 2, 3, 4}).wait());

  // A small receive buffer; each pull of an unknown key is answered with an
  // error reply of a few hundred bytes, so 60,000 of them are far more than
  // the socket buffers and the 4 MiB queue hold.
  RawPullPeer raw;
  ASSERT_TRUE(raw.connect(server->address(), 4096));
  std::vector<std::byte> flood;
  for (int i = 0; i < 60000; ++i) {
    const auto f = raw.pull_frame(999, 4);
    flood.insert(flood.end(), f.begin(), f.end());
  }
  ASSERT_TRUE(raw.peer.send(flood));
  // The peer stays alive (a request every 200 ms, so heartbeat_timeout never
  // declares it silent) until the server closes it.
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    while (!stop.load() && raw.peer.send(raw.pull_frame(999, 4))) std::this_thread::sleep_for(200ms);
  });
  struct Join {
    std::atomic<bool>& stop;
    std::thread& t;
    ~Join() {
      stop.store(true);
      t.join();
    }
  } join{stop, trickle};
  // The well-behaved worker is served on the same shard within a few
  // heartbeat_timeouts (not after 30 s per queued reply).
  const auto began = std::chrono::steady_clock::now();
  std::vector<float> p(4);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE((*good)->push(1, std::vector<float>{0, 0, 0, 0}).wait());
    auto r = (*good)->pull(1, p).wait();
    ASSERT_TRUE(r) << r.error().to_string();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - began, 15s);
  const std::string log = server->log();
  const auto at = log.find("reads none of its replies");
  EXPECT_NE(at, std::string::npos) << log;
  EXPECT_NE(log.find("twice [communication] heartbeat_timeout); closing its connection"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("reads none of its replies", at + 1), std::string::npos) << "logged twice:\n" << log;
}

// The other side of it: a worker that reads its replies, but slowly (a slow
// link, big tensors), keeps its connection however long the server waits for
// room: bytes leave its queue, so it is backpressure, not a dead reader. Here
// 3.6 MB pull replies, each needing most of the 4 MiB queue free, go to a peer
// that reads about 1 MB/s for over twice heartbeat_timeout. (On loopback the
// kernel's socket buffers take much of each reply, so a single try of
// heartbeat_timeout passes this too: the progress rule is for links slower
// than that buffering; helper-84.)
TEST_F(SlowReceiver, AWorkerThatDrainsSlowlyIsWaitedFor) {
  constexpr std::uint64_t kFloats = 900'000;
  {
    auto w = Worker::create(worker_config(spec, {server->address()}, 0));
    ASSERT_TRUE(w) << w.error().to_string();
    const std::uint64_t shape[] = {kFloats};
    ASSERT_TRUE((*w)->init(7, shape, std::vector<float>(kFloats, 0.5f)).wait());
  }
  // Little kept in the kernel on the way: the queue drains at the read rate.
  RawPullPeer raw;
  ASSERT_TRUE(raw.connect(server->address(), 16 * 1024));
  auto& peer = raw.peer;
  constexpr int kPulls = 2;
  for (int i = 0; i < kPulls; ++i) ASSERT_TRUE(peer.send(raw.pull_frame(7, kFloats)));
  // 2 KiB every 2 ms (about 1 MB/s), and a small request every 100 ms so
  // that the server hears from the peer within its heartbeat_timeout.
  std::vector<std::byte> sink(2 * 1024);
  std::size_t got = 0;
  bool closed = false;
  const std::size_t want = kPulls * kFloats * sizeof(float);
  const auto until = std::chrono::steady_clock::now() + 30s;
  for (int tick = 0; !closed && got < want && std::chrono::steady_clock::now() < until; ++tick) {
    std::this_thread::sleep_for(2ms);
    if (tick % 50 == 0 && !peer.send(raw.pull_frame(999, 1))) closed = true;
    const ssize_t n = ::recv(peer.fd(), sink.data(), sink.size(), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) closed = true;
    if (n > 0) got += static_cast<std::size_t>(n);
  }
  EXPECT_FALSE(closed) << "the server closed a worker that was reading (" << got << " bytes read)";
  EXPECT_GE(got, want);
  EXPECT_EQ(server->log().find("reads none of its replies"), std::string::npos) << server->log();
}

TEST(BadRequestsBsp, PushForAClosedRoundIsStale) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_workers = 2;
  spec.loss_policy = "shrink";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto w = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_TRUE(w);
  const std::uint64_t shape[] = {2};
  ASSERT_TRUE((*w)->init(1, shape, std::vector<float>{1, 1}).wait());
  {
    RawClient gone(server.address(), 1);  // rank 1 connects and leaves: excluded
  }
  ASSERT_TRUE((*w)->push(1, std::vector<float>{1, 1}).wait());
  std::vector<float> p(2);
  ASSERT_TRUE((*w)->pull(1, p).wait());  // round 0 closed without rank 1
  RawClient late(server.address(), 1);
  late.send(keyed(MsgType::kPush, 1, 2, 0), {}, {5, 5});
  std::string text;
  auto h = late.reply(&text);
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, ErrorCode::kStale) << text;
  EXPECT_NE(text.find("pull to catch up"), std::string::npos) << text;
  EXPECT_EQ(h->step, 1u) << "the reply carries the server's step, where rank 1 continues";
  // The log line's header names the push as it came: step 0, not the server's.
  const std::string expected = "push key=1 chunk=0/1 step=0 rank=1";
  const auto logged = [&] { return server.log().find(expected) != std::string::npos; };
  for (int i = 0; i < 200 && !logged(); ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(logged()) << server.log();
}

TEST(BadRequestsAuth, WrongAuthTokenFailsAtOnceWithoutRetries) {
  TempDir dir;
  ClusterSpec spec;
  ServerProcess server(dir, spec, 0, {"--set", "communication.auth_token=right-secret"});
  ASSERT_TRUE(server.ok());
  auto cfg = worker_config(spec, {server.address()}, 0);
  cfg.communication.auth_token = "wrong-secret";
  cfg.worker.connect_retries = 20;  // with back-off this would take over 15 s if retried
  auto w = Worker::create(cfg);
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error().code(), ErrorCode::kAuth) << w.error().to_string();
  EXPECT_NE(w.error().message().find("attempt 1; not retried: a retry cannot cure"),
            std::string::npos)
      << w.error().to_string();
  EXPECT_NE(w.error().message().find("auth_token"), std::string::npos) << w.error().to_string();
  // The server saw exactly one attempt: stop it (its log is complete once it
  // exits) and count its refusals.
  server.process().signal(SIGTERM);
  ASSERT_TRUE(server.process().wait_exit());
  const std::string log = server.log();
  const std::string needle = "wrong auth token";
  std::size_t seen = 0;
  for (auto at = log.find(needle); at != std::string::npos; at = log.find(needle, at + 1)) ++seen;
  EXPECT_EQ(seen, 1u) << log;
}

// --- the daemon's command line ---

struct CliResult {
  int status = -1;
  std::string out, err;
};

CliResult run_cli(const TempDir& dir, const std::vector<std::string>& args) {
  const auto err = dir / "cli.err";
  std::filesystem::remove(err);
  Process p(server_binary(), args, err);
  while (p.wait_line("\x01", 10s)) {
  }
  CliResult r;
  auto st = p.wait_exit(10s);
  if (st && WIFEXITED(*st)) r.status = WEXITSTATUS(*st);
  for (const auto& l : p.lines()) r.out += l + "\n";
  r.err = read_file(err);
  return r;
}

TEST(ServerCli, CheckConfigAcceptsAValidFile) {
  TempDir dir;
  write_file(dir / "ok.toml", cluster_toml(ClusterSpec{}, {"127.0.0.1:7070"}));
  auto r = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--check-config"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("configuration is valid"), std::string::npos) << r.out;
}

TEST(ServerCli, CheckConfigRefusesBadFilesWithFileAndLine) {
  TempDir dir;
  struct Case {
    std::string name, text, needle;
  };
  const std::vector<Case> cases{
      {"syntax.toml", "[server]\nconsistency = \n", "syntax.toml:"},
      {"unknown.toml", "[server]\nconsistancy = \"bsp\"\n", "consistency"},
      {"value.toml", "[server]\nconsistency = \"eventual\"\n", "value.toml:2"},
      {"range.toml", "[cluster]\nnum_workers = 0\n", "num_workers"},
      {"index.toml", "[server]\nserver_index = 3\n", "server_index"},
      {"unit.toml", "[communication]\nflush_interval = \"20\"\n", "flush_interval"},
  };
  for (const auto& c : cases) {
    write_file(dir / c.name, c.text);
    auto r = run_cli(dir, {"--config", (dir / c.name).string(), "--check-config"});
    EXPECT_EQ(r.status, 1) << c.name << ": " << r.out << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << c.name << ": " << r.err;
  }
  // What start-up would refuse: a non-loopback listen address without a token.
  write_file(dir / "ok.toml", cluster_toml(ClusterSpec{}, {"127.0.0.1:7070"}));
  auto open_listen = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--listen",
                                   "0.0.0.0:7070", "--check-config"});
  EXPECT_EQ(open_listen.status, 1) << open_listen.out;
  EXPECT_NE(open_listen.err.find("listening on 0.0.0.0:7070 (not a loopback address) needs an "
                                 "auth token"),
            std::string::npos)
      << open_listen.err;
  // So do the rdma listener and "auto" (which listens with tcp); they used
  // to pass here and fail at start.
  for (const char* transport : {"auto", "rdma"}) {
    auto r = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--listen", "0.0.0.0:7070",
                           "--set", std::string("communication.transport=") + transport,
                           "--check-config"});
    EXPECT_EQ(r.status, 1) << transport << ": " << r.out;
    EXPECT_NE(r.err.find("(not a loopback address) needs an auth token"), std::string::npos)
        << transport << ": " << r.err;
  }
  // A listen host that does not resolve names the keys that give it.
  auto unresolved = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--listen",
                                  "listen.example.invalid:7070", "--check-config"});
  EXPECT_EQ(unresolved.status, 1) << unresolved.out;
  EXPECT_NE(unresolved.err.find("[server] listen"), std::string::npos) << unresolved.err;
  // --listen and --set server.listen both given: refused, not one silently
  // winning.
  auto both = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--listen", "127.0.0.1:7071",
                            "--set", "server.listen=127.0.0.1:7072", "--check-config"});
  EXPECT_EQ(both.status, 1) << both.out;
  EXPECT_NE(both.err.find("both give the listen address"), std::string::npos) << both.err;
  auto empty_listen = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--listen", "",
                                    "--check-config"});
  EXPECT_EQ(empty_listen.status, 1) << empty_listen.out;
  EXPECT_NE(empty_listen.err.find("--listen"), std::string::npos) << empty_listen.err;
  // A metrics_listen host that does not resolve: refused here, as at start
  // (it used to pass here and fail at start); a name that resolves is fine.
  auto bad_metrics = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--set",
                                   "server.metrics_listen=metrics.example.invalid:9100",
                                   "--check-config"});
  EXPECT_EQ(bad_metrics.status, 1) << bad_metrics.out;
  EXPECT_NE(bad_metrics.err.find("cannot resolve host 'metrics.example.invalid'"), std::string::npos)
      << bad_metrics.err;
  EXPECT_NE(bad_metrics.err.find("[server] metrics_listen"), std::string::npos) << bad_metrics.err;
  auto named_metrics = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--set",
                                     "server.metrics_listen=localhost:9100", "--check-config"});
  EXPECT_EQ(named_metrics.status, 0) << named_metrics.err;
  // A checkpoint_dir the start could not use (it used to pass here).
  write_file(dir / "afile", "x");
  for (const auto& [path, why] : std::vector<std::pair<std::string, std::string>>{
           {(dir / "afile").string(), "': is not a directory; point it at a writable directory"},
           {(dir / "afile" / "sub").string(),
            "': cannot be created: '" + (dir / "afile").string() + "' is not a directory"}}) {
    auto r = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--set",
                           "server.checkpoint_dir=" + path, "--check-config"});
    EXPECT_EQ(r.status, 1) << path << ": " << r.out;
    EXPECT_NE(r.err.find("[server] checkpoint_dir '" + path + why), std::string::npos) << r.err;
  }
  // A directory still to be made under a writable one is fine, and is not made.
  auto fresh = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--set",
                             "server.checkpoint_dir=" + (dir / "new" / "ckpt").string(),
                             "--check-config"});
  EXPECT_EQ(fresh.status, 0) << fresh.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "new"));
  // A recording in a missing directory (the start failed with "cannot
  // create"; --check-config used to pass it).
  const std::string record_in_missing = (dir / "no-such-dir" / "rec").string();
  auto no_dir = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--set",
                              "communication.record_pattern=true", "--set",
                              "communication.record_path=" + record_in_missing, "--check-config"});
  EXPECT_EQ(no_dir.status, 1) << no_dir.out;
  EXPECT_NE(no_dir.err.find("[communication] record_path '" + record_in_missing + "'"),
            std::string::npos)
      << no_dir.err;
  EXPECT_NE(no_dir.err.find("is not a directory"), std::string::npos) << no_dir.err;
  auto rec_ok = run_cli(dir, {"--config", (dir / "ok.toml").string(), "--set",
                              "communication.record_pattern=true", "--set",
                              "communication.record_path=" + (dir / "rec").string(),
                              "--check-config"});
  EXPECT_EQ(rec_ok.status, 0) << rec_ok.err;
  auto missing = run_cli(dir, {"--config", (dir / "nope.toml").string(), "--check-config"});
  EXPECT_EQ(missing.status, 1);
  EXPECT_NE(missing.err.find("nope.toml"), std::string::npos) << missing.err;
}

// server.shard_cpu_affinity is checked against the server's own affinity
// mask, by ember-server (--check-config and start), not when any process
// parses the file: a server under `taskset -c A` given shard CPU B refuses
// to start and says which CPU and which are allowed. (config_test: a worker
// pinned to A parses the same file.)
TEST(ServerCli, ShardCpusOutsideTheServersMaskAreRefusedByTheServer) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  std::vector<int> allowed;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) allowed.push_back(c);
  }
  if (allowed.size() < 2) GTEST_SKIP() << "needs 2 CPUs in this process's affinity mask";
  if (::access("/usr/bin/taskset", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/taskset (util-linux)";
  TempDir dir;
  ClusterSpec spec;
  spec.extra_server = fmt::format("shard_cpu_affinity = [{}]", allowed[1]);
  write_file(dir / "pinned.toml", cluster_toml(spec, {"127.0.0.1:1"}));
  const std::string needle = fmt::format(
      "key 'server.shard_cpu_affinity': CPU {} is not in this process's allowed CPUs ({}, set by "
      "taskset",
      allowed[1], allowed[0]);
  for (const bool check_only : {true, false}) {
    const auto err = dir / "pinned.err";
    std::filesystem::remove(err);
    std::vector<std::string> args{"-c", std::to_string(allowed[0]), server_binary(), "--config",
                                  (dir / "pinned.toml").string()};
    if (check_only) args.push_back("--check-config");
    Process p("/usr/bin/taskset", args, err);
    EXPECT_FALSE(p.wait_line("ember-server ready", 10s)) << "check_only=" << check_only;
    auto st = p.wait_exit(10s);
    ASSERT_TRUE(st && WIFEXITED(*st)) << "check_only=" << check_only;
    EXPECT_EQ(WEXITSTATUS(*st), 1) << "check_only=" << check_only;
    EXPECT_NE(read_file(err).find(needle), std::string::npos)
        << "check_only=" << check_only << ": " << read_file(err);
  }
  // Unpinned, the same file is valid.
  auto r = run_cli(dir, {"--config", (dir / "pinned.toml").string(), "--check-config"});
  EXPECT_EQ(r.status, 0) << r.err;
}

// A command line that does not parse exits 2 (1 is for a bad configuration),
// with CLI11's message naming the argument; --help exits 0.
TEST(ServerCli, UsageErrorsExitTwoNamingTheArgument) {
  TempDir dir;
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases{
      {{"--bogus"}, "--bogus"},
      {{"--listen"}, "--listen"},
      // Either would exit before the other: asking for both is a mistake.
      {{"--check-config", "--print-config"}, "excludes"},
      // The file without --config: named as such.
      {{"--check-config", "config/ember.toml"}, "give the config file with --config FILE"},
  };
  for (const auto& c : cases) {
    auto r = run_cli(dir, c.args);
    EXPECT_EQ(r.status, 2) << c.needle << ": " << r.out << r.err;
    EXPECT_NE((r.out + r.err).find(c.needle), std::string::npos) << r.out << r.err;
  }
  // An unknown option is not taken for a positional argument.
  auto bogus = run_cli(dir, {"--bogus"});
  EXPECT_EQ(bogus.err.find("positional"), std::string::npos) << bogus.err;
  auto help = run_cli(dir, {"--help"});
  EXPECT_EQ(help.status, 0) << help.err;
  EXPECT_NE(help.out.find("--check-config"), std::string::npos) << help.out;
}

TEST(ServerCli, PrintConfigShowsTheEffectiveConfigWithOverrides) {
  TempDir dir;
  auto r = run_cli(dir, {"--print-config", "--listen", "127.0.0.1:9999", "--set",
                         "optimizer.type=adam"});
  ASSERT_EQ(r.status, 0) << r.err;
  auto cfg = config::parse_config(r.out, "printed");
  ASSERT_TRUE(cfg) << cfg.error().to_string();
  EXPECT_EQ(cfg->optimizer.type, config::OptimizerType::kAdam);
  ASSERT_TRUE(cfg->server.listen);
  EXPECT_EQ(cfg->server.listen->port, 9999);
}

// systemd Type=notify: READY=1 once listening, WATCHDOG=1 every quarter of
// WATCHDOG_USEC, STOPPING=1 on SIGTERM. The test plays systemd's part with a
// datagram socket named by NOTIFY_SOCKET.
// A systemd notify socket in `dir`: the server started while it exists
// (NOTIFY_SOCKET, WATCHDOG_USEC set for that start only) sends it its states.
struct NotifyListener {
  int fd = -1;
  std::string path;
  explicit NotifyListener(const TempDir& dir) : path((dir / "notify.sock").string()) {
    fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    EXPECT_GE(fd, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::strncpy(sa.sun_path, path.c_str(), sizeof sa.sun_path - 1);
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  }
  ~NotifyListener() { ::close(fd); }
  std::unique_ptr<ServerProcess> start(const TempDir& dir, const std::string& watchdog_usec) {
    ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
    ::setenv("WATCHDOG_USEC", watchdog_usec.c_str(), 1);
    auto server = std::make_unique<ServerProcess>(dir, ClusterSpec{}, 0);
    ::unsetenv("NOTIFY_SOCKET");
    ::unsetenv("WATCHDOG_USEC");
    return server;
  }
  // The next message, "" after `wait` without one.
  std::string next(std::chrono::milliseconds wait = 10s) {
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(wait.count())) <= 0) return "";
    char buf[512];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : "";
  }
  bool wait_for(const std::string& state, int messages) {
    for (int i = 0; i < messages; ++i) {
      if (next().find(state) != std::string::npos) return true;
    }
    return false;
  }
};

TEST(ServerCli, NotifiesSystemdReadyWatchdogAndStopping) {
  TempDir dir;
  NotifyListener notify(dir);
  auto server = notify.start(dir, "200000");
  ASSERT_TRUE(server->ok());
  std::string got = notify.next();
  EXPECT_NE(got.find("READY=1"), std::string::npos) << got;
  EXPECT_TRUE(notify.wait_for("WATCHDOG=1", 20));
  server->process().signal(SIGTERM);
  EXPECT_TRUE(notify.wait_for("STOPPING=1", 40));
  auto status = server->process().wait_exit();
  ASSERT_TRUE(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
}

// A WATCHDOG_USEC of centuries used to overflow the signal loop's wait: it
// spun, flooding systemd with WATCHDOG=1 and never taking SIGTERM.
TEST(ServerCli, AHugeWatchdogIntervalNeitherSpinsNorIgnoresSigterm) {
  TempDir dir;
  NotifyListener notify(dir);
  auto server = notify.start(dir, "20000000000000000");
  ASSERT_TRUE(server->ok());
  EXPECT_NE(notify.next().find("READY=1"), std::string::npos);
  int pings = 0;
  for (std::string m = notify.next(500ms); !m.empty(); m = notify.next(500ms)) {
    pings += m.find("WATCHDOG=1") != std::string::npos ? 1 : 0;
    if (pings > 10) break;
  }
  EXPECT_EQ(pings, 0);
  server->process().signal(SIGTERM);
  auto status = server->process().wait_exit(20s);
  ASSERT_TRUE(status) << "SIGTERM did not stop the server";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
}

// Ctrl-C in a terminal reaches the whole process group, and the script
// that started the server then sends SIGTERM too (scripts/demo.sh does):
// one orderly stop, final checkpoint and exit 0, not the forced exit a later
// repeat gets.
TEST(ServerCli, SigintThenSigtermAtOnceIsOneOrderlyStop) {
  TempDir dir;
  ClusterSpec spec;
  spec.checkpoint_dir = (dir / "ckpt").string();
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  server.process().signal(SIGINT);
  server.process().signal(SIGTERM);
  auto status = server.process().wait_exit(30s);
  ASSERT_TRUE(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << server.log();
  EXPECT_EQ(server.log().find("exiting now, without the final checkpoint"), std::string::npos)
      << server.log();
}

// With the log off, a failed start still says why on stderr.
TEST(ServerCli, AFailedStartIsNeverSilent) {
  TempDir dir;
  ServerProcess first(dir, ClusterSpec{}, 0);
  ASSERT_TRUE(first.ok());
  write_file(dir / "off.toml", cluster_toml(ClusterSpec{}, {first.address()}));
  auto r = run_cli(dir, {"--config", (dir / "off.toml").string(), "--set",
                         "server.log_level=off"});
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("cannot start"), std::string::npos) << r.err;
}

// The file descriptors process `pid` has open.
std::ptrdiff_t open_descriptors(pid_t pid) {
  return std::distance(std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid)),
                       std::filesystem::directory_iterator{});
}

// Connections to 127.0.0.1:port (the kernel completes them from the listen
// backlog whether or not the server accepts); -1 entries where connect failed.
std::vector<int> open_connections(const std::string& address, int n) {
  const auto colon = address.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1))));
  ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
      ::close(fd);
      fds.push_back(-1);
      continue;
    }
    fds.push_back(fd);
  }
  return fds;
}

// Running out of file descriptors once (a burst of scrapers, a leak
// elsewhere) makes accept fail with EMFILE. The metrics endpoint used to
// stop accepting for good after that, so a liveness probe on /metrics
// would kill a healthy server; both listeners now retry and say so once.
TEST(ServerMetrics, EndpointAndListenerRecoverAfterDescriptorsRunOut) {
#if defined(__SANITIZE_ADDRESS__)
  // The asan preset is ASan+UBSan. UBSan's vptr check probes memory through
  // a pipe; with no descriptor left it takes every object for a bad one
  // ("invalid vptr", "memory cannot be printed") and aborts the server.
  GTEST_SKIP() << "UBSan cannot check vptrs in a process out of file descriptors";
#endif
  TempDir dir;
  ClusterSpec spec;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  const pid_t pid = server.process().pid();
  const auto in_use = open_descriptors(pid);
  rlimit original{};
  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, nullptr, &original), 0);
  const rlimit tight{static_cast<rlim_t>(in_use + 4), original.rlim_max};
  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, &tight, nullptr), 0) << std::strerror(errno);
  // More connections than the server has descriptors left, on both ports.
  auto flood = open_connections(server.metrics_address(), 24);
  auto data_flood = open_connections(server.address(), 24);
  const auto said = [&](const char* what) {
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (server.log().find(what) == std::string::npos) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(20ms);  // polling the log file against a deadline
    }
    return true;
  };
  ASSERT_TRUE(said("metrics endpoint: cannot accept a connection")) << server.log();
  const std::string listener_said =
      fmt::format("listener {}: cannot accept a connection (Too many open files)", server.address());
  EXPECT_TRUE(said(listener_said.c_str())) << server.log();
  for (auto* fds : {&flood, &data_flood}) {
    for (const int fd : *fds) {
      if (fd >= 0) ::close(fd);
    }
  }
  // The descriptors come back as the server sees the closes; the endpoint
  // serves again within a few retries (the limit stays tight).
  std::string text;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (text.find("200 OK") == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    text = http_get(server.metrics_address(), "/metrics");
  }
  EXPECT_NE(text.find("200 OK"), std::string::npos) << server.log();
  // And a worker can join and train once the limit is back.
  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, &original, nullptr), 0);
  auto w = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_TRUE(w) << w.error().to_string();
  const std::uint64_t shape[] = {4};
  ASSERT_TRUE((*w)->init(1, shape, std::vector<float>{1, 2, 3, 4}).wait());
  std::vector<float> p(4);
  ASSERT_TRUE((*w)->push_pull(1, std::vector<float>{1, 1, 1, 1}, p).wait());
}

TEST(ServerMetrics, EndpointServesPrometheusText) {
  TempDir dir;
  ClusterSpec spec;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto w = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_TRUE(w);
  const std::uint64_t shape[] = {4};
  ASSERT_TRUE((*w)->init(1, shape, std::vector<float>{1, 2, 3, 4}).wait());
  std::vector<float> p(4);
  ASSERT_TRUE((*w)->push_pull(1, std::vector<float>{1, 1, 1, 1}, p).wait());
  const std::string text = http_get(server.metrics_address(), "/metrics");
  EXPECT_NE(text.find("200 OK"), std::string::npos) << text;
  EXPECT_NE(text.find("text/plain; version=0.0.4"), std::string::npos);
  for (const char* name :
       {"ember_server_bytes_received_total", "ember_server_frames_sent_total", "ember_server_batch_fill_ratio",
        "ember_server_shard_ring_items{shard=\"0\"}", "ember_server_request_latency_us_bucket",
        "ember_pool_bytes_in_use", "ember_server_bad_messages_total",
        "ember_server_checksum_failures_total", "ember_server_workers_connected 1",
        "ember_server_worker_step{rank=\"0\"}"}) {
    EXPECT_NE(text.find(name), std::string::npos) << name << " missing in:\n" << text;
  }
  // One histogram per request type; the push_pull above is counted as one
  // (it was counted as a pull, so a job of push_pulls showed no pushes).
  for (const char* line : {"ember_server_request_latency_us_count{type=\"push_pull\"} 1",
                           "ember_server_request_latency_us_count{type=\"push\"} 0",
                           "ember_server_request_latency_us_count{type=\"pull\"} 0"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " missing in:\n" << text;
  }
  EXPECT_NE(http_get(server.metrics_address(), "/nope").find("404"), std::string::npos);
  // A refused push (out of step: the server is at step 1) names a step the
  // rank never reached; the step gauge stays at the last recorded push's.
  auto refused = (*w)->push(1, std::vector<float>{1, 1, 1, 1}, 1000).wait();
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code(), ErrorCode::kOutOfStep) << refused.error().to_string();
  const std::string after = http_get(server.metrics_address(), "/metrics");
  EXPECT_NE(after.find("ember_server_worker_step{rank=\"0\"} 0\n"), std::string::npos) << after;
}

// Prometheus jobs with `params:` add a query string, probes send HEAD, and
// a wrong method is 405 (it used to be 404 for all of these).
TEST(ServerMetrics, RoutesByPathAnswersHeadAndNamesTheMethods) {
  TempDir dir;
  ServerProcess server(dir, ClusterSpec{}, 0);
  ASSERT_TRUE(server.ok());
  const std::string& m = server.metrics_address();
  EXPECT_NE(http_get(m, "/metrics?collect=all").find("200 OK"), std::string::npos);
  EXPECT_NE(http_get(m, "http://" + m + "/metrics").find("200 OK"), std::string::npos);
  const std::string head = http_request(m, "HEAD", "/metrics");
  EXPECT_NE(head.find("200 OK"), std::string::npos) << head;
  EXPECT_NE(head.find("Content-Length: "), std::string::npos) << head;
  EXPECT_EQ(head.find("ember_server_"), std::string::npos) << "HEAD sent a body:\n" << head;
  const std::string post = http_request(m, "POST", "/metrics");
  EXPECT_NE(post.find("405"), std::string::npos) << post;
  EXPECT_NE(post.find("Allow: GET, HEAD"), std::string::npos) << post;
  const std::string get_checkpoint = http_get(m, "/checkpoint");
  EXPECT_NE(get_checkpoint.find("405"), std::string::npos) << get_checkpoint;
  EXPECT_NE(get_checkpoint.find("Allow: POST"), std::string::npos) << get_checkpoint;
  EXPECT_NE(http_get(m, "/nope").find("404"), std::string::npos);
  // A HEAD is answered without a body whatever the status.
  const std::string head_404 = http_request(m, "HEAD", "/nope");
  EXPECT_NE(head_404.find("404"), std::string::npos) << head_404;
  EXPECT_EQ(head_404.find("not found;"), std::string::npos) << head_404;
}

// A client that sends "Expect: 100-continue" and waits before sending its
// body (curl does past 1 KiB) gets the final answer at once: no route needs
// a body. It waited for the session's timeout before.
TEST(ServerMetrics, ExpectContinueIsAnsweredWithoutWaitingForTheBody) {
  TempDir dir;
  ServerProcess server(dir, ClusterSpec{}, 0);
  ASSERT_TRUE(server.ok());
  const std::string& m = server.metrics_address();
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(std::stoi(m.substr(m.rfind(':') + 1))));
  ::inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  const std::string head = fmt::format(
      "POST /checkpoint HTTP/1.1\r\nHost: {}\r\nExpect: 100-continue\r\nContent-Length: 2000\r\n\r\n", m);
  ASSERT_EQ(::write(fd, head.data(), head.size()), static_cast<ssize_t>(head.size()));
  std::string got;
  char buf[1024];
  pollfd pfd{fd, POLLIN, 0};
  if (::poll(&pfd, 1, 3000) > 0) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) got.assign(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  // Checkpoints are off here: 409, at once.
  EXPECT_NE(got.find("HTTP/1.1 409"), std::string::npos) << "within 3 s: '" << got << "'";
  EXPECT_EQ(got.find("100 Continue"), std::string::npos) << got;
}

// POST /checkpoint makes the server write and fsync a snapshot: with a token
// configured it needs that token (the deploy files listen on 0.0.0.0).
TEST(ServerMetrics, CheckpointOverHttpNeedsTheJobsToken) {
  TempDir dir;
  ClusterSpec spec;
  spec.checkpoint_dir = (dir / "ckpt").string();
  ServerProcess server(dir, spec, 0, {"--set", "communication.auth_token=s3cret"});
  ASSERT_TRUE(server.ok());
  const std::string& m = server.metrics_address();
  const std::string none = http_request(m, "POST", "/checkpoint");
  EXPECT_NE(none.find("401"), std::string::npos) << none;
  EXPECT_NE(none.find("auth_token"), std::string::npos) << none;
  const std::string wrong = http_request(m, "POST", "/checkpoint", "Authorization: Bearer s3cre\r\n");
  EXPECT_NE(wrong.find("401"), std::string::npos) << wrong;
  const std::string right = http_request(m, "POST", "/checkpoint", "Authorization: Bearer s3cret\r\n");
  EXPECT_NE(right.find("200 OK"), std::string::npos) << right;
  EXPECT_NE(right.find("sequence "), std::string::npos) << right;
  // The scheme's case does not matter, nor extra spaces (RFC 7235 2.1); the
  // token's does, and another scheme is refused.
  const std::string lower = http_request(m, "POST", "/checkpoint", "Authorization: bearer  s3cret\r\n");
  EXPECT_NE(lower.find("200 OK"), std::string::npos) << lower;
  const std::string upper_token = http_request(m, "POST", "/checkpoint", "Authorization: Bearer S3CRET\r\n");
  EXPECT_NE(upper_token.find("401"), std::string::npos) << upper_token;
  const std::string basic = http_request(m, "POST", "/checkpoint", "Authorization: Basic s3cret\r\n");
  EXPECT_NE(basic.find("401"), std::string::npos) << basic;
  // Scrapes need no token.
  EXPECT_NE(http_get(m, "/metrics").find("200 OK"), std::string::npos);
}

// Idle clients cannot hold every descriptor, nor keep a scrape out: at 64
// open connections the oldest idle one makes room for a new one.
TEST(ServerMetrics, IdleClientsNeitherPileUpNorKeepAScrapeOut) {
  TempDir dir;
  ServerProcess server(dir, ClusterSpec{}, 0);
  ASSERT_TRUE(server.ok());
  const auto open_fds = [&] { return open_descriptors(server.process().pid()); };
  const auto before = open_fds();
  std::vector<int> idle = open_connections(server.metrics_address(), 200);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string scrape = http_get(server.metrics_address(), "/metrics");
  EXPECT_NE(scrape.find("200 OK"), std::string::npos) << scrape.substr(0, 200);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  // 64 sessions, and a few closed ones the kernel has not reaped yet.
  EXPECT_LE(open_fds(), before + 64 + 8);
  for (int fd : idle) {
    if (fd >= 0) ::close(fd);
  }
  EXPECT_NE(server.log().find("connections are open; closing the oldest"), std::string::npos)
      << server.log();
}

// A refused join still brought its bytes and messages: they stay in the
// totals once its connection is gone (they were dropped with it, so the
// counters lagged until other traffic caught up).
TEST(ServerMetrics, ARefusedConnectionsTrafficStaysCounted) {
  TempDir dir;
  ClusterSpec spec;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto w = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_TRUE(w);
  const auto scrape = [&](const char* name) {
    return metric_value(http_get(server.metrics_address(), "/metrics"), name);
  };
  const long messages_before = scrape("ember_server_messages_received_total");
  const long bytes_before = scrape("ember_server_bytes_received_total");
  // Rank 0 again, while the first is connected: refused at its join.
  auto twin = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_FALSE(twin);
  ASSERT_NE(twin.error().to_string().find("already connected"), std::string::npos)
      << twin.error().to_string();
  // The server handles the close asynchronously. No scrape until it has
  // (a scrape of the live connection would raise the counters, and they
  // never go down): then its traffic counts through closed connections only.
  std::this_thread::sleep_for(1s);
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (scrape("ember_server_messages_received_total") < messages_before + 1 &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_GE(scrape("ember_server_messages_received_total"), messages_before + 1);
  EXPECT_GT(scrape("ember_server_bytes_received_total"), bytes_before);
}

}  // namespace
}  // namespace ember::test
