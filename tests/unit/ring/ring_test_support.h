// Helpers shared by the ring tests: a lifetime-tracking element, the seed of
// the differential tests, and waiting on a condition with a deadline.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

#include <gtest/gtest.h>

namespace ember::ring::testing {

// An element with a heap payload (so ASan reports a leaked element) that
// counts live objects and detects use after destruction and double
// destruction through a magic word.
class Tracked {
 public:
  static constexpr std::uint32_t kAlive = 0xA11CE5ED;
  static constexpr std::uint32_t kDead = 0xDEADBEEF;

  Tracked() noexcept : magic_(kAlive) { live().fetch_add(1, std::memory_order_relaxed); }
  explicit Tracked(std::uint64_t value)
      : payload_(std::make_unique<std::uint64_t>(value)), magic_(kAlive) {
    live().fetch_add(1, std::memory_order_relaxed);
  }
  Tracked(Tracked&& other) noexcept : payload_(std::move(other.payload_)), magic_(kAlive) {
    if (other.magic_ != kAlive) ADD_FAILURE() << "moved from a destroyed Tracked";
    live().fetch_add(1, std::memory_order_relaxed);
  }
  Tracked& operator=(Tracked&& other) noexcept {
    if (magic_ != kAlive || other.magic_ != kAlive) ADD_FAILURE() << "assigned a destroyed Tracked";
    payload_ = std::move(other.payload_);
    return *this;
  }
  Tracked(const Tracked&) = delete;
  Tracked& operator=(const Tracked&) = delete;
  ~Tracked() {
    if (magic_ != kAlive) ADD_FAILURE() << "Tracked destroyed twice";
    magic_ = kDead;
    live().fetch_sub(1, std::memory_order_relaxed);
  }

  bool has_value() const { return payload_ != nullptr; }
  std::uint64_t value() const { return payload_ ? *payload_ : ~std::uint64_t{0}; }

  // Tracked objects alive in the process (relaxed: read after joins).
  static std::atomic<std::int64_t>& live() {
    static std::atomic<std::int64_t> count{0};
    return count;
  }

 private:
  std::unique_ptr<std::uint64_t> payload_;
  std::uint32_t magic_;
};

// The seed of a randomized test: EMBER_TEST_SEED if set, else fresh. Printed
// so that a failure can be replayed.
inline std::uint64_t test_seed(const char* test_name) {
  std::uint64_t seed = 0;
  if (const char* env = std::getenv("EMBER_TEST_SEED")) {
    seed = std::strtoull(env, nullptr, 0);
  } else {
    seed = static_cast<std::uint64_t>(
        std::chrono::steady_clock::now().time_since_epoch().count());
  }
  std::printf("[%s] seed=%llu (replay: EMBER_TEST_SEED=%llu)\n", test_name,
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  return seed;
}

// Polls `condition` (yielding between polls) until it holds or `timeout`
// passes; returns whether it held.
template <typename Condition>
bool wait_until(Condition&& condition, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

}  // namespace ember::ring::testing
