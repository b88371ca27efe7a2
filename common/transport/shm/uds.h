// Unix-domain SOCK_SEQPACKET helpers for the shm transport's control socket:
// addresses (filesystem path or "@abstract"), and sending/receiving one
// message with file descriptors (SCM_RIGHTS).
//
// Thread-safety: pure functions over their arguments; any thread.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/error.h"
#include "common/transport/stream_io.h"

namespace ember::transport::shm {

// Most descriptors one message carries (the kernel's SCM_MAX_FD is 253).
inline constexpr std::size_t kMaxFdsPerMessage = 250;
inline constexpr std::size_t kMaxControlMessageBytes = 64 * 1024;

// Errors: kInvalidArgument (empty, or longer than sun_path allows).
Result<std::pair<sockaddr_un, socklen_t>> make_address(std::string_view address);

// Sends one message with `fds` attached (non-blocking socket; waits for room
// until the deadline, or until `cancel_fd` is readable: stream_io::wait_ready).
// Errors: kTimeout, kClosed, kIo, kCancelled.
Status send_message(int fd, std::span<const std::byte> bytes, std::span<const int> fds,
                    stream_io::Deadline deadline, int cancel_fd = -1);

// One received message and the descriptors that came with it (owned by the
// caller). An empty `bytes` with closed == true means end of stream.
struct Received {
  std::vector<std::byte> bytes;
  std::vector<int> fds;
  bool closed = false;
};
// Receives one message without waiting. Errors: kTimeout (nothing there: use
// as "would block"), kIo, kProtocol (truncated message or descriptors).
Result<Received> try_receive(int fd);
// Receives one message, waiting until the deadline (or `cancel_fd`, as
// send_message). Errors as try_receive, and kCancelled.
Result<Received> receive_message(int fd, stream_io::Deadline deadline, int cancel_fd = -1);

void close_fds(std::span<const int> fds) noexcept;

}  // namespace ember::transport::shm
