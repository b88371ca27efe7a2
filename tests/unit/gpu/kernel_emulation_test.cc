// The kernels' work split (tile_ops.h, run lane by lane on the host in a
// shuffled tile order) produces the same bytes, state and outputs as the
// independent CPU reference, for every codec × delta × error-feedback
// combination, unaligned tensors, and records that wrap around a ring's end.
#include <algorithm>
#include <vector>

#include <gtest/gtest.h>

#include "tests/unit/gpu/gpu_test_support.h"

namespace ember::gpu {
namespace {

using testing::build_plan;
using testing::emulate_pack;
using testing::emulate_unpack;
using testing::EmulatedState;
using testing::fill_gradients;
using testing::make_tensors;
using testing::mixed_sizes;
using testing::same_bits;
using testing::same_bytes;
using testing::TensorSet;

std::vector<CompressionOptions> all_groups() {
  std::vector<CompressionOptions> groups;
  for (Codec codec : {Codec::kFp32, Codec::kBf16, Codec::kFp16, Codec::kInt8}) {
    for (bool delta : {false, true}) {
      for (bool ef : {false, true}) groups.push_back(CompressionOptions{codec, delta, ef, 0.0f});
    }
  }
  return groups;
}

TEST(KernelEmulation, MatchesTheCpuReferenceBitForBit) {
  const std::vector<std::uint64_t> sizes = mixed_sizes(160, 21);
  TensorSet src = make_tensors(sizes, 16);
  PlanOptions o;
  o.num_channels = 3;
  o.num_servers = 2;
  o.num_workers = 3;
  o.partition_bytes = 12000;  // chunks of 3000 elements: two tiles, the second partial
  o.groups = all_groups();
  auto probe = build_plan(src, o);
  ASSERT_NE(probe, nullptr);
  o.ring_bytes = round_up(probe->max_ring_step_bytes() * 3 / 2, 128);  // records wrap
  auto plan = build_plan(src, o);
  ASSERT_NE(plan, nullptr);

  auto ref_buf = HostSymBuffer::allocate(plan->layout());
  auto emu_buf = HostSymBuffer::allocate(plan->layout());
  ASSERT_TRUE(ref_buf && emu_buf);
  auto reference = CpuPacker::create(plan);
  ASSERT_TRUE(reference.has_value());
  EmulatedState emulated(*plan);
  TensorSet ref_out = make_tensors(sizes, 16);
  TensorSet emu_out = make_tensors(sizes, 16);

  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    fill_gradients(src, 300 + step, step % 2 ? 0.01f : 3.0f);
    const auto sources = src.const_ptrs();
    auto a = reference->pack(sources, ref_buf->view());
    ASSERT_TRUE(a.has_value()) << a.error().to_string();
    auto b = emulate_pack(*plan, sources, emu_buf->view(), emulated, step);
    ASSERT_TRUE(b.has_value()) << b.error().to_string();
    std::string where;
    const std::span<const std::byte> ref_bytes(ref_buf->base(), plan->layout().total_bytes());
    const std::span<const std::byte> emu_bytes(emu_buf->base(), plan->layout().total_bytes());
    ASSERT_TRUE(same_bytes(ref_bytes, emu_bytes, &where)) << "send rings: " << where;
    ASSERT_TRUE(same_bits(reference->residuals(), emulated.residuals, &where)) << "residuals: " << where;
    ASSERT_TRUE(same_bits(reference->send_refs(), emulated.send_refs, &where)) << "send refs: " << where;

    ASSERT_TRUE(loopback(ref_buf->view()).has_value());
    ASSERT_TRUE(loopback(emu_buf->view()).has_value());
    a = reference->unpack(ref_out.ptrs, ref_buf->view());
    ASSERT_TRUE(a.has_value()) << a.error().to_string();
    b = emulate_unpack(*plan, emu_out.ptrs, emu_buf->view(), emulated, step + 100);
    ASSERT_TRUE(b.has_value()) << b.error().to_string();
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ASSERT_TRUE(same_bits(ref_out.tensor(i), emu_out.tensor(i), &where)) << "tensor " << i << " " << where;
    }
    ASSERT_TRUE(same_bits(reference->recv_refs(), emulated.recv_refs, &where)) << "recv refs: " << where;
  }
}

TEST(KernelEmulation, ChecksFailBeforeAnythingIsWritten) {
  TensorSet src = make_tensors(mixed_sizes(40, 22), 1);
  PlanOptions o;
  o.num_channels = 2;
  auto plan = build_plan(src, o);
  ASSERT_NE(plan, nullptr);
  auto buf = HostSymBuffer::allocate(plan->layout());
  ASSERT_TRUE(buf.has_value());
  EmulatedState st(*plan);
  const auto sources = src.const_ptrs();
  ASSERT_TRUE(emulate_pack(*plan, sources, buf->view(), st, 1).has_value());
  // Buffer and state after the step that fitted: the failing one must leave
  // both as they are.
  const SymBufferView view = buf->view();
  const std::vector<std::byte> before(view.base, view.base + view.layout.total_bytes());
  const std::vector<float> residuals = st.residuals;
  const std::vector<float> send_refs = st.send_refs;
  auto again = emulate_pack(*plan, sources, buf->view(), st, 2);
  ASSERT_FALSE(again.has_value());
  EXPECT_EQ(again.error().code(), ErrorCode::kTimeout);
  EXPECT_TRUE(std::equal(before.begin(), before.end(), view.base)) << "the failed step wrote";
  EXPECT_EQ(st.residuals, residuals);
  EXPECT_EQ(st.send_refs, send_refs);
  // The first ring that cannot take a second step.
  std::uint64_t first = 0;
  while (2 * plan->ring_step_bytes()[first] <= plan->layout().ring_bytes) ++first;
  EXPECT_NE(again.error().message().find("send ring of " + plan->describe_ring(first) + " is full"),
            std::string::npos)
      << again.error().message();
}

}  // namespace
}  // namespace ember::gpu
