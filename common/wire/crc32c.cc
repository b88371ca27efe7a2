// CRC32C through ISA-L (see crc32c.h for the convention and the zeroupper note).
#include "common/wire/crc32c.h"

#include <immintrin.h>
#include <isa-l/crc.h>

#include <algorithm>
#include <climits>

namespace ember::wire {
namespace {

// ISA-L takes an int length; feed it in pieces well below INT_MAX.
constexpr std::size_t kMaxPieceBytes = std::size_t{1} << 30;

// vzeroupper needs AVX at compile time (target attribute, so the rest of the
// file stays baseline x86-64) and at run time (SIGILL otherwise); a CPU
// without AVX also has no dirty upper state to clear.
__attribute__((target("avx"))) void zero_upper_avx() noexcept { _mm256_zeroupper(); }
bool cpu_has_avx() noexcept {
  static const bool has_avx = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") != 0;
  }();
  return has_avx;
}

// ISA-L's crc32_iscsi(buf, len, init) neither inverts the input state nor the
// result: crc32_iscsi(s, n, 0xFFFFFFFF) ^ 0xFFFFFFFF is the standard CRC32C,
// and its raw return value chains into the next call as `init`.
std::uint32_t raw_update(std::uint32_t state, std::span<const std::byte> bytes) noexcept {
  // crc32_iscsi takes a non-const pointer but does not write through it.
  auto* p = const_cast<unsigned char*>(reinterpret_cast<const unsigned char*>(bytes.data()));
  std::size_t left = bytes.size();
  while (left > 0) {
    const std::size_t n = std::min(left, kMaxPieceBytes);
    state = crc32_iscsi(p, static_cast<int>(n), state);
    p += n;
    left -= n;
  }
  // ISA-L's AVX kernels leave the upper YMM state dirty (see crc32c.h).
  if (cpu_has_avx()) zero_upper_avx();
  return state;
}

}  // namespace

std::uint32_t crc32c_extend(std::uint32_t crc, std::span<const std::byte> bytes) noexcept {
  return ~raw_update(~crc, bytes);
}

std::uint32_t crc32c(std::span<const std::byte> bytes) noexcept { return crc32c_extend(0, bytes); }

}  // namespace ember::wire
