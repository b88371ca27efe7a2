#include "common/transport/stream_io.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace ember::transport::stream_io {

Status wait_ready(int fd, short events, Deadline deadline, const char* what, int cancel_fd) {
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return make_error(ErrorCode::kTimeout, "{}: timed out waiting for the peer", what);
    }
    const auto left_ms =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
    // poll() ignores an entry with a negative fd: no cancel_fd, no wake-up.
    pollfd p[2] = {{fd, events, 0}, {cancel_fd, POLLIN, 0}};
    const int rc = ::poll(p, 2, static_cast<int>(std::min<long long>(left_ms, 1 << 30)));
    if (rc > 0 && p[1].revents != 0) {
      return make_error(ErrorCode::kCancelled, "{}: cancelled, the transport is shutting down",
                        what);
    }
    if (rc > 0) return ok_status();
    if (rc < 0 && errno != EINTR) return make_sys_error(errno, "{}: poll failed", what);
  }
}

Status write_all(int fd, std::span<const std::byte> bytes, Deadline deadline, const char* what,
                 int cancel_fd) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      EMBER_TRY(wait_ready(fd, POLLOUT, deadline, what, cancel_fd));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) {
      return make_error(ErrorCode::kClosed, "{}: the peer closed the connection", what);
    }
    return make_sys_error(errno, "{}: send failed", what);
  }
  return ok_status();
}

Status read_exact(int fd, std::span<std::byte> out, Deadline deadline, const char* what,
                  int cancel_fd) {
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::recv(fd, out.data() + done, out.size() - done, 0);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) {
      return make_error(ErrorCode::kClosed,
                        "{}: the peer closed the connection after {} of {} bytes", what, done,
                        out.size());
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      EMBER_TRY(wait_ready(fd, POLLIN, deadline, what, cancel_fd));
      continue;
    }
    if (errno == EINTR) continue;
    if (errno == ECONNRESET) {
      return make_error(ErrorCode::kClosed, "{}: the peer reset the connection", what);
    }
    return make_sys_error(errno, "{}: recv failed", what);
  }
  return ok_status();
}

}  // namespace ember::transport::stream_io
