// Integration-test harness: real ember-server processes (and the test worker
// program) on 127.0.0.1, driven from a GoogleTest process.
//
// Nothing here sleeps to wait: a child's readiness is a line on its stdout
// read with poll() against a deadline; its exit is a pidfd polled against a
// deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/config/config.h"

namespace ember::test {

using namespace std::chrono_literals;

// A fresh directory under $TMPDIR, removed with everything in it.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

void write_file(const std::filesystem::path& path, const std::string& text);
std::string read_file(const std::filesystem::path& path);

// A child process: stdout on a pipe (read line by line), stderr to a file.
class Process {
 public:
  // Spawns `exe` with `args`; stderr goes to `stderr_path` (appended).
  Process(const std::string& exe, const std::vector<std::string>& args,
          const std::filesystem::path& stderr_path);
  ~Process();  // SIGKILL and reap if still running
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  int pid() const { return pid_; }
  // The next stdout line starting with `prefix` (earlier lines are kept in
  // lines()); nullopt when the deadline passes or stdout closes first.
  std::optional<std::string> wait_line(const std::string& prefix,
                                       std::chrono::milliseconds timeout = 20s);
  const std::vector<std::string>& lines() const { return lines_; }
  void signal(int sig);
  // Exit status (as from waitpid) once the process ended; nullopt when still
  // running at the deadline.
  std::optional<int> wait_exit(std::chrono::milliseconds timeout = 20s);
  bool running() const { return !reaped_; }

 private:
  int pid_ = -1;
  int out_fd_ = -1;
  int pid_fd_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string buffer_;
  std::vector<std::string> lines_;
  std::size_t consumed_ = 0;
};

// Common settings for test clusters.
struct ClusterSpec {
  std::uint32_t num_servers = 1;
  std::uint32_t num_workers = 1;
  std::string transport = "tcp";
  std::string consistency = "bsp";
  std::uint32_t staleness = 0;
  std::string optimizer = "sgd";
  double learning_rate = 0.1;
  std::string loss_policy = "wait";
  std::string worker_timeout = "5s";
  std::string partition_bytes = "4MB";
  std::string checkpoint_dir;
  std::string checkpoint_interval = "0s";
  std::string extra_server;  // more lines for [server]
  std::string extra_optimizer;  // more lines for [optimizer]
  std::string request_timeout = "20s";
  std::uint32_t shards = 1;
};

// The TOML of `spec`, with `servers` as the cluster's server list.
std::string cluster_toml(const ClusterSpec& spec, const std::vector<std::string>& servers);

// A running ember-server.
class ServerProcess {
 public:
  // Writes the config into `dir` and starts server `index` of `spec` on
  // 127.0.0.1:<free port>; waits for its ready line. Extra command-line args
  // are appended. EXPECTs it to come up.
  ServerProcess(const TempDir& dir, const ClusterSpec& spec, std::uint32_t index,
                std::vector<std::string> extra_args = {});
  bool ok() const { return !address_.empty(); }
  const std::string& address() const { return address_; }
  const std::string& metrics_address() const { return metrics_; }
  Process& process() { return *process_; }
  const std::filesystem::path& log_path() const { return log_; }
  std::string log() const { return read_file(log_); }

 private:
  std::filesystem::path log_;
  std::unique_ptr<Process> process_;
  std::string address_;
  std::string metrics_;
};

// Starts ember-server again from the config file a ServerProcess of server
// index 0 wrote into `dir` ("server0.toml"), listening on `address` (the one
// it had, so that workers reconnect to it), stderr to dir/log_name; EXPECTs
// its ready line within 30 s.
std::unique_ptr<Process> restart_server(const TempDir& dir, const std::string& address,
                                        const std::string& log_name);

// A worker's config for `servers` (their real addresses) with `rank`.
config::Config worker_config(const ClusterSpec& spec, const std::vector<std::string>& servers,
                             std::uint32_t rank);

// Path of the binaries under test (from compile definitions).
std::string server_binary();
std::string test_worker_binary();

// GET (or `method`) http://address/path; the whole response ("" on failure).
// `headers`: more header lines, each ending in "\r\n".
std::string http_request(const std::string& address, const std::string& method,
                         const std::string& path, const std::string& headers = "");
inline std::string http_get(const std::string& address, const std::string& path) {
  return http_request(address, "GET", path);
}

}  // namespace ember::test
