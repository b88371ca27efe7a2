#include "common/transport/shm/uds.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ember::transport::shm {

Result<std::pair<sockaddr_un, socklen_t>> make_address(std::string_view address) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (address.empty() || address.size() >= sizeof(sa.sun_path)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "shm address '{}' must be a socket path or '@name' of 1..{} characters",
                      address, sizeof(sa.sun_path) - 1);
  }
  std::memcpy(sa.sun_path, address.data(), address.size());
  socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size());
  if (address[0] == '@') {
    sa.sun_path[0] = '\0';  // abstract namespace: no file, gone with the socket
  } else {
    len += 1;  // include the terminating NUL for a path
  }
  return std::make_pair(sa, len);
}

Status send_message(int fd, std::span<const std::byte> bytes, std::span<const int> fds,
                    stream_io::Deadline deadline, int cancel_fd) {
  if (fds.size() > kMaxFdsPerMessage) {
    return make_error(ErrorCode::kInvalidArgument, "{} descriptors exceed one message's limit {}",
                      fds.size(), kMaxFdsPerMessage);
  }
  iovec iov{const_cast<std::byte*>(bytes.data()), bytes.size()};
  std::vector<char> control(fds.empty() ? 0 : CMSG_SPACE(sizeof(int) * fds.size()));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    if (c == nullptr) return make_error(ErrorCode::kInternal, "no room for SCM_RIGHTS control data");
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  for (;;) {
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(bytes.size())) return ok_status();
    if (n >= 0) return make_error(ErrorCode::kIo, "short send of a control message");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      EMBER_TRY(stream_io::wait_ready(fd, POLLOUT, deadline, "shm control send", cancel_fd));
      continue;
    }
    if (errno == EPIPE || errno == ECONNRESET) {
      return make_error(ErrorCode::kClosed, "the shm peer closed its control socket");
    }
    return make_sys_error(errno, "sendmsg on the shm control socket");
  }
}

void close_fds(std::span<const int> fds) noexcept {
  for (int f : fds) {
    if (f >= 0) ::close(f);
  }
}

Result<Received> try_receive(int fd) {
  Received r;
  r.bytes.resize(kMaxControlMessageBytes);
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage));
  iovec iov{r.bytes.data(), r.bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return make_error(ErrorCode::kTimeout, "no control message yet");
    }
    if (errno == ECONNRESET) {
      r.bytes.clear();
      r.closed = true;
      return r;
    }
    return make_sys_error(errno, "recvmsg on the shm control socket");
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      const std::size_t old = r.fds.size();
      r.fds.resize(old + count);
      std::memcpy(r.fds.data() + old, CMSG_DATA(c), count * sizeof(int));
    }
  }
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    close_fds(r.fds);
    return make_error(ErrorCode::kProtocol, "shm control message truncated (over {} bytes or {} fds)",
                      kMaxControlMessageBytes, kMaxFdsPerMessage);
  }
  r.bytes.resize(static_cast<std::size_t>(n));
  r.closed = (n == 0);
  return r;
}

Result<Received> receive_message(int fd, stream_io::Deadline deadline, int cancel_fd) {
  for (;;) {
    auto r = try_receive(fd);
    if (r || r.error().code() != ErrorCode::kTimeout) return r;
    EMBER_TRY(stream_io::wait_ready(fd, POLLIN, deadline, "shm control receive", cancel_fd));
  }
}

}  // namespace ember::transport::shm
