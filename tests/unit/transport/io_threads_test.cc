// IoThreads: busy polling (the `busy_poll` argument) runs handlers like the
// blocking loop and never delays stop() or join_when_idle().
#include "common/transport/io_threads.h"

#include <atomic>
#include <chrono>
#include <thread>

#include <boost/asio/post.hpp>
#include <gtest/gtest.h>

namespace ember::transport {
namespace {

TEST(IoThreads, BusyPollingThreadsRunHandlersAndStopPromptly) {
  // busy_poll far longer than the test: handlers must still run, and both
  // ways of stopping must end the polling at once.
  for (const bool idle_join : {true, false}) {
    auto io = IoThreads::start(2, {}, std::chrono::seconds(30));
    ASSERT_TRUE(io);
    std::atomic<int> ran{0};
    for (int i = 0; i < 100; ++i) {
      boost::asio::post((*io)->pick(), [&ran] { ran.fetch_add(1); });
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (ran.load() != 100 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    ASSERT_EQ(ran.load(), 100);
    const auto start = std::chrono::steady_clock::now();
    if (idle_join) {
      (*io)->join_when_idle();
    } else {
      (*io)->stop();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20))
        << (idle_join ? "join_when_idle" : "stop") << " waited for the busy poll";
  }
}

TEST(IoThreads, BlockingThreadsRunHandlers) {
  auto io = IoThreads::start(1, {});
  ASSERT_TRUE(io);
  std::atomic<bool> on_io{false};
  IoThreads* raw = io->get();
  boost::asio::post(raw->context(0), [&] { on_io = raw->on_io_thread(); });
  raw->join_when_idle();
  EXPECT_TRUE(on_io.load());
  EXPECT_FALSE(raw->on_io_thread());
}

}  // namespace
}  // namespace ember::transport
