// Adversarial end-to-end checks of the shm quarantine (commit ed2b315:
// payloads lent to a peer that stalls past heartbeat_timeout stay out of
// their owner's pool until it gives them back, is torn down or exits), with
// a real ember-server over shm:
//  - the server is stopped (SIGSTOP) while it holds worker 1's lent push in
//    an open bsp round; worker 1's connection times out and the push is done
//    (at most heartbeat_timeout after the close); worker 1 then fills fresh
//    pool blocks with garbage. After SIGCONT the round completes with worker
//    1's original bytes (the quarantined block was not reused), and the
//    workers go away within bounds;
//  - a Worker destroyed while a healthy server holds its push in an open bsp
//    round must return (disabled: it hangs, see the test);
//  - SIGTERM to a server whose worker is stopped with a lent pull reply
//    unread in its lane: the server must still exit (disabled: it hangs).
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>

#include <gtest/gtest.h>

#include "tests/integration/server/harness.h"
#include "tests/integration/server/workers.h"
#include "worker/worker.h"

namespace ember::test {
namespace {

constexpr std::uint64_t kElements = 512 * 1024;  // 2 MiB: one chunk, a large (lent) message over shm

// Destroys `w` on another thread; done() within a deadline tells whether
// ~Worker returned.
struct Destroy {
  explicit Destroy(std::unique_ptr<Worker> w)
      : thread([this, w = std::move(w)]() mutable {
          w.reset();
          std::lock_guard lock(mu);
          finished = true;
          cv.notify_all();
        }) {}
  ~Destroy() { thread.join(); }
  bool done(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, timeout, [&] { return finished; });
  }
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  std::thread thread;
};

long metric(const ServerProcess& server, const std::string& name) {
  return metric_value(http_get(server.metrics_address(), "/metrics"), name);
}

// Waits until `metric` of `server` reaches at least `at_least` (20 s).
bool wait_metric(const ServerProcess& server, const std::string& name, long at_least) {
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < until) {
    if (metric(server, name) >= at_least) return true;
    std::this_thread::yield();
  }
  return false;
}

TEST(ShmStalledServer, HeldPushSurvivesTheStallAndTheRoundUsesItsOriginalBytes) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;
  spec.learning_rate = 0.5;
  spec.worker_timeout = "60s";  // rank 1's reconnect must not count as a loss
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()});
  for (auto& w : workers) ASSERT_TRUE(w);
  const std::uint64_t shape[] = {kElements};
  const std::vector<float> init(kElements, 4.0f);
  on_all(2, [&](std::uint32_t r) {
    auto res = workers[r]->init(1, shape, r == 0 ? std::span<const float>(init) : std::span<const float>())
                   .wait();
    ASSERT_TRUE(res) << res.error().to_string();
  });
  // Rank 1 pushes first: the server keeps its contribution (the lent pool
  // copy of this heap gradient) until rank 0's arrives.
  // The stop comes once the server has sent the push's reply (into the
  // shared ring, where the worker reads it while the server is stopped):
  // its bytes received rising is too early, the shard may not have handled
  // the push yet, and then the push has no reply and fails.
  const long received_before = metric(server, "ember_server_bytes_received_total");
  const long sent_before = metric(server, "ember_server_messages_sent_total");
  std::vector<float> g1(kElements, 3.0f);
  Handle h1 = workers[1]->push(1, g1);
  ASSERT_TRUE(wait_metric(server, "ember_server_bytes_received_total",
                          received_before + static_cast<long>(kElements * 4)));
  ASSERT_TRUE(wait_metric(server, "ember_server_messages_sent_total", sent_before + 1));
  server.process().signal(SIGSTOP);
  // Declared dead after heartbeat_timeout (2 s); the push is done at most
  // heartbeat_timeout after that (its reply came at once), while the server
  // still maps the block.
  const auto t0 = std::chrono::steady_clock::now();
  auto r1 = h1.wait();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  ASSERT_TRUE(r1) << r1.error().to_string();
  // Worker 1 goes on: fresh pool blocks of the same class, filled with
  // garbage. Were the quarantined block back in the pool, one of these would
  // be it, and the stopped server would fold 1000s into round 0.
  std::vector<TensorBuffer> junk;
  for (int i = 0; i < 6; ++i) {
    junk.push_back(workers[1]->allocate(kElements * 4));
    for (float& f : junk.back().floats()) f = 1000.0f;
  }
  server.process().signal(SIGCONT);
  // Rank 0's push completes round 0: mean (1 + 3) / 2 = 2, times lr 0.5.
  std::vector<float> g0(kElements, 1.0f);
  auto r0 = workers[0]->push(1, g0).wait();
  ASSERT_TRUE(r0) << r0.error().to_string();
  on_all(2, [&](std::uint32_t r) {
    std::vector<float> out(kElements, -1.0f);
    auto p = workers[r]->pull(1, out).wait();
    ASSERT_TRUE(p) << p.error().to_string();
    EXPECT_EQ(out.front(), 3.0f) << "rank " << r;
    EXPECT_EQ(out.back(), 3.0f) << "rank " << r;
    EXPECT_EQ(std::count(out.begin(), out.end(), 3.0f), static_cast<std::ptrdiff_t>(kElements));
  });
  junk.clear();
  // Nothing is held any more: the workers go away at once.
  for (auto& w : workers) {
    Destroy d(std::move(w));
    EXPECT_TRUE(d.done(10s)) << "~Worker blocked";
    if (!d.done(0ms)) server.process().signal(SIGKILL);
  }
  server.process().signal(SIGTERM);
  EXPECT_TRUE(server.process().wait_exit(20s)) << server.log();
}

// Regression (found in ed2b315, fixed since): a Worker destroyed while a healthy server holds its bsp
// push in an open round (the first contribution waits for the second,
// shard_core.h) does not return. The close quarantines the lent pool block
// (the server may still read it, and will when the round completes), and
// ~Transport -> IoThreads::join_when_idle() waits for I/O context 0, where
// the quarantine's poll timer re-arms for as long as the block is held: until
// the round completes or the server exits, possibly never (before ed2b315 the
// block was taken back at the close and ~Worker returned at once). A rank
// that gives up after an error cannot exit.
TEST(ShmHeldPush, WorkerDestroyedWhileTheServerHoldsItsPushReturns) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;
  spec.worker_timeout = "60s";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()});
  for (auto& w : workers) ASSERT_TRUE(w);
  const std::uint64_t shape[] = {kElements};
  const std::vector<float> init(kElements, 1.0f);
  on_all(2, [&](std::uint32_t r) {
    auto res = workers[r]->init(1, shape, r == 0 ? std::span<const float>(init) : std::span<const float>())
                   .wait();
    ASSERT_TRUE(res) << res.error().to_string();
  });
  const long m0 = metric(server, "ember_server_messages_received_total");
  std::vector<float> g(kElements, 1.0f);
  {
    Handle h0 = workers[0]->push(1, g);  // held by the server until rank 1 pushes
    ASSERT_TRUE(wait_metric(server, "ember_server_messages_received_total", m0 + 2));  // header, data
    Destroy d(std::move(workers[0]));
    const bool returned = d.done(10s);
    EXPECT_TRUE(returned) << "~Worker blocked 10 s (heartbeat_timeout is 2 s) while the server "
                             "holds its push in an open round";
    if (!returned) server.process().signal(SIGKILL);  // its pidfd lets the quarantine go
  }
  workers.clear();
}

// Regression (found in ed2b315, fixed since): a server whose worker is stopped (SIGSTOP, a debugger)
// with a large pull reply lent to it and not yet read never exits on
// SIGTERM. Server::Impl::shutdown() closes the connection (the worker cannot
// answer: the drain fails it), the reply goes to the shm quarantine, and
// transport.reset() -> ~ShmTransport -> IoThreads::join_when_idle() waits for
// I/O context 0 to run out of work, which it never does while the
// quarantine's poll timer re-arms for a held payload. No checkpoint is
// written; systemd ends it with SIGKILL. It exits only once the worker
// process is gone (pidfd) or wakes up and releases the reply
// (tests/unit/transport/shm_quarantine_test.cc has the transport-level
// reproducer).
TEST(ShmStalledWorker, ServerExitsOnSigtermWhileAStoppedWorkerHoldsALentReply) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 3;
  spec.worker_timeout = "60s";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  const auto w1_config = dir / "worker.toml";
  write_file(w1_config, cluster_toml(spec, {server.address()}));
  auto w0 = Worker::create(worker_config(spec, {server.address()}, 0));
  ASSERT_TRUE(w0) << w0.error().to_string();
  auto w2 = Worker::create(worker_config(spec, {server.address()}, 2));
  ASSERT_TRUE(w2) << w2.error().to_string();
  const std::uint64_t shape[] = {kElements};
  std::vector<float> init(kElements, 1.0f);
  ASSERT_TRUE((*w0)->init(1, shape, init).wait());
  ASSERT_TRUE((*w2)->init(1, shape, {}).wait());
  std::vector<float> g(kElements, 1.0f);
  // Rank 0's push of step 0 is folded (and done) once rank 1's is in.
  const long m0 = metric(server, "ember_server_messages_received_total");
  Handle h0 = (*w0)->push(1, g);
  // Worker 1 (a process): init, push step 0, then pull step 1, which waits
  // for rank 2.
  Process w1(test_worker_binary(),
             {"--config", w1_config.string(), "--rank", "1", "--key", "1", "--elements",
              std::to_string(kElements), "--steps", "1"},
             dir / "worker1.log");
  ASSERT_TRUE(w1.wait_line("pushed 0"));
  {
    auto r0 = h0.wait();
    ASSERT_TRUE(r0) << r0.error().to_string();
  }
  // Worker 1's pull has reached the server: 7 messages since m0 (rank 0's
  // push: header and data; worker 1's join, init, push header and data, pull).
  ASSERT_TRUE(wait_metric(server, "ember_server_messages_received_total", m0 + 7));
  w1.signal(SIGSTOP);
  const long sent_before = metric(server, "ember_server_bytes_sent_total");
  ASSERT_TRUE((*w2)->push(1, g).wait());  // completes round 0: w1's reply is sent, lent
  ASSERT_TRUE(wait_metric(server, "ember_server_bytes_sent_total",
                          sent_before + static_cast<long>(kElements * 4)));
  server.process().signal(SIGTERM);
  const auto status = server.process().wait_exit(15s);
  EXPECT_TRUE(status) << "ember-server did not exit within 15 s of SIGTERM while worker 1 is "
                         "stopped; log:\n"
                      << server.log();
  w1.signal(SIGKILL);  // its pidfd lets the quarantine go
  if (!status) {
    EXPECT_TRUE(server.process().wait_exit(10s)) << "not even after the worker died";
  }
}

}  // namespace
}  // namespace ember::test
