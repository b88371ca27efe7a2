// Helpers of the DeviceExchange integration tests: a real ember::server::
// Server in this process (TCP on 127.0.0.1, as tests/integration/worker
// does), a Worker on it, seeded random tensors, and the plain-Worker
// reference run (the same tensors pushed and pulled with Worker::push /
// Worker::pull under other keys) that DeviceExchange results are compared
// with.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "server/server.h"
#include "worker/gpu/device_exchange.h"
#include "worker/worker.h"

namespace ember::gpu::test {

// One worker, SGD with learning rate 1 (parameters = init − Σ gradients),
// `channels` lanes, 4 KiB partitions (1024-element chunks spread over
// channels), two shard threads.
inline config::Config exchange_config(std::uint32_t channels) {
  auto c = config::parse_config(
      fmt::format("[communication]\nprealloc_pages = 16\npool_backing = \"plain\"\nchannels = {}\n"
                  "heartbeat_interval = \"100ms\"\nheartbeat_timeout = \"5s\"\n"
                  "[cluster]\nnum_workers = 1\n[server]\npartition_bytes = \"4KB\"\n"
                  "[optimizer]\ntype = \"sgd\"\nlearning_rate = 1.0\n"
                  "[worker]\nrequest_timeout = \"20s\"\nconnect_timeout = \"2s\"\n"
                  "connect_retries = 2\n",
                  channels),
      "exchange-test");
  EXPECT_TRUE(c) << c.error().to_string();
  return *c;
}

struct LocalServer {
  config::Config config;
  std::unique_ptr<server::Server> server;

  explicit LocalServer(config::Config c) : config(std::move(c)) {
    EXPECT_TRUE(config::set_listen(config, "127.0.0.1:0"));
    auto s = server::Server::create(config);
    EXPECT_TRUE(s) << s.error().to_string();
    if (!s) return;
    server = std::move(*s);
    const std::string servers[] = {server->address()};
    EXPECT_TRUE(config::set_servers(config, servers));
  }
  std::unique_ptr<Worker> worker(std::uint32_t rank = 0) const {
    config::Config c = config;
    config::set_worker_rank(c, rank);
    auto w = Worker::create(c);
    EXPECT_TRUE(w) << w.error().to_string();
    return w ? std::move(*w) : nullptr;
  }
};

// Host tensors of a model: values[i] has descs[i].num_elements floats.
struct HostModel {
  std::vector<TensorDesc> descs;
  std::vector<std::vector<float>> values;

  std::vector<ConstTensorView> const_views() const {
    std::vector<ConstTensorView> v;
    for (std::size_t i = 0; i < descs.size(); ++i) {
      v.push_back({descs[i].key, values[i].data(), descs[i].num_elements});
    }
    return v;
  }
  std::vector<TensorView> views() {
    std::vector<TensorView> v;
    for (std::size_t i = 0; i < descs.size(); ++i) {
      v.push_back({descs[i].key, values[i].data(), descs[i].num_elements});
    }
    return v;
  }
};

// Tensors of the given sizes under keys first_key, first_key + 1, ...;
// group of tensor i: groups[i % groups.size()].
inline HostModel make_model(const std::vector<std::uint64_t>& sizes, std::uint64_t first_key,
                            const std::vector<std::uint32_t>& groups = {0}) {
  HostModel m;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    m.descs.push_back({first_key + i, sizes[i], groups[i % groups.size()]});
    m.values.emplace_back(sizes[i], 0.0f);
  }
  return m;
}

// Fills every tensor with values whose magnitude is in [lo, hi), random sign.
inline void fill_random(HostModel& m, std::mt19937_64& rng, float lo, float hi) {
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution neg(0.5);
  for (auto& t : m.values) {
    for (float& x : t) x = neg(rng) ? -mag(rng) : mag(rng);
  }
}

// The plain Worker's side of the comparison: the same tensors under keys
// key_offset + desc.key, init-ed with `init` values, pushed and pulled with
// Worker::push / Worker::pull.
struct PlainReference {
  Worker& worker;
  std::uint64_t key_offset;

  Status init(const HostModel& init) {
    std::vector<Handle> hs;
    for (std::size_t i = 0; i < init.descs.size(); ++i) {
      const std::uint64_t shape[1] = {init.descs[i].num_elements};
      hs.push_back(worker.init(key_offset + init.descs[i].key, shape, init.values[i]));
    }
    return wait_all(hs);
  }
  Status push(const HostModel& grads) {
    std::vector<Handle> hs;
    for (std::size_t i = 0; i < grads.descs.size(); ++i) {
      hs.push_back(worker.push(key_offset + grads.descs[i].key, grads.values[i]));
    }
    return wait_all(hs);
  }
  Status pull(HostModel& out) {
    std::vector<Handle> hs;
    for (std::size_t i = 0; i < out.descs.size(); ++i) {
      hs.push_back(worker.pull(key_offset + out.descs[i].key, out.values[i]));
    }
    return wait_all(hs);
  }
};

// Bit-for-bit equality of two models' values; reports the first difference.
inline ::testing::AssertionResult bits_equal(const HostModel& a, const HostModel& b) {
  if (a.values.size() != b.values.size()) return ::testing::AssertionFailure() << "tensor counts";
  for (std::size_t t = 0; t < a.values.size(); ++t) {
    if (a.values[t].size() != b.values[t].size()) {
      return ::testing::AssertionFailure() << "tensor " << t << " sizes";
    }
    for (std::size_t i = 0; i < a.values[t].size(); ++i) {
      std::uint32_t x, y;
      std::memcpy(&x, &a.values[t][i], 4);
      std::memcpy(&y, &b.values[t][i], 4);
      if (x != y) {
        return ::testing::AssertionFailure()
               << "tensor " << t << " (key " << a.descs[t].key << ") element " << i << ": "
               << a.values[t][i] << " vs " << b.values[t][i];
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace ember::gpu::test
