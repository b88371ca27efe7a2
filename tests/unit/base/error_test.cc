#include "common/base/error.h"

#include <cerrno>

#include <gtest/gtest.h>

namespace ember {
namespace {

Result<int> half(int x) {
  if (x % 2 != 0) return make_error(ErrorCode::kInvalidArgument, "{} is odd", x);
  return x / 2;
}

Result<int> quarter(int x) {
  EMBER_ASSIGN_OR_RETURN(int h, half(x));
  EMBER_ASSIGN_OR_RETURN(int q, half(h));
  return q;
}

Status check_even(int x) {
  EMBER_TRY(half(x));
  return ok_status();
}

TEST(Error, AssignOrReturnPropagatesFirstError) {
  EXPECT_EQ(*quarter(8), 2);
  auto r = quarter(6);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(r.error().message(), "3 is odd");
}

TEST(Error, TryPropagatesThroughStatus) {
  EXPECT_TRUE(check_even(2));
  auto s = check_even(3);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kInvalidArgument);
}

TEST(Error, ToStringNamesCodeAndErrno) {
  auto e = make_sys_error(ENOENT, "open {}", "/nope").value();
  EXPECT_EQ(e.sys_errno(), ENOENT);
  const std::string s = e.to_string();
  EXPECT_NE(s.find("io: open /nope"), std::string::npos) << s;
  EXPECT_NE(s.find("errno 2"), std::string::npos) << s;
}

TEST(Error, WithContextPrefixesAndKeepsCode) {
  Error e(ErrorCode::kPoolExhausted, "no block", 0);
  e.with_context("allocating 4 KiB");
  EXPECT_EQ(e.message(), "allocating 4 KiB: no block");
  EXPECT_EQ(e.code(), ErrorCode::kPoolExhausted);
}

TEST(Error, EveryCodeHasAName) {
  for (int c = 0; c <= static_cast<int>(kLastErrorCode); ++c) {
    EXPECT_NE(error_code_name(static_cast<ErrorCode>(c)), "unknown") << c;
  }
}

}  // namespace
}  // namespace ember
