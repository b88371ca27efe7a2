#include "common/ring/spsc_ring.h"

#include <array>
#include <cstdint>
#include <deque>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/unit/ring/ring_test_support.h"

namespace ember::ring {
namespace {

using testing::Tracked;

TEST(SpscRing, CreateRejectsZeroCapacity) {
  auto ring = SpscRing<int>::create(0);
  ASSERT_FALSE(ring);
  EXPECT_EQ(ring.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(ring.error().message().find("SpscRing capacity"), std::string::npos);
  EXPECT_NE(ring.error().message().find("power of two"), std::string::npos);
}

TEST(SpscRing, CreateRejectsNonPowerOfTwoAndProposesOne) {
  auto ring = SpscRing<int>::create(1000);
  ASSERT_FALSE(ring);
  EXPECT_EQ(ring.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(ring.error().message().find("1000"), std::string::npos);
  EXPECT_NE(ring.error().message().find("use 1024"), std::string::npos);
}

TEST(SpscRing, CreateRejectsTooManySlots) {
  auto ring = SpscRing<int>::create(kMaxRingSlots * 2);
  ASSERT_FALSE(ring);
  EXPECT_EQ(ring.error().code(), ErrorCode::kTooLarge);
  EXPECT_NE(ring.error().message().find("maximum"), std::string::npos);
}

TEST(SpscRing, CreateRejectsTooManyBytes) {
  using Big = std::array<char, 1 << 20>;
  auto ring = SpscRing<Big>::create(std::size_t{1} << 15);  // 32 GiB of slots
  ASSERT_FALSE(ring);
  EXPECT_EQ(ring.error().code(), ErrorCode::kTooLarge);
  EXPECT_NE(ring.error().message().find("smaller element"), std::string::npos);
}

TEST(SpscRing, TryPushFailsWhenFullAndSucceedsAfterPop) {
  auto ring = SpscRing<int>::create(4).value();
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(ring->try_push(int{i}));
  EXPECT_FALSE(ring->try_push(99));
  EXPECT_EQ(ring->size_approx(), 4u);
  int out = -1;
  ASSERT_TRUE(ring->try_pop(out));
  EXPECT_EQ(out, 0);
  EXPECT_TRUE(ring->try_push(4));
  for (int expected = 1; expected <= 4; ++expected) {
    ASSERT_TRUE(ring->try_pop(out));
    EXPECT_EQ(out, expected);
  }
  EXPECT_FALSE(ring->try_pop(out));
  EXPECT_TRUE(ring->empty_approx());
}

TEST(SpscRing, CapacityOneWorks) {
  SpscRing<std::string> ring(1);
  EXPECT_TRUE(ring.try_emplace("a"));
  EXPECT_FALSE(ring.try_emplace("b"));
  EXPECT_EQ(ring.try_pop().value_or(""), "a");
  EXPECT_FALSE(ring.try_pop().has_value());
}

TEST(SpscRing, DestroyingTheRingDestroysRemainingItems) {
  ASSERT_EQ(Tracked::live().load(), 0);
  {
    SpscRing<Tracked> ring(8);
    for (std::uint64_t i = 0; i < 6; ++i) ASSERT_TRUE(ring.try_push(Tracked(i)));
    Tracked out;
    ASSERT_TRUE(ring.try_pop(out));
    EXPECT_EQ(out.value(), 0u);
    EXPECT_EQ(Tracked::live().load(), 6);  // 5 in the ring + out
  }
  EXPECT_EQ(Tracked::live().load(), 0);
}

TEST(SpscRing, PositionsWrapAround64Bits) {
  // Start 3 before 2^64 so head and tail wrap during the test.
  SpscRing<std::uint64_t> ring(4, std::numeric_limits<std::uint64_t>::max() - 2);
  std::uint64_t next_in = 0, next_out = 0;
  for (int round = 0; round < 20; ++round) {
    while (ring.try_push(std::uint64_t{next_in})) ++next_in;
    EXPECT_EQ(ring.size_approx(), 4u);
    std::uint64_t out = 0;
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(ring.try_pop(out));
      EXPECT_EQ(out, next_out++);
    }
  }
}

struct CountingHooks {
  static inline thread_local int publishes = 0;
  static void before_publish() noexcept { ++publishes; }
};

TEST(SpscRing, BatchPushPublishesOnceAndPushesWhatFits) {
  SpscRing<int, CountingHooks> ring(8);
  std::vector<int> items{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  CountingHooks::publishes = 0;
  EXPECT_EQ(ring.try_push_batch(items.data(), items.size()), 8u);
  EXPECT_EQ(CountingHooks::publishes, 1);
  EXPECT_EQ(ring.try_push_batch(items.data() + 8, 2), 0u);
  EXPECT_EQ(CountingHooks::publishes, 1);
  std::array<int, 16> out{};
  EXPECT_EQ(ring.try_pop_batch(out.data(), 5), 5u);
  EXPECT_EQ(ring.try_push_batch(items.data() + 8, 2), 2u);
  EXPECT_EQ(ring.try_pop_batch(out.data() + 5, 16), 5u);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(out[static_cast<std::size_t>(i)], i);
}

TEST(SpscRing, ConsumeVisitsInPlaceAndLeavesThrowingItemAtFront) {
  SpscRing<Tracked> ring(8);
  for (std::uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(ring.try_push(Tracked(i)));
  std::vector<std::uint64_t> seen;
  EXPECT_THROW(ring.consume(
                   [&](Tracked& item) {
                     if (item.value() == 2) throw std::runtime_error("stop");
                     seen.push_back(item.value());
                   },
                   8),
               std::runtime_error);
  EXPECT_EQ(seen, (std::vector<std::uint64_t>{0, 1}));
  EXPECT_EQ(ring.size_approx(), 3u);
  EXPECT_EQ(ring.try_pop().value().value(), 2u);
}

// Differential test: random operations on the ring and on a std::deque must
// agree on every result, for several capacities and with positions that
// start just before the 64-bit wrap.
TEST(SpscRing, MatchesDequeUnderRandomOperations) {
  const std::uint64_t seed = testing::test_seed("SpscRing.MatchesDequeUnderRandomOperations");
  std::mt19937_64 rng(seed);
  for (std::size_t capacity : {1u, 2u, 8u, 64u}) {
    for (std::uint64_t start : {std::uint64_t{0}, std::numeric_limits<std::uint64_t>::max() - 100}) {
      SCOPED_TRACE(::testing::Message() << "seed=" << seed << " capacity=" << capacity
                                        << " start=" << start);
      {
        SpscRing<Tracked> ring(capacity, start);
        std::deque<std::uint64_t> ref;
        std::uint64_t next = 0;
        for (int op = 0; op < 20000; ++op) {
          switch (rng() % 6) {
            case 0: {
              const bool ok = ring.try_push(Tracked(next));
              ASSERT_EQ(ok, ref.size() < capacity);
              if (ok) ref.push_back(next);
              ++next;
              break;
            }
            case 1: {
              const bool ok = ring.try_emplace(next);
              ASSERT_EQ(ok, ref.size() < capacity);
              if (ok) ref.push_back(next);
              ++next;
              break;
            }
            case 2: {
              const std::size_t count = rng() % (capacity + 3);
              std::vector<Tracked> items;
              for (std::size_t i = 0; i < count; ++i) items.emplace_back(next + i);
              const std::size_t pushed = ring.try_push_batch(items.data(), count);
              ASSERT_EQ(pushed, std::min(count, capacity - ref.size()));
              for (std::size_t i = 0; i < pushed; ++i) {
                ASSERT_FALSE(items[i].has_value());  // moved into the ring
                ref.push_back(next + i);
              }
              for (std::size_t i = pushed; i < count; ++i) ASSERT_EQ(items[i].value(), next + i);
              next += count;
              break;
            }
            case 3: {
              std::optional<Tracked> out = ring.try_pop();
              ASSERT_EQ(out.has_value(), !ref.empty());
              if (out) {
                ASSERT_EQ(out->value(), ref.front());
                ref.pop_front();
              }
              break;
            }
            case 4: {
              const std::size_t max = rng() % (capacity + 3);
              std::vector<Tracked> out(max);
              const std::size_t popped = ring.try_pop_batch(out.data(), max);
              ASSERT_EQ(popped, std::min(max, ref.size()));
              for (std::size_t i = 0; i < popped; ++i) {
                ASSERT_EQ(out[i].value(), ref.front());
                ref.pop_front();
              }
              break;
            }
            default: {
              const std::size_t max = rng() % (capacity + 3);
              std::size_t visited = 0;
              const std::size_t consumed = ring.consume(
                  [&](Tracked& item) {
                    EXPECT_EQ(item.value(), ref[visited]);
                    ++visited;
                  },
                  max);
              ASSERT_EQ(consumed, std::min(max, ref.size()));
              ASSERT_EQ(visited, consumed);
              ref.erase(ref.begin(), ref.begin() + static_cast<std::ptrdiff_t>(consumed));
              break;
            }
          }
          ASSERT_EQ(ring.size_approx(), ref.size());
          ASSERT_EQ(Tracked::live().load(), static_cast<std::int64_t>(ref.size()));
        }
      }
      ASSERT_EQ(Tracked::live().load(), 0) << "the destructor must destroy what is left";
    }
  }
}

}  // namespace
}  // namespace ember::ring
