// Blocking-with-deadline helpers over non-blocking stream sockets, for the
// connecting side's handshake (tcp channels, the shm control socket). The
// I/O threads never use these: they are for connect(), which runs on the
// caller's thread.
//
// Every function returns kTimeout when the deadline passes, kIo with errno
// for a failed system call, kClosed when the peer closed the stream early,
// and kCancelled when `cancel_fd` (an eventfd, or -1 for none) is readable
// while it waits: how ~Transport cuts short a connect() in progress
// (TransportRegistry::begin_connect).
// Thread-safety: any thread; each call uses only its arguments.
#pragma once

#include <chrono>
#include <cstddef>
#include <span>
#include <vector>

#include "common/base/error.h"

namespace ember::transport::stream_io {

using Deadline = std::chrono::steady_clock::time_point;

// Waits until `fd` is ready for `events` (POLLIN/POLLOUT). Errors: kTimeout, kIo,
// kCancelled.
Status wait_ready(int fd, short events, Deadline deadline, const char* what, int cancel_fd = -1);

// Writes all of `bytes`. Errors: kTimeout, kIo, kClosed (EPIPE/ECONNRESET), kCancelled.
Status write_all(int fd, std::span<const std::byte> bytes, Deadline deadline, const char* what,
                 int cancel_fd = -1);

// Reads exactly `out.size()` bytes. Errors: kTimeout, kIo, kClosed (EOF,
// ECONNRESET), kCancelled.
Status read_exact(int fd, std::span<std::byte> out, Deadline deadline, const char* what,
                  int cancel_fd = -1);

// Reads a length-prefixed handshake message: calls `missing(prefix)` (returns
// Result<size_t> bytes still needed) after each read until it returns 0.
template <typename MissingFn>
Result<std::vector<std::byte>> read_message(int fd, MissingFn missing, Deadline deadline,
                                            const char* what, int cancel_fd = -1) {
  std::vector<std::byte> buf;
  for (;;) {
    auto need = missing(std::span<const std::byte>(buf));
    if (!need) return tl::unexpected<Error>(std::move(need).error());
    if (*need == 0) return buf;
    const std::size_t old = buf.size();
    buf.resize(old + *need);
    EMBER_TRY(read_exact(fd, std::span<std::byte>(buf).subspan(old), deadline, what, cancel_fd));
  }
}

}  // namespace ember::transport::stream_io
