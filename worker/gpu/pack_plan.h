// PackPlan: built once per model from the list of gradient tensors; says
// where every chunk of every tensor goes in a SymBuffer and how it is encoded.
//
// Tensors are fp32 ([num_elements] float, contiguous). Each is cut into
// chunks and placed with common/placement's chunk_plan(), the same
// deterministic map the CPU worker uses, so a chunk travels on the same
// (channel, server) whichever worker path packs it. The chunks of one
// (channel, server rank) ring become consecutive records, in tensor-list
// order then chunk order, at byte positions relative to the ring's position
// when a step starts; a step therefore needs ring_step_bytes(ring) bytes of
// space in that ring. Records are split into tiles (plan_types.h) for the
// kernels.
//
// Per-tensor state (error-feedback residuals, delta references) lives in
// arenas owned by the packer (CpuPacker, GpuPacker); the plan gives each
// tensor an element offset there, 16-byte aligned.
//
// Thread-safety: a built plan is immutable; any thread may read it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/base/error.h"
#include "worker/gpu/codec.h"
#include "worker/gpu/layout.h"
#include "worker/gpu/plan_types.h"

namespace ember::gpu {

// One gradient tensor: `num_elements` fp32 values under `key`.
struct TensorDesc {
  std::uint64_t key = 0;
  std::uint64_t num_elements = 0;
  std::uint32_t group = 0;  // index into PlanOptions::groups
};

// Compression of one key group. prescale 0 means the default: 1/num_workers
// for kBf16 and kFp16 (the server's sum of num_workers values is then the
// mean and cannot overflow where the mean does not), 1 for kFp32 and kInt8.
struct CompressionOptions {
  Codec codec = Codec::kFp32;
  bool delta = false;           // encode the difference to the last sent values
  bool error_feedback = false;  // keep the quantisation residual, add it next step
  float prescale = 0.0f;        // multiplier applied before encoding; 0 = default
};

struct PlanOptions {
  std::uint32_t num_channels = 1;  // lanes (config `channels`); GPU: ≤ half the SM count
  std::uint32_t num_servers = 1;   // destination ranks
  std::uint32_t num_workers = 1;   // for the default bf16/fp16 prescale
  // Chunk size, as the CPU worker's: tensors larger than this are cut.
  // ≤ kMaxPartitionBytes so that a record's element count fits 32 bits.
  std::uint64_t partition_bytes = 4096000;
  // Data capacity of each ring (SymBufferLayout::ring_bytes), a multiple of
  // 128 that holds at least one step of its ring; 0 = the smallest such.
  std::uint64_t ring_bytes = 0;
  // Compression per key group; TensorDesc::group indexes it. Must not be empty.
  std::vector<CompressionOptions> groups = {CompressionOptions{}};

  static constexpr std::uint64_t kMaxPartitionBytes = std::uint64_t{1} << 32;
};

class PackPlan {
 public:
  // Builds the plan. Allocates O(tensors + chunks + tiles). Errors
  // (kInvalidArgument unless noted), each naming the value and the fix:
  //   num_channels, num_servers or num_workers is 0; partition_bytes is 0 or
  //   above kMaxPartitionBytes; groups is empty; a tensor names a group that
  //   does not exist; two tensors share a key; a prescale is not a positive
  //   finite number; ring_bytes is not a multiple of 128;
  //   kTooLarge: a tensor's byte size overflows, there are more than 2^32-1
  //   records or tiles, or ring_bytes is below a ring's step bytes (or above
  //   SymBufferLayout::kMaxRingBytes), or channels × servers exceeds
  //   SymBufferLayout::kMaxRings.
  static Result<PackPlan> build(std::span<const TensorDesc> tensors, const PlanOptions& options);

  const SymBufferLayout& layout() const { return layout_; }
  const PlanOptions& options() const { return options_; }
  std::span<const TensorDesc> tensors() const { return tensors_; }
  std::span<const GroupParams> groups() const { return groups_; }
  // Records ordered by ring, then tensor-list order, then chunk index.
  std::span<const PlanRecord> records() const { return records_; }
  // Tiles in record order.
  std::span<const PlanTile> tiles() const { return tiles_; }
  // Indices of the tiles whose record uses kInt8 (need an absmax pass).
  std::span<const std::uint32_t> int8_tiles() const { return int8_tiles_; }
  // Per ring (layout().num_rings() entries): bytes one step writes.
  std::span<const std::uint64_t> ring_step_bytes() const { return ring_step_bytes_; }
  // Per ring, plus one: records of ring i are [begin[i], begin[i + 1]).
  std::span<const std::uint32_t> ring_record_begin() const { return ring_record_begin_; }
  // First record of each tensor (its chunks are not consecutive across rings:
  // use tensor_records()).
  std::span<const std::uint32_t> tensor_records(std::uint32_t tensor) const;

  // Elements of the per-tensor state arenas (each tensor's slice starts at a
  // multiple of 4 elements).
  std::uint64_t residual_arena_elements() const { return residual_elements_; }
  std::uint64_t ref_arena_elements() const { return ref_elements_; }
  // Per tensor: offset of its first residual / reference element, or kNoState.
  std::uint64_t residual_offset(std::uint32_t tensor) const { return residual_offsets_[tensor]; }
  std::uint64_t ref_offset(std::uint32_t tensor) const { return ref_offsets_[tensor]; }

  std::uint64_t total_elements() const { return total_elements_; }
  // Bytes of all records of one step (sum of ring_step_bytes).
  std::uint64_t step_bytes() const { return step_bytes_; }
  std::uint64_t max_ring_step_bytes() const { return max_ring_step_bytes_; }
  bool uses_int8() const { return !int8_tiles_.empty(); }

  // "channel C rank R" of a ring index, for messages.
  std::string describe_ring(std::uint64_t ring) const;

 private:
  SymBufferLayout layout_{};
  PlanOptions options_{};
  std::vector<TensorDesc> tensors_;
  std::vector<GroupParams> groups_;
  std::vector<PlanRecord> records_;
  std::vector<PlanTile> tiles_;
  std::vector<std::uint32_t> int8_tiles_;
  std::vector<std::uint64_t> ring_step_bytes_;
  std::vector<std::uint32_t> ring_record_begin_;
  std::vector<std::uint32_t> tensor_record_index_;  // record indices grouped by tensor
  std::vector<std::uint32_t> tensor_record_begin_;  // per tensor, plus one
  std::vector<std::uint64_t> residual_offsets_;
  std::vector<std::uint64_t> ref_offsets_;
  std::uint64_t residual_elements_ = 0;
  std::uint64_t ref_elements_ = 0;
  std::uint64_t total_elements_ = 0;
  std::uint64_t step_bytes_ = 0;
  std::uint64_t max_ring_step_bytes_ = 0;
};

// Resolves a group's options (default prescale) and validates them.
Result<GroupParams> resolve_group(const CompressionOptions& options, std::uint32_t num_workers,
                                  std::uint32_t group_index);

std::string_view codec_name(Codec codec);

}  // namespace ember::gpu
