// End to end through real ember-server processes on 127.0.0.1: the main
// path (init → push → pull → barrier under BSP), BSP determinism, ASP
// exactly-once, the SSP bound, each optimizer, and chunked tensors over three
// servers.
#include <atomic>
#include <cmath>
#include <random>
#include <bit>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "common/placement/placement.h"
#include "tests/integration/server/harness.h"
#include "tests/integration/server/workers.h"
#include "worker/worker.h"

namespace ember::test {
namespace {

class ServerOverTransport : public ::testing::TestWithParam<const char*> {};

TEST_P(ServerOverTransport, BspInitPushPullBarrierTwoWorkers) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.num_workers = 2;
  spec.learning_rate = 0.5;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()});
  ASSERT_TRUE(workers[0] && workers[1]);
  const std::uint64_t shape[] = {2, 3};
  const std::vector<float> init{1, 2, 3, 4, 5, 6};
  on_all(2, [&](std::uint32_t r) {
    Worker& w = *workers[r];
    auto h = w.init(7, shape, r == 0 ? std::span<const float>(init) : std::span<const float>());
    auto res = h.wait();
    ASSERT_TRUE(res) << res.error().to_string();
    EXPECT_EQ(*res, 0u);
    std::vector<float> params(6);
    for (int step = 0; step < 5; ++step) {
      std::vector<float> grad(6, static_cast<float>(r + 1));  // ranks push 1 and 2: mean 1.5
      auto p = w.push(7, grad).wait();
      ASSERT_TRUE(p) << p.error().to_string();
      auto q = w.pull(7, params).wait();
      ASSERT_TRUE(q) << q.error().to_string();
      EXPECT_EQ(*q, static_cast<std::uint64_t>(step + 1));
      ASSERT_TRUE(w.barrier().wait());
    }
    for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(params[i], init[i] - 5 * 0.5f * 1.5f) << i;
  });
}

// Large tensors: chunks leave from pool memory (tcp: gathered writes; shm:
// by reference) and replies come back in pool blocks.
TEST_P(ServerOverTransport, LargeChunkedTensorRoundTrips) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.num_workers = 2;
  spec.partition_bytes = "1MB";
  spec.learning_rate = 1.0;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()});
  ASSERT_TRUE(workers[0] && workers[1]);
  const std::uint64_t n = 3 * (1u << 20) / 4 + 1000;  // 3 MiB + change: 4 chunks
  const std::uint64_t shape[] = {n};
  on_all(2, [&](std::uint32_t r) {
    Worker& w = *workers[r];
    TensorBuffer values = w.allocate(n * 4);
    for (std::uint64_t i = 0; i < n; ++i) values.floats()[i] = static_cast<float>(i % 1000);
    ASSERT_TRUE(w.init(11, shape, r == 0 ? std::span<const float>(values.floats()) : std::span<const float>()).wait());
    TensorBuffer grad = w.allocate(n * 4);
    for (std::uint64_t i = 0; i < n; ++i) grad.floats()[i] = static_cast<float>(r);  // mean 0.5
    TensorBuffer out = w.allocate(n * 4);
    for (int t = 0; t < 2; ++t) {
      auto res = w.push_pull(11, grad.floats(), out.floats()).wait();
      ASSERT_TRUE(res) << res.error().to_string();
    }
    for (std::uint64_t i = 0; i < n; i += 997) {
      ASSERT_EQ(out.floats()[i], static_cast<float>(i % 1000) - 1.0f) << i;
    }
    // Pulls into pool memory (written in place over shm) and into plain
    // memory (sent as data: the server cannot reach it) agree.
    TensorBuffer pooled = w.allocate(n * 4);
    std::vector<float> plain(n);
    ASSERT_TRUE(w.pull(11, pooled.floats()).wait());
    ASSERT_TRUE(w.pull(11, plain).wait());
    ASSERT_EQ(std::vector<float>(pooled.floats().begin(), pooled.floats().end()), plain);
    EXPECT_EQ(plain[5], 5.0f - 1.0f);
  });
  // Over shm every large reply into pool memory was written in place: the
  // 2 push_pulls and the pool pull of each worker, 4 chunks each; over tcp none.
  const std::string text = http_get(server.metrics_address(), "/metrics");
  const std::string expect = std::string("ember_server_replies_in_place_total ") +
                             (std::string(GetParam()) == "shm" ? "24" : "0");
  EXPECT_NE(text.find(expect + "\n"), std::string::npos) << expect << "\n" << text;
  // Over tcp (bsp) every reply larger than a batch went out from the
  // parameter store without a copy: 4 replies of each worker, 4 chunks each
  // (the last, 4,000 bytes plus its header, is over the 4 KiB batch limit).
  const std::string lent = std::string("ember_server_replies_zero_copy_total ") +
                           (std::string(GetParam()) == "tcp" ? "32" : "0");
  EXPECT_NE(text.find(lent + "\n"), std::string::npos) << lent << "\n" << text;
  // Copy-on-write events are exported (their count depends on timing: a
  // reply's lease is dropped just after its last write).
  EXPECT_NE(text.find("\nember_server_lent_copies "), std::string::npos) << text;
}

// Small requests over shm are handled on the server's I/O thread when their
// shard is idle (serial requests: nearly always); over tcp never. Either way
// the parameters are the same.
TEST_P(ServerOverTransport, SmallRequestsAreHandledInlineOnlyOverShm) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.num_workers = 1;
  spec.learning_rate = 0.25;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()});
  ASSERT_TRUE(workers[0]);
  Worker& w = *workers[0];
  const std::uint64_t n = 1024;  // 4 KiB
  const std::uint64_t shape[] = {n};
  std::vector<float> init(n, 1.0f), grad(n), out(n);
  for (std::uint64_t i = 0; i < n; ++i) grad[i] = static_cast<float>(i % 8);
  ASSERT_TRUE(w.init(3, shape, init).wait());
  const int steps = 40;
  for (int t = 0; t < steps; ++t) {
    auto p = w.push(3, grad).wait();
    ASSERT_TRUE(p) << p.error().to_string();
    auto q = w.pull(3, out).wait();
    ASSERT_TRUE(q) << q.error().to_string();
    EXPECT_EQ(*q, static_cast<std::uint64_t>(t + 1));
  }
  for (std::uint64_t i = 0; i < n; ++i) {
    float expect = 1.0f;
    for (int t = 0; t < steps; ++t) expect -= 0.25f * static_cast<float>(i % 8);
    ASSERT_EQ(out[i], expect) << i;
  }
  const std::string text = http_get(server.metrics_address(), "/metrics");
  const long inline_requests = metric_value(text, "ember_server_requests_inline_total");
  ASSERT_GE(inline_requests, 0) << text;
  if (std::string(GetParam()) == "shm") {
    EXPECT_GT(inline_requests, 0) << text;
    EXPECT_LE(inline_requests, 2 * steps) << text;
  } else {
    EXPECT_EQ(inline_requests, 0) << text;
  }
}

// A batch of many small requests goes to the shard threads even when they
// are idle: only the last kInlineMaxFollowing (8) of each batch may be
// handled on the I/O thread (server.cc). A pipelined burst of 64 tiny
// push_pulls leaves in batches of over 20 (Connection::cork), so at most
// 8 x 4 of them are inline; before, an idle server took nearly all inline.
TEST(ServerOverShm, ABatchOfManySmallRequestsGoesToTheShardThreads) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 1;
  spec.learning_rate = 0.5;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()});
  ASSERT_TRUE(workers[0]);
  Worker& w = *workers[0];
  constexpr int kKeys = 64;
  constexpr std::uint64_t kElems = 16;
  const std::uint64_t shape[] = {kElems};
  std::vector<float> init(kElems, 1.0f), grad(kElems, 2.0f);
  std::vector<std::vector<float>> out(kKeys, std::vector<float>(kElems));
  for (int k = 0; k < kKeys; ++k) ASSERT_TRUE(w.init(100 + k, shape, init).wait());
  const long before =
      metric_value(http_get(server.metrics_address(), "/metrics"), "ember_server_requests_inline_total");
  ASSERT_GE(before, 0);
  {
    auto pipe = w.pipeline();
    for (int k = 0; k < kKeys; ++k) pipe.enqueue_push_pull(100 + k, grad, out[k]);
    auto s = pipe.wait();
    ASSERT_TRUE(s) << s.error().to_string();
  }
  for (int k = 0; k < kKeys; ++k) {
    for (std::uint64_t i = 0; i < kElems; ++i) ASSERT_EQ(out[k][i], 0.0f) << k << " " << i;  // 1 - 0.5 * 2
  }
  const std::string text = http_get(server.metrics_address(), "/metrics");
  const long inline_burst = metric_value(text, "ember_server_requests_inline_total") - before;
  EXPECT_LE(inline_burst, 32) << text;
}

INSTANTIATE_TEST_SUITE_P(Transports, ServerOverTransport, ::testing::Values("tcp", "shm"),
                         [](const ::testing::TestParamInfo<const char*>& param_info) {
                           return std::string(param_info.param);
                         });


// --- BSP determinism: K workers == one worker with the combined batch ---

// A worker's gradient for its shard of the batch: a deterministic function
// of the parameters, the step and the rank (float arithmetic only).
std::vector<float> shard_gradient(const std::vector<float>& p, std::uint32_t rank, int step) {
  std::vector<float> g(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const float a = 0.1f + 0.01f * static_cast<float>((rank * 7 + i) % 13);
    const float b = std::sin(static_cast<float>(step * 31 + rank * 17 + i));
    g[i] = a * p[i] + b;
  }
  return g;
}

// Parameters after `steps` BSP steps with K workers each pushing its shard's
// gradient (or, when combine, one worker pushing the mean of the K shard
// gradients summed in rank order).
std::vector<float> run_bsp(std::uint32_t k, bool combine, int steps) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_workers = combine ? 1 : k;
  spec.optimizer = "momentum";
  spec.learning_rate = 0.05;
  ServerProcess server(dir, spec, 0);
  EXPECT_TRUE(server.ok());
  if (!server.ok()) return {};
  auto workers = make_workers(spec, {server.address()});
  const std::size_t n = 257;
  std::vector<float> init(n);
  for (std::size_t i = 0; i < n; ++i) init[i] = std::cos(static_cast<float>(i));
  const std::uint64_t shape[] = {n};
  std::vector<float> result;
  on_all(spec.num_workers, [&](std::uint32_t r) {
    Worker& w = *workers[r];
    ASSERT_TRUE(w.init(3, shape, r == 0 ? std::span<const float>(init) : std::span<const float>()).wait());
    std::vector<float> p(n);
    ASSERT_TRUE(w.pull(3, p).wait());
    for (int t = 0; t < steps; ++t) {
      std::vector<float> g;
      if (combine) {
        g = shard_gradient(p, 0, t);
        for (std::uint32_t q = 1; q < k; ++q) {
          const auto gq = shard_gradient(p, q, t);
          for (std::size_t i = 0; i < n; ++i) g[i] += gq[i];
        }
        for (auto& x : g) x /= static_cast<float>(k);
      } else {
        g = shard_gradient(p, r, t);
      }
      auto res = w.push_pull(3, g, p).wait();
      ASSERT_TRUE(res) << res.error().to_string();
    }
    if (r == 0) result = p;
  });
  return result;
}

TEST(ServerEndToEnd, BspTwoAndFourWorkersMatchOneWorkerBitForBit) {
  for (std::uint32_t k : {2u, 4u}) {
    const auto single = run_bsp(k, true, 4);
    const auto multi = run_bsp(k, false, 4);
    ASSERT_EQ(single.size(), 257u);
    ASSERT_EQ(multi.size(), 257u);
    for (std::size_t i = 0; i < single.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(single[i]), std::bit_cast<std::uint32_t>(multi[i]))
          << "K=" << k << " element " << i << ": " << single[i] << " vs " << multi[i];
    }
  }
}

// --- ASP: every push applied exactly once ---

TEST(ServerEndToEnd, AspAppliesEveryPushExactlyOnce) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_workers = 2;
  spec.consistency = "asp";
  spec.learning_rate = 1.0;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()});
  const std::uint64_t shape[] = {4};
  const std::vector<float> init(4, 1000.0f);
  const int pushes = 60;
  on_all(2, [&](std::uint32_t r) {
    Worker& w = *workers[r];
    ASSERT_TRUE(w.init(1, shape, r == 0 ? std::span<const float>(init) : std::span<const float>()).wait());
    const std::vector<float> one(4, 1.0f);
    std::vector<float> p(4);
    for (int t = 0; t < pushes; ++t) {
      ASSERT_TRUE(w.push(1, one, static_cast<std::uint64_t>(t)).wait());
      if (t % 10 == 9) {
        // Re-send an earlier step, as after a reconnect: acknowledged, not applied.
        ASSERT_TRUE(w.push(1, one, static_cast<std::uint64_t>(t - 3)).wait());
        ASSERT_TRUE(w.pull(1, p).wait());  // asp pulls never wait
      }
    }
    ASSERT_TRUE(w.barrier().wait());
    ASSERT_TRUE(w.pull(1, p).wait());
    for (float x : p) EXPECT_EQ(x, 1000.0f - 2 * pushes);
  });
}

// --- SSP: nobody runs more than s steps ahead of the slowest ---

TEST(ServerEndToEnd, SspNeverLetsAWorkerRunMoreThanSStepsAhead) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_workers = 2;
  spec.consistency = "ssp";
  spec.staleness = 2;
  spec.learning_rate = 0.001;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()});
  const std::uint64_t shape[] = {8};
  const std::vector<float> init(8, 0.0f);
  const int steps = 12;
  const std::uint64_t s = spec.staleness;
  std::atomic<int> issued[2] = {0, 0};       // pushes worker r has started
  std::mutex mutex;
  std::condition_variable cv;
  int pulls_started0 = 0;                    // pulls worker 0 has started (guarded)
  std::atomic<int> violations{0};
  std::atomic<bool> failed{false};
  on_all(2, [&](std::uint32_t r) {
    Worker& w = *workers[r];
    if (!w.init(2, shape, r == 0 ? std::span<const float>(init) : std::span<const float>()).wait()) {
      failed = true;
      return;
    }
    const std::vector<float> g(8, 1.0f);
    std::vector<float> p(8);
    for (int t = 0; t < steps && !failed; ++t) {
      if (r == 1) {
        // The slow worker: step t starts only once the fast one has asked
        // for step t + s + 1, which SSP must hold back until this push.
        std::unique_lock lock(mutex);
        cv.wait_for(lock, 10s, [&] {
          return pulls_started0 >= std::min(t + static_cast<int>(s) + 1, steps);
        });
      }
      issued[r].fetch_add(1);
      if (!w.push(2, g).wait()) failed = true;
      if (r == 0) {
        std::lock_guard lock(mutex);
        ++pulls_started0;
        cv.notify_all();
      }
      auto res = w.pull(2, p).wait();  // wants step t + 1
      if (!res) {
        failed = true;
        break;
      }
      if (r == 0) {
        // Back from pull(t + 1): the slow worker has pushed >= t + 1 - s steps.
        const int behind = (t + 1) - issued[1].load();
        if (behind > static_cast<int>(s)) violations.fetch_add(1);
      }
    }
  });
  EXPECT_FALSE(failed);
  EXPECT_EQ(violations.load(), 0);
}

// --- each optimizer against a hand reference ---

struct OptCase {
  const char* type;
  const char* extra;
};
void PrintTo(const OptCase& c, std::ostream* os) { *os << c.type; }

class ServerOptimizer : public ::testing::TestWithParam<OptCase> {};

TEST_P(ServerOptimizer, MatchesHandReferenceOverSeveralSteps) {
  const OptCase c = GetParam();
  TempDir dir;
  ClusterSpec spec;
  spec.optimizer = c.type;
  spec.learning_rate = 0.1;
  spec.extra_optimizer = c.extra;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()});
  Worker& w = *workers[0];
  const std::vector<float> p0{1.0f, -2.0f, 0.5f};
  const std::uint64_t shape[] = {3};
  ASSERT_TRUE(w.init(9, shape, p0).wait());
  const std::vector<std::vector<float>> grads{{0.5f, 0.5f, -1.0f}, {0.5f, -0.25f, 2.0f},
                                              {0.1f, 0.2f, 0.3f}, {-1.0f, 1.0f, 0.0f}};
  // Reference in double, hyper-parameters as configured below.
  const double lr = 0.1, mu = 0.9, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01, acc0 = 0.1;
  std::vector<double> p(p0.begin(), p0.end()), m(3, 0.0), v(3, 0.0), sum(3, acc0), buf(3, 0.0);
  const std::string type = c.type;
  const bool nesterov = std::string(c.extra).find("nesterov = true") != std::string::npos;
  std::vector<float> got(3);
  for (std::size_t t = 1; t <= grads.size(); ++t) {
    for (std::size_t i = 0; i < 3; ++i) {
      double g = grads[t - 1][i];
      if (type == "sgd") {
        p[i] -= lr * g;
      } else if (type == "momentum") {
        buf[i] = t == 1 ? g : mu * buf[i] + g;
        p[i] -= lr * (nesterov ? g + mu * buf[i] : buf[i]);
      } else if (type == "adam" || type == "adamw") {
        if (type == "adamw") p[i] *= 1 - lr * wd;
        m[i] = b1 * m[i] + (1 - b1) * g;
        v[i] = b2 * v[i] + (1 - b2) * g * g;
        p[i] -= lr / (1 - std::pow(b1, t)) * m[i] /
                (std::sqrt(v[i]) / std::sqrt(1 - std::pow(b2, t)) + eps);
      } else if (type == "adagrad") {
        sum[i] += g * g;
        p[i] -= lr * g / (std::sqrt(sum[i]) + eps);
      }
    }
    ASSERT_TRUE(w.push_pull(9, grads[t - 1], got).wait());
    for (std::size_t i = 0; i < 3; ++i) {
      EXPECT_NEAR(got[i], p[i], 1e-5 * (1 + std::abs(p[i]))) << type << " step " << t << " i " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllTypes, ServerOptimizer,
    ::testing::Values(OptCase{"sgd", ""}, OptCase{"momentum", "momentum = 0.9"},
                      OptCase{"momentum", "momentum = 0.9\nnesterov = true"},
                      OptCase{"adam", "beta1 = 0.9\nbeta2 = 0.999\nepsilon = 1e-8"},
                      OptCase{"adamw", "weight_decay = 0.01\nepsilon = 1e-8"},
                      OptCase{"adagrad", "initial_accumulator = 0.1\nepsilon = 1e-8"}),
    [](const ::testing::TestParamInfo<OptCase>& param_info) {
      std::string n = param_info.param.type;
      if (std::string(param_info.param.extra).find("nesterov") != std::string::npos) n += "_nesterov";
      return n;
    });

// --- three servers, a tensor cut into chunks ---

TEST(ServerEndToEnd, ThreeServersServeAChunkedTensor) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_servers = 3;
  spec.num_workers = 2;
  spec.partition_bytes = "4KB";
  spec.learning_rate = 0.25;
  std::vector<std::unique_ptr<ServerProcess>> servers;
  std::vector<std::string> addresses;
  for (std::uint32_t i = 0; i < 3; ++i) {
    servers.push_back(std::make_unique<ServerProcess>(dir, spec, i));
    ASSERT_TRUE(servers.back()->ok());
    addresses.push_back(servers.back()->address());
  }
  const std::uint64_t n = 10000;  // 40,000 bytes: 10 chunks
  const Key key = 42;
  std::set<std::uint32_t> used;
  for (const auto& c : placement::chunk_plan(key, n * 4, 4, 4096, 3, 1)) used.insert(c.server);
  ASSERT_EQ(used.size(), 3u) << "the test key must spread over all three servers";
  auto workers = make_workers(spec, addresses);
  std::vector<float> init(n);
  for (std::uint64_t i = 0; i < n; ++i) init[i] = static_cast<float>(i % 100);
  std::vector<std::vector<float>> grads(2, std::vector<float>(n));
  for (std::uint64_t i = 0; i < n; ++i) {
    grads[0][i] = static_cast<float>(i % 7);
    grads[1][i] = static_cast<float>(i % 5) * 0.5f;
  }
  const std::uint64_t shape[] = {100, 100};
  std::vector<std::vector<float>> out(2, std::vector<float>(n));
  on_all(2, [&](std::uint32_t r) {
    Worker& w = *workers[r];
    ASSERT_TRUE(w.init(key, shape, r == 0 ? std::span<const float>(init) : std::span<const float>()).wait());
    // The gradient lives in pool memory: chunks leave without a copy.
    TensorBuffer g = w.allocate(n * 4);
    std::copy(grads[r].begin(), grads[r].end(), g.floats().begin());
    for (int t = 0; t < 3; ++t) {
      auto res = w.push_pull(key, g.floats(), out[r]).wait();
      ASSERT_TRUE(res) << res.error().to_string();
      EXPECT_EQ(*res, static_cast<std::uint64_t>(t + 1));
    }
  });
  std::vector<float> expect = init;
  for (int t = 0; t < 3; ++t) {
    for (std::uint64_t i = 0; i < n; ++i) {
      float s = grads[0][i];
      s += grads[1][i];
      s /= 2.0f;
      expect[i] -= 0.25f * s;
    }
  }
  EXPECT_EQ(out[0], expect);
  EXPECT_EQ(out[1], expect);
  for (auto& s : servers) {
    const std::string text = http_get(s->metrics_address(), "/metrics");
    EXPECT_NE(text.find("ember_server_bytes_received_total"), std::string::npos);
  }
}

// --- pipeline: many small gradients batched ---

TEST(ServerEndToEnd, PipelineBatchesManySmallKeys) {
  TempDir dir;
  ClusterSpec spec;
  spec.num_workers = 2;
  spec.learning_rate = 1.0;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()});
  const int keys = 300;
  const std::uint64_t shape[] = {16};
  on_all(2, [&](std::uint32_t r) {
    Worker& w = *workers[r];
    std::vector<float> init(16, 10.0f);
    std::vector<Handle> inits;
    for (int k = 0; k < keys; ++k) {
      inits.push_back(w.init(static_cast<Key>(k), shape, r == 0 ? std::span<const float>(init) : std::span<const float>()));
    }
    ASSERT_TRUE(wait_all(inits));
    std::vector<float> grad(16, static_cast<float>(r));  // mean 0.5
    std::vector<std::vector<float>> out(keys, std::vector<float>(16));
    {
      auto pipe = w.pipeline();
      for (int k = 0; k < keys; ++k) pipe.enqueue(static_cast<Key>(k), grad);
      ASSERT_TRUE(pipe.wait());
      for (int k = 0; k < keys; ++k) pipe.enqueue_pull(static_cast<Key>(k), out[k]);
      ASSERT_TRUE(pipe.wait());
    }
    for (int k = 0; k < keys; ++k) {
      ASSERT_EQ(out[k][0], 9.5f) << "key " << k;
    }
  });
}

}  // namespace
}  // namespace ember::test
