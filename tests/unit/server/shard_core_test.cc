// ShardCore: store semantics, BSP/ASP/SSP, exactly-once pushes, worker loss,
// snapshots. Driven directly with a recording sink; no threads, no sockets.
#include "server/shard_core.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <random>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/barrier_core.h"

namespace ember::server {
namespace {

using proto::Header;
using proto::MsgType;

struct Sent {
  ReplyTo to;
  Header header;
  std::vector<float> values;
  bool is_error = false;
  Error error;
  // reply_lent: the lent values (not a copy) and the lease keeping them.
  std::span<const float> lent;
  std::shared_ptr<const void> lease;
  // error: the step of the request it answers (header.step is the reply's).
  std::uint64_t asked_step = 0;
};

class RecordingSink : public ReplySink {
 public:
  void reply(const ReplyTo& to, const Header& reply, std::span<const float> values) override {
    sent.push_back(Sent{to, reply, {values.begin(), values.end()}, false, {}, {}, nullptr});
  }
  void reply_lent(const ReplyTo& to, const Header& reply, std::span<const float> values,
                  std::shared_ptr<const void> lease) override {
    sent.push_back(Sent{to, reply, {values.begin(), values.end()}, false, {}, values,
                        std::move(lease)});
  }
  using ReplySink::error;
  // Records the error reply as it goes out: the request's header with the
  // reply's step; `asked_step` keeps the request's own.
  void error(const ReplyTo& to, const Header& request, const Error& error,
             std::uint64_t reply_step) override {
    Header answered = request;
    answered.step = reply_step;
    sent.push_back(Sent{to, answered, {}, true, error, {}, nullptr, request.step});
  }
  void push_recorded(std::uint32_t rank, std::uint64_t step) override {
    recorded.emplace_back(rank, step);
  }
  std::vector<Sent> take() { return std::exchange(sent, {}); }
  std::vector<Sent> sent;
  std::vector<std::pair<std::uint32_t, std::uint64_t>> recorded;  // push_recorded (rank, step)
};

const TimePoint kT0{};

Optimizer sgd(double lr = 1.0) {
  config::OptimizerConfig c;
  c.type = config::OptimizerType::kSgd;
  c.learning_rate = lr;
  return *Optimizer::create(c);
}

CoreOptions opts(std::uint32_t workers, proto::Consistency c = proto::Consistency::kBsp,
                 proto::LossPolicy loss = proto::LossPolicy::kWait) {
  CoreOptions o;
  o.num_workers = workers;
  o.consistency = c;
  o.loss_policy = loss;
  o.worker_timeout = std::chrono::seconds(5);
  o.name = "test shard";
  return o;
}

Request req(MsgType type, std::uint32_t rank, std::uint64_t key, std::uint64_t step,
            std::uint64_t n, std::uint64_t conn = 0) {
  Request r;
  r.to = ReplyTo{conn == 0 ? rank + 100u : conn, 0};
  r.header.type = type;
  r.header.dtype = proto::DType::kFloat32;
  r.header.worker_rank = rank;
  r.header.key = key;
  r.header.step = step;
  r.header.num_elements = n;
  r.header.request_id = step * 1000 + rank;
  return r;
}

class ShardCoreTest : public ::testing::Test {
 protected:
  void make(CoreOptions o, Optimizer opt = sgd()) { core = std::make_unique<ShardCore>(o, opt); }
  void init(std::uint64_t key, std::vector<float> v) {
    const std::uint64_t shape[] = {v.size()};
    core->on_init(req(MsgType::kInit, 0, key, 0, v.size()), shape, Payload::of(v), kT0, sink);
    auto s = sink.take();
    ASSERT_EQ(s.size(), 1u);
    ASSERT_FALSE(s[0].is_error) << s[0].error.to_string();
  }
  void push(std::uint32_t rank, std::uint64_t key, std::uint64_t step, std::vector<float> g) {
    core->on_push(req(MsgType::kPush, rank, key, step, g.size()), Payload::of(g), kT0, sink);
  }
  void pull(std::uint32_t rank, std::uint64_t key, std::uint64_t step, std::uint64_t n) {
    core->on_pull(req(MsgType::kPull, rank, key, step, n), kT0, sink);
  }
  std::vector<float> params(std::uint64_t key, std::uint64_t n) {
    pull(0, key, 0, n);
    auto s = sink.take();
    EXPECT_EQ(s.size(), 1u);
    return s.empty() ? std::vector<float>{} : s.back().values;
  }

  std::unique_ptr<ShardCore> core;
  RecordingSink sink;
};

TEST_F(ShardCoreTest, InitWithSameShapeIsNoOpAndKeepsValues) {
  make(opts(1));
  init(7, {1, 2, 3});
  const std::uint64_t shape[] = {3};
  core->on_init(req(MsgType::kInit, 0, 7, 0, 3), shape, Payload::of(std::vector<float>{9, 9, 9}),
                kT0, sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_FALSE(s[0].is_error);
  EXPECT_EQ(params(7, 3), (std::vector<float>{1, 2, 3}));
}

TEST_F(ShardCoreTest, InitWithDifferentShapeIsShapeMismatch) {
  make(opts(1));
  init(7, {1, 2, 3, 4});
  const std::uint64_t shape[] = {2, 2};
  core->on_init(req(MsgType::kInit, 0, 7, 0, 4), shape, Payload::of(std::vector<float>{1, 2, 3, 4}),
                kT0, sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  ASSERT_TRUE(s[0].is_error);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kShapeMismatch);
  EXPECT_NE(s[0].error.message().find("[4]"), std::string::npos) << s[0].error.message();
}

TEST_F(ShardCoreTest, OtherRanksInitWaitsForRankZero) {
  make(opts(2));
  const std::uint64_t shape[] = {2};
  auto r1 = req(MsgType::kInit, 1, 5, 0, 2);
  r1.header.flags = proto::kFlagNoData;
  core->on_init(r1, shape, Payload{}, kT0, sink);
  EXPECT_TRUE(sink.take().empty());
  EXPECT_EQ(core->stats().parked_requests, 1u);
  core->on_init(req(MsgType::kInit, 0, 5, 0, 2), shape, Payload::of(std::vector<float>{1, 2}), kT0,
                sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);  // rank 0, then the waiting rank 1
  EXPECT_FALSE(s[0].is_error);
  EXPECT_FALSE(s[1].is_error);
  EXPECT_EQ(s[1].to.connection_id, 101u);
  EXPECT_EQ(core->stats().parked_requests, 0u);
}

TEST_F(ShardCoreTest, WaitingInitWithOtherShapeFailsWhenRankZeroArrives) {
  make(opts(2));
  const std::uint64_t shape3[] = {3};
  auto r1 = req(MsgType::kInit, 1, 5, 0, 3);
  core->on_init(r1, shape3, Payload{}, kT0, sink);
  const std::uint64_t shape2[] = {2};
  core->on_init(req(MsgType::kInit, 0, 5, 0, 2), shape2, Payload::of(std::vector<float>{1, 2}), kT0,
                sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_FALSE(s[0].is_error);
  EXPECT_TRUE(s[1].is_error);
  EXPECT_EQ(s[1].error.code(), ErrorCode::kShapeMismatch);
  // Another element count: the message names both shapes and what to do.
  EXPECT_NE(s[1].error.message().find("holds 2 elements"), std::string::npos)
      << s[1].error.message();
  EXPECT_NE(s[1].error.message().find("it was registered with shape [2] and this init asks for "
                                      "[3]: init a key with the shape it has"),
            std::string::npos)
      << s[1].error.message();
}

TEST_F(ShardCoreTest, NonFloat32InitIsRefused) {
  make(opts(1));
  auto r = req(MsgType::kInit, 0, 1, 0, 1);
  r.header.dtype = proto::DType::kFloat16;
  const std::uint64_t shape[] = {1};
  core->on_init(r, shape, Payload::of(std::vector<float>{1}), kT0, sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kInvalidArgument);
}

TEST_F(ShardCoreTest, UnknownKeyIsNotFound) {
  make(opts(1));
  push(0, 99, 0, {1});
  pull(0, 99, 0, 1);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  for (auto& x : s) {
    EXPECT_TRUE(x.is_error);
    EXPECT_EQ(x.error.code(), ErrorCode::kNotFound);
    EXPECT_NE(x.error.message().find("key 99"), std::string::npos);
    // What to do, and the cause when the worker did init: a restart that lost the state.
    EXPECT_NE(x.error.message().find("call init for the key first"), std::string::npos);
    EXPECT_NE(x.error.message().find("restarted and lost the key, having no checkpoint to restore"), std::string::npos)
        << x.error.message();
  }
}

TEST_F(ShardCoreTest, WrongElementCountIsShapeMismatch) {
  make(opts(1));
  init(1, {1, 2});
  push(0, 1, 0, {1, 2, 3});
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kShapeMismatch);
}

TEST_F(ShardCoreTest, BspPullWaitsForEveryWorkerThenAveragesOnce) {
  make(opts(2));
  init(1, {1, 1});
  push(0, 1, 0, {0.5f, 1.0f});
  pull(0, 1, 1, 2);  // parks
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);  // only the push ack
  EXPECT_FALSE(s[0].is_error);
  push(1, 1, 0, {1.5f, 3.0f});
  s = sink.take();
  ASSERT_EQ(s.size(), 2u);  // rank 1's ack, then the parked pull
  EXPECT_EQ(s[0].header.type, MsgType::kPush);
  EXPECT_EQ(s[1].header.type, MsgType::kPull);
  EXPECT_EQ(s[1].header.step, 1u);
  EXPECT_EQ(s[1].values, (std::vector<float>{1 - 1.0f, 1 - 2.0f}));
  EXPECT_EQ(core->stats().rounds_completed, 1u);
}

// Bit-for-bit: any arrival order gives the parameters of summing in rank order.
TEST_F(ShardCoreTest, BspResultIsIndependentOfArrivalOrder) {
  const std::uint32_t workers = 4;
  const std::size_t n = 64;
  const std::uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<std::vector<std::vector<float>>> grads(3);  // [step][rank][i]
  for (auto& step : grads) {
    step.resize(workers);
    for (auto& g : step) {
      g.resize(n);
      for (auto& x : g) x = dist(rng);
    }
  }
  std::vector<float> init_values(n);
  for (auto& x : init_values) x = dist(rng);
  // Expected: ((g0 + g1) + g2) + g3, divided by 4, SGD lr 0.1.
  std::vector<float> expect = init_values;
  for (auto& step : grads) {
    for (std::size_t i = 0; i < n; ++i) {
      float s = step[0][i];
      for (std::uint32_t r = 1; r < workers; ++r) s += step[r][i];
      s /= 4.0f;
      expect[i] -= 0.1f * s;
    }
  }
  for (int trial = 0; trial < 10; ++trial) {
    make(opts(workers), sgd(0.1));
    init(3, init_values);
    for (std::uint64_t t = 0; t < grads.size(); ++t) {
      std::vector<std::uint32_t> order{0, 1, 2, 3};
      std::shuffle(order.begin(), order.end(), rng);
      for (auto r : order) push(r, 3, t, grads[t][r]);
    }
    sink.take();
    EXPECT_EQ(params(3, n), expect) << "seed " << seed << " trial " << trial;
  }
}

TEST_F(ShardCoreTest, DuplicatePushIsAcknowledgedAndAppliedOnce) {
  make(opts(1));
  init(1, {10});
  push(0, 1, 0, {1});
  push(0, 1, 0, {1});  // re-send
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_FALSE(s[0].is_error);
  EXPECT_FALSE(s[1].is_error);
  EXPECT_EQ(params(1, 1), std::vector<float>{9});
  EXPECT_EQ(core->stats().pushes_duplicate, 1u);
  EXPECT_EQ(core->stats().pushes_applied, 1u);
}

TEST_F(ShardCoreTest, BspDuplicateIntoOpenRoundIsNotCountedTwice) {
  make(opts(2));
  init(1, {10});
  push(0, 1, 0, {1});
  push(0, 1, 0, {1});
  pull(0, 1, 1, 1);
  EXPECT_EQ(sink.take().size(), 2u);  // two acks, pull parked
  push(1, 1, 0, {3});
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[1].values, std::vector<float>{8});  // 10 - (1 + 3) / 2
}

TEST_F(ShardCoreTest, BspPushForClosedRoundIsStale) {
  make(opts(2, proto::Consistency::kBsp, proto::LossPolicy::kShrink));
  init(1, {10});
  push(0, 1, 0, {1});
  core->on_worker_lost(1, kT0, sink);  // round 0 completes without rank 1
  sink.take();
  core->on_worker_back(1, kT0, sink);
  push(1, 1, 0, {1});
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  ASSERT_TRUE(s[0].is_error);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kStale);
}

TEST_F(ShardCoreTest, BspPushTooFarAheadIsRefused) {
  auto o = opts(2);
  o.max_steps_ahead = 4;
  make(o);
  init(1, {0});
  for (std::uint64_t t = 0; t <= 4; ++t) push(0, 1, t, {1});  // rank 0 alone runs ahead
  auto s = sink.take();
  ASSERT_EQ(s.size(), 5u);
  for (const auto& x : s) EXPECT_FALSE(x.is_error) << x.error.to_string();
  push(0, 1, 5, {1});
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kInvalidArgument);
}

TEST_F(ShardCoreTest, BspFutureRoundsCompleteInOrder) {
  make(opts(2));
  init(1, {0});
  push(0, 1, 0, {2});
  push(0, 1, 1, {4});  // rank 0 runs ahead without pulling: round 1 opens early
  EXPECT_EQ(core->stats().rounds_completed, 0u);
  push(1, 1, 0, {2});
  EXPECT_EQ(core->stats().rounds_completed, 1u);
  push(1, 1, 1, {4});
  EXPECT_EQ(core->stats().rounds_completed, 2u);
  sink.take();
  EXPECT_EQ(params(1, 1), std::vector<float>{-6});
}

TEST_F(ShardCoreTest, PushPullRepliesWithNextStepParameters) {
  make(opts(2));
  init(1, {0});
  core->on_push_pull(req(MsgType::kPushPull, 0, 1, 0, 1), Payload::of(std::vector<float>{2}), kT0,
                     sink);
  EXPECT_TRUE(sink.take().empty());
  core->on_push_pull(req(MsgType::kPushPull, 1, 1, 0, 1), Payload::of(std::vector<float>{4}), kT0,
                     sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  for (auto& x : s) {
    EXPECT_EQ(x.values, std::vector<float>{-3});
    EXPECT_EQ(x.header.step, 1u);
  }
}

TEST_F(ShardCoreTest, AspAppliesEveryPushOnArrivalExactlyOnce) {
  make(opts(2, proto::Consistency::kAsp));
  init(1, {0});
  push(0, 1, 0, {1});
  push(1, 1, 0, {2});
  push(0, 1, 1, {3});
  push(0, 1, 1, {3});  // duplicate
  pull(1, 1, 100, 1);  // never waits
  auto s = sink.take();
  ASSERT_EQ(s.size(), 5u);
  EXPECT_EQ(s[4].values, std::vector<float>{-6});
  EXPECT_EQ(s[4].header.step, 1u);  // rank 1's own clock
  EXPECT_EQ(core->stats().pushes_applied, 3u);
}

TEST_F(ShardCoreTest, SspPullWaitsWhenAheadOfSlowestByMoreThanBound) {
  auto o = opts(2, proto::Consistency::kSsp);
  o.staleness = 1;
  make(o);
  init(1, {0});
  // Rank 0 pushes steps 0 and 1; rank 1 nothing. Pull for step 1 needs all
  // clocks >= 0: fine. Pull for step 2 needs clocks >= 1: waits for rank 1.
  push(0, 1, 0, {1});
  pull(0, 1, 1, 1);
  push(0, 1, 1, {1});
  pull(0, 1, 2, 1);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 3u);  // ack, pull, ack; the second pull waits
  EXPECT_EQ(core->stats().parked_requests, 1u);
  push(1, 1, 0, {1});
  s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[1].header.type, MsgType::kPull);
  EXPECT_EQ(s[1].values, std::vector<float>{-3});
}

TEST_F(ShardCoreTest, WaitPolicyFailsWaitersOnlyAfterTimeout) {
  make(opts(2));
  init(1, {0});
  push(0, 1, 0, {1});
  pull(0, 1, 1, 1);
  sink.take();
  core->on_worker_lost(1, kT0, sink);
  EXPECT_TRUE(sink.take().empty());
  ASSERT_TRUE(core->next_deadline());
  EXPECT_EQ(*core->next_deadline(), kT0 + std::chrono::seconds(5));
  core->on_tick(kT0 + std::chrono::seconds(4), sink);
  EXPECT_TRUE(sink.take().empty());
  core->on_tick(kT0 + std::chrono::seconds(5), sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  ASSERT_TRUE(s[0].is_error);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kWorkerLost);
  EXPECT_NE(s[0].error.message().find("worker 1"), std::string::npos);
}

TEST_F(ShardCoreTest, WaitPolicyContinuesWhenTheWorkerReturns) {
  make(opts(2));
  init(1, {0});
  push(0, 1, 0, {1});
  pull(0, 1, 1, 1);
  sink.take();
  core->on_worker_lost(1, kT0, sink);
  core->on_worker_back(1, kT0 + std::chrono::seconds(1), sink);
  core->on_tick(kT0 + std::chrono::seconds(10), sink);
  EXPECT_TRUE(sink.take().empty());
  push(1, 1, 0, {3});
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[1].values, std::vector<float>{-2});
}

TEST_F(ShardCoreTest, ShrinkPolicyCompletesWithRemainingWorkers) {
  make(opts(3, proto::Consistency::kBsp, proto::LossPolicy::kShrink));
  init(1, {0});
  push(0, 1, 0, {3});
  push(2, 1, 0, {5});
  pull(0, 1, 1, 1);
  sink.take();
  core->on_worker_lost(1, kT0, sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].values, std::vector<float>{-4});  // (3 + 5) / 2
  // Next rounds need only ranks 0 and 2.
  push(0, 1, 1, {1});
  push(2, 1, 1, {1});
  EXPECT_EQ(core->stats().rounds_completed, 2u);
}

// Under shrink, a lost rank 0 is left out, not failed: inits of other ranks
// waited for it with nothing to end the wait (a timeout that named no cause).
// They fail once it has been gone for worker_timeout.
TEST_F(ShardCoreTest, ShrinkWithoutRankZeroFailsOtherRanksInitsWithWorkerLost) {
  make(opts(3, proto::Consistency::kBsp, proto::LossPolicy::kShrink));
  const std::uint64_t shape[] = {2};
  auto parked = req(MsgType::kInit, 1, 5, 0, 2);
  parked.header.flags = proto::kFlagNoData;
  core->on_init(parked, shape, Payload{}, kT0, sink);
  EXPECT_TRUE(sink.take().empty());
  core->on_worker_lost(0, kT0, sink);
  EXPECT_TRUE(sink.take().empty());  // within worker_timeout (5 s): rank 0 may be back
  core->on_tick(kT0 + std::chrono::seconds(5), sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kWorkerLost);
  EXPECT_NE(s[0].error.message().find("on_worker_loss = \"shrink\""), std::string::npos)
      << s[0].error.message();
  EXPECT_FALSE(core->next_deadline());
  auto later = req(MsgType::kInit, 2, 6, 0, 2);
  later.header.flags = proto::kFlagNoData;
  core->on_init(later, shape, Payload{}, kT0 + std::chrono::seconds(6), sink);
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kWorkerLost);
  EXPECT_EQ(core->stats().parked_requests, 0u);
}

// Under shrink a left-out rank's push for a round that closed without it is
// refused as stale, and the reply's step says where the key is now, so the
// worker can move on (it pushed stale forever before).
TEST_F(ShardCoreTest, AStalePushIsToldTheServersStep) {
  make(opts(2, proto::Consistency::kBsp, proto::LossPolicy::kShrink));
  init(1, {0});
  core->on_worker_lost(1, kT0, sink);
  for (std::uint64_t t = 0; t < 3; ++t) push(0, 1, t, {1});
  sink.take();
  core->on_worker_back(1, kT0, sink);
  push(1, 1, 0, {1});
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kStale);
  EXPECT_EQ(s[0].header.step, 3u) << "the reply carries the server's step";
  EXPECT_EQ(s[0].asked_step, 0u) << "the log names the push's";
  push(1, 1, 3, {1});  // from the server's step: joins the open round
  push(0, 1, 3, {1});
  EXPECT_EQ(core->stats().rounds_completed, 4u);
}

// SSP, shrink: a rank back after the others went on resumes with the
// slowest of them, rather than at its old clock, which held every pull of
// theirs until it had replayed the steps it missed.
TEST_F(ShardCoreTest, SspRankBackAfterShrinkResumesWithTheSlowestOther) {
  CoreOptions o = opts(3, proto::Consistency::kSsp, proto::LossPolicy::kShrink);
  o.staleness = 1;
  make(o);
  init(1, {0});
  core->on_worker_lost(2, kT0, sink);
  for (std::uint64_t t = 0; t < 6; ++t) push(0, 1, t, {1});
  for (std::uint64_t t = 0; t < 4; ++t) push(1, 1, t, {1});
  sink.take();
  core->on_worker_back(2, kT0, sink);
  pull(2, 1, 0, 1);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].header.step, 4u);  // rank 1's clock, the slower other
  // Rank 0's pull of step 6 needs every counted rank at 5 or more: ranks 1
  // and 2 push steps 4 (rank 2 from its new clock), and it is served.
  pull(0, 1, 6, 1);
  EXPECT_TRUE(sink.take().empty());
  push(1, 1, 4, {1});
  push(2, 1, 4, {1});
  s = sink.take();
  ASSERT_FALSE(s.empty());
  EXPECT_FALSE(s.back().is_error) << s.back().error.to_string();
  EXPECT_EQ(s.back().to.connection_id, 100u);
}

// SSP, shrink, every other rank left out when one comes back: it resumes
// with the furthest of them (the slowest counted would be none), so the
// others' pulls are not held by it when they come back in turn.
TEST_F(ShardCoreTest, SspRankBackWhileAllOthersAreLeftOutResumesWithTheFurthest) {
  CoreOptions o = opts(2, proto::Consistency::kSsp, proto::LossPolicy::kShrink);
  o.staleness = 1;
  make(o);
  init(1, {0});
  core->on_worker_lost(1, kT0, sink);
  for (std::uint64_t t = 0; t < 6; ++t) push(0, 1, t, {1});
  core->on_worker_lost(0, kT0, sink);
  sink.take();
  core->on_worker_back(1, kT0, sink);
  pull(1, 1, 0, 1);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].header.step, 6u);
  core->on_worker_back(0, kT0, sink);
  pull(0, 1, 7, 1);  // needs rank 1 at 6 or more: it is
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_FALSE(s[0].is_error) << s[0].error.to_string();
}

// SSP, shrink: a rank back on the same connection pushes the steps it had
// reached before (its worker did not restart). Those steps were skipped when
// its clock was raised: refused as stale with the clock, rather than
// acknowledged as re-sends and silently dropped. A real re-send (a step
// below its old clock) is still acknowledged.
TEST_F(ShardCoreTest, SspPushesOfSkippedStepsAreStaleAndTellTheClock) {
  make(opts(2, proto::Consistency::kSsp, proto::LossPolicy::kShrink));
  init(1, {0});
  push(1, 1, 0, {1});
  push(1, 1, 1, {1});
  core->on_worker_lost(1, kT0, sink);
  for (std::uint64_t t = 0; t < 5; ++t) push(0, 1, t, {1});
  sink.take();
  core->on_worker_back(1, kT0, sink);
  push(1, 1, 1, {1});  // a re-send of a push applied before it left
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_FALSE(s[0].is_error);
  EXPECT_EQ(core->stats().pushes_duplicate, 1u);
  push(1, 1, 2, {1});  // skipped
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kStale);
  EXPECT_EQ(s[0].header.step, 5u) << "the reply carries the rank's clock";
  EXPECT_EQ(s[0].asked_step, 2u) << "the log names the push's step";
  const auto applied = core->stats().pushes_applied;
  push(1, 1, 5, {1});  // from the clock: applied
  EXPECT_EQ(core->stats().pushes_applied, applied + 1);
}

// Under shrink rank 0 is left out at once, but a rank 0 restarted within
// worker_timeout still gives the initial values: inits of other ranks wait
// that long for it before they fail.
TEST_F(ShardCoreTest, InitsWaitWorkerTimeoutForALeftOutRankZero) {
  make(opts(2, proto::Consistency::kBsp, proto::LossPolicy::kShrink));
  const std::uint64_t shape[] = {2};
  core->on_worker_lost(0, kT0, sink);
  auto r1 = req(MsgType::kInit, 1, 5, 0, 2);
  r1.header.flags = proto::kFlagNoData;
  core->on_init(r1, shape, Payload{}, kT0 + std::chrono::seconds(1), sink);
  EXPECT_TRUE(sink.take().empty());
  ASSERT_TRUE(core->next_deadline());
  EXPECT_EQ(*core->next_deadline(), kT0 + std::chrono::seconds(5));
  core->on_worker_back(0, kT0 + std::chrono::seconds(2), sink);
  core->on_init(req(MsgType::kInit, 0, 5, 0, 2), shape, Payload::of(std::vector<float>{1, 2}),
                kT0 + std::chrono::seconds(2), sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);  // rank 0, then the waiting rank 1
  EXPECT_FALSE(s[1].is_error) << s[1].error.to_string();
}

TEST_F(ShardCoreTest, FailPolicyAnswersWaitersAtOnce) {
  make(opts(2, proto::Consistency::kBsp, proto::LossPolicy::kFail));
  init(1, {0});
  push(0, 1, 0, {1});
  pull(0, 1, 1, 1);
  sink.take();
  core->on_worker_lost(1, kT0, sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kWorkerLost);
  // A new pull that would wait for the failed rank fails at once too.
  pull(0, 1, 1, 1);
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kWorkerLost);
  // Rejoin: rank 1 comes back, pulls (resume step 0), pushes step 0.
  core->on_worker_back(1, kT0, sink);
  pull(1, 1, 0, 1);
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].header.step, 0u);
  push(1, 1, 0, {3});
  EXPECT_EQ(core->stats().rounds_completed, 1u);
}

// The kWorkerLost reply names the request's step (the step pushed), not the
// version its reply waits for (one more): the worker's own messages and the
// server's metrics use that step.
TEST_F(ShardCoreTest, WorkerLostNamesTheStepOfThePushPull) {
  make(opts(2, proto::Consistency::kBsp, proto::LossPolicy::kFail));
  init(1, {0});
  core->on_push_pull(req(MsgType::kPushPull, 0, 1, 0, 1), Payload::of(std::vector<float>{2}), kT0,
                     sink);
  sink.take();
  core->on_worker_lost(1, kT0, sink);  // the parked push_pull fails
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kWorkerLost);
  EXPECT_THAT(s[0].error.message(), ::testing::HasSubstr("push_pull of step 0 for key 1"));
  // One that arrives after the loss (a re-send) fails at once, with its step too.
  core->on_push_pull(req(MsgType::kPushPull, 0, 1, 0, 1), Payload::of(std::vector<float>{2}), kT0,
                     sink);
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kWorkerLost);
  EXPECT_THAT(s[0].error.message(), ::testing::HasSubstr("push_pull of step 0 for key 1"));
}

// A gradient adopted from a transport buffer (over shm: the worker's own
// pool block, given back at its release) whose round waits for a lost rank
// is copied and its buffer released, so the pusher's push can complete (with
// the error, or at request_timeout); the round still completes with it when
// the rank comes back.
struct ReleaseFlag {
  std::shared_ptr<bool> released = std::make_shared<bool>(false);
  std::vector<float> values;
  ReleaseFlag() = default;
  ReleaseFlag(ReleaseFlag&& o) noexcept = default;
  ~ReleaseFlag() {
    if (released) *released = true;
  }
};

Payload lent_gradient(std::vector<float> values, std::shared_ptr<bool>& released) {
  ReleaseFlag owner;
  owner.values = std::move(values);
  released = owner.released;
  const auto bytes = std::as_writable_bytes(std::span<float>(owner.values));
  const std::size_t n = owner.values.size();
  return Payload::adopt(transport::Buffer::adopt(bytes, transport::MemoryLocation{}, std::move(owner)),
                        0, n);
}

TEST_F(ShardCoreTest, FailedRankReleasesTheHeldGradientsOfItsRoundAndKeepsThem) {
  make(opts(3, proto::Consistency::kBsp, proto::LossPolicy::kFail));
  init(1, {0, 0});
  std::shared_ptr<bool> released0, released2;
  core->on_push_pull(req(MsgType::kPushPull, 0, 1, 0, 2), lent_gradient({1, 2}, released0), kT0,
                     sink);
  EXPECT_TRUE(sink.take().empty());
  EXPECT_FALSE(*released0) << "held for the round while every rank is present";
  core->on_worker_lost(1, kT0, sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kWorkerLost);
  EXPECT_TRUE(*released0) << "the round waits for failed rank 1: rank 0's buffer must go back";
  // A push into the blocked round after the failure is released at once too.
  core->on_push(req(MsgType::kPush, 2, 1, 0, 2), lent_gradient({3, 4}, released2), kT0, sink);
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_FALSE(s[0].is_error) << s[0].error.to_string();  // accepted: the push's reply
  EXPECT_TRUE(*released2);
  // Rank 1 comes back and pushes: the round completes with all three
  // gradients, none lost: 0 - (1 + 3 + 5) / 3, 0 - (2 + 4 + 6) / 3.
  core->on_worker_back(1, kT0, sink);
  push(1, 1, 0, {5, 6});
  sink.take();
  EXPECT_EQ(core->stats().rounds_completed, 1u);
  EXPECT_EQ(params(1, 2), (std::vector<float>{-3, -4}));
}

TEST_F(ShardCoreTest, LostRankUnderWaitReleasesHeldGradientsAndShrinkNeedsNot) {
  make(opts(2));  // policy wait
  init(1, {0});
  std::shared_ptr<bool> released;
  core->on_push_pull(req(MsgType::kPushPull, 0, 1, 0, 1), lent_gradient({1}, released), kT0, sink);
  core->on_worker_lost(1, kT0, sink);
  EXPECT_TRUE(sink.take().empty()) << "policy wait: the push_pull waits for rank 1";
  EXPECT_TRUE(*released);
  core->on_worker_back(1, kT0 + std::chrono::seconds(1), sink);
  push(1, 1, 0, {3});
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);  // the push's reply, then the push_pull's parameters
  EXPECT_EQ(s[1].values, std::vector<float>{-2});

  // shrink: the round completes without the lost rank and folds the buffer.
  make(opts(3, proto::Consistency::kBsp, proto::LossPolicy::kShrink));
  init(1, {0});
  core->on_push_pull(req(MsgType::kPushPull, 0, 1, 0, 1), lent_gradient({1}, released), kT0, sink);
  push(2, 1, 0, {3});
  sink.take();
  EXPECT_FALSE(*released);
  core->on_worker_lost(1, kT0, sink);
  EXPECT_TRUE(*released);
  EXPECT_EQ(core->stats().rounds_completed, 1u);
}

// any_missing: ranks waited for or failed, not excluded ones; counted
// through lost, tick (waiting -> failed) and back.
TEST(Membership, AnyMissingCountsWaitingAndFailedRanks) {
  using std::chrono::seconds;
  Membership wait(3, proto::LossPolicy::kWait, seconds(5));
  EXPECT_FALSE(wait.any_missing());
  EXPECT_TRUE(wait.lost(1, kT0));
  EXPECT_FALSE(wait.lost(1, kT0));  // no change, no double count
  EXPECT_TRUE(wait.lost(2, kT0));
  EXPECT_TRUE(wait.any_missing());
  EXPECT_TRUE(wait.tick(kT0 + seconds(10)));  // both fail
  EXPECT_TRUE(wait.back(1));
  EXPECT_TRUE(wait.any_missing());
  EXPECT_TRUE(wait.back(2));
  EXPECT_FALSE(wait.any_missing());
  Membership shrink(2, proto::LossPolicy::kShrink, seconds(5));
  EXPECT_TRUE(shrink.lost(0, kT0));
  EXPECT_FALSE(shrink.any_missing());
  EXPECT_TRUE(shrink.back(0));
  EXPECT_FALSE(shrink.any_missing());
  Membership fail(2, proto::LossPolicy::kFail, seconds(5));
  EXPECT_TRUE(fail.lost(0, kT0));
  EXPECT_TRUE(fail.any_missing());
  EXPECT_TRUE(fail.back(0));
  EXPECT_FALSE(fail.any_missing());
}

// The kWorkerLost text says how the rank left: "lost" after an error, "closed
// its connection" after an orderly close; the latest loss decides.
TEST(Membership, FailureErrorNamesHowTheRankLeft) {
  using std::chrono::seconds;
  Membership wait(2, proto::LossPolicy::kWait, seconds(5));
  ASSERT_TRUE(wait.lost(1, kT0));
  ASSERT_TRUE(wait.tick(kT0 + seconds(6)));
  Error e = wait.failure_error(1, "push of step 3");
  EXPECT_EQ(e.code(), ErrorCode::kWorkerLost);
  EXPECT_EQ(e.message(), "push of step 3 needs worker 1, lost and not back within worker_timeout "
                         "(5000ms) (on_worker_loss = \"wait\")");
  ASSERT_TRUE(wait.back(1));
  ASSERT_TRUE(wait.lost(1, kT0, Departure::kClosed));
  ASSERT_TRUE(wait.tick(kT0 + seconds(6)));
  e = wait.failure_error(1, "push of step 3");
  EXPECT_EQ(e.message(), "push of step 3 needs worker 1, which closed its connection in order (it "
                         "finished, or dropped the connection to reconnect) and was not back "
                         "within worker_timeout (5000ms) (on_worker_loss = \"wait\")");
  Membership fail(2, proto::LossPolicy::kFail, seconds(5));
  ASSERT_TRUE(fail.lost(0, kT0, Departure::kClosed));
  EXPECT_EQ(fail.failure_error(0, "barrier 2").message(),
            "barrier 2 needs worker 0, which closed its connection in order (it finished, or "
            "dropped the connection to reconnect) (on_worker_loss = \"fail\"); restart it with "
            "the same rank to continue");
  ASSERT_TRUE(fail.back(0));
  ASSERT_TRUE(fail.lost(0, kT0));
  EXPECT_EQ(fail.failure_error(0, "barrier 2").message(),
            "barrier 2 needs worker 0, which was lost (on_worker_loss = \"fail\"); restart it "
            "with the same rank to continue");
}

TEST_F(ShardCoreTest, RankZeroLossFailsWaitingInits) {
  make(opts(2, proto::Consistency::kBsp, proto::LossPolicy::kFail));
  const std::uint64_t shape[] = {1};
  core->on_init(req(MsgType::kInit, 1, 4, 0, 1), shape, Payload{}, kT0, sink);
  core->on_worker_lost(0, kT0, sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].error.code(), ErrorCode::kWorkerLost);
}

TEST_F(ShardCoreTest, DropConnectionForgetsItsWaiters) {
  make(opts(2));
  init(1, {0});
  push(0, 1, 0, {1});
  core->on_pull(req(MsgType::kPull, 0, 1, 1, 1, 555), kT0, sink);  // waits for rank 1
  EXPECT_EQ(core->stats().parked_requests, 1u);
  core->drop_connection(555);
  EXPECT_EQ(core->stats().parked_requests, 0u);
  push(1, 1, 0, {1});
  auto s = sink.take();
  EXPECT_EQ(s.size(), 2u);  // acks only
}

TEST_F(ShardCoreTest, SnapshotRestoreRoundTripsAndCapsOpenRoundClocks) {
  config::OptimizerConfig c;
  c.type = config::OptimizerType::kAdam;
  c.learning_rate = 0.1;
  make(opts(2), *Optimizer::create(c));
  init(1, {1, 2});
  push(0, 1, 0, {1, 1});
  push(1, 1, 0, {1, 1});
  push(0, 1, 1, {1, 1});  // open round 1: rank 0's clock is 2
  auto snap = core->snapshot();
  ASSERT_EQ(snap.size(), 1u);
  EXPECT_EQ(snap[0].version, 1u);
  EXPECT_EQ(snap[0].clocks, (std::vector<std::uint64_t>{1, 1}));
  EXPECT_EQ(snap[0].optimizer.num_updates, 1u);

  ShardCore restored(opts(2), *Optimizer::create(c));
  ASSERT_TRUE(restored.restore(snap[0]));
  EXPECT_EQ(restored.snapshot(), snap);
  EXPECT_FALSE(restored.restore(snap[0]));  // exists
  // After restore, rank 0's re-sent push of step 1 is accepted (not a duplicate).
  restored.on_push(req(MsgType::kPush, 0, 1, 1, 2), Payload::of(std::vector<float>{1, 1}), kT0, sink);
  restored.on_push(req(MsgType::kPush, 1, 1, 1, 2), Payload::of(std::vector<float>{1, 1}), kT0, sink);
  EXPECT_EQ(restored.stats().rounds_completed, 1u);
}

// --- out of step (a rank's step does not follow the server's) ---

void expect_out_of_step(const Sent& x, std::uint64_t asked, std::uint64_t server_step,
                        std::uint32_t rank, std::uint64_t key) {
  ASSERT_TRUE(x.is_error);
  EXPECT_EQ(x.error.code(), ErrorCode::kOutOfStep) << x.error.to_string();
  EXPECT_EQ(x.header.step, server_step) << "the reply carries the server's step";
  const std::string& m = x.error.message();
  EXPECT_NE(m.find(fmt::format("of step {} for key {} chunk 0", asked, key)), std::string::npos)
      << m;
  EXPECT_NE(m.find(fmt::format("from rank {}", rank)), std::string::npos) << m;
  EXPECT_NE(m.find(fmt::format("at step {} for that rank", server_step)), std::string::npos) << m;
  EXPECT_NE(m.find(fmt::format("pull key {} at step {}", key, server_step)), std::string::npos)
      << m;
  EXPECT_NE(m.find("see docs/troubleshooting.md#out-of-step"), std::string::npos) << m;
}

TEST_F(ShardCoreTest, BspPushThatSkipsStepsIsOutOfStepAndRecordsNothing) {
  make(opts(2));
  init(1, {0});
  push(0, 1, 0, {1});
  push(0, 1, 3, {1});  // rank 0 expected at step 1
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_FALSE(s[0].is_error);
  expect_out_of_step(s[1], 3, 1, 0, 1);
  EXPECT_EQ(s[1].header.request_id, req(MsgType::kPush, 0, 1, 3, 1).header.request_id);
  // Nothing of step 3 was kept: the round of step 0 completes, and rank 0
  // continues at step 1 as told.
  push(1, 1, 0, {1});
  push(0, 1, 1, {2});
  push(1, 1, 1, {2});
  s = sink.take();
  ASSERT_EQ(s.size(), 3u);
  for (const auto& x : s) EXPECT_FALSE(x.is_error) << x.error.to_string();
  EXPECT_EQ(core->stats().rounds_completed, 2u);
  EXPECT_EQ(params(1, 1), std::vector<float>{-3});
}

TEST_F(ShardCoreTest, BspGapIsMeasuredFromTheVersionForARankThatWasExcluded) {
  make(opts(2, proto::Consistency::kBsp, proto::LossPolicy::kShrink));
  init(1, {0});
  core->on_worker_lost(1, kT0, sink);
  push(0, 1, 0, {1});
  push(0, 1, 1, {1});  // rounds 0 and 1 complete without rank 1 (clock 0)
  core->on_worker_back(1, kT0, sink);
  sink.take();
  push(1, 1, 2, {1});  // a rejoined worker resumes at the version: accepted
  push(1, 1, 4, {1});  // but not past it
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_FALSE(s[0].is_error) << s[0].error.to_string();
  expect_out_of_step(s[1], 4, 3, 1, 1);
}

// The scenario in the core: a checkpoint at step 2, the workers reach
// step 5, the server restarts from the checkpoint. Without the check the
// pushes of step 5 were held for a round that needs step 2 from everyone.
TEST_F(ShardCoreTest, BspRestoredFromOlderSnapshotRefusesThenResumesAtItsStep) {
  make(opts(2));
  init(1, {1, 2});
  for (std::uint64_t t = 0; t < 2; ++t) {
    for (std::uint32_t r = 0; r < 2; ++r) push(r, 1, t, {1, 1});
  }
  auto snap = core->snapshot();
  ASSERT_EQ(snap[0].version, 2u);
  ShardCore restored(opts(2), sgd());
  ASSERT_TRUE(restored.restore(snap[0]));
  sink.take();
  for (std::uint32_t r = 0; r < 2; ++r) {
    restored.on_push_pull(req(MsgType::kPushPull, r, 1, 5, 2),
                          Payload::of(std::vector<float>{1, 1}), kT0, sink);
  }
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u) << "refused at once, nothing parked";
  expect_out_of_step(s[0], 5, 2, 0, 1);
  expect_out_of_step(s[1], 5, 2, 1, 1);
  EXPECT_EQ(restored.stats().parked_requests, 0u);
  // A pull of step 5 would wait on the rank itself: refused too.
  restored.on_pull(req(MsgType::kPull, 0, 1, 5, 2), kT0, sink);
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  expect_out_of_step(s[0], 5, 2, 0, 1);
  // Pull at the server's step is answered at once; push_pull from there completes.
  restored.on_pull(req(MsgType::kPull, 0, 1, 2, 2), kT0, sink);
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_FALSE(s[0].is_error);
  EXPECT_EQ(s[0].values, (std::vector<float>{-1, 0}));
  for (std::uint32_t r = 0; r < 2; ++r) {
    restored.on_push_pull(req(MsgType::kPushPull, r, 1, 2, 2),
                          Payload::of(std::vector<float>{1, 1}), kT0, sink);
  }
  s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  for (const auto& x : s) {
    EXPECT_FALSE(x.is_error) << x.error.to_string();
    EXPECT_EQ(x.header.step, 3u);
    EXPECT_EQ(x.values, (std::vector<float>{-2, -1}));
  }
}

TEST_F(ShardCoreTest, BspPullOfTheNextStepAfterItsOwnPushStillWaits) {
  make(opts(2));
  init(1, {0});
  push(0, 1, 0, {1});
  pull(0, 1, 1, 1);  // needs rank 1's push of 0 only: parks
  pull(1, 1, 1, 1);  // rank 1 has not pushed step 0, which it must send first: refused
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_FALSE(s[0].is_error);
  expect_out_of_step(s[1], 1, 0, 1, 1);
  EXPECT_EQ(core->stats().parked_requests, 1u);
  push(1, 1, 0, {3});
  s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[1].values, std::vector<float>{-2});
}

TEST_F(ShardCoreTest, BspPullOfAnExcludedRankIsNotRefused) {
  make(opts(2, proto::Consistency::kBsp, proto::LossPolicy::kShrink));
  init(1, {0});
  core->on_worker_lost(1, kT0, sink);
  pull(1, 1, 1, 1);  // rank 1 is excluded: rank 0's push alone serves it
  EXPECT_TRUE(sink.take().empty());
  push(0, 1, 0, {1});
  auto s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_FALSE(s[1].is_error);
}

TEST_F(ShardCoreTest, AspGapIsAcceptedAndMovesTheClock) {
  make(opts(2, proto::Consistency::kAsp));
  init(1, {0});
  push(0, 1, 0, {1});
  push(0, 1, 7, {1});  // skipped steps 1..6: applied, clock 8
  pull(0, 1, 8, 1);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 3u);
  for (const auto& x : s) EXPECT_FALSE(x.is_error) << x.error.to_string();
  EXPECT_EQ(s[2].header.step, 8u);
  EXPECT_EQ(s[2].values, std::vector<float>{-2});
  push(0, 1, 5, {1});  // below the clock now: a duplicate
  EXPECT_EQ(core->stats().pushes_duplicate, 1u);
}

TEST_F(ShardCoreTest, AspPushOfAStepAtTheLimitIsRefusedAndTheClockStays) {
  make(opts(2, proto::Consistency::kAsp));
  init(1, {0});
  push(0, 1, 0, {1});
  push(0, 1, 1, {1});
  sink.take();
  // 2^64 - 1 wrapped the clock to 0; 2^53 is the first step refused.
  for (const std::uint64_t bad : {std::numeric_limits<std::uint64_t>::max(), proto::kLargestStep}) {
    push(0, 1, bad, {1});
    auto s = sink.take();
    ASSERT_EQ(s.size(), 1u);
    ASSERT_TRUE(s[0].is_error);
    EXPECT_EQ(s[0].error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(s[0].error.message().find("step counter is corrupt"), std::string::npos)
        << s[0].error.message();
  }
  push(0, 1, 1, {1});  // a re-send: still a duplicate, not applied again
  sink.take();
  EXPECT_EQ(core->stats().pushes_duplicate, 1u);
  EXPECT_EQ(core->stats().pushes_applied, 2u);
  EXPECT_EQ(params(1, 1), std::vector<float>{-2});
  push(0, 1, proto::kLargestStep - 1, {1});  // the last step taken: a gap, applied
  EXPECT_EQ(core->stats().pushes_applied, 3u);
}

TEST_F(ShardCoreTest, OnlyRecordedPushesAreReportedToTheSink) {
  make(opts(2));
  init(1, {0});
  push(0, 1, 0, {1});    // recorded
  push(0, 1, 0, {1});    // a re-send: acknowledged, not recorded again
  push(1, 1, 40, {1});   // out of step: refused
  core->on_push_pull(req(MsgType::kPushPull, 1, 1, 0, 1), Payload::of(std::vector<float>{1}), kT0,
                     sink);  // recorded
  using Rec = std::pair<std::uint32_t, std::uint64_t>;
  EXPECT_EQ(sink.recorded, (std::vector<Rec>{{0, 0}, {1, 0}}));
}

TEST_F(ShardCoreTest, SspGapIsAcceptedButAPullWaitingOnItselfIsOutOfStep) {
  auto o = opts(2, proto::Consistency::kSsp);
  o.staleness = 1;
  make(o);
  init(1, {0});
  // Rank 0's clock is 0: a pull of step 3 needs its own clock >= 2.
  pull(0, 1, 3, 1);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  expect_out_of_step(s[0], 3, 0, 0, 1);
  // A push with a gap is applied and moves the clock to 3.
  push(0, 1, 2, {1});
  pull(0, 1, 3, 1);  // now waits for rank 1 (clock 0 + 1 < 3), not on itself
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_FALSE(s[0].is_error);
  EXPECT_EQ(core->stats().parked_requests, 1u);
  // A push_pull of the gap step from rank 1 serves both: no hang.
  core->on_push_pull(req(MsgType::kPushPull, 1, 1, 2, 1), Payload::of(std::vector<float>{1}), kT0,
                     sink);
  s = sink.take();
  ASSERT_EQ(s.size(), 2u);
  for (const auto& x : s) {
    EXPECT_FALSE(x.is_error) << x.error.to_string();
    EXPECT_EQ(x.values, std::vector<float>{-2});
  }
}

TEST_F(ShardCoreTest, RestoreRefusesStateOfAnotherOptimizer) {
  make(opts(1));
  init(1, {1, 2});
  auto snap = core->snapshot();
  config::OptimizerConfig c;
  c.type = config::OptimizerType::kAdam;
  ShardCore other(opts(1), *Optimizer::create(c));
  auto st = other.restore(snap[0]);
  ASSERT_FALSE(st);
  EXPECT_EQ(st.error().code(), ErrorCode::kCorrupt);
}

// --- barrier ---

TEST_F(ShardCoreTest, ShrinkAfterTheOtherRanksWereFoldedStillAverages) {
  make(opts(3, proto::Consistency::kBsp, proto::LossPolicy::kShrink));
  init(1, {0});
  push(0, 1, 0, {3});
  push(1, 1, 0, {5});  // ranks 0 and 1 are folded; the round waits for rank 2
  pull(0, 1, 1, 1);
  sink.take();
  core->on_worker_lost(2, kT0, sink);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].values, std::vector<float>{-4});  // (3 + 5) / 2
}

CoreOptions lending(std::uint32_t workers) {
  CoreOptions o = opts(workers);
  o.lend_params = true;
  return o;
}

// lend_params: a reply still in flight (its lease held) when the next round
// completes keeps reading the old parameters; the round updates a copy.
TEST_F(ShardCoreTest, LentReplyKeepsItsValuesWhileTheNextRoundUpdatesACopy) {
  make(lending(2));
  const std::size_t n = 1 << 20;  // large enough for its own mapping
  init(1, std::vector<float>(n, 1.0f));
  push(0, 1, 0, std::vector<float>(n, 1.0f));
  push(1, 1, 0, std::vector<float>(n, 3.0f));
  pull(0, 1, 1, n);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 3u);
  const Sent in_flight = s[2];
  ASSERT_TRUE(in_flight.lease);
  ASSERT_EQ(in_flight.lent.size(), n);
  EXPECT_EQ(in_flight.lent[0], -1.0f);  // 1 - (1 + 3) / 2

  push(0, 1, 1, std::vector<float>(n, 2.0f));
  push(1, 1, 1, std::vector<float>(n, 2.0f));
  sink.take();
  EXPECT_EQ(core->stats().lent_copies, 1u);
  EXPECT_EQ(core->stats().rounds_completed, 2u);
  // The lent bytes are still step 1's, everywhere.
  EXPECT_EQ(std::count(in_flight.lent.begin(), in_flight.lent.end(), -1.0f),
            static_cast<std::ptrdiff_t>(n));
  pull(0, 1, 2, n);
  s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].values[0], -3.0f);  // -1 - 2
  EXPECT_EQ(s[0].values[n - 1], -3.0f);
  EXPECT_NE(s[0].lent.data(), in_flight.lent.data());
}

TEST_F(ShardCoreTest, LentReplyReturnedBeforeTheNextRoundCostsNoCopy) {
  make(lending(2));
  init(1, {1, 1});
  for (std::uint64_t t = 0; t < 3; ++t) {
    push(0, 1, t, {1, 1});
    push(1, 1, t, {1, 1});
    pull(0, 1, t + 1, 2);
    auto s = sink.take();  // the leases go with `s`
    ASSERT_EQ(s.size(), 3u);
    EXPECT_TRUE(s[2].lease);
    EXPECT_EQ(s[2].values, (std::vector<float>{-static_cast<float>(t), -static_cast<float>(t)}));
  }
  EXPECT_EQ(core->stats().replies_lent, 3u);
  EXPECT_EQ(core->stats().lent_copies, 0u);
}

TEST_F(ShardCoreTest, LentValuesOutliveTheCore) {
  make(lending(1));
  const std::size_t n = 1 << 20;
  init(1, std::vector<float>(n, 7.0f));
  pull(0, 1, 0, n);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  core.reset();  // e.g. a server shutting down with the send still queued
  EXPECT_EQ(std::count(s[0].lent.begin(), s[0].lent.end(), 7.0f), static_cast<std::ptrdiff_t>(n));
}

TEST_F(ShardCoreTest, WithoutLendParamsRepliesAreCopies) {
  make(opts(1));
  init(1, {1, 2});
  pull(0, 1, 0, 2);
  auto s = sink.take();
  ASSERT_EQ(s.size(), 1u);
  EXPECT_FALSE(s[0].lease);
  EXPECT_EQ(core->stats().replies_lent, 0u);
}

TEST(BarrierCore, ReleasesEveryoneWhenAllArrive) {
  BarrierCore b(3, proto::LossPolicy::kWait, std::chrono::seconds(1));
  RecordingSink sink;
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 0, 0), kT0, sink);
  b.on_barrier(req(MsgType::kBarrier, 2, 0, 0, 0), kT0, sink);
  b.on_barrier(req(MsgType::kBarrier, 2, 0, 0, 0), kT0, sink);  // re-send replaces
  EXPECT_TRUE(sink.sent.empty());
  EXPECT_EQ(b.num_waiting(), 2u);
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 0, 0), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 3u);
  for (auto& s : sink.sent) EXPECT_EQ(s.header.step, 0u);
  EXPECT_EQ(b.generation(), 1u);
}

// A barrier number at or above proto::kLargestStep is refused and leaves no
// trace: the rank's next join still gives 0, and its barriers still work
// (helper-82: 2^60 was kept as the newest answered number, and every later
// join was refused by the worker; 2^64 - 1 wrapped the next number to 0).
TEST(BarrierCore, ANumberBeyondAnyRunIsRefusedAndForgotten) {
  for (const std::uint64_t bad : {proto::kLargestStep, std::uint64_t{1} << 60, ~std::uint64_t{0}}) {
    BarrierCore b(1, proto::LossPolicy::kWait, std::chrono::seconds(1));
    RecordingSink sink;
    EXPECT_EQ(b.on_join(0, 100, sink), 0u);
    b.on_barrier(req(MsgType::kBarrier, 0, 0, bad, 0, 100), kT0, sink);
    ASSERT_EQ(sink.sent.size(), 1u);
    ASSERT_TRUE(sink.sent[0].is_error);
    EXPECT_EQ(sink.sent[0].error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(sink.sent[0].error.message().find("barrier numbers stay below"), std::string::npos)
        << sink.sent[0].error.message();
    EXPECT_EQ(b.num_waiting(), 0u);
    EXPECT_EQ(b.on_join(0, 101, sink), 0u) << bad;
    sink.sent.clear();
    b.on_barrier(req(MsgType::kBarrier, 0, 0, 0, 0, 101), kT0, sink);
    ASSERT_EQ(sink.sent.size(), 1u);
    EXPECT_FALSE(sink.sent[0].is_error);
    EXPECT_EQ(b.generation(), 1u);
  }
}

// A barrier answered on a connection that then closed is re-sent by the
// worker with the same number: answered again with its generation, not
// counted in the next one (which would release the others one barrier early
// and leave this rank's next barrier alone). The join of the new connection
// gives one past the rank's last answered number.
TEST(BarrierCore, AReSentAnsweredBarrierIsAnsweredAgainNotCountedInTheNext) {
  BarrierCore b(2, proto::LossPolicy::kWait, std::chrono::seconds(1));
  RecordingSink sink;
  EXPECT_EQ(b.on_join(0, 100, sink), 0u);
  EXPECT_EQ(b.on_join(1, 101, sink), 0u);
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 0, 0), kT0, sink);
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 0, 0), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 2u);
  sink.sent.clear();
  // Rank 1's answer was lost: it joins on a new connection and re-sends
  // (number 0) there.
  EXPECT_EQ(b.on_join(1, 555, sink), 1u);
  EXPECT_TRUE(sink.sent.empty());
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 0, 0, 555), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 1u);
  EXPECT_EQ(sink.sent[0].to.connection_id, 555u);
  EXPECT_EQ(sink.sent[0].header.step, 0u);  // generation 0, again
  EXPECT_EQ(b.num_waiting(), 0u);
  sink.sent.clear();
  // Rank 0's next barrier waits for rank 1's next one.
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 1, 0), kT0, sink);
  EXPECT_TRUE(sink.sent.empty());
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 1, 0, 555), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 2u);
  for (auto& s : sink.sent) EXPECT_EQ(s.header.step, 1u);
  EXPECT_EQ(b.generation(), 2u);
  EXPECT_EQ(b.on_join(1, 556, sink), 2u);
}

// A restarted worker joins while its predecessor's barrier still waits on
// the old connection (not yet seen closed). The join cancels that barrier
// and refuses the old connection's later ones, so the number the join gives
// (the predecessor's waiting one) is the new process's to complete: the
// predecessor's copy can no longer complete it first, which would answer the
// new process's first barrier from history, one barrier behind the others.
TEST(BarrierCore, AJoinSupersedesTheRanksOlderConnections) {
  BarrierCore b(2, proto::LossPolicy::kWait, std::chrono::seconds(1));
  RecordingSink sink;
  EXPECT_EQ(b.on_join(1, 101, sink), 0u);
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 0, 0, 101), kT0, sink);  // the predecessor's
  EXPECT_EQ(b.num_waiting(), 1u);
  EXPECT_EQ(b.on_join(1, 201, sink), 0u);  // the restarted process
  ASSERT_EQ(sink.sent.size(), 1u);
  EXPECT_EQ(sink.sent[0].to.connection_id, 101u);
  EXPECT_TRUE(sink.sent[0].is_error);
  EXPECT_EQ(sink.sent[0].error.code(), ErrorCode::kCancelled);
  EXPECT_EQ(b.num_waiting(), 0u);
  sink.sent.clear();
  // A copy still buffered on the old connection arrives late: refused, not
  // counted.
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 0, 0, 101), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 1u);
  EXPECT_TRUE(sink.sent[0].is_error);
  EXPECT_EQ(sink.sent[0].error.code(), ErrorCode::kCancelled);
  sink.sent.clear();
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 0, 0), kT0, sink);
  EXPECT_TRUE(sink.sent.empty());  // rank 1's new process has not arrived
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 0, 0, 201), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 2u);
  for (auto& s : sink.sent) {
    EXPECT_FALSE(s.is_error);
    EXPECT_EQ(s.header.step, 0u);
  }
  EXPECT_NE(sink.sent[0].to.connection_id, 101u);
  EXPECT_NE(sink.sent[1].to.connection_id, 101u);
  // An older join arriving late (another I/O thread) does not move the
  // rank back to its older connection.
  EXPECT_EQ(b.on_join(1, 150, sink), 1u);
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 1, 0, 150), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 3u);
  EXPECT_TRUE(sink.sent[2].is_error);
  EXPECT_EQ(sink.sent[2].error.code(), ErrorCode::kCancelled);
}

// barrier() called twice before the first finished: the second waits for
// the next generation (it replaced the first before, whose caller then
// timed out while the job fell out of step).
TEST(BarrierCore, ABarrierSentAheadWaitsForTheNextGeneration) {
  BarrierCore b(2, proto::LossPolicy::kWait, std::chrono::seconds(1));
  RecordingSink sink;
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 0, 0), kT0, sink);
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 1, 0), kT0, sink);
  EXPECT_TRUE(sink.sent.empty());
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 0, 0), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 2u);  // generation 0: rank 0's first, rank 1's
  for (auto& s : sink.sent) {
    EXPECT_EQ(s.header.step, 0u);
    EXPECT_EQ(s.header.request_id % 1000, s.header.worker_rank);  // step 0's requests
  }
  EXPECT_EQ(b.num_waiting(), 1u);  // rank 0's second, in generation 1
  sink.sent.clear();
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 1, 0), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 2u);
  for (auto& s : sink.sent) EXPECT_EQ(s.header.step, 1u);
  EXPECT_EQ(b.generation(), 2u);
}

// Two answered barriers re-sent (both answers lost with one connection):
// each is answered with its own generation from the history, neither is
// counted in the open generation, and a number older than the history kept
// is refused by name.
TEST(BarrierCore, EveryReSentAnsweredBarrierIsAnsweredFromItsHistory) {
  BarrierCore b(2, proto::LossPolicy::kWait, std::chrono::seconds(1));
  RecordingSink sink;
  for (std::uint64_t n = 0; n < 20; ++n) {
    b.on_barrier(req(MsgType::kBarrier, 0, 0, n, 0), kT0, sink);
    b.on_barrier(req(MsgType::kBarrier, 1, 0, n, 0), kT0, sink);
  }
  ASSERT_EQ(sink.sent.size(), 40u);
  EXPECT_EQ(b.generation(), 20u);
  sink.sent.clear();
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 18, 0, 7), kT0, sink);
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 19, 0, 7), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 2u);
  EXPECT_EQ(sink.sent[0].header.step, 18u);
  EXPECT_EQ(sink.sent[1].header.step, 19u);
  EXPECT_EQ(b.num_waiting(), 0u);
  EXPECT_EQ(b.generation(), 20u);
  sink.sent.clear();
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 0, 0, 7), kT0, sink);  // older than kept
  ASSERT_EQ(sink.sent.size(), 1u);
  ASSERT_TRUE(sink.sent[0].is_error);
  EXPECT_EQ(sink.sent[0].error.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(sink.sent[0].error.message().find("barrier number 0 of worker 1"), std::string::npos)
      << sink.sent[0].error.message();
}

// A re-send of a waiting barrier replaces that one only: a lower number
// re-sent does not take the place of a newer one waiting behind it, and the
// generations still pair each rank's barriers in number order.
TEST(BarrierCore, AReSentWaitingBarrierReplacesOnlyItsOwnNumber) {
  BarrierCore b(2, proto::LossPolicy::kWait, std::chrono::seconds(1));
  RecordingSink sink;
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 0, 0), kT0, sink);
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 1, 0), kT0, sink);
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 0, 0, 200), kT0, sink);  // re-send of number 0
  EXPECT_TRUE(sink.sent.empty());
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 0, 0), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 2u);
  for (auto& s : sink.sent) EXPECT_EQ(s.header.step, 0u);
  const auto to_rank0 = std::find_if(sink.sent.begin(), sink.sent.end(),
                                     [](const auto& s) { return s.header.worker_rank == 0; });
  ASSERT_NE(to_rank0, sink.sent.end());
  EXPECT_EQ(to_rank0->to.connection_id, 200u);  // the re-send's (newer) connection
  sink.sent.clear();
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 1, 0), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 2u);  // rank 0's number 1 was still waiting
  for (auto& s : sink.sent) EXPECT_EQ(s.header.step, 1u);
}

// The original of a re-sent barrier, still buffered on its dead connection,
// can be handled after the re-send (another I/O thread): it does not take
// the re-send's place, so dropping the dead connection leaves the re-send.
TEST(BarrierCore, ALateOriginalDoesNotReplaceItsReSentCopy) {
  BarrierCore b(2, proto::LossPolicy::kWait, std::chrono::seconds(1));
  RecordingSink sink;
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 0, 0, 9), kT0, sink);  // the re-send
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 0, 0, 1), kT0, sink);  // the original, late
  b.drop_connection(1);
  EXPECT_EQ(b.num_waiting(), 1u);
  b.on_barrier(req(MsgType::kBarrier, 1, 0, 0, 0), kT0, sink);
  ASSERT_EQ(sink.sent.size(), 2u);
  const auto to_rank0 = std::find_if(sink.sent.begin(), sink.sent.end(),
                                     [](const auto& s) { return s.header.worker_rank == 0; });
  ASSERT_NE(to_rank0, sink.sent.end());
  EXPECT_EQ(to_rank0->to.connection_id, 9u);
}

TEST(BarrierCore, ShrinkReleasesWithoutLostRank) {
  BarrierCore b(2, proto::LossPolicy::kShrink, std::chrono::seconds(1));
  RecordingSink sink;
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 0, 0), kT0, sink);
  b.on_worker_lost(1, kT0, sink);
  ASSERT_EQ(sink.sent.size(), 1u);
  EXPECT_FALSE(sink.sent[0].is_error);
}

TEST(BarrierCore, WaitTimesOutWithWorkerLost) {
  BarrierCore b(2, proto::LossPolicy::kWait, std::chrono::seconds(1));
  RecordingSink sink;
  b.on_barrier(req(MsgType::kBarrier, 0, 0, 0, 0), kT0, sink);
  b.on_worker_lost(1, kT0, sink);
  EXPECT_TRUE(sink.sent.empty());
  b.on_tick(kT0 + std::chrono::seconds(1), sink);
  ASSERT_EQ(sink.sent.size(), 1u);
  EXPECT_EQ(sink.sent[0].error.code(), ErrorCode::kWorkerLost);
}

}  // namespace
}  // namespace ember::server
