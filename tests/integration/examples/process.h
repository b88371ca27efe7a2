// A child process for integration tests: started with posix_spawn, its
// stdout on a pipe read line by line (wait_line), its stderr appended to a
// log file, its exit awaited through a pidfd (poll with a deadline, no
// sleeping). The destructor SIGKILLs and reaps a child still running.
//
// Keep a child's stdout small (under the 64 KiB pipe buffer) or read it
// while it runs: a child blocked on a full pipe never exits.
//
// Thread-safety: one thread uses a Process.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/base/check.h"

extern char** environ;

namespace ember::testing {

class Process {
 public:
  using Clock = std::chrono::steady_clock;

  // Starts argv[0] (a path) with argv; stderr appended to `stderr_path`.
  explicit Process(std::vector<std::string> argv, const std::string& stderr_path)
      : argv_(std::move(argv)), stderr_path_(stderr_path) {
    int p[2];
    EMBER_CHECK(::pipe2(p, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    posix_spawn_file_actions_addopen(&fa, 2, stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND,
                                     0644);
    std::vector<char*> args;
    for (auto& a : argv_) args.push_back(a.data());
    args.push_back(nullptr);
    const int rc = ::posix_spawn(&pid_, argv_[0].c_str(), &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(p[1]);
    EMBER_CHECK_MSG(rc == 0, "posix_spawn failed");
    out_ = p[0];
    pidfd_ = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
    EMBER_CHECK_MSG(pidfd_ >= 0, "pidfd_open failed (Linux >= 5.3 needed)");
  }
  ~Process() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(out_);
    ::close(pidfd_);
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig) const {
    if (pid_ > 0) ::kill(pid_, sig);
  }

  // Reads stdout until a line starting with `prefix` arrives and returns it;
  // nullopt at the deadline or at EOF. Every line read is kept (output()).
  std::optional<std::string> wait_line(const std::string& prefix, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      while (next_line_ < lines_.size()) {
        const std::string& l = lines_[next_line_++];
        if (l.rfind(prefix, 0) == 0) return l;
      }
      if (!read_some(deadline)) return std::nullopt;
    }
  }

  // Reads every line already in the pipe, without waiting; lines() then
  // holds all the child has written so far (but what is in flight).
  void read_available() {
    while (poll_then_drain(0)) {
    }
  }

  // Waits for the exit (reading stdout meanwhile); the exit code, 128 + the
  // signal for a killed child, or nullopt at the deadline.
  std::optional<int> wait_exit(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (pid_ > 0) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        break;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd fds[2] = {{pidfd_, POLLIN, 0}, {out_eof_ ? -1 : out_, POLLIN, 0}};
      ::poll(fds, 2, static_cast<int>(left.count()));
      if ((fds[1].revents & (POLLIN | POLLHUP)) != 0) drain_available();
    }
    // The child is gone: the rest of its stdout is in the pipe.
    while (!out_eof_ && read_some(Clock::now() + std::chrono::seconds(1))) {
    }
    return exit_code_;
  }

  // Every complete stdout line read so far, and the stderr log.
  const std::vector<std::string>& lines() const { return lines_; }
  std::string output() const {
    std::string all;
    for (const auto& l : lines_) all += l + "\n";
    return all + partial_;
  }
  std::string stderr_text() const {
    std::ifstream f(stderr_path_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

 private:
  // Reads what is available, waiting until `deadline` for something. False
  // at the deadline or EOF.
  bool read_some(Clock::time_point deadline) {
    if (out_eof_) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    return poll_then_drain(static_cast<int>(left.count()));
  }
  // Waits up to `timeout_ms` (0: not at all) for output, then reads what is
  // there. False when nothing came or at EOF.
  bool poll_then_drain(int timeout_ms) {
    if (out_eof_) return false;
    pollfd pfd{out_, POLLIN, 0};
    if (::poll(&pfd, 1, timeout_ms) <= 0) return false;
    return drain_available();
  }
  bool drain_available() {
    char buf[4096];
    const ssize_t n = ::read(out_, buf, sizeof buf);
    if (n <= 0) {
      out_eof_ = true;
      return false;
    }
    partial_.append(buf, static_cast<std::size_t>(n));
    for (auto pos = partial_.find('\n'); pos != std::string::npos; pos = partial_.find('\n')) {
      lines_.push_back(partial_.substr(0, pos));
      partial_.erase(0, pos + 1);
    }
    return true;
  }

  std::vector<std::string> argv_;
  std::string stderr_path_;
  pid_t pid_ = -1;
  int out_ = -1;
  int pidfd_ = -1;
  bool out_eof_ = false;
  std::optional<int> exit_code_;
  std::vector<std::string> lines_;
  std::size_t next_line_ = 0;
  std::string partial_;
};

}  // namespace ember::testing
