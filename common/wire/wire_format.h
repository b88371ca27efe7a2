// Byte layout of an Ember frame (version 1), shared by encoder and decoder.
//
// A frame is a header, an item table, then the payloads:
//
//   [0, 24)                 FrameHeaderWire
//   [24, 24 + 12 n)         n × ItemEntryWire (offset, length, flags)
//   [.., prefix_bytes(n))   zero padding to a multiple of 8
//   [prefix_bytes(n), F)    payloads, packed in table order, each starting at
//                           a multiple of 8 (zero padding between), F = frame_bytes,
//                           itself a multiple of 8 (zero padding after the last)
//
// All integers are little-endian; offsets are bytes from the frame's first
// byte. The CRC32C (Castagnoli, the iSCSI polynomial 0x1EDC6F41, reflected,
// init and final xor 0xFFFFFFFF) covers frame bytes [8, frame_bytes): everything
// after the crc32c field, so it is one contiguous pass. A single frame with
// kFrameFlagPrefixChecksum set covers only [8, prefix_bytes): its header and
// table, not its payload (see crc_end()). The magic is not covered; it is
// compared exactly. docs/wire-format.md describes the same
// layout byte by byte; the static_asserts below pin it.
//
// The layout is canonical: given the item lengths there is exactly one valid
// frame (the decoder rejects any other offsets). Every payload starts 8-byte
// aligned relative to the frame, and frames are a multiple of 8 bytes, so in a
// receive buffer that starts 8-aligned every payload of every frame is 8-aligned
// (safe to view as float/int64 arrays).
//
// Thread-safety: constants and pure functions only.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ember::wire {

static_assert(std::endian::native == std::endian::little,
              "Ember's wire structs are read with memcpy: add byte swaps in "
              "common/wire/wire_format.h (load_header/store_header) to port to a "
              "big-endian host");

// "EMBF" in memory order (bytes 0x45 0x4D 0x42 0x46).
inline constexpr std::uint32_t kMagic = 0x46424D45u;
inline constexpr std::uint8_t kVersion = 1;

enum class FrameKind : std::uint8_t {
  kBatch = 1,   // small messages packed by BatchEncoder (any item_count >= 1)
  kSingle = 2,  // one large message, written by encode_single (item_count == 1)
};

// Frame header, 24 bytes at frame offset 0.
struct FrameHeaderWire {
  std::uint32_t magic;        // kMagic
  std::uint32_t crc32c;       // CRC32C of frame bytes [8, crc_end()): the whole frame, or [8, 40)
  std::uint8_t version;       // kVersion
  std::uint8_t kind;          // FrameKind
  std::uint16_t flags;        // frame flags: 0, or kFrameFlagPrefixChecksum on a kSingle frame
  std::uint32_t item_count;   // number of table entries, >= 1
  std::uint32_t frame_bytes;  // whole frame including this header; multiple of 8
  std::uint32_t reserved;     // must be 0 in version 1
};
static_assert(sizeof(FrameHeaderWire) == 24);
static_assert(offsetof(FrameHeaderWire, magic) == 0);
static_assert(offsetof(FrameHeaderWire, crc32c) == 4);
static_assert(offsetof(FrameHeaderWire, version) == 8);
static_assert(offsetof(FrameHeaderWire, kind) == 9);
static_assert(offsetof(FrameHeaderWire, flags) == 10);
static_assert(offsetof(FrameHeaderWire, item_count) == 12);
static_assert(offsetof(FrameHeaderWire, frame_bytes) == 16);
static_assert(offsetof(FrameHeaderWire, reserved) == 20);

// One item table entry, 12 bytes, entry i at frame offset 24 + 12 i.
struct ItemEntryWire {
  std::uint32_t offset;  // payload's first byte, from the frame's first byte
  std::uint32_t length;  // payload bytes (0 allowed)
  std::uint32_t flags;   // opaque to the framer; carried for the protocol layer
};
static_assert(sizeof(ItemEntryWire) == 12);
static_assert(offsetof(ItemEntryWire, offset) == 0);
static_assert(offsetof(ItemEntryWire, length) == 4);
static_assert(offsetof(ItemEntryWire, flags) == 8);

inline constexpr std::size_t kHeaderBytes = sizeof(FrameHeaderWire);
inline constexpr std::size_t kItemEntryBytes = sizeof(ItemEntryWire);
inline constexpr std::size_t kAlignBytes = 8;        // payload and frame alignment
inline constexpr std::size_t kCrcCoverageBegin = 8;  // CRC covers [8, crc_end(...))
// Largest frame the format can describe (frame_bytes is a uint32, multiple of 8).
inline constexpr std::size_t kMaxFrameBytes = 0xFFFFFFF8u;

inline constexpr std::size_t align_up8(std::size_t n) { return (n + 7) & ~std::size_t{7}; }

// Frame flag bit 0, allowed on kSingle frames only: the CRC32C covers the
// header and table, [8, kSinglePrefixBytes), and not the payload or its
// padding. The payload's integrity is then left to the transport (TCP's own
// checksum, RDMA's ICRC); a flipped flag bit still fails the prefix CRC, since
// `flags` lies inside it. Set by encode_single(..., Checksum::kPrefix) (config
// [communication] payload_checksum = false). Receivers built before this flag
// existed reject it ("unknown frame flags 0x0001").
inline constexpr std::uint16_t kFrameFlagPrefixChecksum = 0x0001;
// Every frame flag a receiver of this build accepts.
inline constexpr std::uint16_t kKnownFrameFlags = kFrameFlagPrefixChecksum;

// Header + table + padding for n items: where the first payload starts.
inline constexpr std::size_t prefix_bytes(std::size_t item_count) {
  return align_up8(kHeaderBytes + kItemEntryBytes * item_count);
}

// End of the CRC32C's coverage, [kCrcCoverageBegin, crc_end): the whole frame,
// or only its header and table under kFrameFlagPrefixChecksum. `flags`,
// `item_count` and `frame_bytes` as in the (checked) header.
inline constexpr std::size_t crc_end(std::uint16_t flags, std::size_t item_count,
                                     std::size_t frame_bytes) {
  return (flags & kFrameFlagPrefixChecksum) != 0 ? prefix_bytes(item_count) : frame_bytes;
}

// Smallest valid frame: one zero-length item.
inline constexpr std::size_t kMinFrameBytes = prefix_bytes(1);
// Header + table of a kSingle frame; its payload starts here.
inline constexpr std::size_t kSinglePrefixBytes = prefix_bytes(1);
static_assert(kMinFrameBytes == 40 && kSinglePrefixBytes == 40);

// Most items a frame of frame_bytes can hold (all zero-length).
inline constexpr std::size_t max_items_in(std::size_t frame_bytes) {
  return frame_bytes < kMinFrameBytes ? 0 : (frame_bytes - kHeaderBytes) / kItemEntryBytes;
}

// Loads/stores through memcpy: no alignment or aliasing assumptions on `p`.
inline FrameHeaderWire load_header(const std::byte* p) {
  FrameHeaderWire h;
  std::memcpy(&h, p, sizeof h);
  return h;
}
inline void store_header(std::byte* p, const FrameHeaderWire& h) { std::memcpy(p, &h, sizeof h); }
inline ItemEntryWire load_entry(const std::byte* frame, std::size_t index) {
  ItemEntryWire e;
  std::memcpy(&e, frame + kHeaderBytes + index * kItemEntryBytes, sizeof e);
  return e;
}
inline void store_entry(std::byte* frame, std::size_t index, const ItemEntryWire& e) {
  std::memcpy(frame + kHeaderBytes + index * kItemEntryBytes, &e, sizeof e);
}

}  // namespace ember::wire
