#include "common/ring/mpsc_ring.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/unit/ring/ring_test_support.h"

namespace ember::ring {
namespace {

using testing::Tracked;

// Item tagged with its producer and per-producer sequence number.
struct Tagged {
  std::uint32_t producer = 0;
  std::uint64_t seq = 0;
};

TEST(MpscRing, CreateRejectsBadLaneCapacity) {
  auto ring = MpscRing<int>::create({.lane_capacity = 100, .max_producers = 4});
  ASSERT_FALSE(ring);
  EXPECT_EQ(ring.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(ring.error().message().find("MpscRing lane_capacity"), std::string::npos);
  EXPECT_NE(ring.error().message().find("use 128"), std::string::npos);
}

TEST(MpscRing, CreateRejectsZeroProducers) {
  auto ring = MpscRing<int>::create({.lane_capacity = 16, .max_producers = 0});
  ASSERT_FALSE(ring);
  EXPECT_EQ(ring.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(ring.error().message().find("max_producers"), std::string::npos);
}

TEST(MpscRing, CreateRejectsTooManyProducers) {
  auto ring = MpscRing<int>::create({.lane_capacity = 16, .max_producers = kMaxProducerLanes + 1});
  ASSERT_FALSE(ring);
  EXPECT_EQ(ring.error().code(), ErrorCode::kTooLarge);
  EXPECT_NE(ring.error().message().find("max_producers"), std::string::npos);
}

TEST(MpscRing, TryPushFailsWhenFull) {
  auto ring = MpscRing<int>::create({.lane_capacity = 4, .max_producers = 2}).value();
  auto producer = ring->make_producer().value();
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(producer.try_push(int{i}));
  EXPECT_FALSE(producer.try_push(4));
  // Another producer has its own lane and is not held back.
  auto other = ring->make_producer().value();
  EXPECT_TRUE(other.try_push(100));
  EXPECT_EQ(ring->size_approx(), 5u);
}

TEST(MpscRing, MakeProducerFailsWhenLanesAreExhaustedAndNamesTheKnob) {
  auto ring = MpscRing<int>::create({.lane_capacity = 4, .max_producers = 2}).value();
  auto a = ring->make_producer().value();
  auto b = ring->make_producer().value();
  auto c = ring->make_producer();
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error().code(), ErrorCode::kUnavailable);
  EXPECT_NE(c.error().message().find("all 2 producer lanes"), std::string::npos);
  EXPECT_NE(c.error().message().find("max_producers"), std::string::npos);
  // The any-thread push path reports the same condition.
  EXPECT_FALSE(ring->try_push(1));
  auto status = ring->register_current_thread();
  ASSERT_FALSE(status);
  EXPECT_EQ(status.error().code(), ErrorCode::kUnavailable);
  // Releasing a handle frees its lane for the thread.
  b = {};
  EXPECT_TRUE(ring->register_current_thread());
  EXPECT_TRUE(ring->try_push(1));
  EXPECT_EQ(ring->num_producers(), 2u);
}

TEST(MpscRing, ReleasedLaneKeepsItsItemsForTheConsumer) {
  auto ring = MpscRing<int>::create({.lane_capacity = 4, .max_producers = 1}).value();
  {
    auto producer = ring->make_producer().value();
    EXPECT_TRUE(producer.try_push(7));
  }
  auto next = ring->make_producer().value();  // reuses lane 0
  EXPECT_EQ(next.lane_index(), 0u);
  EXPECT_TRUE(next.try_push(8));
  EXPECT_EQ(ring->try_pop().value_or(-1), 7);
  EXPECT_EQ(ring->try_pop().value_or(-1), 8);
}

TEST(MpscRing, ThreadLaneIsReleasedWhenTheThreadExits) {
  auto ring = MpscRing<int>::create({.lane_capacity = 4, .max_producers = 1}).value();
  std::thread([&] { EXPECT_TRUE(ring->try_push(1)); }).join();
  EXPECT_EQ(ring->num_producers(), 0u);
  std::thread([&] { EXPECT_TRUE(ring->try_push(2)); }).join();
  EXPECT_EQ(ring->try_pop().value_or(-1), 1);
  EXPECT_EQ(ring->try_pop().value_or(-1), 2);
}

TEST(MpscRing, ThreadMayOutliveTheRingAndUseANewOne) {
  std::thread([] {
    for (int round = 0; round < 3; ++round) {
      auto ring = MpscRing<Tracked>::create({.lane_capacity = 4, .max_producers = 1}).value();
      // A stale cache entry of the previous ring must not be used.
      ASSERT_TRUE(ring->try_push(Tracked(static_cast<std::uint64_t>(round))));
      EXPECT_EQ(ring->num_producers(), 1u);
      EXPECT_EQ(ring->size_approx(), 1u);
    }
  }).join();
  EXPECT_EQ(Tracked::live().load(), 0);
}

TEST(MpscRing, DestroyingTheRingDestroysRemainingItems) {
  {
    auto ring = MpscRing<Tracked>::create({.lane_capacity = 8, .max_producers = 4}).value();
    auto p0 = ring->make_producer().value();
    auto p1 = ring->make_producer().value();
    for (std::uint64_t i = 0; i < 5; ++i) {
      ASSERT_TRUE(p0.try_push(Tracked(i)));
      ASSERT_TRUE(p1.try_emplace(i + 100));
    }
    ASSERT_TRUE(ring->try_push(Tracked(999)));  // this thread's lane
    EXPECT_EQ(Tracked::live().load(), 11);
  }
  EXPECT_EQ(Tracked::live().load(), 0);
}

TEST(MpscRing, ConsumerVisitsLanesRoundRobin) {
  auto ring = MpscRing<Tagged>::create({.lane_capacity = 16, .max_producers = 3}).value();
  std::vector<MpscRing<Tagged>::Producer> producers;
  for (std::uint32_t p = 0; p < 3; ++p) {
    producers.push_back(ring->make_producer().value());
    for (std::uint64_t s = 0; s < 4; ++s) ASSERT_TRUE(producers[p].try_push(Tagged{p, s}));
  }
  // Single pops rotate over the lanes, so no lane waits for another to drain.
  std::vector<std::uint32_t> order;
  for (int i = 0; i < 3; ++i) order.push_back(ring->try_pop().value().producer);
  std::sort(order.begin(), order.end());
  EXPECT_EQ(order, (std::vector<std::uint32_t>{0, 1, 2}));
}

// Differential test: random pushes on several producers and random pops;
// each producer's items must come out in its order, each lane must refuse a
// push exactly when its reference deque is full, and a batch pop that
// returns fewer than asked must have emptied every lane.
TEST(MpscRing, MatchesPerProducerDequesUnderRandomOperations) {
  const std::uint64_t seed = testing::test_seed("MpscRing.MatchesPerProducerDequesUnderRandomOperations");
  std::mt19937_64 rng(seed);
  for (std::size_t lane_capacity : {1u, 4u, 32u}) {
    SCOPED_TRACE(::testing::Message() << "seed=" << seed << " lane_capacity=" << lane_capacity);
    constexpr std::uint32_t kProducers = 5;
    auto ring = MpscRing<Tagged>::create({.lane_capacity = lane_capacity, .max_producers = 8}).value();
    std::vector<MpscRing<Tagged>::Producer> producers;
    std::vector<std::deque<std::uint64_t>> ref(kProducers);
    std::vector<std::uint64_t> next(kProducers, 0);
    for (std::uint32_t p = 0; p < kProducers; ++p) producers.push_back(ring->make_producer().value());
    auto total = [&] {
      std::size_t n = 0;
      for (const auto& d : ref) n += d.size();
      return n;
    };
    auto check_popped = [&](const Tagged& item) {
      ASSERT_LT(item.producer, kProducers);
      ASSERT_FALSE(ref[item.producer].empty());
      ASSERT_EQ(item.seq, ref[item.producer].front());
      ref[item.producer].pop_front();
    };
    for (int op = 0; op < 30000; ++op) {
      const std::uint32_t p = static_cast<std::uint32_t>(rng() % kProducers);
      switch (rng() % 4) {
        case 0: {
          const bool ok = producers[p].try_push(Tagged{p, next[p]});
          ASSERT_EQ(ok, ref[p].size() < lane_capacity);
          if (ok) ref[p].push_back(next[p]++);
          break;
        }
        case 1: {
          const std::size_t count = rng() % (lane_capacity + 2);
          std::vector<Tagged> items;
          for (std::size_t i = 0; i < count; ++i) items.push_back(Tagged{p, next[p] + i});
          const std::size_t pushed = producers[p].try_push_batch(items.data(), count);
          ASSERT_EQ(pushed, std::min(count, lane_capacity - ref[p].size()));
          for (std::size_t i = 0; i < pushed; ++i) ref[p].push_back(next[p]++);
          break;
        }
        case 2: {
          std::optional<Tagged> item = ring->try_pop();
          ASSERT_EQ(item.has_value(), total() != 0);
          if (item) check_popped(*item);
          break;
        }
        default: {
          const std::size_t max = rng() % (2 * lane_capacity + 2);
          std::vector<Tagged> out(max);
          const std::size_t before = total();
          const std::size_t popped = ring->try_pop_batch(out.data(), max);
          ASSERT_EQ(popped, std::min(max, before));
          for (std::size_t i = 0; i < popped; ++i) check_popped(out[i]);
          break;
        }
      }
      ASSERT_EQ(ring->size_approx(), total());
      ASSERT_EQ(ring->empty_approx(), total() == 0);
    }
  }
}

}  // namespace
}  // namespace ember::ring
