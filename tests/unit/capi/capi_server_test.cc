// The C ABI against real ember-server processes on 127.0.0.1 (started by
// the test on a free port, waited on through their ready line): a round trip
// through pool buffers, wrong keys and sizes, a BSP round seen as
// EMBER_PENDING until the second worker pushes, pipelines, destroying a
// worker that still owns buffers, and a server that dies under a worker.
#include <signal.h>

#include <chrono>
#include <cmath>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "capi/ember.h"
#include "tests/integration/server/harness.h"

namespace ember::test {
namespace {

using ::testing::HasSubstr;

std::string last() { return ember_last_error(); }

// Writes a worker config for `servers` and creates a worker of `rank` from
// it through the C ABI. Returns nullptr (with a test failure) on error.
ember_worker* create_worker(const TempDir& dir, const ClusterSpec& spec,
                            const std::vector<std::string>& servers, std::int64_t rank,
                            const std::vector<const char*>& overrides = {}) {
  const auto path = dir / ("worker" + std::to_string(rank) + ".toml");
  write_file(path, cluster_toml(spec, servers));
  ember_worker* w = nullptr;
  const int rc = ember_worker_create(path.c_str(), rank, overrides.data(), overrides.size(), &w);
  EXPECT_EQ(rc, EMBER_OK) << last();
  return w;
}

// Owns a worker handle for the test's scope.
struct WorkerGuard {
  ember_worker* w;
  ~WorkerGuard() { ember_worker_destroy(w); }
};

class CapiServerOverTransport : public ::testing::TestWithParam<const char*> {};

TEST_P(CapiServerOverTransport, RoundTripThroughPoolBuffers) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.learning_rate = 0.5;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  ember_worker* w = create_worker(dir, spec, {server.address()}, 0);
  ASSERT_NE(w, nullptr);
  WorkerGuard guard{w};

  uint32_t rank = 9, num_workers = 0, num_servers = 0;
  ASSERT_EQ(ember_worker_info(w, &rank, &num_workers, &num_servers), EMBER_OK);
  EXPECT_EQ(rank, 0u);
  EXPECT_EQ(num_workers, 1u);
  EXPECT_EQ(num_servers, 1u);

  void* pmem = nullptr;
  void* gmem = nullptr;
  ASSERT_EQ(ember_alloc(w, 6 * sizeof(float), &pmem), EMBER_OK) << last();
  ASSERT_EQ(ember_alloc(w, 6 * sizeof(float), &gmem), EMBER_OK) << last();
  size_t bytes = 0;
  int in_pool = -1;
  ASSERT_EQ(ember_buffer_info(w, pmem, &bytes, &in_pool), EMBER_OK) << last();
  EXPECT_EQ(bytes, 6 * sizeof(float));
  EXPECT_EQ(in_pool, 1);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(pmem) % 4096, 0u);
  auto* params = static_cast<float*>(pmem);
  auto* grad = static_cast<float*>(gmem);
  for (int i = 0; i < 6; ++i) params[i] = static_cast<float>(i + 1);

  const uint64_t shape[] = {2, 3};
  uint64_t step = 99;
  ASSERT_EQ(ember_init(w, 7, shape, 2, params, 6, &step), EMBER_OK) << last();
  EXPECT_EQ(step, 0u);
  ASSERT_EQ(ember_step(w, 7, &step), EMBER_OK);
  EXPECT_EQ(step, 0u);

  for (int i = 0; i < 6; ++i) grad[i] = 1.0f;
  ASSERT_EQ(ember_push(w, 7, grad, 6, &step), EMBER_OK) << last();
  EXPECT_EQ(step, 0u);
  ASSERT_EQ(ember_pull(w, 7, params, 6, &step), EMBER_OK) << last();
  EXPECT_EQ(step, 1u);
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(params[i], static_cast<float>(i + 1) - 0.5f) << i;

  ember_request* req = nullptr;
  ASSERT_EQ(ember_push_pull_async(w, 7, grad, params, 6, &req), EMBER_OK) << last();
  ASSERT_NE(req, nullptr);
  ASSERT_EQ(ember_wait(req, EMBER_WAIT_FOREVER, &step), EMBER_OK) << last();
  EXPECT_EQ(step, 2u);
  step = 0;
  EXPECT_EQ(ember_wait(req, 0, &step), EMBER_OK);  // done: same result again
  EXPECT_EQ(step, 2u);
  ember_request_free(req);
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(params[i], static_cast<float>(i + 1) - 1.0f) << i;

  uint64_t generation = 99;
  ASSERT_EQ(ember_barrier(w, &generation), EMBER_OK) << last();
  EXPECT_EQ(generation, 0u);

  ASSERT_EQ(ember_set_learning_rate(w, 0.25), EMBER_OK) << last();
  ASSERT_EQ(ember_push_pull(w, 7, grad, params, 6, &step), EMBER_OK) << last();
  EXPECT_EQ(step, 3u);
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(params[i], static_cast<float>(i + 1) - 1.25f) << i;
  EXPECT_EQ(ember_set_learning_rate(w, 0.0), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("learning_rate must be > 0"));
  EXPECT_EQ(ember_set_learning_rate(w, std::nan("")), EMBER_E_INVALID_ARGUMENT);

  EXPECT_EQ(ember_free(w, pmem), EMBER_OK);
  EXPECT_EQ(ember_free(w, pmem), EMBER_E_INVALID_ARGUMENT);  // twice: refused, not a crash
  EXPECT_THAT(last(), HasSubstr("not a live buffer of this worker"));
  EXPECT_EQ(ember_buffer_info(w, pmem, &bytes, &in_pool), EMBER_E_NOT_FOUND);
  EXPECT_EQ(ember_free(w, gmem), EMBER_OK);
  EXPECT_EQ(ember_free(w, nullptr), EMBER_OK);
}

INSTANTIATE_TEST_SUITE_P(Transports, CapiServerOverTransport, ::testing::Values("tcp", "shm"),
                         [](const auto& param_info) { return std::string(param_info.param); });

TEST(CapiServer, WrongKeysAndSizesAreCodesWithMessages) {
  TempDir dir;
  ClusterSpec spec;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  ember_worker* w = create_worker(dir, spec, {server.address()}, 0);
  ASSERT_NE(w, nullptr);
  WorkerGuard guard{w};
  std::vector<float> v(4, 1.0f), out(4);
  const uint64_t shape[] = {4};
  uint64_t step = 0;
  ASSERT_EQ(ember_init(w, 1, shape, 1, v.data(), 4, &step), EMBER_OK) << last();

  // A key nobody init-ed.
  EXPECT_EQ(ember_push(w, 2, v.data(), 4, &step), EMBER_E_NOT_FOUND);
  EXPECT_THAT(last(), HasSubstr("key 2"));
  EXPECT_THAT(last(), HasSubstr("not init-ed"));
  EXPECT_EQ(ember_pull(w, 2, out.data(), 4, &step), EMBER_E_NOT_FOUND);
  EXPECT_EQ(ember_push_pull(w, 2, v.data(), out.data(), 4, &step), EMBER_E_NOT_FOUND);
  ember_request* req = nullptr;
  ASSERT_EQ(ember_push_async(w, 2, v.data(), 4, &req), EMBER_OK);  // found out on wait
  EXPECT_EQ(ember_wait(req, EMBER_WAIT_FOREVER, &step), EMBER_E_NOT_FOUND);
  EXPECT_THAT(last(), HasSubstr("key 2"));
  ember_request_free(req);

  // Wrong sizes.
  EXPECT_EQ(ember_push(w, 1, v.data(), 3, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("4 elements but 3 were given"));
  EXPECT_EQ(ember_pull(w, 1, out.data(), 5, &step), EMBER_E_INVALID_ARGUMENT);
  const uint64_t other[] = {2, 2};
  EXPECT_EQ(ember_init(w, 1, other, 2, v.data(), 4, &step), EMBER_E_SHAPE_MISMATCH);
  EXPECT_THAT(last(), HasSubstr("key 1"));
  EXPECT_EQ(ember_init(w, 3, shape, 1, v.data(), 3, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("4 elements but 3 values"));
  const uint64_t nine_dims[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  EXPECT_EQ(ember_init(w, 4, nine_dims, 9, v.data(), 1, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_EQ(ember_init(w, 4, nullptr, 1, v.data(), 1, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("shape is NULL but ndim is 1"));

  // NULL buffers and required outputs.
  EXPECT_EQ(ember_push(w, 1, nullptr, 4, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("gradient is NULL"));
  EXPECT_EQ(ember_pull(w, 1, nullptr, 4, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("out is NULL"));
  EXPECT_EQ(ember_push_pull(w, 1, v.data(), nullptr, 4, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("out is NULL"));
  EXPECT_EQ(ember_pull_async(w, 1, out.data(), 4, nullptr), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("out_request is NULL"));
  EXPECT_EQ(ember_step(w, 1, nullptr), EMBER_E_INVALID_ARGUMENT);

  // Buffers: zero bytes, absurd sizes, foreign pointers.
  void* data = nullptr;
  EXPECT_EQ(ember_alloc(w, 0, &data), EMBER_E_INVALID_ARGUMENT);
  EXPECT_EQ(ember_alloc(w, std::numeric_limits<size_t>::max(), &data), EMBER_E_TOO_LARGE);
  EXPECT_EQ(ember_alloc(w, 16, nullptr), EMBER_E_INVALID_ARGUMENT);
  EXPECT_EQ(data, nullptr);
  EXPECT_EQ(ember_free(w, v.data()), EMBER_E_INVALID_ARGUMENT);
  EXPECT_EQ(ember_buffer_info(w, v.data(), nullptr, nullptr), EMBER_E_NOT_FOUND);

  // Waiting with a bad timeout.
  ASSERT_EQ(ember_pull_async(w, 1, out.data(), 4, &req), EMBER_OK);
  EXPECT_EQ(ember_wait(req, -5, &step), EMBER_E_INVALID_ARGUMENT);
  EXPECT_EQ(ember_wait(req, EMBER_WAIT_FOREVER, &step), EMBER_OK) << last();
  ember_request_free(req);
  for (float x : out) EXPECT_FLOAT_EQ(x, 1.0f);

  // No [server] checkpoint_dir on this server.
  EXPECT_EQ(ember_checkpoint(w, nullptr), EMBER_E_CONFIG) << last();
  EXPECT_THAT(last(), HasSubstr("checkpoint"));

  // The worker still works after all that.
  ASSERT_EQ(ember_push_pull(w, 1, v.data(), out.data(), 4, &step), EMBER_OK) << last();
}

// One ember-server process, bsp, two C ABI workers (ranks 0 and 1, sgd with
// learning rate 0.5) and key 5 of 3 elements init-ed with {1, 2, 3}.
class CapiTwoWorkers : public ::testing::Test {
 protected:
  void SetUp() override {
    spec.num_workers = 2;
    spec.learning_rate = 0.5;
    server = std::make_unique<ServerProcess>(dir, spec, 0);
    ASSERT_TRUE(server->ok());
    {
      std::thread t([&] { w[1] = create_worker(dir, spec, {server->address()}, 1); });
      w[0] = create_worker(dir, spec, {server->address()}, 0);
      t.join();
    }
    ASSERT_TRUE(w[0] && w[1]);
    const uint64_t shape[] = {3};
    int rc1 = -1;
    std::thread t([&] { rc1 = ember_init(w[1], 5, shape, 1, nullptr, 0, nullptr); });
    ASSERT_EQ(ember_init(w[0], 5, shape, 1, init.data(), 3, nullptr), EMBER_OK) << last();
    t.join();
    ASSERT_EQ(rc1, EMBER_OK);
  }
  void TearDown() override {
    ember_worker_destroy(w[0]);
    ember_worker_destroy(w[1]);
  }

  TempDir dir;
  ClusterSpec spec;
  std::unique_ptr<ServerProcess> server;
  ember_worker* w[2] = {nullptr, nullptr};
  const std::vector<float> init{1, 2, 3};
};

TEST_F(CapiTwoWorkers, BspRequestIsPendingUntilTheOtherWorkerPushes) {
  std::vector<float> g0v(3, 1.0f), g1v(3, 3.0f), p0(3), p1(3);
  ember_request* req = nullptr;
  ASSERT_EQ(ember_push_pull_async(w[0], 5, g0v.data(), p0.data(), 3, &req), EMBER_OK) << last();
  uint64_t step = 0;
  // Step 1's parameters need rank 1's push of step 0, which has not happened.
  EXPECT_EQ(ember_wait(req, 0, &step), EMBER_PENDING);
  EXPECT_EQ(ember_last_error_code(), EMBER_PENDING);
  EXPECT_EQ(last(), "");
  EXPECT_EQ(ember_wait(req, 20, &step), EMBER_PENDING);
  // A huge timeout (INT64_MAX as "forever") waits until done: it returned
  // EMBER_PENDING at once when milliseconds overflowed as nanoseconds.
  std::atomic<int> huge_rc{0};
  std::atomic<bool> huge_returned{false};
  uint64_t huge_step = 0;
  std::thread huge([&] {
    huge_rc = ember_wait(req, INT64_MAX, &huge_step);
    huge_returned = true;
  });
  // The round needs rank 1's push: the wait must still be waiting (it came
  // back at once with the bug; a late-starting thread only hides it).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(huge_returned.load()) << "ember_wait(INT64_MAX) returned " << huge_rc.load();
  const int pushed = ember_push_pull(w[1], 5, g1v.data(), p1.data(), 3, &step);
  huge.join();
  ASSERT_EQ(pushed, EMBER_OK) << last();
  EXPECT_EQ(step, 1u);
  EXPECT_EQ(huge_rc.load(), EMBER_OK);
  EXPECT_EQ(huge_step, 1u);
  ASSERT_EQ(ember_wait(req, EMBER_WAIT_FOREVER, &step), EMBER_OK) << last();
  EXPECT_EQ(step, 1u);
  ember_request_free(req);
  for (int i = 0; i < 3; ++i) {
    EXPECT_FLOAT_EQ(p0[i], init[i] - 0.5f * 2.0f) << i;  // mean gradient (1 + 3) / 2
    EXPECT_EQ(p0[i], p1[i]) << i;
  }
}

// ember_free refuses a buffer that a running asynchronous request was given
// a pointer into (the server may still read it over shm: the breaker's
// repro freed it, the next ember_alloc reused the block and the server
// applied the new contents), and frees it once the request is done.
TEST_F(CapiTwoWorkers, FreeRefusesABufferARunningRequestUses) {
  void* mem = nullptr;
  ASSERT_EQ(ember_alloc(w[0], 4096, &mem), EMBER_OK) << last();
  // The gradient and the reply both sit inside the buffer, past its start.
  auto* f = static_cast<float*>(mem);
  for (int i = 0; i < 3; ++i) f[16 + i] = 1.0f;
  ember_request* req = nullptr;
  ASSERT_EQ(ember_push_pull_async(w[0], 5, f + 16, f + 32, 3, &req), EMBER_OK) << last();
  // Pending: the round needs rank 1's push.
  EXPECT_EQ(ember_free(w[0], mem), EMBER_E_INVALID_ARGUMENT);
  EXPECT_THAT(last(), HasSubstr("is still used by 1 running request(s)"));
  EXPECT_THAT(last(), HasSubstr("nothing was freed"));
  size_t bytes = 0;
  EXPECT_EQ(ember_buffer_info(w[0], mem, &bytes, nullptr), EMBER_OK) << last();
  EXPECT_EQ(bytes, 4096u);
  std::vector<float> g1v(3, 3.0f), p1(3);
  ASSERT_EQ(ember_push_pull(w[1], 5, g1v.data(), p1.data(), 3, nullptr), EMBER_OK) << last();
  uint64_t step = 0;
  ASSERT_EQ(ember_wait(req, EMBER_WAIT_FOREVER, &step), EMBER_OK) << last();
  ember_request_free(req);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(f[32 + i], p1[i]) << i;
  EXPECT_EQ(ember_free(w[0], mem), EMBER_OK) << last();
  EXPECT_EQ(ember_free(w[0], mem), EMBER_E_INVALID_ARGUMENT);  // gone now
}

TEST(CapiServer, ConcurrentAsyncOperationsOnKeysOfDifferentSizes) {
  // A batch-sized tensor (1000 floats, just under batch_threshold), a tiny
  // one and a large one (196 KiB, sent alone) in flight at once.
  TempDir dir;
  ClusterSpec spec;
  spec.learning_rate = 0.5;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  ember_worker* w = create_worker(dir, spec, {server.address()}, 0);
  ASSERT_NE(w, nullptr);
  WorkerGuard guard{w};
  const std::size_t sizes[] = {1000, 10, 784 * 64};
  std::vector<std::vector<float>> params, grads, outs;
  for (std::size_t k = 0; k < 3; ++k) {
    params.emplace_back(sizes[k], static_cast<float>(k));
    grads.emplace_back(sizes[k], 2.0f);
    outs.emplace_back(sizes[k], -1.0f);
    const uint64_t shape[] = {sizes[k]};
    ASSERT_EQ(ember_init(w, k + 1, shape, 1, params[k].data(), sizes[k], nullptr), EMBER_OK)
        << last();
  }
  for (int round = 0; round < 5; ++round) {
    ember_request* reqs[3] = {};
    for (std::size_t k = 0; k < 3; ++k) {
      ASSERT_EQ(ember_push_pull_async(w, k + 1, grads[k].data(), outs[k].data(), sizes[k],
                                      &reqs[k]),
                EMBER_OK)
          << last();
    }
    for (std::size_t k = 0; k < 3; ++k) {
      uint64_t step = 0;
      ASSERT_EQ(ember_wait(reqs[k], EMBER_WAIT_FOREVER, &step), EMBER_OK)
          << "round " << round << " key " << k + 1 << ": " << last();
      EXPECT_EQ(step, static_cast<uint64_t>(round + 1));
      ember_request_free(reqs[k]);
      for (std::size_t i = 0; i < sizes[k]; i += 97) {
        ASSERT_FLOAT_EQ(outs[k][i], static_cast<float>(k) - 1.0f * static_cast<float>(round + 1))
            << k << " " << i;
      }
    }
  }
}

TEST(CapiServer, CheckpointWritesOnEveryServer) {
  TempDir dir;
  ClusterSpec spec;
  spec.checkpoint_dir = (dir / "ckpt").string();
  std::filesystem::create_directories(spec.checkpoint_dir);
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  ember_worker* w = create_worker(dir, spec, {server.address()}, 0);
  ASSERT_NE(w, nullptr);
  WorkerGuard guard{w};
  std::vector<float> v(16, 1.0f);
  const uint64_t shape[] = {16};
  ASSERT_EQ(ember_init(w, 1, shape, 1, v.data(), 16, nullptr), EMBER_OK) << last();
  uint64_t first = 0, second = 0;
  ASSERT_EQ(ember_checkpoint(w, &first), EMBER_OK) << last();
  ASSERT_EQ(ember_checkpoint(w, &second), EMBER_OK) << last();
  EXPECT_GT(second, first);
  EXPECT_FALSE(std::filesystem::is_empty(spec.checkpoint_dir));
}

TEST(CapiServer, PipelineBatchesManySmallTensors) {
  TempDir dir;
  ClusterSpec spec;
  spec.learning_rate = 1.0;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  ember_worker* w = create_worker(dir, spec, {server.address()}, 0);
  ASSERT_NE(w, nullptr);
  WorkerGuard guard{w};
  constexpr int kKeys = 40;
  const uint64_t shape[] = {3};
  std::vector<std::vector<float>> params(kKeys, std::vector<float>(3)),
      grads(kKeys, std::vector<float>(3));
  for (int k = 0; k < kKeys; ++k) {
    for (int i = 0; i < 3; ++i) {
      params[k][i] = static_cast<float>(k * 10 + i);
      grads[k][i] = static_cast<float>(k);
    }
    ASSERT_EQ(ember_init(w, 100 + k, shape, 1, params[k].data(), 3, nullptr), EMBER_OK) << last();
  }
  ember_pipeline* p = nullptr;
  ASSERT_EQ(ember_pipeline_create(w, &p), EMBER_OK);
  std::vector<ember_request*> reqs(kKeys, nullptr);
  for (int k = 0; k < kKeys; ++k) {
    // Half with a request handle, half fire-and-forget (seen by _wait only).
    ASSERT_EQ(ember_pipeline_push_pull(p, 100 + k, grads[k].data(), params[k].data(), 3,
                                       k % 2 == 0 ? &reqs[k] : nullptr),
              EMBER_OK)
        << last();
  }
  ASSERT_EQ(ember_pipeline_wait(p), EMBER_OK) << last();
  for (int k = 0; k < kKeys; ++k) {
    for (int i = 0; i < 3; ++i) {
      EXPECT_FLOAT_EQ(params[k][i], static_cast<float>(k * 10 + i - k)) << k << " " << i;
    }
    if (reqs[k] != nullptr) {
      uint64_t step = 0;
      EXPECT_EQ(ember_wait(reqs[k], 0, &step), EMBER_OK);
      EXPECT_EQ(step, 1u);
      ember_request_free(reqs[k]);
    }
  }
  // An error inside a pipeline comes out of _wait.
  std::vector<float> x(3);
  ASSERT_EQ(ember_pipeline_pull(p, 100, x.data(), 3, nullptr), EMBER_OK);
  ASSERT_EQ(ember_pipeline_push(p, 999, x.data(), 3, nullptr), EMBER_OK);
  ASSERT_EQ(ember_pipeline_flush(p), EMBER_OK) << last();
  EXPECT_EQ(ember_pipeline_wait(p), EMBER_E_NOT_FOUND);
  EXPECT_THAT(last(), HasSubstr("key 999"));
  EXPECT_EQ(ember_pipeline_push(p, 100, nullptr, 3, nullptr), EMBER_E_INVALID_ARGUMENT);
  ember_pipeline_destroy(p);
}

TEST(CapiServer, DestroyReleasesBuffersPipelinesAndKeepsRequestsValid) {
  TempDir dir;
  ClusterSpec spec;
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  ember_worker* w = create_worker(dir, spec, {server.address()}, 0);
  ASSERT_NE(w, nullptr);
  void* a = nullptr;
  void* b = nullptr;
  void* big = nullptr;
  ASSERT_EQ(ember_alloc(w, 4096, &a), EMBER_OK);
  ASSERT_EQ(ember_alloc(w, 100, &b), EMBER_OK);
  ASSERT_EQ(ember_alloc(w, (std::size_t{64} << 20) + 1, &big), EMBER_OK) << last();
  int in_pool = -1;
  ASSERT_EQ(ember_buffer_info(w, big, nullptr, &in_pool), EMBER_OK);
  EXPECT_EQ(in_pool, 0);  // more than the test pool holds (prealloc_pages = 16: 32 MiB): heap
  ember_pipeline* p = nullptr;
  ASSERT_EQ(ember_pipeline_create(w, &p), EMBER_OK);
  const uint64_t shape[] = {2};
  auto* f = static_cast<float*>(a);
  f[0] = 1;
  f[1] = 2;
  ASSERT_EQ(ember_init(w, 1, shape, 1, f, 2, nullptr), EMBER_OK) << last();
  ember_request* req = nullptr;
  ASSERT_EQ(ember_pull_async(w, 1, f, 2, &req), EMBER_OK);
  ASSERT_EQ(ember_wait(req, EMBER_WAIT_FOREVER, nullptr), EMBER_OK) << last();
  ember_worker_destroy(w);  // frees a, b, big and p
  uint64_t step = 99;
  EXPECT_EQ(ember_wait(req, 0, &step), EMBER_OK);  // the request outlives its worker
  EXPECT_EQ(step, 0u);
  ember_request_free(req);
}

TEST(CapiServer, ServerGoneIsAnErrorNotACrash) {
  TempDir dir;
  ClusterSpec spec;
  spec.request_timeout = "3s";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  ember_worker* w = create_worker(dir, spec, {server.address()}, 0,
                                  {"worker.connect_retries=0", "worker.connect_timeout=1s"});
  ASSERT_NE(w, nullptr);
  WorkerGuard guard{w};
  std::vector<float> v(8, 1.0f);
  const uint64_t shape[] = {8};
  ASSERT_EQ(ember_init(w, 1, shape, 1, v.data(), 8, nullptr), EMBER_OK) << last();
  server.process().signal(SIGKILL);
  ASSERT_TRUE(server.process().wait_exit(10s));
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = ember_push_pull(w, 1, v.data(), v.data(), 8, nullptr);
  EXPECT_NE(rc, EMBER_OK);
  EXPECT_TRUE(rc == EMBER_E_CLOSED || rc == EMBER_E_IO || rc == EMBER_E_TIMEOUT) << rc << last();
  EXPECT_FALSE(last().empty());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_NE(ember_barrier(w, nullptr), EMBER_OK);
}

}  // namespace
}  // namespace ember::test
