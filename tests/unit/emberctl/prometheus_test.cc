// The exposition reader against text rendered by Ember's own metrics
// Registry (so the two cannot drift apart), hand-written edge cases, and
// histogram quantiles against a hand computation.
#include <cmath>

#include <gtest/gtest.h>

#include "common/metrics/metrics.h"
#include "tools/emberctl/prometheus.h"

namespace ember::emberctl {
namespace {

const std::vector<double> kBounds = {10, 100};

TEST(ParseExposition, ReadsWhatTheRegistryRenders) {
  metrics::Registry reg;
  reg.counter("ember_test_total", "A \"counter\" with\nnewline").inc(7);
  reg.gauge("ember_test_gauge", "g", {{"rank", "3"}}).set(2.5);
  reg.gauge("ember_test_gauge", "g", {{"rank", "a\"b\\c"}}).set(-1);
  auto& h = reg.histogram("ember_test_us", "h", kBounds, {{"type", "push"}});
  h.observe(5);
  h.observe(50);
  h.observe(500);
  auto e = parse_exposition(reg.render());
  ASSERT_TRUE(e) << e.error().to_string();
  EXPECT_EQ(e->value("ember_test_total"), 7.0);
  EXPECT_EQ(e->types.at("ember_test_total"), "counter");
  EXPECT_EQ(e->types.at("ember_test_us"), "histogram");
  EXPECT_EQ(e->value("ember_test_gauge", {{"rank", "3"}}), 2.5);
  EXPECT_EQ(e->value("ember_test_gauge", {{"rank", "a\"b\\c"}}), -1.0);
  EXPECT_FALSE(e->value("ember_test_gauge", {{"rank", "4"}}));
  EXPECT_FALSE(e->value("nope"));
  auto hs = histograms(*e, "ember_test_us");
  ASSERT_EQ(hs.size(), 1u);
  EXPECT_EQ(hs[0].labels.at("type"), "push");
  EXPECT_EQ(hs[0].count, 3.0);
  EXPECT_EQ(hs[0].sum, 555.0);
  ASSERT_EQ(hs[0].buckets.size(), 3u);
  EXPECT_TRUE(std::isinf(hs[0].buckets.back().first));
}

TEST(Histogram, QuantilesInterpolateInsideTheBucket) {
  Histogram h;
  h.buckets = {{10, 2}, {100, 6}, {INFINITY, 8}};
  h.count = 8;
  h.sum = 400;
  // rank 4 of 8 lies in (10, 100] holding ranks 3..6: 10 + 90 * (4-2)/(6-2) = 55.
  EXPECT_DOUBLE_EQ(*h.quantile(0.5), 55.0);
  // rank 1 in [0, 10]: 0 + 10 * 1/2 = 5.
  EXPECT_DOUBLE_EQ(*h.quantile(0.125), 5.0);
  // in +Inf: the largest finite bound.
  EXPECT_DOUBLE_EQ(*h.quantile(0.99), 100.0);
  EXPECT_DOUBLE_EQ(*h.mean(), 50.0);
  Histogram empty;
  EXPECT_FALSE(empty.quantile(0.5));
  EXPECT_FALSE(empty.mean());
}

TEST(ParseExposition, AcceptsTimestampsCommentsAndSpecialValues) {
  auto e = parse_exposition(
      "# a comment\n\n# HELP x_total help \\\\ text\n# TYPE x_total counter\n"
      "x_total 3 1700000000000\ny +Inf\nz NaN\nw{} -Inf\nv{a=\"1\",} 2\r\n");
  ASSERT_TRUE(e) << e.error().to_string();
  EXPECT_EQ(e->value("x_total"), 3.0);
  EXPECT_EQ(e->help.at("x_total"), "help \\ text");
  EXPECT_TRUE(std::isinf(*e->value("y")));
  EXPECT_TRUE(std::isnan(*e->value("z")));
  EXPECT_EQ(e->value("v", {{"a", "1"}}), 2.0);
}

TEST(ParseExposition, RefusesMalformedLinesNamingThem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"9bad 1\n", "no metric name"},
      {"x{a=1} 2\n", "label needs"},
      {"x{a=\"1 2\n", "unterminated"},
      {"x{a=\"\\q\"} 2\n", "bad escape"},
      {"x{=\"1\"} 2\n", "bad label name"},
      {"x one\n", "bad value"},
      {"x 1 later\n", "bad timestamp"},
      {"# TYPE x flavour\n", "unknown metric type"},
      {"ok 1\nx{a=\"1\"\n", "line 2"},
  };
  for (const auto& [text, want] : cases) {
    auto e = parse_exposition(text);
    ASSERT_FALSE(e) << text;
    EXPECT_EQ(e.error().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.error().message().find(want), std::string::npos) << e.error().message();
  }
}

}  // namespace
}  // namespace ember::emberctl
