// Transport control items: heartbeats and the orderly-close goodbye travel
// in the same frames as user messages, as items whose flags carry
// kItemFlagControl. User messages always have item flags 0; any other flag
// value from a peer is a protocol error.
//
// Control item payload (kControlBytes = 8, little-endian):
//   0  u8   ControlType
//   1  u8[7] zero
//
// Thread-safety: constants and pure functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

namespace ember::transport {

inline constexpr std::uint32_t kItemFlagControl = 0x80000000u;
inline constexpr std::size_t kControlBytes = 8;

enum class ControlType : std::uint8_t {
  kHeartbeat = 1,  // "I am alive"; sent after heartbeat_interval of send silence
  kGoodbye = 2,    // orderly close: nothing follows on this channel from the sender
};

inline std::array<std::byte, kControlBytes> control_payload(ControlType type) {
  std::array<std::byte, kControlBytes> p{};
  p[0] = static_cast<std::byte>(type);
  return p;
}

// The control type in `payload`, or nullopt when the payload is malformed.
inline std::optional<ControlType> parse_control(std::span<const std::byte> payload) {
  if (payload.size() != kControlBytes) return std::nullopt;
  for (std::size_t i = 1; i < kControlBytes; ++i) {
    if (payload[i] != std::byte{0}) return std::nullopt;
  }
  const auto t = static_cast<std::uint8_t>(payload[0]);
  if (t != 1 && t != 2) return std::nullopt;
  return static_cast<ControlType>(t);
}

}  // namespace ember::transport
