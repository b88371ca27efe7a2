// Test helpers for common/wire: a naive reference encoder (written from
// docs/wire-format.md, not from the encoder's code), a bitwise CRC32C, field
// patching for malformed-frame tests, and the test seed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/wire/wire_format.h"

namespace ember::wire::testing {

using Bytes = std::vector<std::byte>;

// Bitwise CRC32C (reflected polynomial 0x82F63B78), the textbook definition.
inline std::uint32_t reference_crc32c(std::span<const std::byte> bytes) {
  std::uint32_t crc = 0xFFFFFFFFu;
  for (std::byte b : bytes) {
    crc ^= static_cast<std::uint8_t>(b);
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

struct RefItem {
  Bytes payload;
  std::uint32_t flags = 0;
};

inline void put_u8(Bytes& f, std::size_t at, std::uint8_t v) { f.at(at) = std::byte{v}; }
inline void put_u16(Bytes& f, std::size_t at, std::uint16_t v) {
  for (int i = 0; i < 2; ++i) f.at(at + i) = std::byte(static_cast<std::uint8_t>(v >> (8 * i)));
}
inline void put_u32(Bytes& f, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) f.at(at + i) = std::byte(static_cast<std::uint8_t>(v >> (8 * i)));
}
inline std::uint32_t get_u32(const Bytes& f, std::size_t at) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= std::uint32_t(static_cast<std::uint8_t>(f.at(at + i))) << (8 * i);
  return v;
}

// Recomputes the crc32c field over bytes [8, f.size()), so a patched frame
// fails the structural check under test rather than the checksum.
inline void refresh_crc(Bytes& f) {
  put_u32(f, 4, reference_crc32c(std::span<const std::byte>(f).subspan(8)));
}

// Frame bytes per docs/wire-format.md, byte by byte.
inline Bytes reference_frame(const std::vector<RefItem>& items,
                             FrameKind kind = FrameKind::kBatch) {
  const std::size_t n = items.size();
  std::size_t offset = (24 + 12 * n + 7) / 8 * 8;
  Bytes f(offset, std::byte{0});
  put_u32(f, 0, 0x46424D45u);
  put_u8(f, 8, 1);
  put_u8(f, 9, static_cast<std::uint8_t>(kind));
  put_u32(f, 12, static_cast<std::uint32_t>(n));
  for (std::size_t i = 0; i < n; ++i) {
    put_u32(f, 24 + 12 * i, static_cast<std::uint32_t>(offset));
    put_u32(f, 24 + 12 * i + 4, static_cast<std::uint32_t>(items[i].payload.size()));
    put_u32(f, 24 + 12 * i + 8, items[i].flags);
    f.resize(offset, std::byte{0});
    f.insert(f.end(), items[i].payload.begin(), items[i].payload.end());
    offset = (f.size() + 7) / 8 * 8;
  }
  f.resize(offset, std::byte{0});
  put_u32(f, 16, static_cast<std::uint32_t>(f.size()));
  refresh_crc(f);
  return f;
}

// A single frame (kind 2) with frame flag 0x0001: the CRC covers only bytes
// [8, 40), its header and table (docs/wire-format.md, "Checksum").
inline Bytes reference_prefix_checksum_single(const RefItem& item) {
  Bytes f = reference_frame({item}, FrameKind::kSingle);
  put_u16(f, 10, 0x0001);
  put_u32(f, 4, reference_crc32c(std::span<const std::byte>(f).subspan(8, 32)));
  return f;
}

inline Bytes random_bytes(std::mt19937_64& rng, std::size_t n) {
  Bytes b(n);
  for (auto& x : b) x = std::byte(static_cast<std::uint8_t>(rng()));
  return b;
}

// Seed for randomized tests: EMBER_TEST_SEED when set, else random; printed
// so a failure can be replayed.
inline std::uint64_t test_seed(const char* test_name) {
  std::uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("EMBER_TEST_SEED")) seed = std::strtoull(s, nullptr, 10);
  std::printf("[ seed     ] %s: EMBER_TEST_SEED=%llu\n", test_name,
              static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  return seed;
}

inline std::span<const std::byte> as_span(const Bytes& b) { return {b.data(), b.size()}; }

}  // namespace ember::wire::testing
