// CRC32C: the standard check value, chaining, and agreement with a bitwise
// reference over random lengths and alignments.
#include "common/wire/crc32c.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "tests/unit/wire/wire_test_util.h"

namespace ember::wire {
namespace {

using testing::Bytes;

std::span<const std::byte> text(const char* s) {
  return {reinterpret_cast<const std::byte*>(s), std::strlen(s)};
}

TEST(Crc32c, StandardCheckValue) {
  EXPECT_EQ(crc32c(text("123456789")), 0xE3069283u);
  EXPECT_EQ(testing::reference_crc32c(text("123456789")), 0xE3069283u);
}

TEST(Crc32c, EmptyIsZeroAndExtendFromZeroIsPlain) {
  EXPECT_EQ(crc32c({}), 0u);
  EXPECT_EQ(crc32c_extend(0, text("123456789")), 0xE3069283u);
  EXPECT_EQ(crc32c_extend(0xE3069283u, {}), 0xE3069283u);
}

TEST(Crc32c, ExtendEqualsConcatenation) {
  EXPECT_EQ(crc32c_extend(crc32c(text("1234")), text("56789")), 0xE3069283u);
}

TEST(Crc32c, MatchesBitwiseReferenceOnRandomLengthsAndAlignments) {
  std::mt19937_64 rng(testing::test_seed("Crc32c.MatchesBitwiseReference"));
  const Bytes data = testing::random_bytes(rng, 70000);
  for (int run = 0; run < 300; ++run) {
    const std::size_t begin = rng() % 64;
    const std::size_t len = (run % 3 == 0) ? rng() % 64 : rng() % (data.size() - begin);
    const auto piece = std::span<const std::byte>(data).subspan(begin, len);
    ASSERT_EQ(crc32c(piece), testing::reference_crc32c(piece)) << "begin " << begin << " len " << len;
    const std::size_t cut = len == 0 ? 0 : rng() % len;
    ASSERT_EQ(crc32c_extend(crc32c(piece.first(cut)), piece.subspan(cut)), crc32c(piece));
  }
}

}  // namespace
}  // namespace ember::wire
