// Size classes of the page pool and the Block handle it hands out.
//
// Eight classes, 4 KiB apart by a factor of four: 4 KiB, 16 KiB, 64 KiB,
// 256 KiB, 1 MiB, 4 MiB, 16 MiB, 64 MiB. A request goes to the smallest class
// that holds it. Every class is a multiple of 4 KiB and every block starts on a
// 4 KiB boundary of the pool's memfd, so a block can be handed to sendfile,
// mapped by a same-host peer or registered with RDMA/CUDA at page granularity.
//
// Why x4 and not jemalloc's four classes per doubling: eight classes must reach
// 64 MiB (the largest message the transports push in one piece) from a 4 KiB
// minimum, which leaves a factor of four per step. The cost is internal waste
// of up to 75% of a block for a request just above a class boundary; pool
// blocks are short-lived message and batch buffers, so the waste is transient
// and bounded by the number of messages in flight.
//
// Thread-safety: constexpr functions and a plain value type; no shared state.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

#include "common/base/check.h"

namespace ember::memory {

inline constexpr std::size_t kNumSizeClasses = 8;
inline constexpr std::size_t kMinBlockBytes = std::size_t{4} << 10;   // 4 KiB
inline constexpr std::size_t kBlockAlignBytes = kMinBlockBytes;        // every block
inline constexpr unsigned kMinBlockShift = 12;                         // log2(4 KiB)
inline constexpr unsigned kClassSpacingShift = 2;                      // x4 per class
inline constexpr std::size_t kMaxBlockBytes = kMinBlockBytes
                                              << (kClassSpacingShift * (kNumSizeClasses - 1));
static_assert(kMaxBlockBytes == std::size_t{64} << 20, "largest class is 64 MiB");

// Bytes of one block of class `size_class`. pre: size_class < kNumSizeClasses.
constexpr std::size_t size_class_bytes(std::size_t size_class) noexcept {
  return kMinBlockBytes << (kClassSpacingShift * size_class);
}

// The smallest class whose blocks hold `bytes`; 0 for bytes <= 4 KiB (also for
// 0 bytes). Returns kNumSizeClasses when bytes > kMaxBlockBytes (no class).
constexpr std::size_t size_class_for(std::size_t bytes) noexcept {
  if (bytes > kMaxBlockBytes) return kNumSizeClasses;
  // Number of 4 KiB units beyond the first, then ceil(log4(units)).
  const std::size_t units_minus_one = bytes == 0 ? 0 : (bytes - 1) >> kMinBlockShift;
  const auto bits = static_cast<std::size_t>(std::bit_width(units_minus_one));
  return (bits + 1) >> 1;
}

static_assert(size_class_for(0) == 0 && size_class_for(4096) == 0);
static_assert(size_class_for(4097) == 1 && size_class_for(16384) == 1);
static_assert(size_class_for(16385) == 2 && size_class_for(kMaxBlockBytes) == 7);
static_assert(size_class_for(kMaxBlockBytes + 1) == kNumSizeClasses);

// A block of pool memory: a view, not an owner. It is valid from the
// PagePool::allocate that returned it until it is passed to PagePool::free
// (exactly once, from any thread) or the pool is destroyed. Copies alias the
// same bytes. An empty (default) Block has data() == nullptr.
//
// Units: capacity_bytes/size_bytes in bytes; offset_bytes is the block's
// offset in the pool's memfd (PagePool::fd()), the name a peer or the kernel
// (sendfile) uses for the same bytes; data() == pool.base() + offset_bytes().
class Block {
 public:
  Block() = default;

  std::byte* data() const noexcept { return data_; }
  // Bytes the caller asked for (<= capacity_bytes()). The caller may change it.
  std::size_t size_bytes() const noexcept { return size_bytes_; }
  // Bytes usable from data(): the size of the block's class.
  std::size_t capacity_bytes() const noexcept {
    return data_ == nullptr ? 0 : size_class_bytes(size_class_);
  }
  std::size_t size_class() const noexcept { return size_class_; }
  std::uint64_t offset_bytes() const noexcept { return offset_bytes_; }
  bool empty() const noexcept { return data_ == nullptr; }
  explicit operator bool() const noexcept { return data_ != nullptr; }

  // pre: size_bytes <= capacity_bytes() (checked in debug builds; a larger
  // value is a bug).
  void set_size_bytes(std::size_t size_bytes) noexcept {
    EMBER_DCHECK_MSG(size_bytes <= capacity_bytes(), "size {} above capacity {}", size_bytes,
                     capacity_bytes());
    size_bytes_ = static_cast<std::uint32_t>(size_bytes);
  }
  // [data(), data() + size_bytes()).
  std::span<std::byte> span() const noexcept { return {data_, size_bytes_}; }
  // [data(), data() + capacity_bytes()).
  std::span<std::byte> capacity_span() const noexcept { return {data_, capacity_bytes()}; }

  friend bool operator==(const Block& a, const Block& b) noexcept {
    return a.data_ == b.data_ && a.offset_bytes_ == b.offset_bytes_ &&
           a.size_bytes_ == b.size_bytes_ && a.size_class_ == b.size_class_;
  }

 private:
  friend class PagePool;
  Block(std::byte* data, std::uint64_t offset_bytes, std::uint32_t size_bytes,
        std::uint8_t size_class) noexcept
      : data_(data), offset_bytes_(offset_bytes), size_bytes_(size_bytes),
        size_class_(size_class) {}

  std::byte* data_ = nullptr;
  std::uint64_t offset_bytes_ = 0;
  std::uint32_t size_bytes_ = 0;  // <= 64 MiB fits in 32 bits
  std::uint8_t size_class_ = 0;
};

static_assert(sizeof(Block) == 24, "Block is passed by value on hot paths");

}  // namespace ember::memory
