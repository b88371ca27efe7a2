// Stress tests of the rings (label `stress`; CI also runs them under TSan):
// many producers against one consumer, checking that nothing is lost,
// nothing is duplicated and each producer's order is kept.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/ring/blocking_mpsc_ring.h"
#include "common/ring/spsc_ring.h"
#include "tests/unit/ring/ring_test_support.h"

namespace ember::ring {
namespace {

using namespace std::chrono_literals;
using testing::Tracked;

constexpr std::uint64_t kScale = testing::kSanitized ? 4 : 1;
// Every waiter sleeps at once: the sleep/wake protocols run on every wait.
constexpr ParkOptions kParkAtOnce{.spin_iterations = 0,
                                  .yield_iterations = 0,
                                  .producer_spin_iterations = 0,
                                  .producer_yield_iterations = 0};
// No wait in these tests may come near this; reaching it means a lost wake-up.
constexpr auto kWaitTimeout = 10s;

// 16 bytes, like the benchmark's messages.
struct Msg {
  std::uint32_t producer = 0;
  std::uint32_t pad = 0;
  std::uint64_t seq = 0;
};

// Checks per-producer sequence numbers as they arrive.
class OrderChecker {
 public:
  explicit OrderChecker(std::size_t num_producers) : next_(num_producers, 0) {}
  // Returns false (and records the first failure) on loss, duplicate or
  // reorder.
  bool accept(std::uint32_t producer, std::uint64_t seq) {
    if (producer >= next_.size()) return fail("unknown producer", producer, seq);
    if (seq != next_[producer]) return fail("out of sequence", producer, seq);
    ++next_[producer];
    ++total_;
    return true;
  }
  std::uint64_t total() const { return total_; }
  std::uint64_t next(std::size_t producer) const { return next_[producer]; }
  const std::string& failure() const { return failure_; }

 private:
  bool fail(const char* what, std::uint32_t producer, std::uint64_t seq) {
    if (failure_.empty()) {
      failure_ = fmt::format("{}: producer {} seq {} (expected {})", what, producer, seq,
                             producer < next_.size() ? next_[producer] : 0);
    }
    return false;
  }
  std::vector<std::uint64_t> next_;
  std::uint64_t total_ = 0;
  std::string failure_;
};

// Pushes `count` messages as producer `id` with random single and batch
// pushes; yields when the lane is full, or (wait == true) uses the waiting
// pushes, which sleep until the consumer frees space.
template <typename Producer>
void produce(Producer& producer, std::uint32_t id, std::uint64_t count, std::uint64_t seed,
             bool wait) {
  std::mt19937_64 rng(seed + id);
  std::vector<Msg> batch;
  std::uint64_t seq = 0;
  while (seq < count) {
    if (wait) {
      const std::uint64_t n = std::min<std::uint64_t>(1 + rng() % 64, count - seq);
      batch.clear();
      for (std::uint64_t i = 0; i < n; ++i) batch.push_back(Msg{id, 0, seq + i});
      if (producer.push_batch_wait(batch.data(), n, kWaitTimeout) != n) {
        ADD_FAILURE() << "producer " << id << " waited the full timeout for space";
        return;
      }
      seq += n;
    } else if (rng() % 2 == 0) {
      while (!producer.try_push(Msg{id, 0, seq})) std::this_thread::yield();
      ++seq;
    } else {
      const std::uint64_t n = std::min<std::uint64_t>(1 + rng() % 64, count - seq);
      batch.clear();
      for (std::uint64_t i = 0; i < n; ++i) batch.push_back(Msg{id, 0, seq + i});
      std::size_t done = 0;
      while (done < n) {
        const std::size_t k = producer.try_push_batch(batch.data() + done, n - done);
        if (k == 0) std::this_thread::yield();
        done += k;
      }
      seq += n;
    }
  }
}

void run_eight_producers(std::size_t lane_capacity, const ParkOptions& park, bool wait) {
  constexpr std::uint32_t kProducers = 8;
  const std::uint64_t per_producer = 200'000 / kScale;
  const std::uint64_t seed = testing::test_seed("EightProducersOneConsumer");
  auto ring = BlockingMpscRing<Msg>::create(
                  {.lane_capacity = lane_capacity, .max_producers = kProducers}, park)
                  .value();
  std::vector<std::thread> producers;
  for (std::uint32_t p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      auto handle = ring->make_producer().value();
      produce(handle, p, per_producer, seed, wait);
    });
  }
  OrderChecker checker(kProducers);
  bool ok = true;
  std::string timeout;
  while (ok && checker.total() < kProducers * per_producer) {
    const auto start = std::chrono::steady_clock::now();
    const std::size_t n = ring->consume_wait(
        [&](Msg& m) { ok = checker.accept(m.producer, m.seq) && ok; }, 256, kWaitTimeout);
    // Producers push without pause, so waiting out the whole timeout means a
    // push did not wake the consumer (consume_wait still finds the items
    // afterwards, hence the clock).
    if (n == 0 || std::chrono::steady_clock::now() - start >= kWaitTimeout) {
      timeout = fmt::format("lost wake-up: the consumer waited the full timeout ({} items)", n);
      break;
    }
  }
  for (auto& t : producers) t.join();
  ASSERT_TRUE(timeout.empty()) << timeout;
  ASSERT_TRUE(ok) << checker.failure();
  EXPECT_EQ(checker.total(), kProducers * per_producer);
  for (std::uint32_t p = 0; p < kProducers; ++p) EXPECT_EQ(checker.next(p), per_producer);
  EXPECT_TRUE(ring->empty_approx());
}

TEST(RingStress, EightProducersOneConsumerNoLossNoDuplicatesInOrder) {
  run_eight_producers(1024, ParkOptions{}, /*wait=*/false);
}

// Producers that sleep for space (push_batch_wait) on small lanes: the
// producer sleep/wake protocol on almost every batch.
TEST(RingStress, EightWaitingProducersSmallLanes) {
  run_eight_producers(16, kParkAtOnce, /*wait=*/true);
}

// Tiny lanes and an always-parking consumer: full lanes and sleep/wake
// races on almost every operation.
TEST(RingStress, EightProducersTinyLanesParkingConsumer) {
  run_eight_producers(4, kParkAtOnce, /*wait=*/false);
}

// Any-thread pushes with non-trivial elements and lane churn: 24 threads in
// 3 waves share 8 lanes (each wave claims lanes released by the previous
// wave's exited threads, items possibly still queued).
TEST(RingStress, ThreadLanesChurnWithTrackedElements) {
  constexpr std::uint32_t kWaves = 3;
  constexpr std::uint32_t kPerWave = 8;
  constexpr std::uint32_t kThreads = kWaves * kPerWave;
  const std::uint64_t per_thread = 20'000 / kScale;
  {
    auto ring = BlockingMpscRing<Tracked>::create({.lane_capacity = 64, .max_producers = kPerWave})
                    .value();
    std::atomic<bool> producers_done{false};
    std::thread waves([&] {
      for (std::uint32_t w = 0; w < kWaves; ++w) {
        std::vector<std::thread> wave;
        for (std::uint32_t i = 0; i < kPerWave; ++i) {
          const std::uint32_t id = w * kPerWave + i;
          wave.emplace_back([&, id] {
            for (std::uint64_t s = 0; s < per_thread; ++s) {
              while (!ring->try_emplace(std::uint64_t{id} << 32 | s)) std::this_thread::yield();
            }
          });
        }
        for (auto& t : wave) t.join();
      }
      producers_done = true;
    });
    OrderChecker checker(kThreads);
    bool ok = true;
    while (ok && checker.total() < kThreads * per_thread) {
      const auto start = std::chrono::steady_clock::now();
      const std::size_t n = ring->consume_wait(
          [&](Tracked& item) {
            ok = checker.accept(static_cast<std::uint32_t>(item.value() >> 32),
                                item.value() & 0xffffffffu) &&
                 ok;
          },
          128, kWaitTimeout);
      if (n == 0 && ring->empty_approx() && producers_done) break;
      if (std::chrono::steady_clock::now() - start >= kWaitTimeout) {
        ok = false;
        ADD_FAILURE() << "lost wake-up: the consumer waited the full timeout";
      }
    }
    waves.join();
    ASSERT_TRUE(ok) << checker.failure();
    EXPECT_EQ(checker.total(), kThreads * per_thread);
    EXPECT_EQ(ring->num_producers(), 0u) << "exited threads must release their lanes";
  }
  EXPECT_EQ(Tracked::live().load(), 0);
}

TEST(RingStress, SpscProducerConsumerKeepsOrderWithTrackedElements) {
  const std::uint64_t count = 500'000 / kScale;
  {
    SpscRing<Tracked> ring(256);
    std::thread producer([&] {
      std::vector<Tracked> batch;
      std::uint64_t seq = 0;
      while (seq < count) {
        if (seq % 3 == 0) {
          while (!ring.try_push(Tracked(seq))) std::this_thread::yield();
          ++seq;
          continue;
        }
        const std::uint64_t n = std::min<std::uint64_t>(17, count - seq);
        batch.clear();
        for (std::uint64_t i = 0; i < n; ++i) batch.emplace_back(seq + i);
        std::size_t done = 0;
        while (done < n) {
          const std::size_t k = ring.try_push_batch(batch.data() + done, n - done);
          if (k == 0) std::this_thread::yield();
          done += k;
        }
        seq += n;
      }
    });
    std::uint64_t expected = 0;
    bool in_order = true;
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (expected < count && in_order && std::chrono::steady_clock::now() < deadline) {
      const std::size_t n = ring.consume(
          [&](Tracked& item) { in_order = in_order && item.value() == expected++; }, 64);
      if (n == 0) std::this_thread::yield();
    }
    producer.join();
    EXPECT_TRUE(in_order);
    EXPECT_EQ(expected, count);
  }
  EXPECT_EQ(Tracked::live().load(), 0);
}

}  // namespace
}  // namespace ember::ring
