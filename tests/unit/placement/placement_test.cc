#include "common/placement/placement.h"

#include <map>

#include <gtest/gtest.h>

namespace ember::placement {
namespace {

TEST(Placement, ChunksTileTheTensorExactly) {
  for (std::uint64_t bytes : {0ull, 4ull, 4096ull, 4ull * 1000 * 1000 + 4, 100ull << 20}) {
    auto chunks = chunk_plan(7, bytes, 4, 4'000'000, 3, 4);
    ASSERT_EQ(chunks.size(), num_chunks(bytes, 4, 4'000'000));
    std::uint64_t next = 0;
    for (const Chunk& c : chunks) {
      EXPECT_EQ(c.offset_bytes, next);
      EXPECT_EQ(c.offset_bytes % 4, 0u);
      EXPECT_LE(c.length_bytes, 4'000'000u);
      if (bytes != 0) {
        EXPECT_GT(c.length_bytes, 0u);
      }
      EXPECT_LT(c.server, 3u);
      EXPECT_LT(c.channel, 4u);
      next += c.length_bytes;
    }
    EXPECT_EQ(next, bytes);
  }
}

TEST(Placement, PartitionRoundedDownToElementSize) {
  auto chunks = chunk_plan(1, 40, 4, 10, 1, 1);  // step 8 bytes
  ASSERT_EQ(chunks.size(), 5u);
  EXPECT_EQ(chunks[1].offset_bytes, 8u);
  auto tiny = chunk_plan(1, 8, 4, 3, 1, 1);  // partition smaller than one element
  EXPECT_EQ(tiny.size(), 2u);
}

TEST(Placement, ConsecutiveKeysSpreadOverServersAndChannels) {
  std::map<std::uint32_t, int> per_server, per_channel;
  for (std::uint64_t key = 0; key < 4000; ++key) {
    ++per_server[server_of(key, 0, 4)];
    ++per_channel[channel_of(key, 0, 4)];
  }
  for (std::uint32_t s = 0; s < 4; ++s) {
    EXPECT_GT(per_server[s], 850) << s;
    EXPECT_GT(per_channel[s], 850) << s;
  }
}

TEST(Placement, MapIsStable) {
  // Golden values: a change here breaks worker/server compatibility and
  // needs a protocol version bump.
  EXPECT_EQ(mix64(0), 0xE220A8397B1DCDAFULL);
  EXPECT_EQ(server_of(42, 0, 7), server_of(42, 0, 7));
  static_assert(mix64(1) != mix64(2));
}

TEST(Placement, ChunkAtIsChunkPlansEntry) {
  for (const std::uint64_t bytes : {std::uint64_t{0}, std::uint64_t{4}, std::uint64_t{4096},
                                    std::uint64_t{10'000'004}}) {
    const auto plan = chunk_plan(77, bytes, 4, 1'000'002, 3, 2);
    for (const Chunk& c : plan) {
      const Chunk a = chunk_at(77, bytes, 4, 1'000'002, c.index, 3, 2);
      EXPECT_EQ(a.offset_bytes, c.offset_bytes) << bytes << " " << c.index;
      EXPECT_EQ(a.length_bytes, c.length_bytes) << bytes << " " << c.index;
      EXPECT_EQ(a.server, c.server);
      EXPECT_EQ(a.channel, c.channel);
    }
  }
}

}  // namespace
}  // namespace ember::placement
