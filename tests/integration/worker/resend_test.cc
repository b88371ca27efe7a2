// Re-sending after a lost connection ([worker] resend_attempts), through
// real ember-server processes on 127.0.0.1:
//  * kill -9 the server while a BSP push_pull waits for the other worker,
//    restart it on the same port from its checkpoint: the pending operation
//    completes without the caller retrying, and the gradient was applied
//    exactly once (bit-identical to a server that never died);
//  * resend_attempts = 0: the operation fails with kClosed, as before;
//  * SIGSTOP the server past heartbeat_timeout after it recorded a push: the
//    worker's re-send reaches the same server, which deduplicates it (the
//    gradient counts once);
//  * a server that never comes back: the operation fails within
//    request_timeout with an error naming the server, the attempts and the
//    knob (attempts used up first, or the timeout first);
//  * while the re-sender reconnects (a long connect cycle), a new call
//    returns its Handle within its request_timeout, and a rejoin of another
//    server (which compares settings with every server) does not wait for
//    that cycle;
//  * a sender stalled (sync point) between its check for queued re-sends
//    and asking for its connection, while the connection is lost and the
//    re-sender reconnects: its request still goes after the re-sends.
// Nothing sleeps to wait: processes are awaited through their stdout and
// pidfd with deadlines, operations through their Handles.
#include <signal.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/base/logging.h"
#include "common/base/sync_point.h"
#include "common/placement/placement.h"
#include "tests/integration/examples/tcp_proxy.h"
#include "tests/integration/server/harness.h"
#include "tests/integration/server/log_watch.h"
#include "worker/worker.h"

namespace ember::test {
namespace {

using ::testing::HasSubstr;

constexpr Key kKey = 7;
const std::uint64_t kShape[] = {4, 8};
constexpr std::size_t kElements = 32;

std::vector<float> initial() {
  std::vector<float> v(kElements);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * static_cast<float>(i) - 3.0f;
  return v;
}

// Different per rank and step, so that a gradient applied twice (or not at
// all) changes the parameters.
std::vector<float> gradient(std::uint32_t rank, int step) {
  std::vector<float> g(kElements);
  for (std::size_t i = 0; i < g.size(); ++i) {
    g[i] = std::sin(static_cast<float>(step * 97 + static_cast<int>(i) * 13 + static_cast<int>(rank) * 7));
  }
  return g;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i])) return false;
  }
  return true;
}

std::unique_ptr<Worker> make_worker(const ClusterSpec& spec, const std::string& address,
                                    std::uint32_t rank,
                                    const std::vector<std::pair<std::string, std::string>>& set = {}) {
  config::Config c = worker_config(spec, {address}, rank);
  for (const auto& [k, v] : set) {
    Status s = config::set_value(c, k, v);
    EXPECT_TRUE(s) << k << ": " << s.error().to_string();
  }
  auto w = Worker::create(c);
  EXPECT_TRUE(w) << w.error().to_string();
  return w ? std::move(*w) : nullptr;
}

using Settings = std::vector<std::pair<std::string, std::string>>;

// Server 0 and two workers, for the barrier tests; worker 0 takes `w0_set`.
struct BarrierJob {
  TempDir dir;
  ClusterSpec spec;
  std::unique_ptr<ServerProcess> server;
  std::unique_ptr<Worker> w0, w1;
  explicit BarrierJob(const Settings& w0_set = {}) {
    spec.num_workers = 2;
    spec.worker_timeout = "20s";
    server = std::make_unique<ServerProcess>(dir, spec, 0);
    if (!server->ok()) return;
    w0 = make_worker(spec, server->address(), 0, w0_set);
    w1 = make_worker(spec, server->address(), 1);
  }
  bool ok() const { return server->ok() && w0 && w1; }
};

// A loopback proxy in front of `server`, for a worker to connect through
// (fault injection: hold, drop).
std::unique_ptr<ember::testing::TcpProxy> proxy_to(const ServerProcess& server) {
  const std::string& real = server.address();
  return std::make_unique<ember::testing::TcpProxy>(std::stoi(real.substr(real.rfind(':') + 1)));
}

// A worker of `spec` (1 worker) connected through `proxy`, with `key`
// registered as 4 zeros.
std::unique_ptr<Worker> proxied_worker(const ClusterSpec& spec, const ember::testing::TcpProxy& proxy,
                                       std::uint32_t resend_attempts, Key key) {
  auto w = make_worker(spec, fmt::format("127.0.0.1:{}", proxy.port()), 0,
                       {{"worker.resend_attempts", std::to_string(resend_attempts)},
                        {"worker.connect_retries", "20"}});
  if (!w) return nullptr;
  const std::uint64_t shape[] = {4};
  auto r = w->init(key, shape, std::vector<float>(4, 0.0f)).wait();
  EXPECT_TRUE(r) << r.error().to_string();
  return r ? std::move(w) : nullptr;
}

// init on both workers (rank 0 gives the values).
void init_both(Worker& w0, Worker& w1) {
  auto i1 = w1.init(kKey, kShape, {});
  auto r0 = w0.init(kKey, kShape, initial()).wait();
  ASSERT_TRUE(r0) << r0.error().to_string();
  auto r1 = i1.wait();
  ASSERT_TRUE(r1) << r1.error().to_string();
}

// One BSP step of both workers; the parameters after it land in p0 and p1.
void step_both(Worker& w0, Worker& w1, int t, std::vector<float>& p0, std::vector<float>& p1) {
  // Gradients stay valid until their operations are done (a re-send reads them again).
  const std::vector<float> g0 = gradient(0, t), g1 = gradient(1, t);
  auto h1 = w1.push_pull(kKey, g1, p1);
  auto r0 = w0.push_pull(kKey, g0, p0).wait();
  ASSERT_TRUE(r0) << "step " << t << ": " << r0.error().to_string();
  auto r1 = h1.wait();
  ASSERT_TRUE(r1) << "step " << t << ": " << r1.error().to_string();
}

// Waits for `h`: it must succeed with step (or barrier generation) `step`.
void expect_done_at(const Handle& h, std::uint64_t step) {
  auto r = h.wait();
  ASSERT_TRUE(r) << r.error().to_string();
  EXPECT_EQ(*r, step);
}

void kill_nine(ServerProcess& server) {
  server.process().signal(SIGKILL);
  ASSERT_TRUE(server.process().wait_exit());
}

TEST(WorkerResend, PushPullPendingAcrossAKilledAndRestartedServerCompletesAndIsAppliedOnce) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_workers = 2;
  spec.optimizer = "adam";  // a gradient applied twice also moves Adam's moments
  spec.learning_rate = 0.05;
  spec.checkpoint_dir = (dir / "ckpt").string();
  std::vector<float> p0(kElements), p1(kElements);
  auto server = std::make_unique<ServerProcess>(dir, spec, 0);
  ASSERT_TRUE(server->ok());
  const std::string address = server->address();
  auto w0 = make_worker(spec, address, 0);
  auto w1 = make_worker(spec, address, 1);
  ASSERT_TRUE(w0 && w1);
  init_both(*w0, *w1);
  for (int t = 0; t < 2; ++t) step_both(*w0, *w1, t, p0, p1);
  auto seq = w0->checkpoint().wait();
  ASSERT_TRUE(seq) << seq.error().to_string();

  // Step 2: worker 0's push_pull waits for worker 1's push, which comes only
  // after the server died and came back.
  const std::vector<float> g0 = gradient(0, 2), g1 = gradient(1, 2);  // valid until done
  Handle pending = w0->push_pull(kKey, g0, p0);
  kill_nine(*server);
  EXPECT_FALSE(pending.ready());
  auto again = restart_server(dir, address, "server0-restarted.log");
  ASSERT_TRUE(again->running());
  EXPECT_THAT(read_file(dir / "server0-restarted.log"), HasSubstr("restored checkpoint"));
  auto r1 = w1->push_pull(kKey, g1, p1).wait();
  ASSERT_TRUE(r1) << r1.error().to_string();
  auto r0 = pending.wait();  // no retry by the caller
  ASSERT_TRUE(r0) << r0.error().to_string();
  EXPECT_EQ(*r0, 3u);
  EXPECT_EQ(*r1, 3u);
  EXPECT_TRUE(same_bits(p0, p1));
  // The job goes on from there.
  step_both(*w0, *w1, 3, p0, p1);
  // The worker rejoined the restarted server.
  EXPECT_THAT(read_file(dir / "server0-restarted.log"), HasSubstr("worker 0 connected"));

  // The same four steps on a server that never died.
  TempDir ref_dir;
  ClusterSpec ref_spec = spec;
  ref_spec.checkpoint_dir = "";
  ServerProcess ref(ref_dir, ref_spec, 0);
  ASSERT_TRUE(ref.ok());
  auto v0 = make_worker(ref_spec, ref.address(), 0);
  auto v1 = make_worker(ref_spec, ref.address(), 1);
  ASSERT_TRUE(v0 && v1);
  init_both(*v0, *v1);
  std::vector<float> q0(kElements), q1(kElements);
  for (int t = 0; t < 4; ++t) step_both(*v0, *v1, t, q0, q1);
  EXPECT_TRUE(same_bits(p0, q0)) << "the re-sent step was not applied exactly once: "
                                 << fmt::format("{} vs {}", fmt::join(p0, ","), fmt::join(q0, ","));
  EXPECT_TRUE(same_bits(p1, q1));
}

using ember::testing::WorkerLogWatch;

TEST(WorkerResend, ResendToAServerThatKeptItsStateIsDeduplicated) {
  WorkerLogWatch log_watch;  // before the Workers: see log_watch.h
  TempDir dir;
  ClusterSpec spec;
  spec.num_workers = 2;
  spec.learning_rate = 0.5;
  spec.worker_timeout = "20s";
  auto server = std::make_unique<ServerProcess>(dir, spec, 0);
  ASSERT_TRUE(server->ok());
  auto w0 = make_worker(spec, server->address(), 0);
  auto w1 = make_worker(spec, server->address(), 1);
  ASSERT_TRUE(w0 && w1);
  init_both(*w0, *w1);
  std::vector<float> p0(kElements), p1(kElements);
  step_both(*w0, *w1, 0, p0, p1);

  const std::vector<float> g0 = gradient(0, 1), g1 = gradient(1, 1);  // valid until done
  Handle pending = w0->push_pull(kKey, g0, p0);
  // Wait until the server recorded worker 0's push of step 1 (its metrics).
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  bool recorded = false;
  while (!recorded && std::chrono::steady_clock::now() < deadline) {
    recorded = http_get(server->metrics_address(), "/metrics")
                   .find("ember_server_worker_step{rank=\"0\"} 1") != std::string::npos;
  }
  ASSERT_TRUE(recorded) << http_get(server->metrics_address(), "/metrics");

  // Frozen past heartbeat_timeout (2s): the worker gives the connection up
  // (kTimeout) and re-sends to the same server once it answers again.
  server->process().signal(SIGSTOP);
  const bool noticed = log_watch.watch->wait_for("reconnecting to re-send 1 request(s)", 15s);
  server->process().signal(SIGCONT);
  ASSERT_TRUE(noticed);
  auto r1 = w1->push_pull(kKey, g1, p1).wait();
  ASSERT_TRUE(r1) << r1.error().to_string();
  auto r0 = pending.wait();
  ASSERT_TRUE(r0) << r0.error().to_string();
  EXPECT_EQ(*r0, 2u);
  EXPECT_TRUE(same_bits(p0, p1));
  // By hand (sgd, lr 0.5, mean of the two ranks' gradients per step).
  std::vector<float> expect = initial();
  for (int t = 0; t < 2; ++t) {
    const auto a = gradient(0, t), b = gradient(1, t);
    for (std::size_t i = 0; i < kElements; ++i) expect[i] -= 0.5f * ((a[i] + b[i]) / 2.0f);
  }
  EXPECT_TRUE(same_bits(p0, expect)) << "the re-sent push was not applied exactly once: "
                                     << fmt::format("{} vs {}", fmt::join(p0, ","),
                                                    fmt::join(expect, ","));
}

// A barrier whose answer is lost with its connection is re-sent; the
// server answers it again rather than counting it in the next barrier,
// which would release worker 0's next barrier before worker 1 calls it.
TEST(WorkerResend, ABarrierReSentAfterItsAnswerWasLostIsNotCountedInTheNext) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_workers = 2;
  spec.worker_timeout = "20s";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto proxy = proxy_to(server);
  auto w0 = make_worker(spec, server.address(), 0);
  auto w1 = make_worker(spec, fmt::format("127.0.0.1:{}", proxy->port()), 1,
                        {{"worker.connect_retries", "20"}});
  ASSERT_TRUE(w0 && w1);
  Handle b1 = w1->barrier();
  proxy->hold_replies();
  // Both arrived: answered, worker 1's answer held.
  ASSERT_NO_FATAL_FAILURE(expect_done_at(w0->barrier(), 0));
  proxy->drop_all();  // worker 1 re-sends its barrier on a new connection
  ASSERT_NO_FATAL_FAILURE(expect_done_at(b1, 0));
  Handle next0 = w0->barrier();
  EXPECT_FALSE(next0.wait_for(500ms)) << "worker 0's second barrier returned alone";
  EXPECT_FALSE(next0.ready());
  ASSERT_NO_FATAL_FAILURE(expect_done_at(w1->barrier(), 1));
  ASSERT_NO_FATAL_FAILURE(expect_done_at(next0, 1));
}

// barrier() twice before the first finished, on both workers: each call
// completes with its own generation (the second used to replace the first,
// whose caller then timed out).
TEST(WorkerResend, TwoBarriersInFlightPerWorkerCompleteInOrder) {
  BarrierJob job;
  ASSERT_TRUE(job.ok());
  auto& w0 = job.w0;
  auto& w1 = job.w1;
  Handle a0 = w0->barrier(), b0 = w0->barrier();
  Handle a1 = w1->barrier(), b1 = w1->barrier();
  for (const Handle* h : {&a0, &a1}) ASSERT_NO_FATAL_FAILURE(expect_done_at(*h, 0));
  for (const Handle* h : {&b0, &b1}) ASSERT_NO_FATAL_FAILURE(expect_done_at(*h, 1));
}

// A barrier that timed out gives its number back: the caller's retry is
// the same barrier (server 0 replaces the one still waiting), so the job's
// barriers stay paired; had the retry taken the next number, it would wait
// a generation behind the other worker for good.
TEST(WorkerResend, ARetriedTimedOutBarrierIsTheSameBarrier) {
  BarrierJob job(Settings{{"worker.request_timeout", "1s"}});
  ASSERT_TRUE(job.ok());
  auto& w0 = job.w0;
  auto& w1 = job.w1;
  auto timed_out = w0->barrier().wait();
  ASSERT_FALSE(timed_out);
  EXPECT_EQ(timed_out.error().code(), ErrorCode::kTimeout) << timed_out.error().to_string();
  Handle retry = w0->barrier();
  ASSERT_NO_FATAL_FAILURE(expect_done_at(w1->barrier(), 0));
  ASSERT_NO_FATAL_FAILURE(expect_done_at(retry, 0));
  Handle next1 = w1->barrier();
  ASSERT_NO_FATAL_FAILURE(expect_done_at(w0->barrier(), 1));
  ASSERT_NO_FATAL_FAILURE(expect_done_at(next1, 1));
}

// Two barriers in flight, both timed out: the worker fails them oldest
// first, and both numbers come back (the first is remembered until the
// second, then the top one, fails), so the two retries are the same two
// barriers and pair with the other worker's first two.
TEST(WorkerResend, TwoTimedOutBarriersRetriedAreTheSameTwo) {
  BarrierJob job(Settings{{"worker.request_timeout", "1s"}});
  ASSERT_TRUE(job.ok());
  auto& w0 = job.w0;
  auto& w1 = job.w1;
  Handle a = w0->barrier(), b = w0->barrier();
  ASSERT_FALSE(a.wait());
  ASSERT_FALSE(b.wait());
  Handle retry_a = w0->barrier(), retry_b = w0->barrier();
  Handle a1 = w1->barrier(), b1 = w1->barrier();
  ASSERT_NO_FATAL_FAILURE(expect_done_at(a1, 0));
  ASSERT_NO_FATAL_FAILURE(expect_done_at(b1, 1));
  ASSERT_NO_FATAL_FAILURE(expect_done_at(retry_a, 0));
  ASSERT_NO_FATAL_FAILURE(expect_done_at(retry_b, 1));
}

// A worker restarted with the same rank numbers its barriers on from where
// its predecessor stopped (server 0's join reply): its first barrier is the
// job's next one, not a re-send of the predecessor's answered one.
TEST(WorkerResend, ARestartedWorkersFirstBarrierWaitsForTheOthers) {
  BarrierJob job;
  ASSERT_TRUE(job.ok());
  auto& w0 = job.w0;
  auto& w1 = job.w1;
  Handle b1 = w1->barrier();
  ASSERT_TRUE(w0->barrier().wait());
  ASSERT_TRUE(b1.wait());
  w1.reset();
  w1 = make_worker(job.spec, job.server->address(), 1);  // the restarted rank 1
  ASSERT_TRUE(w1);
  Handle again = w1->barrier();
  EXPECT_FALSE(again.wait_for(500ms)) << "the restarted worker's barrier returned alone";
  ASSERT_NO_FATAL_FAILURE(expect_done_at(w0->barrier(), 1));
  ASSERT_NO_FATAL_FAILURE(expect_done_at(again, 1));
}

// on_worker_loss = "shrink": worker 1's connection is cut, the server leaves
// it out, and worker 0 goes on alone. Worker 1's next push is stale; its
// step(key) then moves to the server's step, so after a pull it pushes into
// the open round (before, every push of it came back stale, forever).
TEST(WorkerResend, UnderShrinkAWorkerLeftOutCatchesUpAfterAStalePush) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_workers = 2;
  spec.loss_policy = "shrink";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto proxy = proxy_to(server);
  auto w0 = make_worker(spec, server.address(), 0);
  auto w1 = make_worker(spec, fmt::format("127.0.0.1:{}", proxy->port()), 1,
                        {{"worker.connect_retries", "20"}});
  ASSERT_TRUE(w0 && w1);
  ASSERT_NO_FATAL_FAILURE(init_both(*w0, *w1));
  std::vector<float> p0(kElements), p1(kElements);
  ASSERT_NO_FATAL_FAILURE(step_both(*w0, *w1, 0, p0, p1));
  proxy->drop_all();
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (server.log().find("worker 1 (") == std::string::npos ||
         server.log().find(" lost: ") == std::string::npos) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << server.log();
    std::this_thread::sleep_for(20ms);
  }
  for (int t = 1; t <= 2; ++t) {  // worker 0 alone
    const std::vector<float> g = gradient(0, t);
    auto r = w0->push_pull(kKey, g, p0).wait();
    ASSERT_TRUE(r) << "step " << t << ": " << r.error().to_string();
  }
  const std::vector<float> g1 = gradient(1, 1);
  auto stale = w1->push_pull(kKey, g1, p1).wait();
  ASSERT_FALSE(stale);
  EXPECT_EQ(stale.error().code(), ErrorCode::kStale) << stale.error().to_string();
  EXPECT_EQ(w1->step(kKey), 3u);
  ASSERT_TRUE(w1->pull(kKey, p1).wait());
  EXPECT_TRUE(same_bits(p0, p1));
  ASSERT_NO_FATAL_FAILURE(step_both(*w0, *w1, 3, p0, p1));
  EXPECT_EQ(w0->step(kKey), 4u);
  EXPECT_EQ(w1->step(kKey), 4u);
  EXPECT_TRUE(same_bits(p0, p1));
}

// Worker 0 of a two-worker job pushes step 0 and pulls step 1, which waits
// for worker 1's push of step 0 (worker 1 never comes) when the server is
// killed. (A pull of step 1 without its own push of step 0 would wait on
// itself: the server refuses it at once with kOutOfStep.)
struct PendingPull {
  TempDir dir;
  ClusterSpec spec;
  std::unique_ptr<ServerProcess> server;
  std::unique_ptr<Worker> worker;
  std::vector<float> out = std::vector<float>(kElements, -1.0f);

  using Settings = std::vector<std::pair<std::string, std::string>>;
  explicit PendingPull(const Settings& set,
                       const std::string& request_timeout = "20s") {
    spec.num_workers = 2;
    spec.request_timeout = request_timeout;
    server = std::make_unique<ServerProcess>(dir, spec, 0);
    if (!server->ok()) return;
    worker = make_worker(spec, server->address(), 0, set);
    if (!worker) return;
    auto r = worker->init(kKey, kShape, initial()).wait();
    EXPECT_TRUE(r) << r.error().to_string();
    auto p = worker->push(kKey, gradient(0, 0)).wait();
    EXPECT_TRUE(p) << p.error().to_string();
  }
  Handle pull_step_1() { return worker->pull(kKey, out, 1); }
};

TEST(WorkerResend, ZeroAttemptsFailsWithClosedAtOnce) {
  PendingPull s(PendingPull::Settings{{"worker.resend_attempts", "0"}});
  ASSERT_TRUE(s.worker);
  Handle pending = s.pull_step_1();
  EXPECT_FALSE(pending.ready());
  const auto t0 = std::chrono::steady_clock::now();
  kill_nine(*s.server);
  auto r = pending.wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kClosed) << r.error().to_string();
  EXPECT_THAT(r.error().message(),
              HasSubstr(fmt::format("connection to server 0 ({}) lost before the reply",
                                    s.server->address())));
  EXPECT_THAT(r.error().message(), HasSubstr("not re-sent ([worker] resend_attempts = 0)"));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_EQ(s.out, std::vector<float>(kElements, -1.0f));
}

TEST(WorkerResend, ServerThatNeverComesBackFailsAfterTheAttemptsNamingServerAndKnob) {
  // Refused connects fail fast: three reconnect attempts end well before
  // request_timeout.
  PendingPull s(PendingPull::Settings{{"worker.resend_attempts", "3"}, {"worker.connect_retries", "1"}},
                "8s");
  ASSERT_TRUE(s.worker);
  Handle pending = s.pull_step_1();
  const auto t0 = std::chrono::steady_clock::now();
  kill_nine(*s.server);
  auto r = pending.wait();
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kClosed) << r.error().to_string();
  const std::string msg = r.error().message();
  EXPECT_THAT(msg, HasSubstr(fmt::format("server 0 ({})", s.server->address())));
  EXPECT_THAT(msg, HasSubstr("re-sending gave up after 3 attempt(s) ([worker] resend_attempts = 3)"));
  EXPECT_THAT(msg, HasSubstr("cannot connect to server 0")) << "the last reconnect error";
  EXPECT_LT(waited, 8s);
  EXPECT_EQ(s.out, std::vector<float>(kElements, -1.0f));
}

TEST(WorkerResend, AfterTheReSenderGaveUpANewRequestTriesOnceAndFailsAtOnce) {
  // The re-sender's reconnect rounds (connect_retries = 8, with back-off)
  // fail; a request made afterwards makes one attempt, not another round.
  PendingPull s(PendingPull::Settings{{"worker.resend_attempts", "1"}, {"worker.connect_retries", "8"}},
                "30s");
  ASSERT_TRUE(s.worker);
  Handle pending = s.pull_step_1();
  kill_nine(*s.server);
  auto r = pending.wait();
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error().message(), HasSubstr("re-sending gave up after 1 attempt(s)"))
      << r.error().to_string();
  EXPECT_THAT(r.error().message(), HasSubstr("after 9 of 9 attempt(s)")) << r.error().to_string();

  auto again = s.worker->push(kKey, gradient(0, 1)).wait();
  ASSERT_FALSE(again);
  const std::string msg = again.error().message();
  EXPECT_THAT(msg, HasSubstr(fmt::format("cannot connect to server 0 at {} (1 attempt: the last "
                                         "reconnect already failed after 9 attempt(s)",
                                         s.server->address())))
      << again.error().to_string();
}

TEST(WorkerResend, ServerThatNeverComesBackFailsWithinRequestTimeoutNamingTheAttempts) {
  // Many connect retries with back-off: request_timeout ends it first.
  PendingPull s(PendingPull::Settings{{"worker.resend_attempts", "3"}, {"worker.connect_retries", "50"}},
                "2s");
  ASSERT_TRUE(s.worker);
  const auto t0 = std::chrono::steady_clock::now();
  Handle pending = s.pull_step_1();
  kill_nine(*s.server);
  auto r = pending.wait();
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kTimeout) << r.error().to_string();
  const std::string msg = r.error().message();
  EXPECT_THAT(msg, HasSubstr("no reply within [worker] request_timeout (2000ms)"));
  EXPECT_THAT(msg, HasSubstr(fmt::format("connection to server 0 ({}) lost before the reply",
                                         s.server->address())));
  EXPECT_THAT(msg, HasSubstr("re-sending, attempt 1 of [worker] resend_attempts = 3"));
  EXPECT_GE(waited, 1500ms);
  EXPECT_LT(waited, 6s);
  // Destroying the worker while it still tries to reconnect ends promptly.
  const auto t1 = std::chrono::steady_clock::now();
  s.worker.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 5s);
}

TEST(WorkerResend, ACallWhileTheReSenderReconnectsReturnsWithinItsRequestTimeout) {
  // The re-sender's cycle (connect_retries = 50, back-off up to 1 s) would
  // last about 45 s; a call made meanwhile waits for it at most its own
  // request_timeout (worker.h: calls return their Handle, they do not hang).
  WorkerLogWatch log_watch;  // before the Worker: see log_watch.h
  PendingPull s(PendingPull::Settings{{"worker.resend_attempts", "3"}, {"worker.connect_retries", "50"}},
                "3s");
  ASSERT_TRUE(s.worker);
  Handle pending = s.pull_step_1();
  kill_nine(*s.server);
  ASSERT_TRUE(log_watch.watch->wait_for("reconnecting to re-send 1 request(s)", 15s));

  const std::vector<float> g = gradient(0, 1);
  const auto t0 = std::chrono::steady_clock::now();
  Handle h = s.worker->push(kKey, g);
  const auto call = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(call, 5s) << "push() blocked for "
                      << std::chrono::duration_cast<std::chrono::milliseconds>(call).count()
                      << " ms (request_timeout 3 s)";
  auto lost = pending.wait();
  ASSERT_FALSE(lost);
  EXPECT_EQ(lost.error().code(), ErrorCode::kTimeout) << lost.error().to_string();
  EXPECT_THAT(lost.error().message(), HasSubstr("request_timeout (3000ms)"));
  // The push waited for the re-sender until its own request_timeout (the
  // error says what it waited for, whether the timer or the wait ended it);
  // or, when the re-sender's cycle ended (at the pull's deadline, a little
  // earlier) and the push's time was not yet up, it made one attempt of its
  // own, which failed at once.
  auto r = h.wait();
  ASSERT_FALSE(r);
  const std::string server = fmt::format("server 0 at {}", s.server->address());
  if (r.error().code() == ErrorCode::kTimeout) {
    EXPECT_THAT(r.error().message(), HasSubstr("request_timeout (3000ms)"));
    EXPECT_THAT(r.error().message(), HasSubstr(server + " while ")) << r.error().to_string();
  } else {
    EXPECT_THAT(r.error().message(), HasSubstr("cannot connect to " + server + " (1 attempt"))
        << r.error().to_string();
  }
  const auto t1 = std::chrono::steady_clock::now();
  s.worker.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 5s);
}

TEST(WorkerResend, ACycleCutShortByTheDeadlineCountsAsFailedSoLaterCallsTryOnce) {
  // request_timeout (6 s) ends the re-sender's cycle (50 retries, ~45 s)
  // long before its last attempt: that counts as a failed cycle, so later
  // calls make one attempt each and fail at once rather than each waiting
  // out its request_timeout.
  PendingPull s(PendingPull::Settings{{"worker.resend_attempts", "1"}, {"worker.connect_retries", "50"}},
                "6s");
  ASSERT_TRUE(s.worker);
  Handle pending = s.pull_step_1();
  kill_nine(*s.server);
  auto lost = pending.wait();
  ASSERT_FALSE(lost);
  EXPECT_EQ(lost.error().code(), ErrorCode::kTimeout) << lost.error().to_string();
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    const std::vector<float> g = gradient(0, 1);
    const auto t0 = std::chrono::steady_clock::now();
    auto r = s.worker->push(kKey, g).wait();
    const auto took = std::chrono::steady_clock::now() - t0;
    ASSERT_FALSE(r);
    EXPECT_THAT(r.error().message(),
                HasSubstr(fmt::format("cannot connect to server 0 at {} (1 attempt: the last "
                                      "reconnect already failed after",
                                      s.server->address())))
        << r.error().to_string();
    EXPECT_THAT(r.error().message(), HasSubstr("attempt(s) when a request's [worker] "
                                               "request_timeout ran out; restart the server"))
        << r.error().to_string();
    // Half the request_timeout: one refused connect, not a wait for the
    // deadline (loose: a loaded 2-core CI machine).
    EXPECT_LT(took, 3s) << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                        << " ms";
  }
}

TEST(WorkerResend, AConnectWithLittleTimeLeftDoesNotMarkTheServerAsGone) {
  // A pipelined push enqueued most of a request_timeout ago is flushed after
  // its server was killed: its connect has time for a few refused attempts
  // only. That says nothing of the server, so a later call still makes a
  // whole reconnect cycle (not the single attempt that follows a failed
  // cycle) and finds the server once it is back.
  // request_timeout 6 s: the restarted server below has over 5 s to start.
  PendingPull s(PendingPull::Settings{{"worker.resend_attempts", "1"}, {"worker.connect_retries", "20"}},
                "6s");
  ASSERT_TRUE(s.worker);
  const std::string address = s.server->address();
  kill_nine(*s.server);
  const std::vector<float> g = gradient(0, 1);
  Handle late;
  {
    auto p = s.worker->pipeline();
    late = p.enqueue(kKey, g);
    std::this_thread::sleep_for(5700ms);  // 300 ms of its request_timeout left
    (void)p.flush();
  }
  auto lr = late.wait();
  ASSERT_FALSE(lr);
  EXPECT_EQ(lr.error().code(), ErrorCode::kTimeout) << lr.error().to_string();

  std::unique_ptr<Process> again;
  std::thread restart([&] {
    std::this_thread::sleep_for(400ms);
    again = restart_server(s.dir, address, "server0-restarted.log");
  });
  const Key fresh = kKey + 1;  // the restarted server has no keys
  auto r = s.worker->init(fresh, kShape, initial()).wait();
  restart.join();
  ASSERT_TRUE(again && again->running());
  EXPECT_TRUE(r) << r.error().to_string();
}

TEST(WorkerResend, AConnectionLostDuringAReSendBurstKeepsThePushesInStepOrder) {
  // 20000 pushes of one key (steps 0..19999) are lost with their connection
  // before the server saw any (a proxy held them). The re-sender reconnects
  // and re-sends them in one burst; the proxy drops that connection too,
  // as soon as the burst starts. What the burst had sent on it goes to the
  // next re-send job (on_closed); the rest of the burst must not go out on
  // the next connection ahead of those: the server (bsp, 1 worker) refuses
  // a push whose step does not follow the last with kOutOfStep. In the end
  // every push is applied once, in order.
  WorkerLogWatch log_watch;  // before the Worker: see log_watch.h
  TempDir dir;
  ClusterSpec spec;
  spec.request_timeout = "120s";
  spec.learning_rate = 1.0;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto proxy = proxy_to(server);
  auto w = proxied_worker(spec, *proxy, 10, kKey);
  ASSERT_TRUE(w);
  constexpr std::uint64_t kSteps = 20000;
  const std::vector<float> g(4, 1.0f);

  proxy->hold_requests();
  std::vector<Handle> pushes;
  pushes.reserve(kSteps);
  for (std::uint64_t s = 0; s < kSteps; ++s) pushes.push_back(w->push(kKey, g, s));
  std::this_thread::sleep_for(300ms);  // all of them on their way
  proxy->drop_all();
  ASSERT_TRUE(log_watch.watch->wait_for(fmt::format("re-sending {} request(s)", kSteps), 60s));
  proxy->drop_all();  // during the burst

  for (std::uint64_t s = 0; s < kSteps; ++s) {
    auto r = pushes[s].wait();
    ASSERT_TRUE(r) << "push of step " << s << ": " << r.error().to_string();
  }
  std::vector<float> out(4, -1.0f);
  auto pulled = w->pull(kKey, out, kSteps).wait();
  ASSERT_TRUE(pulled) << pulled.error().to_string();
  EXPECT_EQ(out, std::vector<float>(4, -static_cast<float>(kSteps)));  // each push applied once
}

// Set by the thread whose passes of sync points a test acts on (the points
// are passed by every thread of the worker).
thread_local bool t_marked_thread = false;

TEST(WorkerResend, ASenderStalledAcrossAReconnectStillGoesAfterTheReSends) {
  if (!sync_point::kCompiled) {
    GTEST_SKIP() << "needs sync points (EMBER_SYNC_POINTS: the dev, asan and tsan presets)";
  }
  // Push A (step 0) is lost with its connection before the server saw it (a
  // proxy held it). Push B (step 1), from another thread, found no re-sends
  // queued just before the loss and stalls there, before it asks for its
  // connection, until the re-sender has reconnected and joined. The
  // connection B then gets is open and joined, but A's re-send has not gone
  // out on it yet: B must wait for it. Sent first, B is refused by the
  // server (bsp, 1 worker: a step must follow the last) with kOutOfStep.
  sync_point::ScopedClear clear_points;  // last: after the worker is gone
  TempDir dir;
  ClusterSpec spec;
  spec.request_timeout = "60s";
  spec.learning_rate = 1.0;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto proxy = proxy_to(server);

  std::promise<void> b_stalled, b_go;
  std::shared_future<void> b_go_now = b_go.get_future().share();
  std::promise<void> b_waits;
  std::atomic<bool> b_waited{false}, burst_seen{false};
  std::atomic<bool> b_stalled_once{false};
  sync_point::set("Worker::send:before_connection", [&] {
    if (!t_marked_thread || b_stalled_once.exchange(true)) return;
    b_stalled.set_value();
    // Bounded: if the re-sender never gets to its burst, B goes on (and
    // the test fails on its checks, not on a hang).
    (void)b_go_now.wait_for(60s);
  });
  sync_point::set("Worker::wait_for_resends", [&] {
    if (!t_marked_thread || b_waited.exchange(true)) return;
    b_waits.set_value();
  });
  std::shared_future<void> b_waiting = b_waits.get_future().share();
  sync_point::set("Worker::run_resend:before_burst", [&] {
    if (burst_seen.exchange(true)) return;
    b_go.set_value();  // B asks for its connection now: this one
    // B finds the re-sends queued and waits for them. Bounded, so that a B
    // that does not wait (and is refused) cannot hang the test.
    (void)b_waiting.wait_for(10s);
  });

  auto w = proxied_worker(spec, *proxy, 3, kKey);
  ASSERT_TRUE(w);
  const std::vector<float> g(4, 1.0f);

  proxy->hold_requests();
  Handle a = w->push(kKey, g, 0);
  std::optional<Result<std::uint64_t>> b_result;
  std::jthread b([&] {  // joined on every return
    t_marked_thread = true;
    b_result = w->push(kKey, g, 1).wait();
  });
  ASSERT_EQ(b_stalled.get_future().wait_for(60s), std::future_status::ready);
  proxy->drop_all();  // A is lost with its connection

  auto ra = a.wait();
  b.join();
  ASSERT_TRUE(ra) << "push of step 0: " << ra.error().to_string();
  ASSERT_TRUE(b_result.has_value());
  ASSERT_TRUE(*b_result) << "push of step 1: " << b_result->error().to_string();
  EXPECT_TRUE(burst_seen.load());  // A was re-sent
  std::vector<float> out(4, -1.0f);
  auto pulled = w->pull(kKey, out, 2).wait();
  ASSERT_TRUE(pulled) << pulled.error().to_string();
  EXPECT_EQ(out, std::vector<float>(4, -2.0f));  // each push applied once
  w.reset();
  sync_point::clear_all();
}

// A key of `spec`'s 2 servers that server `server` holds (its one chunk).
Key key_on(std::uint32_t server, Key from) {
  Key k = from;
  while (placement::server_of(k, 0, 2) != server) ++k;
  return k;
}

TEST(WorkerResend, ARejoinDoesNotWaitForAnotherServersConnectCycle) {
  // Server 1 is gone and a push to it reconnects (a long cycle); server 0
  // restarts meanwhile, and the worker's next call to it rejoins. The join
  // compares server 0's settings with every other server's
  // (check_same_settings), which must not wait for server 1's cycle.
  TempDir dir;
  ClusterSpec spec;
  spec.num_servers = 2;
  spec.request_timeout = "20s";
  ServerProcess s0(dir, spec, 0);
  ServerProcess s1(dir, spec, 1);
  ASSERT_TRUE(s0.ok() && s1.ok());
  config::Config c = worker_config(spec, {s0.address(), s1.address()}, 0);
  ASSERT_TRUE(config::set_value(c, "worker.connect_retries", "50"));
  ASSERT_TRUE(config::set_value(c, "worker.resend_attempts", "3"));
  auto created = Worker::create(c);
  ASSERT_TRUE(created) << created.error().to_string();
  std::unique_ptr<Worker> w = std::move(*created);
  const Key k0 = key_on(0, 100), k1 = key_on(1, 100);
  for (Key k : {k0, k1}) {
    auto r = w->init(k, kShape, initial()).wait();
    ASSERT_TRUE(r) << r.error().to_string();
  }

  kill_nine(s1);
  const std::vector<float> g = gradient(0, 0);
  std::optional<Result<std::uint64_t>> to_s1;
  std::thread cycle([&] { to_s1 = w->push(k1, g).wait(); });  // reconnects to server 1

  kill_nine(s0);
  auto again = restart_server(dir, s0.address(), "server0-restarted.log");
  ASSERT_TRUE(again->running());
  const Key fresh = key_on(0, k0 + 1);  // the restarted server has no keys
  const auto t0 = std::chrono::steady_clock::now();
  auto r = w->init(fresh, kShape, initial()).wait();
  const auto took = std::chrono::steady_clock::now() - t0;
  cycle.join();
  ASSERT_TRUE(r) << r.error().to_string();
  // Half of request_timeout, which bounds server 1's cycle.
  EXPECT_LT(took, 10s) << "the rejoin of server 0 took "
                      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  EXPECT_THAT(read_file(dir / "server0-restarted.log"), HasSubstr("worker 0 connected"));
  // The push to server 1 gave up within its own request_timeout.
  ASSERT_TRUE(to_s1.has_value());
  ASSERT_FALSE(*to_s1);
  EXPECT_EQ(to_s1->error().code(), ErrorCode::kTimeout) << to_s1->error().to_string();
}

}  // namespace
}  // namespace ember::test
