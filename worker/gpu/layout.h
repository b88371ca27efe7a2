// The SymBuffer layout: the one place where byte offsets inside the GPU
// worker's symmetric buffer are computed, for host code and kernels alike.
//
// A SymBuffer is one allocation (device memory, or pinned host memory
// registered with CUDA) laid out channel → destination rank → {send, recv}:
//
//   [ch 0][rank 0][send: ChannelMeta | ring data][recv: ChannelMeta | ring data]
//         [rank 1][send ...][recv ...] ... [ch 1] ...
//
// Every region (ChannelMeta, ring data) starts on a 128-byte boundary, and the
// ring capacity is a multiple of 128, so two lanes never share a line pair
// (the adjacent-line prefetcher's unit, see common/base/constants.h). A ring
// is addressed by 64-bit monotonic byte positions: `head` (next byte the
// consumer reads) and `tail` (end of the bytes the producer has published);
// the byte at position p lives at data + p % ring_bytes. tail - head is the
// number of readable bytes and never exceeds ring_bytes.
//
// Invariant: regions are disjoint, 128-byte aligned and in the order above;
// layout_regions_are_disjoint() checks it (static_asserts below, and a unit
// test over many shapes). Nothing else in Ember computes these offsets: kernels,
// the CPU reference and the transport all call SymBufferLayout.
//
// Thread-safety: SymBufferLayout is a plain value; functions are pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "common/base/constants.h"
#include "common/placement/placement.h"  // EMBER_HOST_DEVICE

namespace ember::gpu {

// Alignment of every region of a SymBuffer, in bytes.
inline constexpr std::uint64_t kRegionAlignBytes = 128;
static_assert(kRegionAlignBytes == kFalseSharingBytes,
              "SymBuffer regions are padded to the false-sharing unit");

// Which half of a (channel, rank) pair: send rings carry packed gradients out,
// recv rings hold the peer's reply (pulled parameters) to unpack.
enum class Direction : std::uint32_t { kSend = 0, kRecv = 1 };

// Positions of one ring, in bytes since the ring was created (never wrap).
// head is written only by the consumer (release) and read by the producer
// (acquire); tail the other way round. Each sits on its own 128-byte line.
struct alignas(128) ChannelMeta {
  std::uint64_t head;
  std::uint8_t head_pad[120];
  std::uint64_t tail;
  std::uint8_t tail_pad[120];
};
static_assert(sizeof(ChannelMeta) == 256, "ChannelMeta is two 128-byte lines");
static_assert(alignof(ChannelMeta) == 128, "ChannelMeta starts a line pair");
static_assert(offsetof(ChannelMeta, head) == 0, "head on the first line");
static_assert(offsetof(ChannelMeta, tail) == 128, "tail on its own line");

struct SymBufferLayout {
  std::uint32_t num_channels = 0;  // lanes; > 0
  std::uint32_t num_ranks = 0;     // destination server ranks; > 0
  std::uint64_t ring_bytes = 0;    // data capacity of one ring; a positive multiple of 128

  // Largest ring and lane count accepted, so every offset fits in 64 bits
  // with room to spare (2^40 bytes = 1 TiB per ring, 2^20 rings).
  static constexpr std::uint64_t kMaxRingBytes = std::uint64_t{1} << 40;
  static constexpr std::uint64_t kMaxRings = std::uint64_t{1} << 20;

  // Rings per direction: one per (channel, rank).
  EMBER_HOST_DEVICE constexpr std::uint64_t num_rings() const {
    return std::uint64_t{num_channels} * num_ranks;
  }
  // Index of the (channel, rank) ring, channel-major: the order of regions.
  EMBER_HOST_DEVICE constexpr std::uint64_t ring_index(std::uint32_t channel,
                                                       std::uint32_t rank) const {
    return std::uint64_t{channel} * num_ranks + rank;
  }
  EMBER_HOST_DEVICE constexpr std::uint32_t channel_of_ring(std::uint64_t ring) const {
    return static_cast<std::uint32_t>(ring / num_ranks);
  }
  EMBER_HOST_DEVICE constexpr std::uint32_t rank_of_ring(std::uint64_t ring) const {
    return static_cast<std::uint32_t>(ring % num_ranks);
  }
  // Bytes of one region pair member: its ChannelMeta then its ring data.
  EMBER_HOST_DEVICE constexpr std::uint64_t region_stride_bytes() const {
    return sizeof(ChannelMeta) + ring_bytes;
  }
  // Offset of the ChannelMeta of (ring, direction) from the buffer base.
  EMBER_HOST_DEVICE constexpr std::uint64_t meta_offset(std::uint64_t ring, Direction d) const {
    return (ring * 2 + static_cast<std::uint64_t>(d)) * region_stride_bytes();
  }
  EMBER_HOST_DEVICE constexpr std::uint64_t meta_offset(std::uint32_t channel, std::uint32_t rank,
                                                        Direction d) const {
    return meta_offset(ring_index(channel, rank), d);
  }
  // Offset of the first ring-data byte of (ring, direction).
  EMBER_HOST_DEVICE constexpr std::uint64_t data_offset(std::uint64_t ring, Direction d) const {
    return meta_offset(ring, d) + sizeof(ChannelMeta);
  }
  EMBER_HOST_DEVICE constexpr std::uint64_t data_offset(std::uint32_t channel, std::uint32_t rank,
                                                        Direction d) const {
    return data_offset(ring_index(channel, rank), d);
  }
  // A channel's regions (all ranks, both directions) are contiguous.
  EMBER_HOST_DEVICE constexpr std::uint64_t channel_offset(std::uint32_t channel) const {
    return meta_offset(ring_index(channel, 0), Direction::kSend);
  }
  EMBER_HOST_DEVICE constexpr std::uint64_t channel_bytes() const {
    return std::uint64_t{num_ranks} * 2 * region_stride_bytes();
  }
  EMBER_HOST_DEVICE constexpr std::uint64_t total_bytes() const {
    return std::uint64_t{num_channels} * channel_bytes();
  }

  // Typed addresses inside a buffer whose first byte is `base`
  // (128-byte aligned).
  EMBER_HOST_DEVICE ChannelMeta* meta(std::byte* base, std::uint64_t ring, Direction d) const {
    return reinterpret_cast<ChannelMeta*>(base + meta_offset(ring, d));
  }
  EMBER_HOST_DEVICE std::byte* data(std::byte* base, std::uint64_t ring, Direction d) const {
    return base + data_offset(ring, d);
  }

  // True when the fields are in range (see the field comments and kMax*).
  EMBER_HOST_DEVICE constexpr bool valid() const {
    return num_channels > 0 && num_ranks > 0 && ring_bytes > 0 &&
           ring_bytes % kRegionAlignBytes == 0 && ring_bytes <= kMaxRingBytes &&
           num_rings() <= kMaxRings;
  }

  EMBER_HOST_DEVICE constexpr bool operator==(const SymBufferLayout& o) const {
    return num_channels == o.num_channels && num_ranks == o.num_ranks &&
           ring_bytes == o.ring_bytes;
  }
};

// Checks the layout invariant by walking every region in order: each starts
// 128-byte aligned exactly where the previous one ended (no overlap, no
// gap), metas are followed by their data, and the last region ends at
// total_bytes(). O(num_rings); constexpr so static_asserts can use it.
constexpr bool layout_regions_are_disjoint(const SymBufferLayout& l) {
  if (!l.valid()) return false;
  std::uint64_t expected = 0;
  for (std::uint32_t c = 0; c < l.num_channels; ++c) {
    if (l.channel_offset(c) != expected) return false;
    for (std::uint32_t r = 0; r < l.num_ranks; ++r) {
      for (Direction d : {Direction::kSend, Direction::kRecv}) {
        const std::uint64_t meta = l.meta_offset(c, r, d);
        const std::uint64_t data = l.data_offset(c, r, d);
        if (meta != expected || meta % kRegionAlignBytes != 0) return false;
        if (data != meta + sizeof(ChannelMeta) || data % kRegionAlignBytes != 0) return false;
        expected = data + l.ring_bytes;
      }
    }
  }
  return expected == l.total_bytes();
}

static_assert(layout_regions_are_disjoint(SymBufferLayout{1, 1, 128}));
static_assert(layout_regions_are_disjoint(SymBufferLayout{3, 2, 384}));
static_assert(layout_regions_are_disjoint(SymBufferLayout{8, 5, 1 << 20}));
static_assert(!layout_regions_are_disjoint(SymBufferLayout{2, 2, 100}), "unaligned ring rejected");
static_assert(SymBufferLayout{2, 3, 128}.data_offset(1, 2, Direction::kRecv) ==
                  ((1 * 3 + 2) * 2 + 1) * (256 + 128) + 256,
              "channel-major, then rank, then send/recv");

}  // namespace ember::gpu
