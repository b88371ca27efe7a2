// Failure and recovery through real processes: checkpoint + kill -9 +
// restart, a truncated checkpoint refused, SIGTERM drains and exits 0, a
// worker killed mid-round under each on_worker_loss policy, a restarted
// worker rejoining, a re-sent push applied once.
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/mount.h>
#include <unistd.h>
#include <sys/wait.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "common/placement/placement.h"
#include "server/checkpoint.h"
#include "tests/integration/server/harness.h"
#include "worker/worker.h"

namespace ember::test {
namespace {

std::unique_ptr<Worker> connect_worker(const ClusterSpec& spec, const std::string& address,
                                       std::uint32_t rank) {
  auto w = Worker::create(worker_config(spec, {address}, rank));
  EXPECT_TRUE(w) << w.error().to_string();
  return w ? std::move(*w) : nullptr;
}

std::vector<float> gradient(int step) {
  std::vector<float> g(64);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = std::sin(static_cast<float>(step * 64 + i));
  return g;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i])) return false;
  }
  return true;
}

ClusterSpec adam_spec(const TempDir& dir) {
  ClusterSpec spec;
  spec.optimizer = "adam";
  spec.learning_rate = 0.01;
  spec.checkpoint_dir = (dir / "ckpt").string();
  return spec;
}

const std::uint64_t kShape[] = {8, 8};

std::vector<float> initial() {
  std::vector<float> v(64);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * static_cast<float>(i);
  return v;
}

TEST(ServerRecovery, CheckpointKillNineRestartKeepsParametersAndOptimizerState) {
  TempDir dir;
  const ClusterSpec spec = adam_spec(dir);
  std::vector<float> p3(64), p4(64);
  {
    ServerProcess a(dir, spec, 0);
    ASSERT_TRUE(a.ok());
    auto w = connect_worker(spec, a.address(), 0);
    ASSERT_TRUE(w);
    ASSERT_TRUE(w->init(5, kShape, initial()).wait());
    for (int t = 0; t < 3; ++t) ASSERT_TRUE(w->push_pull(5, gradient(t), p3).wait());
    auto seq = w->checkpoint().wait();
    ASSERT_TRUE(seq) << seq.error().to_string();
    a.process().signal(SIGKILL);
    ASSERT_TRUE(a.process().wait_exit());
  }
  {
    ServerProcess b(dir, spec, 0);
    ASSERT_TRUE(b.ok());
    EXPECT_NE(b.log().find("restored checkpoint"), std::string::npos) << b.log();
    auto w = connect_worker(spec, b.address(), 0);
    ASSERT_TRUE(w);
    auto resume = w->init(5, kShape, initial()).wait();  // exists: no-op, says where to resume
    ASSERT_TRUE(resume);
    EXPECT_EQ(*resume, 3u);
    EXPECT_EQ(w->step(5), 3u);
    std::vector<float> again(64);
    ASSERT_TRUE(w->pull(5, again).wait());
    EXPECT_TRUE(same_bits(again, p3));
    ASSERT_TRUE(w->push_pull(5, gradient(3), p4).wait());
  }
  // The same four steps on a server that never died: Adam's moments and step
  // count must have been restored for the fourth step to match.
  TempDir other;
  ServerProcess c(other, adam_spec(other), 0);
  ASSERT_TRUE(c.ok());
  auto w = connect_worker(spec, c.address(), 0);
  ASSERT_TRUE(w);
  ASSERT_TRUE(w->init(5, kShape, initial()).wait());
  std::vector<float> ref(64);
  for (int t = 0; t < 4; ++t) ASSERT_TRUE(w->push_pull(5, gradient(t), ref).wait());
  EXPECT_TRUE(same_bits(p4, ref));
}

// A hangup (the terminal or ssh session that started the server went away)
// used to end it by SIGHUP's default action: no drain and no final
// checkpoint, so every push applied since the last checkpoint was lost.
TEST(ServerRecovery, SighupStopsInOrderAndKeepsEveryAppliedPush) {
  TempDir dir;
  const ClusterSpec spec = adam_spec(dir);
  std::vector<float> p2(64);
  {
    ServerProcess a(dir, spec, 0);
    ASSERT_TRUE(a.ok());
    auto w = connect_worker(spec, a.address(), 0);
    ASSERT_TRUE(w);
    ASSERT_TRUE(w->init(5, kShape, initial()).wait());
    ASSERT_TRUE(w->push_pull(5, gradient(0), p2).wait());
    ASSERT_TRUE(w->push_pull(5, gradient(1), p2).wait());
    w.reset();
    a.process().signal(SIGHUP);
    auto status = a.process().wait_exit();
    ASSERT_TRUE(status);
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << a.log();
    EXPECT_NE(a.log().find("received SIGHUP: stopping"), std::string::npos) << a.log();
    EXPECT_NE(a.log().find("checkpoint 1 written"), std::string::npos) << a.log();
  }
  ServerProcess b(dir, spec, 0);
  ASSERT_TRUE(b.ok());
  auto w = connect_worker(spec, b.address(), 0);
  ASSERT_TRUE(w);
  auto resume = w->init(5, kShape, initial()).wait();  // exists: says where to resume
  ASSERT_TRUE(resume);
  EXPECT_EQ(*resume, 2u);
  std::vector<float> got(64);
  ASSERT_TRUE(w->pull(5, got).wait());
  EXPECT_TRUE(same_bits(p2, got));
}

// Started with SIGHUP ignored (nohup ember-server ...), the server keeps
// running when its terminal goes away, as the operator asked: a SIGHUP
// followed by a SIGTERM is one stop, by the SIGTERM. (Both pending at once,
// sigtimedwait would take SIGHUP first, the lower number, had it been one of
// the stop signals.)
TEST(ServerRecovery, StartedWithSighupIgnoredAHangupDoesNotStopIt) {
  TempDir dir;
  const ClusterSpec spec = adam_spec(dir);
  struct sigaction ignore {}, before {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGHUP, &ignore, &before), 0);
  auto a = std::make_unique<ServerProcess>(dir, spec, 0);  // inherits SIG_IGN over exec
  ASSERT_EQ(::sigaction(SIGHUP, &before, nullptr), 0);
  ASSERT_TRUE(a->ok());
  a->process().signal(SIGHUP);
  auto w = connect_worker(spec, a->address(), 0);
  ASSERT_TRUE(w) << a->log();
  ASSERT_TRUE(w->init(5, kShape, initial()).wait());
  w.reset();
  a->process().signal(SIGTERM);
  auto status = a->process().wait_exit();
  ASSERT_TRUE(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << a->log();
  EXPECT_NE(a->log().find("received SIGTERM: stopping"), std::string::npos) << a->log();
  EXPECT_EQ(a->log().find("received SIGHUP"), std::string::npos) << a->log();
  EXPECT_NE(a->log().find("(another SIGTERM or SIGINT after 2 s"), std::string::npos) << a->log();
}

TEST(ServerRecovery, SigtermWritesFinalCheckpointAndATruncatedOneIsRefused) {
  TempDir dir;
  const ClusterSpec spec = adam_spec(dir);
  std::vector<float> p2(64), p3(64);
  {
    ServerProcess a(dir, spec, 0);
    ASSERT_TRUE(a.ok());
    auto w = connect_worker(spec, a.address(), 0);
    ASSERT_TRUE(w);
    ASSERT_TRUE(w->init(5, kShape, initial()).wait());
    ASSERT_TRUE(w->push_pull(5, gradient(0), p2).wait());
    ASSERT_TRUE(w->push_pull(5, gradient(1), p2).wait());
    auto seq = w->checkpoint().wait();
    ASSERT_TRUE(seq);
    ASSERT_TRUE(w->push_pull(5, gradient(2), p3).wait());
    w.reset();
    a.process().signal(SIGTERM);
    auto status = a.process().wait_exit();
    ASSERT_TRUE(status);
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << a.log();
    EXPECT_NE(a.log().find("checkpoint 2 written"), std::string::npos) << a.log();
  }
  auto files = server::list_checkpoints(dir / "ckpt", 0);
  ASSERT_TRUE(files);
  ASSERT_EQ(files->size(), 2u);
  const auto newest = (*files)[0].second;
  std::filesystem::resize_file(newest, std::filesystem::file_size(newest) / 2);

  ServerProcess b(dir, spec, 0);
  ASSERT_TRUE(b.ok());
  const std::string log = b.log();
  EXPECT_NE(log.find("refusing checkpoint '" + newest.string() + "': truncated"), std::string::npos)
      << log;
  auto w = connect_worker(spec, b.address(), 0);
  ASSERT_TRUE(w);
  auto resume = w->init(5, kShape, initial()).wait();
  ASSERT_TRUE(resume);
  EXPECT_EQ(*resume, 2u);
  std::vector<float> got(64);
  ASSERT_TRUE(w->pull(5, got).wait());
  EXPECT_TRUE(same_bits(got, p2));
  EXPECT_FALSE(same_bits(got, p3));
}

std::vector<char> file_bytes(const std::filesystem::path& path) {
  const std::string text = read_file(path);
  return std::vector<char>(text.begin(), text.end());
}

void put_bytes(const std::filesystem::path& path, const std::vector<char>& bytes) {
  write_file(path, std::string(bytes.begin(), bytes.end()));
}

// The reviewer's repro: valid 1 and 2, then 3 truncated, 4 with one bit
// flipped, 5 random bytes, 6 empty. Restore falls back to 2; the final
// checkpoint 7 under checkpoint_keep = 3 must leave 7, 2, 1 (not 5, 6, 7),
// the refused files kept aside as "<name>.corrupt".
TEST(ServerRecovery, CorruptCheckpointsAreMovedAsideAndNeverDisplaceValidOnes) {
  TempDir dir;
  ClusterSpec spec = adam_spec(dir);
  spec.extra_server = "checkpoint_keep = 3";
  const auto ckpt = dir / "ckpt";
  std::vector<float> p2(64);
  {
    ServerProcess a(dir, spec, 0);
    ASSERT_TRUE(a.ok());
    auto w = connect_worker(spec, a.address(), 0);
    ASSERT_TRUE(w);
    ASSERT_TRUE(w->init(5, kShape, initial()).wait());
    ASSERT_TRUE(w->push_pull(5, gradient(0), p2).wait());
    auto one = w->checkpoint().wait();
    ASSERT_TRUE(one);
    EXPECT_EQ(*one, 1u);
    ASSERT_TRUE(w->push_pull(5, gradient(1), p2).wait());
    auto two = w->checkpoint().wait();
    ASSERT_TRUE(two);
    EXPECT_EQ(*two, 2u);
    w.reset();
    a.process().signal(SIGKILL);  // no final checkpoint
    ASSERT_TRUE(a.process().wait_exit());
  }
  auto name = [&](std::uint64_t seq) { return ckpt / server::checkpoint_file_name(0, seq); };
  const std::vector<char> image = file_bytes(name(2));
  ASSERT_GT(image.size(), 200u);
  put_bytes(name(3), std::vector<char>(image.begin(), image.begin() + image.size() / 2));
  std::vector<char> flipped = image;
  flipped[image.size() - 40] ^= 0x04;  // inside the last record's parameters
  put_bytes(name(4), flipped);
  std::vector<char> noise(image.size());
  std::uint32_t x = 12345;
  for (auto& c : noise) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  put_bytes(name(5), noise);
  put_bytes(name(6), {});

  ServerProcess b(dir, spec, 0);
  ASSERT_TRUE(b.ok());
  {
    auto w = connect_worker(spec, b.address(), 0);
    ASSERT_TRUE(w);
    ASSERT_TRUE(w->init(5, kShape, initial()).wait());
    std::vector<float> got(64);
    ASSERT_TRUE(w->pull(5, got).wait());
    EXPECT_TRUE(same_bits(got, p2));
  }
  b.process().signal(SIGTERM);
  auto status = b.process().wait_exit();
  ASSERT_TRUE(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << b.log();
  const std::string log = b.log();
  EXPECT_NE(log.find("restored checkpoint '" + name(2).string() + "'"), std::string::npos) << log;
  EXPECT_NE(log.find("checkpoint 7 written"), std::string::npos) << log;
  for (std::uint64_t seq = 3; seq <= 6; ++seq) {
    const std::string aside = name(seq).string() + ".corrupt";
    EXPECT_NE(log.find("refusing checkpoint '" + name(seq).string() + "': "), std::string::npos)
        << log;
    EXPECT_NE(log.find("moved it to '" + aside + "'"), std::string::npos) << log;
    EXPECT_TRUE(std::filesystem::exists(aside)) << aside;
  }
  EXPECT_EQ(file_bytes(name(4).string() + ".corrupt"), flipped);
  auto files = server::list_checkpoints(ckpt, 0);
  ASSERT_TRUE(files);
  std::vector<std::uint64_t> kept;
  for (const auto& f : *files) kept.push_back(f.first);
  EXPECT_EQ(kept, (std::vector<std::uint64_t>{7, 2, 1}));
}

// A server of `spec` (one worker) inits key 1 as four zeros, applies
// `steps` push_pulls of ones and writes a checkpoint, then stops.
void checkpoint_key_1(const TempDir& dir, const ClusterSpec& spec, int steps) {
  const std::uint64_t shape[] = {4};
  ServerProcess a(dir, spec, 0);
  ASSERT_TRUE(a.ok());
  auto w = connect_worker(spec, a.address(), 0);
  ASSERT_TRUE(w);
  ASSERT_TRUE(w->init(1, shape, std::vector<float>(4, 0.0f)).wait());
  std::vector<float> got(4);
  for (int i = 0; i < steps; ++i) {
    ASSERT_TRUE(w->push_pull(1, std::vector<float>(4, 1.0f), got).wait());
  }
  ASSERT_TRUE(w->checkpoint().wait());
}

// The checkpoint's learning rate (the one in force) applies after a restore;
// a config that says another one is named in a warning, not ignored
// silently (a helper lowered the rate after a divergence and got the old one).
TEST(ServerRecovery, ACheckpointRateOtherThanTheConfigsIsAppliedWithAWarning) {
  TempDir dir;
  ClusterSpec spec;
  spec.optimizer = "sgd";
  spec.learning_rate = 1.0;
  spec.checkpoint_dir = (dir / "ckpt").string();
  const std::uint64_t shape[] = {4};
  ASSERT_NO_FATAL_FAILURE(checkpoint_key_1(dir, spec, 0));
  ClusterSpec lowered = spec;
  lowered.learning_rate = 0.25;
  ServerProcess b(dir, lowered, 0);
  ASSERT_TRUE(b.ok());
  auto w = connect_worker(lowered, b.address(), 0);
  ASSERT_TRUE(w);
  ASSERT_TRUE(w->init(1, shape, std::vector<float>(4, 0.0f)).wait());
  std::vector<float> got(4);
  ASSERT_TRUE(w->push_pull(1, std::vector<float>(4, 1.0f), got).wait());
  EXPECT_EQ(got, std::vector<float>(4, -1.0f));  // rate 1, the checkpoint's
  EXPECT_NE(b.log().find("holds learning rate 1, the rate in force when it was written; it "
                         "applies, not [optimizer] learning_rate 0.25 of this config"),
            std::string::npos)
      << b.log();
  // set_learning_rate changes it, as the warning says.
  ASSERT_TRUE(w->set_learning_rate(0.25).wait());
  ASSERT_TRUE(w->push_pull(1, std::vector<float>(4, 1.0f), got).wait());
  EXPECT_EQ(got, std::vector<float>(4, -1.25f));
}

// The other hyper-parameters come from the config at restart; one that
// differs from the checkpoint's is named (the restored moments continue
// under it), one the type does not use is not.
TEST(ServerRecovery, OtherOptimizerSettingsThanTheCheckpointsAreNamed) {
  TempDir dir;
  ClusterSpec spec;
  spec.optimizer = "adam";
  spec.learning_rate = 0.1;
  spec.extra_optimizer = "beta2 = 0.999\nmomentum = 0.9";
  spec.checkpoint_dir = (dir / "ckpt").string();
  ASSERT_NO_FATAL_FAILURE(checkpoint_key_1(dir, spec, 1));
  {
    ServerProcess same(dir, spec, 0);
    ASSERT_TRUE(same.ok());
    EXPECT_NE(same.log().find("restored checkpoint"), std::string::npos) << same.log();
    EXPECT_EQ(same.log().find("other [optimizer] settings"), std::string::npos) << same.log();
  }
  ClusterSpec changed = spec;
  changed.extra_optimizer = "beta2 = 0.99\nmomentum = 0.5";  // momentum: not adam's
  ServerProcess b(dir, changed, 0);
  ASSERT_TRUE(b.ok());
  EXPECT_NE(b.log().find("was written with other [optimizer] settings: beta2 0.999 (now 0.99); "
                         "this config's apply to the restored state from the next update on"),
            std::string::npos)
      << b.log();
}

// An unusable checkpoint_dir is refused at start, naming the path, the errno
// text and the knob, not found out at SIGTERM after the whole job.
// A checkpoint cut with another partition_bytes, or written by a job with
// another server list, would leave the workers addressing chunks the server
// does not hold: the server refuses it at start, naming the setting.
TEST(ServerRecovery, CheckpointOfAnotherPartitionOrServerListIsRefusedAtStart) {
  TempDir dir;
  ClusterSpec spec = adam_spec(dir);
  spec.partition_bytes = "4KB";
  const std::uint64_t shape[] = {8, 256};  // 8 KiB: two chunks of 4 KiB
  const std::vector<float> values(2048, 0.5f);
  // Keys whose chunks include one that server 1 of 2 would own.
  std::vector<Key> keys;
  for (Key k = 1; keys.size() < 4; ++k) {
    if (placement::server_of(k, 0, 2) == 1 || placement::server_of(k, 1, 2) == 1) keys.push_back(k);
  }
  {
    ServerProcess a(dir, spec, 0);
    ASSERT_TRUE(a.ok());
    auto w = connect_worker(spec, a.address(), 0);
    ASSERT_TRUE(w);
    for (Key k : keys) ASSERT_TRUE(w->init(k, shape, values).wait());
    ASSERT_TRUE(w->checkpoint().wait());
  }
  auto expect_refused = [&](const ClusterSpec& s, const std::string& what) {
    std::vector<std::string> servers;
    for (std::uint32_t i = 0; i < s.num_servers; ++i) servers.push_back(fmt::format("127.0.0.1:{}", 1 + i));
    const auto config = dir / "restart.toml";
    write_file(config, cluster_toml(s, servers));
    const auto log_path = dir / "restart.log";
    std::filesystem::remove(log_path);
    Process server(server_binary(),
                   {"--config", config.string(), "--listen", "127.0.0.1:0", "--set", "server.server_index=0"},
                   log_path);
    EXPECT_FALSE(server.wait_line("ember-server ready", 20s)) << what;
    const auto status = server.wait_exit(20s);
    ASSERT_TRUE(status) << "ember-server kept running with " << what;
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0);
    const std::string log = read_file(log_path);
    EXPECT_NE(log.find(what), std::string::npos) << log;
    EXPECT_NE(log.find("another checkpoint_dir to start fresh"), std::string::npos) << log;
  };
  ClusterSpec wider = spec;
  wider.partition_bytes = "8KB";
  expect_refused(wider, "was written with another [server] partition_bytes: it holds key");
  ClusterSpec two = spec;
  two.num_servers = 2;
  expect_refused(two, "written by a job with another server list");
  // The job's own settings still restore it.
  ServerProcess b(dir, spec, 0);
  ASSERT_TRUE(b.ok());
  auto w = connect_worker(spec, b.address(), 0);
  ASSERT_TRUE(w);
  // init of a restored key is a no-op: the checkpoint's values stay.
  ASSERT_TRUE(w->init(keys[0], shape, std::vector<float>(2048, 9.0f)).wait());
  std::vector<float> got(2048);
  ASSERT_TRUE(w->pull(keys[0], got).wait());
  EXPECT_EQ(got, values);
}

TEST(ServerRecovery, OnlyCorruptCheckpointsAreAWarningAndAFreshStart) {
  TempDir dir;
  const ClusterSpec spec = adam_spec(dir);
  {
    ServerProcess a(dir, spec, 0);
    ASSERT_TRUE(a.ok());
    auto w = connect_worker(spec, a.address(), 0);
    ASSERT_TRUE(w);
    ASSERT_TRUE(w->init(5, kShape, initial()).wait());
    ASSERT_TRUE(w->checkpoint().wait());
  }
  auto files = server::list_checkpoints(dir / "ckpt", 0);
  ASSERT_TRUE(files);
  ASSERT_FALSE(files->empty());
  for (const auto& f : *files) std::filesystem::resize_file(f.second, 10);
  ServerProcess b(dir, spec, 0);
  ASSERT_TRUE(b.ok());
  const std::string log = b.log();
  EXPECT_NE(log.find(fmt::format("[warning] [server] no valid checkpoint in '{}': all {} refused",
                                 (dir / "ckpt").string(), files->size())),
            std::string::npos)
      << log;
  auto w = connect_worker(spec, b.address(), 0);
  ASSERT_TRUE(w);
  auto step = w->init(5, kShape, initial()).wait();
  ASSERT_TRUE(step) << step.error().to_string();
  EXPECT_EQ(*step, 0u);  // a fresh start
}

// Two jobs given one checkpoint_dir: the second server of index 0 is refused
// at start, before it reads anything, naming the directory and the pid that
// holds it; the first one's checkpoints stay as they were and it keeps
// serving. Once that server is gone (kill -9 too), the directory is free.
TEST(ServerRecovery, ASecondLiveServerOnTheSameCheckpointDirIsRefused) {
  TempDir dir;
  const ClusterSpec spec = adam_spec(dir);
  auto a = std::make_unique<ServerProcess>(dir, spec, 0);
  ASSERT_TRUE(a->ok());
  auto w = connect_worker(spec, a->address(), 0);
  ASSERT_TRUE(w);
  ASSERT_TRUE(w->init(5, kShape, initial()).wait());
  ASSERT_TRUE(w->checkpoint().wait());
  auto listing = [&] {
    std::vector<std::pair<std::string, std::uintmax_t>> files;
    for (const auto& e : std::filesystem::directory_iterator(dir / "ckpt")) {
      files.emplace_back(e.path().filename().string(), e.file_size());
    }
    std::sort(files.begin(), files.end());
    return files;
  };
  const auto before = listing();

  const auto config = dir / "second-job.toml";
  write_file(config, cluster_toml(spec, {"127.0.0.1:1"}));
  const auto log_path = dir / "second-job.log";
  Process second(server_binary(), {"--config", config.string(), "--listen", "127.0.0.1:0"}, log_path);
  EXPECT_FALSE(second.wait_line("ember-server ready", 20s));
  const auto status = second.wait_exit(20s);
  ASSERT_TRUE(status) << "a second ember-server ran on the same checkpoint_dir";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0);
  const std::string log = read_file(log_path);
  EXPECT_NE(log.find(fmt::format("checkpoint_dir '{}' is in use by another ember-server with "
                                 "server_index 0 (pid {})",
                                 (dir / "ckpt").string(), a->process().pid())),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("restored checkpoint"), std::string::npos) << log;
  EXPECT_EQ(listing(), before);
  // --check-config of that config notes it (it said nothing, helper-82) but
  // passes (the config is valid, and checking a running server's config
  // before a restart must pass, helper-84), and changes nothing there.
  const auto check_log = dir / "second-job-check.log";
  Process check(server_binary(), {"--config", config.string(), "--check-config"}, check_log);
  const auto checked = check.wait_exit(20s);
  ASSERT_TRUE(checked);
  EXPECT_TRUE(WIFEXITED(*checked) && WEXITSTATUS(*checked) == 0);
  EXPECT_NE(read_file(check_log).find(fmt::format(
                "note: checkpoint_dir '{}' is in use by another ember-server with server_index 0 "
                "(pid {})",
                (dir / "ckpt").string(), a->process().pid())),
            std::string::npos)
      << read_file(check_log);
  EXPECT_EQ(listing(), before);
  std::vector<float> got(64);
  ASSERT_TRUE(w->pull(5, got).wait());
  EXPECT_EQ(got, initial());

  w.reset();
  a->process().signal(SIGKILL);
  ASSERT_TRUE(a->process().wait_exit());
  ServerProcess again(dir, spec, 0);  // the kernel dropped the dead server's lock
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again.log().find("restored checkpoint"), std::string::npos) << again.log();
}

// A checkpoint that fails on a full file system: the worker that asked gets
// kIo with the errno and what to do, the server logs the failure once as its
// own (not as a bad request from the worker) and keeps serving.
TEST(ServerRecovery, ACheckpointOnAFullFileSystemSaysWhatToDo) {
  TempDir dir;
  const auto mnt = dir / "small";
  std::filesystem::create_directories(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=256k") != 0) {
    GTEST_SKIP() << "mounting a 256 KiB tmpfs needs CAP_SYS_ADMIN: " << std::strerror(errno);
  }
  struct Unmount {
    std::filesystem::path at;
    ~Unmount() { ::umount2(at.c_str(), MNT_DETACH); }
  } unmount{mnt};
  ClusterSpec spec = adam_spec(dir);
  spec.checkpoint_dir = (mnt / "ckpt").string();
  ServerProcess a(dir, spec, 0);
  ASSERT_TRUE(a.ok());
  auto w = connect_worker(spec, a.address(), 0);
  ASSERT_TRUE(w);
  const std::uint64_t shape[] = {256, 256};  // 256 KiB of parameters, more with Adam's moments
  const std::vector<float> values(256 * 256, 0.5f);
  ASSERT_TRUE(w->init(9, shape, values).wait());
  auto r = w->checkpoint().wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kIo) << r.error().to_string();
  // The cause, then what to do.
  EXPECT_NE(r.error().to_string().find("No space left on device (errno 28); free space on the file "
                                       "system of [server] checkpoint_dir"),
            std::string::npos)
      << r.error().to_string();
  std::vector<float> got(256 * 256);
  ASSERT_TRUE(w->pull(9, got).wait());
  EXPECT_EQ(got, values);
  const std::string log = a.log();
  EXPECT_NE(log.find("checkpoint 1 failed"), std::string::npos) << log;
  EXPECT_EQ(log.find("bad request from worker"), std::string::npos) << log;
}

TEST(ServerRecovery, UnwritableCheckpointDirIsRefusedAtStart) {
  TempDir dir;
  write_file(dir / "file", "");
  struct Case {
    std::string path, errno_text;
  };
  const std::vector<Case> cases{{"/proc/ember-nope/ckpt", "No such file or directory"},
                                {(dir / "file" / "ckpt").string(), "Not a directory"}};
  for (const auto& c : cases) {
    ClusterSpec spec;
    spec.checkpoint_dir = c.path;
    const auto config = dir / "server.toml";
    write_file(config, cluster_toml(spec, {"127.0.0.1:1"}));
    const auto log_path = dir / "unwritable.log";
    std::filesystem::remove(log_path);
    Process server(server_binary(), {"--config", config.string(), "--listen", "127.0.0.1:0"},
                   log_path);
    EXPECT_FALSE(server.wait_line("ember-server ready", 20s)) << c.path;
    const auto status = server.wait_exit(20s);
    ASSERT_TRUE(status) << "ember-server kept running with checkpoint_dir " << c.path;
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0);
    const std::string log = read_file(log_path);
    EXPECT_NE(log.find("'" + c.path + "'"), std::string::npos) << log;
    EXPECT_NE(log.find(c.errno_text), std::string::npos) << log;
    EXPECT_NE(log.find("[server] checkpoint_dir"), std::string::npos) << log;
  }
}

// A worker process killed after pushing step `stop` while worker 0 (here)
// waits for its step stop + 1.
struct LossScenario {
  TempDir dir;
  ClusterSpec spec;
  std::unique_ptr<ServerProcess> server;
  std::unique_ptr<Worker> w0;
  std::unique_ptr<Process> w1;
  std::filesystem::path w1_config;

  explicit LossScenario(const std::string& policy, const std::string& timeout = "1500ms") {
    spec.num_workers = 2;
    spec.loss_policy = policy;
    spec.worker_timeout = timeout;
    spec.learning_rate = 0.5;
    server = std::make_unique<ServerProcess>(dir, spec, 0);
    if (!server->ok()) return;
    w1_config = dir / "worker.toml";
    write_file(w1_config, cluster_toml(spec, {server->address()}));
  }

  std::unique_ptr<Process> start_w1(const std::string& steps, const std::vector<std::string>& extra) {
    std::vector<std::string> args{"--config", w1_config.string(), "--rank", "1", "--key", "1",
                                  "--elements", "4", "--steps", steps};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<Process>(test_worker_binary(), args, dir / "worker1.log");
  }

  // Runs both workers to the point where w1 has pushed step 2 and stopped,
  // and w0 has pushed steps 0..3; returns w0's pending pull of step 4.
  Handle run_to_loss(std::vector<float>& params) {
    w1 = start_w1("100", {"--stop-after", "2"});
    auto w = Worker::create(worker_config(spec, {server->address()}, 0));
    EXPECT_TRUE(w) << w.error().to_string();
    if (!w) return Handle::failed(w.error());
    w0 = std::move(*w);
    const std::vector<float> init{0, 1, 2, 3};
    const std::uint64_t shape[] = {4};
    EXPECT_TRUE(w0->init(1, shape, init).wait());
    EXPECT_TRUE(w1->wait_line("ready"));
    const std::vector<float> g(4, 1.0f);
    for (int t = 0; t < 3; ++t) {
      EXPECT_TRUE(w0->push(1, g).wait());
      EXPECT_TRUE(w0->pull(1, params).wait());
    }
    EXPECT_TRUE(w1->wait_line("pushed 2"));
    EXPECT_TRUE(w0->push(1, g).wait());  // step 3: w1 will never push it
    return w0->pull(1, params);          // waits for round 3
  }
};

// A push whose gradient is still queued for the socket when request_timeout
// passes (the server stopped reading: SIGSTOP) is done only once the
// transport no longer reads the gradient: here when the heartbeat declares
// the server lost and closes the connection. The caller then overwrites the
// gradient; after SIGCONT the server must never apply those bytes. (It used
// to: the push timed out while the rest of the gradient was still queued,
// and the server applied half old, half new values, which only the payload
// checksum had caught.)
// Largest value of a "min default max" sysctl file such as
// /proc/sys/net/ipv4/tcp_rmem (bytes); 0 when unreadable.
std::uint64_t sysctl_max(const char* path) {
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) return 0;
  unsigned long long lo = 0, def = 0, hi = 0;
  const int n = std::fscanf(f, "%llu %llu %llu", &lo, &def, &hi);
  std::fclose(f);
  return n == 3 ? hi : 0;
}

TEST(ServerStall, ATimedOutPushIsDoneOnlyOnceItsGradientIsNoLongerRead) {
  TempDir dir;
  ClusterSpec spec;
  spec.consistency = "asp";
  spec.learning_rate = 1.0;
  // request_timeout well before the worker's heartbeat_timeout, and long
  // enough for the init (32 MiB or more) on a slow (sanitizer) build.
  spec.request_timeout = "3s";
  // One chunk (the gradient below is the loopback buffers + 16 MiB), within
  // the default max_message_size of 256 MiB.
  spec.partition_bytes = "256MB";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  config::Config c = worker_config(spec, {server.address()}, 0);
  ASSERT_TRUE(config::set_value(c, "worker.resend_attempts", "0"));
  ASSERT_TRUE(config::set_value(c, "communication.heartbeat_timeout", "6s"));
  auto w = Worker::create(c);
  ASSERT_TRUE(w) << w.error().to_string();
  // More than the loopback buffers can hold, so part of the gradient is
  // still queued when the server stops reading: the stopped server's
  // receive buffer autotunes up to tcp_rmem's maximum (32 MiB on some
  // hosts) and the worker's send buffer up to tcp_wmem's.
  const std::uint64_t buffers =
      sysctl_max("/proc/sys/net/ipv4/tcp_rmem") + sysctl_max("/proc/sys/net/ipv4/tcp_wmem");
  const std::uint64_t num_floats =
      std::max<std::uint64_t>(std::uint64_t{8} << 20, (buffers + (std::uint64_t{16} << 20)) / 4);
  const std::uint64_t shape[] = {num_floats};
  ASSERT_TRUE((*w)->init(7, shape, std::vector<float>(num_floats, 0.0f)).wait());

  std::vector<float> gradient(num_floats, 1.0f);  // heap memory: sent without a copy over tcp
  const auto t0 = std::chrono::steady_clock::now();
  server.process().signal(SIGSTOP);
  auto pushed = (*w)->push(7, gradient).wait();
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(pushed);
  // Not at request_timeout (3 s): the gradient was still queued then; once
  // the heartbeat closed the connection, 5 to 6 s after the stop (the last
  // heartbeat came up to heartbeat_interval, 1 s, before it).
  EXPECT_GE(waited, 4s);
  EXPECT_EQ(pushed.error().code(), ErrorCode::kTimeout) << pushed.error().to_string();
  std::fill(gradient.begin(), gradient.end(), 1000.0f);  // the caller's memory again
  server.process().signal(SIGCONT);

  std::vector<float> params(num_floats, -5.0f);
  auto pulled = (*w)->pull(7, params).wait();
  ASSERT_TRUE(pulled) << pulled.error().to_string();
  // Not applied (0), or applied whole with the bytes of the push (-1).
  const auto zeros = std::count(params.begin(), params.end(), 0.0f);
  const auto ones = std::count(params.begin(), params.end(), -1.0f);
  EXPECT_TRUE(zeros == static_cast<std::ptrdiff_t>(num_floats) || ones == static_cast<std::ptrdiff_t>(num_floats))
      << zeros << " zeros, " << ones << " x -1, "
      << std::count(params.begin(), params.end(), -1000.0f) << " x -1000 (bytes written after done)";
}

TEST(ServerWorkerLoss, FailPolicyReturnsWorkerLostAtOnce) {
  LossScenario s("fail");
  ASSERT_TRUE(s.server->ok());
  std::vector<float> params(4);
  Handle pending = s.run_to_loss(params);
  const auto t0 = std::chrono::steady_clock::now();
  s.w1->signal(SIGKILL);
  auto r = pending.wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kWorkerLost) << r.error().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

// Over shm a large gradient in a pool block (allocate) is read by the server
// from the worker's own memory, and the push is done only when the server
// gives the block back. A round blocked by a lost rank used to keep it for
// good: rank 0's push_pull never completed, not at the worker_lost reply
// (fail) nor at request_timeout (wait). The server now copies what it keeps
// and gives the block back as soon as the round waits for a lost rank.
void shm_pool_push_pull_survives_loss(const std::string& policy) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;
  spec.loss_policy = policy;
  spec.worker_timeout = "120s";  // wait: the round outlives the test
  spec.request_timeout = "4s";
  spec.learning_rate = 1.0;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  constexpr std::uint64_t n = 1 << 18;  // 1 MiB: far above batch_threshold, lent
  const std::filesystem::path w1_config = dir / "worker.toml";
  write_file(w1_config, cluster_toml(spec, {server.address()}));
  // Rank 1 pushes step 0 and stops there (SIGSTOP-like: alive, silent).
  Process w1(test_worker_binary(),
             {"--config", w1_config.string(), "--rank", "1", "--key", "1", "--elements",
              std::to_string(n), "--steps", "100", "--stop-after", "0"},
             dir / "worker1.log");
  auto w = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_TRUE(w) << w.error().to_string();
  Worker& w0 = **w;
  TensorBuffer init = w0.allocate(n * 4), grad = w0.allocate(n * 4), out = w0.allocate(n * 4);
  std::fill(init.floats().begin(), init.floats().end(), 0.0f);
  std::fill(grad.floats().begin(), grad.floats().end(), 2.0f);
  const std::uint64_t shape[] = {n};
  ASSERT_TRUE(w0.init(1, shape, init.floats()).wait());
  // Rank 1 registered too (its process may start slowly on a loaded
  // machine): step 0's push_pull below waits only for its push then.
  ASSERT_TRUE(w1.wait_line("ready", 30s))
      << fmt::format("{}", fmt::join(w1.lines(), "\n")) << read_file(dir / "worker1.log");
  // Step 0 completes with both gradients: 0 - (1 + 2) / 2. (Rank 1's push
  // is done only then: the server reads it from rank 1's pool block too.)
  auto r = w0.push_pull(1, grad.floats(), out.floats()).wait();
  ASSERT_TRUE(r) << r.error().to_string();
  ASSERT_EQ(out.floats()[0], -1.5f);
  ASSERT_TRUE(w1.wait_line("pushed 0", 30s))
      << fmt::format("{}", fmt::join(w1.lines(), "\n")) << read_file(dir / "worker1.log");
  // Step 1 waits for rank 1, which dies.
  Handle pending = w0.push_pull(1, grad.floats(), out.floats());
  std::this_thread::sleep_for(200ms);  // the gradient reaches the server's round
  const auto t0 = std::chrono::steady_clock::now();
  w1.signal(SIGKILL);
  r = pending.wait_for(30s);
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(pending.ready()) << policy << ": the push_pull still runs 30 s after the loss (the "
                                              "server never gave its pool block back)";
  ASSERT_FALSE(r);
  if (policy == "fail") {
    EXPECT_EQ(r.error().code(), ErrorCode::kWorkerLost) << r.error().to_string();
  } else {
    EXPECT_EQ(r.error().code(), ErrorCode::kTimeout) << r.error().to_string();
  }
  // request_timeout is 4 s and worker_timeout 120 s: well under the latter.
  EXPECT_LT(waited, 30s) << policy;
  // The server carries on: a pull of what step 0 made is answered.
  std::vector<float> params(n, -9.0f);
  auto pulled = w0.pull(1, params, 0).wait();
  ASSERT_TRUE(pulled) << pulled.error().to_string();
  EXPECT_EQ(params[0], -1.5f);
}

TEST(ServerWorkerLoss, ShmPoolGradientOfABlockedRoundIsGivenBackUnderFail) {
  shm_pool_push_pull_survives_loss("fail");
}

TEST(ServerWorkerLoss, ShmPoolGradientOfABlockedRoundIsGivenBackUnderWait) {
  shm_pool_push_pull_survives_loss("wait");
}

TEST(ServerWorkerLoss, ShrinkPolicyContinuesWithTheRemainingWorker) {
  LossScenario s("shrink");
  ASSERT_TRUE(s.server->ok());
  std::vector<float> params(4);
  Handle pending = s.run_to_loss(params);
  s.w1->signal(SIGKILL);
  auto r = pending.wait();
  ASSERT_TRUE(r) << r.error().to_string();
  EXPECT_EQ(*r, 4u);
  // Three rounds of mean 1 (both workers), then round 3 of worker 0 alone.
  EXPECT_EQ(params[0], 0.0f - 4 * 0.5f);
  const std::vector<float> g(4, 1.0f);
  for (int t = 0; t < 3; ++t) {
    ASSERT_TRUE(s.w0->push(1, g).wait());
    ASSERT_TRUE(s.w0->pull(1, params).wait());
  }
  EXPECT_EQ(params[0], 0.0f - 7 * 0.5f);
  EXPECT_TRUE(s.w0->barrier().wait());  // the barrier shrinks too
}

TEST(ServerWorkerLoss, WaitPolicyGivesUpAfterWorkerTimeout) {
  LossScenario s("wait", "1500ms");
  ASSERT_TRUE(s.server->ok());
  std::vector<float> params(4);
  Handle pending = s.run_to_loss(params);
  const auto t0 = std::chrono::steady_clock::now();
  s.w1->signal(SIGKILL);
  auto r = pending.wait();
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kWorkerLost) << r.error().to_string();
  EXPECT_GE(waited, 1400ms);
  EXPECT_LT(waited, 10s);
}

// Two workers, on_worker_loss = "wait" with a short worker_timeout.
ClusterSpec two_workers_waiting(const std::string& transport) {
  ClusterSpec spec;
  spec.transport = transport;
  spec.num_workers = 2;
  spec.loss_policy = "wait";
  spec.worker_timeout = "1s";
  spec.learning_rate = 0.5;
  return spec;
}

// A worker that finished its steps and closed is not reported to the others
// as "lost": the error says it closed its connection.
void finished_worker_is_named_as_closed(const std::string& transport) {
  TempDir dir;
  const ClusterSpec spec = two_workers_waiting(transport);
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto a = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_TRUE(a) << a.error().to_string();
  auto b = Worker::create(worker_config(spec, {server.address()}, 1));
  ASSERT_TRUE(b) << b.error().to_string();
  const std::vector<float> init{0, 1, 2, 3};
  const std::uint64_t shape[] = {4};
  ASSERT_TRUE((*a)->init(1, shape, init).wait());
  ASSERT_TRUE((*b)->init(1, shape, init).wait());
  const std::vector<float> g(4, 1.0f);
  std::vector<float> pa(4), pb(4);
  Handle hb = (*b)->push_pull(1, g, pb);
  ASSERT_TRUE((*a)->push_pull(1, g, pa).wait());
  ASSERT_TRUE(hb.wait());
  b->reset();  // rank 1 is done: it closes its connections
  auto r = (*a)->push_pull(1, g, pa).wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kWorkerLost) << r.error().to_string();
  EXPECT_NE(r.error().message().find("needs worker 1, which closed its connection"), std::string::npos)
      << r.error().to_string();
  EXPECT_EQ(r.error().message().find("lost and not back"), std::string::npos) << r.error().to_string();
}

TEST(ServerWorkerLoss, AWorkerThatFinishedIsNamedAsClosedNotLostOverTcp) {
  finished_worker_is_named_as_closed("tcp");
}

TEST(ServerWorkerLoss, AWorkerThatFinishedIsNamedAsClosedOverShm) {
  finished_worker_is_named_as_closed("shm");
}

// A killed worker's end closes without the transport's goodbye: "lost".
void killed_worker_is_named_as_lost(const std::string& transport) {
  TempDir dir;
  const ClusterSpec spec = two_workers_waiting(transport);
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  const std::filesystem::path config = dir / "worker.toml";
  write_file(config, cluster_toml(spec, {server.address()}));
  Process w1(test_worker_binary(),
             {"--config", config.string(), "--rank", "1", "--key", "1", "--elements", "4",
              "--steps", "100", "--stop-after", "0"},
             dir / "worker1.log");
  auto a = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_TRUE(a) << a.error().to_string();
  const std::vector<float> init{0, 1, 2, 3};
  const std::uint64_t shape[] = {4};
  ASSERT_TRUE((*a)->init(1, shape, init).wait());
  const std::vector<float> g(4, 1.0f);
  std::vector<float> pa(4);
  ASSERT_TRUE((*a)->push_pull(1, g, pa).wait());  // step 0, with rank 1's push
  ASSERT_TRUE(w1.wait_line("pushed 0", 30s))
      << fmt::format("{}", fmt::join(w1.lines(), "\n")) << read_file(dir / "worker1.log");
  w1.signal(SIGKILL);
  auto r = (*a)->push_pull(1, g, pa).wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kWorkerLost) << r.error().to_string();
  EXPECT_NE(r.error().message().find("needs worker 1, lost and not back within worker_timeout"),
            std::string::npos)
      << r.error().to_string();
}

TEST(ServerWorkerLoss, AKilledWorkerIsNamedAsLostOverTcp) { killed_worker_is_named_as_lost("tcp"); }

TEST(ServerWorkerLoss, AKilledWorkerIsNamedAsLostOverShm) { killed_worker_is_named_as_lost("shm"); }

TEST(ServerWorkerLoss, RestartedWorkerRejoinsAndTheRoundCompletes) {
  LossScenario s("wait", "20s");
  ASSERT_TRUE(s.server->ok());
  std::vector<float> params(4);
  Handle pending = s.run_to_loss(params);
  s.w1->signal(SIGKILL);
  ASSERT_TRUE(s.w1->wait_exit());
  EXPECT_FALSE(pending.ready());
  // Same rank again: it learns the job is at step 3 and pushes from there.
  auto again = s.start_w1("6", {});
  auto ready = again->wait_line("ready");
  ASSERT_TRUE(ready) << fmt::format("{}", fmt::join(again->lines(), "\n"))
                     << read_file(s.dir / "worker1.log");
  EXPECT_EQ(*ready, "ready 3");
  auto r = pending.wait();
  ASSERT_TRUE(r) << r.error().to_string();
  EXPECT_EQ(*r, 4u);
  const std::vector<float> g(4, 1.0f);
  for (int t = 4; t < 6; ++t) {
    ASSERT_TRUE(s.w0->push(1, g).wait());
    ASSERT_TRUE(s.w0->pull(1, params).wait());
  }
  ASSERT_TRUE(again->wait_line("done"));
  EXPECT_EQ(params[0], 0.0f - 6 * 0.5f);
  EXPECT_NE(s.server->log().find("rejoining"), std::string::npos);
}

TEST(ServerRecovery, CheckpointOnRequestOverHttpAndPeriodically) {
  TempDir dir;
  ClusterSpec spec = adam_spec(dir);
  spec.checkpoint_interval = "1s";  // the shortest allowed
  spec.extra_server = "checkpoint_keep = 2";
  ServerProcess a(dir, spec, 0);
  ASSERT_TRUE(a.ok());
  const std::string answer = http_request(a.metrics_address(), "POST", "/checkpoint");
  EXPECT_NE(answer.find("200 OK"), std::string::npos) << answer;
  EXPECT_NE(answer.find("sequence "), std::string::npos) << answer;
  // Periodic checkpoints keep coming; keep = 2 bounds the files. Each POST
  // waits for a durable checkpoint, so two more requests see later sequences.
  for (int i = 0; i < 2; ++i) {
    EXPECT_NE(http_request(a.metrics_address(), "POST", "/checkpoint").find("200 OK"), std::string::npos);
  }
  auto files = server::list_checkpoints(dir / "ckpt", 0);
  ASSERT_TRUE(files);
  EXPECT_EQ(files->size(), 2u);
  const std::uint64_t last_requested = (*files)[0].first;
  EXPECT_GE(last_requested, 3u);
  // Without any request, the interval alone produces the next one: watch the
  // directory for the rename that publishes it.
  const int fd = ::inotify_init1(IN_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_GE(::inotify_add_watch(fd, (dir / "ckpt").c_str(), IN_MOVED_TO), 0);
  bool periodic = false;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!periodic && std::chrono::steady_clock::now() < deadline) {
    auto now_files = server::list_checkpoints(dir / "ckpt", 0);
    periodic = now_files && !now_files->empty() && (*now_files)[0].first > last_requested;
    if (periodic) break;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, 1000) > 0) {
      char buf[4096];
      (void)::read(fd, buf, sizeof buf);
    }
  }
  ::close(fd);
  EXPECT_TRUE(periodic) << "no periodic checkpoint within 10 s at checkpoint_interval 1s";
  TempDir off_dir;
  ClusterSpec off;
  ServerProcess b(off_dir, off, 0);
  ASSERT_TRUE(b.ok());
  const std::string refused = http_request(b.metrics_address(), "POST", "/checkpoint");
  EXPECT_NE(refused.find("409"), std::string::npos) << refused;
  EXPECT_NE(refused.find("checkpoint_dir"), std::string::npos) << refused;
}

TEST(ServerRecovery, ResentPushIsAppliedOnce) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_workers = 2;
  spec.learning_rate = 1.0;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto w0 = connect_worker(spec, server.address(), 0);
  auto w1 = connect_worker(spec, server.address(), 1);
  ASSERT_TRUE(w0 && w1);
  const std::uint64_t shape[] = {2};
  const std::vector<float> init{10, 10};
  auto i1 = w1->init(4, shape, {});
  ASSERT_TRUE(w0->init(4, shape, init).wait());
  ASSERT_TRUE(i1.wait());
  const std::vector<float> g{2, 4};
  ASSERT_TRUE(w0->push(4, g, 0).wait());
  ASSERT_TRUE(w0->push(4, g, 0).wait());  // re-sent (as after a reconnect): acknowledged
  ASSERT_TRUE(w1->push(4, g, 0).wait());
  std::vector<float> p(2);
  ASSERT_TRUE(w0->pull(4, p, 1).wait());
  EXPECT_EQ(p, (std::vector<float>{8, 6}));  // one round: 10 - mean(2, 2), 10 - mean(4, 4)
  ASSERT_TRUE(w1->push(4, g, 0).wait());  // after the round: still a duplicate, not stale
  ASSERT_TRUE(w0->pull(4, p, 1).wait());
  EXPECT_EQ(p, (std::vector<float>{8, 6}));
}

// ---- a server restored from a checkpoint older than the workers' step ----

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Two workers run to step kCheckpointStep, the server checkpoints, they run
// three more steps, the server is killed (-9) and restarted on the same
// address: it restores step kCheckpointStep.
struct OlderCheckpointScenario {
  static constexpr std::uint64_t kKey = 5;
  static constexpr std::uint64_t kCheckpointStep = 2;
  TempDir dir;
  ClusterSpec spec;
  std::unique_ptr<ServerProcess> server;
  std::unique_ptr<Process> restarted;
  std::unique_ptr<Worker> w0, w1;
  std::vector<float> at_checkpoint = std::vector<float>(64);  // w0's parameters at that step
  std::vector<float> p0 = std::vector<float>(64), p1 = std::vector<float>(64);

  explicit OlderCheckpointScenario(const std::string& consistency) {
    spec.num_workers = 2;
    spec.consistency = consistency;
    spec.staleness = 1;
    spec.learning_rate = 0.5;
    spec.checkpoint_dir = (dir / "ckpt").string();
    spec.request_timeout = "20s";
  }

  static std::vector<float> grad(std::uint32_t rank, std::uint64_t t) {
    return gradient(static_cast<int>(t + 100 * rank));
  }

  // Both workers push_pull step t (w1 issued first, so neither waits on a
  // request not yet sent). Returns both results.
  std::pair<Result<std::uint64_t>, Result<std::uint64_t>> step_both() {
    const std::uint64_t t0 = w0->step(kKey), t1 = w1->step(kKey);
    const auto g0 = grad(0, t0), g1 = grad(1, t1);  // valid until both are done
    Handle h1 = w1->push_pull(kKey, g1, p1);
    auto r0 = w0->push_pull(kKey, g0, p0).wait();
    auto r1 = h1.wait();
    return {r0, r1};
  }

  void run_and_crash() {
    server = std::make_unique<ServerProcess>(dir, spec, 0);
    ASSERT_TRUE(server->ok());
    w0 = connect_worker(spec, server->address(), 0);
    w1 = connect_worker(spec, server->address(), 1);
    ASSERT_TRUE(w0 && w1);
    auto i1 = w1->init(kKey, kShape, {});
    ASSERT_TRUE(w0->init(kKey, kShape, initial()).wait());
    ASSERT_TRUE(i1.wait());
    for (std::uint64_t t = 0; t < kCheckpointStep + 3; ++t) {
      if (t == kCheckpointStep) {
        auto seq = w0->checkpoint().wait();
        ASSERT_TRUE(seq) << seq.error().to_string();
        at_checkpoint = p0;
      }
      auto [r0, r1] = step_both();
      ASSERT_TRUE(r0) << r0.error().to_string();
      ASSERT_TRUE(r1) << r1.error().to_string();
    }
    ASSERT_EQ(w0->step(kKey), kCheckpointStep + 3);
    const std::string address = server->address();
    server->process().signal(SIGKILL);
    ASSERT_TRUE(server->process().wait_exit());
    restarted = restart_server(dir, address, "server0-restarted.log");
    ASSERT_TRUE(restarted->running());
    EXPECT_NE(read_file(dir / "server0-restarted.log").find("restored checkpoint"),
              std::string::npos);
  }
};

TEST(ServerRecovery, OlderCheckpointRefusesTheWorkersStepAtOnceThenTheyResumeAtIt) {
  OlderCheckpointScenario s("bsp");
  ASSERT_NO_FATAL_FAILURE(s.run_and_crash());
  constexpr std::uint64_t k = OlderCheckpointScenario::kCheckpointStep;
  const auto t0 = std::chrono::steady_clock::now();
  auto [r0, r1] = s.step_both();
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(waited, 10s) << "must fail well under request_timeout (20s)";
  for (const auto* r : {&r0, &r1}) {
    ASSERT_FALSE(*r);
    const Error& e = r->error();
    EXPECT_EQ(e.code(), ErrorCode::kOutOfStep) << e.to_string();
    EXPECT_NE(e.message().find(fmt::format("push_pull of key 5 step {} to server 0", k + 3)),
              std::string::npos)
        << e.message();
    EXPECT_NE(e.message().find(fmt::format("which is at step {} for that rank", k)),
              std::string::npos)
        << e.message();
    EXPECT_NE(e.message().find(fmt::format("pull key 5 at step {}", k)), std::string::npos)
        << e.message();
  }
  EXPECT_EQ(s.w0->step(5), k);
  EXPECT_EQ(s.w1->step(5), k);
  // Pull at the server's step: the checkpoint's parameters, at once.
  std::vector<float> q0(64), q1(64);
  auto a0 = s.w0->pull(5, q0).wait();
  auto a1 = s.w1->pull(5, q1).wait();
  ASSERT_TRUE(a0) << a0.error().to_string();
  ASSERT_TRUE(a1) << a1.error().to_string();
  EXPECT_EQ(*a0, k);
  EXPECT_TRUE(same_bits(q0, s.at_checkpoint));
  EXPECT_TRUE(same_bits(q1, s.at_checkpoint));
  for (std::uint64_t t = k; t < k + 2; ++t) {
    auto [b0, b1] = s.step_both();
    ASSERT_TRUE(b0) << b0.error().to_string();
    ASSERT_TRUE(b1) << b1.error().to_string();
    EXPECT_EQ(*b0, t + 1);
    EXPECT_TRUE(same_bits(s.p0, s.p1));
  }
  // Logged once per (rank, key) with the peer, however often it recurs.
  const std::vector<float> g = OlderCheckpointScenario::grad(0, 0);
  auto again = s.w0->push(5, g, k + 9).wait();
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().code(), ErrorCode::kOutOfStep);
  EXPECT_EQ(s.w0->step(5), k + 2) << "the server's step for rank 0";
  const std::string log = read_file(s.dir / "server0-restarted.log");
  EXPECT_EQ(count(log, "bad request from worker 0 (127.0.0.1"), 1u) << log;
  EXPECT_EQ(count(log, "bad request from worker 1 (127.0.0.1"), 1u) << log;
  EXPECT_NE(log.find("see docs/troubleshooting.md#out-of-step"), std::string::npos) << log;
  // The request as it came (its step), not the server's step the reply carries.
  EXPECT_NE(log.find(fmt::format("push_pull key=5 chunk=0/1 step={} rank=0", k + 3)),
            std::string::npos)
      << log;
}

TEST(ServerRecovery, OlderCheckpointUnderAspAcceptsTheWorkersStep) {
  OlderCheckpointScenario s("asp");
  ASSERT_NO_FATAL_FAILURE(s.run_and_crash());
  constexpr std::uint64_t k = OlderCheckpointScenario::kCheckpointStep;
  const auto t0 = std::chrono::steady_clock::now();
  auto [r0, r1] = s.step_both();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  ASSERT_TRUE(r0) << r0.error().to_string();
  ASSERT_TRUE(r1) << r1.error().to_string();
  // The server's clock for each worker jumped to the worker's step.
  EXPECT_EQ(*r0, k + 4);
  EXPECT_EQ(s.w0->step(5), k + 4);
  EXPECT_EQ(s.w1->step(5), k + 4);
  auto [b0, b1] = s.step_both();
  ASSERT_TRUE(b0 && b1);
  EXPECT_EQ(count(read_file(s.dir / "server0-restarted.log"), "out_of_step"), 0u);
}

TEST(ServerRecovery, OlderCheckpointUnderSspAcceptsPushesAndRefusesASelfWaitingPull) {
  OlderCheckpointScenario s("ssp");  // staleness 1
  ASSERT_NO_FATAL_FAILURE(s.run_and_crash());
  constexpr std::uint64_t k = OlderCheckpointScenario::kCheckpointStep;
  // A plain pull of step k + 3 needs worker 0's own clock (k after the
  // restore) + 1 >= k + 3: it would wait on itself; refused at once.
  std::vector<float> q(64);
  const auto t0 = std::chrono::steady_clock::now();
  auto p = s.w0->pull(5, q).wait();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  ASSERT_FALSE(p);
  EXPECT_EQ(p.error().code(), ErrorCode::kOutOfStep) << p.error().to_string();
  EXPECT_EQ(s.w0->step(5), k);
  // Pushes are accepted whatever their step. Worker 1 (still at k + 3) runs
  // three steps ahead of worker 0 (back at k): its pull waits within the
  // staleness bound until worker 0 has caught up, then both go on.
  const auto g1 = OlderCheckpointScenario::grad(1, k + 3);
  Handle h1 = s.w1->push_pull(5, g1, s.p1);
  for (std::uint64_t t = k; t < k + 3; ++t) {
    const auto g0 = OlderCheckpointScenario::grad(0, t);
    auto r0 = s.w0->push_pull(5, g0, s.p0).wait();
    ASSERT_TRUE(r0) << "step " << t << ": " << r0.error().to_string();
  }
  auto r1 = h1.wait();
  ASSERT_TRUE(r1) << r1.error().to_string();
  EXPECT_EQ(s.w0->step(5), k + 3);
  EXPECT_EQ(s.w1->step(5), k + 4);
  auto [b0, b1] = s.step_both();
  ASSERT_TRUE(b0) << b0.error().to_string();
  ASSERT_TRUE(b1) << b1.error().to_string();
}

}  // namespace
}  // namespace ember::test
