// Fashion-MNIST training through Ember, with real processes: a real
// ember-server and real fmnist-worker processes on 127.0.0.1, on the real
// data (Debian package dataset-fashion-mnist).
//
// The model is the demo's MLP with a narrower hidden layer (784-32-10) and
// the runs are a few hundred steps, so that a Debug build finishes in
// seconds; the code path (EmberExchange, pool buffers, overlap, the server's
// bsp averaging and momentum SGD) is the demo's.
//
// Covered: a short bsp run learns (loss falls, accuracy rises above a floor,
// both workers end with the same model, also under asp); bsp with 2 workers
// gives the parameters of one process trained with the doubled batch (the
// sampler makes the samples identical; only float summation order differs);
// every failure is a clear message and a non-zero exit: server absent,
// server killed mid-training, server hung (timeout), a worker lost, a
// server holding an earlier job, a bad rank. A server killed with -9 while
// one worker is a step ahead (the other's replies held in a TcpProxy) and
// restarted from an older checkpoint: both workers go back to the
// checkpoint's step (one warning each) and finish the job, also when that
// step is in an earlier epoch (which is then trained and ended again). A worker killed with -9 under on_worker_loss = "wait"
// and restarted with --rejoin continues from the servers' step and the job
// finishes; restarted without it, it is told to pass --rejoin. Under
// "shrink", a rejoining rank whose re-sent push finds its round closed
// without it (kStale) pulls that tensor instead (EmberExchange driven step by
// step with in-process workers).
#include <gtest/gtest.h>

#include <poll.h>
#include <sched.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "common/config/config.h"
#include "examples/fashion_mnist/data.h"
#include "examples/fashion_mnist/ember_exchange.h"
#include "examples/fashion_mnist/mlp.h"
#include "examples/fashion_mnist/optimizer.h"
#include "examples/fashion_mnist/trainer.h"
#include "tests/integration/examples/process.h"
#include "tests/integration/examples/tcp_proxy.h"

namespace ember::fashion_mnist {
namespace {

// The lowest CPU this process may run on (its taskset mask).
int first_allowed_cpu() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 0;
  int c = 0;
  while (c + 1 < CPU_SETSIZE && !CPU_ISSET(c, &set)) ++c;
  return c;
}

using namespace std::chrono_literals;
using ember::testing::Process;

// Generous: Debug binaries on a loaded 2-core machine.
constexpr auto kRunTimeout = 240s;
constexpr auto kStartTimeout = 60s;

// The model and the per-worker batch of these tests.
constexpr std::size_t kHidden = 32;
constexpr std::size_t kBatch = 32;

// "key=value" out of a RESULT/epoch line; nullopt when absent.
std::optional<std::string> field(const std::string& line, const std::string& key) {
  const std::regex re("(^| )" + key + "=([^ ]+)");
  std::smatch m;
  if (!std::regex_search(line, m, re)) return std::nullopt;
  return m[2].str();
}
double number(const std::string& line, const std::string& key) {
  const auto v = field(line, key);
  EXPECT_TRUE(v.has_value()) << "no " << key << "= in: " << line;
  return v ? std::stod(*v) : std::nan("");
}

// Lines of `p`'s stdout starting with `prefix`.
std::vector<std::string> lines_with(const Process& p, const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& l : p.lines()) {
    if (l.rfind(prefix, 0) == 0) out.push_back(l);
  }
  return out;
}

std::vector<float> read_floats(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), {});
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    m = std::max(m, static_cast<double>(std::fabs(a[i] - b[i])));
  }
  return m;
}

// One process, no Ember: the tests' model and seed, momentum SGD lr 0.05
// m 0.9 (the server's config), `batch` samples per step for `steps` steps,
// row blocks of `block_rows`. Returns the parameters (key order, packed).
std::vector<float> train_one_process(const FashionMnist& data, std::size_t batch,
                                     std::size_t steps, std::size_t block_rows) {
  TrainerOptions o;
  o.batch_size = batch;
  o.epochs = 1;
  o.seed = 1;
  o.max_steps_per_epoch = steps;
  o.eval_batch_size = 500;
  o.max_eval_samples = 500;
  MlpSpec spec;
  spec.layer_sizes = {kImagePixels, kHidden, kNumClasses};
  spec.block_rows = block_rows;
  auto model = Mlp::create(spec, required_max_batch_size(o));
  EMBER_CHECK(model.has_value());
  std::vector<float> values(model->num_parameters());
  std::vector<float> grads(model->num_parameters());
  EMBER_CHECK(model->bind(values, grads).has_value());
  SgdOptions sgd;
  sgd.lr = 0.05;
  sgd.momentum = 0.9;
  auto optimizer = make_sgd(sgd);
  EMBER_CHECK(optimizer.has_value());
  LocalExchange exchange(**optimizer);
  auto trainer = Trainer::create(o, *model, data.train, data.test, exchange);
  EMBER_CHECK(trainer.has_value());
  auto run = trainer->run();
  EMBER_CHECK(run.has_value());
  return values;
}

// The newest "checkpoint <n> written" sequence in a server log; 0 for none.
// (No std::regex: tests call this once per progress line, and a Debug
// std::regex over the whole log made them fall far behind the workers.)
std::uint64_t newest_checkpoint(const std::string& log) {
  static const std::string kWord = "checkpoint ";
  std::uint64_t newest = 0;
  for (auto pos = log.find(kWord); pos != std::string::npos; pos = log.find(kWord, pos + 1)) {
    const std::size_t digits = pos + kWord.size();
    std::size_t end = digits;
    while (end < log.size() && std::isdigit(static_cast<unsigned char>(log[end]))) ++end;
    if (end > digits && log.compare(end, 8, " written") == 0) {
      newest = std::max<std::uint64_t>(newest, std::stoull(log.substr(digits, end - digits)));
    }
  }
  return newest;
}

// The step count of a progress line ("progress epoch=<e> step=<n>/..."): n,
// or with `steps_per_epoch` the global count (e - 1) * steps_per_epoch + n;
// 0 for another line.
std::size_t progress_step(const std::string& line, std::size_t steps_per_epoch = 0) {
  if (line.rfind("progress ", 0) != 0) return 0;
  const auto v = field(line, "step");
  const auto e = field(line, "epoch");
  if (!v || !e) return 0;
  return steps_per_epoch * (std::stoul(*e) - 1) + std::stoul(v->substr(0, v->find('/')));
}

// The largest progress_step of `p`'s lines read so far; 0 for none.
std::size_t newest_step(const Process& p, std::size_t steps_per_epoch = 0) {
  std::size_t newest = 0;
  for (const auto& l : p.lines()) newest = std::max(newest, progress_step(l, steps_per_epoch));
  return newest;
}

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

// Waits until the file at `path` makes `done(text)` true, re-reading it
// each time it is written (inotify, no polling); false at the deadline.
bool wait_for_file(const std::string& path, const std::function<bool(const std::string&)>& done,
                   std::chrono::milliseconds timeout) {
  const int fd = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  EMBER_CHECK(fd >= 0);
  EMBER_CHECK(::inotify_add_watch(fd, path.c_str(), IN_MODIFY) >= 0);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool ok = false;
  for (;;) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    if (done(ss.str())) {
      ok = true;
      break;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd pfd{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) break;
    char events[4096];
    while (::read(fd, events, sizeof events) > 0) {
    }
  }
  ::close(fd);
  return ok;
}

class FmnistJob : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           fmt::format("ember-fmnist-it-{}-{}", ::getpid(), info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    } else {
      std::fprintf(stderr, "logs kept in %s\n", dir_.c_str());
    }
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // A job config: tcp on 127.0.0.1, bsp, momentum SGD lr 0.05 m 0.9 (the
  // demo's), a lost worker fails the round at once (or, with
  // on_worker_loss "wait", the rounds wait up to 60 s for it: two Debug
  // worker start-ups, a refused one and a rejoining one, must fit in it on
  // a loaded machine; below request_timeout, 120 s). The server
  // address is a placeholder: the server listens on a free port (--listen
  // :0) and the workers get the real one with --set. heartbeat_timeout is
  // 30 s: no test here detects a loss by heartbeats (a killed process closes
  // its sockets), and restart_with_a_rank_ahead holds worker 1's replies for
  // two checkpoint intervals or more, which a loaded machine stretches.
  std::string write_config(std::uint32_t num_workers, const std::string& consistency = "bsp",
                           const std::string& on_worker_loss = "fail") {
    const std::string p = path(fmt::format("job-{}.toml", configs_++));
    std::ofstream f(p);
    f << "[communication]\n"
         "transport = \"tcp\"\n"
         "prealloc_pages = 16\n"
         "heartbeat_interval = \"250ms\"\n"
         "heartbeat_timeout = \"30s\"\n"
         "[cluster]\n"
         "servers = [\"127.0.0.1:1\"]\n"
      << "num_workers = " << num_workers << "\n"
      << "[server]\n"
      << "consistency = \"" << consistency << "\"\n"
      << "on_worker_loss = \"" << on_worker_loss << "\"\n"
      << "worker_timeout = \"60s\"\n"
         "[optimizer]\n"
         "type = \"momentum\"\n"
         "learning_rate = 0.05\n"
         "momentum = 0.9\n"
         "[worker]\n"
         "request_timeout = \"120s\"\n"
         "connect_retries = 0\n";
    return p;
  }

  // Starts ember-server and waits for its ready line; sets port_.
  std::unique_ptr<Process> start_server(const std::string& config) {
    auto p = std::make_unique<Process>(
        std::vector<std::string>{EMBER_SERVER_BIN, "--config", config, "--listen", "127.0.0.1:0"},
        path("server.log"));
    const auto ready = p->wait_line("ember-server ready", kStartTimeout);
    EXPECT_TRUE(ready.has_value()) << "server not ready; log:\n" << p->stderr_text();
    if (!ready) return nullptr;
    const std::smatch m = [&] {
      std::smatch r;
      std::regex_search(*ready, r, std::regex("listen=127\\.0\\.0\\.1:([0-9]+)"));
      return r;
    }();
    EXPECT_FALSE(m.empty()) << *ready;
    port_ = m.empty() ? 0 : std::stoi(m[1].str());
    return p;
  }

  // A Worker in this process, of rank `rank` on the job file `config`,
  // talking to the server at 127.0.0.1:`port`, with the `set` overrides.
  Result<std::unique_ptr<Worker>> in_process_worker(
      const std::string& config, std::uint32_t rank, int port,
      const std::vector<std::pair<std::string, std::string>>& set = {}) {
    auto c = config::load_config_file(config);
    if (!c) return tl::unexpected(c.error());
    const std::string address = fmt::format("127.0.0.1:{}", port);
    EMBER_TRY(config::set_servers(*c, std::span<const std::string>(&address, 1)));
    for (const auto& [key, value] : set) EMBER_TRY(config::set_value(*c, key, value));
    config::set_worker_rank(*c, rank);
    return Worker::create(*c);
  }

  // fmnist-worker of rank `rank` on `config`, talking to the server on
  // port_, with the small model and `args`.
  std::unique_ptr<Process> start_worker(const std::string& config, std::uint32_t rank,
                                        const std::vector<std::string>& args) {
    std::vector<std::string> argv{FMNIST_WORKER_BIN,
                                  "--config",
                                  config,
                                  "--rank",
                                  std::to_string(rank),
                                  "--set",
                                  fmt::format("cluster.servers=127.0.0.1:{}", port_),
                                  "--hidden",
                                  std::to_string(kHidden),
                                  "--batch-size",
                                  std::to_string(kBatch),
                                  "--eval-batch-size",
                                  "500",
                                  "--max-eval-samples",
                                  "2000",
                                  "--log-level",
                                  "warn"};
    argv.insert(argv.end(), args.begin(), args.end());
    return std::make_unique<Process>(argv, path(fmt::format("worker-{}-{}.log", rank, workers_++)));
  }

  // The text of the file `name` in the test directory ("" when absent).
  std::string read_text(const std::string& name) const {
    std::ifstream f(path(name));
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

  static std::string describe(Process& p) {
    return fmt::format("stdout:\n{}\nstderr:\n{}", p.output(), p.stderr_text());
  }

  // A bsp job of `epochs` epochs of `steps` steps with periodic
  // checkpoints, 2 workers. Worker 1 talks to the server through a proxy
  // that the test stalls (hold_replies): worker 1 then waits for the replies
  // of its step j - 1 while worker 0, which has them, computes and pushes
  // step j and waits for that round: worker 0 is one step ahead. The server
  // is killed with -9 there (at global step `kill_from` or later) and
  // restarted from a checkpoint at least 10 steps older (the newer ones are
  // deleted); worker 1's held replies are lost with its connections. Each
  // worker's first reply from the restarted server is kOutOfStep: both must
  // go back to the checkpoint's step (the same one, whichever step each was
  // at) and finish the job together. An exchange that kept each rank's own
  // step (with an offset) paired worker 0's step t with worker 1's t - 1,
  // and the job deadlocked at the end of the epoch. Sets `back_to` (the
  // step both went back to), w0_ and w1_.
  void restart_with_a_rank_ahead(std::uint32_t epochs, std::size_t steps, std::size_t kill_from,
                                 std::size_t& back_to) {
    const std::string config = write_config(2);
    const std::vector<std::string> checkpoints{"--set", "server.checkpoint_dir=" + path("ckpt"),
                                               "--set", "server.checkpoint_interval=1s",
                                               "--set", "server.checkpoint_keep=100"};
    auto server_argv = [&](const std::string& listen) {
      std::vector<std::string> argv{EMBER_SERVER_BIN, "--config", config, "--listen", listen};
      argv.insert(argv.end(), checkpoints.begin(), checkpoints.end());
      return argv;
    };
    auto server = std::make_unique<Process>(server_argv("127.0.0.1:0"), path("server.log"));
    const auto ready = server->wait_line("ember-server ready", kStartTimeout);
    ASSERT_TRUE(ready.has_value()) << server->stderr_text();
    std::smatch m;
    ASSERT_TRUE(std::regex_search(*ready, m, std::regex("listen=127\\.0\\.0\\.1:([0-9]+)")));
    const int server_port = std::stoi(m[1].str());
    ember::testing::TcpProxy proxy(server_port);

    // Reconnects keep trying while the server is down (50 ms .. 1 s apart).
    const std::vector<std::string> args{"--epochs",        std::to_string(epochs),
                                        "--max-steps-per-epoch", std::to_string(steps),
                                        "--progress-every", "1",
                                        "--set",           "worker.connect_retries=100"};
    auto global_step = [&](const Process& w) { return newest_step(w, steps); };
    port_ = server_port;
    w0_ = start_worker(config, 0, args);
    Process* w0 = w0_.get();
    port_ = proxy.port();
    w1_ = start_worker(config, 1, args);
    Process* w1 = w1_.get();

    // Wait (on worker 0's progress lines) for a checkpoint N written after
    // training began (so it holds the tensors), then for 10 more steps and
    // for global step `kill_from`.
    // Each line is handled in microseconds: the workers must not get far
    // ahead of what this loop has read.
    std::optional<std::uint64_t> before_training;
    std::uint64_t checkpoint = 0;
    std::size_t target = 0;
    std::size_t read_at = 0;  // worker 0's global step, as read
    while (checkpoint == 0 || read_at < target) {
      const auto line = w0->wait_line("progress ", kRunTimeout);
      ASSERT_TRUE(line.has_value()) << "no checkpoint while worker 0 trained; server log:\n"
                                    << server->stderr_text() << describe(*w0);
      read_at = std::max(read_at, progress_step(*line, steps));
      ASSERT_LT(read_at, epochs * steps - 50)
          << "the job ran out of steps before the kill; server log:\n"
          << server->stderr_text();
      if (checkpoint != 0) continue;
      const std::uint64_t newest = newest_checkpoint(server->stderr_text());
      if (!before_training) before_training = newest;
      if (newest > *before_training) {
        checkpoint = newest;
        // The line just read can be old (lines wait in the pipe while this
        // loop is descheduled): the target counts from the newest step
        // worker 0 has printed so far, and checkpoint N is at most that
        // step plus the one or two steps in flight.
        w0->read_available();
        read_at = std::max(read_at, global_step(*w0));
        target = std::max(read_at + 15, kill_from);
      }
    }
    // Stall worker 1's replies. Two checkpoint intervals later both workers
    // are blocked (a step takes milliseconds): worker 1 in step j's forward,
    // worker 0 in step j + 1's.
    proxy.hold_replies();
    const std::uint64_t at_hold = newest_checkpoint(server->stderr_text());
    ASSERT_TRUE(wait_for_file(
        path("server.log"),
        [&](const std::string& log) { return newest_checkpoint(log) >= at_hold + 2; }, kRunTimeout))
        << server->stderr_text();
    server->signal(SIGKILL);
    ASSERT_TRUE(server->wait_exit(kStartTimeout).has_value());
    proxy.drop_all();
    for (Process* w : {w0, w1}) {
      while (w->wait_line("progress ", 100ms)) {  // what it printed before it blocked
      }
    }
    const std::size_t step0 = global_step(*w0);
    const std::size_t step1 = global_step(*w1);
    ASSERT_EQ(step0, step1 + 1) << "worker 0 is not one step ahead of worker 1";
    // The newer checkpoints are gone: the restart restores N.
    for (const auto& e : std::filesystem::directory_iterator(path("ckpt"))) {
      const std::string name = e.path().filename().string();
      std::smatch seq;
      if (std::regex_search(name, seq, std::regex("-([0-9]+)\\.ember$")) &&
          std::stoull(seq[1].str()) > checkpoint) {
        std::filesystem::remove(e.path());
      }
    }
    const auto killed = std::chrono::steady_clock::now();
    Process again(server_argv(fmt::format("127.0.0.1:{}", server_port)),
                  path("server-restarted.log"));
    ASSERT_TRUE(again.wait_line("ember-server ready", kStartTimeout).has_value())
        << again.stderr_text();
    EXPECT_NE(again.stderr_text().find(fmt::format("restored checkpoint '{}", path("ckpt"))),
              std::string::npos)
        << again.stderr_text();
    EXPECT_NE(again.stderr_text().find(fmt::format("sequence {},", checkpoint)), std::string::npos)
        << again.stderr_text();

    for (Process* w : {w0, w1}) {
      ASSERT_EQ(w->wait_exit(kRunTimeout), 0) << describe(*w);
    }
    // Well before request_timeout (120 s) after the restart, training of the
    // remaining steps included (about 10 s in Debug): the refusal comes at
    // once.
    const auto extra = std::chrono::steady_clock::now() - killed;
    EXPECT_LT(extra, 60s);
    std::vector<std::string> resumed_at;
    for (Process* w : {w0, w1}) {
      const std::string err = w->stderr_text();
      EXPECT_EQ(count_of(err, "the servers restarted from a checkpoint of step"), 1u) << err;
      EXPECT_NE(err.find("docs/troubleshooting.md#out-of-step"), std::string::npos) << err;
      EXPECT_EQ(err.find("fmnist-worker rank"), std::string::npos) << err;
      std::smatch at;
      if (std::regex_search(err, at, std::regex("checkpoint of step ([0-9]+)"))) {
        resumed_at.push_back(at[1].str());
      }
      const auto result = lines_with(*w, "RESULT ");
      ASSERT_EQ(result.size(), 1u) << describe(*w);
      EXPECT_EQ(field(result[0], "steps"), std::to_string(epochs * steps));
      EXPECT_GT(number(result[0], "test_accuracy"), 0.70) << describe(*w);
    }
    // Both went back to the same step, at least 10 behind worker 1.
    ASSERT_EQ(resumed_at.size(), 2u);
    EXPECT_EQ(resumed_at[0], resumed_at[1]);
    back_to = std::stoul(resumed_at[0]);
    EXPECT_LE(back_to + 10, step1);
    // bsp: one model.
    EXPECT_EQ(field(lines_with(*w0, "RESULT ")[0], "test_accuracy"),
              field(lines_with(*w1, "RESULT ")[0], "test_accuracy"));
    std::printf("checkpoint %llu at step %s; workers at steps %zu and %zu at the kill; %.2f s from "
                "the restart to the end\n",
                static_cast<unsigned long long>(checkpoint),
                resumed_at.empty() ? "?" : resumed_at[0].c_str(), step0, step1,
                std::chrono::duration<double>(extra).count());
    again.signal(SIGTERM);
    EXPECT_EQ(again.wait_exit(kStartTimeout), 0) << again.stderr_text();
  }

  std::filesystem::path dir_;
  int port_ = 0;
  std::unique_ptr<Process> w0_, w1_;  // restart_with_a_rank_ahead's workers
  int configs_ = 0;
  int workers_ = 0;
};

TEST_F(FmnistJob, TwoWorkersBspLossFallsAndAccuracyRises) {
  const std::string config = write_config(2);
  auto server = start_server(config);
  ASSERT_NE(server, nullptr);
  const std::vector<std::string> args{"--epochs", "2", "--max-steps-per-epoch", "100",
                                      "--initial-eval", "--progress-every", "10"};
  auto w0 = start_worker(config, 0, args);
  auto w1 = start_worker(config, 1, args);
  ASSERT_EQ(w0->wait_exit(kRunTimeout), 0) << describe(*w0);
  ASSERT_EQ(w1->wait_exit(kRunTimeout), 0) << describe(*w1);

  for (Process* w : {w0.get(), w1.get()}) {
    const auto initial = lines_with(*w, "initial ");
    const auto epochs = lines_with(*w, "epoch ");
    const auto progress = lines_with(*w, "progress ");
    const auto result = lines_with(*w, "RESULT ");
    ASSERT_EQ(initial.size(), 1u) << describe(*w);
    ASSERT_EQ(epochs.size(), 2u) << describe(*w);
    ASSERT_EQ(progress.size(), 20u) << describe(*w);
    ASSERT_EQ(result.size(), 1u) << describe(*w);
    // Loss falls: per epoch, and from the first logged steps (batch losses,
    // noisy: three averaged) to the last.
    EXPECT_LT(number(epochs[1], "train_loss"), number(epochs[0], "train_loss")) << describe(*w);
    auto mean_loss = [&](std::size_t first) {
      double sum = 0.0;
      for (std::size_t i = first; i < first + 3; ++i) sum += number(progress[i], "loss");
      return sum / 3;
    };
    EXPECT_LT(mean_loss(progress.size() - 3), 0.8 * mean_loss(0)) << describe(*w);
    // Accuracy rises from chance to well above it.
    EXPECT_LT(number(initial[0], "test_accuracy"), 0.3) << describe(*w);
    EXPECT_GT(number(result[0], "test_accuracy"), 0.70) << describe(*w);
    EXPECT_EQ(field(result[0], "steps"), "200");
    EXPECT_EQ(field(result[0], "workers"), "2");
    EXPECT_EQ(field(result[0], "consistency"), "bsp");
    const double share = number(result[0], "comm_share");
    EXPECT_GE(share, 0.0);
    EXPECT_LE(share, 1.0);
  }
  // bsp: both workers pulled the same parameters after every step, so they
  // evaluate the same model.
  EXPECT_EQ(field(lines_with(*w0, "RESULT ")[0], "test_accuracy"),
            field(lines_with(*w1, "RESULT ")[0], "test_accuracy"));

  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(kStartTimeout), 0) << server->stderr_text();
}

TEST_F(FmnistJob, BspTwoWorkersMatchOneProcessWithTheDoubledBatch) {
  constexpr std::size_t kSteps = 40;
  const std::string config = write_config(2);
  auto server = start_server(config);
  ASSERT_NE(server, nullptr);
  auto args = [&](int rank) {
    // Row blocks of 8: W1 [32,784] travels as 4 keys, overlapped with backward
    // and awaited one by one in the next forward.
    return std::vector<std::string>{"--epochs", "1", "--max-steps-per-epoch",
                                    std::to_string(kSteps), "--progress-every", "0",
                                    "--block-rows", "8",
                                    "--save-params", path(fmt::format("params-{}.bin", rank))};
  };
  auto w0 = start_worker(config, 0, args(0));
  auto w1 = start_worker(config, 1, args(1));

  // Meanwhile, the reference: one process, no Ember, batch 2 * kBatch, the
  // same seed, model and optimizer formulas.
  auto data = load_fashion_mnist();
  ASSERT_TRUE(data.has_value()) << data.error().to_string();
  auto train_reference = [&](std::size_t steps) {
    return train_one_process(*data, 2 * kBatch, steps, 8);
  };
  const std::vector<float> reference = train_reference(kSteps);
  const std::vector<float> one_step_short = train_reference(kSteps - 1);

  ASSERT_EQ(w0->wait_exit(kRunTimeout), 0) << describe(*w0);
  ASSERT_EQ(w1->wait_exit(kRunTimeout), 0) << describe(*w1);
  const std::vector<float> p0 = read_floats(path("params-0.bin"));
  const std::vector<float> p1 = read_floats(path("params-1.bin"));
  ASSERT_EQ(p0.size(), reference.size());
  // Both workers hold the server's bytes.
  EXPECT_EQ(p0, p1);
  // Same model as one process up to float rounding (the server sums the two
  // workers' mean gradients in rank order and halves; one process sums 64
  // samples in Eigen's order). Measured: 3.6e-7 after 40 steps.
  constexpr double kTolerance = 2e-5;
  const double diff = max_abs_diff(p0, reference);
  EXPECT_LT(diff, kTolerance);
  // The tolerance is meaningful: one step less is far outside it.
  const double step_diff = max_abs_diff(reference, one_step_short);
  EXPECT_GT(step_diff, 50 * kTolerance);
  std::printf("max |ember - one process| = %.3g, one step = %.3g\n", diff, step_diff);

  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(kStartTimeout), 0) << server->stderr_text();
}

TEST_F(FmnistJob, OneWorkerComputesTheOneProcessParametersBitForBit) {
  // One worker applies no averaging, and the baseline's optimizer runs the
  // server's update code: every float must match, not just nearly.
  constexpr std::size_t kSteps = 40;
  const std::string config = write_config(1);
  auto server = start_server(config);
  ASSERT_NE(server, nullptr);
  // The training thread pinned (--compute-cpu) and every socket write left
  // to the I/O thread (inline_write = 0, as scripts/demo.sh runs tcp with a
  // spare core): the same floats.
  auto w0 = start_worker(config, 0,
                         {"--epochs", "1", "--max-steps-per-epoch", std::to_string(kSteps),
                          "--progress-every", "0", "--block-rows", "8", "--save-params",
                          path("params.bin"), "--compute-cpu", std::to_string(first_allowed_cpu()),
                          "--set", "communication.inline_write=0"});
  auto data = load_fashion_mnist();
  ASSERT_TRUE(data.has_value()) << data.error().to_string();
  const std::vector<float> reference = train_one_process(*data, kBatch, kSteps, 8);
  ASSERT_EQ(w0->wait_exit(kRunTimeout), 0) << describe(*w0);
  const std::vector<float> p0 = read_floats(path("params.bin"));
  ASSERT_EQ(p0.size(), reference.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < p0.size(); ++i) differ += std::memcmp(&p0[i], &reference[i], 4) != 0;
  EXPECT_EQ(differ, 0u) << "max |ember - one process| = " << max_abs_diff(p0, reference);
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(kStartTimeout), 0) << server->stderr_text();
}

TEST_F(FmnistJob, AspWorkersEvaluateTheSameFinalModel) {
  // Under asp each push is applied on arrival, so a worker's last reply
  // predates the other's last pushes; the end of an epoch (barrier, then a
  // pull) must still leave every worker with the final parameters.
  const std::string config = write_config(2, "asp");
  auto server = start_server(config);
  ASSERT_NE(server, nullptr);
  auto args = [&](int rank) {
    return std::vector<std::string>{"--epochs", "1", "--max-steps-per-epoch", "30",
                                    "--progress-every", "0", "--save-params",
                                    path(fmt::format("params-{}.bin", rank))};
  };
  auto w0 = start_worker(config, 0, args(0));
  auto w1 = start_worker(config, 1, args(1));
  ASSERT_EQ(w0->wait_exit(kRunTimeout), 0) << describe(*w0);
  ASSERT_EQ(w1->wait_exit(kRunTimeout), 0) << describe(*w1);
  const std::vector<float> p0 = read_floats(path("params-0.bin"));
  ASSERT_FALSE(p0.empty());
  EXPECT_EQ(p0, read_floats(path("params-1.bin")));
  EXPECT_EQ(field(lines_with(*w0, "RESULT ")[0], "consistency"), "asp");
  EXPECT_EQ(field(lines_with(*w0, "RESULT ")[0], "test_accuracy"),
            field(lines_with(*w1, "RESULT ")[0], "test_accuracy"));
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(kStartTimeout), 0) << server->stderr_text();
}

TEST_F(FmnistJob, ServerAbsentIsAClearErrorAndExitCode1) {
  // A port nobody listens on: bind one, learn its number, close it.
  {
    auto probe = std::make_unique<Process>(
        std::vector<std::string>{EMBER_SERVER_BIN, "--config", write_config(1), "--listen",
                                 "127.0.0.1:0"},
        path("probe.log"));
    const auto ready = probe->wait_line("ember-server ready", kStartTimeout);
    ASSERT_TRUE(ready.has_value()) << probe->stderr_text();
    std::smatch m;
    ASSERT_TRUE(std::regex_search(*ready, m, std::regex(":([0-9]+) ")));
    port_ = std::stoi(m[1].str());
    probe->signal(SIGTERM);
    ASSERT_EQ(probe->wait_exit(kStartTimeout), 0);
  }
  auto w = start_worker(write_config(1), 0, {"--set", "worker.connect_timeout=1s"});
  EXPECT_EQ(w->wait_exit(kStartTimeout), 1) << describe(*w);
  const std::string err = w->stderr_text();
  EXPECT_NE(err.find("fmnist-worker rank 0: error:"), std::string::npos) << err;
  EXPECT_NE(err.find(fmt::format("cannot connect to server 0 at 127.0.0.1:{}", port_)),
            std::string::npos)
      << err;
  EXPECT_TRUE(lines_with(*w, "RESULT").empty());
}

TEST_F(FmnistJob, ServerKilledMidTrainingStopsEveryWorkerWithAnError) {
  const std::string config = write_config(2);
  auto server = start_server(config);
  ASSERT_NE(server, nullptr);
  const std::vector<std::string> args{"--epochs", "1", "--progress-every", "5"};
  auto w0 = start_worker(config, 0, args);
  auto w1 = start_worker(config, 1, args);
  ASSERT_TRUE(w0->wait_line("progress ", kRunTimeout).has_value()) << describe(*w0);
  server->signal(SIGKILL);
  for (Process* w : {w0.get(), w1.get()}) {
    EXPECT_EQ(w->wait_exit(kStartTimeout), 1) << describe(*w);
    const std::string err = w->stderr_text();
    EXPECT_NE(err.find(": error: "), std::string::npos) << err;
    // The message says where training stopped.
    EXPECT_NE(err.find("epoch 1 step"), std::string::npos) << err;
    EXPECT_TRUE(lines_with(*w, "RESULT").empty());
  }
}

TEST_F(FmnistJob, ServerRestartedFromAnOlderCheckpointWhileARankIsAStepAheadResyncsBoth) {
  std::size_t back_to = 0;
  restart_with_a_rank_ahead(1, 400, 0, back_to);
}

TEST_F(FmnistJob, ServerRestartedFromACheckpointOfAnEarlierEpochTrainsThatEpochAgain) {
  // Killed in epoch 2, restored to a step of epoch 1: both workers train the
  // rest of epoch 1 again, end it (barrier, pull, evaluation: its line is
  // printed twice) and train epoch 2.
  constexpr std::size_t kSteps = 250;
  std::size_t back_to = 0;
  restart_with_a_rank_ahead(2, kSteps, kSteps + 10, back_to);
  if (HasFatalFailure()) return;
  ASSERT_LT(back_to, kSteps) << "checkpoint N was not written in epoch 1 (steps this fast?)";
  for (Process* w : {w0_.get(), w1_.get()}) {
    EXPECT_EQ(lines_with(*w, "epoch 1/2 ").size(), 2u) << describe(*w);
    ASSERT_EQ(lines_with(*w, "epoch 2/2 ").size(), 1u) << describe(*w);
    EXPECT_NE(lines_with(*w, "epoch 2/2 ")[0].find(" redone_steps="), std::string::npos);
  }
}

TEST_F(FmnistJob, HungServerIsATimeoutError) {
  const std::string config = write_config(1);
  auto server = start_server(config);
  ASSERT_NE(server, nullptr);
  auto w = start_worker(config, 0,
                        {"--epochs", "1", "--progress-every", "5", "--set",
                         "worker.request_timeout=2s"});
  ASSERT_TRUE(w->wait_line("progress ", kRunTimeout).has_value()) << describe(*w);
  server->signal(SIGSTOP);  // alive (connections open) but silent
  EXPECT_EQ(w->wait_exit(kStartTimeout), 1) << describe(*w);
  const std::string err = w->stderr_text();
  EXPECT_NE(err.find("error: timeout"), std::string::npos) << err;
  EXPECT_NE(err.find("request_timeout"), std::string::npos) << err;
  server->signal(SIGCONT);
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(kStartTimeout), 0) << server->stderr_text();
}

TEST_F(FmnistJob, LostWorkerFailsTheOthersUnderTheFailPolicy) {
  const std::string config = write_config(2);
  auto server = start_server(config);
  ASSERT_NE(server, nullptr);
  const std::vector<std::string> args{"--epochs", "1", "--progress-every", "5"};
  auto w0 = start_worker(config, 0, args);
  auto w1 = start_worker(config, 1, args);
  ASSERT_TRUE(w1->wait_line("progress ", kRunTimeout).has_value()) << describe(*w1);
  w1->signal(SIGKILL);
  EXPECT_EQ(w0->wait_exit(kStartTimeout), 1) << describe(*w0);
  const std::string err = w0->stderr_text();
  EXPECT_NE(err.find("error: worker_lost"), std::string::npos) << err;
  // The server survives a lost worker and stops cleanly.
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(kStartTimeout), 0) << server->stderr_text();
}

// Reads `p`'s progress lines until one says at least `steps` steps of an
// epoch are done; false at the deadline or when `p` exits first.
bool wait_for_step(Process& p, std::size_t steps) {
  while (newest_step(p) < steps) {
    if (!p.wait_line("progress ", kRunTimeout)) return false;
  }
  return true;
}

// The step of `p`'s "rank <r> rejoins the job at step <s> (...)" line;
// nullopt when there is none.
std::optional<std::uint64_t> rejoin_step(const Process& p) {
  static const std::regex re("^rank [0-9]+ rejoins the job at step ([0-9]+) \\(epoch [0-9]+, "
                             "step [0-9]+ of [0-9]+\\)$");
  for (const auto& l : p.lines()) {
    std::smatch m;
    if (std::regex_match(l, m, re)) return std::stoull(m[1].str());
  }
  return std::nullopt;
}

TEST_F(FmnistJob, WorkersKilledAndRestartedWithRejoinContinueTheJob) {
  // docs/troubleshooting.md#worker-loss: with on_worker_loss = "wait", a
  // worker killed with -9 and restarted with the same rank and --rejoin
  // takes the servers' parameters, continues from their step, and the job
  // ends normally on every worker. Twice: rank 1, then rank 0 (whose init
  // values the servers ignore). Row blocks of 4 (13 keys) and the kill at
  // a progress line of the other rank put it anywhere in a step: measured,
  // about one kill in three lands in backward, with some keys of the step
  // already pushed (the re-sent push path). An epoch of 300 steps leaves
  // 240 steps (about 5 s) between the later kill point and the end of
  // epoch 1, for a test process that reads the progress lines late on a
  // loaded machine: CI once saw a lag of 29 steps, with 100-step epochs
  // close to the 40 then left.
  constexpr std::size_t kSteps = 300;  // per epoch
  const std::string config = write_config(2, "bsp", "wait");
  auto server = start_server(config);
  ASSERT_NE(server, nullptr);
  const std::vector<std::string> args{"--epochs", "2", "--max-steps-per-epoch",
                                      std::to_string(kSteps),
                                      "--progress-every", "1", "--block-rows", "4"};
  std::vector<std::string> rejoin_args = args;
  rejoin_args.push_back("--rejoin");
  std::unique_ptr<Process> w[2] = {start_worker(config, 0, args), start_worker(config, 1, args)};
  struct Kill {
    std::uint32_t rank;
    std::size_t after;  // steps of epoch 1 the rank has printed
  };
  for (const Kill kill : {Kill{1, 20}, Kill{0, 60}}) {
    Process& victim = *w[kill.rank];
    ASSERT_TRUE(wait_for_step(victim, kill.after)) << describe(victim);
    ASSERT_TRUE(wait_for_step(*w[1 - kill.rank], kill.after + 1)) << describe(*w[1 - kill.rank]);
    const std::size_t killed_after = newest_step(victim);
    victim.signal(SIGKILL);
    ASSERT_TRUE(victim.wait_exit(kStartTimeout).has_value());
    ASSERT_TRUE(lines_with(victim, "epoch ").empty()) << "killed too late: " << describe(victim);

    w[kill.rank] = start_worker(config, kill.rank, rejoin_args);
    Process& again = *w[kill.rank];
    // The line itself: one read of the pipe may bring the progress lines
    // after it too (lines().back() was one of them on a loaded machine).
    const std::optional<std::string> joined =
        again.wait_line(fmt::format("rank {} rejoins the job at step", kill.rank), kRunTimeout);
    ASSERT_TRUE(joined.has_value()) << describe(again);
    const auto step = rejoin_step(again);
    ASSERT_TRUE(step.has_value()) << describe(again);
    // The rank printed `after` steps: the replies of step after - 2 were
    // in, so the servers are at step after - 1 or later for every tensor.
    EXPECT_GE(*step, kill.after - 1) << describe(again);
    EXPECT_LT(*step, kSteps) << describe(again);
    EXPECT_EQ(*joined, fmt::format("rank {} rejoins the job at step {} (epoch 1, step {} of {})",
                                   kill.rank, *step, *step, kSteps));
    std::printf("rank %u killed after printing step %zu, rejoined at step %llu\n", kill.rank,
                killed_after, static_cast<unsigned long long>(*step));
  }
  for (int r = 0; r < 2; ++r) ASSERT_EQ(w[r]->wait_exit(kRunTimeout), 0) << describe(*w[r]);

  EXPECT_EQ(count_of(server->stderr_text(), "(rejoining)"), 2u) << server->stderr_text();
  for (int r = 0; r < 2; ++r) {
    // Each rank was restarted once; it trains only the steps left: its
    // epoch 1 line counts the steps after the resume step, and every rank
    // ends at step 2 * kSteps.
    const auto step = rejoin_step(*w[r]);
    ASSERT_TRUE(step.has_value()) << describe(*w[r]);
    const auto epochs = lines_with(*w[r], "epoch ");
    ASSERT_EQ(epochs.size(), 2u) << describe(*w[r]);
    EXPECT_EQ(epochs[0].rfind("epoch 1/2 ", 0), 0u) << epochs[0];
    EXPECT_EQ(field(epochs[0], "steps"), std::to_string(kSteps - *step)) << epochs[0];
    EXPECT_EQ(field(epochs[1], "steps"), std::to_string(kSteps)) << epochs[1];
    EXPECT_EQ(lines_with(*w[r], "progress epoch=1 ").size(), kSteps - *step) << describe(*w[r]);
    const auto result = lines_with(*w[r], "RESULT ");
    ASSERT_EQ(result.size(), 1u) << describe(*w[r]);
    EXPECT_EQ(field(result[0], "steps"), std::to_string(2 * kSteps)) << result[0];
    EXPECT_GT(number(result[0], "test_accuracy"), 0.70) << describe(*w[r]);
  }
  // bsp: the end of the last epoch pulls one model on both.
  EXPECT_EQ(field(lines_with(*w[0], "RESULT ")[0], "test_accuracy"),
            field(lines_with(*w[1], "RESULT ")[0], "test_accuracy"));
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(kStartTimeout), 0) << server->stderr_text();
}

// Two tensors of 2 x 1 (keys 1 and 2), values and gradients per rank, for
// the tests that drive EmberExchange directly.
struct TwoTensors {
  std::vector<float> values = std::vector<float>(4, 1.0f);
  std::vector<float> grads = std::vector<float>(4, 0.0f);
  std::vector<Parameter> params;
  explicit TwoTensors(float gradient) {
    std::fill(grads.begin(), grads.end(), gradient);
    for (std::size_t t = 0; t < 2; ++t) {
      Parameter p;
      p.key = 1 + t;
      p.name = fmt::format("T{}", t);
      p.rows = 2;
      p.cols = 1;
      p.offset = 2 * t;
      p.value = std::span<float>(values).subspan(2 * t, 2);
      p.grad = std::span<float>(grads).subspan(2 * t, 2);
      params.push_back(p);
    }
  }
  std::span<const Parameter> one(std::size_t t) const { return {&params[t], 1}; }
};

// Rejoin under on_worker_loss = "shrink", driven step by step through
// EmberExchange with in-process workers: while rank 1 is gone, rank 0 pushes
// step 1 of tensor 0 alone and its round closes without rank 1. The
// restarted rank 1 finds tensor 0 at step 2 and tensor 1 at step 1, resumes
// at 1 and re-sends step 1 of tensor 0, which the server refuses with
// kStale (it never had rank 1's push): the exchange pulls the tensor
// instead, and both ranks continue with the same parameters.
TEST_F(FmnistJob, RejoinUnderShrinkPullsATensorWhoseRoundClosedWithoutIt) {
  const std::string config_path = write_config(2, "bsp", "shrink");
  auto server = start_server(config_path);
  ASSERT_NE(server, nullptr);
  auto make_worker = [&](std::uint32_t rank) { return in_process_worker(config_path, rank, port_); };
  TwoTensors m0(0.5f), m1(0.25f);
  auto w0 = make_worker(0);
  ASSERT_TRUE(w0) << w0.error().to_string();
  auto w1 = make_worker(1);
  ASSERT_TRUE(w1) << w1.error().to_string();
  EmberExchange ex0(**w0);
  auto ex1 = std::make_unique<EmberExchange>(**w1);
  Status started1 = ok_status();
  std::thread starter([&] { started1 = ex1->start(m1.params); });  // waits for rank 0's init
  ASSERT_TRUE(ex0.start(m0.params));
  starter.join();
  ASSERT_TRUE(started1) << started1.error().to_string();
  // Step 0 with both ranks.
  ASSERT_TRUE(ex0.gradients_ready(0, m0.params));
  ASSERT_TRUE(ex1->gradients_ready(0, m1.params));
  ASSERT_TRUE(ex0.await_parameters(1, m0.params));
  ASSERT_TRUE(ex1->await_parameters(1, m1.params));
  ASSERT_EQ(m0.values, m1.values);
  // Rank 1 goes away; rank 0's round 1 of tensor 0 closes without it (the
  // reply is the proof that the server left rank 1 out).
  ex1.reset();
  w1->reset();
  ASSERT_TRUE(ex0.gradients_ready(1, m0.one(0)));
  ASSERT_TRUE(ex0.await_parameters(2, m0.one(0)));
  // Rank 1 restarts with rejoin.
  auto w1b = make_worker(1);
  ASSERT_TRUE(w1b) << w1b.error().to_string();
  TwoTensors m1b(0.25f);
  EmberExchange ex1b(**w1b, EmberExchangeOptions{.rejoin = true});
  ASSERT_TRUE(ex1b.start(m1b.params));
  EXPECT_EQ(ex1b.resume_step(), 1u);
  // Step 1: tensor 1 with both ranks; rank 1's re-send of tensor 0 is refused
  // (kStale) and pulled instead.
  ASSERT_TRUE(ex0.gradients_ready(1, m0.one(1)));
  ASSERT_TRUE(ex1b.gradients_ready(1, m1b.params));
  ASSERT_TRUE(ex0.await_parameters(2, m0.one(1)));
  Status s = ex1b.await_parameters(2, m1b.params);
  ASSERT_TRUE(s) << s.error().to_string();
  EXPECT_EQ(m0.values, m1b.values);
  // Step 2 as usual, every tensor with both ranks.
  ASSERT_TRUE(ex0.gradients_ready(2, m0.params));
  ASSERT_TRUE(ex1b.gradients_ready(2, m1b.params));
  ASSERT_TRUE(ex0.await_parameters(3, m0.params));
  ASSERT_TRUE(ex1b.await_parameters(3, m1b.params));
  EXPECT_EQ(m0.values, m1b.values);
  ASSERT_TRUE(ex0.sync());
  ASSERT_TRUE(ex1b.sync());
}

// A one-worker job whose rank is restarted twice at one epoch's end (the
// first restart killed right after it rejoined): each rejoin sends a
// barrier, and alone each completes at once, so the barrier count runs one
// ahead of the epochs. finish_epoch took that for restarted servers and
// failed with kInternal (helper-76's repro with fmnist-worker); alone there
// is nobody to wait for, so the rejoin barrier is the epoch's.
TEST_F(FmnistJob, ALoneRankRestartedTwiceAtAnEpochsEndFinishesTheNextEpoch) {
  const std::string config_path = write_config(1, "bsp", "wait");
  auto server = start_server(config_path);
  ASSERT_NE(server, nullptr);
  TwoTensors m(0.5f);
  // One process of the rank: its exchange started (with rejoin after the
  // first), or an error.
  struct Run {
    Result<std::unique_ptr<Worker>> worker;
    std::unique_ptr<EmberExchange> ex;
  };
  auto start = [&](bool rejoin) {
    Run r{in_process_worker(config_path, 0, port_), nullptr};
    if (!r.worker) return r;
    r.ex = std::make_unique<EmberExchange>(**r.worker, EmberExchangeOptions{.rejoin = rejoin});
    if (Status s = r.ex->start(m.params); !s) r.ex.reset();
    return r;
  };
  auto train = [&](EmberExchange& ex, std::uint64_t from, std::uint64_t to) {
    for (std::uint64_t t = from; t < to; ++t) {
      ASSERT_TRUE(ex.gradients_ready(t, m.params));
      ASSERT_TRUE(ex.await_parameters(t + 1, m.params));
    }
  };
  {
    // Epoch 1: steps 0 and 1, then its end (barrier generation 0).
    Run first = start(false);
    ASSERT_TRUE(first.ex);
    ASSERT_NO_FATAL_FAILURE(train(*first.ex, 0, 2));
    Status end = first.ex->finish_epoch(1);
    ASSERT_TRUE(end) << end.error().to_string();
  }  // the process is gone (killed while evaluating)
  {
    // The first restart rejoins after epoch 1 and is killed at once.
    Run second = start(true);
    ASSERT_TRUE(second.ex);
    EXPECT_EQ(second.ex->resume_step(), 2u);
    ASSERT_TRUE(second.ex->resume_after_epoch(1));
    auto g = (*second.worker)->barrier().wait();  // its rejoin barrier has completed by then
    ASSERT_TRUE(g) << g.error().to_string();
  }
  Run third = start(true);
  ASSERT_TRUE(third.ex);
  EXPECT_EQ(third.ex->resume_step(), 2u);
  ASSERT_TRUE(third.ex->resume_after_epoch(1));
  ASSERT_NO_FATAL_FAILURE(train(*third.ex, 2, 4));
  Status end = third.ex->finish_epoch(2);
  ASSERT_TRUE(end) << end.error().to_string();
  // And the epoch after goes as usual.
  ASSERT_NO_FATAL_FAILURE(train(*third.ex, 4, 6));
  end = third.ex->finish_epoch(3);
  ASSERT_TRUE(end) << end.error().to_string();
}

// Under shrink, a worker whose connection dropped (same process, it
// reconnects on its next request) is left out while the others go on; its
// next push is stale. The example trainer goes only back, never ahead
// (ember_exchange.h), so it stops with an error that says to restart the
// rank with --rejoin, rather than an unexplained kStale.
TEST_F(FmnistJob, UnderShrinkARankLeftOutWhileDisconnectedIsToldToRejoin) {
  const std::string config_path = write_config(2, "bsp", "shrink");
  auto server = start_server(config_path);
  ASSERT_NE(server, nullptr);
  ember::testing::TcpProxy proxy(port_);
  auto make_worker = [&](std::uint32_t rank, int port) {
    return in_process_worker(config_path, rank, port, {{"worker.connect_retries", "20"}});
  };
  auto w0 = make_worker(0, port_);
  ASSERT_TRUE(w0) << w0.error().to_string();
  auto w1 = make_worker(1, proxy.port());
  ASSERT_TRUE(w1) << w1.error().to_string();
  TwoTensors m0(0.5f), m1(0.25f);
  EmberExchange ex0(**w0), ex1(**w1);
  Status started1 = ok_status();
  std::thread starter([&] { started1 = ex1.start(m1.params); });  // waits for rank 0's init
  ASSERT_TRUE(ex0.start(m0.params));
  starter.join();
  ASSERT_TRUE(started1) << started1.error().to_string();
  ASSERT_TRUE(ex0.gradients_ready(0, m0.params));
  ASSERT_TRUE(ex1.gradients_ready(0, m1.params));
  ASSERT_TRUE(ex0.await_parameters(1, m0.params));
  ASSERT_TRUE(ex1.await_parameters(1, m1.params));
  proxy.drop_all();
  // Rank 0's step 1 completes once the server left rank 1 out.
  ASSERT_TRUE(ex0.gradients_ready(1, m0.params));
  Status alone = ex0.await_parameters(2, m0.params);
  ASSERT_TRUE(alone) << alone.error().to_string() << "\nserver log:\n" << server->stderr_text();
  ASSERT_TRUE(ex1.gradients_ready(1, m1.params));
  Status left_out = ex1.await_parameters(2, m1.params);
  ASSERT_FALSE(left_out);
  EXPECT_EQ(left_out.error().code(), ErrorCode::kStale) << left_out.error().to_string();
  EXPECT_NE(left_out.error().message().find("restart this rank with its usual command plus --rejoin"),
            std::string::npos)
      << left_out.error().to_string();
  ASSERT_TRUE(ex0.sync());
}

TEST_F(FmnistJob, WorkerRestartedWithoutRejoinIsToldToPassRejoin) {
  // The same restart without --rejoin is refused with a message that names
  // the flag; the refusal leaves the job intact: the rank then rejoins with
  // --rejoin and the job finishes. 150 steps leave the kill at step 10
  // room for a test process that reads progress lines late (see
  // WorkersKilledAndRestartedWithRejoinContinueTheJob).
  constexpr int kSteps = 150;
  const std::string config = write_config(2, "bsp", "wait");
  auto server = start_server(config);
  ASSERT_NE(server, nullptr);
  const std::vector<std::string> args{"--epochs", "1", "--max-steps-per-epoch",
                                      std::to_string(kSteps), "--progress-every", "5"};
  auto w0 = start_worker(config, 0, args);
  auto w1 = start_worker(config, 1, args);
  ASSERT_TRUE(wait_for_step(*w1, 10)) << describe(*w1);
  w1->signal(SIGKILL);
  ASSERT_TRUE(w1->wait_exit(kStartTimeout).has_value());

  auto refused = start_worker(config, 1, args);
  EXPECT_EQ(refused->wait_exit(kRunTimeout), 1) << describe(*refused);
  const std::string err = refused->stderr_text();
  EXPECT_NE(err.find("fmnist-worker rank 1: error: invalid_argument"), std::string::npos) << err;
  EXPECT_NE(err.find("the servers already hold this tensor at step"), std::string::npos) << err;
  EXPECT_NE(err.find("restarted rank of the job they are running, pass --rejoin"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("start fresh servers"), std::string::npos) << err;
  EXPECT_FALSE(rejoin_step(*refused).has_value());
  EXPECT_TRUE(lines_with(*refused, "RESULT").empty());

  std::vector<std::string> again_args = args;
  again_args.push_back("--rejoin");
  auto again = start_worker(config, 1, again_args);
  ASSERT_EQ(again->wait_exit(kRunTimeout), 0) << describe(*again);
  ASSERT_EQ(w0->wait_exit(kRunTimeout), 0) << describe(*w0);
  EXPECT_TRUE(rejoin_step(*again).has_value()) << describe(*again);
  EXPECT_EQ(field(lines_with(*again, "RESULT ")[0], "steps"), std::to_string(kSteps));
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(kStartTimeout), 0) << server->stderr_text();
}

TEST_F(FmnistJob, ServerHoldingAnEarlierJobIsRefused) {
  const std::string config = write_config(1);
  auto server = start_server(config);
  ASSERT_NE(server, nullptr);
  const std::vector<std::string> args{"--epochs", "1", "--max-steps-per-epoch", "5",
                                      "--progress-every", "0"};
  auto first = start_worker(config, 0, args);
  ASSERT_EQ(first->wait_exit(kRunTimeout), 0) << describe(*first);
  auto second = start_worker(config, 0, args);
  EXPECT_EQ(second->wait_exit(kRunTimeout), 1) << describe(*second);
  const std::string err = second->stderr_text();
  EXPECT_NE(err.find("already hold this tensor at step 5"), std::string::npos) << err;
  EXPECT_NE(err.find("start fresh servers"), std::string::npos) << err;
  EXPECT_NE(err.find("pass --rejoin"), std::string::npos) << err;
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(kStartTimeout), 0) << server->stderr_text();
}

TEST_F(FmnistJob, ComputeCpuOutsideTheAffinityMaskIsRefusedBeforeConnecting) {
  port_ = 1;  // never reached: the option is refused first
  auto w = start_worker(write_config(1), 0, {"--compute-cpu", "1023"});
  EXPECT_EQ(w->wait_exit(kStartTimeout), 1) << describe(*w);
  const std::string err = w->stderr_text();
  EXPECT_NE(err.find("--compute-cpu 1023: CPU 1023 is not in this process's allowed CPUs"),
            std::string::npos)
      << err;
}

TEST_F(FmnistJob, BadRankAndMissingConfigAreRefused) {
  port_ = 1;  // never reached: the config is refused first
  auto bad_rank = start_worker(write_config(2), 2, {});
  EXPECT_EQ(bad_rank->wait_exit(kStartTimeout), 1) << describe(*bad_rank);
  EXPECT_NE(bad_rank->stderr_text().find("rank"), std::string::npos) << bad_rank->stderr_text();

  // Command-line errors (the --config file's absence is CLI11's check)
  // exit 2, naming the argument; errors after parsing exit 1 (above).
  Process missing({FMNIST_WORKER_BIN, "--config", path("no-such.toml")}, path("missing.log"));
  EXPECT_EQ(missing.wait_exit(kStartTimeout), 2) << describe(missing);
  EXPECT_NE(missing.stderr_text().find("no-such.toml"), std::string::npos) << missing.stderr_text();
  Process unknown({FMNIST_WORKER_BIN, "--config", write_config(1), "--epoch", "3"},
                  path("unknown.log"));
  EXPECT_EQ(unknown.wait_exit(kStartTimeout), 2) << describe(unknown);
  EXPECT_NE(unknown.stderr_text().find("--epoch"), std::string::npos) << unknown.stderr_text();
  Process bad_level({FMNIST_WORKER_BIN, "--config", write_config(1), "--log-level", "bogus"},
                    path("bad-level.log"));
  EXPECT_EQ(bad_level.wait_exit(kStartTimeout), 2) << describe(bad_level);
  EXPECT_NE(bad_level.stderr_text().find("--log-level"), std::string::npos)
      << bad_level.stderr_text();
  // A wrong --data-dir is reported before connecting: no server listens on
  // port 1, and the error is the data's, not the connect retries'.
  const std::string no_data = path("no-data");
  Process data_missing({FMNIST_WORKER_BIN, "--config", write_config(1), "--data-dir", no_data},
                       path("no-data.log"));
  EXPECT_EQ(data_missing.wait_exit(kStartTimeout), 1) << describe(data_missing);
  const std::string err = data_missing.stderr_text();
  EXPECT_NE(err.find(no_data + "/train-images-idx3-ubyte.gz: no such file; install the Debian "
                               "package dataset-fashion-mnist"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("cannot connect"), std::string::npos) << err;
}

}  // namespace
}  // namespace ember::fashion_mnist
