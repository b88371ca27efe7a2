// Shard thread: items flow through the ring, and past a full lane through
// the overflow list, without losing the producer's order.
#include "server/shard.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>

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
  void error(const ReplyTo&, const proto::Header& h, const Error& e) override {
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

}  // namespace
}  // namespace ember::server
