// Unit tests for common/metrics: exact exposition text for a small registry,
// escaping, ordering, histogram bucket semantics, concurrent updates, and
// the abort on misuse.
#include "common/metrics/metrics.h"

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace ember::metrics {
namespace {

TEST(Registry, RendersSmallRegistryExactly) {
  Registry r;
  Counter& sent3 = r.counter("ember_bytes_sent_total", "Bytes sent.", {{"channel", "3"}});
  Counter& sent10 = r.counter("ember_bytes_sent_total", "Bytes sent.", {{"channel", "10"}});
  Counter& sent2 = r.counter("ember_bytes_sent_total", "Bytes sent.", {{"channel", "2"}});
  sent3.inc(4096);
  sent10.inc();
  sent2.inc(7);
  Gauge& workers = r.gauge("ember_workers_connected", "Workers connected.");
  workers.set(2);
  workers.add(0.5);
  const std::vector<double> bounds{10, 100};
  Histogram& lat = r.histogram("ember_push_latency_us", "Push latency in microseconds.", bounds,
                               {{"worker", "1"}});
  lat.observe(5);
  lat.observe(10);   // on the bound: counted in le="10"
  lat.observe(50);
  lat.observe(1000);

  const std::string expected =
      "# HELP ember_bytes_sent_total Bytes sent.\n"
      "# TYPE ember_bytes_sent_total counter\n"
      "ember_bytes_sent_total{channel=\"2\"} 7\n"
      "ember_bytes_sent_total{channel=\"3\"} 4096\n"
      "ember_bytes_sent_total{channel=\"10\"} 1\n"
      "# HELP ember_push_latency_us Push latency in microseconds.\n"
      "# TYPE ember_push_latency_us histogram\n"
      "ember_push_latency_us_bucket{worker=\"1\",le=\"10\"} 2\n"
      "ember_push_latency_us_bucket{worker=\"1\",le=\"100\"} 3\n"
      "ember_push_latency_us_bucket{worker=\"1\",le=\"+Inf\"} 4\n"
      "ember_push_latency_us_sum{worker=\"1\"} 1065\n"
      "ember_push_latency_us_count{worker=\"1\"} 4\n"
      "# HELP ember_workers_connected Workers connected.\n"
      "# TYPE ember_workers_connected gauge\n"
      "ember_workers_connected 2.5\n";
  EXPECT_EQ(r.render(), expected);
  EXPECT_EQ(r.num_families(), 3u);
}

TEST(Registry, EscapesLabelValuesAndHelp) {
  Registry r;
  r.counter("odd_total", "Line one\nback\\slash \"quoted\".",
            {{"path", "C:\\tmp\n\"x\""}, {"a", "1"}})
      .inc(3);
  const std::string expected =
      "# HELP odd_total Line one\\nback\\\\slash \"quoted\".\n"
      "# TYPE odd_total counter\n"
      "odd_total{a=\"1\",path=\"C:\\\\tmp\\n\\\"x\\\"\"} 3\n";
  EXPECT_EQ(r.render(), expected);
}

TEST(Registry, SameNameAndLabelsReturnsSameObject) {
  Registry r;
  Counter& a = r.counter("c_total", "h", {{"x", "1"}, {"y", "2"}});
  Counter& b = r.counter("c_total", "h", {{"y", "2"}, {"x", "1"}});  // order does not matter
  Counter& c = r.counter("c_total", "h", {{"x", "2"}, {"y", "2"}});
  EXPECT_EQ(&a, &b);
  EXPECT_NE(&a, &c);
}

TEST(Registry, RendersSpecialGaugeValues) {
  Registry r;
  r.gauge("g_inf", "h").set(std::numeric_limits<double>::infinity());
  r.gauge("g_nan", "h").set(std::nan(""));
  r.gauge("g_neg", "h").set(-std::numeric_limits<double>::infinity());
  r.gauge("g_small", "h").set(1e-8);
  const std::string text = r.render();
  EXPECT_NE(text.find("g_inf +Inf\n"), std::string::npos) << text;
  EXPECT_NE(text.find("g_nan NaN\n"), std::string::npos) << text;
  EXPECT_NE(text.find("g_neg -Inf\n"), std::string::npos) << text;
  EXPECT_NE(text.find("g_small 1e-08\n"), std::string::npos) << text;
}

TEST(Gauge, RaiseToKeepsTheHighestValueFromEveryThread) {
  Gauge g;
  g.raise_to(5);
  g.raise_to(3);  // lower: no change
  EXPECT_EQ(g.value(), 5);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&g, t] {
      for (int i = 0; i < 10000; ++i) g.raise_to(i * 4 + t);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(g.value(), 9999 * 4 + 3);
}

TEST(Histogram, BucketsFollowLeSemantics) {
  const std::vector<double> bounds{1, 2, 4};
  Histogram h(bounds);
  for (double v : {0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, -1.0}) h.observe(v);
  h.observe(std::nan(""));  // goes to +Inf
  const Histogram::Snapshot s = h.snapshot();
  ASSERT_EQ(s.cumulative.size(), 4u);
  EXPECT_EQ(s.cumulative[0], 3u);  // -1, 0.5, 1
  EXPECT_EQ(s.cumulative[1], 5u);  // + 1.5, 2
  EXPECT_EQ(s.cumulative[2], 7u);  // + 3, 4
  EXPECT_EQ(s.cumulative[3], 9u);  // + 5, NaN
  EXPECT_EQ(s.count, 9u);
  EXPECT_TRUE(std::isnan(s.sum));
}

TEST(Histogram, BucketHelpers) {
  EXPECT_EQ(exponential_buckets(1, 2, 4), (std::vector<double>{1, 2, 4, 8}));
  EXPECT_EQ(linear_buckets(10, 5, 3), (std::vector<double>{10, 15, 20}));
  const auto lat = latency_us_buckets();
  EXPECT_EQ(lat.front(), 1);
  EXPECT_EQ(lat.back(), 1e7);
  EXPECT_EQ(lat.size(), 22u);
  const auto sizes = size_bytes_buckets();
  EXPECT_EQ(sizes.front(), 64);
  EXPECT_EQ(sizes.back(), static_cast<double>(std::uint64_t{1} << 30));
}

TEST(Counter, ConcurrentIncrementsSumExactly) {
  Registry r;
  constexpr int kThreads = 8;
  constexpr int kPerThread = 200'000;
  Counter& shared = r.counter("shared_total", "h");
  Histogram& hist = r.histogram("obs", "h", std::vector<double>{0.5});
  Gauge& gauge = r.gauge("g", "h");
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Counter& own = r.counter("per_thread_total", "h", {{"thread", std::to_string(t)}});
      for (int i = 0; i < kPerThread; ++i) {
        shared.inc();
        own.inc(2);
        hist.observe(i % 2);  // half in le=0.5, half in +Inf
        gauge.add(1);
      }
    });
  }
  // Rendering concurrently with updates must be safe (checked under TSan).
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(r.render().empty());
  for (auto& th : threads) th.join();
  EXPECT_EQ(shared.value(), std::uint64_t{kThreads} * kPerThread);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(r.counter("per_thread_total", "h", {{"thread", std::to_string(t)}}).value(),
              std::uint64_t{2} * kPerThread);
  }
  const auto snap = hist.snapshot();
  EXPECT_EQ(snap.count, std::uint64_t{kThreads} * kPerThread);
  EXPECT_EQ(snap.cumulative[0], std::uint64_t{kThreads} * kPerThread / 2);
  EXPECT_EQ(snap.sum, static_cast<double>(kThreads) * kPerThread / 2);
  EXPECT_EQ(gauge.value(), static_cast<double>(kThreads) * kPerThread);
}

TEST(Counter, RaiseToMirrorsATotalAndNeverGoesDown) {
  Registry r;
  Counter& c = r.counter("mirrored_total", "h");
  c.raise_to(100);
  EXPECT_EQ(c.value(), 100u);
  c.raise_to(40);  // a sample that read less (a count moving between sums)
  EXPECT_EQ(c.value(), 100u);
  c.raise_to(250);
  EXPECT_EQ(c.value(), 250u);
  EXPECT_NE(r.render().find("# TYPE mirrored_total counter\nmirrored_total 250\n"), std::string::npos)
      << r.render();
  // Concurrent samplers: the largest total wins.
  std::vector<std::thread> threads;
  for (std::uint64_t t = 1; t <= 4; ++t) {
    threads.emplace_back([&c, t] {
      for (std::uint64_t i = 0; i < 10'000; ++i) c.raise_to(1000 * t + i);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(c.value(), 4000u + 9'999u);
}

TEST(Counter, DoesNotShareCacheLines) {
  static_assert(alignof(Counter) >= kFalseSharingBytes);
  static_assert(alignof(Gauge) >= kFalseSharingBytes);
  Registry r;
  Counter& a = r.counter("a_total", "h", {{"c", "0"}});
  Counter& b = r.counter("a_total", "h", {{"c", "1"}});
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(&a) % kFalseSharingBytes, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(&b) % kFalseSharingBytes, 0u);
}

TEST(Registry, GlobalRegistryIsOneObject) {
  EXPECT_EQ(&global_registry(), &global_registry());
}

using RegistryDeathTest = ::testing::Test;

TEST(RegistryDeathTest, AbortsOnMisuse) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH({ Registry r; r.counter("bad-name", "h"); }, "must match");
  EXPECT_DEATH({ Registry r; r.counter("c", "h", {{"__x", "1"}}); }, "label name '__x'");
  EXPECT_DEATH({ Registry r; r.counter("c", "h", {{"a", "1"}, {"a", "2"}}); }, "given twice");
  EXPECT_DEATH(
      {
        Registry r;
        r.counter("m", "h");
        r.gauge("m", "h");
      },
      "registered as counter and again as gauge");
  EXPECT_DEATH(
      {
        Registry r;
        r.counter("m", "h");
        r.counter("m", "other");
      },
      "registered with help");
  EXPECT_DEATH(
      {
        Registry r;
        r.counter("m", "h", {{"a", "1"}});
        r.counter("m", "h", {{"b", "1"}});
      },
      "registered with labels");
  EXPECT_DEATH(
      {
        Registry r;
        r.histogram("h", "h", std::vector<double>{1, 2});
        r.histogram("h", "h", std::vector<double>{1, 3});
      },
      "registered with bounds");
  EXPECT_DEATH({ Histogram h(std::vector<double>{2, 1}); }, "increase strictly");
  EXPECT_DEATH(
      { Histogram h(std::vector<double>{1, std::numeric_limits<double>::infinity()}); },
      "must be finite");
  EXPECT_DEATH(
      {
        Registry r;
        r.histogram("h", "h", std::vector<double>{1}, {{"le", "1"}});
      },
      "reserved");
}

}  // namespace
}  // namespace ember::metrics
