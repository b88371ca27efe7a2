// CPU reference packer: round trips, ring capacity and backpressure, header
// checks, compression error bounds and error feedback.
#include "worker/gpu/cpu_packer.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include <gtest/gtest.h>

#include "tests/unit/gpu/gpu_test_support.h"

namespace ember::gpu {
namespace {

using namespace std::chrono_literals;
using testing::build_plan;
using testing::fill_gradients;
using testing::make_tensors;
using testing::mixed_sizes;
using testing::same_bits;
using testing::TensorSet;

struct Rig {
  std::shared_ptr<const PackPlan> plan;
  HostSymBuffer buffer;
  CpuPacker packer;
};

Rig make_rig(const TensorSet& t, const PlanOptions& o,
             std::chrono::nanoseconds timeout = std::chrono::seconds(5)) {
  auto plan = build_plan(t, o);
  EMBER_CHECK(plan != nullptr);
  auto buffer = HostSymBuffer::allocate(plan->layout());
  EMBER_CHECK(buffer.has_value());
  auto packer = CpuPacker::create(plan, CpuPackerOptions{timeout});
  EMBER_CHECK(packer.has_value());
  return Rig{plan, std::move(*buffer), std::move(*packer)};
}

// pack → loopback (the echoing server) → unpack.
void round_trip(Rig& rig, const TensorSet& src, TensorSet& dst) {
  const auto sources = src.const_ptrs();
  auto st = rig.packer.pack(sources, rig.buffer.view());
  ASSERT_TRUE(st.has_value()) << st.error().to_string();
  st = loopback(rig.buffer.view());
  ASSERT_TRUE(st.has_value()) << st.error().to_string();
  st = rig.packer.unpack(dst.ptrs, rig.buffer.view());
  ASSERT_TRUE(st.has_value()) << st.error().to_string();
}

void expect_bit_exact(const TensorSet& a, const TensorSet& b) {
  ASSERT_EQ(a.descs.size(), b.descs.size());
  for (std::size_t i = 0; i < a.descs.size(); ++i) {
    std::string where;
    ASSERT_TRUE(same_bits(a.tensor(i), b.tensor(i), &where)) << "tensor " << i << ": " << where;
  }
}

// count == 1: one tensor of 4099 elements (five 4 KiB chunks, the last of 3);
// otherwise mixed_sizes (0, 1, odd, multi-tile; 3 of 4 pointers unaligned).
std::vector<std::uint64_t> round_trip_sizes(std::size_t count, std::uint64_t seed) {
  return count == 1 ? std::vector<std::uint64_t>{4099} : mixed_sizes(count, seed);
}

void fp32_round_trip(std::size_t count, std::uint64_t seed) {
  TensorSet src = make_tensors(round_trip_sizes(count, seed));
  fill_gradients(src, seed);
  if (count > 20) {  // NaN payloads, infinities, signed zero and denormals survive
    const std::uint32_t specials[] = {0x7fc00123u, 0xff800000u, 0x80000000u, 0x00000001u, 0x7f7fffffu};
    std::size_t k = 0;
    for (std::size_t i = 0; i < count && k < std::size(specials); ++i) {
      if (src.descs[i].num_elements > 0) std::memcpy(&src.tensor(i)[0], &specials[k++], 4);
    }
  }
  TensorSet dst = make_tensors(round_trip_sizes(count, seed));
  PlanOptions o;
  o.num_channels = 4;
  o.num_servers = 3;
  o.partition_bytes = 4096;
  Rig rig = make_rig(src, o);
  round_trip(rig, src, dst);
  expect_bit_exact(src, dst);
}

TEST(CpuPacker, Fp32RoundTripIsBitExactForZeroTensors) { fp32_round_trip(0, 1); }
TEST(CpuPacker, Fp32RoundTripIsBitExactForOneTensor) { fp32_round_trip(1, 2); }
TEST(CpuPacker, Fp32RoundTripIsBitExactForTenThousandTensors) { fp32_round_trip(10'000, 3); }

TEST(CpuPacker, RoundTripsAcrossTheRingsEndStepAfterStep) {
  TensorSet src = make_tensors(mixed_sizes(300, 4));
  TensorSet dst = make_tensors(mixed_sizes(300, 4));
  PlanOptions o;
  o.num_channels = 2;
  o.num_servers = 2;
  o.partition_bytes = 2048;
  auto probe = build_plan(src, o);
  ASSERT_NE(probe, nullptr);
  // 1.37 steps per ring: every step starts somewhere else, records wrap.
  o.ring_bytes = round_up(probe->max_ring_step_bytes() * 137 / 100, 128);
  Rig rig = make_rig(src, o);
  for (int step = 0; step < 7; ++step) {
    fill_gradients(src, 100 + step);
    round_trip(rig, src, dst);
    expect_bit_exact(src, dst);
  }
  for (std::uint32_t c = 0; c < 2; ++c) {
    for (std::uint32_t r = 0; r < 2; ++r) {
      if (rig.plan->ring_step_bytes()[rig.plan->layout().ring_index(c, r)] == 0) continue;
      EXPECT_GT(rig.buffer.ring(c, r, Direction::kSend).tail(), o.ring_bytes) << "ring never wrapped";
    }
  }
}

TEST(CpuPacker, RingFilledToExactlyItsCapacityThenBackpressureNamesTheRing) {
  // One ring; records of 128 and 256 bytes: the step is exactly 384 bytes,
  // and so is the automatic ring capacity.
  TensorSet src = make_tensors({24, 56});
  fill_gradients(src, 5);
  PlanOptions o;
  Rig rig = make_rig(src, o, 20ms);
  ASSERT_EQ(rig.plan->step_bytes(), 384u);
  ASSERT_EQ(rig.plan->layout().ring_bytes, 384u);
  const auto sources = src.const_ptrs();
  ASSERT_TRUE(rig.packer.pack(sources, rig.buffer.view()).has_value());
  RingView ring = rig.buffer.ring(0, 0, Direction::kSend);
  EXPECT_EQ(ring.tail() - ring.head(), ring.capacity_bytes());
  EXPECT_EQ(ring.writable().size(), 0u);

  // Full: the next step waits 20 ms, then fails without touching anything.
  std::vector<std::byte> before(rig.plan->layout().total_bytes());
  std::memcpy(before.data(), rig.buffer.base(), before.size());
  auto st = rig.packer.pack(sources, rig.buffer.view());
  ASSERT_FALSE(st.has_value());
  EXPECT_EQ(st.error().code(), ErrorCode::kTimeout);
  const std::string& msg = st.error().message();
  EXPECT_NE(msg.find("channel 0 rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("head=0 tail=384"), std::string::npos) << msg;
  EXPECT_NE(msg.find("capacity=384"), std::string::npos) << msg;
  EXPECT_EQ(std::memcmp(before.data(), rig.buffer.base(), before.size()), 0);

  // Drained: the step goes through.
  ring.consume(384);
  ASSERT_TRUE(rig.packer.pack(sources, rig.buffer.view()).has_value());
  EXPECT_EQ(ring.tail(), 768u);
}

// backpressure_timeout bounds the whole step: rings that drain one after
// another, each just before the timeout, do not add their waits up.
TEST(CpuPacker, BackpressureTimeoutBoundsTheStepNotEachRing) {
  TensorSet src = make_tensors({4096, 4096, 4096, 4096});
  PlanOptions o;
  o.num_channels = 2;
  o.partition_bytes = 4096;
  Rig rig = make_rig(src, o, 500ms);
  const auto sources = src.const_ptrs();
  ASSERT_TRUE(rig.packer.pack(sources, rig.buffer.view()).has_value());
  // Both rings (channels 0 and 1) hold a step they cannot take twice: the
  // next pack waits.
  const std::uint64_t capacity = rig.plan->layout().ring_bytes;
  for (std::uint64_t ring = 0; ring < rig.plan->layout().num_rings(); ++ring) {
    ASSERT_GT(2 * rig.plan->ring_step_bytes()[ring], capacity) << ring;
  }
  // The first ring drains at half the timeout; the other never does.
  RingView first = rig.buffer.ring(0, 0, Direction::kSend);
  std::thread drain([&] {
    std::this_thread::sleep_for(250ms);
    first.consume(first.readable().size());
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto st = rig.packer.pack(sources, rig.buffer.view());
  const auto took = std::chrono::steady_clock::now() - t0;
  drain.join();
  ASSERT_FALSE(st.has_value());
  EXPECT_EQ(st.error().code(), ErrorCode::kTimeout);
  // One timeout (500 ms), not 250 ms + another 500 ms for the next ring.
  EXPECT_LT(took, 700ms) << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                         << " ms: " << st.error().to_string();
}

TEST(CpuPacker, BackpressureErrorNamesTheFullRingAmongMany) {
  TensorSet src = make_tensors(mixed_sizes(200, 6));
  PlanOptions o;
  o.num_channels = 4;
  o.num_servers = 2;
  Rig rig = make_rig(src, o, 0ns);
  const auto sources = src.const_ptrs();
  ASSERT_TRUE(rig.packer.pack(sources, rig.buffer.view()).has_value());
  // Drain every ring but (channel 2, rank 1).
  const std::uint64_t keep = rig.plan->layout().ring_index(2, 1);
  ASSERT_GT(rig.plan->ring_step_bytes()[keep], 0u);
  for (std::uint32_t c = 0; c < 4; ++c) {
    for (std::uint32_t r = 0; r < 2; ++r) {
      RingView ring = rig.buffer.ring(c, r, Direction::kSend);
      if (rig.plan->layout().ring_index(c, r) != keep) ring.consume(ring.readable().size());
    }
  }
  auto st = rig.packer.pack(sources, rig.buffer.view());
  ASSERT_FALSE(st.has_value());
  EXPECT_NE(st.error().message().find("channel 2 rank 1"), std::string::npos) << st.error().message();
}

TEST(CpuPacker, WaitsForAConcurrentConsumerToMakeRoom) {
  TensorSet src = make_tensors(mixed_sizes(100, 7));
  fill_gradients(src, 7);
  PlanOptions o;  // one ring, capacity = one step: every step waits for the consumer
  Rig rig = make_rig(src, o, 10s);
  const std::uint64_t step = rig.plan->step_bytes();
  constexpr int kSteps = 50;
  std::atomic<bool> stop{false};
  std::uint64_t consumed = 0;
  std::thread consumer([&] {
    RingView ring = rig.buffer.ring(0, 0, Direction::kSend);
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (consumed < kSteps * step && !stop.load() && std::chrono::steady_clock::now() < deadline) {
      const std::uint64_t n = ring.readable().size();
      if (n == 0) {
        std::this_thread::yield();
        continue;
      }
      ring.consume(n);
      consumed += n;
    }
  });
  const auto sources = src.const_ptrs();
  for (int i = 0; i < kSteps; ++i) {
    auto st = rig.packer.pack(sources, rig.buffer.view());
    if (!st) {
      stop = true;
      consumer.join();
      FAIL() << "step " << i << ": " << st.error().to_string();
    }
  }
  consumer.join();
  EXPECT_EQ(consumed, kSteps * step);
}

TEST(CpuPacker, UnpackTimesOutOnAnEmptyRecvRing) {
  TensorSet t = make_tensors({10, 20, 30});
  PlanOptions o;
  o.num_channels = 2;
  Rig rig = make_rig(t, o, 0ns);
  auto st = rig.packer.unpack(t.ptrs, rig.buffer.view());
  ASSERT_FALSE(st.has_value());
  EXPECT_EQ(st.error().code(), ErrorCode::kTimeout);
  EXPECT_NE(st.error().message().find("recv ring of channel"), std::string::npos) << st.error().message();
  EXPECT_NE(st.error().message().find("head=0 tail=0"), std::string::npos) << st.error().message();
}

TEST(CpuPacker, UnpackRejectsARecordThatDoesNotMatchThePlan) {
  TensorSet src = make_tensors(mixed_sizes(50, 8));
  fill_gradients(src, 8);
  TensorSet dst = make_tensors(mixed_sizes(50, 8));
  for (std::size_t i = 0; i < dst.descs.size(); ++i) {
    for (float& v : dst.tensor(i)) v = 42.0f;
  }
  PlanOptions o;
  o.num_channels = 2;
  Rig rig = make_rig(src, o);
  ASSERT_TRUE(rig.packer.pack(src.const_ptrs(), rig.buffer.view()).has_value());
  ASSERT_TRUE(loopback(rig.buffer.view()).has_value());
  // Corrupt the key of the third record of ring 1.
  const std::uint32_t victim = rig.plan->ring_record_begin()[1] + 2;
  const PlanRecord& r = rig.plan->records()[victim];
  std::byte* data = rig.plan->layout().data(rig.buffer.base(), r.ring, Direction::kRecv);
  data[r.rel_pos] ^= std::byte{0x5a};
  auto st = rig.packer.unpack(dst.ptrs, rig.buffer.view());
  ASSERT_FALSE(st.has_value());
  EXPECT_EQ(st.error().code(), ErrorCode::kProtocol);
  const std::string& msg = st.error().message();
  EXPECT_NE(msg.find("record " + std::to_string(victim)), std::string::npos) << msg;
  EXPECT_NE(msg.find("should be key " + std::to_string(r.key)), std::string::npos) << msg;
  EXPECT_NE(msg.find("channel 1 rank 0"), std::string::npos) << msg;
  // Nothing was unpacked, nothing consumed.
  for (std::size_t i = 0; i < dst.descs.size(); ++i) {
    for (float v : dst.tensor(i)) ASSERT_EQ(v, 42.0f);
  }
  EXPECT_EQ(rig.buffer.ring(1, 0, Direction::kRecv).head(), 0u);
}

TEST(CpuPacker, RejectsBadArguments) {
  TensorSet t = make_tensors({10, 20});
  PlanOptions o;
  Rig rig = make_rig(t, o);
  std::vector<const float*> one = {t.ptrs[0]};
  auto st = rig.packer.pack(one, rig.buffer.view());
  ASSERT_FALSE(st.has_value());
  EXPECT_NE(st.error().message().find("got 1 tensor pointers but the pack plan has 2"), std::string::npos);
  std::vector<const float*> with_null = {t.ptrs[0], nullptr};
  st = rig.packer.pack(with_null, rig.buffer.view());
  ASSERT_FALSE(st.has_value());
  EXPECT_NE(st.error().message().find("tensor 1 (key"), std::string::npos) << st.error().message();
  auto other = HostSymBuffer::allocate(SymBufferLayout{3, 1, 128});
  ASSERT_TRUE(other.has_value());
  st = rig.packer.pack(t.const_ptrs(), other->view());
  ASSERT_FALSE(st.has_value());
  EXPECT_EQ(st.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(st.error().message().find("plan.layout()"), std::string::npos);
  // Empty tensors may have null pointers.
  TensorSet e = make_tensors({0, 5});
  Rig rig2 = make_rig(e, o);
  std::vector<const float*> null_empty = {nullptr, e.ptrs[1]};
  EXPECT_TRUE(rig2.packer.pack(null_empty, rig2.buffer.view()).has_value());
  EXPECT_FALSE(CpuPacker::create(nullptr).has_value());
}

// ---------------------------------------------------------------------------
// Compression.

// Decoded values of one step (pack, loopback, unpack).
TensorSet decode_one_step(Rig& rig, const TensorSet& src) {
  TensorSet out = make_tensors([&] {
    std::vector<std::uint64_t> s;
    for (const auto& d : src.descs) s.push_back(d.num_elements);
    return s;
  }());
  round_trip(rig, src, out);
  return out;
}

TEST(CpuPacker, CompressionErrorIsWithinTheStatedBounds) {
  TensorSet src = make_tensors(mixed_sizes(400, 9));
  fill_gradients(src, 9, 2.0f);
  for (Codec codec : {Codec::kBf16, Codec::kFp16, Codec::kInt8}) {
    PlanOptions o;
    o.num_workers = 4;
    o.num_channels = 3;
    o.partition_bytes = 1000;
    o.groups = {CompressionOptions{codec}};
    Rig rig = make_rig(src, o);
    const float prescale = rig.plan->groups()[0].prescale;
    EXPECT_EQ(prescale, codec == Codec::kInt8 ? 1.0f : 0.25f);
    TensorSet got = decode_one_step(rig, src);
    double worst = 0.0;
    for (const PlanRecord& r : rig.plan->records()) {
      const float* x = src.ptrs[r.tensor] + r.elem_offset;
      const float* y = got.ptrs[r.tensor] + r.elem_offset;
      float absmax = 0.0f;
      for (std::uint32_t i = 0; i < r.num_elements; ++i) absmax = std::max(absmax, std::fabs(x[i] * prescale));
      for (std::uint32_t i = 0; i < r.num_elements; ++i) {
        const float v = x[i] * prescale;
        const double err = std::fabs(static_cast<double>(y[i]) - v);
        double bound = 0.0;
        switch (codec) {
          case Codec::kBf16:  // half an ulp of an 8-bit significand; subnormals: half of 2^-133
            bound = std::max(std::ldexp(double{std::fabs(v)}, -8), 0x1p-134);
            break;
          case Codec::kFp16: bound = std::max(std::ldexp(double{std::fabs(v)}, -11), 0x1p-25); break;
          case Codec::kInt8: bound = (0.5 + 0x1p-15) * absmax / 127.0; break;         // half a step
          case Codec::kFp32: break;
        }
        ASSERT_LE(err, bound) << codec_name(codec) << " value " << v << " decoded " << y[i];
        worst = std::max(worst, err);
      }
    }
    EXPECT_GT(worst, 0.0) << codec_name(codec) << " compresses, so some error must show";
  }
}

TEST(CpuPacker, Fp16WithLargeValuesDoesNotOverflowTheSum) {
  // 8 workers push gradients up to 60000; the server adds 8 fp16 values.
  constexpr int kWorkers = 8;
  TensorSet src = make_tensors({64});
  for (std::size_t i = 0; i < 64; ++i) src.tensor(0)[i] = (i % 2 ? -1.0f : 1.0f) * (60000.0f - 100.0f * i);
  src.tensor(0)[63] = 1e6f;  // beyond fp16's range even after prescaling: saturates
  auto fp16_sum = [&](float prescale_override) {
    PlanOptions o;
    o.num_workers = kWorkers;
    o.groups = {CompressionOptions{Codec::kFp16, false, false, prescale_override}};
    Rig rig = make_rig(src, o);
    TensorSet one = decode_one_step(rig, src);
    std::vector<float> sums(64);
    for (std::size_t i = 0; i < 64; ++i) {
      _Float16 acc = 0;
      for (int w = 0; w < kWorkers; ++w) acc = static_cast<_Float16>(acc + static_cast<_Float16>(one.tensor(0)[i]));
      sums[i] = static_cast<float>(acc);
    }
    return std::make_pair(sums, std::vector<float>(one.tensor(0).begin(), one.tensor(0).end()));
  };
  auto [sums, decoded] = fp16_sum(0.0f);  // default prescale 1/8
  for (std::size_t i = 0; i < 63; ++i) {
    ASSERT_TRUE(std::isfinite(sums[i])) << i;
    EXPECT_NEAR(sums[i], src.tensor(0)[i], std::fabs(src.tensor(0)[i]) * 0x1p-8) << i;
  }
  EXPECT_EQ(decoded[63], 65504.0f);  // saturated, not inf
  // Without the prescale the same sum overflows: the option is what saves it.
  auto [raw_sums, raw_decoded] = fp16_sum(1.0f);
  EXPECT_TRUE(std::isinf(raw_sums[0]));
  EXPECT_EQ(raw_decoded[63], 65504.0f);
}

// Accumulated transmitted values vs accumulated true values over 1000 steps
// of a slowly varying gradient: with error feedback the gap is the current
// residual, bounded by one quantisation step; without it, it grows.
double accumulated_gap(Codec codec, bool error_feedback, double* max_residual, double* step_bound) {
  constexpr std::size_t kElements = 1000;
  constexpr int kSteps = 1000;
  TensorSet src = make_tensors({kElements});
  std::mt19937_64 rng(12);
  std::uniform_real_distribution<float> base(-1.0f, 1.0f);
  std::normal_distribution<float> noise(0.0f, 0.01f);
  std::vector<float> bias(kElements);
  for (float& b : bias) b = base(rng);
  PlanOptions o;
  o.partition_bytes = 1024;  // 256-element chunks, one int8 scale each
  o.groups = {CompressionOptions{codec, false, error_feedback, 0.0f}};
  Rig rig = make_rig(src, o);
  std::vector<double> sent(kElements, 0.0), truth(kElements, 0.0);
  *max_residual = 0.0;
  *step_bound = 0.0;
  for (int step = 0; step < kSteps; ++step) {
    for (std::size_t i = 0; i < kElements; ++i) src.tensor(0)[i] = bias[i] + noise(rng);
    TensorSet got = decode_one_step(rig, src);
    for (std::size_t i = 0; i < kElements; ++i) {
      truth[i] += src.tensor(0)[i];
      sent[i] += got.tensor(0)[i];
    }
    // One quantisation step of this step (int8: absmax/127 of the values
    // encoded, at most ~1.05 + residual; bf16: ulp of values below 2).
    const double q = codec == Codec::kInt8 ? 1.2 / 127.0 : 0x1p-7;
    *step_bound = q;
    for (float r : rig.packer.residuals()) *max_residual = std::max(*max_residual, std::fabs(double{r}));
  }
  double gap = 0.0;
  for (std::size_t i = 0; i < kElements; ++i) gap = std::max(gap, std::fabs(sent[i] - truth[i]));
  return gap;
}

TEST(CpuPacker, ErrorFeedbackKeepsTheAccumulatedErrorBoundedOverAThousandSteps) {
  for (Codec codec : {Codec::kInt8, Codec::kBf16}) {
    double max_residual = 0.0;
    double q = 0.0;
    const double with_ef = accumulated_gap(codec, true, &max_residual, &q);
    // The gap is the last residual (plus float rounding of 1000 additions),
    // and the residual never exceeds one quantisation step.
    EXPECT_LE(max_residual, q) << codec_name(codec);
    EXPECT_LE(with_ef, q + 1e-3) << codec_name(codec);
    double unused = 0.0;
    const double without_ef = accumulated_gap(codec, false, &unused, &q);
    EXPECT_GT(without_ef, 10 * with_ef) << codec_name(codec) << ": error feedback must matter";
  }
}

TEST(CpuPacker, DeltaEncodingKeepsSenderAndReceiverReferencesIdentical) {
  TensorSet src = make_tensors(mixed_sizes(120, 13), 2);
  TensorSet dst = make_tensors(mixed_sizes(120, 13), 2);
  PlanOptions o;
  o.num_channels = 2;
  o.partition_bytes = 2000;
  o.groups = {CompressionOptions{Codec::kFp16, true, true, 0.0f},
              CompressionOptions{Codec::kInt8, true, false, 0.0f}};
  Rig rig = make_rig(src, o);
  for (int step = 0; step < 10; ++step) {
    fill_gradients(src, 200 + step);
    round_trip(rig, src, dst);
    std::string where;
    ASSERT_TRUE(same_bits(rig.packer.send_refs(), rig.packer.recv_refs(), &where)) << where;
    for (std::uint32_t i = 0; i < src.descs.size(); ++i) {
      if (src.descs[i].group != 0 || src.descs[i].num_elements == 0) continue;
      const auto ref = rig.packer.recv_refs().subspan(rig.plan->ref_offset(i), src.descs[i].num_elements);
      ASSERT_TRUE(same_bits(ref, dst.tensor(i), &where)) << "tensor " << i << " " << where;
    }
  }
}

}  // namespace
}  // namespace ember::gpu
