// Plain structs of a pack plan as the kernels and the CPU reference read
// them (uploaded to device memory as is), plus the status record both write
// when a step fails. Built by PackPlan (pack_plan.h); nothing here allocates.
//
// A plan cuts every tensor into chunks (common/placement), gives each chunk a
// record in the ring of its (channel, server rank) at a fixed byte position
// relative to the ring's position at the start of the step, and splits each
// record into tiles of at most kTileElements elements: the unit of work of
// one warp. Records of a ring are consecutive and in tensor order.
//
// Thread-safety: plain values.
#pragma once

#include <cstdint>

#include "common/placement/placement.h"  // EMBER_HOST_DEVICE

namespace ember::gpu {

// Elements one warp packs or unpacks as one unit of work (8 KiB of fp32).
// A multiple of 4 (float4 accesses) whose byte size in every codec keeps the
// payload of each tile 16-byte aligned.
inline constexpr std::uint32_t kTileElements = 2048;
static_assert(kTileElements % 16 == 0);

// Marks a state offset of a tensor whose group keeps no such state.
inline constexpr std::uint64_t kNoState = ~std::uint64_t{0};

// One chunk of one tensor: one record in one ring. 64 bytes.
struct PlanRecord {
  std::uint64_t key;              // tensor key
  std::uint64_t elem_offset;      // first element of the chunk within the tensor
  std::uint64_t rel_pos;          // byte position from the ring's step base (multiple of 16)
  std::uint64_t residual_offset;  // element index of the chunk's first residual, or kNoState
  std::uint64_t ref_offset;       // element index of the chunk's first reference, or kNoState
  std::uint32_t tensor;           // index in the plan's tensor list
  std::uint32_t chunk_index;      // chunk number within the tensor
  std::uint32_t num_elements;     // elements of the chunk (0 only for an empty tensor)
  std::uint32_t ring;             // SymBufferLayout::ring_index(channel, server rank)
  std::uint32_t group;            // key group (index into the plan's GroupParams)
  std::uint32_t first_tile;       // index of the record's first tile
};
static_assert(sizeof(PlanRecord) == 64);

// Tiles of a record of n elements (an empty record still has one: it
// writes the header).
EMBER_HOST_DEVICE constexpr std::uint32_t record_num_tiles(std::uint32_t num_elements) {
  return num_elements == 0 ? 1u : (num_elements + kTileElements - 1) / kTileElements;
}

inline constexpr std::uint32_t kTileFirst = 1;  // the tile writes/reads the record header
inline constexpr std::uint32_t kTileLast = 2;   // the tile writes the record's padding

struct PlanTile {
  std::uint32_t record;        // index of its record
  std::uint32_t elem_begin;    // first element of the tile within the record
  std::uint32_t num_elements;  // ≤ kTileElements
  std::uint32_t flags;         // kTileFirst | kTileLast
};
static_assert(sizeof(PlanTile) == 16);

// Why a pack/unpack step stopped. Stable values (reported in errors).
enum class StepStatusCode : std::uint32_t {
  kOk = 0,
  kSendRingFull = 1,    // bounded wait for space in a send ring timed out
  kRecvRingEmpty = 2,   // bounded wait for a whole step of data in a recv ring timed out
  kHeaderMismatch = 3,  // a received record does not match the plan
  kMisaligned = 4,      // a ring position is not a multiple of 16
  kRingCorrupt = 5,     // tail - head exceeds the capacity
  kNoSpace = 6,         // loopback: the recv ring cannot take the send ring's bytes
};

// First failure of a step, written once (the first writer wins). Kernels and
// the CPU reference fill it the same way; status_to_error() (status.h) turns
// it into an Error.
struct StepStatus {
  std::uint32_t code;         // StepStatusCode
  std::uint32_t ring;         // ring index (channel * num_ranks + rank)
  std::uint32_t direction;    // Direction of that ring
  std::uint32_t record;       // record index (kHeaderMismatch)
  std::uint64_t head;         // ring positions seen last
  std::uint64_t tail;
  std::uint64_t need_bytes;   // bytes of space (send) or data (recv) the step needs
  std::uint64_t found_key;    // kHeaderMismatch: what the header said
  std::uint32_t found_chunk;
  std::uint32_t found_elements;
  std::uint32_t found_codec;  // codec byte, or 0x10000 | magic when the magic was wrong
  std::uint32_t waited_ms;    // how long the bounded wait lasted
};
static_assert(sizeof(StepStatus) == 64);

}  // namespace ember::gpu
