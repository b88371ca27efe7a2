// A hand-driven tcp peer for the failure tests: it speaks the handshake and
// the wire format byte by byte (or not at all), so tests can send garbage,
// stop mid-frame, reset, or fall silent.
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "common/transport/handshake.h"
#include "common/transport/stream_io.h"
#include "common/transport/tcp/address.h"

namespace ember::transport::testing {

class RawTcpPeer {
 public:
  ~RawTcpPeer() {
    if (fd_ >= 0) ::close(fd_);
  }
  // `receive_buffer` > 0: SO_RCVBUF, set before connecting (it sets the
  // window the connection starts with).
  Status connect(const std::string& address, int receive_buffer = 0) {
    EMBER_ASSIGN_OR_RETURN(auto ep, tcp::resolve_endpoint(address));
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return make_sys_error(errno, "socket");
    int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (receive_buffer > 0) {
      ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
    }
    if (::connect(fd_, static_cast<const sockaddr*>(ep.data()), static_cast<socklen_t>(ep.size())) != 0) {
      return make_sys_error(errno, "connect");
    }
    return ok_status();
  }
  Status send(std::span<const std::byte> bytes) {
    return stream_io::write_all(fd_, bytes, deadline(), "raw peer send");
  }
  // Sends a Hello for channel `channel` of `channels` and reads the Reply.
  Result<handshake::Reply> handshake(handshake::Hello hello) {
    EMBER_TRY(send(handshake::encode(hello)));
    EMBER_ASSIGN_OR_RETURN(auto raw, stream_io::read_message(
                                         fd_,
                                         [](std::span<const std::byte> p) {
                                           return handshake::reply_bytes_missing(p);
                                         },
                                         deadline(), "raw peer reply"));
    return handshake::decode_reply(raw);
  }
  // Reads until EOF (or the deadline); true when the server closed the stream.
  bool wait_eof() {
    std::byte buf[4096];
    for (;;) {
      auto s = stream_io::wait_ready(fd_, POLLIN, deadline(), "raw peer eof");
      if (!s) return false;
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n == 0) return true;
      if (n < 0 && errno != EINTR && errno != EAGAIN) return true;  // reset counts as closed
    }
  }
  // Closes with a TCP reset (SO_LINGER 0).
  void reset() {
    linger l{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    ::close(fd_);
    fd_ = -1;
  }
  int fd() const { return fd_; }

 private:
  static stream_io::Deadline deadline() { return std::chrono::steady_clock::now() + std::chrono::seconds(10); }
  int fd_ = -1;
};

}  // namespace ember::transport::testing
