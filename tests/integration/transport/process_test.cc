// Transport tests across real processes: this test is the server; the peer
// (ember-transport-peer, a separate executable) is the worker. Covers every
// payload size through an echo in both directions, a crashed shm peer (its
// lent payloads and mappings are released), a hung shm peer (heartbeat
// timeout) and a tcp peer killed mid-transfer.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>

#include <condition_variable>
#include <fstream>
#include <mutex>
#include <thread>
#include <string>

#include "common/transport/transport.h"
#include "tests/unit/transport/transport_test_util.h"

extern char** environ;

namespace ember::transport {
namespace {

using namespace std::chrono_literals;
using testing::Inbox;
using testing::MemfdRegion;

// A child process with its stdout on a pipe.
class Child {
 public:
  Child(const std::vector<std::string>& args) {
    int p[2];
    EMBER_CHECK(::pipe2(p, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    std::vector<char*> argv;
    std::string exe = EMBER_TRANSPORT_PEER;
    argv.push_back(exe.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    EMBER_CHECK(::posix_spawn(&pid_, exe.c_str(), &fa, nullptr, argv.data(), environ) == 0);
    posix_spawn_file_actions_destroy(&fa);
    ::close(p[1]);
    out_ = p[0];
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(out_);
  }
  // Reads stdout until a line equal to `line` arrives (deadline 20 s).
  bool wait_line(const std::string& line) {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    for (;;) {
      for (auto pos = buf_.find('\n'); pos != std::string::npos; pos = buf_.find('\n')) {
        std::string l = buf_.substr(0, pos);
        buf_.erase(0, pos + 1);
        if (l == line) return true;
      }
      const auto left = deadline - std::chrono::steady_clock::now();
      if (left <= 0s) return false;
      pollfd pfd{out_, POLLIN, 0};
      if (::poll(&pfd, 1, static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(left).count())) <= 0) {
        return false;
      }
      char tmp[512];
      const ssize_t n = ::read(out_, tmp, sizeof tmp);
      if (n <= 0) return false;
      buf_.append(tmp, static_cast<std::size_t>(n));
    }
  }
  void signal(int sig) { ::kill(pid_, sig); }
  // Exit status, waiting up to 20 s; -1 on timeout or signal.
  int wait_exit() {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    for (;;) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      if (std::chrono::steady_clock::now() > deadline) return -1;
      // Child exit has no fd to wait on here; its stdout closes at exit.
      pollfd pfd{out_, POLLIN, 0};
      ::poll(&pfd, 1, 50);
      char tmp[512];
      if ((pfd.revents & POLLIN) != 0) (void)::read(out_, tmp, sizeof tmp);
    }
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  std::string buf_;
};

std::size_t count_maps(const std::string& needle) {
  std::ifstream f("/proc/self/maps");
  std::string line;
  std::size_t n = 0;
  while (std::getline(f, line)) n += line.find(needle) != std::string::npos;
  return n;
}
std::size_t count_fds() {
  std::size_t n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n;
}

struct Mode {
  const char* name;
  Kind kind;
  ZeroCopy zero_copy;
};

Options server_options(const Mode& m) {
  Options o;
  o.kind = m.kind;
  o.zero_copy = m.zero_copy;
  o.num_channels = 2;
  o.max_message_bytes = std::uint64_t{128} << 20;
  o.max_queued_bytes = std::uint64_t{256} << 20;
  o.heartbeat_interval = 100ms;
  o.heartbeat_timeout = 5s;
  return o;
}
std::string listen_address(const Mode& m, const char* tag) {
  return m.kind == Kind::kShm ? std::string("@ember-it-") + tag + "-" + std::to_string(::getpid())
                              : "127.0.0.1:0";
}

class ProcessTest : public ::testing::TestWithParam<Mode> {};

TEST_P(ProcessTest, EverySizeEchoedByAnotherProcessArrivesIntactInOrder) {
  Inbox in;  // before the transports: on_closed may run into it until they are gone
  const Mode m = GetParam();
  auto t = Transport::create(server_options(m));
  ASSERT_TRUE(t);
  MemfdRegion mem(std::size_t{200} << 20);
  auto rid = (*t)->register_memory(mem.region());
  ASSERT_TRUE(rid);
  mem.set_region_id(*rid);
  auto l = (*t)->listen(listen_address(m, "echo"), {Role::kServer, 0}, in.acceptor(), in.handlers());
  ASSERT_TRUE(l) << l.error().to_string();
  Child child({"--mode", m.name, "--connect", (*l)->address(), "--behaviour", "echo", "--channels", "2"});
  ASSERT_TRUE(child.wait_line("READY"));
  ASSERT_TRUE(in.wait_accepted(1));
  auto conn = in.accepted_at(0);
  const std::vector<std::size_t> sizes = {0, 1, 4095, 4096, 4097, 1u << 20, 64u << 20};
  for (std::uint32_t ch = 0; ch < 2; ++ch) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      Buffer b = mem.make(sizes[i]);
      testing::fill_pattern(b.bytes(), ch, i);
      ASSERT_TRUE(conn->send(ch, std::move(b)));
    }
    ASSERT_TRUE(conn->flush(ch));
  }
  for (std::uint32_t ch = 0; ch < 2; ++ch) {
    ASSERT_TRUE(in.wait_count(ch, sizes.size())) << "channel " << ch;
    std::lock_guard lock(in.mu);
    EXPECT_EQ(in.sizes[ch], sizes);
    for (std::size_t i = 0; i < sizes.size(); ++i) EXPECT_TRUE(in.intact[ch][i]) << sizes[i];
  }
  conn->close();
  ASSERT_TRUE(in.wait_closed());
  EXPECT_EQ(in.closed_reason()->code(), ErrorCode::kClosed);
  EXPECT_EQ(child.wait_exit(), 0);
  EXPECT_TRUE(mem.wait_all_released());
}

INSTANTIATE_TEST_SUITE_P(All, ProcessTest,
                         ::testing::Values(Mode{"tcp", Kind::kTcp, ZeroCopy::kWritev},
                                           Mode{"tcp-sendfile", Kind::kTcp, ZeroCopy::kSendfile},
                                           Mode{"shm", Kind::kShm, ZeroCopy::kWritev}),
                         [](const auto& p) {
                           std::string n = p.param.name;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

TEST(ShmProcess, CrashedPeerIsDetectedAndItsResourcesReleased) {
  Inbox in;  // before the transports: on_closed may run into it until they are gone
  const Mode m{"shm", Kind::kShm, ZeroCopy::kWritev};
  auto t = Transport::create(server_options(m));
  ASSERT_TRUE(t);
  MemfdRegion mem(std::size_t{16} << 20);
  auto rid = (*t)->register_memory(mem.region());
  ASSERT_TRUE(rid);
  mem.set_region_id(*rid);
  const std::size_t lanes_before = count_maps("ember-shm-lane");
  const std::size_t fds_before = count_fds();
  auto l = (*t)->listen(listen_address(m, "crash"), {Role::kServer, 0}, in.acceptor(), in.handlers());
  ASSERT_TRUE(l);
  const std::size_t fds_listening = count_fds();
  Child child({"--mode", "shm", "--connect", (*l)->address(), "--behaviour", "hold", "--channels", "2"});
  ASSERT_TRUE(child.wait_line("READY"));
  ASSERT_TRUE(in.wait_accepted(1));
  auto conn = in.accepted_at(0);
  EXPECT_EQ(count_maps("ember-shm-lane"), lanes_before + 4);  // 2 channels x 2 directions
  std::atomic<int> completions{0};
  for (int i = 0; i < 4; ++i) {
    Buffer b = mem.make(1 << 20);
    ASSERT_TRUE(conn->send(static_cast<std::uint32_t>(i % 2), std::move(b),
                           [&](const Status&) { ++completions; }));
  }
  for (int i = 1; i <= 4; ++i) ASSERT_TRUE(child.wait_line("GOT " + std::to_string(i)));
  EXPECT_EQ(mem.live(), 4);  // lent to the peer, which holds them
  EXPECT_EQ(conn->stats().queued_bytes, 4u << 20);
  child.signal(SIGKILL);
  ASSERT_TRUE(in.wait_closed());
  EXPECT_EQ(in.closed_reason()->code(), ErrorCode::kIo) << in.closed_reason()->to_string();
  EXPECT_NE(in.closed_reason()->message().find("without goodbye"), std::string::npos);
  EXPECT_EQ(conn->stats().queued_bytes, 0u);
  // The lent Buffers go back once the process is seen gone (its pidfd; it
  // may close the socket a moment before), and with them the lanes.
  EXPECT_TRUE(mem.wait_all_released());
  // (The completions run just after, on the same thread.)
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (completions.load() < 4 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  EXPECT_EQ(completions.load(), 4);  // every send completed (ok or with the error)
  EXPECT_EQ(count_maps("ember-shm-lane"), lanes_before);
  EXPECT_EQ(count_fds(), fds_listening + 1);  // + the read end of the child's stdout pipe
  l->reset();
  (void)fds_before;
}

TEST(ShmProcess, HungPeerIsDeclaredDeadByHeartbeat) {
  Inbox in;  // before the transports: on_closed may run into it until they are gone
  const Mode m{"shm", Kind::kShm, ZeroCopy::kWritev};
  Options o = server_options(m);
  o.heartbeat_interval = 50ms;
  o.heartbeat_timeout = 400ms;
  auto t = Transport::create(o);
  ASSERT_TRUE(t);
  auto l = (*t)->listen(listen_address(m, "hang"), {Role::kServer, 0}, in.acceptor(), in.handlers());
  ASSERT_TRUE(l);
  Child child({"--mode", "shm", "--connect", (*l)->address(), "--behaviour", "echo", "--channels", "2"});
  ASSERT_TRUE(child.wait_line("READY"));
  ASSERT_TRUE(in.wait_accepted(1));
  child.signal(SIGSTOP);
  ASSERT_TRUE(in.wait_closed(10s));
  EXPECT_EQ(in.closed_reason()->code(), ErrorCode::kTimeout) << in.closed_reason()->to_string();
  EXPECT_TRUE(in.closed_reason()->to_string().ends_with(
      "(heartbeat_timeout): the peer is dead or stalled; see docs/troubleshooting.md#worker-loss"))
      << in.closed_reason()->to_string();
  child.signal(SIGKILL);
}

// A peer declared dead after heartbeat_timeout may only be stalled, and it
// still maps our memory: what we lent it must not return to its owner (to be
// reused, and read by the peer when it wakes up) until it gives it back, and
// the sends' completions (after which a caller reuses its memory) wait too,
// up to heartbeat_timeout after the close.
class StalledPeer {
 public:
  explicit StalledPeer(const std::string& behaviour, const char* name) {
    Options o = server_options(Mode{"shm", Kind::kShm, ZeroCopy::kWritev});
    // 3 s: the checks right after the close (nothing completed yet) must
    // run before the completions' heartbeat_timeout linger ends, and the
    // child must not be declared dead before its SIGSTOP, on a loaded
    // machine (400 ms was a thin margin for both).
    o.heartbeat_interval = 100ms;
    o.heartbeat_timeout = 3s;
    auto t = Transport::create(o);
    EMBER_CHECK(t.has_value());
    transport = std::move(*t);
    auto rid = transport->register_memory(mem.region());
    EMBER_CHECK(rid.has_value());
    mem.set_region_id(*rid);
    lanes_before = count_maps("ember-shm-lane");
    auto l = transport->listen(listen_address(Mode{"shm", Kind::kShm, ZeroCopy::kWritev}, name),
                               {Role::kServer, 0}, in.acceptor(), in.handlers());
    EMBER_CHECK(l.has_value());
    listener = std::move(*l);
    child = std::make_unique<Child>(std::vector<std::string>{
        "--mode", "shm", "--connect", listener->address(), "--behaviour", behaviour,
        "--channels", "2"});
  }
  // Lends 4 blocks of 1 MiB, stops the peer and waits for the heartbeat
  // timeout to close the connection.
  void lend_then_stall() {
    ASSERT_TRUE(child->wait_line("READY"));
    ASSERT_TRUE(in.wait_accepted(1));
    auto conn = in.accepted_at(0);
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(conn->send(0, mem.make(1 << 20), [this](const Status& st) {
        std::lock_guard lock(mu);
        ++completions;
        ok += st.has_value();
        cv.notify_all();
      }));
    }
    for (int i = 1; i <= 4; ++i) ASSERT_TRUE(child->wait_line("GOT " + std::to_string(i)));
    child->signal(SIGSTOP);
    ASSERT_TRUE(in.wait_closed(30s));
    EXPECT_EQ(in.closed_reason()->code(), ErrorCode::kTimeout) << in.closed_reason()->to_string();
    EXPECT_EQ(conn->stats().queued_bytes, 0u);
  }
  int completed() {
    std::lock_guard lock(mu);
    return completions;
  }
  bool wait_completions(int n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, 10s, [&] { return completions >= n; });
  }

  MemfdRegion mem{std::size_t{16} << 20};  // outlives every Buffer, quarantined ones included
  Inbox in;  // before the transport: on_closed may run into it until it is gone
  std::unique_ptr<Transport> transport;
  std::unique_ptr<Listener> listener;
  std::unique_ptr<Child> child;
  std::size_t lanes_before = 0;
  std::mutex mu;
  std::condition_variable cv;
  int completions = 0;
  int ok = 0;  // completions with success (the peer had consumed them)
};

TEST(ShmProcess, PayloadsLentToAStalledPeerComeBackWhenItReleasesThem) {
  StalledPeer p("hold-then-release", "stall-release");
  p.lend_then_stall();
  // Declared dead, but only stopped: the blocks stay out of the pool, in
  // quarantine (and our lane with them, for the peer's late releases), and
  // the sends are not complete.
  EXPECT_EQ(p.mem.live(), 4);
  EXPECT_EQ(p.completed(), 0);
  EXPECT_GT(count_maps("ember-shm-lane"), p.lanes_before);
  // It wakes up, sees the connection gone and drops its views: their tokens
  // come back through the lane, and so do the blocks, with the process alive.
  p.child->signal(SIGCONT);
  ASSERT_TRUE(p.child->wait_line("RELEASED"));
  EXPECT_TRUE(p.mem.wait_all_released());
  ASSERT_TRUE(p.wait_completions(4));
  EXPECT_EQ(p.ok, 4);  // it had consumed them all
  EXPECT_EQ(count_maps("ember-shm-lane"), p.lanes_before);
  p.child->signal(SIGKILL);
}

TEST(ShmProcess, PayloadsLentToAStalledPeerComeBackWhenItsProcessExits) {
  StalledPeer p("hold", "stall-exit");
  p.lend_then_stall();
  EXPECT_EQ(p.mem.live(), 4);
  EXPECT_EQ(p.completed(), 0);
  // The completions do not wait past heartbeat_timeout after the close (a
  // caller is not held forever by a stalled peer); the blocks stay held.
  ASSERT_TRUE(p.wait_completions(4));
  EXPECT_EQ(p.mem.live(), 4);
  // Killed while stopped: it never gives anything back, but its mappings die
  // with it (seen through its pidfd).
  p.child->signal(SIGKILL);
  EXPECT_TRUE(p.mem.wait_all_released());
  EXPECT_EQ(count_maps("ember-shm-lane"), p.lanes_before);
}

TEST(TcpProcess, PeerKilledMidTransferClosesWithAnError) {
  Inbox in;  // before the transports: on_closed may run into it until they are gone
  const Mode m{"tcp", Kind::kTcp, ZeroCopy::kWritev};
  auto t = Transport::create(server_options(m));
  ASSERT_TRUE(t);
  in.check_pattern_bytes = false;
  auto l = (*t)->listen(listen_address(m, "kill"), {Role::kServer, 0}, in.acceptor(), in.handlers());
  ASSERT_TRUE(l);
  Child child({"--mode", "tcp", "--connect", (*l)->address(), "--behaviour", "flood", "--channels", "2"});
  ASSERT_TRUE(child.wait_line("READY"));
  ASSERT_TRUE(in.wait_count(0, 3));  // data is flowing
  child.signal(SIGKILL);
  ASSERT_TRUE(in.wait_closed());
  const Error e = *in.closed_reason();
  EXPECT_TRUE(e.code() == ErrorCode::kIo || e.code() == ErrorCode::kMalformedFrame) << e.to_string();
}

}  // namespace
}  // namespace ember::transport
