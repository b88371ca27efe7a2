// CRC32C (Castagnoli) over byte ranges, backed by ISA-L's crc32_iscsi.
//
// Convention: the standard CRC-32C (RFC 3720 B.4): reflected polynomial
// 0x82F63B78, init 0xFFFFFFFF, final xor 0xFFFFFFFF; crc32c("123456789") ==
// 0xE3069283. crc32c_extend(crc32c(a), b) == crc32c(a ++ b), so a checksum can
// be computed piecewise as bytes arrive or over a gather list.
//
// ISA-L picks an AVX-512/AVX2/SSE4.2 kernel at run time (~46 GB/s on the
// development machine) and leaves the upper halves of the YMM/ZMM registers
// dirty; every call here ends with _mm256_zeroupper() so that legacy-SSE code
// that runs next (memcpy in glibc, libstdc++) does not pay the AVX-SSE
// transition penalty (measured ~4x slowdown without it).
//
// Thread-safety: pure functions; any thread. No allocation, never blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace ember::wire {

// CRC32C of `bytes` (any length, any alignment).
std::uint32_t crc32c(std::span<const std::byte> bytes) noexcept;

// Continues a CRC32C: crc32c_extend(crc32c(a), b) == crc32c(a followed by b).
// crc32c_extend(0, b) == crc32c(b) (0 is the CRC of the empty string).
std::uint32_t crc32c_extend(std::uint32_t crc, std::span<const std::byte> bytes) noexcept;

}  // namespace ember::wire
