// The tune probe against its sink on 127.0.0.1 (a real socket pair), and
// its refusal of a peer that is not a sink.
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include <gtest/gtest.h>

#include "tools/emberctl/probe.h"

namespace ember::emberctl {
namespace {

using namespace std::chrono_literals;

// A listening TCP socket on 127.0.0.1 (any free port, in `a`); -1 on failure.
int loopback_listener(sockaddr_in& a) {
  const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (lfd < 0) return -1;
  a = sockaddr_in{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(lfd, 1) != 0 ||
      ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(lfd);
    return -1;
  }
  return lfd;
}

TEST(Probe, MeasuresRttAndBandwidthAgainstTheSink) {
  auto sink = ProbeSink::listen("127.0.0.1:0");
  ASSERT_TRUE(sink) << sink.error().to_string();
  Status served;
  std::thread t([&] { served = (*sink)->serve(1); });
  auto r = run_probe((*sink)->address(), 20, 20ms, 10s);
  t.join();
  ASSERT_TRUE(r) << r.error().to_string();
  EXPECT_TRUE(served) << served.error().to_string();
  EXPECT_EQ(r->pings, 20u);
  EXPECT_GT(r->rtt.count(), 0);
  EXPECT_LE(r->rtt_min, r->rtt);
  EXPECT_GE(r->bulk_bytes, 4u << 20);
  EXPECT_GT(r->bandwidth_bytes_per_s, 0.0);
  // Sanity, not timing: the bandwidth is the bytes over the measured time.
  EXPECT_NEAR(r->bandwidth_bytes_per_s,
              static_cast<double>(r->bulk_bytes) / (static_cast<double>(r->bulk_time.count()) / 1e9),
              r->bandwidth_bytes_per_s * 1e-9);
}

TEST(Probe, RefusesBadArgumentsAndMissingSink) {
  EXPECT_FALSE(run_probe("127.0.0.1:1", 0, 1s, 1s));
  EXPECT_FALSE(run_probe("127.0.0.1:1", 1, 0s, 1s));
  EXPECT_FALSE(run_probe("no-port", 1, 1s, 1s));
  // A listener nobody serves beyond accept: port 1 on loopback is closed.
  auto r = run_probe("127.0.0.1:1", 1, 1s, 1s);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("probe-sink"), std::string::npos) << r.error().message();
}

TEST(Probe, PeerThatIsNotASinkIsAProtocolOrTimeoutError) {
  // A plain TCP listener that accepts and answers the magic with junk.
  sockaddr_in a{};
  const int lfd = loopback_listener(a);
  ASSERT_GE(lfd, 0);
  std::thread t([lfd] {
    const int c = ::accept(lfd, nullptr, nullptr);
    char buf[72];
    std::size_t got = 0;
    while (got < sizeof buf) {  // magic + one ping
      const ssize_t n = ::recv(c, buf + got, sizeof buf - got, 0);
      if (n <= 0) break;
      got += static_cast<std::size_t>(n);
    }
    char junk[64] = {};
    (void)::send(c, junk, sizeof junk, MSG_NOSIGNAL);
    ::close(c);
  });
  auto r = run_probe("127.0.0.1:" + std::to_string(ntohs(a.sin_port)), 3, 10ms, 5s);
  t.join();
  ::close(lfd);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kProtocol) << r.error().to_string();
  EXPECT_NE(r.error().message().find("not a probe sink"), std::string::npos);
}

TEST(Probe, APeerTricklingItsAnswerCannotStretchTheTimeout) {
  // Accepts, reads the hello and a ping, then answers one byte every 100 ms:
  // each recv() gets a byte well within the timeout, the ping's round trip
  // does not (64 bytes would take 6.4 s).
  sockaddr_in a{};
  const int lfd = loopback_listener(a);
  ASSERT_GE(lfd, 0);
  std::atomic<bool> stop{false};
  std::thread t([lfd, &stop] {
    const int c = ::accept(lfd, nullptr, nullptr);
    char buf[72];
    std::size_t got = 0;
    while (got < sizeof buf) {
      const ssize_t n = ::recv(c, buf + got, sizeof buf - got, 0);
      if (n <= 0) break;
      got += static_cast<std::size_t>(n);
    }
    for (int i = 0; i < 64 && !stop; ++i) {
      const char b = i == 0 ? 'P' : 'p';
      if (::send(c, &b, 1, MSG_NOSIGNAL) != 1) break;
      std::this_thread::sleep_for(100ms);
    }
    ::close(c);
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_probe("127.0.0.1:" + std::to_string(ntohs(a.sin_port)), 1, 10ms, 500ms);
  const auto took = std::chrono::steady_clock::now() - t0;
  stop = true;
  t.join();
  ::close(lfd);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kTimeout) << r.error().to_string();
  // A bound, not a timing: trickled to the end it would take 6.4 s.
  EXPECT_LT(took, 4s);
}

TEST(Probe, ABusySinkIsNamedAsTheLikelyCause) {
  auto sink = ProbeSink::listen("127.0.0.1:0");
  ASSERT_TRUE(sink) << sink.error().to_string();
  // An idle client holds the sink (it serves one at a time).
  const std::string addr = (*sink)->address();
  const int idle = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1))));
  ASSERT_EQ(::connect(idle, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  std::thread t([&] { (void)(*sink)->serve(2); });
  auto r = run_probe(addr, 1, 10ms, 300ms);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kTimeout) << r.error().to_string();
  EXPECT_NE(r.error().message().find("serves one client at a time"), std::string::npos)
      << r.error().message();
  ::close(idle);  // the sink drops it, then takes the probe's (closed) connection
  t.join();
}

TEST(ProbeSink, RefusesAnAddressItCannotBind) {
  auto s = ProbeSink::listen("999.1.1.1:0");
  ASSERT_FALSE(s);
  auto s2 = ProbeSink::listen("nonsense");
  ASSERT_FALSE(s2);
}

}  // namespace
}  // namespace ember::emberctl
