// Fuzz target: the protocol decoder never crashes or reads out of bounds, and
// anything it accepts re-encodes to exactly the same bytes (so no field is
// silently dropped or normalised).
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "common/base/check.h"
#include "common/proto/message.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto m = ember::proto::decode(bytes);
  if (!m) {
    EMBER_CHECK(!m.error().message().empty());
    return 0;
  }
  // A request's reply placement (kFlagInPlace) is its inline payload on the
  // wire and decoded apart; anything else is the payload, ending the bytes.
  std::span<const std::byte> payload = m->payload;
  std::array<std::byte, sizeof(ember::proto::ReplyPlacement)> placement{};
  if (m->placement) {
    EMBER_CHECK(m->payload.empty());
    placement = ember::proto::encode_body(*m->placement);
    payload = placement;
  } else {
    EMBER_CHECK(m->payload.data() + m->payload.size() == bytes.data() + bytes.size());
  }
  auto again = ember::proto::encode_message(m->header, m->shape(), payload);
  EMBER_CHECK_MSG(again.size() == size && std::memcmp(again.data(), data, size) == 0,
                  "re-encoding differs ({} vs {} bytes)", again.size(), size);
  return 0;
}
