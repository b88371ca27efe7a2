// Fuzz target: the communication-recording reader (common/record/recording.h),
// which `emberctl record FILE` runs on files a crashed process may have cut
// anywhere. Never crashes or reads out of bounds; refuses with kCorrupt and
// a message naming the source and line; what it accepts keeps every sample's
// channel and rank inside the declared ranges, and final_totals gives one
// entry per declared channel and rank.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/base/check.h"
#include "common/record/recording.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto rec = ember::record::parse_recording(text, "fuzz.rec");
  if (!rec) {
    EMBER_CHECK(rec.error().code() == ember::ErrorCode::kCorrupt);
    EMBER_CHECK(rec.error().message().find("fuzz.rec") != std::string::npos);
    return 0;
  }
  EMBER_CHECK(rec->num_channels >= 1 && rec->num_ranks >= 1);
  for (const auto& s : rec->channel_samples) EMBER_CHECK(s.channel < rec->num_channels);
  for (const auto& s : rec->rank_samples) EMBER_CHECK(s.rank < rec->num_ranks);
  for (const auto& b : rec->size_buckets) EMBER_CHECK(b.channel < rec->num_channels);
  const auto totals = ember::record::final_totals(*rec);
  EMBER_CHECK(totals.channels.size() == rec->num_channels);
  EMBER_CHECK(totals.ranks.size() == rec->num_ranks);
  return 0;
}
