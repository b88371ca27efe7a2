#include "common/ring/blocking_mpsc_ring.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <gtest/gtest.h>

#include "common/ring/asio_waiter.h"
#include "tests/unit/ring/ring_test_support.h"

namespace ember::ring {
namespace {

using namespace std::chrono_literals;
using testing::wait_until;

using IntRing = BlockingMpscRing<int>;

// Options that make the consumer park at once, so the wake path is exercised.
constexpr ParkOptions kParkAtOnce{.spin_iterations = 0,
                                  .yield_iterations = 0,
                                  .producer_spin_iterations = 0,
                                  .producer_yield_iterations = 0};

std::unique_ptr<IntRing> make_ring(const ParkOptions& park = kParkAtOnce) {
  return IntRing::create({.lane_capacity = 64, .max_producers = 8}, park).value();
}

TEST(BlockingMpscRing, CreateRejectsBadOptions) {
  auto ring = IntRing::create({.lane_capacity = 3, .max_producers = 8});
  ASSERT_FALSE(ring);
  EXPECT_EQ(ring.error().code(), ErrorCode::kInvalidArgument);
}

TEST(BlockingMpscRing, PopWaitReturnsAtOnceWhenItemsArePresent) {
  auto ring = make_ring();
  ASSERT_TRUE(ring->try_push(5));
  int out = 0;
  ASSERT_TRUE(ring->pop_wait(out, 10s));
  EXPECT_EQ(out, 5);
  EXPECT_EQ(ring->parker().num_parks(), 0u);
}

TEST(BlockingMpscRing, PopWaitTimesOutOnAnEmptyRing) {
  auto ring = make_ring();
  int out = 0;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(ring->pop_wait(out, 30ms));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 30ms);
  EXPECT_GE(ring->parker().num_parks(), 1u);
}

TEST(BlockingMpscRing, ParkedConsumerIsWokenByAPush) {
  auto ring = make_ring();
  std::thread producer([&] {
    // Push only once the consumer has committed to sleeping.
    ASSERT_TRUE(wait_until([&] { return ring->parker().num_parks() >= 1; }, 10s));
    auto handle = ring->make_producer().value();
    ASSERT_TRUE(handle.try_push(42));
  });
  int out = 0;
  const auto start = std::chrono::steady_clock::now();
  const bool got = ring->pop_wait(out, 20s);
  const auto waited = std::chrono::steady_clock::now() - start;
  producer.join();
  ASSERT_TRUE(got) << "the push did not wake the consumer";
  EXPECT_EQ(out, 42);
  EXPECT_LT(waited, 10s);
  EXPECT_GE(ring->parker().num_signals(), 1u);
}

TEST(BlockingMpscRing, WakeEndsAWaitWithoutItems) {
  auto ring = make_ring();
  std::thread waker([&] {
    ASSERT_TRUE(wait_until([&] { return ring->parker().num_parks() >= 1; }, 10s));
    ring->wake();
  });
  int out = 0;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(ring->pop_wait(out, 20s));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  waker.join();
}

TEST(BlockingMpscRing, BatchPushWakesAndBatchPopDrains) {
  auto ring = make_ring();
  std::thread producer([&] {
    ASSERT_TRUE(wait_until([&] { return ring->parker().num_parks() >= 1; }, 10s));
    std::vector<int> items{1, 2, 3, 4, 5};
    ASSERT_EQ(ring->try_push_batch(items.data(), items.size()), 5u);
  });
  std::vector<int> out(16);
  const auto start = std::chrono::steady_clock::now();
  std::size_t got = ring->pop_batch_wait(out.data(), out.size(), 20s);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "the batch push did not wake the consumer";
  producer.join();
  while (got < 5) {
    const std::size_t n = ring->try_pop_batch(out.data() + got, out.size() - got);
    ASSERT_NE(n, 0u);
    got += n;
  }
  for (int i = 0; i < 5; ++i) EXPECT_EQ(out[static_cast<std::size_t>(i)], i + 1);
}

TEST(BlockingMpscRing, PushWaitTimesOutOnAFullLane) {
  auto ring = IntRing::create({.lane_capacity = 2, .max_producers = 2}, kParkAtOnce).value();
  auto producer = ring->make_producer().value();
  std::vector<int> items{1, 2, 3};
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(producer.push_batch_wait(items.data(), items.size(), 20ms), 2u);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 20ms);
  EXPECT_FALSE(producer.push_wait(4, 0ms));
}

TEST(BlockingMpscRing, SleepingProducerIsWokenOnceHalfItsLaneIsFree) {
  auto ring = IntRing::create({.lane_capacity = 4, .max_producers = 2}, kParkAtOnce).value();
  std::atomic<bool> pushed{false};
  std::thread producer([&] {
    auto handle = ring->make_producer().value();
    std::vector<int> items{0, 1, 2, 3, 4, 5};
    EXPECT_EQ(handle.push_batch_wait(items.data(), items.size(), 20s), 6u);
    pushed = true;
  });
  ASSERT_TRUE(wait_until([&] { return ring->num_producer_sleeps() >= 1; }, 10s));
  int out = -1;
  ASSERT_TRUE(ring->try_pop(out));
  EXPECT_EQ(out, 0);
  EXPECT_EQ(ring->num_producer_wakes(), 0u) << "one free slot of four is below the wake mark";
  ASSERT_TRUE(ring->try_pop(out));
  EXPECT_EQ(out, 1);
  EXPECT_EQ(ring->num_producer_wakes(), 1u) << "half the lane is free: the producer is woken";
  ASSERT_TRUE(wait_until([&] { return pushed.load(); }, 10s)) << "the producer was not woken";
  producer.join();
  for (int expected = 2; expected < 6; ++expected) {
    ASSERT_TRUE(ring->try_pop(out));
    EXPECT_EQ(out, expected);
  }
}

TEST(BlockingMpscRing, AnyThreadPushWaitUsesTheThreadLane) {
  auto ring = IntRing::create({.lane_capacity = 2, .max_producers = 1}, kParkAtOnce).value();
  std::thread producer([&] {
    for (int i = 0; i < 100; ++i) EXPECT_TRUE(ring->push_wait(int{i}, 20s));
  });
  for (int expected = 0; expected < 100; ++expected) {
    int out = -1;
    ASSERT_TRUE(ring->pop_wait(out, 20s));
    ASSERT_EQ(out, expected);
  }
  producer.join();
}

// Ping-pong between two threads through two rings whose consumers park at
// once: every round trip goes through the sleep/wake protocol. A lost
// wake-up shows up as a timeout.
TEST(BlockingMpscRing, PingPongNeverLosesAWakeUp) {
  auto ping = make_ring();
  auto pong = make_ring();
  constexpr int kRounds = testing::kSanitized ? 500 : 3000;
  std::atomic<bool> failed{false};
  std::thread echo([&] {
    auto out = pong->make_producer().value();
    for (int i = 0; i < kRounds; ++i) {
      int v = 0;
      const auto start = std::chrono::steady_clock::now();
      // A lost wake-up makes pop_wait sleep to its timeout (and then find
      // the item), so the time taken is what reveals it.
      if (!ping->pop_wait(v, 5s) || v != i || std::chrono::steady_clock::now() - start >= 5s) {
        failed = true;
        pong->wake();
        return;
      }
      while (!out.try_push(int{v})) std::this_thread::yield();
    }
  });
  auto in = ping->make_producer().value();
  for (int i = 0; i < kRounds && !failed; ++i) {
    while (!in.try_push(int{i})) std::this_thread::yield();
    int v = -1;
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE(pong->pop_wait(v, 5s)) << "lost wake-up at round " << i;
    ASSERT_LT(std::chrono::steady_clock::now() - start, 5s) << "lost wake-up at round " << i;
    ASSERT_EQ(v, i);
  }
  echo.join();
  EXPECT_FALSE(failed.load()) << "lost wake-up on the echo side";
}

TEST(AsioRingWaiter, CompletesAtOnceWhenItemsArePresent) {
  boost::asio::io_context io;
  auto ring = make_ring();
  auto waiter = AsioRingWaiter<IntRing>::create(io.get_executor(), *ring).value();
  ASSERT_TRUE(ring->try_push(1));
  bool called = false;
  waiter.async_wait([&](boost::system::error_code ec) {
    EXPECT_FALSE(ec);
    called = true;
  });
  io.run_for(5s);
  EXPECT_TRUE(called);
  EXPECT_EQ(ring->parker().num_parks(), 0u);
}

TEST(AsioRingWaiter, PushFromAnotherThreadCompletesTheWait) {
  boost::asio::io_context io;
  auto ring = make_ring();
  auto waiter = AsioRingWaiter<IntRing>::create(io.get_executor(), *ring).value();
  int received = -1;
  waiter.async_wait([&](boost::system::error_code ec) {
    ASSERT_FALSE(ec);
    ASSERT_TRUE(ring->try_pop(received));
  });
  std::thread producer([&] {
    ASSERT_TRUE(wait_until([&] { return ring->parker().num_parks() >= 1; }, 10s));
    ASSERT_TRUE(ring->try_push(77));
  });
  io.run_for(20s);  // returns as soon as the handler has run (no work left)
  producer.join();
  EXPECT_EQ(received, 77);
}

TEST(AsioRingWaiter, DrainLoopReceivesEverythingFromSeveralProducers) {
  boost::asio::io_context io;
  auto ring = make_ring();
  auto waiter = AsioRingWaiter<IntRing>::create(io.get_executor(), *ring).value();
  constexpr int kProducers = 3;
  constexpr int kPerProducer = testing::kSanitized ? 300 : 3000;
  std::vector<int> next(kProducers, 0);
  int total = 0;
  std::function<void(boost::system::error_code)> on_ready = [&](boost::system::error_code ec) {
    ASSERT_FALSE(ec);
    ring->consume(
        [&](int& v) {
          const int p = v / kPerProducer;
          EXPECT_EQ(v % kPerProducer, next[static_cast<std::size_t>(p)]++);
          ++total;
        },
        64);
    if (total < kProducers * kPerProducer) waiter.async_wait(on_ready);
  };
  waiter.async_wait(on_ready);
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      for (int i = 0; i < kPerProducer; ++i) {
        while (!ring->try_push(p * kPerProducer + i)) std::this_thread::yield();
        if (i % 97 == 0) std::this_thread::yield();  // let the consumer park now and then
      }
    });
  }
  io.run_for(60s);
  for (auto& t : producers) t.join();
  EXPECT_EQ(total, kProducers * kPerProducer);
}

TEST(AsioRingWaiter, CancelCompletesWithOperationAborted) {
  boost::asio::io_context io;
  auto ring = make_ring();
  auto waiter = AsioRingWaiter<IntRing>::create(io.get_executor(), *ring).value();
  boost::system::error_code result;
  waiter.async_wait([&](boost::system::error_code ec) { result = ec; });
  io.poll();  // start the wait
  waiter.cancel();
  io.run_for(5s);
  EXPECT_EQ(result, boost::asio::error::operation_aborted);
}

}  // namespace
TEST(BlockingMpscRing, BusyPollingConsumerTakesAPushWithoutSleeping) {
  ParkOptions park = kParkAtOnce;
  park.busy_poll = 30s;  // longer than the test: the consumer must never park
  auto ring = make_ring(park);
  std::atomic<bool> waiting{false};
  std::thread producer([&] {
    ASSERT_TRUE(wait_until([&] { return waiting.load(); }, 10s));
    auto handle = ring->make_producer().value();
    ASSERT_TRUE(handle.try_push(7));
  });
  int out = 0;
  waiting = true;
  const bool got = ring->pop_wait(out, 60s);
  producer.join();
  ASSERT_TRUE(got);
  EXPECT_EQ(out, 7);
  EXPECT_EQ(ring->parker().num_parks(), 0u) << "a busy-polling consumer went to sleep";
  EXPECT_EQ(ring->parker().num_signals(), 0u) << "the producer paid for a wake-up";
}

TEST(BlockingMpscRing, WakeEndsABusyPoll) {
  ParkOptions park = kParkAtOnce;
  park.busy_poll = 30s;
  auto ring = make_ring(park);
  std::atomic<bool> waiting{false};
  std::thread waker([&] {
    ASSERT_TRUE(wait_until([&] { return waiting.load(); }, 10s));
    ring->wake();
  });
  int out = 0;
  const auto start = std::chrono::steady_clock::now();
  waiting = true;
  EXPECT_FALSE(ring->pop_wait(out, 60s));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s) << "wake() did not end the busy poll";
  waker.join();
}

TEST(BlockingMpscRing, BusyPollIsBoundedByTheWaitTimeout) {
  ParkOptions park = kParkAtOnce;
  park.busy_poll = 30s;
  auto ring = make_ring(park);
  int out = 0;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(ring->pop_wait(out, 50ms));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
}

}  // namespace ember::ring
