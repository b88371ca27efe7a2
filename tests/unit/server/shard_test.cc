// Shard thread: items flow through the ring, and past a full lane through
// the overflow list, without losing the producer's order.
#include "server/shard.h"
#include "server/server.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

namespace ember::server {
namespace {

using namespace std::chrono_literals;

class CollectingSink : public ReplySink {
 public:
  void reply(const ReplyTo&, const proto::Header& h, std::span<const float>) override {
    std::lock_guard lock(mutex);
    steps.push_back(h.type == proto::MsgType::kInit ? ~std::uint64_t{0} : h.step);
    cv.notify_all();
  }
  using ReplySink::error;
  void error(const ReplyTo&, const proto::Header& h, const Error& e, std::uint64_t) override {
    std::lock_guard lock(mutex);
    errors.push_back(fmt::format("{}: {}", proto::describe(h), e.to_string()));
    cv.notify_all();
  }
  bool wait_for_count(std::size_t n) {
    std::unique_lock lock(mutex);
    return cv.wait_for(lock, 10s, [&] { return steps.size() + errors.size() >= n; });
  }
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<std::uint64_t> steps;
  std::vector<std::string> errors;
};

ShardItem request(proto::MsgType type, std::uint64_t step, std::vector<float> data) {
  ShardItem item;
  item.request.header.type = type;
  item.request.header.dtype = proto::DType::kFloat32;
  item.request.header.key = 5;
  item.request.header.step = step;
  item.request.header.num_elements = data.size();
  if (type == proto::MsgType::kInit) {
    item.request.header.ndim = 1;
    item.dims[0] = data.size();
  }
  item.payload = Payload::of(data);
  return item;
}

TEST(Shard, KeepsProducerOrderThroughTheOverflowList) {
  CollectingSink sink;
  ShardOptions o;
  o.core.consistency = proto::Consistency::kAsp;
  o.ring_slots = 2;  // the lane fills at once: most items overflow
  config::OptimizerConfig oc;
  auto shard = Shard::create(o, *Optimizer::create(oc), ShardHooks{&sink, {}, {}, {}, {}});
  ASSERT_TRUE(shard) << shard.error().to_string();
  const int pushes = 200;
  (*shard)->post(request(proto::MsgType::kInit, 0, {1, 2}));  // before start: queued
  for (int t = 0; t < pushes; ++t) (*shard)->post(request(proto::MsgType::kPush, t, {0, 0}));
  (*shard)->start();
  ASSERT_TRUE(sink.wait_for_count(pushes + 1));
  // More while it runs, from this thread: still in order.
  for (int t = pushes; t < 2 * pushes; ++t) (*shard)->post(request(proto::MsgType::kPush, t, {0, 0}));
  ASSERT_TRUE(sink.wait_for_count(2 * pushes + 1));
  (*shard)->stop();
  (*shard)->join();
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
  ASSERT_EQ(sink.steps.size(), 2u * pushes + 1);
  EXPECT_EQ(sink.steps[0], ~std::uint64_t{0});  // the init came first
  for (int t = 0; t < 2 * pushes; ++t) ASSERT_EQ(sink.steps[t + 1], static_cast<std::uint64_t>(t));
  EXPECT_EQ((*shard)->core().stats().pushes_applied, 2u * pushes);
}

TEST(Shard, StopHandlesEverythingQueuedFirst) {
  CollectingSink sink;
  ShardOptions o;
  o.core.consistency = proto::Consistency::kAsp;
  o.ring_slots = 4;
  config::OptimizerConfig oc;
  auto shard = Shard::create(o, *Optimizer::create(oc), ShardHooks{&sink, {}, {}, {}, {}});
  ASSERT_TRUE(shard);
  (*shard)->post(request(proto::MsgType::kInit, 0, {1}));
  for (int t = 0; t < 50; ++t) (*shard)->post(request(proto::MsgType::kPush, t, {1}));
  (*shard)->start();
  (*shard)->stop();
  (*shard)->join();
  EXPECT_EQ(sink.steps.size(), 51u);
  EXPECT_EQ((*shard)->core().stats().pushes_applied, 50u);
}

// A rank's loss and its return are posted from two I/O threads (on_closed,
// rejoin), on two lanes with no order between them. Taken in the other
// order, the return then the loss, the rank stayed lost while connected: under
// "fail", the others' rounds failed. The server numbers the events; an
// older one is skipped.
TEST(Shard, AnOlderLossDeliveredAfterTheReturnIsSkipped) {
  CollectingSink sink;
  ShardOptions o;
  o.core.num_workers = 2;
  o.core.consistency = proto::Consistency::kBsp;
  o.core.loss_policy = proto::LossPolicy::kFail;
  config::OptimizerConfig oc;
  auto shard = Shard::create(o, *Optimizer::create(oc), ShardHooks{&sink, {}, {}, {}, {}});
  ASSERT_TRUE(shard) << shard.error().to_string();
  auto event = [](ShardItem::Kind kind, std::uint64_t seq) {
    ShardItem item;
    item.kind = kind;
    item.rank = 1;
    item.membership_seq = seq;
    return item;
  };
  (*shard)->post(event(ShardItem::Kind::kWorkerBack, 2));  // delivered first
  (*shard)->post(event(ShardItem::Kind::kWorkerLost, 1));
  auto from = [](std::uint32_t rank, ShardItem item) {
    item.request.header.worker_rank = rank;
    item.request.to.connection_id = rank + 1;
    return item;
  };
  (*shard)->post(from(0, request(proto::MsgType::kInit, 0, {1, 2})));
  (*shard)->post(from(0, request(proto::MsgType::kPush, 0, {1, 1})));
  ShardItem pull = from(0, request(proto::MsgType::kPull, 1, {}));
  pull.request.header.num_elements = 2;
  (*shard)->post(std::move(pull));  // waits for rank 1's push
  (*shard)->post(from(1, request(proto::MsgType::kPush, 0, {1, 1})));
  (*shard)->start();
  ASSERT_TRUE(sink.wait_for_count(4));
  (*shard)->stop();
  (*shard)->join();
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
  EXPECT_EQ(sink.steps.size(), 4u);
}

// try_handle_inline, retried while the shard thread still holds its lock
// after its last reply (a moment); false only after 10 s.
bool handle_inline_once_free(Shard& shard, ShardItem& item) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!shard.try_handle_inline(item)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// try_handle_inline handles an item on the calling thread only when nothing
// is queued; otherwise it leaves the item untouched for post().
TEST(Shard, HandlesInlineOnlyWhenNothingIsQueued) {
  CollectingSink sink;
  ShardOptions o;
  o.core.consistency = proto::Consistency::kAsp;
  config::OptimizerConfig oc;
  auto shard = Shard::create(o, *Optimizer::create(oc), ShardHooks{&sink, {}, {}, {}, {}});
  ASSERT_TRUE(shard);
  (*shard)->post(request(proto::MsgType::kInit, 0, {1, 2}));  // queued: the thread is not started
  ShardItem push = request(proto::MsgType::kPush, 0, {0.5f, 0.5f});
  EXPECT_FALSE((*shard)->try_handle_inline(push));
  EXPECT_EQ(push.payload.size(), 2u);  // untouched
  EXPECT_TRUE(sink.steps.empty());
  (*shard)->start();
  ASSERT_TRUE(sink.wait_for_count(1));
  // Idle now: handled here, before the call returns.
  ASSERT_TRUE(handle_inline_once_free(**shard, push));
  {
    std::lock_guard lock(sink.mutex);
    ASSERT_EQ(sink.steps.size(), 2u);
    EXPECT_EQ(sink.steps[1], 0u);
  }
  (*shard)->stop();
  (*shard)->join();
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
  EXPECT_EQ((*shard)->core().stats().pushes_applied, 1u);
}

// While the shard thread handles an item, try_handle_inline does not wait
// for it: it refuses at once.
TEST(Shard, RefusesInlineWhileTheShardThreadHandles) {
  CollectingSink sink;
  std::mutex gate_mutex;
  std::condition_variable gate_cv;
  bool inside = false, release = false;
  ShardHooks hooks{&sink, {}, {}, {}, {}};
  hooks.on_handled = [&](proto::MsgType type, std::chrono::nanoseconds) {
    if (type != proto::MsgType::kInit) return;
    std::unique_lock lock(gate_mutex);
    inside = true;
    gate_cv.notify_all();
    gate_cv.wait(lock, [&] { return release; });
  };
  ShardOptions o;
  o.core.consistency = proto::Consistency::kAsp;
  config::OptimizerConfig oc;
  auto shard = Shard::create(o, *Optimizer::create(oc), std::move(hooks));
  ASSERT_TRUE(shard);
  (*shard)->start();
  (*shard)->post(request(proto::MsgType::kInit, 0, {1, 2}));
  {
    std::unique_lock lock(gate_mutex);
    ASSERT_TRUE(gate_cv.wait_for(lock, 10s, [&] { return inside; }));
  }
  // The ring is empty (the init was taken) but the shard thread is inside it.
  ShardItem push = request(proto::MsgType::kPush, 0, {0.5f, 0.5f});
  EXPECT_FALSE((*shard)->try_handle_inline(push));
  {
    std::lock_guard lock(gate_mutex);
    release = true;
  }
  gate_cv.notify_all();
  ASSERT_TRUE(sink.wait_for_count(1));
  (*shard)->post(std::move(push));
  ASSERT_TRUE(sink.wait_for_count(2));
  (*shard)->stop();
  (*shard)->join();
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
  EXPECT_EQ(sink.steps, (std::vector<std::uint64_t>{~std::uint64_t{0}, 0}));
}

// One producer that handles inline when it can and posts otherwise (as an
// I/O thread does), with a tiny lane so items also overflow: every push is
// handled once, in the producer's order. Every 100th push first lets the
// shard catch up, so the inline path surely runs too.
TEST(Shard, InlineAndQueuedItemsOfOneProducerStayInOrder) {
  CollectingSink sink;
  ShardOptions o;
  o.core.consistency = proto::Consistency::kAsp;
  o.ring_slots = 2;
  o.busy_poll = 50us;
  config::OptimizerConfig oc;
  auto shard = Shard::create(o, *Optimizer::create(oc), ShardHooks{&sink, {}, {}, {}, {}});
  ASSERT_TRUE(shard);
  (*shard)->post(request(proto::MsgType::kInit, 0, {1, 2}));
  const int pushes = 3000;
  int inline_count = 0, posted = 0;
  {
    // Not started, the init queued: refused, so posted.
    ShardItem first = request(proto::MsgType::kPush, 0, {0, 0});
    ASSERT_FALSE((*shard)->try_handle_inline(first));
    (*shard)->post(std::move(first));
    ++posted;
  }
  (*shard)->start();
  for (int t = 1; t < pushes; ++t) {
    ShardItem push = request(proto::MsgType::kPush, t, {0, 0});
    if (t % 100 == 0) {
      ASSERT_TRUE(sink.wait_for_count(t + 1));  // the init and pushes 0 .. t-1
      ASSERT_TRUE(handle_inline_once_free(**shard, push));
      ++inline_count;
      continue;
    }
    if ((*shard)->try_handle_inline(push)) {
      ++inline_count;
    } else {
      (*shard)->post(std::move(push));
      ++posted;
    }
  }
  ASSERT_TRUE(sink.wait_for_count(pushes + 1));
  (*shard)->stop();
  (*shard)->join();
  EXPECT_TRUE(sink.errors.empty()) << sink.errors.front();
  ASSERT_EQ(sink.steps.size(), pushes + 1u);
  EXPECT_EQ(sink.steps[0], ~std::uint64_t{0});
  for (int t = 0; t < pushes; ++t) ASSERT_EQ(sink.steps[t + 1], static_cast<std::uint64_t>(t)) << t;
  EXPECT_EQ((*shard)->core().stats().pushes_applied, static_cast<std::uint64_t>(pushes));
  EXPECT_GE(inline_count, pushes / 100 - 1);
  EXPECT_GE(posted, 1);
}

TEST(ShardOf, DealsATensorsChunksRoundRobinOverTheShards) {
  for (std::uint32_t shards : {1u, 2u, 3u, 8u}) {
    for (std::uint64_t key : {0ull, 1ull, 42ull, 500000ull, ~0ull}) {
      std::vector<int> per_shard(shards, 0);
      const std::uint32_t first = shard_of(key, 0, shards);
      for (std::uint32_t c = 0; c < 64; ++c) {
        const std::uint32_t s = shard_of(key, c, shards);
        ASSERT_LT(s, shards);
        EXPECT_EQ(s, (first + c) % shards) << "key " << key << " chunk " << c;
        ++per_shard[s];
      }
      const auto [lo, hi] = std::minmax_element(per_shard.begin(), per_shard.end());
      EXPECT_LE(*hi - *lo, 1) << "64 chunks of key " << key << " over " << shards << " shards";
    }
  }
}

TEST(ShardOf, SpreadsSmallKeysOverTheShards) {
  std::vector<int> per_shard(4, 0);
  for (std::uint64_t key = 0; key < 4000; ++key) ++per_shard[shard_of(key, 0, 4)];
  for (int n : per_shard) {
    EXPECT_GT(n, 800);
    EXPECT_LT(n, 1200);
  }
}

// The join's optimizer_check digests resolved numbers: "auto" and the value
// it stands for are the same job; another value is not; an unused field
// does not count.
TEST(OptimizerNumbers, AutoDigestsAsTheValueItStandsFor) {
  const auto check = [](const config::OptimizerConfig& o) {
    const auto n = optimizer_numbers(o);
    return proto::optimizer_check(n);
  };
  config::OptimizerConfig automatic;
  automatic.type = config::OptimizerType::kAdamW;
  config::OptimizerConfig written = automatic;
  written.weight_decay = 0.01;
  written.epsilon = 1e-8;
  EXPECT_EQ(check(automatic), check(written));
  written.weight_decay = 0.0;
  EXPECT_NE(check(automatic), check(written));

  config::OptimizerConfig adagrad;
  adagrad.type = config::OptimizerType::kAdagrad;
  config::OptimizerConfig adagrad_old = adagrad;
  adagrad_old.epsilon = 1e-8;  // an earlier build's default
  EXPECT_NE(check(adagrad), check(adagrad_old));
  adagrad_old.epsilon = 1e-10;
  adagrad_old.beta2 = 0.5;  // adagrad does not read it
  EXPECT_EQ(check(adagrad), check(adagrad_old));
}

}  // namespace
}  // namespace ember::server
