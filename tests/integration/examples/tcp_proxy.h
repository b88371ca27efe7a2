// A loopback TCP proxy for fault injection in integration tests: it listens
// on 127.0.0.1 (a free port) and forwards every connection made to it to
// 127.0.0.1:<upstream port>, both directions, byte for byte.
//
//   hold_replies()  stops forwarding upstream -> client bytes: what the
//                   upstream sends (the server's replies) stays in the
//                   proxy's socket buffers; the client's bytes still go up.
//                   A client behind it waits for replies the server already
//                   sent, as behind a stalled network path.
//   hold_requests() the same the other way: the client's bytes (requests)
//                   stay in the proxy's socket buffers and never reach the
//                   upstream; its replies still come down.
//   drop_all()      closes every forwarded connection, both sides, and throws
//                   away what was held (lost in the network); lifts the holds.
//                   New connections are forwarded again; when the upstream
//                   refuses one (the server is down), the client's is closed.
//
// One thread forwards (poll, blocking writes: fine on loopback with readers
// that keep reading). Commands are synchronous: they return once the thread
// has applied them. Thread-safety: the public methods may be called from any
// one thread.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "common/base/check.h"

namespace ember::testing {

class TcpProxy {
 public:
  explicit TcpProxy(int upstream_port) : upstream_port_(upstream_port) {
    listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EMBER_CHECK(listen_ >= 0);
    sockaddr_in a = loopback(0);
    EMBER_CHECK(::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    EMBER_CHECK(::listen(listen_, 64) == 0);
    socklen_t len = sizeof a;
    EMBER_CHECK(::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port_ = ntohs(a.sin_port);
    wake_ = ::eventfd(0, EFD_CLOEXEC);
    EMBER_CHECK(wake_ >= 0);
    thread_ = std::thread([this] { run(); });
  }
  ~TcpProxy() {
    command(Command::kStop);
    thread_.join();
    ::close(listen_);
    ::close(wake_);
  }
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  int port() const { return port_; }
  void hold_replies() { command(Command::kHold); }
  void hold_requests() { command(Command::kHoldRequests); }
  void drop_all() { command(Command::kDrop); }

 private:
  enum class Command { kNone, kHold, kHoldRequests, kDrop, kStop };
  struct Pair {
    int client = -1;
    int upstream = -1;
  };

  static sockaddr_in loopback(int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
  }

  void command(Command c) {
    std::unique_lock lock(mutex_);
    pending_ = c;
    const std::uint64_t one = 1;
    EMBER_CHECK(::write(wake_, &one, sizeof one) == sizeof one);
    applied_.wait(lock, [&] { return pending_ == Command::kNone; });
  }

  static void close_pair(Pair& p) {
    ::close(p.client);
    ::close(p.upstream);
    p.client = p.upstream = -1;
  }

  // Copies what `from` has to `to`; false when either side is closed.
  static bool forward(int from, int to) {
    char buf[64 * 1024];
    const ssize_t n = ::recv(from, buf, sizeof buf, MSG_DONTWAIT);
    if (n <= 0) return n < 0 && (errno == EAGAIN || errno == EINTR);
    for (ssize_t off = 0; off < n;) {
      const ssize_t w = ::send(to, buf + off, static_cast<std::size_t>(n - off), MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return false;
      off += w;
    }
    return true;
  }

  void accept_one() {
    const int c = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) return;
    const int u = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = loopback(upstream_port_);
    if (u < 0 || ::connect(u, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      if (u >= 0) ::close(u);
      ::close(c);  // the server is down: the client sees a refused connection
      return;
    }
    pairs_.push_back(Pair{c, u});
  }

  void run() {
    bool hold = false;
    bool hold_requests = false;
    for (;;) {
      std::vector<pollfd> fds{{wake_, POLLIN, 0}, {listen_, POLLIN, 0}};
      for (const Pair& p : pairs_) {
        fds.push_back({hold_requests ? -1 : p.client, POLLIN, 0});
        fds.push_back({hold ? -1 : p.upstream, POLLIN, 0});  // -1: ignored while held
      }
      if (::poll(fds.data(), fds.size(), -1) < 0) continue;
      if (fds[0].revents != 0) {
        std::uint64_t n = 0;
        (void)!::read(wake_, &n, sizeof n);
        std::lock_guard lock(mutex_);
        const Command c = pending_;
        if (c == Command::kHold) hold = true;
        if (c == Command::kHoldRequests) hold_requests = true;
        if (c == Command::kDrop || c == Command::kStop) {
          for (Pair& p : pairs_) close_pair(p);
          pairs_.clear();
          hold = false;
          hold_requests = false;
        }
        pending_ = Command::kNone;
        applied_.notify_all();
        if (c == Command::kStop) return;
        continue;  // the pair list may have changed
      }
      if (fds[1].revents != 0) accept_one();
      for (std::size_t i = 0; i < pairs_.size() && 2 + 2 * i + 1 < fds.size(); ++i) {
        Pair& p = pairs_[i];
        bool open = true;
        if (fds[2 + 2 * i].revents != 0) open = forward(p.client, p.upstream);
        if (open && fds[3 + 2 * i].revents != 0) open = forward(p.upstream, p.client);
        if (!open) close_pair(p);
      }
      std::erase_if(pairs_, [](const Pair& p) { return p.client < 0; });
    }
  }

  int upstream_port_;
  int listen_ = -1;
  int port_ = 0;
  int wake_ = -1;
  std::vector<Pair> pairs_;  // the forwarding thread's
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable applied_;
  Command pending_ = Command::kNone;
};

}  // namespace ember::testing
