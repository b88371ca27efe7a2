// Adversarial end-to-end checks of the server's inline path (commit 0a7a2de:
// small shm requests handled on the I/O thread when their shard is idle),
// with real ember-server processes and workers over shm on two I/O threads
// and the smallest rings, so that I/O-thread sends often fall back to the
// shard threads:
//  - bsp, 4 workers: inline-eligible keys (<= 64 KiB chunks) mixed with
//    shard-handled ones (> 64 KiB, and a large in-place tensor), through
//    pipelines, push_pull, barriers and set_learning_rate, compared bit for
//    bit with a hand-computed reference (small dyadic rationals: every float
//    operation is exact whatever the order);
//  - asp and ssp, 4 workers: every push applied exactly once;
//  - SIGTERM during small-key traffic: exit 0, and the final checkpoint holds
//    every acknowledged push;
//  - kill -9 of a worker under shrink and wait (rejoin);
//  - a stopped worker must not stall a shard that owns none of its keys
//    (it did on 0a7a2de, see the test).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>

#include <gtest/gtest.h>

#include "common/config/config.h"
#include "server/shard.h"
#include "tests/integration/server/harness.h"
#include "tests/integration/server/workers.h"
#include "worker/worker.h"

namespace ember::test {
namespace {

// [communication] settings for the server (--set) and the workers: two I/O
// threads (so two producers per shard ring) and the smallest rings, so that
// sends on I/O threads find them full and fall back to the shard threads.
const std::vector<std::string> kComm = {"communication.io_threads=2",
                                        "communication.ring_buffer_size=2",
                                        "communication.busy_poll=0us"};

std::vector<std::string> server_args(const std::vector<std::string>& comm) {
  std::vector<std::string> out;
  for (const auto& s : comm) {
    out.push_back("--set");
    out.push_back(s);
  }
  return out;
}

void stop_server(ServerProcess& server) {
  server.process().signal(SIGTERM);
  const auto status = server.process().wait_exit(20s);
  ASSERT_TRUE(status) << "ember-server did not exit after SIGTERM; log:\n" << server.log();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << server.log();
}

// Small integers: sums of 4 of them divided by 4, times 1/2 or 1/4, stay
// exact dyadic rationals.
float init_value(std::uint64_t key, std::uint64_t i) { return static_cast<float>((key * 3 + i) % 11); }
float grad_value(std::uint32_t rank, std::uint64_t key, std::uint64_t step, std::uint64_t i) {
  return static_cast<float>(static_cast<int>(((rank + 1) * (key + step + i)) % 5) - 2);
}

struct KeySpec {
  Key key;
  std::uint64_t elements;
};

// BSP, 4 workers, 3 shards: per step a pipeline of pushes of small keys
// (inline-eligible; the 16384-element key is exactly 64 KiB), a push_pull of
// a 16385-element key (over 64 KiB: shard thread) and of a 600,000-element
// key in pool memory (in place), then a pipeline of pulls checked against
// the reference; set_learning_rate between barriers at step 4.
TEST(InlineBreakit, BspMixedKeysMatchReferenceBitForBit) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 4;
  spec.shards = 3;
  spec.learning_rate = 0.5;
  ServerProcess server(dir, spec, 0, server_args(kComm));
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()}, kComm);
  for (auto& w : workers) ASSERT_TRUE(w);
  std::vector<KeySpec> small;
  const std::uint64_t sizes[] = {1, 7, 256, 1000, 1024, 4096, 16384};
  for (Key k = 0; k < 35; ++k) small.push_back({k, sizes[k % 7]});
  const KeySpec medium{100, 16385};
  const KeySpec large{101, 600000};
  const int steps = 10;
  // Reference parameters after each step.
  auto reference = [&](const KeySpec& ks, int after_steps) {
    std::vector<float> p(ks.elements);
    for (std::uint64_t i = 0; i < ks.elements; ++i) p[i] = init_value(ks.key, i);
    for (int t = 0; t < after_steps; ++t) {
      const float lr = t < 4 ? 0.5f : 0.25f;
      for (std::uint64_t i = 0; i < ks.elements; ++i) {
        float sum = 0;
        for (std::uint32_t r = 0; r < 4; ++r) sum += grad_value(r, ks.key, static_cast<std::uint64_t>(t), i);
        p[i] -= lr * (sum / 4.0f);
      }
    }
    return p;
  };
  std::vector<std::vector<std::vector<float>>> expect_small(steps + 1);
  for (int t = 0; t <= steps; ++t) {
    for (const auto& ks : small) expect_small[t].push_back(reference(ks, t));
  }
  const auto expect_medium = reference(medium, steps);
  const auto expect_large = reference(large, steps);

  on_all(4, [&](std::uint32_t r) {
    Worker& w = *workers[r];
    std::vector<Handle> inits;
    auto init_of = [&](const KeySpec& ks) {
      const std::uint64_t shape[] = {ks.elements};
      std::vector<float> v(ks.elements);
      for (std::uint64_t i = 0; i < ks.elements; ++i) v[i] = init_value(ks.key, i);
      inits.push_back(w.init(ks.key, shape, r == 0 ? std::span<const float>(v) : std::span<const float>()));
      // Waited here: v is the init's data.
      auto res = inits.back().wait();
      ASSERT_TRUE(res) << res.error().to_string();
    };
    for (const auto& ks : small) init_of(ks);
    init_of(medium);
    init_of(large);
    std::vector<std::vector<float>> grads(small.size()), outs(small.size());
    std::vector<float> mgrad(medium.elements), mout(medium.elements);
    TensorBuffer lgrad = w.allocate(large.elements * 4), lout = w.allocate(large.elements * 4);
    for (int t = 0; t < steps; ++t) {
      if (t == 4) {
        ASSERT_TRUE(w.barrier().wait());
        if (r == 0) {
          auto lr = w.set_learning_rate(0.25).wait();
          ASSERT_TRUE(lr) << lr.error().to_string();
        }
        ASSERT_TRUE(w.barrier().wait());
      }
      for (std::size_t k = 0; k < small.size(); ++k) {
        grads[k].resize(small[k].elements);
        outs[k].assign(small[k].elements, -1000.0f);
        for (std::uint64_t i = 0; i < small[k].elements; ++i) {
          grads[k][i] = grad_value(r, small[k].key, static_cast<std::uint64_t>(t), i);
        }
      }
      for (std::uint64_t i = 0; i < medium.elements; ++i) {
        mgrad[i] = grad_value(r, medium.key, static_cast<std::uint64_t>(t), i);
      }
      for (std::uint64_t i = 0; i < large.elements; ++i) {
        lgrad.floats()[i] = grad_value(r, large.key, static_cast<std::uint64_t>(t), i);
      }
      {
        auto pipe = w.pipeline();
        std::vector<Handle> hs;
        for (std::size_t k = 0; k < small.size(); ++k) hs.push_back(pipe.enqueue(small[k].key, grads[k]));
        auto s = pipe.wait();
        ASSERT_TRUE(s) << s.error().to_string();
        for (auto& h : hs) {
          auto res = h.wait();
          ASSERT_TRUE(res) << res.error().to_string();
        }
      }
      auto hm = w.push_pull(medium.key, mgrad, mout);
      auto hl = w.push_pull(large.key, lgrad.floats(), lout.floats());
      {
        auto pipe = w.pipeline();
        std::vector<Handle> hs;
        for (std::size_t k = 0; k < small.size(); ++k) hs.push_back(pipe.enqueue_pull(small[k].key, outs[k]));
        auto s = pipe.wait();
        ASSERT_TRUE(s) << s.error().to_string();
        for (std::size_t k = 0; k < small.size(); ++k) {
          auto res = hs[k].wait();
          ASSERT_TRUE(res) << res.error().to_string();
          EXPECT_EQ(*res, static_cast<std::uint64_t>(t + 1)) << "key " << small[k].key;
        }
      }
      auto rm = hm.wait();
      ASSERT_TRUE(rm) << rm.error().to_string();
      auto rl = hl.wait();
      ASSERT_TRUE(rl) << rl.error().to_string();
      for (std::size_t k = 0; k < small.size(); ++k) {
        ASSERT_EQ(outs[k], expect_small[t + 1][k]) << "rank " << r << " step " << t << " key " << small[k].key;
      }
      if (t % 3 == 2) {
        ASSERT_TRUE(w.barrier().wait());
      }
    }
    ASSERT_EQ(mout, expect_medium) << "rank " << r;
    ASSERT_TRUE(std::equal(expect_large.begin(), expect_large.end(), lout.floats().begin())) << "rank " << r;
  });
  // Whether the shards were ever idle under the 4 workers' traffic depends on
  // scheduling; serial pulls of a small key meet an idle shard, so the inline
  // path is taken (and answers correctly) whatever the machine's load.
  for (int i = 0; i < 20; ++i) {
    std::vector<float> out(small[0].elements, -1000.0f);
    auto res = workers[0]->pull(small[0].key, out, static_cast<std::uint64_t>(steps)).wait();
    ASSERT_TRUE(res) << res.error().to_string();
    ASSERT_EQ(out, expect_small[steps][0]) << "serial pull " << i;
  }
  const std::string text = http_get(server.metrics_address(), "/metrics");
  EXPECT_GT(metric_value(text, "ember_server_requests_inline_total"), 0) << text;
  stop_server(server);
}


// ASP and SSP, 4 workers on 2 I/O threads and 3 shards: each pushes 60
// pipelines of its 24 small keys (inline-eligible) plus a push_pull of a
// 70,000-element key (shard thread), with pulls in between. Every push is
// applied once: the final parameters are init - lr * (sum of all pushes).
class InlineBreakitAsync : public ::testing::TestWithParam<const char*> {};

TEST_P(InlineBreakitAsync, EveryPushAppliedOnce) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 4;
  spec.shards = 3;
  spec.consistency = GetParam();
  spec.staleness = 2;
  spec.learning_rate = 0.5;
  ServerProcess server(dir, spec, 0, server_args(kComm));
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()}, kComm);
  for (auto& w : workers) ASSERT_TRUE(w);
  const int num_small = 24, rounds = 60;
  const std::uint64_t small_elements = 512, big_elements = 70000;
  const Key big = 500;
  on_all(4, [&](std::uint32_t r) {
    Worker& w = *workers[r];
    const std::uint64_t shape[] = {small_elements};
    const std::uint64_t big_shape[] = {big_elements};
    std::vector<float> init(small_elements, 1000.0f), big_init(big_elements, 1000.0f);
    for (Key k = 0; k < num_small; ++k) {
      ASSERT_TRUE(w.init(k, shape, r == 0 ? std::span<const float>(init) : std::span<const float>()).wait());
    }
    ASSERT_TRUE(w.init(big, big_shape, r == 0 ? std::span<const float>(big_init) : std::span<const float>()).wait());
    std::vector<float> grad(small_elements, static_cast<float>(r + 1));
    std::vector<float> big_grad(big_elements, static_cast<float>(r + 1)), big_out(big_elements);
    std::vector<std::vector<float>> outs(num_small, std::vector<float>(small_elements));
    for (int t = 0; t < rounds; ++t) {
      auto pipe = w.pipeline();
      std::vector<Handle> hs;
      for (Key k = 0; k < num_small; ++k) {
        hs.push_back(pipe.enqueue(k, grad));
        if (t % 7 == 0) hs.push_back(pipe.enqueue_pull(k, outs[k]));
      }
      auto hb = w.push_pull(big, big_grad, big_out);
      auto s = pipe.wait();
      ASSERT_TRUE(s) << s.error().to_string();
      for (auto& h : hs) {
        auto res = h.wait();
        ASSERT_TRUE(res) << res.error().to_string();
      }
      auto rb = hb.wait();
      ASSERT_TRUE(rb) << rb.error().to_string();
    }
  });
  // Everyone is done: pull once more.
  const float expect = 1000.0f - 0.5f * static_cast<float>(rounds) * (1 + 2 + 3 + 4);
  Worker& w = *workers[0];
  std::vector<float> out(small_elements), big_out(big_elements);
  for (Key k = 0; k < num_small; ++k) {
    ASSERT_TRUE(w.pull(k, out).wait());
    for (std::uint64_t i = 0; i < small_elements; ++i) ASSERT_EQ(out[i], expect) << "key " << k << " i " << i;
  }
  ASSERT_TRUE(w.pull(big, big_out).wait());
  for (std::uint64_t i = 0; i < big_elements; ++i) ASSERT_EQ(big_out[i], expect) << i;
  const std::string text = http_get(server.metrics_address(), "/metrics");
  EXPECT_GT(metric_value(text, "ember_server_requests_inline_total"), 0) << text;
  stop_server(server);
}

INSTANTIATE_TEST_SUITE_P(Consistency, InlineBreakitAsync, ::testing::Values("asp", "ssp"),
                         [](const ::testing::TestParamInfo<const char*>& param_info) {
                           return std::string(param_info.param);
                         });

// SIGTERM while 3 workers push small keys (asp) as fast as they can: the
// server drains and exits 0, and its final checkpoint holds every push that
// was acknowledged (and none that was not issued): a restarted server serves
// parameters init - lr * applied with acked <= applied <= issued.
TEST(InlineBreakit, SigtermDuringSmallKeyTrafficKeepsEveryAckedPush) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 3;
  spec.shards = 2;
  spec.consistency = "asp";
  spec.learning_rate = 0.5;
  spec.checkpoint_dir = (dir / "ckpt").string();
  spec.request_timeout = "3s";
  std::vector<std::string> comm = kComm;
  comm.push_back("worker.resend_attempts=0");
  auto server = std::make_unique<ServerProcess>(dir, spec, 0, server_args(kComm));
  ASSERT_TRUE(server->ok());
  const std::string address = server->address();
  auto workers = make_workers(spec, {address}, comm);
  for (auto& w : workers) ASSERT_TRUE(w);
  const int num_keys = 16;
  const std::uint64_t elements = 128;
  const std::uint64_t shape[] = {elements};
  std::vector<float> init(elements, 0.0f);
  for (Key k = 0; k < num_keys; ++k) ASSERT_TRUE(workers[0]->init(k, shape, init).wait());
  std::vector<std::vector<std::uint64_t>> acked(3, std::vector<std::uint64_t>(num_keys, 0));
  std::vector<std::vector<std::uint64_t>> issued(3, std::vector<std::uint64_t>(num_keys, 0));
  std::atomic<int> started{0};
  std::thread killer([&] {
    // Once every worker has had some pushes answered.
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (started.load() < 3 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    server->process().signal(SIGTERM);
  });
  on_all(3, [&](std::uint32_t r) {
    Worker& w = *workers[r];
    if (r != 0) {
      for (Key k = 0; k < num_keys; ++k) ASSERT_TRUE(w.init(k, shape, {}).wait());
    }
    std::vector<float> grad(elements, 1.0f);
    bool said = false;
    for (int t = 0; t < 100000; ++t) {
      auto pipe = w.pipeline();
      std::vector<Handle> hs;
      for (Key k = 0; k < num_keys; ++k) {
        hs.push_back(pipe.enqueue(k, grad));
        ++issued[r][k];
      }
      (void)pipe.wait();
      bool failed = false;
      for (Key k = 0; k < num_keys; ++k) {
        if (hs[k].wait()) {
          ++acked[r][k];
        } else {
          failed = true;
        }
      }
      if (!said && t >= 20) {
        said = true;
        started.fetch_add(1);
      }
      if (failed) break;
    }
  });
  killer.join();
  const auto status = server->process().wait_exit(20s);
  ASSERT_TRUE(status) << server->log();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << server->log();
  workers.clear();
  auto again = restart_server(dir, address, "server0-again.log");
  ASSERT_TRUE(again);
  auto check = make_workers(spec, {address}, {});  // restart_server: the config file only (1 I/O thread)
  ASSERT_TRUE(check[0]);
  for (Key k = 0; k < num_keys; ++k) {
    ASSERT_TRUE(check[0]->init(k, shape, init).wait());
    std::vector<float> out(elements);
    ASSERT_TRUE(check[0]->pull(k, out).wait());
    std::uint64_t a = 0, i = 0;
    for (int r = 0; r < 3; ++r) {
      a += acked[r][k];
      i += issued[r][k];
    }
    const double applied = -out[0] / 0.5;
    EXPECT_GE(applied, static_cast<double>(a)) << "key " << k << ": an acknowledged push is missing";
    EXPECT_LE(applied, static_cast<double>(i)) << "key " << k;
  }
  again->signal(SIGTERM);
  (void)again->wait_exit(20s);
}

// Worker loss over shm (the small key's requests are handled inline): worker
// 1 (ember-test-worker) is killed with -9 after its push of step 2, while
// worker 0's pull of step 4 waits for round 3. shrink: the round completes
// without it; wait: a restarted rank 1 rejoins at step 3 and completes it.
class InlineBreakitLoss : public ::testing::TestWithParam<const char*> {};

TEST_P(InlineBreakitLoss, KilledWorkerOverShm) {
  const std::string policy = GetParam();
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;
  spec.shards = 2;
  spec.loss_policy = policy;
  spec.worker_timeout = "20s";
  spec.learning_rate = 0.5;
  ServerProcess server(dir, spec, 0, server_args(kComm));
  ASSERT_TRUE(server.ok());
  const auto w1_config = dir / "worker.toml";
  write_file(w1_config, cluster_toml(spec, {server.address()}) + "\n");
  // The test worker reads only the file: give it the same [communication].
  auto start_w1 = [&](const std::string& steps, std::vector<std::string> extra) {
    std::vector<std::string> args{"--config", w1_config.string(), "--rank", "1", "--key", "1",
                                  "--elements", "4", "--steps", steps};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<Process>(test_worker_binary(), args, dir / "worker1.log");
  };
  {
    // Same [communication] as the server: io_threads = 2 (2 channels).
    std::string text = read_file(w1_config);
    const std::string at = "[communication]\n";
    text.insert(text.find(at) + at.size(), "io_threads = 2\nring_buffer_size = 2\n");
    write_file(w1_config, text);
  }
  auto w1 = start_w1("100", {"--stop-after", "2"});
  config::Config c0 = worker_config(spec, {server.address()}, 0);
  ASSERT_TRUE(config::apply_overrides(c0, kComm));
  auto w0 = Worker::create(c0);
  ASSERT_TRUE(w0) << w0.error().to_string();
  const std::vector<float> init{0, 1, 2, 3};
  const std::uint64_t shape[] = {4};
  ASSERT_TRUE((*w0)->init(1, shape, init).wait());
  ASSERT_TRUE(w1->wait_line("ready")) << read_file(dir / "worker1.log");
  std::vector<float> params(4);
  const std::vector<float> g(4, 1.0f);
  for (int t = 0; t < 3; ++t) {
    ASSERT_TRUE((*w0)->push(1, g).wait());
    ASSERT_TRUE((*w0)->pull(1, params).wait());
  }
  ASSERT_TRUE(w1->wait_line("pushed 2"));
  ASSERT_TRUE((*w0)->push(1, g).wait());
  Handle pending = (*w0)->pull(1, params);
  w1->signal(SIGKILL);
  ASSERT_TRUE(w1->wait_exit());
  std::unique_ptr<Process> again;
  if (policy == "wait") {
    again = start_w1("6", {});
    auto ready = again->wait_line("ready");
    ASSERT_TRUE(ready) << read_file(dir / "worker1.log");
    EXPECT_EQ(*ready, "ready 3");
  }
  auto r = pending.wait();
  ASSERT_TRUE(r) << r.error().to_string();
  EXPECT_EQ(*r, 4u);
  EXPECT_EQ(params[0], 0.0f - 4 * 0.5f);
  const int more = policy == "wait" ? 2 : 3;
  for (int t = 0; t < more; ++t) {
    ASSERT_TRUE((*w0)->push(1, g).wait());
    ASSERT_TRUE((*w0)->pull(1, params).wait());
  }
  EXPECT_EQ(params[0], 0.0f - (4 + more) * 0.5f);
  if (again) {
    ASSERT_TRUE(again->wait_line("done")) << read_file(dir / "worker1.log");
  }
  if (policy == "shrink") {
    EXPECT_TRUE((*w0)->barrier().wait());  // the barrier shrinks too
  }
  w0->reset();
  stop_server(server);
}

INSTANTIATE_TEST_SUITE_P(Policies, InlineBreakitLoss, ::testing::Values("shrink", "wait"),
                         [](const ::testing::TestParamInfo<const char*>& param_info) {
                           return std::string(param_info.param);
                         });

// --- a worker that stops reading ---------------------------------------

// The child half of StoppedWorkerDoesNotStallOtherShards: run by that test
// through this binary (EMBER_BREAKIT_CHILD="<config path>"); skipped
// otherwise. It joins as rank 1, inits nothing (rank 0 did), and pulls its
// keys in pipelines forever, so that many replies to it are in flight when
// the test stops it.
TEST(InlineBreakitChild, DISABLED_FloodsPullsUntilStopped) {
  const char* path = std::getenv("EMBER_BREAKIT_CHILD");
  if (path == nullptr) {
    GTEST_SKIP() << "helper process of StoppedWorkerDoesNotStallOtherShards";
  }
  const std::string keys_text = std::getenv("EMBER_BREAKIT_KEYS");
  std::vector<Key> keys;
  for (std::size_t at = 0; at < keys_text.size();) {
    const auto comma = keys_text.find(',', at);
    keys.push_back(std::stoull(keys_text.substr(at, comma - at)));
    at = comma == std::string::npos ? keys_text.size() : comma + 1;
  }
  std::vector<std::string> sets = kComm;
  sets.push_back("worker.rank=1");
  // The server's 10 s (below): stopped for seconds at a time, this child
  // must not take the server for lost when it resumes.
  sets.push_back("communication.heartbeat_timeout=10s");
  auto w = Worker::create_from_file(path, sets);
  ASSERT_TRUE(w) << w.error().to_string();
  const std::uint64_t shape[] = {256};
  for (Key k : keys) ASSERT_TRUE((*w)->init(k, shape, {}).wait());
  std::vector<std::vector<float>> outs(keys.size(), std::vector<float>(256));
  for (std::uint64_t round = 0;; ++round) {
    auto pipe = (*w)->pipeline();
    for (int rep = 0; rep < 4; ++rep) {
      for (std::size_t k = 0; k < keys.size(); ++k) (void)pipe.enqueue_pull(keys[k], outs[k]);
    }
    ASSERT_TRUE(pipe.wait());
    std::printf("flooding %llu\n", static_cast<unsigned long long>(round));
    std::fflush(stdout);
  }
}

// ASP, 2 shards. Worker 1 (a child process) pulls 1 KiB keys of shard 1 in
// big pipelines and is stopped (SIGSTOP) mid-pipeline, its reply ring full.
// Worker 0 uses only keys of shard 0, which owns none of worker 1's keys, so
// it must still be served at once (heartbeat_timeout is 10 s here, so a stall
// is plain to see). Before 0a7a2de it was (the blocked shard was shard 1).
// 0a7a2de broke it: a reply that an I/O thread handling a request inline
// could not send at once went to shard connection_id % num_shards, here
// shard 0, whose thread then waited in Connection::send for the stopped
// worker's ring until heartbeat_timeout closed it; worker 0's requests
// queued behind it for ~10 s. Such a reply now goes to the shard that owns
// the request's key (server.cc, t_inline_shard).
TEST(InlineBreakit, StoppedWorkerDoesNotStallOtherShards) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;
  spec.shards = 2;
  spec.consistency = "asp";
  spec.learning_rate = 0.5;
  std::vector<std::string> comm = kComm;
  comm.push_back("communication.heartbeat_timeout=10s");
  ServerProcess server(dir, spec, 0, server_args(comm));
  ASSERT_TRUE(server.ok());
  // Worker 0 connects first (connection id 1), the child second (id 2):
  // replies to the child that an I/O thread cannot send go to shard 2 % 2.
  const std::uint32_t reply_shard = 0;
  std::vector<Key> child_keys, own_keys;
  for (Key k = 1000; child_keys.size() < 64 || own_keys.size() < 8; ++k) {
    const std::uint32_t s = server::shard_of(k, 0, 2);
    if (s != reply_shard && child_keys.size() < 64) child_keys.push_back(k);
    if (s == reply_shard && own_keys.size() < 8) own_keys.push_back(k);
  }
  config::Config cfg0 = worker_config(spec, {server.address()}, 0);
  ASSERT_TRUE(config::apply_overrides(cfg0, comm));
  auto w0 = Worker::create(cfg0);
  ASSERT_TRUE(w0) << w0.error().to_string();
  const std::uint64_t shape[] = {256};
  std::vector<float> init(256, 4.0f);
  for (Key k : child_keys) ASSERT_TRUE((*w0)->init(k, shape, init).wait());
  for (Key k : own_keys) ASSERT_TRUE((*w0)->init(k, shape, init).wait());

  const auto child_cfg = dir / "child.toml";
  write_file(child_cfg, cluster_toml(spec, {server.address()}));
  std::string keys_text;
  for (Key k : child_keys) keys_text += (keys_text.empty() ? "" : ",") + std::to_string(k);
  ::setenv("EMBER_BREAKIT_CHILD", child_cfg.c_str(), 1);
  ::setenv("EMBER_BREAKIT_KEYS", keys_text.c_str(), 1);
  Process child("/proc/self/exe", {"--gtest_also_run_disabled_tests",
                 "--gtest_filter=InlineBreakitChild.DISABLED_FloodsPullsUntilStopped"},
                dir / "child.log");
  ::unsetenv("EMBER_BREAKIT_CHILD");
  // Stop the child in the middle of a pipeline a few times; each time
  // worker 0 does 10 rounds on its own keys, then the child goes on.
  std::vector<float> grad(256, 1.0f), out(256);
  // The stall this test catches lasts until heartbeat_timeout (10 s) closes
  // the stopped worker's connection. A round slower than half of that is
  // one; a second or two is a test process descheduled on a loaded machine.
  constexpr auto kStalled = 5s;
  auto worst = std::chrono::nanoseconds(0);
  const auto began = std::chrono::steady_clock::now();
  const int cycles = 6, rounds = 10;
  for (int cycle = 0; cycle < cycles; ++cycle) {
    ASSERT_TRUE(child.wait_line("flooding", 20s)) << read_file(dir / "child.log");
    child.signal(SIGSTOP);
    for (int t = 0; t < rounds; ++t) {
      const auto t0 = std::chrono::steady_clock::now();
      for (Key k : own_keys) {
        auto p = (*w0)->push(k, grad).wait();
        ASSERT_TRUE(p) << p.error().to_string();
        auto q = (*w0)->pull(k, out).wait();
        ASSERT_TRUE(q) << q.error().to_string();
      }
      worst = std::max(worst, std::chrono::steady_clock::now() - t0);
    }
    child.signal(SIGCONT);
    if (worst > kStalled) break;
  }
  const auto total = std::chrono::steady_clock::now() - began;
  child.signal(SIGKILL);
  (void)child.wait_exit(5s);
  if (worst <= kStalled) {
    EXPECT_EQ(out[0], 4.0f - cycles * rounds * 0.5f);
  }
  EXPECT_LE(worst, kStalled)
      << "worker 0 stalled while worker 1 was stopped: worst round "
      << std::chrono::duration_cast<std::chrono::milliseconds>(worst).count() << " ms, all "
      << std::chrono::duration_cast<std::chrono::milliseconds>(total).count() << " ms\n"
      << http_get(server.metrics_address(), "/metrics");
  stop_server(server);
}

}  // namespace
}  // namespace ember::test

