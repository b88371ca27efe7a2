// A lane: one direction of one shm channel, a single-producer single-consumer
// ring of fixed-size slots in a memfd that both processes map.
//
// Segment layout (all integers little-endian, host order; same host only):
//   [0, 128)         LaneConfig: magic, version, slot_bytes, num_slots, credits
//   [128, 256)       head: slots published by the producer (u64, producer writes)
//   [256, 384)       tail: slots consumed by the consumer (u64, consumer writes)
//   [384, 512)       consumer_sleeping (u32): the consumer of this lane is, or is
//                    about to be, asleep on its doorbell eventfd; the producer
//                    rings that doorbell after publishing. The consuming side
//                    may have another thread consume meanwhile
//                    (Connection::poll): it clears the word while it does,
//                    then sets it again, fences and re-checks head, waking
//                    its own I/O thread for what arrived after its last look
//   [512, 640)       producer_waiting (u32): the producer waits for a free slot
//                    or a released token; the consumer rings the producer's
//                    doorbell after freeing one
//   [640, 768)       release_head: tokens released (u64, the consumer writes)
//   [768, 896)       release_tail: tokens reclaimed (u64, the producer writes)
//   [896, 1024)      memory_revoked (u32): set by this lane's producer when its
//                    connection is over; from then on the consumer must not
//                    write into the producer's memory (Connection::write_peer_memory)
//   [1024, 1152)     memory_writers (u32): writes into the producer's memory the
//                    consumer has in progress (it adds 1, re-checks
//                    memory_revoked, writes, subtracts 1); only the lane of
//                    channel 0 carries these two words for the connection
//   [1152, 1280)     consumer_detached (u32): set by the consumer when it has torn
//                    its side down: it consumes no more slots, so a large
//                    message at or past `tail` will never be read
//   [1280, 1280 + 8 credits)    release ring: u64 tokens, index = position % credits
//   [align 64 ...)   kWriteWindows WriteWindow entries (8 bytes each): write windows
//                    of the producer's memory (Connection::open_write_window); only
//                    the lane of channel 0 uses them
//   [align 4096 ...) num_slots slots of slot_bytes each
// Every position is a 64-bit counter that never wraps in practice; index =
// position % count (counts are powers of two). Each hot field sits on its own
// 128-byte pair of cache lines (kFalseSharingBytes).
//
// Slot layout: a 64-byte SlotHeader, then the slot's body:
//   kind 1 (batch):    body = one common/wire batch frame of header.frame_bytes,
//                      starting at body offset header.frame_offset
//   kind 2 (large):    no body; the payload is [offset, offset + length) of the
//                      producer's registered region header.region_id, lent
//                      until the consumer puts header.token on the release ring
//   kind 3 (fragment): body = header.frame_bytes bytes of a message of
//                      header.length bytes, at message offset header.offset
//                      (a large message from unregistered memory, copied
//                      through the ring in order; fragments of one message
//                      are consecutive on the lane)
//
// Memory ordering: the producer fills a slot, then stores head with release;
// the consumer loads head with acquire before reading slots, and stores tail
// with release after it is done with them (the producer loads tail with
// acquire before reusing a slot). The release ring works the same way with
// roles swapped. The sleeping/waiting flags follow the Dekker protocol of
// common/ring/parker.h (seq_cst store, seq_cst fence, re-check), and so do
// memory_revoked and memory_writers (seq_cst on both sides): a writer that
// saw memory_revoked == 0 after its increment is counted by a producer that
// reads memory_writers after setting memory_revoked.
//
// Trust: a lane's peer is a process of the same user (the listener checks
// SO_PEERCRED), but it may crash at any point or be buggy, so every value
// read from shared memory is range-checked before use (positions, kinds,
// offsets, lengths, tokens) and frames are verified by wire::decode_frame.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "common/base/constants.h"
#include "common/base/error.h"

namespace ember::transport::shm {

inline constexpr std::uint32_t kLaneMagic = 0x4C424D45u;  // "EMBL"
inline constexpr std::uint32_t kLaneVersion = 2;
inline constexpr std::size_t kSlotHeaderBytes = 64;

enum class SlotKind : std::uint32_t { kBatch = 1, kLarge = 2, kFragment = 3 };

// Write windows: how many a connection can have open at once, and the bits
// of a window id that name its entry (the rest is a generation, never 0, so
// that a late write for a closed window finds another id in the entry).
inline constexpr std::uint32_t kWriteWindows = 4096;
inline constexpr std::uint32_t kWriteWindowIndexBits = 12;
static_assert(kWriteWindows == 1u << kWriteWindowIndexBits);

// One write window, in the lane of the memory's owner. The owner stores the
// window's id in `armed` to open it and 0 to close it; the writer adds 1 to
// `writers`, checks that `armed` still holds its id, copies, subtracts 1
// (seq_cst on both sides, as memory_revoked/memory_writers), so an owner that
// closed the window and then saw writers == 0 knows no write is in progress
// and none will start.
struct WriteWindow {
  std::atomic<std::uint32_t> armed;
  std::atomic<std::uint32_t> writers;
};
static_assert(sizeof(WriteWindow) == 8);

struct SlotHeader {
  std::uint32_t kind;          // SlotKind
  std::uint32_t frame_offset;  // batch: frame start in the body
  std::uint32_t frame_bytes;   // batch: frame length; fragment: bytes in this slot
  std::uint32_t region_id;     // large: producer's region
  std::uint64_t offset;        // large: byte offset in the region; fragment: offset in message
  std::uint64_t length;        // large / fragment: message length in bytes
  std::uint64_t token;         // large: returned on the release ring
  std::uint8_t reserved[24];
};
static_assert(sizeof(SlotHeader) == kSlotHeaderBytes);

struct alignas(kFalseSharingBytes) PaddedU64 {
  std::atomic<std::uint64_t> value{0};
};
struct alignas(kFalseSharingBytes) PaddedU32 {
  std::atomic<std::uint32_t> value{0};
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "shm lanes need lock-free 64-bit atomics (shared between processes)");

struct alignas(kFalseSharingBytes) LaneConfig {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint32_t slot_bytes;
  std::uint32_t num_slots;
  std::uint32_t credits;
};

struct LaneControl {
  LaneConfig config;
  PaddedU64 head;
  PaddedU64 tail;
  PaddedU32 consumer_sleeping;
  PaddedU32 producer_waiting;
  PaddedU64 release_head;
  PaddedU64 release_tail;
  PaddedU32 memory_revoked;
  PaddedU32 memory_writers;
  PaddedU32 consumer_detached;
  // std::atomic<std::uint64_t> release_ring[credits] follows.
};
static_assert(sizeof(LaneControl) == 10 * kFalseSharingBytes);

// Geometry of a lane; both sides compute it from the config values.
struct LaneGeometry {
  std::uint32_t slot_bytes = 0;
  std::uint32_t num_slots = 0;
  std::uint32_t credits = 0;
  std::size_t windows_offset() const noexcept {
    const std::size_t ctrl = sizeof(LaneControl) + 8 * std::size_t{credits};
    return (ctrl + 63) / 64 * 64;
  }
  std::size_t slots_offset() const noexcept {
    const std::size_t end = windows_offset() + sizeof(WriteWindow) * kWriteWindows;
    return (end + kSmallPageBytes - 1) / kSmallPageBytes * kSmallPageBytes;
  }
  std::size_t total_bytes() const noexcept {
    const std::size_t t = slots_offset() + std::size_t{slot_bytes} * num_slots;
    return (t + kSmallPageBytes - 1) / kSmallPageBytes * kSmallPageBytes;
  }
};

// A mapped lane (either end). Owns the mapping; not the fd.
class Lane {
 public:
  Lane() = default;
  // Creates a memfd of the geometry's size, maps it and writes the config.
  // Returns the lane and the memfd (caller owns it). Errors: kIo.
  static Result<Lane> create(const LaneGeometry& geometry, int* fd_out);
  // Maps a peer's lane and checks its config against `expected`.
  // Errors: kIo (fstat/mmap), kProtocol (size, magic, version or geometry differ).
  static Result<Lane> attach(int fd, const LaneGeometry& expected);

  Lane(Lane&& other) noexcept { *this = std::move(other); }
  Lane& operator=(Lane&& other) noexcept;
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  ~Lane();

  LaneControl& control() const noexcept { return *reinterpret_cast<LaneControl*>(base_); }
  std::atomic<std::uint64_t>& release_slot(std::uint64_t position) const noexcept {
    auto* ring = reinterpret_cast<std::atomic<std::uint64_t>*>(base_ + sizeof(LaneControl));
    return ring[position & (geometry_.credits - 1)];
  }
  WriteWindow& window(std::uint32_t index) const noexcept {
    return reinterpret_cast<WriteWindow*>(base_ + geometry_.windows_offset())[index & (kWriteWindows - 1)];
  }
  std::byte* slot(std::uint64_t position) const noexcept {
    return base_ + geometry_.slots_offset() +
           std::size_t{geometry_.slot_bytes} * (position & (geometry_.num_slots - 1));
  }
  const LaneGeometry& geometry() const noexcept { return geometry_; }
  std::size_t body_bytes() const noexcept { return geometry_.slot_bytes - kSlotHeaderBytes; }
  bool mapped() const noexcept { return base_ != nullptr; }

 private:
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
  LaneGeometry geometry_;
};

}  // namespace ember::transport::shm
