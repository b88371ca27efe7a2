// Helpers for integration tests that drive real workers against
// ember-server processes (harness.h): create a job's workers, run a function
// on each of them, read one metric. Header-only: only tests that link
// ember_worker include it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/config/config.h"
#include "tests/integration/server/harness.h"
#include "worker/worker.h"

namespace ember::test {

// Creates the spec.num_workers workers of a job on `servers`, each with
// `overrides` ("table.key=value", config::apply_overrides) applied, all at
// once (a worker's init may wait for rank 0's). A worker that cannot be
// created is a gtest failure naming it, and a null entry.
inline std::vector<std::unique_ptr<Worker>> make_workers(
    const ClusterSpec& spec, const std::vector<std::string>& servers,
    const std::vector<std::string>& overrides = {}) {
  std::vector<std::unique_ptr<Worker>> out(spec.num_workers);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(spec.num_workers);
  for (std::uint32_t r = 0; r < spec.num_workers; ++r) {
    threads.emplace_back([&, r] {
      config::Config cfg = worker_config(spec, servers, r);
      if (Status s = config::apply_overrides(cfg, overrides); !s) {
        errors[r] = s.error().to_string();
        return;
      }
      auto w = Worker::create(cfg);
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

// Runs `fn(rank)` on one thread per rank in [0, n) and joins them.
template <typename Fn>
void on_all(std::uint32_t n, Fn fn) {
  std::vector<std::thread> threads;
  for (std::uint32_t r = 0; r < n; ++r) threads.emplace_back([&, r] { fn(r); });
  for (auto& t : threads) t.join();
}

// The value of the unlabelled Prometheus sample `name` in `text` (a
// /metrics page); -1 when it is absent.
inline long metric_value(const std::string& text, const std::string& name) {
  const std::string key = "\n" + name + " ";
  const auto at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stol(text.substr(at + key.size()));
}

}  // namespace ember::test
