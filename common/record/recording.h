// Communication pattern recordings: the file format, the message-size
// buckets, and a reader.
//
// A recording is what a Recorder (recorder.h) writes when [communication]
// record_pattern = true: per channel, the head and tail positions of the
// channel's queue over time and the distribution of message sizes; per worker
// rank, bytes and messages sent. scripts/plot_channels.py renders it; this
// reader serves tests and `emberctl record FILE`.
//
// File format 1 (text, one record per line, fields separated by one space,
// numbers in decimal; times are nanoseconds since the recording started, on
// the steady clock; positions are cumulative counts since the start):
//
//   ember-record 1                         first line: magic and version
//   source <text to end of line>           who recorded ("ember-server 0", "worker 3")
//   start_unix_ns <n>                      wall clock at t = 0
//   channels <n>                           channel ids are 0 .. n-1
//   ranks <n>                              rank ids are 0 .. n-1
//   sample_interval_ns <n>                 sampler period
//   data                                   end of the header
//   c <t_ns> <channel> <head_msgs> <tail_msgs> <head_bytes> <tail_bytes>
//       a channel sample, written when a position changed since the
//       previous sample of that channel (and once at t = 0 and at the end).
//       tail = messages (bytes) that entered the channel, head = messages
//       (bytes) taken out; tail - head is the occupancy. head may exceed tail
//       by a few in one sample when a consumer ran before the producer's
//       hook: readers clamp the occupancy at 0.
//   r <t_ns> <rank> <bytes_sent> <messages_sent>
//       a rank sample, written when the rank's totals changed.
//   h <channel> <lo_bytes> <hi_bytes> <count>
//       at the end: `count` messages of lo_bytes <= size < hi_bytes on the
//       channel (only non-empty buckets; buckets as bucket_bounds below).
//   end <t_ns> <samples> <out_of_range>
//       last line: duration, number of c + r lines, and hook calls dropped
//       for a channel or rank id outside the declared ranges.
//
// Lines starting with '#' are comments. A file without its `end` line was
// cut short (the process died): the reader still returns what it holds and
// sets `complete = false`.
//
// Message-size buckets: log-linear, four per power of two (the layout of
// HdrHistogram with two bits of sub-bucket precision): sizes 0..3 have a
// bucket each; a size s >= 4 with k = floor(log2 s) falls in bucket
// 4 * (k - 1) + ((s >> (k - 2)) & 3), which spans [lo, lo + 2^(k-2)) with
// lo = (4 + sub) << (k - 2). Relative bucket width is at most 25%.
//
// Thread-safety: pure functions and plain values.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/error.h"

namespace ember::record {

inline constexpr int kFormatVersion = 1;
inline constexpr std::string_view kMagic = "ember-record";

// Number of message-size buckets: 4 exact (0..3) + 4 per power of two for
// k = 2 .. 63.
inline constexpr std::uint32_t kNumSizeBuckets = 4 + 4 * 62;

// The bucket of a message of `bytes` bytes (see the file comment).
constexpr std::uint32_t size_bucket(std::uint64_t bytes) noexcept {
  if (bytes < 4) return static_cast<std::uint32_t>(bytes);
  std::uint32_t k = 63;
  while ((bytes >> k) == 0) --k;  // constexpr-friendly floor(log2)
  const auto sub = static_cast<std::uint32_t>((bytes >> (k - 2)) & 3);
  return 4 * (k - 1) + sub;
}

// [lo, hi) of bucket `b` (b < kNumSizeBuckets). The last bucket's hi
// saturates at 2^64 - 1.
struct BucketBounds {
  std::uint64_t lo_bytes = 0;
  std::uint64_t hi_bytes = 0;
};
constexpr BucketBounds bucket_bounds(std::uint32_t b) noexcept {
  if (b < 4) return {b, std::uint64_t{b} + 1};
  const std::uint32_t k = b / 4 + 1;
  const std::uint32_t sub = b % 4;
  const std::uint64_t width = std::uint64_t{1} << (k - 2);
  const std::uint64_t lo = (std::uint64_t{4} + sub) << (k - 2);
  const std::uint64_t hi = lo + width;
  return {lo, hi < lo ? ~std::uint64_t{0} : hi};
}

static_assert(size_bucket(0) == 0 && size_bucket(3) == 3 && size_bucket(4) == 4);
static_assert(size_bucket(7) == 7 && size_bucket(8) == 8 && size_bucket(9) == 8);
static_assert(size_bucket(10) == 9 && size_bucket(4096) == 4 * 11);
static_assert(size_bucket(~std::uint64_t{0}) == kNumSizeBuckets - 1);
static_assert(bucket_bounds(size_bucket(5000)).lo_bytes <= 5000 &&
              5000 < bucket_bounds(size_bucket(5000)).hi_bytes);

struct ChannelSample {
  std::uint64_t t_ns = 0;
  std::uint32_t channel = 0;
  std::uint64_t head_msgs = 0;
  std::uint64_t tail_msgs = 0;
  std::uint64_t head_bytes = 0;
  std::uint64_t tail_bytes = 0;
};

struct RankSample {
  std::uint64_t t_ns = 0;
  std::uint32_t rank = 0;
  std::uint64_t bytes_sent = 0;
  std::uint64_t messages_sent = 0;
};

struct SizeBucketCount {
  std::uint32_t channel = 0;
  std::uint64_t lo_bytes = 0;
  std::uint64_t hi_bytes = 0;
  std::uint64_t count = 0;
};

struct Recording {
  std::string source;
  std::uint64_t start_unix_ns = 0;
  std::uint32_t num_channels = 0;
  std::uint32_t num_ranks = 0;
  std::uint64_t sample_interval_ns = 0;
  std::vector<ChannelSample> channel_samples;  // file order (time order per channel)
  std::vector<RankSample> rank_samples;        // file order (time order per rank)
  std::vector<SizeBucketCount> size_buckets;   // file order
  bool complete = false;                       // the `end` line was read
  std::uint64_t duration_ns = 0;               // from `end`; 0 when incomplete
  std::uint64_t out_of_range = 0;              // from `end`
};

// Parses a recording. Errors (kCorrupt): not a recording (first line), an
// unsupported version, a missing or malformed header field, a record with
// the wrong number of fields or a non-number, a channel or rank id outside
// the declared range — each naming "<source_name>:<line>". A file cut short
// after the header is not an error (complete = false).
[[nodiscard]] Result<Recording> parse_recording(std::string_view text, std::string_view source_name);

// Reads and parses a file. Errors: kIo (cannot read, naming the path) and
// parse_recording's.
[[nodiscard]] Result<Recording> load_recording(const std::filesystem::path& path);

// Totals at the end of a recording, per channel and per rank (the last
// sample of each; zeros for ids never sampled).
struct Totals {
  std::vector<ChannelSample> channels;  // index = channel id
  std::vector<RankSample> ranks;        // index = rank id
};
Totals final_totals(const Recording& recording);

}  // namespace ember::record
