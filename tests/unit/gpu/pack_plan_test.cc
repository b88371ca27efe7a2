// Pack plans: the channel map is the CPU worker's, records tile every tensor
// exactly, positions and state slices are aligned and disjoint, and every bad
// option is a clear error.
#include "worker/gpu/pack_plan.h"

#include <map>
#include <set>

#include <gtest/gtest.h>

#include "common/placement/placement.h"
#include "tests/unit/gpu/gpu_test_support.h"

namespace ember::gpu {
namespace {

using testing::make_tensors;
using testing::mixed_sizes;

PlanOptions options(std::uint32_t channels, std::uint32_t servers) {
  PlanOptions o;
  o.num_channels = channels;
  o.num_servers = servers;
  o.partition_bytes = 4096;  // small, so tensors are cut into several chunks
  return o;
}

TEST(PackPlan, ChannelMapMatchesTheCpuWorkersPlacement) {
  const auto tensors = make_tensors(mixed_sizes(500, 1));
  const PlanOptions o = options(5, 3);
  auto plan = PackPlan::build(tensors.descs, o);
  ASSERT_TRUE(plan.has_value()) << plan.error().to_string();
  std::map<std::pair<std::uint64_t, std::uint32_t>, const PlanRecord*> by_chunk;
  for (const PlanRecord& r : plan->records()) by_chunk[{r.key, r.chunk_index}] = &r;
  std::size_t chunks = 0;
  for (const TensorDesc& t : tensors.descs) {
    // What the CPU worker computes for the same tensor.
    for (const placement::Chunk& c :
         placement::chunk_plan(t.key, t.num_elements * 4, 4, o.partition_bytes, 3, 5)) {
      ++chunks;
      auto it = by_chunk.find({t.key, c.index});
      ASSERT_NE(it, by_chunk.end()) << "key " << t.key << " chunk " << c.index;
      const PlanRecord& r = *it->second;
      EXPECT_EQ(r.ring, plan->layout().ring_index(c.channel, c.server));
      EXPECT_EQ(r.elem_offset * 4, c.offset_bytes);
      EXPECT_EQ(std::uint64_t{r.num_elements} * 4, c.length_bytes);
    }
  }
  EXPECT_EQ(chunks, plan->records().size());
}

TEST(PackPlan, RecordsArePackedBackToBackPerRingAndTilesCoverThem) {
  auto tensors = make_tensors(mixed_sizes(800, 2), 2);
  PlanOptions o = options(3, 2);
  o.partition_bytes = 40000;
  o.groups = {CompressionOptions{}, CompressionOptions{Codec::kInt8, true, true, 0.0f}};
  auto plan = PackPlan::build(tensors.descs, o);
  ASSERT_TRUE(plan.has_value()) << plan.error().to_string();
  const auto& L = plan->layout();
  std::uint64_t total = 0;
  for (std::uint64_t ring = 0; ring < L.num_rings(); ++ring) {
    std::uint64_t pos = 0;
    for (std::uint32_t i = plan->ring_record_begin()[ring]; i < plan->ring_record_begin()[ring + 1]; ++i) {
      const PlanRecord& r = plan->records()[i];
      EXPECT_EQ(r.ring, ring);
      EXPECT_EQ(r.rel_pos, pos);
      EXPECT_EQ(r.rel_pos % 16, 0u);
      pos += record_bytes(r.num_elements, plan->groups()[r.group].codec);
    }
    EXPECT_EQ(plan->ring_step_bytes()[ring], pos);
    EXPECT_LE(pos, L.ring_bytes);
    total += pos;
  }
  EXPECT_EQ(total, plan->step_bytes());
  EXPECT_EQ(L.ring_bytes, std::max<std::uint64_t>(128, round_up(plan->max_ring_step_bytes(), 128)));

  // Tiles: in record order, covering each record exactly once.
  std::vector<std::uint64_t> covered(plan->records().size(), 0);
  std::size_t int8 = 0;
  for (std::uint32_t ti = 0; ti < plan->tiles().size(); ++ti) {
    const PlanTile& t = plan->tiles()[ti];
    const PlanRecord& r = plan->records()[t.record];
    EXPECT_EQ(t.elem_begin, covered[t.record]);
    EXPECT_LE(t.num_elements, kTileElements);
    EXPECT_EQ((t.flags & kTileFirst) != 0, t.elem_begin == 0);
    EXPECT_EQ((t.flags & kTileLast) != 0, t.elem_begin + t.num_elements == r.num_elements);
    if (t.elem_begin == 0) {
      EXPECT_EQ(r.first_tile, ti);
    }
    covered[t.record] += t.num_elements;
    if (plan->groups()[r.group].codec == Codec::kInt8) ++int8;
  }
  for (std::size_t i = 0; i < covered.size(); ++i) EXPECT_EQ(covered[i], plan->records()[i].num_elements);
  EXPECT_EQ(int8, plan->int8_tiles().size());
}

TEST(PackPlan, StateSlicesAreAlignedAndDisjoint) {
  auto tensors = make_tensors(mixed_sizes(300, 3), 3);
  PlanOptions o = options(2, 2);
  o.groups = {CompressionOptions{}, CompressionOptions{Codec::kBf16, false, true, 0.0f},
              CompressionOptions{Codec::kFp16, true, false, 0.0f}};
  auto plan = PackPlan::build(tensors.descs, o);
  ASSERT_TRUE(plan.has_value());
  std::uint64_t next_res = 0;
  std::uint64_t next_ref = 0;
  for (std::uint32_t i = 0; i < tensors.descs.size(); ++i) {
    const std::uint32_t g = tensors.descs[i].group;
    if (g == 1) {
      EXPECT_EQ(plan->residual_offset(i), next_res);
      EXPECT_EQ(plan->residual_offset(i) % 4, 0u);
      next_res += round_up(tensors.descs[i].num_elements, 4);
    } else {
      EXPECT_EQ(plan->residual_offset(i), kNoState);
    }
    if (g == 2) {
      EXPECT_EQ(plan->ref_offset(i) % 4, 0u);
      EXPECT_EQ(plan->ref_offset(i), next_ref);
      next_ref += round_up(tensors.descs[i].num_elements, 4);
    } else {
      EXPECT_EQ(plan->ref_offset(i), kNoState);
    }
    for (std::uint32_t ri : plan->tensor_records(i)) {
      const PlanRecord& r = plan->records()[ri];
      EXPECT_EQ(r.tensor, i);
      if (g == 1) {
        EXPECT_EQ(r.residual_offset, plan->residual_offset(i) + r.elem_offset);
      }
      if (g == 2) {
        EXPECT_EQ(r.ref_offset, plan->ref_offset(i) + r.elem_offset);
      }
    }
  }
  EXPECT_EQ(plan->residual_arena_elements(), next_res);
  EXPECT_EQ(plan->ref_arena_elements(), next_ref);
}

TEST(PackPlan, DefaultPrescaleIsOneOverWorkersForHalfPrecision) {
  PlanOptions o;
  o.num_workers = 8;
  o.groups = {CompressionOptions{Codec::kFp16}, CompressionOptions{Codec::kBf16},
              CompressionOptions{Codec::kInt8}, CompressionOptions{Codec::kFp32},
              CompressionOptions{Codec::kFp16, false, false, 0.5f}};
  auto plan = PackPlan::build({}, o);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->groups()[0].prescale, 0.125f);
  EXPECT_EQ(plan->groups()[1].prescale, 0.125f);
  EXPECT_EQ(plan->groups()[2].prescale, 1.0f);
  EXPECT_EQ(plan->groups()[3].prescale, 1.0f);
  EXPECT_EQ(plan->groups()[4].prescale, 0.5f);
  EXPECT_EQ(plan->records().size(), 0u);
  EXPECT_EQ(plan->layout().ring_bytes, 128u);
}

TEST(PackPlan, ExplicitRingBytesMustHoldAStep) {
  auto tensors = make_tensors({1000, 1000, 1000});
  PlanOptions o = options(1, 1);
  o.ring_bytes = 4096;
  auto plan = PackPlan::build(tensors.descs, o);
  ASSERT_FALSE(plan.has_value());
  EXPECT_EQ(plan.error().code(), ErrorCode::kTooLarge);
  EXPECT_NE(plan.error().message().find("channel 0 rank 0"), std::string::npos) << plan.error().message();
  EXPECT_NE(plan.error().message().find("ring_bytes"), std::string::npos);
  o.ring_bytes = 1000;
  plan = PackPlan::build(tensors.descs, o);
  ASSERT_FALSE(plan.has_value());
  EXPECT_EQ(plan.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(plan.error().message().find("multiple of 128"), std::string::npos);
  o.ring_bytes = 1 << 16;
  plan = PackPlan::build(tensors.descs, o);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->layout().ring_bytes, 1u << 16);
}

TEST(PackPlan, BadOptionsAreClearErrors) {
  auto tensors = make_tensors({10, 20});
  auto expect_error = [&](const std::vector<TensorDesc>& descs, const PlanOptions& o,
                          const std::string& needle) {
    auto plan = PackPlan::build(descs, o);
    ASSERT_FALSE(plan.has_value()) << needle;
    EXPECT_NE(plan.error().message().find(needle), std::string::npos) << plan.error().message();
  };
  PlanOptions o;
  o.num_channels = 0;
  expect_error(tensors.descs, o, "num_channels (0)");
  o = PlanOptions{};
  o.num_servers = 0;
  expect_error(tensors.descs, o, "num_servers (0)");
  o = PlanOptions{};
  o.partition_bytes = 0;
  expect_error(tensors.descs, o, "partition_bytes 0");
  o = PlanOptions{};
  o.groups.clear();
  expect_error(tensors.descs, o, "no key groups");
  o = PlanOptions{};
  o.groups[0].prescale = -1.0f;
  expect_error(tensors.descs, o, "prescale -1");
  o = PlanOptions{};
  o.groups[0].codec = static_cast<Codec>(9);
  expect_error(tensors.descs, o, "unknown codec 9");
  auto descs = tensors.descs;
  descs[1].group = 4;
  expect_error(descs, PlanOptions{}, "names key group 4");
  descs = tensors.descs;
  descs[1].key = descs[0].key;
  expect_error(descs, PlanOptions{}, "used by tensors 0 and 1");
}

}  // namespace
}  // namespace ember::gpu
