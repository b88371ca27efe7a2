#include "common/memory/size_class.h"

#include <gtest/gtest.h>

namespace ember::memory {
namespace {

TEST(SizeClass, ClassesAreFourKibTimesPowersOfFour) {
  const std::size_t expected[kNumSizeClasses] = {
      4u << 10, 16u << 10, 64u << 10, 256u << 10, 1u << 20, 4u << 20, 16u << 20, 64u << 20};
  for (std::size_t c = 0; c < kNumSizeClasses; ++c) {
    EXPECT_EQ(size_class_bytes(c), expected[c]) << "class " << c;
    EXPECT_EQ(size_class_bytes(c) % kBlockAlignBytes, 0u);
  }
  EXPECT_EQ(kMaxBlockBytes, std::size_t{64} << 20);
}

TEST(SizeClass, PicksTheSmallestClassThatHolds) {
  EXPECT_EQ(size_class_for(0), 0u);
  EXPECT_EQ(size_class_for(1), 0u);
  for (std::size_t c = 0; c < kNumSizeClasses; ++c) {
    const std::size_t bytes = size_class_bytes(c);
    EXPECT_EQ(size_class_for(bytes), c) << bytes << " bytes fit class " << c << " exactly";
    EXPECT_EQ(size_class_for(bytes - 1), c) << bytes - 1;
    if (c + 1 < kNumSizeClasses) {
      EXPECT_EQ(size_class_for(bytes + 1), c + 1) << bytes + 1 << " bytes need the next class";
    }
  }
  EXPECT_EQ(size_class_for(kMaxBlockBytes + 1), kNumSizeClasses);
  EXPECT_EQ(size_class_for(~std::size_t{0}), kNumSizeClasses);
}

TEST(SizeClass, ChosenClassAlwaysHoldsTheRequest) {
  // Every size on a coarse walk plus the neighbourhood of every boundary.
  for (std::size_t bytes = 0; bytes <= kMaxBlockBytes; bytes += 997) {
    const std::size_t c = size_class_for(bytes);
    ASSERT_LT(c, kNumSizeClasses);
    ASSERT_GE(size_class_bytes(c), bytes);
    if (c > 0) {
      ASSERT_LT(size_class_bytes(c - 1), bytes) << "a smaller class would do";
    }
  }
}

TEST(SizeClass, EmptyBlockHasNoBytes) {
  Block b;
  EXPECT_TRUE(b.empty());
  EXPECT_FALSE(static_cast<bool>(b));
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(b.capacity_bytes(), 0u);
  EXPECT_TRUE(b.span().empty());
}

}  // namespace
}  // namespace ember::memory
