// Pack plans; see pack_plan.h.
#include "worker/gpu/pack_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

#include <fmt/format.h>

#include "common/placement/placement.h"

namespace ember::gpu {

namespace {
constexpr std::uint64_t kElementBytes = sizeof(float);
constexpr std::uint64_t kU32Max = std::numeric_limits<std::uint32_t>::max();
}  // namespace

std::string_view codec_name(Codec codec) {
  switch (codec) {
    case Codec::kFp32: return "fp32";
    case Codec::kBf16: return "bf16";
    case Codec::kFp16: return "fp16";
    case Codec::kInt8: return "int8";
  }
  return "unknown";
}

Result<GroupParams> resolve_group(const CompressionOptions& options, std::uint32_t num_workers,
                                  std::uint32_t group_index) {
  const auto codec_value = static_cast<std::uint32_t>(options.codec);
  if (codec_value >= kNumCodecs) {
    return make_error(ErrorCode::kInvalidArgument,
                      "key group {}: unknown codec {}; use fp32, bf16, fp16 or int8", group_index,
                      codec_value);
  }
  GroupParams g;
  g.codec = options.codec;
  g.delta = options.delta ? 1 : 0;
  g.error_feedback = options.error_feedback ? 1 : 0;
  if (options.prescale == 0.0f) {
    const bool half = options.codec == Codec::kBf16 || options.codec == Codec::kFp16;
    g.prescale = half ? 1.0f / static_cast<float>(num_workers) : 1.0f;
  } else if (!(options.prescale > 0.0f) || !std::isfinite(options.prescale)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "key group {}: prescale {} is not a positive finite number (use 0 for the "
                      "default 1/num_workers on bf16/fp16, 1 otherwise)",
                      group_index, options.prescale);
  } else {
    g.prescale = options.prescale;
  }
  return g;
}

std::span<const std::uint32_t> PackPlan::tensor_records(std::uint32_t tensor) const {
  const std::uint32_t begin = tensor_record_begin_[tensor];
  const std::uint32_t end = tensor_record_begin_[tensor + 1];
  return std::span<const std::uint32_t>(tensor_record_index_).subspan(begin, end - begin);
}

std::string PackPlan::describe_ring(std::uint64_t ring) const {
  return fmt::format("channel {} rank {}", layout_.channel_of_ring(ring), layout_.rank_of_ring(ring));
}

Result<PackPlan> PackPlan::build(std::span<const TensorDesc> tensors, const PlanOptions& options) {
  if (options.num_channels == 0 || options.num_servers == 0 || options.num_workers == 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "pack plan: num_channels ({}), num_servers ({}) and num_workers ({}) must "
                      "all be at least 1",
                      options.num_channels, options.num_servers, options.num_workers);
  }
  const std::uint64_t num_rings = std::uint64_t{options.num_channels} * options.num_servers;
  if (num_rings > SymBufferLayout::kMaxRings) {
    return make_error(ErrorCode::kTooLarge,
                      "pack plan: {} channels x {} servers = {} rings exceeds the maximum {}; use "
                      "fewer channels",
                      options.num_channels, options.num_servers, num_rings,
                      SymBufferLayout::kMaxRings);
  }
  if (options.partition_bytes == 0 || options.partition_bytes > PlanOptions::kMaxPartitionBytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "pack plan: partition_bytes {} must be between 1 and {} bytes",
                      options.partition_bytes, PlanOptions::kMaxPartitionBytes);
  }
  if (options.groups.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "pack plan: no key groups; give at least one CompressionOptions");
  }
  if (options.ring_bytes % kRegionAlignBytes != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "pack plan: ring_bytes {} is not a multiple of {}; round it up to {}",
                      options.ring_bytes, kRegionAlignBytes,
                      round_up(options.ring_bytes, kRegionAlignBytes));
  }
  if (options.ring_bytes > SymBufferLayout::kMaxRingBytes) {
    return make_error(ErrorCode::kTooLarge, "pack plan: ring_bytes {} exceeds the maximum {}",
                      options.ring_bytes, SymBufferLayout::kMaxRingBytes);
  }

  PackPlan plan;
  plan.options_ = options;
  plan.tensors_.assign(tensors.begin(), tensors.end());
  plan.groups_.reserve(options.groups.size());
  for (std::size_t g = 0; g < options.groups.size(); ++g) {
    EMBER_ASSIGN_OR_RETURN(GroupParams params,
                           resolve_group(options.groups[g], options.num_workers,
                                         static_cast<std::uint32_t>(g)));
    plan.groups_.push_back(params);
  }
  if (tensors.size() >= kU32Max) {
    return make_error(ErrorCode::kTooLarge, "pack plan: {} tensors exceed the maximum {}",
                      tensors.size(), kU32Max - 1);
  }

  // Validate tensors; give each its state slices.
  std::unordered_map<std::uint64_t, std::uint32_t> seen;
  seen.reserve(tensors.size() * 2);
  plan.residual_offsets_.assign(tensors.size(), kNoState);
  plan.ref_offsets_.assign(tensors.size(), kNoState);
  for (std::uint32_t i = 0; i < tensors.size(); ++i) {
    const TensorDesc& t = tensors[i];
    if (t.group >= plan.groups_.size()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "pack plan: tensor {} (key {}) names key group {}, but only {} groups "
                        "are configured",
                        i, t.key, t.group, plan.groups_.size());
    }
    if (auto [it, inserted] = seen.emplace(t.key, i); !inserted) {
      return make_error(ErrorCode::kInvalidArgument,
                        "pack plan: key {} is used by tensors {} and {}; keys must be unique",
                        t.key, it->second, i);
    }
    if (t.num_elements > std::numeric_limits<std::uint64_t>::max() / 16) {
      return make_error(ErrorCode::kTooLarge, "pack plan: tensor {} (key {}) has {} elements: too large",
                        i, t.key, t.num_elements);
    }
    const GroupParams& g = plan.groups_[t.group];
    if (g.error_feedback) {
      plan.residual_offsets_[i] = plan.residual_elements_;
      plan.residual_elements_ += round_up(t.num_elements, 4);
    }
    if (g.delta) {
      plan.ref_offsets_[i] = plan.ref_elements_;
      plan.ref_elements_ += round_up(t.num_elements, 4);
    }
    plan.total_elements_ += t.num_elements;
  }

  // Chunks → per-ring record lists, in tensor order.
  struct Pending {
    std::uint32_t tensor;
    placement::Chunk chunk;
  };
  std::vector<std::vector<Pending>> per_ring(num_rings);
  std::uint64_t num_records = 0;
  for (std::uint32_t i = 0; i < tensors.size(); ++i) {
    const TensorDesc& t = tensors[i];
    for (const placement::Chunk& c :
         placement::chunk_plan(t.key, t.num_elements * kElementBytes, kElementBytes,
                               options.partition_bytes, options.num_servers, options.num_channels)) {
      per_ring[std::uint64_t{c.channel} * options.num_servers + c.server].push_back({i, c});
      ++num_records;
    }
  }
  if (num_records >= kU32Max) {
    return make_error(ErrorCode::kTooLarge,
                      "pack plan: {} chunks exceed the maximum {}; raise partition_bytes",
                      num_records, kU32Max - 1);
  }

  plan.records_.reserve(num_records);
  plan.ring_step_bytes_.assign(num_rings, 0);
  plan.ring_record_begin_.assign(num_rings + 1, 0);
  std::uint64_t num_tiles = 0;
  for (std::uint64_t ring = 0; ring < num_rings; ++ring) {
    plan.ring_record_begin_[ring] = static_cast<std::uint32_t>(plan.records_.size());
    std::uint64_t pos = 0;
    for (const Pending& p : per_ring[ring]) {
      const TensorDesc& t = tensors[p.tensor];
      const GroupParams& g = plan.groups_[t.group];
      PlanRecord r{};
      r.key = t.key;
      r.elem_offset = p.chunk.offset_bytes / kElementBytes;
      r.rel_pos = pos;
      r.residual_offset = g.error_feedback ? plan.residual_offsets_[p.tensor] + r.elem_offset : kNoState;
      r.ref_offset = g.delta ? plan.ref_offsets_[p.tensor] + r.elem_offset : kNoState;
      r.tensor = p.tensor;
      r.chunk_index = p.chunk.index;
      r.num_elements = static_cast<std::uint32_t>(p.chunk.length_bytes / kElementBytes);
      r.ring = static_cast<std::uint32_t>(ring);
      r.group = t.group;
      r.first_tile = static_cast<std::uint32_t>(std::min<std::uint64_t>(num_tiles, kU32Max));
      num_tiles += record_num_tiles(r.num_elements);
      pos += record_bytes(r.num_elements, g.codec);
      plan.records_.push_back(r);
    }
    plan.ring_step_bytes_[ring] = pos;
    plan.step_bytes_ += pos;
    plan.max_ring_step_bytes_ = std::max(plan.max_ring_step_bytes_, pos);
  }
  plan.ring_record_begin_[num_rings] = static_cast<std::uint32_t>(plan.records_.size());
  if (num_tiles >= kU32Max) {
    return make_error(ErrorCode::kTooLarge,
                      "pack plan: {} tiles exceed the maximum {}; the model is too large for one "
                      "plan",
                      num_tiles, kU32Max - 1);
  }

  // Tiles.
  plan.tiles_.reserve(num_tiles);
  for (std::uint32_t ri = 0; ri < plan.records_.size(); ++ri) {
    const PlanRecord& r = plan.records_[ri];
    const bool int8 = plan.groups_[r.group].codec == Codec::kInt8;
    std::uint32_t begin = 0;
    do {
      PlanTile tile{};
      tile.record = ri;
      tile.elem_begin = begin;
      tile.num_elements = std::min<std::uint32_t>(kTileElements, r.num_elements - begin);
      tile.flags = (begin == 0 ? kTileFirst : 0) |
                   (begin + tile.num_elements == r.num_elements ? kTileLast : 0);
      if (int8) plan.int8_tiles_.push_back(static_cast<std::uint32_t>(plan.tiles_.size()));
      plan.tiles_.push_back(tile);
      begin += tile.num_elements;
    } while (begin < r.num_elements);
  }

  // Records per tensor (for callers that walk a tensor's chunks).
  plan.tensor_record_begin_.assign(tensors.size() + 1, 0);
  for (const PlanRecord& r : plan.records_) ++plan.tensor_record_begin_[r.tensor + 1];
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    plan.tensor_record_begin_[i + 1] += plan.tensor_record_begin_[i];
  }
  plan.tensor_record_index_.assign(plan.records_.size(), 0);
  {
    std::vector<std::uint32_t> fill(plan.tensor_record_begin_.begin(),
                                    plan.tensor_record_begin_.end() - 1);
    for (std::uint32_t ri = 0; ri < plan.records_.size(); ++ri) {
      plan.tensor_record_index_[fill[plan.records_[ri].tensor]++] = ri;
    }
  }

  // Ring capacity.
  std::uint64_t ring_bytes = options.ring_bytes;
  if (ring_bytes == 0) {
    ring_bytes = std::max<std::uint64_t>(kRegionAlignBytes,
                                         round_up(plan.max_ring_step_bytes_, kRegionAlignBytes));
    if (ring_bytes > SymBufferLayout::kMaxRingBytes) {
      return make_error(ErrorCode::kTooLarge,
                        "pack plan: one step needs {} bytes in one ring, above the maximum {}; "
                        "use more channels or a compressing codec",
                        plan.max_ring_step_bytes_, SymBufferLayout::kMaxRingBytes);
    }
  } else {
    for (std::uint64_t ring = 0; ring < num_rings; ++ring) {
      if (plan.ring_step_bytes_[ring] > ring_bytes) {
        return make_error(ErrorCode::kTooLarge,
                          "pack plan: ring of channel {} rank {} needs {} bytes per step but "
                          "ring_bytes is {}; raise ring_bytes to at least {} (or 0 for automatic), "
                          "use more channels, or compress",
                          ring / options.num_servers, ring % options.num_servers,
                          plan.ring_step_bytes_[ring], ring_bytes,
                          round_up(plan.max_ring_step_bytes_, kRegionAlignBytes));
      }
    }
  }
  plan.layout_ = SymBufferLayout{options.num_channels, options.num_servers, ring_bytes};
  return plan;
}

}  // namespace ember::gpu
