// http_request against a tiny fake server on 127.0.0.1 that answers one
// connection with canned bytes: a huge Content-Length, bytes that are not
// HTTP, a header or body past the cap, and a valid metrics page.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "tools/emberctl/http.h"
#include "tools/emberctl/prometheus.h"

namespace ember::emberctl {
namespace {

using namespace std::chrono_literals;

// Listens on 127.0.0.1:<ephemeral>, accepts one connection, reads the
// request header (up to "\r\n\r\n"), sends `reply` (in pieces, ignoring
// errors: the client may hang up early on purpose), then closes.
class FakeServer {
 public:
  explicit FakeServer(std::string reply) : reply_(std::move(reply)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_GE(fd_, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(::listen(fd_, 1), 0);
    socklen_t len = sizeof addr;
    EXPECT_EQ(::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    address_ = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
    thread_ = std::thread([this] { serve_one(); });
  }
  ~FakeServer() {
    thread_.join();
    ::close(fd_);
  }
  const std::string& address() const { return address_; }

 private:
  void serve_one() {
    const int conn = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) return;
    std::string request;
    char buf[4096];
    while (request.find("\r\n\r\n") == std::string::npos) {
      const ssize_t n = ::recv(conn, buf, sizeof buf, 0);
      if (n <= 0) break;
      request.append(buf, static_cast<std::size_t>(n));
    }
    std::size_t sent = 0;
    while (sent < reply_.size()) {
      const ssize_t n = ::send(conn, reply_.data() + sent,
                               std::min<std::size_t>(reply_.size() - sent, 1 << 20), MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<std::size_t>(n);
    }
    ::shutdown(conn, SHUT_WR);
    ::close(conn);
  }

  int fd_ = -1;
  std::string address_;
  std::string reply_;
  std::thread thread_;
};

TEST(HttpRequest, RefusesAHugeContentLengthWithoutAllocatingIt) {
  FakeServer server(
      "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 99999999999\r\n\r\nabc");
  auto r = http_request(server.address(), "GET", "/metrics", 10s);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kTooLarge) << r.error().to_string();
  EXPECT_NE(r.error().message().find("response larger than 64 MiB"), std::string::npos)
      << r.error().to_string();
  EXPECT_EQ(r.error().sys_errno(), 0) << r.error().to_string();
}

TEST(HttpRequest, RefusesABodyPastTheCapWithoutContentLength) {
  // No Content-Length: the body runs to the close, and must stop at the cap.
  std::string reply = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n";
  reply.append(kMaxResponseBytes + 1, 'x');
  FakeServer server(std::move(reply));
  auto r = http_request(server.address(), "GET", "/metrics", 15s);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kTooLarge) << r.error().to_string();
  EXPECT_NE(r.error().message().find("response larger than 64 MiB"), std::string::npos)
      << r.error().to_string();
}

TEST(HttpRequest, RefusesAHeaderPastItsCap) {
  std::string reply = "HTTP/1.1 200 OK\r\n";
  while (reply.size() <= 2 * kMaxResponseHeaderBytes) reply += "X-Filler: aaaaaaaaaaaaaaaaaaaaaaaa\r\n";
  reply += "Content-Length: 0\r\n\r\n";
  FakeServer server(std::move(reply));
  auto r = http_request(server.address(), "GET", "/metrics", 10s);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kTooLarge) << r.error().to_string();
  EXPECT_NE(r.error().message().find("response larger than 64 MiB"), std::string::npos)
      << r.error().to_string();
}

TEST(HttpRequest, RandomBytesAreNotHttpAndCarryNoErrno) {
  // The old code passed Beast's own error number (bad_version = 14) as an
  // errno, which printed as "Bad address (errno 14)".
  std::mt19937 rng(1234);
  std::string garbage;
  for (int i = 0; i < 300; ++i) garbage += static_cast<char>(rng() & 0xff);
  garbage[0] = '\x8f';  // whatever the seed gives, not "HTTP/"
  for (const std::string& reply : {garbage, garbage + "\r\n\r\n", std::string("SSH-2.0-x\r\n\r\n")}) {
    FakeServer server(reply);
    auto r = http_request(server.address(), "GET", "/metrics", 10s);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code(), ErrorCode::kProtocol) << r.error().to_string();
    EXPECT_NE(r.error().message().find("the endpoint at " + server.address() +
                                       " did not answer with HTTP: "),
              std::string::npos)
        << r.error().to_string();
    EXPECT_EQ(r.error().sys_errno(), 0) << r.error().to_string();
    EXPECT_EQ(r.error().to_string().find("errno"), std::string::npos) << r.error().to_string();
  }
}

TEST(HttpRequest, ABadStatusLineAfterHttpPrefixIsNotHttp) {
  FakeServer server("HTTP/9 banana\r\n\r\n");
  auto r = http_request(server.address(), "GET", "/metrics", 10s);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kProtocol) << r.error().to_string();
  EXPECT_NE(r.error().message().find("did not answer with HTTP: "), std::string::npos)
      << r.error().to_string();
  EXPECT_EQ(r.error().sys_errno(), 0);
}

TEST(HttpRequest, ACloseWithoutAnswerIsNamed) {
  FakeServer server("");
  auto r = http_request(server.address(), "GET", "/metrics", 10s);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kIo) << r.error().to_string();
  EXPECT_NE(r.error().message().find("closed the connection without answering"),
            std::string::npos)
      << r.error().to_string();
  EXPECT_EQ(r.error().sys_errno(), 0);
}

TEST(HttpRequest, ReadsAValidMetricsPage) {
  const std::string body =
      "# HELP ember_server_requests_total Requests served.\n"
      "# TYPE ember_server_requests_total counter\n"
      "ember_server_requests_total{op=\"push\"} 42\n";
  FakeServer server("HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                    "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  auto r = http_request(server.address(), "GET", "/metrics", 10s);
  ASSERT_TRUE(r) << r.error().to_string();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, body);
  auto e = parse_exposition(r->body);
  ASSERT_TRUE(e) << e.error().to_string();
  EXPECT_EQ(e->value("ember_server_requests_total", {{"op", "push"}}), 42.0);
}

TEST(HttpRequest, AnHttpErrorStatusIsReturnedNotAnError) {
  FakeServer server("HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found");
  auto r = http_request(server.address(), "GET", "/metrics", 10s);
  ASSERT_TRUE(r) << r.error().to_string();
  EXPECT_EQ(r->status, 404);
  EXPECT_EQ(r->body, "not found");
}

}  // namespace
}  // namespace ember::emberctl
