// Machine constants shared by every module.
//
// kCacheLineBytes is the x86-64 cache line. Positions that two cores write
// (ring head/tail, GPU channel head/tail) are padded to kFalseSharingBytes:
// the adjacent-line prefetcher pulls lines in 128-byte pairs, so two hot
// fields 64 bytes apart still ping-pong. We use our own constants rather than
// std::hardware_destructive_interference_size (g++ 12 warns on its use and
// its value may differ between translation units).
#pragma once

#include <cstddef>

namespace ember {

inline constexpr std::size_t kCacheLineBytes = 64;
inline constexpr std::size_t kFalseSharingBytes = 128;
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;  // 2 MiB
inline constexpr std::size_t kSmallPageBytes = std::size_t{4} << 10;  // 4 KiB

}  // namespace ember
