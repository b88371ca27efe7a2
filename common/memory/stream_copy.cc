// Non-temporal copy; contract in stream_copy.h.
#include "common/memory/stream_copy.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace ember::memory {

void stream_copy(void* dst, const void* src, std::size_t bytes) noexcept {
#if defined(__x86_64__)
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  // Head: up to the destination's next 64-byte boundary, so every stream
  // store below writes whole cache lines.
  const std::size_t head =
      std::min<std::size_t>(bytes, (64 - reinterpret_cast<std::uintptr_t>(d) % 64) % 64);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  const std::size_t lines = bytes / 64;
  for (std::size_t i = 0; i < lines; ++i) {
    const auto* in = reinterpret_cast<const __m128i*>(s + i * 64);
    auto* out = reinterpret_cast<__m128i*>(d + i * 64);
    const __m128i a = _mm_loadu_si128(in);
    const __m128i b = _mm_loadu_si128(in + 1);
    const __m128i c = _mm_loadu_si128(in + 2);
    const __m128i e = _mm_loadu_si128(in + 3);
    _mm_stream_si128(out, a);
    _mm_stream_si128(out + 1, b);
    _mm_stream_si128(out + 2, c);
    _mm_stream_si128(out + 3, e);
  }
  _mm_sfence();
  std::memcpy(d + lines * 64, s + lines * 64, bytes - lines * 64);
#else
  std::memcpy(dst, src, bytes);
#endif
}

std::size_t last_level_cache_bytes() noexcept {
  static const std::size_t bytes = [] {
    for (int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
      const long v = ::sysconf(name);
      if (v > 0) return static_cast<std::size_t>(v);
    }
    return std::size_t{32} << 20;
  }();
  return bytes;
}

bool use_stream_copy(std::size_t tensor_bytes) noexcept {
  return tensor_bytes >= last_level_cache_bytes() / 4;
}

}  // namespace ember::memory
