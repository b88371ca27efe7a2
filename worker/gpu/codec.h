// Element codecs and the packed record format, shared by the CUDA kernels and
// the CPU reference so both produce the same bits.
//
// Gradients are fp32. Per key group they are sent as:
//   kFp32  4 bytes, the value itself;
//   kBf16  2 bytes, round-to-nearest-even, finite values saturate at ±bf16 max;
//   kFp16  2 bytes, round-to-nearest-even (subnormals kept), finite values
//          saturate at ±65504, so a finite gradient never becomes inf;
//   kInt8  1 byte, q = clamp(rint(x / s), -127, 127) with one scale per chunk,
//          s = absmax(x over the chunk) / 127 (symmetric absmax quantisation
//          as in LLM.int8(), Dettmers et al. 2022, per chunk instead of per
//          row); decoded as q * s. Needs finite inputs: an inf makes s = inf.
// Before encoding, a value is prepared (prepared_value): v = g * prescale
// (bf16/fp16 default to prescale = 1/num_workers, which keeps a reduction of
// num_workers encoded values within their range; DeviceExchange divides the
// prescale back out before pushing fp32 to the server, which takes the mean
// itself: device_exchange.h, "What the server gets"), plus
// the residual kept from the last step when error feedback is on (Seide et
// al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "EF-SGD"). With delta
// encoding the codec carries x = v - ref, where ref is the reconstruction of
// what was sent so far; sender and receiver both update ref += decode(q), so
// they stay bit-identical. The residual is v - reconstruction.
//
// Bit-exactness between GPU and CPU: every float operation goes through
// mul_rn/add_rn/sub_rn/div_rn (IEEE round-to-nearest, never fused: the device
// uses the __f*_rn intrinsics, the host builds with -ffp-contract=off) and the
// conversions are integer code, identical on both sides. Denormals are kept
// (no flush-to-zero on either side). A NaN that arithmetic produces is the
// canonical 0x7fffffff on both sides (canonical_nan); an input NaN keeps its
// payload only where no arithmetic touches it (fp32 with prescale 1, no
// delta, no error feedback).
//
// Record format (inside a ring, little-endian, 16-byte aligned): a 32-byte
// PackedChunkHeader, then num_elements encoded elements, then zero padding to
// a multiple of 16 bytes. See worker/gpu/README.md for the byte table.
//
// Thread-safety: pure functions.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/placement/placement.h"  // EMBER_HOST_DEVICE

namespace ember::gpu {

enum class Codec : std::uint8_t { kFp32 = 0, kBf16 = 1, kFp16 = 2, kInt8 = 3 };
inline constexpr std::uint32_t kNumCodecs = 4;

EMBER_HOST_DEVICE constexpr std::uint32_t codec_element_bytes(Codec c) {
  return c == Codec::kFp32 ? 4u : (c == Codec::kInt8 ? 1u : 2u);
}

// ---------------------------------------------------------------------------
// Bit casts and IEEE arithmetic that is never contracted into an FMA.

EMBER_HOST_DEVICE inline std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

EMBER_HOST_DEVICE inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// The NaN every arithmetic helper below returns for a NaN result. Hardware
// differs here: x86 SSE keeps an input NaN's payload and sign and makes
// 0xffc00000 for inf - inf; NVIDIA GPUs return 0x7fffffff. One pattern on
// both sides keeps NaN-carrying steps bit-identical too.
inline constexpr std::uint32_t kCanonicalNanBits = 0x7fffffffu;
EMBER_HOST_DEVICE inline float canonical_nan(float r) {
  return r != r ? bits_float(kCanonicalNanBits) : r;
}

EMBER_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return canonical_nan(__fmul_rn(a, b));
#else
  return canonical_nan(a * b);
#endif
}
EMBER_HOST_DEVICE inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return canonical_nan(__fadd_rn(a, b));
#else
  return canonical_nan(a + b);
#endif
}
EMBER_HOST_DEVICE inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return canonical_nan(__fsub_rn(a, b));
#else
  return canonical_nan(a - b);
#endif
}
EMBER_HOST_DEVICE inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return canonical_nan(__fdiv_rn(a, b));
#else
  return canonical_nan(a / b);
#endif
}
// Round to nearest integer, ties to even (the default rounding mode on host).
EMBER_HOST_DEVICE inline float rint_even(float a) {
#if defined(__CUDA_ARCH__)
  return rintf(a);
#else
  return std::nearbyint(a);
#endif
}
EMBER_HOST_DEVICE inline float abs_bits(float a) { return bits_float(float_bits(a) & 0x7fffffffu); }

// ---------------------------------------------------------------------------
// Scalar conversions (integer code: same bits on host and device).

// fp32 → bf16, round to nearest even; NaN stays a quiet NaN; a finite value
// that would round to infinity saturates at ±0x7f7f (bf16 max).
EMBER_HOST_DEVICE inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t x = float_bits(f);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);  // quiet NaN
  if (ax == 0x7f800000u) return static_cast<std::uint16_t>(x >> 16);            // ±inf
  if (ax >= 0x7f7f8000u) return static_cast<std::uint16_t>(((x >> 16) & 0x8000u) | 0x7f7fu);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

EMBER_HOST_DEVICE inline float bf16_to_f32(std::uint16_t h) {
  return bits_float(static_cast<std::uint32_t>(h) << 16);
}

// fp32 → fp16 (IEEE binary16), round to nearest even, subnormals produced;
// NaN stays a quiet NaN, ±inf stays ±inf, a finite value ≥ 65520 in magnitude
// (which would round to inf) saturates at ±65504.
EMBER_HOST_DEVICE inline std::uint16_t f32_to_f16(float f) {
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7bffu);  // ≥ 65520: saturate
  if (ax < 0x38800000u) {                                                     // < 2^-14: subnormal
    if (ax <= 0x33000000u) return static_cast<std::uint16_t>(sign);           // ≤ 2^-25 → ±0
    const std::uint32_t exponent = ax >> 23;                                  // 102..112
    const std::uint32_t mantissa = (ax & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exponent;                              // 14..24
    std::uint32_t q = mantissa >> shift;
    const std::uint32_t rem = mantissa & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<std::uint16_t>(sign | q);
  }
  std::uint32_t q = (ax >> 13) - (112u << 10);  // rebias 127 → 15
  const std::uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;
  return static_cast<std::uint16_t>(sign | q);
}

EMBER_HOST_DEVICE inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return bits_float(sign);
    // Subnormal: value = mantissa * 2^-24; normalise.
    std::int32_t e = 1;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    mantissa &= 0x3ffu;
    return bits_float(sign | (static_cast<std::uint32_t>(e + 112) << 23) | (mantissa << 13));
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// int8 scale from a chunk's absolute maximum: the dequantisation multiplier.
EMBER_HOST_DEVICE inline float int8_scale_from_absmax(float absmax) {
  return absmax > 0.0f ? div_rn(absmax, 127.0f) : 0.0f;
}

EMBER_HOST_DEVICE inline std::uint8_t f32_to_int8(float x, float scale) {
  if (!(scale > 0.0f)) return 0;
  float r = rint_even(div_rn(x, scale));
  if (r != r) r = 0.0f;  // NaN (x = ±inf with scale = inf)
  r = r > 127.0f ? 127.0f : r;
  r = r < -127.0f ? -127.0f : r;
  return static_cast<std::uint8_t>(static_cast<std::int8_t>(static_cast<std::int32_t>(r)));
}

EMBER_HOST_DEVICE inline float int8_to_f32(std::uint8_t q, float scale) {
  return mul_rn(static_cast<float>(static_cast<std::int8_t>(q)), scale);
}

// Encoded bits of x (low codec_element_bytes bytes are meaningful).
template <Codec C>
EMBER_HOST_DEVICE inline std::uint32_t encode_value(float x, float int8_scale) {
  if constexpr (C == Codec::kFp32) {
    return float_bits(x);
  } else if constexpr (C == Codec::kBf16) {
    return f32_to_bf16(x);
  } else if constexpr (C == Codec::kFp16) {
    return f32_to_f16(x);
  } else {
    return f32_to_int8(x, int8_scale);
  }
}

template <Codec C>
EMBER_HOST_DEVICE inline float decode_value(std::uint32_t bits, float int8_scale) {
  if constexpr (C == Codec::kFp32) {
    return bits_float(bits);
  } else if constexpr (C == Codec::kBf16) {
    return bf16_to_f32(static_cast<std::uint16_t>(bits));
  } else if constexpr (C == Codec::kFp16) {
    return f16_to_f32(static_cast<std::uint16_t>(bits));
  } else {
    return int8_to_f32(static_cast<std::uint8_t>(bits), int8_scale);
  }
}

// ---------------------------------------------------------------------------
// The per-element pipeline (one definition for kernels and CPU reference).

// Resolved compression options of one key group, as the kernels see them.
struct GroupParams {
  Codec codec = Codec::kFp32;
  std::uint8_t delta = 0;           // 1: encode v - ref
  std::uint8_t error_feedback = 0;  // 1: add last step's residual, keep the new one
  std::uint8_t reserved = 0;
  float prescale = 1.0f;            // multiplies the gradient before encoding
};
static_assert(sizeof(GroupParams) == 8, "GroupParams is uploaded as is");

// v = g * prescale (skipped when prescale is exactly 1, so fp32 round trips
// every bit pattern, NaN payloads included) + residual (error feedback).
template <bool kEf>
EMBER_HOST_DEVICE inline float prepared_value(float g, float residual, float prescale) {
  float v = prescale == 1.0f ? g : mul_rn(g, prescale);
  if constexpr (kEf) v = add_rn(v, residual);
  return v;
}

template <bool kDelta>
EMBER_HOST_DEVICE inline float codec_input(float v, float ref) {
  if constexpr (kDelta) {
    return sub_rn(v, ref);
  } else {
    return v;
  }
}

// |x| that enters a chunk's int8 absmax for one element.
template <bool kDelta, bool kEf>
EMBER_HOST_DEVICE inline float absmax_input(float g, float residual, float ref, float prescale) {
  return abs_bits(codec_input<kDelta>(prepared_value<kEf>(g, residual, prescale), ref));
}

// NaN-ignoring max: a NaN never becomes the maximum (the comparison is false).
EMBER_HOST_DEVICE inline float max_ignore_nan(float m, float a) { return a > m ? a : m; }

struct PackedElement {
  std::uint32_t bits;  // encoded value
  float residual;      // new residual (unchanged input when !kEf)
  float ref;           // new reference (unchanged input when !kDelta)
};

template <Codec C, bool kDelta, bool kEf>
EMBER_HOST_DEVICE inline PackedElement pack_element(float g, float residual, float ref,
                                                    float prescale, float int8_scale) {
  const float v = prepared_value<kEf>(g, residual, prescale);
  const float x = codec_input<kDelta>(v, ref);
  PackedElement out{encode_value<C>(x, int8_scale), residual, ref};
  const float decoded = decode_value<C>(out.bits, int8_scale);
  float reconstruction = decoded;
  if constexpr (kDelta) {
    reconstruction = add_rn(ref, decoded);
    out.ref = reconstruction;
  }
  if constexpr (kEf) out.residual = sub_rn(v, reconstruction);
  return out;
}

// Decoded value of one element on the receiving side; with delta encoding
// the result is also the receiver's new reference.
template <Codec C, bool kDelta>
EMBER_HOST_DEVICE inline float unpack_element(std::uint32_t bits, float ref, float int8_scale) {
  const float decoded = decode_value<C>(bits, int8_scale);
  if constexpr (kDelta) {
    return add_rn(ref, decoded);
  } else {
    return decoded;
  }
}

// ---------------------------------------------------------------------------
// Record header: 32 bytes, little-endian, at a 16-byte aligned ring position.

inline constexpr std::uint16_t kRecordMagic = 0xE3B7;
inline constexpr std::uint8_t kRecordFlagDelta = 1;
inline constexpr std::uint32_t kRecordHeaderBytes = 32;
inline constexpr std::uint32_t kRecordAlignBytes = 16;

struct PackedChunkHeader {
  std::uint64_t key;           // 0: tensor key
  std::uint64_t elem_offset;   // 8: first element of the chunk within the tensor
  std::uint32_t chunk_index;   // 16: chunk number within the tensor
  std::uint32_t num_elements;  // 20: elements in this record
  float scale;                 // 24: int8 dequantisation multiplier; 1.0 for other codecs
  std::uint8_t codec;          // 28: Codec
  std::uint8_t flags;          // 29: kRecordFlag*
  std::uint16_t magic;         // 30: kRecordMagic
};
static_assert(sizeof(PackedChunkHeader) == kRecordHeaderBytes);
static_assert(offsetof(PackedChunkHeader, elem_offset) == 8);
static_assert(offsetof(PackedChunkHeader, chunk_index) == 16);
static_assert(offsetof(PackedChunkHeader, num_elements) == 20);
static_assert(offsetof(PackedChunkHeader, scale) == 24);
static_assert(offsetof(PackedChunkHeader, codec) == 28);
static_assert(offsetof(PackedChunkHeader, flags) == 29);
static_assert(offsetof(PackedChunkHeader, magic) == 30);

// The header as eight little-endian 32-bit words (what kernels store).
EMBER_HOST_DEVICE inline void header_to_words(const PackedChunkHeader& h, std::uint32_t w[8]) {
  w[0] = static_cast<std::uint32_t>(h.key);
  w[1] = static_cast<std::uint32_t>(h.key >> 32);
  w[2] = static_cast<std::uint32_t>(h.elem_offset);
  w[3] = static_cast<std::uint32_t>(h.elem_offset >> 32);
  w[4] = h.chunk_index;
  w[5] = h.num_elements;
  w[6] = float_bits(h.scale);
  w[7] = static_cast<std::uint32_t>(h.codec) | (static_cast<std::uint32_t>(h.flags) << 8) |
         (static_cast<std::uint32_t>(h.magic) << 16);
}

EMBER_HOST_DEVICE inline PackedChunkHeader header_from_words(const std::uint32_t w[8]) {
  PackedChunkHeader h{};
  h.key = static_cast<std::uint64_t>(w[0]) | (static_cast<std::uint64_t>(w[1]) << 32);
  h.elem_offset = static_cast<std::uint64_t>(w[2]) | (static_cast<std::uint64_t>(w[3]) << 32);
  h.chunk_index = w[4];
  h.num_elements = w[5];
  h.scale = bits_float(w[6]);
  h.codec = static_cast<std::uint8_t>(w[7]);
  h.flags = static_cast<std::uint8_t>(w[7] >> 8);
  h.magic = static_cast<std::uint16_t>(w[7] >> 16);
  return h;
}

// Whether a header describes the given chunk with the given encoding.
EMBER_HOST_DEVICE inline bool header_is(const PackedChunkHeader& h, std::uint64_t key,
                                        std::uint32_t chunk_index, std::uint64_t elem_offset,
                                        std::uint32_t num_elements, Codec codec, bool delta) {
  return h.magic == kRecordMagic && h.key == key && h.chunk_index == chunk_index &&
         h.elem_offset == elem_offset && h.num_elements == num_elements &&
         h.codec == static_cast<std::uint8_t>(codec) && h.flags == (delta ? kRecordFlagDelta : 0);
}

// StepStatus::found_codec for a header: the codec byte, or 0x10000 | magic
// when the magic is wrong.
EMBER_HOST_DEVICE inline std::uint32_t header_found_codec(const PackedChunkHeader& h) {
  return h.magic == kRecordMagic ? h.codec : (0x10000u | h.magic);
}

EMBER_HOST_DEVICE constexpr std::uint64_t round_up(std::uint64_t x, std::uint64_t to) {
  return (x + to - 1) / to * to;
}

// Bytes of a record carrying n elements: header + payload + padding.
EMBER_HOST_DEVICE constexpr std::uint64_t record_bytes(std::uint64_t num_elements, Codec c) {
  return kRecordHeaderBytes + round_up(num_elements * codec_element_bytes(c), kRecordAlignBytes);
}

}  // namespace ember::gpu
