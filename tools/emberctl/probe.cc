// Probe client and sink over plain blocking sockets with per-call timeouts
// (SO_RCVTIMEO / SO_SNDTIMEO); see probe.h for the protocol.
#include "tools/emberctl/probe.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "common/config/config.h"

namespace ember::emberctl {

namespace {

using Clock = std::chrono::steady_clock;
constexpr char kMagic[8] = {'E', 'M', 'B', 'R', 'P', 'R', 'B', '1'};
constexpr std::size_t kPingBytes = 64;
constexpr std::uint64_t kMaxBulkBytes = std::uint64_t{64} << 30;
constexpr std::uint64_t kWarmupBytes = std::uint64_t{4} << 20;
constexpr std::size_t kChunkBytes = std::size_t{1} << 20;

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

void set_timeouts(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

Status io_error(int err, std::string_view what, std::string_view peer) {
  if (err == EAGAIN || err == EWOULDBLOCK) {
    return make_error(ErrorCode::kTimeout, "probe {}: {} timed out", peer, what);
  }
  return make_sys_error(err, "probe {}: {} failed", peer, what);
}

Status send_all(int fd, const void* data, std::size_t n, std::string_view peer) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return io_error(errno, "send", peer);
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return ok_status();
}

// `deadline`: the whole receive ends by then (a peer trickling a byte at a
// time within SO_RCVTIMEO would otherwise stretch it without bound); without
// one, each recv() has the socket's SO_RCVTIMEO.
Status recv_all(int fd, void* data, std::size_t n, std::string_view peer,
                std::optional<Clock::time_point> deadline = std::nullopt) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    if (deadline) {
      const auto left = std::chrono::duration_cast<std::chrono::microseconds>(*deadline - Clock::now());
      if (left.count() <= 0) return make_error(ErrorCode::kTimeout, "probe {}: receive timed out", peer);
      timeval tv{};
      tv.tv_sec = static_cast<time_t>(left.count() / 1'000'000);
      tv.tv_usec = static_cast<suseconds_t>(left.count() % 1'000'000);
      ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    }
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r == 0) return make_error(ErrorCode::kClosed, "probe {}: the peer closed the connection", peer);
    if (r < 0) {
      if (errno == EINTR) continue;
      return io_error(errno, "receive", peer);
    }
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return ok_status();
}

void put_u64(char* out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
std::uint64_t get_u64(const char* in) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= std::uint64_t{static_cast<unsigned char>(in[i])} << (8 * i);
  return v;
}

Result<std::chrono::nanoseconds> bulk(int fd, std::uint64_t n, std::string_view peer,
                                      std::chrono::milliseconds timeout) {
  static std::vector<char> chunk(kChunkBytes, 'x');
  std::array<char, 9> head{};
  head[0] = 'B';
  put_u64(head.data() + 1, n);
  const auto start = Clock::now();
  EMBER_TRY(send_all(fd, head.data(), head.size(), peer));
  std::uint64_t left = n;
  while (left > 0) {
    const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(left, chunk.size()));
    EMBER_TRY(send_all(fd, chunk.data(), k, peer));
    left -= k;
  }
  char ack[8];
  EMBER_TRY(recv_all(fd, ack, sizeof ack, peer, Clock::now() + timeout));
  const auto elapsed = Clock::now() - start;
  if (get_u64(ack) != n) {
    return make_error(ErrorCode::kProtocol, "probe {}: the sink acknowledged {} of {} bytes", peer,
                      get_u64(ack), n);
  }
  return std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed);
}

Result<sockaddr_storage> resolve(const config::HostPort& hp, socklen_t& len, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string host = hp.host == "localhost" ? "127.0.0.1" : hp.host;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(hp.port).c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return make_error(ErrorCode::kIo, "probe: cannot resolve '{}': {}", hp.host, ::gai_strerror(rc));
  }
  sockaddr_storage out{};
  std::memcpy(&out, res->ai_addr, res->ai_addrlen);
  len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return out;
}

// One client: returns when it quits or misbehaves.
Status serve_client(int fd, const std::string& peer) {
  char magic[sizeof kMagic];
  EMBER_TRY(recv_all(fd, magic, sizeof magic, peer));
  if (std::memcmp(magic, kMagic, sizeof kMagic) != 0) {
    return make_error(ErrorCode::kProtocol, "probe sink: {} is not an emberctl probe", peer);
  }
  std::vector<char> buf(kChunkBytes);
  while (true) {
    char op = 0;
    EMBER_TRY(recv_all(fd, &op, 1, peer));
    if (op == 'Q') return ok_status();
    if (op == 'P') {
      char ping[kPingBytes];
      ping[0] = 'P';
      EMBER_TRY(recv_all(fd, ping + 1, kPingBytes - 1, peer));
      EMBER_TRY(send_all(fd, ping, kPingBytes, peer));
    } else if (op == 'B') {
      char len[8];
      EMBER_TRY(recv_all(fd, len, sizeof len, peer));
      const std::uint64_t n = get_u64(len);
      if (n > kMaxBulkBytes) {
        return make_error(ErrorCode::kProtocol, "probe sink: {} asked for a {}-byte bulk (max {})",
                          peer, n, kMaxBulkBytes);
      }
      std::uint64_t left = n;
      while (left > 0) {
        const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(left, buf.size()));
        EMBER_TRY(recv_all(fd, buf.data(), k, peer));
        left -= k;
      }
      char ack[8];
      put_u64(ack, n);
      EMBER_TRY(send_all(fd, ack, sizeof ack, peer));
    } else {
      return make_error(ErrorCode::kProtocol, "probe sink: {} sent unknown op 0x{:02x}", peer,
                        static_cast<unsigned>(static_cast<unsigned char>(op)));
    }
  }
}

std::string address_text(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    return fmt::format("[{}]:{}", host, ntohs(a->sin6_port));
  }
  const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
  ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
  return fmt::format("{}:{}", host, ntohs(a->sin_port));
}

}  // namespace

Result<ProbeResult> run_probe(const std::string& host_port, std::uint32_t pings,
                              std::chrono::nanoseconds duration, std::chrono::milliseconds timeout) {
  if (pings < 1) return make_error(ErrorCode::kInvalidArgument, "probe: --pings must be >= 1");
  if (duration.count() <= 0) {
    return make_error(ErrorCode::kInvalidArgument, "probe: --probe-duration must be > 0");
  }
  EMBER_ASSIGN_OR_RETURN(const config::HostPort hp, config::parse_host_port(host_port));
  socklen_t len = 0;
  EMBER_ASSIGN_OR_RETURN(const sockaddr_storage addr, resolve(hp, len, false));
  Fd fd(::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return make_sys_error(errno, "probe: socket()");
  set_timeouts(fd.get(), timeout);
  const std::string peer = hp.to_string();
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    return make_sys_error(errno, "probe: cannot connect to {} (is `emberctl probe-sink` running there?)",
                          peer);
  }
  EMBER_TRY(send_all(fd.get(), kMagic, sizeof kMagic, peer));

  ProbeResult r;
  std::vector<std::chrono::nanoseconds> rtts;
  rtts.reserve(pings);
  char ping[kPingBytes];
  std::memset(ping, 'p', sizeof ping);
  ping[0] = 'P';
  char pong[kPingBytes];
  for (std::uint32_t i = 0; i < pings; ++i) {
    const auto t0 = Clock::now();
    EMBER_TRY(send_all(fd.get(), ping, sizeof ping, peer));
    if (Status got = recv_all(fd.get(), pong, sizeof pong, peer, t0 + timeout); !got) {
      Error err = got.error();
      if (i == 0 && err.code() == ErrorCode::kTimeout) {
        // The sink serves one client at a time: it has not read this one's hello.
        err = Error(err.code(), err.message() + " (a probe-sink serves one client at a time: is "
                                                "another one connected to it?)");
      }
      return tl::unexpected(std::move(err));
    }
    rtts.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0));
    if (std::memcmp(ping, pong, sizeof ping) != 0) {
      return make_error(ErrorCode::kProtocol, "probe {}: the ping came back altered: not a probe sink",
                        peer);
    }
  }
  std::sort(rtts.begin(), rtts.end());
  r.rtt = rtts[rtts.size() / 2];
  r.rtt_min = rtts.front();
  r.pings = pings;

  EMBER_ASSIGN_OR_RETURN(const auto warm, bulk(fd.get(), kWarmupBytes, peer, timeout));
  const double warm_rate = static_cast<double>(kWarmupBytes) /
                           std::max(1e-9, static_cast<double>(warm.count()) / 1e9);
  const double want = warm_rate * static_cast<double>(duration.count()) / 1e9;
  r.bulk_bytes = static_cast<std::uint64_t>(
      std::clamp(want, static_cast<double>(kWarmupBytes), static_cast<double>(kMaxBulkBytes)));
  EMBER_ASSIGN_OR_RETURN(r.bulk_time, bulk(fd.get(), r.bulk_bytes, peer, timeout));
  r.bandwidth_bytes_per_s = static_cast<double>(r.bulk_bytes) /
                            std::max(1e-9, static_cast<double>(r.bulk_time.count()) / 1e9);
  const char quit = 'Q';
  (void)send_all(fd.get(), &quit, 1, peer);
  return r;
}

Result<std::unique_ptr<ProbeSink>> ProbeSink::listen(const std::string& host_port) {
  EMBER_ASSIGN_OR_RETURN(const config::HostPort hp, config::parse_host_port(host_port, true));
  socklen_t len = 0;
  EMBER_ASSIGN_OR_RETURN(const sockaddr_storage addr, resolve(hp, len, true));
  Fd fd(::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return make_sys_error(errno, "probe sink: socket()");
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    return make_sys_error(errno, "probe sink: cannot bind {}", hp.to_string());
  }
  if (::listen(fd.get(), 4) != 0) return make_sys_error(errno, "probe sink: listen on {}", hp.to_string());
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof bound;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &bound_len);
  return std::unique_ptr<ProbeSink>(new ProbeSink(fd.release(), address_text(bound)));
}

ProbeSink::~ProbeSink() {
  if (fd_ >= 0) ::close(fd_);
}

Status ProbeSink::serve(std::uint32_t max_clients) {
  for (std::uint32_t served = 0; max_clients == 0 || served < max_clients; ++served) {
    sockaddr_storage peer_addr{};
    socklen_t peer_len = sizeof peer_addr;
    Fd client(::accept4(fd_, reinterpret_cast<sockaddr*>(&peer_addr), &peer_len, SOCK_CLOEXEC));
    if (client.get() < 0) {
      if (errno == EINTR) {
        --served;
        continue;
      }
      return make_sys_error(errno, "probe sink {}: accept", address_);
    }
    set_timeouts(client.get(), std::chrono::seconds(30));
    const std::string peer = address_text(peer_addr);
    if (Status s = serve_client(client.get(), peer); !s) {
      std::fprintf(stderr, "emberctl probe-sink: dropped %s: %s\n", peer.c_str(),
                   s.error().to_string().c_str());
    }
  }
  return ok_status();
}

}  // namespace ember::emberctl
