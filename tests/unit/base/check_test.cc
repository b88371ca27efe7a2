#include "common/base/check.h"

#include <gtest/gtest.h>

namespace {

TEST(CheckDeathTest, FailedCheckAbortsWithFileLineAndValues) {
  int x = 3;
  EXPECT_DEATH(EMBER_CHECK_MSG(x == 4, "x={}", x), "check_test.cc:[0-9]+: x == 4: x=3");
}

TEST(Check, PassingCheckDoesNothing) {
  EMBER_CHECK(1 + 1 == 2);
  SUCCEED();
}

}  // namespace
