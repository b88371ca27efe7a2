// The tune probe against its sink on 127.0.0.1 (a real socket pair), and
// its refusal of a peer that is not a sink.
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <thread>

#include <gtest/gtest.h>

#include "tools/emberctl/probe.h"

namespace ember::emberctl {
namespace {

using namespace std::chrono_literals;

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
  const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(lfd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(lfd, 1), 0);
  socklen_t len = sizeof a;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
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

TEST(ProbeSink, RefusesAnAddressItCannotBind) {
  auto s = ProbeSink::listen("999.1.1.1:0");
  ASSERT_FALSE(s);
  auto s2 = ProbeSink::listen("nonsense");
  ASSERT_FALSE(s2);
}

}  // namespace
}  // namespace ember::emberctl
