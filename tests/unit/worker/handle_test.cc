// Handle and its completion state, without any I/O: parts, first error wins,
// waiting with and without a deadline, Boost.Asio completion tokens.
#include "worker/handle.h"

#include <future>
#include <thread>

#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>
#include <gtest/gtest.h>

namespace ember {
namespace {

using worker_detail::Op;
using namespace std::chrono_literals;

TEST(Handle, EmptyHandleIsInvalid) {
  Handle h;
  EXPECT_FALSE(h.valid());
  EXPECT_FALSE(h.ready());
  auto r = h.wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument);
}

TEST(Handle, FinishedAndFailedAreReadyAtOnce) {
  auto ok = Handle::finished(7);
  EXPECT_TRUE(ok.ready());
  EXPECT_EQ(*ok.wait(), 7u);
  auto bad = Handle::failed(Error(ErrorCode::kNotFound, "no key"));
  EXPECT_TRUE(bad.ready());
  EXPECT_EQ(bad.wait().error().code(), ErrorCode::kNotFound);
}

TEST(Handle, CompletesWhenEveryPartIsInWithTheSmallestStep) {
  auto op = std::make_shared<Op>(3);
  Handle h(op);
  EXPECT_FALSE(op->complete_part(5));
  EXPECT_FALSE(op->complete_part(std::nullopt));  // a send completion carries no step
  EXPECT_FALSE(h.ready());
  EXPECT_TRUE(op->complete_part(4));
  EXPECT_TRUE(h.ready());
  EXPECT_EQ(*h.wait(), 4u);
  EXPECT_FALSE(op->complete_part(1));  // late parts change nothing
  EXPECT_EQ(*h.wait(), 4u);
}

TEST(Handle, FirstErrorWinsAndFinishesAtOnce) {
  auto op = std::make_shared<Op>(3);
  Handle h(op);
  op->complete_part(1);
  EXPECT_TRUE(op->fail(Error(ErrorCode::kStale, "first")));
  EXPECT_FALSE(op->fail(Error(ErrorCode::kTimeout, "second")));
  EXPECT_FALSE(op->complete_part(1));
  auto r = h.wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kStale);
  EXPECT_EQ(r.error().message(), "first");
}

// A failure (request_timeout, an error reply) while a zero-copy send still
// reads the caller's memory is recorded at once but the operation is done
// only when the last such send has finished: done means the buffers are the
// caller's again.
TEST(Handle, AFailureWaitsForTheSendsThatStillReadTheCallersMemory) {
  auto op = std::make_shared<Op>(2);
  Handle h(op);
  op->send_started();
  op->send_started();
  EXPECT_FALSE(op->fail(Error(ErrorCode::kTimeout, "no reply")));
  EXPECT_TRUE(op->failed());
  EXPECT_FALSE(h.ready());
  EXPECT_FALSE(op->fail(Error(ErrorCode::kClosed, "later")));  // the first error stays
  EXPECT_FALSE(op->send_finished());
  EXPECT_FALSE(h.ready());
  EXPECT_TRUE(op->send_finished());
  ASSERT_TRUE(h.ready());
  EXPECT_EQ(h.wait().error().code(), ErrorCode::kTimeout);
  EXPECT_FALSE(op->send_finished());  // nothing left to finish

  // Without a failure the sends do not finish anything; parts do.
  auto ok = std::make_shared<Op>(1);
  ok->send_started();
  EXPECT_FALSE(ok->send_finished());
  EXPECT_FALSE(ok->failed());
  EXPECT_TRUE(ok->complete_part(3));
  EXPECT_EQ(*Handle(ok).wait(), 3u);

  // fail_out_of_step runs its callback when the operation finishes.
  auto oos = std::make_shared<Op>(1);
  std::optional<std::uint64_t> told;
  oos->on_out_of_step = [&](std::uint64_t at, ErrorCode code) {
    told = at;
    EXPECT_EQ(code, ErrorCode::kOutOfStep);
  };
  oos->send_started();
  EXPECT_FALSE(oos->fail_out_of_step(Error(ErrorCode::kOutOfStep, "behind"), 9));
  EXPECT_FALSE(told);
  EXPECT_TRUE(oos->send_finished());
  EXPECT_EQ(told, 9u);
}

TEST(Handle, AddedPartsDelayCompletion) {
  auto op = std::make_shared<Op>(1);
  op->add_parts(1);
  EXPECT_FALSE(op->complete_part(2));
  EXPECT_TRUE(op->complete_part(std::nullopt));
}

TEST(Handle, WaitForReportsTimeoutWhileRunning) {
  auto op = std::make_shared<Op>(1);
  Handle h(op);
  auto r = h.wait_for(10ms);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kTimeout);
  op->complete_part(3);
  EXPECT_EQ(*h.wait_for(10ms), 3u);
}

TEST(Handle, WaitReturnsWhenAnotherThreadCompletes) {
  auto op = std::make_shared<Op>(1);
  Handle h(op);
  std::thread t([op] { op->complete_part(9); });
  EXPECT_EQ(*h.wait(), 9u);
  t.join();
}

TEST(Handle, BeforeDoneRunsBeforeWaitersWake) {
  auto op = std::make_shared<Op>(1);
  std::atomic<std::uint64_t> seen{0};
  op->before_done = [&](const Result<std::uint64_t>& r) { seen = *r; };
  Handle h(op);
  std::thread t([op] { op->complete_part(12); });
  ASSERT_TRUE(h.wait());
  EXPECT_EQ(seen.load(), 12u);
  t.join();
}

TEST(Handle, AsyncWaitDeliversOnTheExecutor) {
  boost::asio::io_context io;
  auto op = std::make_shared<Op>(1);
  Handle h(op);
  std::optional<Result<std::uint64_t>> got;
  std::thread::id ran_on;
  h.async_wait(io.get_executor(), [&](Result<std::uint64_t> r) {
    got = std::move(r);
    ran_on = std::this_thread::get_id();
  });
  std::thread completer([op] { op->complete_part(42); });
  completer.join();
  EXPECT_FALSE(got);  // posted, not run inline
  io.run();
  ASSERT_TRUE(got);
  EXPECT_EQ(**got, 42u);
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

TEST(Handle, AsyncWaitOnFinishedHandleAndWithUseFuture) {
  boost::asio::io_context io;
  auto fut = Handle::failed(Error(ErrorCode::kClosed, "gone"))
                 .async_wait(io.get_executor(), boost::asio::use_future);
  io.run();
  auto r = fut.get();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kClosed);
}

TEST(Handle, WaitAllReturnsTheFirstError) {
  std::vector<Handle> hs{Handle::finished(1), Handle::failed(Error(ErrorCode::kIo, "a")),
                         Handle::failed(Error(ErrorCode::kTimeout, "b"))};
  auto s = wait_all(hs);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kIo);
  EXPECT_TRUE(wait_all({Handle::finished(1), Handle::finished(2)}));
}

}  // namespace
TEST(Handle, BusyPollingWaitSeesACompletionFromAnotherThread) {
  auto op = std::make_shared<Op>(1);
  op->busy_poll = 30s;  // longer than the test: wait() must end by polling
  Handle h(op);
  std::thread t([op] { op->complete_part(5); });
  auto r = h.wait();
  t.join();
  ASSERT_TRUE(r);
  EXPECT_EQ(*r, 5u);
}

TEST(Handle, WaitForEndsAtItsTimeoutEvenWhileBusyPolling) {
  auto op = std::make_shared<Op>(1);
  op->busy_poll = 30s;
  Handle h(op);
  const auto start = std::chrono::steady_clock::now();
  auto r = h.wait_for(20ms);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kTimeout);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
  op->complete_part(1);
  EXPECT_TRUE(h.wait_for(30s));
}

}  // namespace ember
