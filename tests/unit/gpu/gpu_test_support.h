// Test helpers for worker/gpu: seeded tensor sets (sizes 0, 1, odd,
// multi-tile; pointers deliberately not 16-byte aligned), bit-exact
// comparisons, and a host emulation of the kernels' work units that runs the
// kernels' own per-tile code (tile_ops.h) so the CPU tests cover the GPU
// work split too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/base/check.h"
#include "worker/gpu/cpu_packer.h"
#include "worker/gpu/host_symbuffer.h"
#include "worker/gpu/pack_plan.h"
#include "worker/gpu/status.h"
#include "worker/gpu/tile_ops.h"

namespace ember::gpu::testing {

// Host tensors with stable addresses. Tensor i starts (i % 4) floats into
// its own allocation, so 3 of 4 tensors are not 16-byte aligned.
struct TensorSet {
  std::vector<TensorDesc> descs;
  std::vector<std::vector<float>> storage;
  std::vector<float*> ptrs;

  std::vector<const float*> const_ptrs() const { return {ptrs.begin(), ptrs.end()}; }
  std::span<float> tensor(std::size_t i) { return {ptrs[i], descs[i].num_elements}; }
  std::span<const float> tensor(std::size_t i) const { return {ptrs[i], descs[i].num_elements}; }
};

inline TensorSet make_tensors(const std::vector<std::uint64_t>& sizes, std::uint32_t num_groups = 1,
                              std::uint64_t first_key = 0) {
  TensorSet t;
  t.descs.reserve(sizes.size());
  t.storage.resize(sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    t.descs.push_back({first_key + i * 7 + 3, sizes[i], static_cast<std::uint32_t>(i % num_groups)});
    t.storage[i].assign(sizes[i] + 4, 0.0f);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) t.ptrs.push_back(t.storage[i].data() + i % 4);
  return t;
}

// Sizes: 0, 1, odd, exactly one tile, one tile plus one, several tiles.
inline std::vector<std::uint64_t> mixed_sizes(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::uint64_t special[] = {0, 1, 3, 7, 2047, 2048, 2049, 4096 + 5, 3 * 2048 + 1, 17, 0, 1};
  std::vector<std::uint64_t> sizes;
  for (std::size_t i = 0; i < count; ++i) {
    if (i < std::size(special)) {
      sizes.push_back(special[i]);
    } else if (rng() % 50 == 0) {
      sizes.push_back(2048 + rng() % 9000);
    } else {
      sizes.push_back(rng() % 300);
    }
  }
  return sizes;
}

// Gradient-like values: normal(0, scale) with a few exact zeros, negative
// zeros and denormals.
inline void fill_gradients(TensorSet& t, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  for (std::size_t i = 0; i < t.descs.size(); ++i) {
    for (float& v : t.tensor(i)) {
      const std::uint64_t r = rng() % 1000;
      v = r == 0 ? 0.0f : r == 1 ? -0.0f : r == 2 ? 1e-40f : normal(rng);
    }
  }
}

inline bool same_bits(std::span<const float> a, std::span<const float> b, std::string* where) {
  if (a.size() != b.size()) {
    *where = "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
    return false;
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      *where = "element " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " +
               std::to_string(b[i]);
      return false;
    }
  }
  return true;
}

inline bool same_bytes(std::span<const std::byte> a, std::span<const std::byte> b, std::string* where) {
  if (a.size() != b.size()) {
    *where = "sizes differ";
    return false;
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) {
      *where = "byte " + std::to_string(i);
      return false;
    }
  }
  return true;
}

inline std::shared_ptr<const PackPlan> build_plan(const TensorSet& t, const PlanOptions& o) {
  auto plan = PackPlan::build(t.descs, o);
  EXPECT_TRUE(plan.has_value()) << (plan ? "" : plan.error().to_string());
  if (!plan) return nullptr;
  return std::make_shared<const PackPlan>(std::move(*plan));
}

// ---------------------------------------------------------------------------
// Host emulation of kernels.cu's work units (see kernels.h): absmax units,
// ring checks, then tiles in a shuffled order, each tile run lane by lane
// from the last lane to the first, through tile_ops.h. The ring checks do
// not wait: a full ring (empty recv ring) is an error at once.
struct EmulatedState {
  std::vector<float> residuals, send_refs, recv_refs;
  explicit EmulatedState(const PackPlan& plan)
      : residuals(plan.residual_arena_elements(), 0.0f),
        send_refs(plan.ref_arena_elements(), 0.0f),
        recv_refs(plan.ref_arena_elements(), 0.0f) {}
};

inline constexpr std::uint32_t kEmulatedLanes = 32;

inline StepStatus emulated_status(StepStatusCode code, std::uint64_t ring, Direction d,
                                  std::uint64_t head, std::uint64_t tail, std::uint64_t need) {
  StepStatus s{};
  s.code = static_cast<std::uint32_t>(code);
  s.ring = static_cast<std::uint32_t>(ring);
  s.direction = static_cast<std::uint32_t>(d);
  s.head = head;
  s.tail = tail;
  s.need_bytes = need;
  return s;
}

inline Status emulate_pack(const PackPlan& plan, std::span<const float* const> sources,
                           const SymBufferView& buf, EmulatedState& st, std::uint64_t seed) {
  const SymBufferLayout& L = plan.layout();
  std::mt19937_64 rng(seed);
  // Absmax units.
  std::vector<std::uint32_t> absmax_bits(plan.records().size(), 0);
  std::vector<std::uint32_t> int8_tiles(plan.int8_tiles().begin(), plan.int8_tiles().end());
  std::shuffle(int8_tiles.begin(), int8_tiles.end(), rng);
  for (std::uint32_t ti : int8_tiles) {
    const PlanTile& tile = plan.tiles()[ti];
    const PlanRecord& rec = plan.records()[tile.record];
    const GroupParams& g = plan.groups()[rec.group];
    const PackTileArgs a = make_pack_tile_args(rec, tile, g, nullptr, 0, 0, sources[rec.tensor],
                                               st.residuals.data(), st.send_refs.data(), 0.0f);
    float m = 0.0f;
    for (std::uint32_t lane = 0; lane < kEmulatedLanes; ++lane) {
      m = max_ignore_nan(m, absmax_tile(a, g, lane, kEmulatedLanes));
    }
    absmax_bits[tile.record] = std::max(absmax_bits[tile.record], float_bits(m));
  }
  // Check units.
  std::vector<std::uint64_t> base(L.num_rings());
  for (std::uint64_t ring = 0; ring < L.num_rings(); ++ring) {
    ChannelMeta* m = L.meta(buf.base, ring, Direction::kSend);
    const std::uint64_t tail = load_position_acquire(m->tail);
    const std::uint64_t head = load_position_acquire(m->head);
    const std::uint64_t need = plan.ring_step_bytes()[ring];
    if (L.ring_bytes - (tail - head) < need) {
      return tl::unexpected(status_to_error(
          emulated_status(StepStatusCode::kSendRingFull, ring, Direction::kSend, head, tail, need),
          plan, "pack"));
    }
    base[ring] = tail;
  }
  // Tile units.
  std::vector<std::uint32_t> order(plan.tiles().size());
  for (std::uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (std::uint32_t ti : order) {
    const PlanTile& tile = plan.tiles()[ti];
    const PlanRecord& rec = plan.records()[tile.record];
    const GroupParams& g = plan.groups()[rec.group];
    const float scale = g.codec == Codec::kInt8
                            ? int8_scale_from_absmax(bits_float(absmax_bits[tile.record]))
                            : 0.0f;
    const PackTileArgs a = make_pack_tile_args(
        rec, tile, g, L.data(buf.base, rec.ring, Direction::kSend), L.ring_bytes, base[rec.ring],
        sources[rec.tensor], st.residuals.data(), st.send_refs.data(), scale);
    for (std::uint32_t lane = kEmulatedLanes; lane-- > 0;) pack_tile(a, g, lane, kEmulatedLanes);
  }
  for (std::uint64_t ring = 0; ring < L.num_rings(); ++ring) {
    const std::uint64_t step = plan.ring_step_bytes()[ring];
    if (step != 0) {
      store_position_release(L.meta(buf.base, ring, Direction::kSend)->tail, base[ring] + step);
    }
  }
  return ok_status();
}

inline Status emulate_unpack(const PackPlan& plan, std::span<float* const> destinations,
                             const SymBufferView& buf, EmulatedState& st, std::uint64_t seed) {
  const SymBufferLayout& L = plan.layout();
  std::mt19937_64 rng(seed);
  std::vector<std::uint64_t> base(L.num_rings());
  for (std::uint64_t ring = 0; ring < L.num_rings(); ++ring) {
    ChannelMeta* m = L.meta(buf.base, ring, Direction::kRecv);
    const std::uint64_t head = load_position_acquire(m->head);
    const std::uint64_t tail = load_position_acquire(m->tail);
    const std::uint64_t need = plan.ring_step_bytes()[ring];
    if (tail - head < need) {
      return tl::unexpected(status_to_error(
          emulated_status(StepStatusCode::kRecvRingEmpty, ring, Direction::kRecv, head, tail, need),
          plan, "unpack"));
    }
    const std::byte* data = L.data(buf.base, ring, Direction::kRecv);
    for (std::uint32_t ri = plan.ring_record_begin()[ring]; ri < plan.ring_record_begin()[ring + 1];
         ++ri) {
      const PlanRecord& rec = plan.records()[ri];
      const PackedChunkHeader h = read_header(data, L.ring_bytes, head + rec.rel_pos);
      if (!header_matches(h, rec, plan.groups()[rec.group])) {
        StepStatus s = emulated_status(StepStatusCode::kHeaderMismatch, ring, Direction::kRecv,
                                       head, tail, need);
        s.record = ri;
        s.found_key = h.key;
        s.found_codec = header_found_codec(h);
        return tl::unexpected(status_to_error(s, plan, "unpack"));
      }
    }
    base[ring] = head;
  }
  std::vector<std::uint32_t> order(plan.tiles().size());
  for (std::uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (std::uint32_t ti : order) {
    const PlanTile& tile = plan.tiles()[ti];
    const PlanRecord& rec = plan.records()[tile.record];
    const GroupParams& g = plan.groups()[rec.group];
    const UnpackTileArgs a = make_unpack_tile_args(
        rec, tile, g, L.data(buf.base, rec.ring, Direction::kRecv), L.ring_bytes, base[rec.ring],
        destinations[rec.tensor], st.recv_refs.data());
    for (std::uint32_t lane = kEmulatedLanes; lane-- > 0;) unpack_tile(a, g, lane, kEmulatedLanes);
  }
  for (std::uint64_t ring = 0; ring < L.num_rings(); ++ring) {
    const std::uint64_t step = plan.ring_step_bytes()[ring];
    if (step != 0) {
      store_position_release(L.meta(buf.base, ring, Direction::kRecv)->head, base[ring] + step);
    }
  }
  return ok_status();
}

}  // namespace ember::gpu::testing
