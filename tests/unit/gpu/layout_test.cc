// SymBuffer layout, host buffers and ring views.
#include "worker/gpu/layout.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "worker/gpu/host_symbuffer.h"

namespace ember::gpu {
namespace {

TEST(SymBufferLayout, ChannelMetaKeepsHeadAndTailOnSeparateLinePairs) {
  EXPECT_EQ(sizeof(ChannelMeta), 256u);
  EXPECT_EQ(offsetof(ChannelMeta, head), 0u);
  EXPECT_EQ(offsetof(ChannelMeta, tail), 128u);
  EXPECT_EQ(alignof(ChannelMeta), 128u);
}

TEST(SymBufferLayout, RegionsAreAlignedDisjointAndInOrder) {
  for (std::uint32_t channels : {1u, 2u, 3u, 7u, 16u}) {
    for (std::uint32_t ranks : {1u, 2u, 5u}) {
      for (std::uint64_t ring_bytes : {128ull, 384ull, 4096ull, 1ull << 20}) {
        const SymBufferLayout l{channels, ranks, ring_bytes};
        ASSERT_TRUE(layout_regions_are_disjoint(l)) << channels << "x" << ranks << "x" << ring_bytes;
        // Independent check: collect every [begin, end) and sort.
        struct Interval {
          std::uint64_t begin, end;
        };
        std::vector<Interval> regions;
        for (std::uint32_t c = 0; c < channels; ++c) {
          for (std::uint32_t r = 0; r < ranks; ++r) {
            for (Direction d : {Direction::kSend, Direction::kRecv}) {
              const std::uint64_t meta = l.meta_offset(c, r, d);
              const std::uint64_t data = l.data_offset(c, r, d);
              EXPECT_EQ(meta % 128, 0u);
              EXPECT_EQ(data % 128, 0u);
              regions.push_back({meta, meta + sizeof(ChannelMeta)});
              regions.push_back({data, data + ring_bytes});
              EXPECT_GE(meta, l.channel_offset(c));
              EXPECT_LE(data + ring_bytes, l.channel_offset(c) + l.channel_bytes());
            }
          }
        }
        std::sort(regions.begin(), regions.end(),
                  [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
        for (std::size_t i = 1; i < regions.size(); ++i) {
          EXPECT_LE(regions[i - 1].end, regions[i].begin) << "overlap at region " << i;
        }
        EXPECT_EQ(regions.back().end, l.total_bytes());
        EXPECT_EQ(l.total_bytes(), channels * ranks * 2 * (256 + ring_bytes));
      }
    }
  }
}

TEST(SymBufferLayout, OrderIsChannelThenRankThenDirection) {
  const SymBufferLayout l{4, 3, 256};
  EXPECT_LT(l.meta_offset(0, 2, Direction::kRecv), l.meta_offset(1, 0, Direction::kSend));
  EXPECT_LT(l.meta_offset(1, 0, Direction::kRecv), l.meta_offset(1, 1, Direction::kSend));
  EXPECT_EQ(l.meta_offset(1, 1, Direction::kRecv) - l.meta_offset(1, 1, Direction::kSend),
            l.region_stride_bytes());
  EXPECT_EQ(l.ring_index(2, 1), 7u);
  EXPECT_EQ(l.channel_of_ring(7), 2u);
  EXPECT_EQ(l.rank_of_ring(7), 1u);
}

TEST(SymBufferLayout, RejectsUnalignedOrEmptyShapes) {
  EXPECT_FALSE((SymBufferLayout{1, 1, 100}.valid()));
  EXPECT_FALSE((SymBufferLayout{0, 1, 128}.valid()));
  EXPECT_FALSE((SymBufferLayout{1, 0, 128}.valid()));
  EXPECT_FALSE((SymBufferLayout{1, 1, 0}.valid()));
  EXPECT_FALSE((SymBufferLayout{1, 1, SymBufferLayout::kMaxRingBytes + 128}.valid()));
  auto b = HostSymBuffer::allocate(SymBufferLayout{2, 2, 200});
  ASSERT_FALSE(b.has_value());
  EXPECT_EQ(b.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(b.error().message().find("multiple of 128"), std::string::npos) << b.error().message();
}

TEST(HostSymBuffer, WrapRejectsMisalignedOrShortRegions) {
  const SymBufferLayout l{1, 1, 128};
  std::unique_ptr<std::byte, decltype(&std::free)> mem(
      static_cast<std::byte*>(std::aligned_alloc(4096, 8192)), &std::free);
  auto misaligned = HostSymBuffer::wrap(l, std::span<std::byte>(mem.get() + 64, 4096));
  ASSERT_FALSE(misaligned.has_value());
  EXPECT_EQ(misaligned.error().code(), ErrorCode::kInvalidArgument);
  auto short_region = HostSymBuffer::wrap(l, std::span<std::byte>(mem.get(), l.total_bytes() - 1));
  ASSERT_FALSE(short_region.has_value());
  EXPECT_NE(short_region.error().message().find(std::to_string(l.total_bytes())), std::string::npos);
  std::memset(mem.get(), 0xab, 8192);
  auto ok = HostSymBuffer::wrap(l, std::span<std::byte>(mem.get(), 8192));
  ASSERT_TRUE(ok.has_value()) << ok.error().to_string();
  EXPECT_EQ(ok->ring(0, 0, Direction::kSend).head(), 0u);
  EXPECT_EQ(ok->ring(0, 0, Direction::kRecv).tail(), 0u);
}

TEST(RingView, ProducerAndConsumerRangesWrapAtTheEnd) {
  auto buf = HostSymBuffer::allocate(SymBufferLayout{1, 1, 256});
  ASSERT_TRUE(buf.has_value());
  RingView ring = buf->ring(0, 0, Direction::kSend);
  EXPECT_EQ(ring.writable().size(), 256u);
  EXPECT_EQ(ring.readable().size(), 0u);
  ring.commit(200);
  ring.consume(160);
  // 40 readable: [160, 200); 216 writable: [200, 256) then [0, 160).
  RingView::Bytes r = ring.readable();
  EXPECT_EQ(r.size(), 40u);
  EXPECT_EQ(r.second.size(), 0u);
  RingView::Bytes w = ring.writable();
  EXPECT_EQ(w.first.size(), 56u);
  EXPECT_EQ(w.second.size(), 160u);
  ring.commit(100);  // tail 300: wraps
  r = ring.readable();
  EXPECT_EQ(r.first.size(), 96u);
  EXPECT_EQ(r.second.size(), 44u);
  EXPECT_EQ(r.second.data(), w.second.data());
  EXPECT_EQ(ring.head(), 160u);
  EXPECT_EQ(ring.tail(), 300u);
}

TEST(Loopback, MovesSendBytesToRecvAndFailsWhenRecvIsFull) {
  auto buf = HostSymBuffer::allocate(SymBufferLayout{2, 1, 128});
  ASSERT_TRUE(buf.has_value());
  RingView send = buf->ring(1, 0, Direction::kSend);
  RingView::Bytes w = send.writable();
  for (std::size_t i = 0; i < 64; ++i) w.first[i] = static_cast<std::byte>(i);
  send.commit(64);
  ASSERT_TRUE(loopback(buf->view()).has_value());
  RingView recv = buf->ring(1, 0, Direction::kRecv);
  ASSERT_EQ(recv.readable().size(), 64u);
  EXPECT_EQ(recv.readable().first[63], std::byte{63});
  EXPECT_EQ(send.readable().size(), 0u);
  send.commit(96);  // recv holds 64 of 128: no room for 96
  auto st = loopback(buf->view());
  ASSERT_FALSE(st.has_value());
  EXPECT_EQ(st.error().code(), ErrorCode::kTooLarge);
  EXPECT_NE(st.error().message().find("channel 1 rank 0"), std::string::npos) << st.error().message();
  EXPECT_NE(st.error().message().find("head=0 tail=64"), std::string::npos) << st.error().message();
}

}  // namespace
}  // namespace ember::gpu
