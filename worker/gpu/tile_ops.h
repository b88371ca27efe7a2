// Work of one warp on one tile, written once for the CUDA kernels and for the
// host-side kernel emulation that the CPU tests run.
//
// A tile is up to kTileElements consecutive elements of one record. The
// functions below do the share of one lane out of `lanes` (32 on the device;
// the emulation calls every lane in turn, which is equivalent because lanes
// write disjoint bytes). Lane j handles float4 groups j, j+lanes, ... when
// the tensor and state pointers are 16-byte aligned (the fast path), and
// single elements after the last whole group or when they are not. No
// element past the tile's end is read or written.
//
// Ring addressing: a record starts at a 16-byte aligned position, its payload
// 32 bytes later, and a tile's payload at elem_begin * element_bytes (a
// multiple of 16) after that; ring capacities are multiples of 128. So a
// 4-, 8- or 16-byte access of a float4 group never straddles the ring's end,
// and one conditional subtraction maps a payload offset to a slot.
//
// Thread-safety: each call touches only its tile's ring bytes and state.
#pragma once

#include <cstdint>
#include <cstring>

#include "worker/gpu/codec.h"
#include "worker/gpu/layout.h"
#include "worker/gpu/plan_types.h"

#if defined(__CUDA_ARCH__)
#define EMBER_UNROLL _Pragma("unroll")
#else
#define EMBER_UNROLL
#endif

namespace ember::gpu {

// float4 groups each lane loads before its first store (memory-level
// parallelism). Paths that also load residuals and references keep about as
// many bytes in flight with fewer groups, within 64 registers per thread
// (1024-thread blocks).
template <bool kDelta, bool kEf>
inline constexpr std::uint32_t kTileUnroll = kDelta && kEf ? 1 : (kDelta || kEf ? 2 : 8);

struct F4 {
  float x, y, z, w;
};

// ---------------------------------------------------------------------------
// Aligned loads and stores (vector instructions on the device).

EMBER_HOST_DEVICE inline F4 load_f4(const float* p) {
#if defined(__CUDA_ARCH__)
  const float4 v = *reinterpret_cast<const float4*>(p);
  return {v.x, v.y, v.z, v.w};
#else
  F4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

// Read-only path for gradients, which no one writes while a kernel runs.
EMBER_HOST_DEVICE inline F4 load_f4_readonly(const float* p) {
#if defined(__CUDA_ARCH__)
  const float4 v = __ldg(reinterpret_cast<const float4*>(p));
  return {v.x, v.y, v.z, v.w};
#else
  return load_f4(p);
#endif
}

EMBER_HOST_DEVICE inline float load_f1_readonly(const float* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

EMBER_HOST_DEVICE inline void store_f4(float* p, F4 v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<float4*>(p) = make_float4(v.x, v.y, v.z, v.w);
#else
  std::memcpy(p, &v, sizeof v);
#endif
}

// Ring bytes: `p` is aligned to the access size.
EMBER_HOST_DEVICE inline void store_u32x4(std::byte* p, std::uint32_t a, std::uint32_t b,
                                          std::uint32_t c, std::uint32_t d) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(p) = make_uint4(a, b, c, d);
#else
  const std::uint32_t w[4] = {a, b, c, d};
  std::memcpy(p, w, sizeof w);
#endif
}
EMBER_HOST_DEVICE inline void store_u32x2(std::byte* p, std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint2*>(p) = make_uint2(a, b);
#else
  const std::uint32_t w[2] = {a, b};
  std::memcpy(p, w, sizeof w);
#endif
}
EMBER_HOST_DEVICE inline void store_u32(std::byte* p, std::uint32_t a) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<std::uint32_t*>(p) = a;
#else
  std::memcpy(p, &a, sizeof a);
#endif
}
EMBER_HOST_DEVICE inline void store_u16(std::byte* p, std::uint16_t a) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<std::uint16_t*>(p) = a;
#else
  std::memcpy(p, &a, sizeof a);
#endif
}

struct U32x4 {
  std::uint32_t x, y, z, w;
};
EMBER_HOST_DEVICE inline U32x4 load_u32x4(const std::byte* p) {
#if defined(__CUDA_ARCH__)
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  return {v.x, v.y, v.z, v.w};
#else
  U32x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}
EMBER_HOST_DEVICE inline void load_u32x2(const std::byte* p, std::uint32_t& a, std::uint32_t& b) {
#if defined(__CUDA_ARCH__)
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  a = v.x;
  b = v.y;
#else
  std::uint32_t w[2];
  std::memcpy(w, p, sizeof w);
  a = w[0];
  b = w[1];
#endif
}
EMBER_HOST_DEVICE inline std::uint32_t load_u32(const std::byte* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const std::uint32_t*>(p);
#else
  std::uint32_t a;
  std::memcpy(&a, p, sizeof a);
  return a;
#endif
}
EMBER_HOST_DEVICE inline std::uint16_t load_u16(const std::byte* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const std::uint16_t*>(p);
#else
  std::uint16_t a;
  std::memcpy(&a, p, sizeof a);
  return a;
#endif
}

// Slot of payload byte `offset` given the slot of byte 0 (both < capacity
// and offset < capacity, which holds because a record fits in its ring).
EMBER_HOST_DEVICE inline std::uint64_t wrap_slot(std::uint64_t slot0, std::uint64_t offset,
                                                 std::uint64_t capacity) {
  const std::uint64_t s = slot0 + offset;
  return s >= capacity ? s - capacity : s;
}

// Stores the encoded bits of one element (codec_element_bytes(C) bytes).
template <Codec C>
EMBER_HOST_DEVICE inline void store_encoded1(std::byte* p, std::uint32_t bits) {
  if constexpr (C == Codec::kFp32) {
    store_u32(p, bits);
  } else if constexpr (C == Codec::kInt8) {
    *p = static_cast<std::byte>(bits);
  } else {
    store_u16(p, static_cast<std::uint16_t>(bits));
  }
}

// Stores four consecutive encoded elements with one access.
template <Codec C>
EMBER_HOST_DEVICE inline void store_encoded4(std::byte* p, std::uint32_t b0, std::uint32_t b1,
                                             std::uint32_t b2, std::uint32_t b3) {
  if constexpr (C == Codec::kFp32) {
    store_u32x4(p, b0, b1, b2, b3);
  } else if constexpr (C == Codec::kInt8) {
    store_u32(p, (b0 & 0xffu) | ((b1 & 0xffu) << 8) | ((b2 & 0xffu) << 16) | (b3 << 24));
  } else {
    store_u32x2(p, (b0 & 0xffffu) | (b1 << 16), (b2 & 0xffffu) | (b3 << 16));
  }
}

template <Codec C>
EMBER_HOST_DEVICE inline std::uint32_t load_encoded1(const std::byte* p) {
  if constexpr (C == Codec::kFp32) {
    return load_u32(p);
  } else if constexpr (C == Codec::kInt8) {
    return static_cast<std::uint32_t>(*p);
  } else {
    return load_u16(p);
  }
}

template <Codec C>
EMBER_HOST_DEVICE inline U32x4 load_encoded4(const std::byte* p) {
  if constexpr (C == Codec::kFp32) {
    return load_u32x4(p);
  } else if constexpr (C == Codec::kInt8) {
    const std::uint32_t w = load_u32(p);
    return {w & 0xffu, (w >> 8) & 0xffu, (w >> 16) & 0xffu, w >> 24};
  } else {
    std::uint32_t a, b;
    load_u32x2(p, a, b);
    return {a & 0xffffu, a >> 16, b & 0xffffu, b >> 16};
  }
}

// Header at ring position `pos` (16-byte aligned): two 16-byte halves, each
// on its own side of the ring's end if the record wraps.
EMBER_HOST_DEVICE inline void write_header(std::byte* ring, std::uint64_t capacity,
                                           std::uint64_t pos, const PackedChunkHeader& h) {
  std::uint32_t w[8];
  header_to_words(h, w);
  store_u32x4(ring + pos % capacity, w[0], w[1], w[2], w[3]);
  store_u32x4(ring + (pos + 16) % capacity, w[4], w[5], w[6], w[7]);
}

EMBER_HOST_DEVICE inline PackedChunkHeader read_header(const std::byte* ring,
                                                       std::uint64_t capacity, std::uint64_t pos) {
  const U32x4 a = load_u32x4(ring + pos % capacity);
  const U32x4 b = load_u32x4(ring + (pos + 16) % capacity);
  const std::uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  return header_from_words(w);
}

// Whether a received header is the one the plan expects at that position.
EMBER_HOST_DEVICE inline bool header_matches(const PackedChunkHeader& h, const PlanRecord& r,
                                             const GroupParams& g) {
  return header_is(h, r.key, r.chunk_index, r.elem_offset, r.num_elements, g.codec, g.delta != 0);
}

// ---------------------------------------------------------------------------
// Pack.

struct PackTileArgs {
  std::byte* ring = nullptr;       // first data byte of the send ring
  std::uint64_t capacity = 0;      // ring bytes
  std::uint64_t record_pos = 0;    // absolute position of the record's first byte
  const PlanRecord* record = nullptr;
  PlanTile tile{};
  float prescale = 1.0f;
  float int8_scale = 0.0f;         // the record's scale (kInt8 only)
  const float* src = nullptr;      // the record's first gradient element
  float* residual = nullptr;       // the record's first residual (error feedback only)
  float* ref = nullptr;            // the record's first send reference (delta only)
};

// Arguments of one pack tile from the plan's arrays. `tensor` is the
// gradient tensor's first element; `base` the send ring's position at the
// start of the step; the arenas may be null when the group keeps no state.
EMBER_HOST_DEVICE inline PackTileArgs make_pack_tile_args(
    const PlanRecord& rec, const PlanTile& tile, const GroupParams& g, std::byte* ring,
    std::uint64_t capacity, std::uint64_t base, const float* tensor, float* residual_arena,
    float* ref_arena, float int8_scale) {
  PackTileArgs a;
  a.ring = ring;
  a.capacity = capacity;
  a.record_pos = base + rec.rel_pos;
  a.record = &rec;
  a.tile = tile;
  a.prescale = g.prescale;
  a.int8_scale = int8_scale;
  a.src = rec.num_elements == 0 ? tensor : tensor + rec.elem_offset;
  a.residual = g.error_feedback ? residual_arena + rec.residual_offset : nullptr;
  a.ref = g.delta ? ref_arena + rec.ref_offset : nullptr;
  return a;
}

// Element range of the tile, and whether the float4 path applies.
EMBER_HOST_DEVICE inline std::uint32_t tile_vector_groups(const void* a, const void* b,
                                                          const void* c, std::uint32_t n) {
  const auto bits = reinterpret_cast<std::uintptr_t>(a) | reinterpret_cast<std::uintptr_t>(b) |
                    reinterpret_cast<std::uintptr_t>(c);
  return (bits & 15u) == 0 ? n / 4 : 0;
}

template <Codec C, bool kDelta, bool kEf>
EMBER_HOST_DEVICE void pack_tile_lane(const PackTileArgs& a, std::uint32_t lane,
                                      std::uint32_t lanes) {
  constexpr std::uint64_t kElementBytes = codec_element_bytes(C);
  const PlanRecord& rec = *a.record;
  const std::uint32_t n = a.tile.num_elements;
  const std::uint64_t payload_slot =
      (a.record_pos + kRecordHeaderBytes + std::uint64_t{a.tile.elem_begin} * kElementBytes) %
      a.capacity;
  if (n > 0) {
    const float* src = a.src + a.tile.elem_begin;
    float* res = kEf ? a.residual + a.tile.elem_begin : nullptr;
    float* ref = kDelta ? a.ref + a.tile.elem_begin : nullptr;
    const std::uint32_t groups = tile_vector_groups(src, res, ref, n);
    for (std::uint32_t first = lane; first < groups; first += lanes * kTileUnroll<kDelta, kEf>) {
      F4 g[kTileUnroll<kDelta, kEf>] = {};
      F4 r[kTileUnroll<kDelta, kEf>] = {};
      F4 f[kTileUnroll<kDelta, kEf>] = {};
      EMBER_UNROLL
      for (std::uint32_t u = 0; u < kTileUnroll<kDelta, kEf>; ++u) {
        const std::uint32_t v = first + u * lanes;
        if (v < groups) {
          g[u] = load_f4_readonly(src + 4 * v);
          if constexpr (kEf) r[u] = load_f4(res + 4 * v);
          if constexpr (kDelta) f[u] = load_f4(ref + 4 * v);
        }
      }
      EMBER_UNROLL
      for (std::uint32_t u = 0; u < kTileUnroll<kDelta, kEf>; ++u) {
        const std::uint32_t v = first + u * lanes;
        if (v < groups) {
          const PackedElement p0 =
              pack_element<C, kDelta, kEf>(g[u].x, r[u].x, f[u].x, a.prescale, a.int8_scale);
          const PackedElement p1 =
              pack_element<C, kDelta, kEf>(g[u].y, r[u].y, f[u].y, a.prescale, a.int8_scale);
          const PackedElement p2 =
              pack_element<C, kDelta, kEf>(g[u].z, r[u].z, f[u].z, a.prescale, a.int8_scale);
          const PackedElement p3 =
              pack_element<C, kDelta, kEf>(g[u].w, r[u].w, f[u].w, a.prescale, a.int8_scale);
          store_encoded4<C>(a.ring + wrap_slot(payload_slot, 4 * v * kElementBytes, a.capacity),
                            p0.bits, p1.bits, p2.bits, p3.bits);
          if constexpr (kEf) store_f4(res + 4 * v, {p0.residual, p1.residual, p2.residual, p3.residual});
          if constexpr (kDelta) store_f4(ref + 4 * v, {p0.ref, p1.ref, p2.ref, p3.ref});
        }
      }
    }
    for (std::uint32_t j = 4 * groups + lane; j < n; j += lanes) {
      const float rj = kEf ? res[j] : 0.0f;
      const float fj = kDelta ? ref[j] : 0.0f;
      const PackedElement p =
          pack_element<C, kDelta, kEf>(load_f1_readonly(src + j), rj, fj, a.prescale, a.int8_scale);
      store_encoded1<C>(a.ring + wrap_slot(payload_slot, std::uint64_t{j} * kElementBytes, a.capacity),
                        p.bits);
      if constexpr (kEf) res[j] = p.residual;
      if constexpr (kDelta) ref[j] = p.ref;
    }
  }
  if (lane == 0 && (a.tile.flags & kTileFirst) != 0) {
    PackedChunkHeader h{};
    h.key = rec.key;
    h.elem_offset = rec.elem_offset;
    h.chunk_index = rec.chunk_index;
    h.num_elements = rec.num_elements;
    h.scale = C == Codec::kInt8 ? a.int8_scale : 1.0f;
    h.codec = static_cast<std::uint8_t>(C);
    h.flags = kDelta ? kRecordFlagDelta : 0;
    h.magic = kRecordMagic;
    write_header(a.ring, a.capacity, a.record_pos, h);
  }
  if (lane == 0 && (a.tile.flags & kTileLast) != 0) {
    const std::uint64_t payload_end = kRecordHeaderBytes + std::uint64_t{rec.num_elements} * kElementBytes;
    const std::uint64_t end = record_bytes(rec.num_elements, C);
    for (std::uint64_t b = payload_end; b < end; ++b) {
      a.ring[(a.record_pos + b) % a.capacity] = std::byte{0};
    }
  }
}

// This lane's part of the tile's int8 absmax (NaN ignored; 0 when empty).
template <bool kDelta, bool kEf>
EMBER_HOST_DEVICE float absmax_tile_lane(const PackTileArgs& a, std::uint32_t lane,
                                         std::uint32_t lanes) {
  const std::uint32_t n = a.tile.num_elements;
  float m = 0.0f;
  if (n == 0) return m;
  const float* src = a.src + a.tile.elem_begin;
  const float* res = kEf ? a.residual + a.tile.elem_begin : nullptr;
  const float* ref = kDelta ? a.ref + a.tile.elem_begin : nullptr;
  const std::uint32_t groups = tile_vector_groups(src, res, ref, n);
  for (std::uint32_t first = lane; first < groups; first += lanes * kTileUnroll<kDelta, kEf>) {
    F4 g[kTileUnroll<kDelta, kEf>] = {};
    F4 r[kTileUnroll<kDelta, kEf>] = {};
    F4 f[kTileUnroll<kDelta, kEf>] = {};
    EMBER_UNROLL
    for (std::uint32_t u = 0; u < kTileUnroll<kDelta, kEf>; ++u) {
      const std::uint32_t v = first + u * lanes;
      if (v < groups) {
        g[u] = load_f4_readonly(src + 4 * v);
        if constexpr (kEf) r[u] = load_f4(res + 4 * v);
        if constexpr (kDelta) f[u] = load_f4(ref + 4 * v);
      }
    }
    EMBER_UNROLL
    for (std::uint32_t u = 0; u < kTileUnroll<kDelta, kEf>; ++u) {
      if (first + u * lanes < groups) {
        m = max_ignore_nan(m, absmax_input<kDelta, kEf>(g[u].x, r[u].x, f[u].x, a.prescale));
        m = max_ignore_nan(m, absmax_input<kDelta, kEf>(g[u].y, r[u].y, f[u].y, a.prescale));
        m = max_ignore_nan(m, absmax_input<kDelta, kEf>(g[u].z, r[u].z, f[u].z, a.prescale));
        m = max_ignore_nan(m, absmax_input<kDelta, kEf>(g[u].w, r[u].w, f[u].w, a.prescale));
      }
    }
  }
  for (std::uint32_t j = 4 * groups + lane; j < n; j += lanes) {
    m = max_ignore_nan(m, absmax_input<kDelta, kEf>(load_f1_readonly(src + j), kEf ? res[j] : 0.0f,
                                                    kDelta ? ref[j] : 0.0f, a.prescale));
  }
  return m;
}

template <Codec C>
EMBER_HOST_DEVICE inline void pack_tile_codec(const PackTileArgs& a, const GroupParams& g,
                                              std::uint32_t lane, std::uint32_t lanes) {
  if (g.delta) {
    if (g.error_feedback) {
      pack_tile_lane<C, true, true>(a, lane, lanes);
    } else {
      pack_tile_lane<C, true, false>(a, lane, lanes);
    }
  } else {
    if (g.error_feedback) {
      pack_tile_lane<C, false, true>(a, lane, lanes);
    } else {
      pack_tile_lane<C, false, false>(a, lane, lanes);
    }
  }
}

// Packs this lane's share of a tile with the group's codec and options.
EMBER_HOST_DEVICE inline void pack_tile(const PackTileArgs& a, const GroupParams& g,
                                        std::uint32_t lane, std::uint32_t lanes) {
  switch (g.codec) {
    case Codec::kFp32: pack_tile_codec<Codec::kFp32>(a, g, lane, lanes); break;
    case Codec::kBf16: pack_tile_codec<Codec::kBf16>(a, g, lane, lanes); break;
    case Codec::kFp16: pack_tile_codec<Codec::kFp16>(a, g, lane, lanes); break;
    case Codec::kInt8: pack_tile_codec<Codec::kInt8>(a, g, lane, lanes); break;
  }
}

EMBER_HOST_DEVICE inline float absmax_tile(const PackTileArgs& a, const GroupParams& g,
                                           std::uint32_t lane, std::uint32_t lanes) {
  if (g.delta) {
    return g.error_feedback ? absmax_tile_lane<true, true>(a, lane, lanes)
                            : absmax_tile_lane<true, false>(a, lane, lanes);
  }
  return g.error_feedback ? absmax_tile_lane<false, true>(a, lane, lanes)
                          : absmax_tile_lane<false, false>(a, lane, lanes);
}

// ---------------------------------------------------------------------------
// Unpack.

struct UnpackTileArgs {
  const std::byte* ring = nullptr;  // first data byte of the recv ring
  std::uint64_t capacity = 0;
  std::uint64_t record_pos = 0;     // absolute position of the record's first byte
  const PlanRecord* record = nullptr;
  PlanTile tile{};
  float* dst = nullptr;             // the record's first destination element
  float* ref = nullptr;             // the record's first recv reference (delta only)
};

EMBER_HOST_DEVICE inline UnpackTileArgs make_unpack_tile_args(
    const PlanRecord& rec, const PlanTile& tile, const GroupParams& g, const std::byte* ring,
    std::uint64_t capacity, std::uint64_t base, float* tensor, float* ref_arena) {
  UnpackTileArgs a;
  a.ring = ring;
  a.capacity = capacity;
  a.record_pos = base + rec.rel_pos;
  a.record = &rec;
  a.tile = tile;
  a.dst = rec.num_elements == 0 ? tensor : tensor + rec.elem_offset;
  a.ref = g.delta ? ref_arena + rec.ref_offset : nullptr;
  return a;
}

template <Codec C, bool kDelta>
EMBER_HOST_DEVICE void unpack_tile_lane(const UnpackTileArgs& a, std::uint32_t lane,
                                        std::uint32_t lanes) {
  constexpr std::uint64_t kElementBytes = codec_element_bytes(C);
  const std::uint32_t n = a.tile.num_elements;
  if (n == 0) return;
  float scale = 1.0f;
  if constexpr (C == Codec::kInt8) {
    scale = bits_float(load_u32(a.ring + (a.record_pos + offsetof(PackedChunkHeader, scale)) % a.capacity));
  }
  const std::uint64_t payload_slot =
      (a.record_pos + kRecordHeaderBytes + std::uint64_t{a.tile.elem_begin} * kElementBytes) %
      a.capacity;
  float* dst = a.dst + a.tile.elem_begin;
  float* ref = kDelta ? a.ref + a.tile.elem_begin : nullptr;
  const std::uint32_t groups = tile_vector_groups(dst, ref, nullptr, n);
  for (std::uint32_t first = lane; first < groups; first += lanes * kTileUnroll<kDelta, false>) {
    U32x4 q[kTileUnroll<kDelta, false>] = {};
    F4 f[kTileUnroll<kDelta, false>] = {};
    EMBER_UNROLL
    for (std::uint32_t u = 0; u < kTileUnroll<kDelta, false>; ++u) {
      const std::uint32_t v = first + u * lanes;
      if (v < groups) {
        q[u] = load_encoded4<C>(a.ring + wrap_slot(payload_slot, 4 * v * kElementBytes, a.capacity));
        if constexpr (kDelta) f[u] = load_f4(ref + 4 * v);
      }
    }
    EMBER_UNROLL
    for (std::uint32_t u = 0; u < kTileUnroll<kDelta, false>; ++u) {
      const std::uint32_t v = first + u * lanes;
      if (v < groups) {
        const F4 out{unpack_element<C, kDelta>(q[u].x, f[u].x, scale),
                     unpack_element<C, kDelta>(q[u].y, f[u].y, scale),
                     unpack_element<C, kDelta>(q[u].z, f[u].z, scale),
                     unpack_element<C, kDelta>(q[u].w, f[u].w, scale)};
        store_f4(dst + 4 * v, out);
        if constexpr (kDelta) store_f4(ref + 4 * v, out);
      }
    }
  }
  for (std::uint32_t j = 4 * groups + lane; j < n; j += lanes) {
    const std::uint32_t bits =
        load_encoded1<C>(a.ring + wrap_slot(payload_slot, std::uint64_t{j} * kElementBytes, a.capacity));
    const float out = unpack_element<C, kDelta>(bits, kDelta ? ref[j] : 0.0f, scale);
    dst[j] = out;
    if constexpr (kDelta) ref[j] = out;
  }
}

EMBER_HOST_DEVICE inline void unpack_tile(const UnpackTileArgs& a, const GroupParams& g,
                                          std::uint32_t lane, std::uint32_t lanes) {
  switch (g.codec) {
    case Codec::kFp32:
      g.delta ? unpack_tile_lane<Codec::kFp32, true>(a, lane, lanes)
              : unpack_tile_lane<Codec::kFp32, false>(a, lane, lanes);
      break;
    case Codec::kBf16:
      g.delta ? unpack_tile_lane<Codec::kBf16, true>(a, lane, lanes)
              : unpack_tile_lane<Codec::kBf16, false>(a, lane, lanes);
      break;
    case Codec::kFp16:
      g.delta ? unpack_tile_lane<Codec::kFp16, true>(a, lane, lanes)
              : unpack_tile_lane<Codec::kFp16, false>(a, lane, lanes);
      break;
    case Codec::kInt8:
      g.delta ? unpack_tile_lane<Codec::kInt8, true>(a, lane, lanes)
              : unpack_tile_lane<Codec::kInt8, false>(a, lane, lanes);
      break;
  }
}

}  // namespace ember::gpu
