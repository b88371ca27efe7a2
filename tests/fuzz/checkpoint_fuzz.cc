// Fuzz target: the checkpoint parser never crashes or reads out of bounds on
// any file image, and anything it accepts serialises back to the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "common/base/check.h"
#include "server/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto parsed = ember::server::parse_checkpoint(bytes);
  if (!parsed) {
    EMBER_CHECK(parsed.error().code() == ember::ErrorCode::kCorrupt);
    return 0;
  }
  auto again = ember::server::serialize_checkpoint(*parsed);
  EMBER_CHECK_MSG(again.size() == size && std::memcmp(again.data(), data, size) == 0,
                  "re-serialised checkpoint differs ({} vs {} bytes)", again.size(), size);
  return 0;
}
