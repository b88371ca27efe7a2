// Element codecs: conversions against the compiler's own _Float16 and
// against the definition of round-to-nearest-even, quantisation bounds, and
// the header's byte layout.
#include "worker/gpu/codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <gtest/gtest.h>

namespace ember::gpu {
namespace {

float from_bits(std::uint32_t u) { return bits_float(u); }

TEST(Codec, Fp16MatchesTheCompilersConversionOutsideTheSaturationRange) {
  // Every 4099th bit pattern plus the neighbourhoods of the boundaries.
  std::vector<std::uint32_t> patterns;
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += 4099) patterns.push_back(static_cast<std::uint32_t>(u));
  for (std::uint32_t edge : {0x33000000u, 0x33800000u, 0x38800000u, 0x387fe000u, 0x477fe000u,
                             0x477ff000u, 0x47800000u, 0x7f800000u, 0x00000001u}) {
    for (std::int32_t d = -4096; d <= 4096; ++d) {
      patterns.push_back(edge + static_cast<std::uint32_t>(d));
      patterns.push_back((edge + static_cast<std::uint32_t>(d)) | 0x80000000u);
    }
  }
  for (std::uint32_t u : patterns) {
    const float f = from_bits(u);
    const std::uint16_t ours = f32_to_f16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(ours))) << std::hex << u;
      continue;
    }
    if (std::isfinite(f) && std::fabs(f) >= 65520.0f) {
      EXPECT_EQ(ours & 0x7fffu, 0x7bffu) << "saturates, " << std::hex << u;
      continue;
    }
    const _Float16 ref = static_cast<_Float16>(f);
    std::uint16_t ref_bits;
    std::memcpy(&ref_bits, &ref, 2);
    ASSERT_EQ(ours, ref_bits) << "f32 bits 0x" << std::hex << u << " (" << f << ")";
  }
}

TEST(Codec, Fp16DecodeIsExactForEveryPattern) {
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    _Float16 ref;
    const auto bits = static_cast<std::uint16_t>(h);
    std::memcpy(&ref, &bits, 2);
    const float want = static_cast<float>(ref);
    const float got = f16_to_f32(bits);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(float_bits(got), float_bits(want)) << "f16 0x" << std::hex << h;
    }
  }
}

TEST(Codec, Bf16RoundsToNearestEvenAndSaturates) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 2'000'000; ++i) {
    const auto u = static_cast<std::uint32_t>(rng());
    const float f = from_bits(u);
    const std::uint16_t q = f32_to_bf16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(q)));
      continue;
    }
    const std::uint32_t ax = u & 0x7fffffffu;
    if (std::isinf(f)) {
      EXPECT_EQ(bf16_to_f32(q), f);
      continue;
    }
    if (ax >= 0x7f7f8000u) {
      EXPECT_EQ(q & 0x7fffu, 0x7f7fu) << std::hex << u;
      continue;
    }
    // The two candidates are truncation and truncation + 1 ulp.
    const std::uint32_t lo = u & 0xffff0000u;
    const std::uint32_t rem = u & 0xffffu;
    std::uint32_t want = lo;
    if (rem > 0x8000u || (rem == 0x8000u && ((lo >> 16) & 1u))) want = lo + 0x10000u;
    ASSERT_EQ(static_cast<std::uint32_t>(q) << 16, want) << std::hex << u;
  }
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f7fu);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::max()), 0xff7fu);
}

TEST(Codec, Int8ErrorIsWithinHalfAStep) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int chunk = 0; chunk < 200; ++chunk) {
    std::vector<float> x(257);
    float absmax = 0.0f;
    for (float& v : x) {
      v = normal(rng);
      absmax = max_ignore_nan(absmax, abs_bits(v));
    }
    const float scale = int8_scale_from_absmax(absmax);
    for (float v : x) {
      const std::uint8_t q = f32_to_int8(v, scale);
      const auto qi = static_cast<std::int8_t>(q);
      EXPECT_GE(qi, -127);
      // Half a step, plus the rounding of x / s and q * s (≤ 127 · 2^-24 steps each).
      EXPECT_LE(std::fabs(int8_to_f32(q, scale) - v), (0.5f + 0x1p-15f) * scale) << v;
      if (abs_bits(v) == absmax) {
        EXPECT_EQ(std::abs(qi), 127);
      }
    }
  }
  EXPECT_EQ(int8_scale_from_absmax(0.0f), 0.0f);
  EXPECT_EQ(f32_to_int8(0.0f, 0.0f), 0u);
  EXPECT_EQ(int8_to_f32(0, 0.0f), 0.0f);
}

TEST(Codec, Fp32WithoutScalingKeepsEveryBit) {
  for (std::uint32_t u : {0x7fc00001u, 0xffa00000u, 0x80000000u, 0x00000001u, 0x7f800000u, 0x3f800001u}) {
    const PackedElement p = pack_element<Codec::kFp32, false, false>(from_bits(u), 0.0f, 0.0f, 1.0f, 0.0f);
    EXPECT_EQ(p.bits, u) << std::hex << u;
    EXPECT_EQ(float_bits(unpack_element<Codec::kFp32, false>(p.bits, 0.0f, 0.0f)), u);
  }
}

// A NaN that arithmetic makes is 0x7fffffff, as on the GPU, whatever the
// host's FPU makes of it (x86: the input's payload and sign; 0xffc00000 for
// inf - inf): CPU and GPU steps that carry NaNs stay bit-identical.
TEST(Codec, ArithmeticMakesTheCanonicalNan) {
  const float payload_nan = from_bits(0xffc00123u);
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_bits(mul_rn(payload_nan, 0.5f)), kCanonicalNanBits);
  EXPECT_EQ(float_bits(add_rn(inf, -inf)), kCanonicalNanBits);
  EXPECT_EQ(float_bits(sub_rn(inf, inf)), kCanonicalNanBits);
  EXPECT_EQ(float_bits(div_rn(0.0f, 0.0f)), kCanonicalNanBits);
  EXPECT_EQ(float_bits(mul_rn(2.0f, 3.0f)), float_bits(6.0f));  // numbers as they were
  // bf16 with the default prescale (1/num_workers): the prescaled NaN.
  const PackedElement b = pack_element<Codec::kBf16, false, false>(payload_nan, 0.0f, 0.0f, 0.5f, 0.0f);
  EXPECT_EQ(b.bits, 0x7fffu);
  // Error feedback fed +inf: the residual inf - inf, and every later step.
  const PackedElement e = pack_element<Codec::kFp32, false, true>(inf, 0.0f, 0.0f, 1.0f, 0.0f);
  EXPECT_EQ(float_bits(e.residual), kCanonicalNanBits);
  const PackedElement next = pack_element<Codec::kFp32, false, true>(1.0f, e.residual, 0.0f, 1.0f, 0.0f);
  EXPECT_EQ(next.bits, kCanonicalNanBits);
}

TEST(Codec, ErrorFeedbackResidualIsWhatTheCodecLost) {
  const float g = 0.1f;
  const float residual = 0.003f;
  const PackedElement p = pack_element<Codec::kBf16, false, true>(g, residual, 0.0f, 1.0f, 0.0f);
  const float v = g + residual;
  EXPECT_EQ(p.residual, v - bf16_to_f32(static_cast<std::uint16_t>(p.bits)));
  // Delta: both sides move their reference by the decoded difference.
  const PackedElement d = pack_element<Codec::kInt8, true, false>(2.0f, 0.0f, 1.5f, 1.0f, 0.01f);
  const float receiver = unpack_element<Codec::kInt8, true>(d.bits, 1.5f, 0.01f);
  EXPECT_EQ(float_bits(d.ref), float_bits(receiver));
  EXPECT_NEAR(receiver, 2.0f, 0.005f);
}

TEST(Codec, HeaderWordsMatchTheStructLayout) {
  PackedChunkHeader h{};
  h.key = 0x1122334455667788ull;
  h.elem_offset = 0x0102030405060708ull;
  h.chunk_index = 9;
  h.num_elements = 12345;
  h.scale = 0.25f;
  h.codec = static_cast<std::uint8_t>(Codec::kInt8);
  h.flags = kRecordFlagDelta;
  h.magic = kRecordMagic;
  std::uint32_t w[8];
  header_to_words(h, w);
  EXPECT_EQ(std::memcmp(w, &h, sizeof h), 0);
  const PackedChunkHeader back = header_from_words(w);
  EXPECT_EQ(std::memcmp(&back, &h, sizeof h), 0);
  EXPECT_TRUE(header_is(h, h.key, 9, h.elem_offset, 12345, Codec::kInt8, true));
  EXPECT_FALSE(header_is(h, h.key, 9, h.elem_offset, 12345, Codec::kInt8, false));
  h.magic = 0;
  EXPECT_EQ(header_found_codec(h), 0x10000u);
}

TEST(Codec, RecordBytesArePaddedToSixteen) {
  EXPECT_EQ(record_bytes(0, Codec::kFp32), 32u);
  EXPECT_EQ(record_bytes(1, Codec::kFp32), 48u);
  EXPECT_EQ(record_bytes(4, Codec::kFp32), 48u);
  EXPECT_EQ(record_bytes(5, Codec::kFp32), 64u);
  EXPECT_EQ(record_bytes(17, Codec::kInt8), 64u);
  EXPECT_EQ(record_bytes(8, Codec::kBf16), 48u);
}

}  // namespace
}  // namespace ember::gpu
