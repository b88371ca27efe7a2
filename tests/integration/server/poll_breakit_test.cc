// Adversarial checks of Connection::poll on the worker (43cd08e): a thread
// waiting on a Handle consumes its shm connection's receive lanes itself
// (Handle::wait -> transport::Connection::poll), so worker reply handling and
// send completions run on user threads, in competition with each other and
// with the worker's I/O thread, which may be parked on its doorbell.
// Attacked here:
//  * many threads of each of two workers waiting at once (push_pull of small
//    and large keys, pipelines), results compared bit for bit, with busy
//    polls long (callers consume most replies), short (a caller hands back to
//    a parked I/O thread on nearly every wait) and off (the I/O thread alone);
//  * a Worker destroyed while threads are polling its connection, and its
//    Handles waited on afterwards;
//  * request_timeout firing while threads poll (the late replies must not be
//    written into memory the caller got back);
//  * a server stopped (SIGSTOP) and resumed, stopped past heartbeat_timeout
//    (the worker reconnects and re-sends: each push counts once), and a
//    server killed, while threads poll.
// No test sleeps to wait: every wait is on a Handle or a process, with a
// deadline.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/base/logging.h"

#include "tests/integration/server/harness.h"
#include "tests/integration/server/log_watch.h"
#include "tests/integration/server/workers.h"
#include "worker/worker.h"

namespace ember::test {
namespace {

using Clock = std::chrono::steady_clock;

std::uint64_t ms_since(Clock::time_point t0) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
}

// Waits on `h` in slices of `slice` (each wait polls the connection) until
// it is done; counts this thread into `polling` (if given) once a slice
// passed with the operation still running. False when it is still running
// `limit_ms` after t0.
bool poll_until_done(const Handle& h, std::chrono::milliseconds slice, Clock::time_point t0,
                     std::uint64_t limit_ms, std::atomic<std::uint32_t>* polling = nullptr) {
  bool counted = false;
  for (;;) {
    (void)h.wait_for(slice);
    if (h.ready()) return true;
    if (polling != nullptr && !counted) {
      counted = true;
      polling->fetch_add(1);
    }
    if (ms_since(t0) > limit_ms) return false;
  }
}

// The first failure of many threads, kept for the report.
struct FirstError {
  std::atomic<int> count{0};
  std::string text;
  void add(std::string what) {
    if (count.fetch_add(1) == 0) text = std::move(what);
  }
};

// Initial value of element i of key k (small integers: every sum is exact).
float initial(std::uint64_t key, std::uint64_t i) { return static_cast<float>((key * 31 + i) % 1000); }

// Two workers (bsp, so each step of a key needs both), kThreads threads each,
// all waiting on their Handles at once: each thread push_pulls a small key
// (batched, 64 B) and a large key (16 KiB: header + payload-follows, into
// pool memory so in place) every step, and a pipeline of small push_pulls.
// Rank r's gradient at step s is (2r + 1) * (s % 3 + 1): the mean of the two
// ranks is 2 * (s % 3 + 1), so p_s = p_0 - sum over steps (lr 1), exactly.
class PollManyWaiters : public ::testing::TestWithParam<const char*> {};

TEST_P(PollManyWaiters, EveryResultIsBitExact) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;
  spec.learning_rate = 1.0;
  spec.request_timeout = "20s";
  spec.worker_timeout = "60s";
  spec.shards = 2;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()},
                              {std::string("communication.busy_poll=") + GetParam()});
  ASSERT_TRUE(workers[0] && workers[1]);
  constexpr std::uint32_t kThreads = 5, kSteps = 30, kPipeKeys = 8;
  constexpr std::uint64_t kSmall = 16, kLarge = 4096;
  // Keys of thread t: 1000 + 100 t (small), +1 (large), +10 .. +10+kPipeKeys (pipeline).
  auto small_key = [](std::uint32_t t) { return Key{1000 + 100 * t}; };
  auto large_key = [](std::uint32_t t) { return Key{1001 + 100 * t}; };
  auto pipe_key = [](std::uint32_t t, std::uint32_t j) { return Key{1010 + 100 * t + j}; };
  auto init_key = [&](std::uint32_t r, Key key, std::uint64_t n) {
    const std::uint64_t shape[] = {n};
    std::vector<float> v(n);
    for (std::uint64_t i = 0; i < n; ++i) v[i] = initial(key, i);
    return workers[r]->init(key, shape, r == 0 ? std::span<const float>(v) : std::span<const float>()).wait();
  };
  for (std::uint32_t r = 0; r < 2; ++r) {
    for (std::uint32_t t = 0; t < kThreads; ++t) {
      ASSERT_TRUE(init_key(r, small_key(t), kSmall));
      ASSERT_TRUE(init_key(r, large_key(t), kLarge));
      for (std::uint32_t j = 0; j < kPipeKeys; ++j) ASSERT_TRUE(init_key(r, pipe_key(t, j), kSmall));
    }
  }
  FirstError err;
  auto check = [&](const char* what, std::uint32_t r, Key key, std::uint32_t s, std::span<const float> got) {
    std::uint64_t sum = 0;
    for (std::uint32_t q = 0; q <= s; ++q) sum += 2 * (q % 3 + 1);
    for (std::uint64_t i = 0; i < got.size(); ++i) {
      const float want = initial(key, i) - static_cast<float>(sum);
      if (std::memcmp(&got[i], &want, sizeof want) != 0) {
        err.add(std::string(what) + ": rank " + std::to_string(r) + " key " + std::to_string(key) +
                " step " + std::to_string(s) + " element " + std::to_string(i) + ": " +
                std::to_string(got[i]) + " != " + std::to_string(want));
        return false;
      }
    }
    return true;
  };
  on_all(2 * kThreads, [&](std::uint32_t id) {
    const std::uint32_t r = id % 2, t = id / 2;
    Worker& w = *workers[r];
    TensorBuffer large_grad = w.allocate(kLarge * sizeof(float));
    TensorBuffer large_out = w.allocate(kLarge * sizeof(float));
    std::vector<float> small_grad(kSmall), small_out(kSmall);
    std::vector<std::vector<float>> pipe_out(kPipeKeys, std::vector<float>(kSmall));
    for (std::uint32_t s = 0; s < kSteps; ++s) {
      const float g = static_cast<float>((2 * r + 1) * (s % 3 + 1));
      std::fill(small_grad.begin(), small_grad.end(), g);
      std::fill(large_grad.floats().begin(), large_grad.floats().end(), g);
      std::fill(small_out.begin(), small_out.end(), -1.0f);
      std::fill(large_out.floats().begin(), large_out.floats().end(), -1.0f);
      Handle hs = w.push_pull(small_key(t), small_grad, small_out);
      Handle hl = w.push_pull(large_key(t), large_grad.floats(), large_out.floats());
      // Wait in the reverse order of issue: the large reply may be consumed
      // by this thread while it waits for the small one, or the other way.
      auto rl = (s % 2 == 0) ? hl.wait() : hs.wait();
      auto rs = (s % 2 == 0) ? hs.wait() : hl.wait();
      if (!rl || !rs) {
        err.add("rank " + std::to_string(r) + " thread " + std::to_string(t) + " step " +
                std::to_string(s) + ": " + (!rl ? rl.error() : rs.error()).to_string());
        return;
      }
      if (!check("small", r, small_key(t), s, small_out)) return;
      if (!check("large", r, large_key(t), s, large_out.floats())) return;
      {
        auto pipe = w.pipeline();
        std::vector<Handle> hp;
        for (std::uint32_t j = 0; j < kPipeKeys; ++j) {
          std::fill(pipe_out[j].begin(), pipe_out[j].end(), -1.0f);
          hp.push_back(pipe.enqueue_push_pull(pipe_key(t, j), small_grad, pipe_out[j]));
        }
        if (Status st = pipe.wait(); !st) {
          err.add("pipeline: rank " + std::to_string(r) + " thread " + std::to_string(t) + " step " +
                  std::to_string(s) + ": " + st.error().to_string());
          return;
        }
      }
      for (std::uint32_t j = 0; j < kPipeKeys; ++j) {
        if (!check("pipeline", r, pipe_key(t, j), s, pipe_out[j])) return;
      }
    }
  });
  EXPECT_EQ(err.count.load(), 0) << err.text;
}

// 2ms: callers consume most replies. 20us: a caller's poll ends after a few
// rounds and it sleeps, so what it leaves must reach a parked I/O thread
// (the hand-back). 0us: callers never poll (the I/O thread alone).
INSTANTIATE_TEST_SUITE_P(BusyPoll, PollManyWaiters, ::testing::Values("2ms", "20us", "0us"),
                         [](const ::testing::TestParamInfo<const char*>& param_info) {
                           return std::string("busy_poll_") + param_info.param;
                         });

// Threads keep polling the connection (wait_for in a loop, busy_poll 10 ms:
// each wait_for polls the whole time) on pulls that bsp parks, while the
// Worker is destroyed. Every wait ends with an error (kClosed: the worker is
// gone) within a bound, nothing crashes, and the Handles can be waited on
// after the Worker is gone.
TEST(PollBreak, AWorkerDestroyedWhileThreadsPollItsConnection) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;  // bsp: rank 0's pulls of step 1 park until rank 1 pushes step 0
  spec.request_timeout = "20s";
  spec.worker_timeout = "60s";
  // A fresh server each round: a destroyed rank 0 does not come back to a job.
  for (int round = 0; round < 2; ++round) {
    ServerProcess server(dir, spec, 0);
    ASSERT_TRUE(server.ok());
    auto workers = make_workers(spec, {server.address()}, {"communication.busy_poll=10ms"});
    ASSERT_TRUE(workers[0] && workers[1]);
    constexpr std::uint32_t kThreads = 4;
    constexpr std::uint64_t n = 1024;
    const std::uint64_t shape[] = {n};
    const Key key = 50 + static_cast<Key>(round);
    std::vector<float> init(n, 1.0f), grad(n, 1.0f);
    ASSERT_TRUE(workers[0]->init(key, shape, init).wait());
    ASSERT_TRUE(workers[1]->init(key, shape, {}).wait());
    // Not waited for: over shm the server keeps the lent gradient block
    // until the round aggregates, i.e. until rank 1 pushed step 0 too.
    Handle push0 = workers[0]->push(key, grad, 0);
    std::vector<std::vector<float>> outs(kThreads, std::vector<float>(n));
    std::vector<Handle> pulls;
    for (std::uint32_t t = 0; t < kThreads; ++t) pulls.push_back(workers[0]->pull(key, outs[t], 1));
    std::atomic<std::uint32_t> polling{0};
    std::vector<std::string> results(kThreads);
    std::vector<std::thread> threads;
    for (std::uint32_t t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        bool counted = false;
        for (;;) {
          auto r = pulls[t].wait_for(std::chrono::milliseconds(5));
          if (pulls[t].ready()) {
            r = pulls[t].wait();
            results[t] = r ? "ok" : std::string(error_code_name(r.error().code()));
            return;
          }
          if (!counted) {
            counted = true;
            polling.fetch_add(1);
          }
        }
      });
    }
    // All threads are in their polling loops (each counted once it polled).
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (polling.load() < kThreads && Clock::now() < deadline) std::this_thread::yield();
    EXPECT_EQ(polling.load(), kThreads);  // (the threads end with the Worker either way)
    const auto t0 = Clock::now();
    workers[0].reset();  // while they poll
    for (auto& th : threads) th.join();
    EXPECT_LT(ms_since(t0), 10000u) << "round " << round;
    for (std::uint32_t t = 0; t < kThreads; ++t) {
      EXPECT_EQ(results[t], "closed") << "round " << round << " thread " << t;
      auto again = pulls[t].wait();  // after the Worker is gone
      EXPECT_FALSE(again);
    }
    EXPECT_FALSE(push0.wait());
    workers[1].reset();
  }
}

// request_timeout fires while threads poll their parked pulls. Each fails
// with kTimeout by the deadline; their replies, which come later (rank 1
// pushes), must not be written into the callers' buffers (given back at the
// timeout), and a later pull gets the right parameters.
TEST(PollBreak, RequestTimeoutWhileThreadsPollAndLateRepliesAreDropped) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;
  // The timeout covers every request of this test, set-up included: long
  // enough that a server descheduled for a while on a loaded machine does
  // not time out the inits (and above heartbeat_timeout, 2 s, which ends a
  // longer stall anyway).
  spec.request_timeout = "3s";
  spec.worker_timeout = "60s";
  spec.learning_rate = 1.0;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()}, {"communication.busy_poll=10ms"});
  ASSERT_TRUE(workers[0] && workers[1]);
  Worker& w0 = *workers[0];
  Worker& w1 = *workers[1];
  constexpr std::uint32_t kThreads = 4;
  constexpr std::uint64_t n = 2048;  // 8 KiB: a large reply (payload follows)
  const std::uint64_t shape[] = {n};
  std::vector<float> init(n, 5.0f), grad(n, 1.0f);
  ASSERT_TRUE(w0.init(9, shape, init).wait());
  ASSERT_TRUE(w1.init(9, shape, {}).wait());
  // Not done until rank 1 pushes (the server keeps its lent gradient block
  // until the round aggregates).
  Handle push0 = w0.push(9, grad, 0);
  // Heap destinations (not in place: the reply carries the data, copied by
  // handle_reply only while the operation is not done).
  std::vector<std::vector<float>> outs(kThreads, std::vector<float>(n, -7.0f));
  std::vector<std::string> results(kThreads);
  std::vector<std::uint64_t> took_ms(kThreads);
  const auto t0 = Clock::now();
  on_all(kThreads, [&](std::uint32_t t) {
    const auto issued = Clock::now();  // a thread may start late on a loaded machine
    Handle h = w0.pull(9, outs[t], 1);
    if (!poll_until_done(h, std::chrono::milliseconds(5), t0, 15000)) {
      results[t] = "still running after 15 s";
      return;
    }
    auto r = h.wait();
    took_ms[t] = ms_since(issued);
    results[t] = r ? "ok" : std::string(error_code_name(r.error().code()));
  });
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    EXPECT_EQ(results[t], "timeout") << "thread " << t;
    // request_timeout (3 s) plus room for a descheduled poller.
    EXPECT_LT(took_ms[t], 3000u + 5000u) << "thread " << t;
  }
  // The callers own their buffers again: fill them with a sentinel, then
  // let the parked pulls be answered (rank 1 pushes step 0).
  for (auto& o : outs) std::fill(o.begin(), o.end(), -9.0f);
  ASSERT_TRUE(w1.push(9, grad, 0).wait());
  (void)push0.wait();  // timed out with the pulls, or answered
  // A pull on the same key (same channel: after the late replies) completes
  // with step 1's parameters: 5 - mean(1, 1).
  std::vector<float> fresh(n, 0.0f);
  // Its wait polls the connection, so it may be the thread that consumes the
  // late replies; several rounds so that they have certainly arrived.
  for (int k = 0; k < 3; ++k) {
    auto r = w0.pull(9, fresh, 1).wait();
    ASSERT_TRUE(r) << r.error().to_string();
    ASSERT_EQ(fresh[0], 4.0f);
    ASSERT_EQ(fresh[n - 1], 4.0f);
  }
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    for (std::uint64_t i = 0; i < n; ++i) {
      ASSERT_EQ(outs[t][i], -9.0f) << "thread " << t << " element " << i
                                   << ": a reply after the timeout wrote into the caller's buffer";
    }
  }
}

// The server is stopped (SIGSTOP, well below heartbeat_timeout) while
// threads of both workers poll for push_pull replies, then resumed: every
// result arrives once and bit-exact.
TEST(PollBreak, ServerStoppedAndResumedWhileThreadsPoll) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;
  spec.learning_rate = 1.0;
  spec.request_timeout = "20s";
  spec.worker_timeout = "60s";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()}, {"communication.busy_poll=2ms"});
  ASSERT_TRUE(workers[0] && workers[1]);
  constexpr std::uint32_t kThreads = 3, kSteps = 12;
  constexpr std::uint64_t n = 2048;
  const std::uint64_t shape[] = {n};
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    std::vector<float> v(n);
    for (std::uint64_t i = 0; i < n; ++i) v[i] = initial(200 + t, i);
    ASSERT_TRUE(workers[0]->init(200 + t, shape, v).wait());
    ASSERT_TRUE(workers[1]->init(200 + t, shape, {}).wait());
  }
  std::atomic<std::uint32_t> steps_done{0};
  FirstError err;
  std::thread stopper([&] {
    // Stop the server in the middle of the run, twice.
    for (std::uint32_t at : {kSteps * kThreads / 3, 2 * kSteps * kThreads / 3}) {
      const auto deadline = Clock::now() + std::chrono::seconds(20);
      while (steps_done.load() < at && Clock::now() < deadline) std::this_thread::yield();
      server.process().signal(SIGSTOP);
      const auto stopped = Clock::now();
      while (Clock::now() - stopped < std::chrono::milliseconds(300)) std::this_thread::yield();
      server.process().signal(SIGCONT);
    }
  });
  on_all(2 * kThreads, [&](std::uint32_t id) {
    const std::uint32_t r = id % 2, t = id / 2;
    Worker& w = *workers[r];
    const Key key = 200 + t;
    TensorBuffer grad = w.allocate(n * sizeof(float));
    TensorBuffer out = w.allocate(n * sizeof(float));
    for (std::uint32_t s = 0; s < kSteps; ++s) {
      const float g = static_cast<float>((2 * r + 1) * (s % 3 + 1));
      std::fill(grad.floats().begin(), grad.floats().end(), g);
      std::fill(out.floats().begin(), out.floats().end(), -1.0f);
      auto res = w.push_pull(key, grad.floats(), out.floats()).wait();
      if (!res) {
        err.add("rank " + std::to_string(r) + " key " + std::to_string(key) + " step " +
                std::to_string(s) + ": " + res.error().to_string());
        return;
      }
      std::uint64_t sum = 0;
      for (std::uint32_t q = 0; q <= s; ++q) sum += 2 * (q % 3 + 1);
      for (std::uint64_t i = 0; i < n; ++i) {
        const float want = initial(key, i) - static_cast<float>(sum);
        if (out.floats()[i] != want) {
          err.add("rank " + std::to_string(r) + " key " + std::to_string(key) + " step " +
                  std::to_string(s) + " element " + std::to_string(i) + ": " +
                  std::to_string(out.floats()[i]) + " != " + std::to_string(want));
          return;
        }
      }
      if (r == 0) steps_done.fetch_add(1);
    }
  });
  stopper.join();
  EXPECT_EQ(err.count.load(), 0) << err.text;
}

// The server is killed while threads poll for replies it will never send:
// every wait ends with an error within a bound (heartbeat loss, no re-send),
// none hangs.
TEST(PollBreak, ServerKilledWhileThreadsPoll) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;  // rank 1 never pushes: the pulls stay parked
  spec.request_timeout = "8s";
  spec.worker_timeout = "60s";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()},
                              {"communication.busy_poll=10ms", "communication.heartbeat_interval=200ms",
                               "communication.heartbeat_timeout=1s", "worker.connect_retries=1",
                               "worker.resend_attempts=0"});
  ASSERT_TRUE(workers[0] && workers[1]);
  Worker& w0 = *workers[0];
  constexpr std::uint32_t kThreads = 4;
  constexpr std::uint64_t n = 2048;
  const std::uint64_t shape[] = {n};
  std::vector<float> init(n, 1.0f), grad(n, 1.0f);
  ASSERT_TRUE(w0.init(4, shape, init).wait());
  ASSERT_TRUE(workers[1]->init(4, shape, {}).wait());
  // A large push over shm lends its gradient block to the server, which
  // keeps it until the round aggregates (rank 1 never pushes): not done.
  Handle push0 = w0.push(4, grad, 0);
  std::atomic<std::uint32_t> polling{0};
  std::vector<std::string> results(kThreads);
  std::vector<std::thread> threads;
  std::vector<TensorBuffer> outs;
  for (std::uint32_t t = 0; t < kThreads; ++t) outs.push_back(w0.allocate(n * sizeof(float)));
  const auto t0 = Clock::now();
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Handle h = w0.pull(4, outs[t].floats(), 1);
      if (!poll_until_done(h, std::chrono::milliseconds(5), t0, 20000, &polling)) {
        results[t] = "still running after 20 s";
        return;
      }
      auto r = h.wait();
      results[t] = r ? "ok" : std::string(error_code_name(r.error().code()));
    });
  }
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (polling.load() < kThreads && Clock::now() < deadline) std::this_thread::yield();
  EXPECT_EQ(polling.load(), kThreads);
  server.process().signal(SIGKILL);
  EXPECT_TRUE(server.process().wait_exit());
  for (auto& th : threads) th.join();
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    // Lost with the server (kClosed) or given up at request_timeout.
    EXPECT_TRUE(results[t] == "closed" || results[t] == "timeout") << "thread " << t << ": " << results[t];
  }
  EXPECT_LT(ms_since(t0), 8000u + 4000u);
  // Acknowledged before the kill (its gradient block came back when the
  // server exited), or lost with the server: either way it ends.
  (void)push0.wait();
  EXPECT_LT(ms_since(t0), 8000u + 4000u);
}

using ember::testing::WorkerLogWatch;

// Threads of rank 0 poll their push_pulls of step 1 (parked by bsp until
// rank 1 pushes) when the server freezes past heartbeat_timeout: the worker
// gives the connection up while they poll it, reconnects once the server
// answers again and re-sends. Every push_pull then completes with the
// parameters of a server that counted each push once, bit for bit.
TEST(PollBreak, ReconnectAndResendWhileThreadsPollCountsEachPushOnce) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;
  spec.learning_rate = 1.0;
  spec.request_timeout = "25s";
  spec.worker_timeout = "60s";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  WorkerLogWatch watch;
  auto workers = make_workers(spec, {server.address()},
                              {"communication.busy_poll=10ms", "communication.heartbeat_interval=200ms",
                               "communication.heartbeat_timeout=1s", "worker.connect_retries=20"});
  ASSERT_TRUE(workers[0] && workers[1]);
  Worker& w0 = *workers[0];
  Worker& w1 = *workers[1];
  constexpr std::uint32_t kThreads = 3;
  constexpr std::uint64_t n = 2048;
  const std::uint64_t shape[] = {n};
  auto key_of = [](std::uint32_t t) { return Key{300 + t}; };
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    std::vector<float> v(n);
    for (std::uint64_t i = 0; i < n; ++i) v[i] = initial(key_of(t), i);
    ASSERT_TRUE(w0.init(key_of(t), shape, v).wait());
    ASSERT_TRUE(w1.init(key_of(t), shape, {}).wait());
  }
  // Gradients: rank r, step s: (2r + 1) * (s + 1); the mean is 2 (s + 1).
  auto grad = [](std::uint32_t r, std::uint32_t s) {
    return std::vector<float>(n, static_cast<float>((2 * r + 1) * (s + 1)));
  };
  std::vector<std::vector<float>> out0(kThreads, std::vector<float>(n)), out1 = out0;
  const auto g00 = grad(0, 0), g10 = grad(1, 0), g01 = grad(0, 1), g11 = grad(1, 1);
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    Handle h1 = w1.push_pull(key_of(t), g10, out1[t]);
    ASSERT_TRUE(w0.push_pull(key_of(t), g00, out0[t]).wait());
    ASSERT_TRUE(h1.wait());
  }
  std::atomic<std::uint32_t> polling{0};
  std::vector<std::string> results(kThreads);
  std::vector<std::thread> threads;
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Handle h = w0.push_pull(key_of(t), g01, out0[t]);
      if (!poll_until_done(h, std::chrono::milliseconds(5), Clock::now(), 28000, &polling)) {
        results[t] = "still running after 28 s";
        return;
      }
      auto r = h.wait();
      results[t] = r ? "ok" : r.error().to_string();
    });
  }
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (polling.load() < kThreads && Clock::now() < deadline) std::this_thread::yield();
  EXPECT_EQ(polling.load(), kThreads);
  server.process().signal(SIGSTOP);
  const bool noticed = watch.watch->wait_for("reconnecting to re-send", std::chrono::seconds(15));
  server.process().signal(SIGCONT);
  EXPECT_TRUE(noticed) << "the worker did not give the frozen server up";
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    auto r = w1.push_pull(key_of(t), g11, out1[t]).wait();
    EXPECT_TRUE(r) << "rank 1 key " << key_of(t) << ": " << r.error().to_string();
  }
  for (auto& th : threads) th.join();
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    ASSERT_EQ(results[t], "ok") << "thread " << t;
    for (std::uint64_t i = 0; i < n; ++i) {
      const float want = initial(key_of(t), i) - 2.0f - 4.0f;  // mean grads of steps 0 and 1
      ASSERT_EQ(out0[t][i], want) << "key " << key_of(t) << " element " << i
                                  << ": a push counted twice or not at all";
      ASSERT_EQ(out1[t][i], want) << "rank 1 key " << key_of(t) << " element " << i;
    }
  }
}

// One thread, one request at a time, with busy polls around a round trip's
// length: the caller's poll often ends just as the reply comes in, while it
// holds the lane with the parked I/O thread's doorbell flag cleared (the
// peer then does not ring). What it leaves must reach the I/O thread: a
// reply stranded in the lane shows as a wait that does not end.
TEST(PollBreak, SequentialRoundTripsWithShortPollsAreNeverStranded) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.consistency = "asp";
  spec.learning_rate = 1.0;
  spec.request_timeout = "20s";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  constexpr std::uint64_t n = 16;
  constexpr int kRoundTrips = 1500;
  const std::uint64_t shape[] = {n};
  Key key = 400;
  for (const char* busy_poll : {"3us", "10us", "30us", "100us"}) {
    auto workers = make_workers(spec, {server.address()}, {std::string("communication.busy_poll=") + busy_poll});
    ASSERT_TRUE(workers[0]);
    Worker& w = *workers[0];
    ++key;
    std::vector<float> init(n, 0.0f), grad(n, 1.0f), out(n);
    ASSERT_TRUE(w.init(key, shape, init).wait());
    std::uint64_t slowest_us = 0;
    for (int k = 0; k < kRoundTrips; ++k) {
      const auto t0 = Clock::now();
      Handle h = w.push_pull(key, grad, out);
      // 10 s: far beyond any stall of a loaded machine, and half the
      // request_timeout, which would end a stranded request otherwise.
      auto r = h.wait_for(std::chrono::seconds(10));
      ASSERT_TRUE(h.ready()) << "busy_poll " << busy_poll << ", round trip " << k
                             << ": no reply after 10 s (stranded in the lane?)";
      r = h.wait();
      ASSERT_TRUE(r) << r.error().to_string();
      slowest_us = std::max<std::uint64_t>(
          slowest_us, static_cast<std::uint64_t>(
                          std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count()));
      ASSERT_EQ(out[0], -static_cast<float>(k + 1)) << "busy_poll " << busy_poll << ", round trip " << k;
      ASSERT_EQ(out[n - 1], -static_cast<float>(k + 1));
    }
    // For the log only (timings are for bench/): a stranded reply that
    // something else rescued (a later message, a heartbeat) shows here.
    std::printf("busy_poll %s: slowest of %d round trips %llu us\n", busy_poll, kRoundTrips,
                static_cast<unsigned long long>(slowest_us));
  }
}

// Copies of one Handle waited on from several threads at once, all polling
// the connection, while its pull is parked (bsp); then rank 1 pushes and
// every waiter gets the same result, and the destination the parameters.
TEST(PollBreak, OneHandleWaitedOnFromManyPollingThreads) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;
  spec.learning_rate = 1.0;
  spec.request_timeout = "20s";
  spec.worker_timeout = "60s";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()}, {"communication.busy_poll=10ms"});
  ASSERT_TRUE(workers[0] && workers[1]);
  Worker& w0 = *workers[0];
  Worker& w1 = *workers[1];
  constexpr std::uint32_t kThreads = 6;
  constexpr std::uint64_t n = 4096;
  const std::uint64_t shape[] = {n};
  std::vector<float> init(n);
  for (std::uint64_t i = 0; i < n; ++i) init[i] = initial(500, i);
  ASSERT_TRUE(w0.init(500, shape, init).wait());
  ASSERT_TRUE(w1.init(500, shape, {}).wait());
  const std::vector<float> g0(n, 1.0f), g1(n, 3.0f);  // mean 2
  Handle push0 = w0.push(500, g0, 0);
  TensorBuffer dest = w0.allocate(n * sizeof(float));  // in place
  std::fill(dest.floats().begin(), dest.floats().end(), -1.0f);
  const Handle pull = w0.pull(500, dest.floats(), 1);
  std::atomic<std::uint32_t> polling{0};
  std::vector<std::string> results(kThreads);
  std::vector<std::thread> threads;
  for (std::uint32_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t, h = pull] {
      if (!poll_until_done(h, std::chrono::milliseconds(3), Clock::now(), 20000, &polling)) {
        results[t] = "still running after 20 s";
        return;
      }
      auto r = h.wait();
      results[t] = r ? "step " + std::to_string(*r) : r.error().to_string();
    });
  }
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (polling.load() < kThreads && Clock::now() < deadline) std::this_thread::yield();
  EXPECT_EQ(polling.load(), kThreads);
  EXPECT_FALSE(pull.ready());
  EXPECT_TRUE(w1.push(500, g1, 0).wait());
  for (auto& th : threads) th.join();
  ASSERT_TRUE(push0.wait());
  for (std::uint32_t t = 0; t < kThreads; ++t) EXPECT_EQ(results[t], "step 1") << "thread " << t;
  for (std::uint64_t i = 0; i < n; ++i) {
    ASSERT_EQ(dest.floats()[i], initial(500, i) - 2.0f) << "element " << i;
  }
}

}  // namespace
}  // namespace ember::test
