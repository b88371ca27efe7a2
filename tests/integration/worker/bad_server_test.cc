// The worker facing a server that breaks the protocol: a fake server in this
// process (Ember's own transport and message encoders, 127.0.0.1) answers
// the worker's requests as a test tells it to. A reply that does not answer
// the request it names, a message that does not decode, or an error text
// with control bytes must give the caller a clear kProtocol (or the escaped
// text), never data of another kind in its tensor; requests that time out
// must not pile up while such a server stays connected.
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/config/config.h"
#include "common/proto/message.h"
#include "common/transport/transport.h"
#include "worker/worker.h"

namespace ember {
namespace {

using namespace std::chrono_literals;
using proto::Header;
using proto::MsgType;

// What the fake server sends for one request: the messages, already encoded.
using Messages = std::vector<std::vector<std::byte>>;
using Answer = std::function<Messages(const proto::MessageView&)>;

std::vector<std::byte> reply_to(const Header& request, std::span<const std::byte> body = {}) {
  return proto::encode_message(proto::reply_header(request), {}, body);
}

// The join reply of a one-server, one-worker asp job, as a real server sends it.
std::vector<std::byte> good_join(const Header& request) {
  proto::JoinReplyBody rb{};
  rb.num_workers = 1;
  rb.num_servers = 1;
  rb.server_index = 0;
  rb.consistency = static_cast<std::uint8_t>(proto::Consistency::kAsp);
  rb.num_shards = 1;
  const auto body = proto::encode_body(rb);
  return reply_to(request, body);
}

// A pull reply of `n` float32 values `v`.
std::vector<std::byte> values_reply(Header h, std::uint64_t n, float v) {
  h.num_elements = n;
  h.dtype = proto::DType::kFloat32;
  const std::vector<float> values(n, v);
  return proto::encode_message(h, {}, std::as_bytes(std::span<const float>(values)));
}

class FakeServer {
 public:
  // `answer_pull` answers pulls; joins, inits and pushes get a good reply.
  explicit FakeServer(Answer answer_pull, Answer answer_join = {})
      : answer_pull_(std::move(answer_pull)), answer_join_(std::move(answer_join)) {
    transport::Options o;
    o.kind = transport::Kind::kTcp;
    o.num_channels = 1;
    auto t = transport::Transport::create(o);
    EXPECT_TRUE(t) << t.error().to_string();
    transport_ = std::move(*t);
    transport::Handlers h;
    h.on_message = [this](transport::Connection& c, transport::Incoming&& msg) {
      auto m = proto::decode(msg.bytes);
      if (!m) return;
      for (const auto& bytes : answer(m->header, *m)) {
        (void)c.send(msg.channel, bytes);
        (void)c.flush(msg.channel);
      }
    };
    h.on_closed = [](transport::Connection&, const Error&) {};
    auto l = transport_->listen(
        "127.0.0.1:0", {transport::Role::kServer, 0},
        [this](std::shared_ptr<transport::Connection> c) {
          std::lock_guard lock(mutex_);
          connections_.push_back(std::move(c));
        },
        h);
    EXPECT_TRUE(l) << l.error().to_string();
    listener_ = std::move(*l);
  }
  ~FakeServer() {
    listener_.reset();
    transport_.reset();
  }
  std::string address() const { return listener_->address(); }

  // A worker of a one-worker asp job at this server.
  Result<std::unique_ptr<Worker>> worker(std::chrono::milliseconds request_timeout = 3000ms) {
    auto c = config::parse_config(
        fmt::format("[communication]\nprealloc_pages = 4\npool_backing = \"plain\"\nchannels = 1\n"
                    "[cluster]\nservers = [\"{}\"]\nnum_workers = 1\n[server]\nconsistency = "
                    "\"asp\"\n[worker]\nrequest_timeout = \"{}ms\"\nconnect_timeout = \"1s\"\n"
                    "connect_retries = 1\nresend_attempts = 0\n",
                    address(), request_timeout.count()),
        "bad_server_test");
    EXPECT_TRUE(c) << c.error().to_string();
    return Worker::create(*c);
  }

 private:
  Messages answer(const Header& h, const proto::MessageView& m) {
    switch (h.type) {
      case MsgType::kJoin:
        return answer_join_ ? answer_join_(m) : Messages{good_join(h)};
      case MsgType::kPull:
      case MsgType::kPushPull:
        return answer_pull_(m);
      default:
        return {reply_to(h)};
    }
  }

  Answer answer_pull_;
  Answer answer_join_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::Listener> listener_;
  std::mutex mutex_;
  std::vector<std::shared_ptr<transport::Connection>> connections_;
};

constexpr std::uint64_t kKey = 1;
constexpr std::uint64_t kShape[] = {8};

// Inits key 1 (8 floats), then pulls it into a buffer of -42s followed by
// 8 more -42s: the pull's result, and whether nothing was written.
struct PullOutcome {
  Result<std::uint64_t> result = tl::unexpected(Error());
  bool untouched = false;
};
PullOutcome pull_once(Worker& w) {
  PullOutcome out;
  EXPECT_TRUE(w.init(kKey, kShape, std::vector<float>(8, 0.5f)).wait());
  std::vector<float> buffer(16, -42.0f);
  out.result = w.pull(kKey, std::span<float>(buffer).first(8)).wait();
  out.untouched = std::all_of(buffer.begin(), buffer.end(), [](float v) { return v == -42.0f; });
  return out;
}

// A worker of `server` pulls once: the pull fails with kProtocol, its
// message holds `needle`, and nothing was written.
void expect_protocol_error(FakeServer& server, const std::string& needle) {
  auto w = server.worker();
  ASSERT_TRUE(w) << w.error().to_string();
  const PullOutcome r = pull_once(**w);
  ASSERT_FALSE(r.result);
  EXPECT_EQ(r.result.error().code(), ErrorCode::kProtocol) << r.result.error().to_string();
  EXPECT_NE(r.result.error().message().find(needle), std::string::npos)
      << r.result.error().to_string();
  EXPECT_TRUE(r.untouched);
}

TEST(WorkerBadServer, AReplyOfAnotherTypeIsAProtocolErrorAndWritesNothing) {
  FakeServer server([](const proto::MessageView& m) {
    Header h = proto::reply_header(m.header);
    h.type = MsgType::kPush;  // a push's reply to a pull
    return Messages{proto::encode_message(h, {}, {})};
  });
  expect_protocol_error(server, "does not answer the request");
}

TEST(WorkerBadServer, APullReplyOfAnotherKeyOrDtypeIsRefused) {
  struct Case {
    const char* name;
    std::function<void(Header&)> change;
  };
  const std::vector<Case> cases{
      {"another key", [](Header& h) { h.key += 1; }},
      {"another chunk",
       [](Header& h) {
         h.chunk_index += 1;
         h.num_chunks = h.chunk_index + 1;
       }},
      // The same bytes as 16 float16 values.
      {"float16", [](Header& h) { h.dtype = proto::DType::kFloat16; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    FakeServer server([&](const proto::MessageView& m) {
      Header h = proto::reply_header(m.header);
      h.dtype = proto::DType::kFloat32;  // well-formed, as a real pull reply
      c.change(h);
      const std::uint64_t n = h.dtype == proto::DType::kFloat16 ? 16 : 8;
      std::vector<float> values(8, 7.0f);
      h.num_elements = n;
      return Messages{
          proto::encode_message(h, {}, std::as_bytes(std::span<const float>(values)))};
    });
    expect_protocol_error(server, "does not answer the request");
  }
}

TEST(WorkerBadServer, AJoinAnsweredWithAnotherTypeFailsCreate) {
  FakeServer server(
      [](const proto::MessageView& m) {
        return Messages{values_reply(proto::reply_header(m.header), 8, 1.0f)};
      },
      [](const proto::MessageView& m) {
                      Header h = proto::reply_header(m.header);
                      h.type = MsgType::kBarrier;
                      return Messages{proto::encode_message(h, {}, {})};
                    });
  auto w = server.worker();
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error().code(), ErrorCode::kProtocol) << w.error().to_string();
}

// A reply that does not answer its request breaks the protocol for the
// whole connection: the other requests waiting on it fail with kProtocol at
// once, rather than trusting (or timing out on) the replies that follow.
TEST(WorkerBadServer, AMismatchedReplyClosesTheConnectionForEveryWaitingCall) {
  std::optional<Header> first;
  FakeServer server([&](const proto::MessageView& m) {
    if (!first) {  // held until the second pull is in
      first = m.header;
      return Messages{};
    }
    Header h = proto::reply_header(*first);
    h.key += 1;
    return Messages{values_reply(h, 8, 7.0f)};
  });
  auto w = server.worker(5000ms);
  ASSERT_TRUE(w) << w.error().to_string();
  ASSERT_TRUE((*w)->init(kKey, kShape, std::vector<float>(8, 0.5f)).wait());
  std::vector<float> a(8, -42.0f), b(8, -42.0f);
  Handle pa = (*w)->pull(kKey, a);
  Handle pb = (*w)->pull(kKey, b);
  const auto t0 = std::chrono::steady_clock::now();
  auto ra = pa.wait();
  auto rb = pb.wait();
  ASSERT_FALSE(ra);
  ASSERT_FALSE(rb);
  EXPECT_EQ(ra.error().code(), ErrorCode::kProtocol) << ra.error().to_string();
  EXPECT_NE(ra.error().message().find("does not answer the request"), std::string::npos)
      << ra.error().to_string();
  EXPECT_EQ(rb.error().code(), ErrorCode::kProtocol) << rb.error().to_string();
  EXPECT_NE(rb.error().message().find("the connection was closed"), std::string::npos)
      << rb.error().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s);  // not the 5 s request_timeout
  EXPECT_TRUE(std::all_of(a.begin(), a.end(), [](float v) { return v == -42.0f; }));
  EXPECT_TRUE(std::all_of(b.begin(), b.end(), [](float v) { return v == -42.0f; }));
}

// A reply naming a request id this worker never issued, or a step no run
// reaches (it would become the key's step), is a protocol break.
TEST(WorkerBadServer, AReplyWithAnUnissuedIdOrAnImpossibleStepIsRefused) {
  struct Case {
    const char* name;
    std::function<void(Header&)> change;
    const char* needle;
  };
  const std::vector<Case> cases{
      {"unissued id", [](Header& h) { h.request_id = std::uint64_t{1} << 40; },
       "which this worker never issued"},
      {"step", [](Header& h) { h.step = std::uint64_t{1} << 60; },
       "above the largest a run reaches"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    FakeServer server([&](const proto::MessageView& m) {
      Header h = proto::reply_header(m.header);
      c.change(h);
      return Messages{values_reply(h, 8, 7.0f)};
    });
    expect_protocol_error(server, c.needle);
  }
}

// The join reply's counts are the server's [cluster] table: a server that
// accepts this worker's join yet answers other counts would map keys
// differently.
TEST(WorkerBadServer, AJoinReplyWithOtherCountsFailsCreate) {
  FakeServer server(
      [](const proto::MessageView& m) {
        return Messages{values_reply(proto::reply_header(m.header), 8, 1.0f)};
      },
      [](const proto::MessageView& m) {
        proto::JoinReplyBody rb{};
        rb.num_workers = 2;  // the worker's config says 1
        rb.num_servers = 1;
        rb.consistency = static_cast<std::uint8_t>(proto::Consistency::kAsp);
        rb.num_shards = 1;
        const auto body = proto::encode_body(rb);
        return Messages{reply_to(m.header, body)};
      });
  auto w = server.worker();
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error().code(), ErrorCode::kProtocol) << w.error().to_string();
  EXPECT_NE(w.error().message().find("answered num_workers 2"), std::string::npos)
      << w.error().to_string();
}

// A message that is not a reply at all: the waiting requests fail with what
// the server did, not with the bare "closed" of the close that follows.
TEST(WorkerBadServer, ARequestFromTheServerFailsTheWaitingCallsNamingIt) {
  FakeServer server([](const proto::MessageView& m) {
    Header h = m.header;  // echoed as is: a request, not a reply
    return Messages{proto::encode_message(h, {}, {})};
  });
  expect_protocol_error(server, "broke the protocol: it sent a request");
}

// A NUL would end the text early for a C caller (ember_last_error).
TEST(WorkerBadServer, ControlBytesInAnErrorTextAreEscaped) {
  FakeServer server([](const proto::MessageView& m) {
    Header h = proto::reply_header(m.header);
    h.status = ErrorCode::kInternal;
    const std::string text("before\0after\n", 13);
    return Messages{proto::encode_message(h, {}, std::as_bytes(std::span(text)))};
  });
  auto w = server.worker();
  ASSERT_TRUE(w) << w.error().to_string();
  const PullOutcome r = pull_once(**w);
  ASSERT_FALSE(r.result);
  EXPECT_EQ(r.result.error().code(), ErrorCode::kInternal);
  EXPECT_NE(r.result.error().message().find("before\\x00after\\x0a"), std::string::npos)
      << r.result.error().message();
}

// A server that stays connected (heartbeats) but never answers: each pull
// times out, and its request leaves the worker's table rather than staying
// until the connection ends.
// (A request_timeout well above the sweep's 0.5 s: the sweep must not wait
// for the next timeout or request_timeout to come round.)
TEST(WorkerBadServer, TimedOutRequestsDoNotPileUpWhileTheServerStaysConnected) {
  FakeServer server([](const proto::MessageView&) { return Messages{}; });
  auto w = server.worker(3000ms);
  ASSERT_TRUE(w) << w.error().to_string();
  ASSERT_TRUE((*w)->init(kKey, kShape, std::vector<float>(8, 0.5f)).wait());
  std::vector<std::vector<float>> buffers(50, std::vector<float>(8));
  std::vector<Handle> pulls;
  for (auto& b : buffers) pulls.push_back((*w)->pull(kKey, b));
  for (Handle& h : pulls) {
    auto r = h.wait();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code(), ErrorCode::kTimeout) << r.error().to_string();
  }
  const auto t0 = std::chrono::steady_clock::now();
  while ((*w)->pending_requests() != 0 && std::chrono::steady_clock::now() - t0 < 10s) {
    std::this_thread::sleep_for(20ms);
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ((*w)->pending_requests(), 0u);
  // About 0.5 s (worker.h); loose for a loaded machine, well below the 3 s
  // the next wake-up would take.
  EXPECT_LT(took, 2s) << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                      << " ms";
}

}  // namespace
}  // namespace ember
