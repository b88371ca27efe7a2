// emberctl tune: the recommendation follows the formula
//   optimal_buffer_size = max(RTT x bandwidth, workers x average message x 2)
// and the derivations documented in tools/emberctl/tune.h, computed here
// independently for both branches of the max; bandwidth parsing; bad input.
#include <bit>
#include <cmath>

#include <gtest/gtest.h>

#include "common/memory/size_class.h"
#include "tools/emberctl/tune.h"

namespace ember::emberctl {
namespace {

using namespace std::chrono_literals;

struct Expected {
  std::uint64_t optimal, batch, pages;
  std::uint32_t slots;
};

// The documented rule, written out again from tune.h's comment.
// RTT in ns and bandwidth in whole Gbit/s, so RTT x bandwidth is exact in
// integers: ns x Gbit/s / 8 = bytes.
Expected reference(std::uint64_t rtt_ns, std::uint64_t gbit, std::uint64_t workers, std::uint64_t avg,
                   std::uint64_t channels, std::uint64_t largest) {
  const std::uint64_t bdp = (rtt_ns * gbit + 7) / 8;
  const std::uint64_t dbl = workers * avg * 2;
  Expected e{};
  e.optimal = bdp > dbl ? bdp : dbl;
  const std::uint64_t w = (e.optimal + channels - 1) / channels;
  std::uint64_t msgs = (w + avg - 1) / avg;
  if (msgs < 2) msgs = 2;
  e.slots = static_cast<std::uint32_t>(std::min<std::uint64_t>(std::bit_ceil(msgs), 1u << 24));
  std::uint64_t b = w / 4;
  b = b < 512 ? 512 : (b > (1u << 20) ? (1u << 20) : b);
  e.batch = std::bit_floor(b);
  std::uint64_t blocks, block;
  if (avg <= e.batch) {
    blocks = (std::uint64_t{e.slots} * avg + e.batch - 1) / e.batch;
    block = memory::size_class_bytes(memory::size_class_for(e.batch));
  } else {
    blocks = e.slots;
    block = memory::size_class_bytes(memory::size_class_for(avg));
  }
  const std::uint64_t pool = 2 * channels * blocks * block;
  const std::uint64_t floor = 2 * channels * memory::size_class_bytes(memory::size_class_for(largest));
  const std::uint64_t need = pool > floor ? pool : floor;
  e.pages = std::max<std::uint64_t>(1, (need + (2u << 20) - 1) / (2u << 20));
  return e;
}

TEST(Tune, LinkTermDominatesOnALongFatLink) {
  TuneInputs in;
  in.rtt = 2ms;
  in.bandwidth_bytes_per_s = 100e9 / 8;  // 100 Gbit/s
  in.num_workers = 8;
  in.avg_message_bytes = 64 << 10;
  in.num_channels = 4;
  auto r = tune(in);
  ASSERT_TRUE(r) << r.error().to_string();
  EXPECT_EQ(r->bdp_bytes, 25'000'000u);  // 0.002 s x 12.5e9 B/s
  EXPECT_EQ(r->double_buffer_bytes, 8u * 65536 * 2);
  EXPECT_EQ(r->optimal_buffer_bytes, 25'000'000u);
  const Expected e = reference(2'000'000, 100, 8, 65536, 4, 4 << 20);
  EXPECT_EQ(r->ring_buffer_slots, e.slots);
  EXPECT_EQ(r->batch_threshold_bytes, e.batch);
  EXPECT_EQ(r->prealloc_pages, e.pages);
  // Spelled out: 6.25 MB per channel, 96 messages of 64 KiB -> 128 slots;
  // batch = floor_pow2(min(6.25e6/4, 1 MiB)) = 1 MiB.
  EXPECT_EQ(r->ring_buffer_slots, 128u);
  EXPECT_EQ(r->batch_threshold_bytes, 1u << 20);
  EXPECT_NE(r->reasoning.front().find("25000000 bytes"), std::string::npos);
}

TEST(Tune, WorkerTermDominatesOnAShortLinkWithManyWorkers) {
  TuneInputs in;
  in.rtt = 20us;
  in.bandwidth_bytes_per_s = 10e9 / 8;
  in.num_workers = 64;
  in.avg_message_bytes = 256 << 10;
  in.num_channels = 2;
  auto r = tune(in);
  ASSERT_TRUE(r) << r.error().to_string();
  EXPECT_EQ(r->bdp_bytes, 25'000u);
  EXPECT_EQ(r->optimal_buffer_bytes, 64u * (256 << 10) * 2);
  const Expected e = reference(20'000, 10, 64, 256 << 10, 2, 4 << 20);
  EXPECT_EQ(r->optimal_buffer_bytes, e.optimal);
  EXPECT_EQ(r->ring_buffer_slots, e.slots);
  EXPECT_EQ(r->batch_threshold_bytes, e.batch);
  EXPECT_EQ(r->prealloc_pages, e.pages);
  bool said = false;
  for (const auto& line : r->reasoning) said |= line.find("workers (double buffering)") != std::string::npos;
  EXPECT_TRUE(said);
}

TEST(Tune, MatchesTheReferenceOverAGridOfInputs) {
  for (std::uint64_t rtt_ns : {5'000ull, 50'000ull, 123'457ull, 5'000'000ull}) {
    for (std::uint64_t gbit : {1ull, 10ull, 25ull, 100ull}) {
      for (std::uint32_t workers : {1u, 4u, 32u}) {
        for (std::uint64_t avg : {100ull, 4096ull, 300000ull, 8ull << 20}) {
          for (std::uint32_t channels : {1u, 3u, 8u}) {
            TuneInputs in;
            in.rtt = std::chrono::nanoseconds(rtt_ns);
            in.bandwidth_bytes_per_s = static_cast<double>(gbit) * 1e9 / 8;
            in.num_workers = workers;
            in.avg_message_bytes = avg;
            in.num_channels = channels;
            auto r = tune(in);
            ASSERT_TRUE(r);
            const Expected e = reference(rtt_ns, gbit, workers, avg, channels, 4 << 20);
            ASSERT_EQ(r->optimal_buffer_bytes, e.optimal)
                << rtt_ns << " ns " << gbit << " Gbit/s " << workers << " workers " << avg << " B";
            ASSERT_EQ(r->ring_buffer_slots, e.slots);
            ASSERT_EQ(r->batch_threshold_bytes, e.batch);
            ASSERT_EQ(r->prealloc_pages, e.pages);
            ASSERT_TRUE(std::has_single_bit(r->ring_buffer_slots));
            ASSERT_GE(r->batch_threshold_bytes, 512u);
            ASSERT_LE(r->batch_threshold_bytes, 1u << 20);
          }
        }
      }
    }
  }
}

TEST(Tune, TomlSnippetParsesAsTheValues) {
  TuneInputs in;
  in.rtt = 50us;
  in.bandwidth_bytes_per_s = 10e9 / 8;
  in.num_workers = 4;
  in.avg_message_bytes = 4096;
  in.num_channels = 2;
  auto r = tune(in);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->toml(),
            "[communication]\nbatch_threshold = \"4KB\"\nring_buffer_size = 8\nprealloc_pages = 8\n");
}

TEST(Tune, RefusesInputsOutOfRangeNamingTheFlag) {
  TuneInputs good;
  good.rtt = 50us;
  good.bandwidth_bytes_per_s = 1e9;
  good.num_workers = 2;
  good.avg_message_bytes = 1000;
  good.num_channels = 1;
  ASSERT_TRUE(tune(good));
  auto expect_error = [](TuneInputs in, const char* what) {
    auto r = tune(in);
    ASSERT_FALSE(r) << what;
    EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.error().message().find(what), std::string::npos) << r.error().message();
  };
  TuneInputs in = good;
  in.rtt = 0ns;
  expect_error(in, "--rtt");
  in = good;
  in.bandwidth_bytes_per_s = 0;
  expect_error(in, "--bandwidth");
  in.bandwidth_bytes_per_s = std::nan("");
  expect_error(in, "--bandwidth");
  in = good;
  in.num_workers = 0;
  expect_error(in, "--workers");
  in = good;
  in.avg_message_bytes = 0;
  expect_error(in, "--avg-message-size");
  in = good;
  in.num_channels = 65;
  expect_error(in, "--channels");
  in = good;
  in.largest_message_bytes = 1;
  expect_error(in, "partition_bytes");
  in = good;
  in.rtt = std::chrono::hours(1000);
  in.bandwidth_bytes_per_s = 1e15;
  expect_error(in, "beyond any real link");
}

TEST(ParseBandwidth, BitRatesAreDecimalByteRatesBinary) {
  EXPECT_DOUBLE_EQ(*parse_bandwidth("10Gbit"), 10e9 / 8);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("10 Gbit/s"), 10e9 / 8);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("25Gbps"), 25e9 / 8);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("100mbit"), 100e6 / 8);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("800kbit"), 800e3 / 8);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("1.5Tbit"), 1.5e12 / 8);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("1GB/s"), 1073741824.0);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("1.25GB/s"), 1.25 * 1073741824.0);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("500MB/s"), 500.0 * 1048576);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("4096B/s"), 4096.0);
  for (const char* bad : {"", "10", "fast", "10Gb", "-1Gbit", "0Gbit", "10Xbit", "0B/s", "abc/s"}) {
    auto r = parse_bandwidth(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.error().message().find("10Gbit"), std::string::npos);
  }
}

}  // namespace
}  // namespace ember::emberctl
