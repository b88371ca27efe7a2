// Integration-test harness; see harness.h.
#include "tests/integration/server/harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "common/base/check.h"

extern char** environ;

namespace ember::test {

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "ember-it-XXXXXX").string();
  EMBER_CHECK(::mkdtemp(tmpl.data()) != nullptr);
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Process::Process(const std::string& exe, const std::vector<std::string>& args,
                 const std::filesystem::path& stderr_path) {
  int p[2];
  EMBER_CHECK(::pipe2(p, O_CLOEXEC) == 0);
  const int err = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  EMBER_CHECK(err >= 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, p[1], 1);
  posix_spawn_file_actions_adddup2(&fa, err, 2);
  std::vector<std::string> all{exe};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int rc = ::posix_spawn(&pid_, exe.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(p[1]);
  ::close(err);
  EMBER_CHECK_MSG(rc == 0, "posix_spawn {}: {}", exe, rc);
  out_fd_ = p[0];
  pid_fd_ = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
  EMBER_CHECK_MSG(pid_fd_ >= 0, "pidfd_open failed: errno {}", errno);
}

Process::~Process() {
  if (!reaped_) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  ::close(out_fd_);
  ::close(pid_fd_);
}

std::optional<std::string> Process::wait_line(const std::string& prefix,
                                              std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    while (consumed_ < lines_.size()) {
      const std::string& l = lines_[consumed_++];
      if (l.rfind(prefix, 0) == 0) return l;
    }
    for (auto pos = buffer_.find('\n'); pos != std::string::npos; pos = buffer_.find('\n')) {
      lines_.push_back(buffer_.substr(0, pos));
      buffer_.erase(0, pos + 1);
    }
    if (consumed_ < lines_.size()) continue;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    pollfd pfd{out_fd_, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) return std::nullopt;
    char tmp[4096];
    const ssize_t n = ::read(out_fd_, tmp, sizeof tmp);
    if (n <= 0) return std::nullopt;
    buffer_.append(tmp, static_cast<std::size_t>(n));
  }
}

void Process::signal(int sig) {
  if (!reaped_) ::kill(pid_, sig);
}

std::optional<int> Process::wait_exit(std::chrono::milliseconds timeout) {
  if (reaped_) return status_;
  pollfd pfd{pid_fd_, POLLIN, 0};
  if (::poll(&pfd, 1, static_cast<int>(timeout.count())) <= 0) return std::nullopt;
  EMBER_CHECK(::waitpid(pid_, &status_, 0) == pid_);
  reaped_ = true;
  return status_;
}

std::string cluster_toml(const ClusterSpec& s, const std::vector<std::string>& servers) {
  std::vector<std::string> quoted;
  for (const auto& a : servers) quoted.push_back("\"" + a + "\"");
  return fmt::format(
      "[communication]\n"
      "transport = \"{}\"\n"
      "prealloc_pages = 16\n"
      "pool_backing = \"plain\"\n"
      "heartbeat_interval = \"100ms\"\n"
      "heartbeat_timeout = \"2s\"\n"
      "[cluster]\n"
      "servers = [{}]\n"
      "num_workers = {}\n"
      "[server]\n"
      "consistency = \"{}\"\n"
      "staleness = {}\n"
      "shards = {}\n"
      "partition_bytes = \"{}\"\n"
      "on_worker_loss = \"{}\"\n"
      "worker_timeout = \"{}\"\n"
      "checkpoint_dir = \"{}\"\n"
      "checkpoint_interval = \"{}\"\n"
      "log_level = \"info\"\n"
      "{}\n"
      "[optimizer]\n"
      "type = \"{}\"\n"
      "learning_rate = {}\n"
      "{}\n"
      "[worker]\n"
      "request_timeout = \"{}\"\n"
      "connect_timeout = \"5s\"\n"
      "connect_retries = 5\n",
      s.transport, fmt::join(quoted, ", "), s.num_workers, s.consistency, s.staleness, s.shards,
      s.partition_bytes, s.loss_policy, s.worker_timeout, s.checkpoint_dir, s.checkpoint_interval,
      s.extra_server, s.optimizer, s.learning_rate, s.extra_optimizer, s.request_timeout);
}

ServerProcess::ServerProcess(const TempDir& dir, const ClusterSpec& spec, std::uint32_t index,
                             std::vector<std::string> extra_args) {
  std::vector<std::string> placeholders;
  for (std::uint32_t i = 0; i < spec.num_servers; ++i) {
    placeholders.push_back(fmt::format("127.0.0.1:{}", 1 + i));
  }
  const auto cfg = dir / fmt::format("server{}.toml", index);
  write_file(cfg, cluster_toml(spec, placeholders));
  log_ = dir / fmt::format("server{}.log", index);
  // tcp binds any free port. shm listens on the abstract socket named after
  // host:port, so pick a port number unlikely to be in use by another test
  // (and another on the rare clash: the server then exits at once).
  static std::atomic<std::uint32_t> counter{0};
  std::optional<std::string> line;
  std::string listen;
  for (int attempt = 0; attempt < 3 && !line; ++attempt) {
    listen = spec.transport == "shm"
                 ? fmt::format("127.0.0.1:{}", 20000 + (static_cast<std::uint32_t>(::getpid()) * 131 +
                                                        counter.fetch_add(1) * 7919) % 40000)
                 : std::string("127.0.0.1:0");
    std::vector<std::string> args{"--config", cfg.string(), "--listen", listen, "--set",
                                  fmt::format("server.server_index={}", index), "--set",
                                  "server.metrics_listen=127.0.0.1:0"};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    process_ = std::make_unique<Process>(server_binary(), args, log_);
    line = process_->wait_line("ember-server ready", 30s);
    if (!line && spec.transport != "shm") break;
  }
  EXPECT_TRUE(line) << "ember-server did not come up; its log:\n" << log();
  if (!line) return;
  auto field = [&](const std::string& name) {
    const auto at = line->find(name + "=");
    if (at == std::string::npos) return std::string();
    const auto from = at + name.size() + 1;
    return line->substr(from, line->find(' ', from) - from);
  };
  address_ = spec.transport == "shm" ? listen : field("listen");
  metrics_ = field("metrics");
}

config::Config worker_config(const ClusterSpec& spec, const std::vector<std::string>& servers,
                             std::uint32_t rank) {
  auto cfg = config::parse_config(cluster_toml(spec, servers), "test-worker");
  EMBER_CHECK_MSG(cfg.has_value(), "{}", cfg ? "" : cfg.error().to_string());
  config::set_worker_rank(*cfg, rank);
  return *cfg;
}

std::string server_binary() { return EMBER_SERVER_BIN; }
std::string test_worker_binary() { return EMBER_TEST_WORKER_BIN; }

std::string http_request(const std::string& address, const std::string& method,
                         const std::string& path, const std::string& headers) {
  const auto colon = address.rfind(':');
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1))));
  ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    ::close(fd);
    return {};
  }
  const std::string req =
      fmt::format("{} {} HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\nConnection: close\r\n{}\r\n",
                  method, path, address, headers);
  (void)::write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  for (;;) {
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, 20000) <= 0) break;
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

std::unique_ptr<Process> restart_server(const TempDir& dir, const std::string& address,
                                        const std::string& log_name) {
  std::vector<std::string> args{"--config", (dir / "server0.toml").string(), "--listen", address,
                                "--set", "server.server_index=0", "--set",
                                "server.metrics_listen=127.0.0.1:0"};
  auto p = std::make_unique<Process>(server_binary(), args, dir / log_name);
  EXPECT_TRUE(p->wait_line("ember-server ready", 30s))
      << "ember-server did not come back on " << address << ":\n"
      << read_file(dir / log_name);
  return p;
}

}  // namespace ember::test
