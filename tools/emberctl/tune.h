// `emberctl tune`: recommends [communication] batch_threshold,
// ring_buffer_size and prealloc_pages from the link's round-trip time and
// bandwidth and the job's shape, and says why.
//
// The rule (issue 7):
//   optimal_buffer_size = max(RTT x bandwidth, workers x average message size x 2)
// RTT x bandwidth is the bandwidth-delay product: the bytes that must be in
// flight to keep the link busy while the first byte's answer travels back.
// workers x average message x 2 is what a server sees in one step when every
// worker has one message in flight and the next one queued (double
// buffering). The larger of the two is the window the data path must hold.
//
// From the window (B bytes, C channels, average message m bytes, W workers):
//   per channel window    w = ceil(B / C)
//   ring_buffer_size      next power of two >= max(2, ceil(w / m)), at most
//                         2^24: one slot per message that must fit in the
//                         channel's share of the window.
//   batch_threshold       largest power of two <= w / 4, clamped to
//                         512 B .. 1 MiB: at least four batches in flight per
//                         channel, so the link never waits for one batch to
//                         fill, and no larger (a bigger batch only adds
//                         latency for the messages waiting in it).
//   prealloc_pages        the page pool holds what is in flight, on the send
//                         and the receive side (x 2), in pool blocks (size
//                         classes of 4 KiB .. 64 MiB, x4 apart): messages
//                         below the batch threshold travel in batch blocks
//                         (ceil(slots x m / batch) blocks of the batch's
//                         class), larger ones in a block each (slots blocks
//                         of the message's class):
//                           pool = 2 x C x blocks x block_bytes
//                         and at least one block of the largest message's
//                         class per channel and side (2 x C x that block),
//                         so a full-size tensor chunk never falls back to
//                         heap memory:
//                           pages = ceil(max(pool, floor) / 2 MiB), at least 1.
// Every step is printed with its numbers (TuneResult::reasoning).
//
// Thread-safety: pure functions.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/error.h"

namespace ember::emberctl {

struct TuneInputs {
  std::chrono::nanoseconds rtt{0};   // round-trip time; > 0
  double bandwidth_bytes_per_s = 0;  // > 0, finite
  std::uint32_t num_workers = 1;     // >= 1
  std::uint64_t avg_message_bytes = 0;  // >= 1
  std::uint32_t num_channels = 1;    // 1 .. 64
  // Largest message a server or worker sends in one piece: a tensor chunk of
  // at most [server] partition_bytes (default 4 MiB); 4 KiB .. 64 MiB.
  std::uint64_t largest_message_bytes = std::uint64_t{4} << 20;
};

struct TuneResult {
  std::uint64_t bdp_bytes = 0;            // ceil(RTT x bandwidth)
  std::uint64_t double_buffer_bytes = 0;  // workers x avg message x 2
  std::uint64_t optimal_buffer_bytes = 0; // max of the two
  std::uint64_t per_channel_bytes = 0;
  std::uint64_t batch_threshold_bytes = 0;
  std::uint32_t ring_buffer_slots = 0;
  std::uint32_t prealloc_pages = 0;
  std::vector<std::string> reasoning;  // one line per step, with the numbers

  // The recommendation as a TOML [communication] snippet.
  std::string toml() const;
};

// Applies the rule above. Errors (kInvalidArgument): an input out of its
// range, naming it and the flag that sets it.
[[nodiscard]] Result<TuneResult> tune(const TuneInputs& in);

// Parses a bandwidth. Bit rates are decimal (SI), as links are rated:
// "10Gbit", "10 Gbit/s", "25Gbps", "100Mbit", "1.5Tbit", "800kbit".
// Byte rates use the binary units of sizes (parse_size_bytes) followed by
// "/s": "1.25GB/s" = 1.25 x 2^30 bytes/s, "500MB/s", "4096B/s".
// Returns bytes per second. Errors (kInvalidArgument): anything else, with
// examples of the accepted forms.
[[nodiscard]] Result<double> parse_bandwidth(std::string_view text);

// "9.31 GiB/s (80.0 Gbit/s)".
std::string format_bandwidth(double bytes_per_s);
// "50.0 us", "1.20 ms".
std::string format_duration(std::chrono::nanoseconds d);

}  // namespace ember::emberctl
