// The tuning rule of tune.h, step by step, with its reasoning text.
#include "tools/emberctl/tune.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "common/base/constants.h"
#include "common/base/units.h"
#include "common/memory/size_class.h"

namespace ember::emberctl {

namespace {

constexpr std::uint64_t kMinBatch = 512;
constexpr std::uint64_t kMaxBatch = std::uint64_t{1} << 20;
constexpr std::uint64_t kMaxRingSlots = std::uint64_t{1} << 24;

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

std::string format_duration(std::chrono::nanoseconds d) {
  const double ns = static_cast<double>(d.count());
  if (ns < 1e3) return fmt::format("{:.0f} ns", ns);
  if (ns < 1e6) return fmt::format("{:.1f} us", ns / 1e3);
  if (ns < 1e9) return fmt::format("{:.2f} ms", ns / 1e6);
  return fmt::format("{:.2f} s", ns / 1e9);
}

std::string format_bandwidth(double bytes_per_s) {
  const double gib = bytes_per_s / static_cast<double>(std::uint64_t{1} << 30);
  const double mib = bytes_per_s / static_cast<double>(std::uint64_t{1} << 20);
  const double gbit = bytes_per_s * 8 / 1e9;
  if (gib >= 1.0) return fmt::format("{:.2f} GiB/s ({:.1f} Gbit/s)", gib, gbit);
  return fmt::format("{:.2f} MiB/s ({:.3f} Gbit/s)", mib, gbit);
}

Result<double> parse_bandwidth(std::string_view text) {
  auto bad = [&] {
    return make_error(ErrorCode::kInvalidArgument,
                      "bandwidth '{}': expected a bit rate such as \"10Gbit\", \"25Gbps\", "
                      "\"100Mbit/s\" (decimal) or a byte rate such as \"1.25GB/s\" (binary "
                      "units, as in sizes)",
                      text);
  };
  std::string t = lower(text);
  std::erase(t, ' ');
  if (t.empty()) return bad();
  // Byte rate: "<size>/s".
  if (t.size() > 2 && t.ends_with("/s") && !t.ends_with("bit/s")) {
    auto bytes = parse_size_bytes(std::string_view(t).substr(0, t.size() - 2));
    if (!bytes) {
      // Fractional byte rates ("1.25GB/s") need not be whole bytes per second.
      const std::string num_unit = t.substr(0, t.size() - 2);
      char* end = nullptr;
      const double v = std::strtod(num_unit.c_str(), &end);
      const std::string unit(end);
      const double scale = unit == "b" || unit.empty() ? 1.0
                           : unit == "kb" || unit == "k" || unit == "kib" ? 1024.0
                           : unit == "mb" || unit == "m" || unit == "mib" ? 1048576.0
                           : unit == "gb" || unit == "g" || unit == "gib" ? 1073741824.0
                           : unit == "tb" || unit == "t" || unit == "tib" ? 1099511627776.0
                                                                          : 0.0;
      if (end == num_unit.c_str() || scale == 0.0 || !std::isfinite(v) || v <= 0) return bad();
      return v * scale;
    }
    if (*bytes == 0) return bad();
    return static_cast<double>(*bytes);
  }
  // Bit rate: "<number><prefix>bit[/s]" or "<number><prefix>bps".
  std::string unit;
  if (t.ends_with("bit/s")) {
    t.resize(t.size() - 5);
  } else if (t.ends_with("bps")) {
    t.resize(t.size() - 3);
  } else if (t.ends_with("bit")) {
    t.resize(t.size() - 3);
  } else {
    return bad();
  }
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  if (end == t.c_str()) return bad();
  unit = std::string(end);
  const double scale = unit.empty() ? 1.0
                       : unit == "k" ? 1e3
                       : unit == "m" ? 1e6
                       : unit == "g" ? 1e9
                       : unit == "t" ? 1e12
                                     : 0.0;
  if (scale == 0.0 || !std::isfinite(v) || v <= 0) return bad();
  return v * scale / 8.0;
}

Result<TuneResult> tune(const TuneInputs& in) {
  if (in.rtt.count() <= 0) {
    return make_error(ErrorCode::kInvalidArgument, "RTT must be > 0 (--rtt, e.g. 50us, or --probe)");
  }
  if (!(in.bandwidth_bytes_per_s > 0) || !std::isfinite(in.bandwidth_bytes_per_s)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "bandwidth must be > 0 (--bandwidth, e.g. 10Gbit, or --probe)");
  }
  if (in.num_workers < 1 || in.num_workers > (1u << 20)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "workers must be 1 .. 1048576 (--workers or --config), got {}", in.num_workers);
  }
  if (in.avg_message_bytes < 1 || in.avg_message_bytes > (std::uint64_t{1} << 40)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "average message size must be 1 B .. 1 TiB (--avg-message-size, e.g. 64KB, or "
                      "--metrics to read it from a running server)");
  }
  if (in.largest_message_bytes < memory::kMinBlockBytes ||
      in.largest_message_bytes > memory::kMaxBlockBytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "largest message must be 4 KiB .. 64 MiB (server.partition_bytes of --config), "
                      "got {}",
                      in.largest_message_bytes);
  }
  if (in.num_channels < 1 || in.num_channels > 64) {
    return make_error(ErrorCode::kInvalidArgument, "channels must be 1 .. 64 (--channels or --config)");
  }
  TuneResult r;
  auto say = [&r](std::string line) { r.reasoning.push_back(std::move(line)); };
  const double rtt_s = static_cast<double>(in.rtt.count()) / 1e9;
  if (rtt_s * in.bandwidth_bytes_per_s > 1e18) {
    return make_error(ErrorCode::kInvalidArgument,
                      "RTT x bandwidth = {:.3g} bytes is beyond any real link; check --rtt and "
                      "--bandwidth units",
                      rtt_s * in.bandwidth_bytes_per_s);
  }
  // ns x bytes/s first, then / 1e9: exact for whole numbers (20 us x 1.25e9
  // B/s is 25000 bytes, not 25000.000000000004 rounded up).
  r.bdp_bytes = static_cast<std::uint64_t>(
      std::ceil(static_cast<double>(in.rtt.count()) * in.bandwidth_bytes_per_s / 1e9));
  r.double_buffer_bytes = std::uint64_t{in.num_workers} * in.avg_message_bytes * 2;
  r.optimal_buffer_bytes = std::max(r.bdp_bytes, r.double_buffer_bytes);
  say(fmt::format("bandwidth-delay product: RTT {} x bandwidth {} = {} bytes ({})", format_duration(in.rtt),
      format_bandwidth(in.bandwidth_bytes_per_s), r.bdp_bytes, format_bytes(r.bdp_bytes)));
  say(fmt::format("double buffering: {} worker(s) x average message {} bytes x 2 = {} bytes ({})",
      in.num_workers, in.avg_message_bytes, r.double_buffer_bytes, format_bytes(r.double_buffer_bytes)));
  say(fmt::format("optimal_buffer_size = max(RTT x bandwidth, workers x average message x 2) = {} bytes ({}); "
      "the {} term dominates",
      r.optimal_buffer_bytes, format_bytes(r.optimal_buffer_bytes),
      r.bdp_bytes >= r.double_buffer_bytes ? "link (bandwidth-delay)" : "workers (double buffering)"));

  r.per_channel_bytes = ceil_div(r.optimal_buffer_bytes, in.num_channels);
  say(fmt::format("per channel: {} bytes / {} channel(s) = {} bytes", r.optimal_buffer_bytes, in.num_channels,
      r.per_channel_bytes));

  const std::uint64_t msgs = std::max<std::uint64_t>(2, ceil_div(r.per_channel_bytes, in.avg_message_bytes));
  const std::uint64_t slots = std::min(kMaxRingSlots, std::bit_ceil(msgs));
  r.ring_buffer_slots = static_cast<std::uint32_t>(slots);
  say(fmt::format("ring_buffer_size: {} bytes / {} bytes per message = {} message(s) in flight per channel; "
      "next power of two = {}{}",
      r.per_channel_bytes, in.avg_message_bytes, msgs, std::bit_ceil(msgs),
      std::bit_ceil(msgs) > kMaxRingSlots ? " (capped at 2^24)" : ""));

  const std::uint64_t quarter = r.per_channel_bytes / 4;
  const std::uint64_t batch = std::clamp(quarter, kMinBatch, kMaxBatch);
  r.batch_threshold_bytes = std::bit_floor(batch);
  say(fmt::format("batch_threshold: a quarter of the channel's window ({} bytes), so four batches are in "
      "flight; clamped to 512 B .. 1 MiB and rounded down to a power of two = {} ({})",
      quarter, r.batch_threshold_bytes, format_bytes(r.batch_threshold_bytes)));
  if (in.avg_message_bytes > r.batch_threshold_bytes) {
    say(fmt::format("  note: the average message ({} bytes) is above the batch threshold, so most messages "
        "are sent alone, straight from pool memory; batching only helps the small ones",
        in.avg_message_bytes));
  }

  std::uint64_t blocks = 0;
  std::uint64_t block_bytes = 0;
  const std::uint64_t in_flight = slots * in.avg_message_bytes;
  if (in.avg_message_bytes <= r.batch_threshold_bytes) {
    blocks = ceil_div(in_flight, r.batch_threshold_bytes);
    block_bytes = memory::size_class_bytes(memory::size_class_for(r.batch_threshold_bytes));
    say(fmt::format("pool blocks: {} slots x {} bytes = {} bytes per channel travel in batches: {} batch "
        "block(s) of {} (the size class of a {}-byte batch)",
        slots, in.avg_message_bytes, in_flight, blocks, format_bytes(block_bytes),
        r.batch_threshold_bytes));
  } else {
    blocks = slots;
    const std::size_t cls = memory::size_class_for(in.avg_message_bytes);
    block_bytes = cls < memory::kNumSizeClasses ? memory::size_class_bytes(cls)
                                                : in.avg_message_bytes;  // above 64 MiB: heap-sized
    say(fmt::format("pool blocks: each of the {} slots holds one message in its own block of {} (the size "
        "class of {} bytes)",
        slots, format_bytes(block_bytes), in.avg_message_bytes));
  }
  const std::uint64_t pool_bytes = 2 * std::uint64_t{in.num_channels} * blocks * block_bytes;
  const std::uint64_t largest_block =
      memory::size_class_bytes(memory::size_class_for(in.largest_message_bytes));
  const std::uint64_t floor_bytes = 2 * std::uint64_t{in.num_channels} * largest_block;
  const std::uint64_t pages =
      std::max<std::uint64_t>(1, ceil_div(std::max(pool_bytes, floor_bytes), kHugePageBytes));
  r.prealloc_pages = static_cast<std::uint32_t>(std::min<std::uint64_t>(pages, 1048576));
  say(fmt::format("prealloc_pages: in flight 2 (send + receive) x {} channel(s) x {} block(s) x {} = {} "
      "bytes; floor for the largest message ({} bytes): 2 x {} channel(s) x {} = {} bytes; the "
      "larger / 2 MiB = {} page(s){}",
      in.num_channels, blocks, format_bytes(block_bytes), pool_bytes, in.largest_message_bytes,
      in.num_channels, format_bytes(largest_block), floor_bytes, pages,
      pages > 1048576 ? " (capped at 1048576)" : ""));
  return r;
}

std::string TuneResult::toml() const {
  auto size_text = [](std::uint64_t bytes) {
    if (bytes >= (std::uint64_t{1} << 20) && bytes % (std::uint64_t{1} << 20) == 0) {
      return fmt::format("\"{}MB\"", bytes >> 20);
    }
    if (bytes >= 1024 && bytes % 1024 == 0) return fmt::format("\"{}KB\"", bytes >> 10);
    return fmt::format("\"{}B\"", bytes);
  };
  return fmt::format("[communication]\nbatch_threshold = {}\nring_buffer_size = {}\nprealloc_pages = {}\n",
                     size_text(batch_threshold_bytes), ring_buffer_slots, prealloc_pages);
}

}  // namespace ember::emberctl
