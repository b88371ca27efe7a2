// Helpers for the rdma tests: the address to use (the RDMA device's netdev,
// never 127.0.0.1), options shared by the suite and its peer program, a
// scope that lowers RLIMIT_MEMLOCK and drops CAP_IPC_LOCK (so the kernel and
// the transport both enforce the limit, as for an unprivileged service), and
// a child process whose stdout lines can be awaited with a deadline.
#pragma once

#include <fcntl.h>
#include <linux/capability.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common/base/check.h"
#include "common/transport/rdma/device.h"
#include "common/transport/transport.h"

extern char** environ;

namespace ember::transport::rdma::testing {

using namespace std::chrono_literals;

inline constexpr const char* kToken = "ember-rdma-test-token";

// "ip:0" on the active device's netdev, or nullopt (then tests skip).
inline std::optional<std::string> listen_address() {
  const Availability a = probe_rdma();
  if (!a.available || a.address.empty()) return std::nullopt;
  return a.address + ":0";
}

inline std::string skip_reason() {
  return "no RDMA device with an active port and an IPv4 address (" + probe_rdma().detail +
         "); the rdma suite runs in the Soft-RoCE guest: scripts/rdma-vm/suite.sh";
}

inline Options suite_options(std::uint32_t channels = 2) {
  Options o;
  o.kind = Kind::kRdma;
  o.num_channels = channels;
  o.num_io_threads = 2;
  o.max_message_bytes = std::uint64_t{80} << 20;
  o.max_queued_bytes = std::uint64_t{160} << 20;
  o.heartbeat_interval = 200ms;
  o.heartbeat_timeout = 5s;
  o.auth_token = kToken;
  return o;
}

// Lowers the soft RLIMIT_MEMLOCK and removes CAP_IPC_LOCK from the calling
// thread's effective set (kept permitted, so it can be restored); both are
// restored on destruction.
class ScopedMemlockLimit {
 public:
  explicit ScopedMemlockLimit(std::uint64_t soft_bytes) {
    EMBER_CHECK(::getrlimit(RLIMIT_MEMLOCK, &saved_) == 0);
    rlimit lowered = saved_;
    lowered.rlim_cur = soft_bytes;
    EMBER_CHECK(::setrlimit(RLIMIT_MEMLOCK, &lowered) == 0);
    header_.version = _LINUX_CAPABILITY_VERSION_3;
    header_.pid = 0;
    EMBER_CHECK(::syscall(SYS_capget, &header_, caps_) == 0);
    __user_cap_data_struct dropped[_LINUX_CAPABILITY_U32S_3];
    std::memcpy(dropped, caps_, sizeof caps_);
    dropped[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
    EMBER_CHECK(::syscall(SYS_capset, &header_, dropped) == 0);
  }
  ~ScopedMemlockLimit() {
    (void)::syscall(SYS_capset, &header_, caps_);
    (void)::setrlimit(RLIMIT_MEMLOCK, &saved_);
  }
  ScopedMemlockLimit(const ScopedMemlockLimit&) = delete;
  ScopedMemlockLimit& operator=(const ScopedMemlockLimit&) = delete;

 private:
  rlimit saved_{};
  __user_cap_header_struct header_{};
  __user_cap_data_struct caps_[_LINUX_CAPABILITY_U32S_3] = {};
};

// A child process (argv[0] is the program path) with its stdout on a pipe.
class Child {
 public:
  explicit Child(const std::vector<std::string>& argv) {
    int fds[2];
    EMBER_CHECK(::pipe2(fds, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const int rc = ::posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    fd_ = fds[0];
    EMBER_CHECK_MSG(rc == 0, "posix_spawn {} failed: {}", argv[0], rc);
  }
  ~Child() {
    kill();
    ::close(fd_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  // The next stdout line starting with `prefix` (without it), or nullopt at
  // the deadline or end of output.
  std::optional<std::string> wait_line(const std::string& prefix, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      for (std::size_t nl; (nl = buf_.find('\n')) != std::string::npos;) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[512];
      const ssize_t n = ::read(fd_, chunk, sizeof chunk);
      if (n <= 0) return std::nullopt;
      buf_.append(chunk, static_cast<std::size_t>(n));
    }
  }
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string buf_;
};

}  // namespace ember::transport::rdma::testing
