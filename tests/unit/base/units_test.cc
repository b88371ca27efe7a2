#include "common/base/units.h"

#include <gtest/gtest.h>

namespace ember {
namespace {

using std::chrono::nanoseconds;

TEST(ParseSize, AcceptsUnitsCaseInsensitively) {
  EXPECT_EQ(*parse_size_bytes("0"), 0u);
  EXPECT_EQ(*parse_size_bytes("123"), 123u);
  EXPECT_EQ(*parse_size_bytes("123B"), 123u);
  EXPECT_EQ(*parse_size_bytes("4KB"), 4096u);
  EXPECT_EQ(*parse_size_bytes("4kb"), 4096u);
  EXPECT_EQ(*parse_size_bytes("4KiB"), 4096u);
  EXPECT_EQ(*parse_size_bytes("4 K"), 4096u);
  EXPECT_EQ(*parse_size_bytes("2MiB"), 2u << 20);
  EXPECT_EQ(*parse_size_bytes(" 1GB "), 1ull << 30);
  EXPECT_EQ(*parse_size_bytes("1.5KB"), 1536u);
  EXPECT_EQ(*parse_size_bytes("2TB"), 2ull << 40);
}

TEST(ParseSize, RejectsMalformedWithNamedText) {
  for (const char* bad : {"", "KB", "-4KB", "4XB", "4 K B", "1.5", "0.3B", ".", "4KB4"}) {
    auto r = parse_size_bytes(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument) << bad;
    EXPECT_NE(r.error().message().find(std::string("'") + bad + "'"), std::string::npos)
        << r.error().message();
  }
}

TEST(ParseSize, RejectsOverflow) {
  EXPECT_EQ(*parse_size_bytes("18446744073709551615"), 18446744073709551615ull);
  EXPECT_EQ(parse_size_bytes("18446744073709551616").error().code(), ErrorCode::kTooLarge);
  EXPECT_EQ(parse_size_bytes("16777216TB").error().code(), ErrorCode::kTooLarge);
}

TEST(ParseDuration, AcceptsUnits) {
  EXPECT_EQ(*parse_duration("50us"), nanoseconds(50'000));
  EXPECT_EQ(*parse_duration("1.5s"), nanoseconds(1'500'000'000));
  EXPECT_EQ(*parse_duration("7ns"), nanoseconds(7));
  EXPECT_EQ(*parse_duration("2ms"), nanoseconds(2'000'000));
  EXPECT_EQ(*parse_duration("1m"), nanoseconds(60'000'000'000));
  EXPECT_EQ(*parse_duration("1h"), nanoseconds(3'600'000'000'000));
  // A space between number and unit, as sizes allow (units.h).
  EXPECT_EQ(*parse_duration("10 ms"), nanoseconds(10'000'000));
  EXPECT_EQ(*parse_duration("1.5  s"), nanoseconds(1'500'000'000));
}

TEST(ParseDuration, RequiresUnit) {
  auto r = parse_duration("50");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("needs a unit"), std::string::npos);
  EXPECT_FALSE(parse_duration("5 fortnights"));
  EXPECT_FALSE(parse_duration("0.5ns"));
}

// A bad number gives examples of its own kind only: durations for a
// duration, sizes for a size.
TEST(ParseDuration, NotANumberSuggestsDurationsOnly) {
  for (const char* bad : {"", "us", "-5ms", "fast"}) {
    auto r = parse_duration(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument) << bad;
    const std::string& msg = r.error().message();
    EXPECT_NE(msg.find("must start with a non-negative number (e.g. '50us', '1s')"),
              std::string::npos)
        << msg;
    EXPECT_EQ(msg.find("KB"), std::string::npos) << msg;
  }
}

TEST(ParseSize, NotANumberSuggestsSizesOnly) {
  auto r = parse_size_bytes("KB");
  ASSERT_FALSE(r);
  const std::string& msg = r.error().message();
  EXPECT_NE(msg.find("must start with a non-negative number (e.g. '4KB', '1.5MiB')"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find("us'"), std::string::npos) << msg;
}

TEST(FormatBytes, HumanUnits) {
  EXPECT_EQ(format_bytes(12), "12 B");
  EXPECT_EQ(format_bytes(4096), "4 KiB");
  EXPECT_EQ(format_bytes(3u << 19), "1.50 MiB");
}

TEST(DurationText, LargestExactUnitAndReadsBack) {
  using namespace std::chrono_literals;
  EXPECT_EQ(duration_text(0ns), "0s");
  EXPECT_EQ(duration_text(20us), "20us");
  EXPECT_EQ(duration_text(1500ns), "1500ns");
  EXPECT_EQ(duration_text(1500ms), "1500ms");
  EXPECT_EQ(duration_text(2min), "2m");
  EXPECT_EQ(duration_text(3h), "3h");
  for (const std::chrono::nanoseconds d :
       std::initializer_list<std::chrono::nanoseconds>{0ns, 7ns, 1us, 250ms, 90s, 61min}) {
    auto back = parse_duration(duration_text(d));
    ASSERT_TRUE(back) << duration_text(d);
    EXPECT_EQ(*back, d) << duration_text(d);
  }
}

}  // namespace
}  // namespace ember
