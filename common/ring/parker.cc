#include "common/ring/parker.h"

#include <cerrno>
#include <ctime>

#include <linux/futex.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/base/check.h"

namespace ember::ring {

Result<std::unique_ptr<Parker>> Parker::create(const ParkOptions& options) {
  const int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd < 0) {
    return make_sys_error(errno, "creating the ring consumer's eventfd failed; check the "
                                 "process's open-file limit (ulimit -n)");
  }
  return std::unique_ptr<Parker>(new Parker(fd, options));
}

Parker::~Parker() { ::close(fd_); }

void Parker::signal() noexcept {
  signals_.fetch_add(1, std::memory_order_relaxed);  // statistic
  const std::uint64_t one = 1;
  // EAGAIN would mean the counter is at 2^64-2: the consumer is awake anyway.
  // EINTR cannot happen on a non-blocking eventfd write.
  [[maybe_unused]] const ssize_t n = ::write(fd_, &one, sizeof(one));
}

void Parker::finish_park() noexcept {
  sleeping_.store(false, std::memory_order_relaxed);  // ordered by the next park's fence
  std::uint64_t count = 0;
  // EAGAIN: not readable (timeout or a spurious poll return); nothing to drain.
  [[maybe_unused]] const ssize_t n = ::read(fd_, &count, sizeof(count));
}

bool Parker::wait_readable(std::chrono::nanoseconds timeout) noexcept {
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(seconds.count());
  ts.tv_nsec = static_cast<long>((timeout - seconds).count());
  pollfd pfd{fd_, POLLIN, 0};
  const int rc = ::ppoll(&pfd, 1, &ts, nullptr);
  if (rc < 0) {
    // EINTR: a signal; ENOMEM: transient. Both: the caller re-checks and
    // parks again. EFAULT/EINVAL would be bugs here.
    EMBER_CHECK_MSG(errno == EINTR || errno == ENOMEM, "ppoll on the ring eventfd failed: errno {}",
                    errno);
    return false;
  }
  return rc > 0;
}

namespace {

// std::atomic<std::uint32_t> is a plain 32-bit word (static_assert below),
// the layout the futex system call needs.
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));

long futex(std::atomic<std::uint32_t>* word, int op, std::uint32_t value,
           const timespec* timeout) noexcept {
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, value, timeout, nullptr,
                   0);
}

}  // namespace

void FutexFlag::sleep(std::chrono::nanoseconds timeout) noexcept {
  if (timeout <= std::chrono::nanoseconds::zero()) return;
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(seconds.count());
  ts.tv_nsec = static_cast<long>((timeout - seconds).count());
  sleeps_.fetch_add(1, std::memory_order_relaxed);  // statistic
  // Sleeps only while the word is still 1 (EAGAIN otherwise: a wake() came
  // first). ETIMEDOUT and EINTR return to the caller, which re-checks.
  if (futex(&word_, FUTEX_WAIT_PRIVATE, 1, &ts) != 0) {
    EMBER_CHECK_MSG(errno == EAGAIN || errno == ETIMEDOUT || errno == EINTR,
                    "futex wait on a ring lane failed: errno {}", errno);
  }
}

void FutexFlag::wake() noexcept {
  // relaxed: only one waker pays the syscall; the condition itself is
  // carried by the ring positions (release/acquire).
  if (word_.exchange(0, std::memory_order_relaxed) != 0) {
    wakes_.fetch_add(1, std::memory_order_relaxed);  // statistic
    futex(&word_, FUTEX_WAKE_PRIVATE, 1, nullptr);
  }
}

}  // namespace ember::ring
