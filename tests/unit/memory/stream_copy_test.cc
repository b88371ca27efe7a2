// memory::stream_copy and the size rule that picks it.
#include "common/memory/stream_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace ember::memory {
namespace {

// Every (destination offset, source offset, length) around the 64-byte line
// and 16-byte store boundaries: the copy equals the source, and not one byte
// before or after the destination range is touched.
TEST(StreamCopy, CopiesEveryAlignmentAndLengthExactly) {
  std::vector<std::uint8_t> src(4096 + 128);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 131 + 7);
  const std::size_t lengths[] = {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 4096};
  for (std::size_t dst_off = 0; dst_off < 64; dst_off += 3) {
    for (std::size_t src_off : {0u, 1u, 8u, 33u}) {
      for (std::size_t len : lengths) {
        std::vector<std::uint8_t> dst(4096 + 256, 0xEE);
        stream_copy(dst.data() + dst_off, src.data() + src_off, len);
        for (std::size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= dst_off && i < dst_off + len;
          const std::uint8_t want = inside ? src[src_off + i - dst_off] : 0xEE;
          ASSERT_EQ(dst[i], want) << "byte " << i << ", dst offset " << dst_off << ", src offset "
                                  << src_off << ", length " << len;
        }
      }
    }
  }
}

TEST(StreamCopy, CopiesALargeBufferOfFloatsBitForBit) {
  std::vector<float> src(3u << 20), dst(src.size(), 0.0f);  // 12 MiB
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) * 0.25f - 1e6f;
  stream_copy(dst.data(), src.data(), src.size() * sizeof(float));
  EXPECT_EQ(dst, src);
}

TEST(StreamCopy, StreamsFromAQuarterOfTheLastLevelCache) {
  const std::size_t llc = last_level_cache_bytes();
  ASSERT_GT(llc, 0u);
  EXPECT_EQ(llc, last_level_cache_bytes());  // computed once
  EXPECT_FALSE(use_stream_copy(0));
  EXPECT_FALSE(use_stream_copy(llc / 4 - 1));
  EXPECT_TRUE(use_stream_copy(llc / 4));
  EXPECT_TRUE(use_stream_copy(llc * 4));
}

}  // namespace
}  // namespace ember::memory
