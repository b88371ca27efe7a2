// CUDA kernels (label gpu): every result is compared with the CPU reference
// (CpuPacker) on the same inputs, bit for bit. Skipped with a reason when no
// CUDA device is usable; EMBER_REQUIRE_GPU=1 (scripts/gpu-check.sh) turns
// the skip into a failure.
#include "worker/gpu/gpu_packer.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
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
using testing::same_bytes;
using testing::TensorSet;

#define EMBER_REQUIRE_DEVICE()                                                         \
  do {                                                                                 \
    auto info_ = query_device(0);                                                      \
    if (!info_) {                                                                      \
      const char* require_ = std::getenv("EMBER_REQUIRE_GPU");                          \
      if (require_ != nullptr && std::string(require_) == "1") {                       \
        FAIL() << "EMBER_REQUIRE_GPU=1 but " << info_.error().to_string();             \
      }                                                                                \
      GTEST_SKIP() << "no CUDA device: " << info_.error().to_string();                 \
    }                                                                                  \
  } while (0)

#define ASSERT_OK(expr)                                        \
  do {                                                         \
    auto ember_st_ = (expr);                                   \
    ASSERT_TRUE(ember_st_.has_value()) << ember_st_.error().to_string(); \
  } while (0)

// Device copies of a TensorSet, with the same misalignment (tensor i starts
// i % 4 floats into its allocation).
struct DeviceTensors {
  std::vector<float*> allocations;
  std::vector<float*> ptrs;
  std::vector<std::uint64_t> sizes;

  explicit DeviceTensors(const TensorSet& t) {
    for (std::size_t i = 0; i < t.descs.size(); ++i) {
      void* p = nullptr;
      EMBER_CHECK(cudaMalloc(&p, (t.descs[i].num_elements + 4) * sizeof(float)) == cudaSuccess);
      allocations.push_back(static_cast<float*>(p));
      ptrs.push_back(static_cast<float*>(p) + i % 4);
      sizes.push_back(t.descs[i].num_elements);
    }
  }
  ~DeviceTensors() {
    for (float* p : allocations) (void)cudaFree(p);
  }
  void upload(const TensorSet& t) {
    for (std::size_t i = 0; i < ptrs.size(); ++i) {
      if (sizes[i] != 0) {
        EMBER_CHECK(cudaMemcpy(ptrs[i], t.ptrs[i], sizes[i] * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      }
    }
  }
  void download(TensorSet& t) const {
    for (std::size_t i = 0; i < ptrs.size(); ++i) {
      if (sizes[i] != 0) {
        EMBER_CHECK(cudaMemcpy(t.ptrs[i], ptrs[i], sizes[i] * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      }
    }
  }
  std::vector<const float*> const_ptrs() const { return {ptrs.begin(), ptrs.end()}; }
};

std::vector<CompressionOptions> all_groups() {
  std::vector<CompressionOptions> groups;
  for (Codec codec : {Codec::kFp32, Codec::kBf16, Codec::kFp16, Codec::kInt8}) {
    for (bool delta : {false, true}) {
      for (bool ef : {false, true}) groups.push_back(CompressionOptions{codec, delta, ef, 0.0f});
    }
  }
  return groups;
}

std::vector<std::byte> buffer_bytes(const GpuSymBuffer& b) {
  std::vector<std::byte> bytes(b.layout().total_bytes());
  EMBER_CHECK(b.copy_to_host(bytes).has_value());
  return bytes;
}

// GPU and CPU reference side by side over several steps: send rings, state,
// unpacked tensors and recv references must agree bit for bit.
void compare_with_reference(bool pinned_host_buffer) {
  const std::vector<std::uint64_t> sizes = mixed_sizes(400, 31);
  TensorSet src = make_tensors(sizes, 16);
  PlanOptions o;
  o.num_channels = 3;
  o.num_servers = 2;
  o.num_workers = 3;
  o.partition_bytes = 12000;
  o.groups = all_groups();
  auto probe = build_plan(src, o);
  ASSERT_NE(probe, nullptr);
  o.ring_bytes = round_up(probe->max_ring_step_bytes() * 3 / 2, 128);  // records wrap
  auto plan = build_plan(src, o);
  ASSERT_NE(plan, nullptr);

  auto cpu_buf = HostSymBuffer::allocate(plan->layout());
  ASSERT_TRUE(cpu_buf.has_value());
  auto cpu = CpuPacker::create(plan);
  ASSERT_TRUE(cpu.has_value());
  TensorSet cpu_out = make_tensors(sizes, 16);

  std::unique_ptr<std::byte, decltype(&std::free)> region(nullptr, &std::free);
  Result<GpuSymBuffer> gpu_buf = tl::unexpected(Error());
  if (pinned_host_buffer) {
    const std::uint64_t bytes = round_up(plan->layout().total_bytes(), 4096);
    region.reset(static_cast<std::byte*>(std::aligned_alloc(4096, bytes)));
    std::memset(region.get(), 0, bytes);
    gpu_buf = GpuSymBuffer::register_host(plan->layout(), std::span<std::byte>(region.get(), bytes));
  } else {
    gpu_buf = GpuSymBuffer::allocate(plan->layout());
  }
  ASSERT_TRUE(gpu_buf.has_value()) << gpu_buf.error().to_string();
  auto gpu = GpuPacker::create(plan);
  ASSERT_TRUE(gpu.has_value()) << gpu.error().to_string();
  DeviceTensors dev_src(src);
  DeviceTensors dev_out(src);
  ASSERT_OK(gpu->set_sources(dev_src.const_ptrs()));
  ASSERT_OK(gpu->set_destinations(dev_out.ptrs));
  TensorSet gpu_out = make_tensors(sizes, 16);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);

  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    fill_gradients(src, 400 + step, step % 2 ? 0.01f : 3.0f);
    if (step == 5) {
      // The last step carries NaNs (with payloads) and infinities: arithmetic
      // on them gives the canonical NaN on both sides (codec.h).
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        std::span<float> t = src.tensor(i);
        const float specials[] = {bits_float(0xffc00123u), bits_float(0x7fa00001u),
                                  std::numeric_limits<float>::infinity(),
                                  -std::numeric_limits<float>::infinity()};
        for (std::size_t j = 0; j < t.size(); j += 97) t[j] = specials[(i + j) % 4];
      }
    }
    dev_src.upload(src);
    ASSERT_OK(cpu->pack(src.const_ptrs(), cpu_buf->view()));
    ASSERT_OK(gpu->pack_async(*gpu_buf, stream));
    ASSERT_OK(gpu->finish(stream));
    std::string where;
    const std::vector<std::byte> gpu_bytes = buffer_bytes(*gpu_buf);
    ASSERT_TRUE(same_bytes({cpu_buf->base(), plan->layout().total_bytes()}, gpu_bytes, &where))
        << "send rings differ at " << where;
    std::vector<float> residuals, send_refs, recv_refs;
    ASSERT_OK(gpu->download_state(&residuals, &send_refs, nullptr));
    ASSERT_TRUE(same_bits(cpu->residuals(), residuals, &where)) << "residuals " << where;
    ASSERT_TRUE(same_bits(cpu->send_refs(), send_refs, &where)) << "send refs " << where;

    ASSERT_OK(loopback(cpu_buf->view()));
    ASSERT_OK(gpu_buf->loopback(stream));
    ASSERT_OK(cpu->unpack(cpu_out.ptrs, cpu_buf->view()));
    ASSERT_OK(gpu->unpack_async(*gpu_buf, stream));
    ASSERT_OK(gpu->finish(stream));
    dev_out.download(gpu_out);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ASSERT_TRUE(same_bits(cpu_out.tensor(i), gpu_out.tensor(i), &where)) << "tensor " << i << " " << where;
    }
    ASSERT_OK(gpu->download_state(nullptr, nullptr, &recv_refs));
    ASSERT_TRUE(same_bits(cpu->recv_refs(), recv_refs, &where)) << "recv refs " << where;
    ASSERT_TRUE(same_bytes({cpu_buf->base(), plan->layout().total_bytes()}, buffer_bytes(*gpu_buf), &where))
        << "after unpack, buffers differ at " << where;
  }
  (void)cudaStreamDestroy(stream);
}

TEST(GpuPacker, MatchesTheCpuReferenceInDeviceMemory) {
  EMBER_REQUIRE_DEVICE();
  compare_with_reference(false);
}

TEST(GpuPacker, MatchesTheCpuReferenceInPinnedHostMemory) {
  EMBER_REQUIRE_DEVICE();
  compare_with_reference(true);
}

void gpu_fp32_round_trip(std::size_t count, std::uint32_t channels) {
  const std::vector<std::uint64_t> sizes =
      count == 1 ? std::vector<std::uint64_t>{4099} : mixed_sizes(count, 40 + count);
  TensorSet src = make_tensors(sizes);
  fill_gradients(src, 41);
  PlanOptions o;
  o.num_channels = channels;
  o.num_servers = 3;
  o.partition_bytes = 4096;
  auto plan = build_plan(src, o);
  ASSERT_NE(plan, nullptr);
  auto buf = GpuSymBuffer::allocate(plan->layout());
  ASSERT_TRUE(buf.has_value()) << buf.error().to_string();
  auto gpu = GpuPacker::create(plan);
  ASSERT_TRUE(gpu.has_value()) << gpu.error().to_string();
  DeviceTensors in(src), out(src);
  in.upload(src);
  ASSERT_OK(gpu->set_sources(in.const_ptrs()));
  ASSERT_OK(gpu->set_destinations(out.ptrs));
  ASSERT_OK(gpu->pack_async(*buf, nullptr));
  ASSERT_OK(gpu->finish(nullptr));
  ASSERT_OK(buf->loopback(nullptr));
  ASSERT_OK(gpu->unpack_async(*buf, nullptr));
  ASSERT_OK(gpu->finish(nullptr));
  TensorSet back = make_tensors(sizes);
  out.download(back);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::string where;
    ASSERT_TRUE(same_bits(src.tensor(i), back.tensor(i), &where)) << "tensor " << i << " " << where;
  }
  auto mismatches = gpu->verify_placement();
  ASSERT_TRUE(mismatches.has_value());
  EXPECT_EQ(*mismatches, 0u) << "device-side placement differs from the plan";
}

TEST(GpuPacker, Fp32RoundTripIsBitExactForZeroTensors) {
  EMBER_REQUIRE_DEVICE();
  gpu_fp32_round_trip(0, 2);
}
TEST(GpuPacker, Fp32RoundTripIsBitExactForOneTensor) {
  EMBER_REQUIRE_DEVICE();
  gpu_fp32_round_trip(1, 2);
}
TEST(GpuPacker, Fp32RoundTripIsBitExactForTenThousandTensors) {
  EMBER_REQUIRE_DEVICE();
  gpu_fp32_round_trip(10'000, 8);
}

TEST(GpuPacker, FullRingFailsWithANamedTimeoutAndChangesNothing) {
  EMBER_REQUIRE_DEVICE();
  TensorSet src = make_tensors({48, 16});  // int8 records of 80 and 48 bytes: one ring, 128 per step
  fill_gradients(src, 50);
  PlanOptions o;
  o.groups = {CompressionOptions{Codec::kInt8, false, true, 0.0f}};
  auto plan = build_plan(src, o);
  ASSERT_NE(plan, nullptr);
  ASSERT_EQ(plan->layout().ring_bytes, plan->step_bytes());
  auto buf = GpuSymBuffer::allocate(plan->layout());
  ASSERT_TRUE(buf.has_value());
  GpuPackerOptions go;
  go.backpressure_timeout = 20ms;
  auto gpu = GpuPacker::create(plan, go);
  ASSERT_TRUE(gpu.has_value()) << gpu.error().to_string();
  DeviceTensors in(src), out(src);
  in.upload(src);
  ASSERT_OK(gpu->set_sources(in.const_ptrs()));
  ASSERT_OK(gpu->set_destinations(out.ptrs));
  ASSERT_OK(gpu->pack_async(*buf, nullptr));
  ASSERT_OK(gpu->finish(nullptr));  // exactly full

  const std::vector<std::byte> before = buffer_bytes(*buf);
  std::vector<float> residuals_before;
  ASSERT_OK(gpu->download_state(&residuals_before, nullptr, nullptr));
  ASSERT_OK(gpu->pack_async(*buf, nullptr));
  auto st = gpu->finish(nullptr);
  ASSERT_FALSE(st.has_value());
  EXPECT_EQ(st.error().code(), ErrorCode::kTimeout);
  EXPECT_NE(st.error().message().find("channel 0 rank 0"), std::string::npos) << st.error().message();
  EXPECT_NE(st.error().message().find("head=0 tail=128"), std::string::npos) << st.error().message();
  std::string where;
  EXPECT_TRUE(same_bytes(before, buffer_bytes(*buf), &where)) << "ring changed at " << where;
  std::vector<float> residuals_after;
  ASSERT_OK(gpu->download_state(&residuals_after, nullptr, nullptr));
  EXPECT_TRUE(same_bits(residuals_before, residuals_after, &where)) << "state changed at " << where;

  // Drain (echo + unpack); the packer works again after the failure.
  ASSERT_OK(buf->loopback(nullptr));
  ASSERT_OK(gpu->unpack_async(*buf, nullptr));
  ASSERT_OK(gpu->finish(nullptr));
  ASSERT_OK(gpu->pack_async(*buf, nullptr));
  ASSERT_OK(gpu->finish(nullptr));
}

TEST(GpuPacker, WaitsForAHostConsumerOfPinnedRings) {
  EMBER_REQUIRE_DEVICE();
  TensorSet src = make_tensors(mixed_sizes(200, 60));
  fill_gradients(src, 60);
  PlanOptions o;  // one ring of exactly one step: every pack waits for the host
  auto plan = build_plan(src, o);
  ASSERT_NE(plan, nullptr);
  const std::uint64_t bytes = round_up(plan->layout().total_bytes(), 4096);
  std::unique_ptr<std::byte, decltype(&std::free)> region(
      static_cast<std::byte*>(std::aligned_alloc(4096, bytes)), &std::free);
  auto buf = GpuSymBuffer::register_host(plan->layout(), std::span<std::byte>(region.get(), bytes));
  ASSERT_TRUE(buf.has_value()) << buf.error().to_string();
  GpuPackerOptions go;
  go.backpressure_timeout = 10s;
  auto gpu = GpuPacker::create(plan, go);
  ASSERT_TRUE(gpu.has_value());
  DeviceTensors in(src);
  in.upload(src);
  ASSERT_OK(gpu->set_sources(in.const_ptrs()));
  constexpr int kSteps = 20;
  std::atomic<std::uint64_t> consumed{0};
  std::atomic<bool> stop{false};
  std::thread consumer([&] {
    RingView ring(buf->host_view(), 0, Direction::kSend);
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (!stop && consumed < kSteps * plan->step_bytes() && std::chrono::steady_clock::now() < deadline) {
      const std::uint64_t n = ring.readable().size();
      if (n != 0) {
        ring.consume(n);
        consumed += n;
      } else {
        std::this_thread::yield();
      }
    }
  });
  // A failure below stops and joins the consumer before it is reported (a
  // joinable std::thread leaving scope would abort the whole binary).
  auto stop_consumer = [&] {
    stop = true;
    consumer.join();
  };
  cudaStream_t stream = nullptr;
  if (const cudaError_t e = cudaStreamCreate(&stream); e != cudaSuccess) {
    stop_consumer();
    FAIL() << "cudaStreamCreate: " << cudaGetErrorString(e);
  }
  for (int i = 0; i < kSteps; ++i) {
    auto queued = gpu->pack_async(*buf, stream);  // queued: each waits
    if (!queued) {
      (void)gpu->finish(stream);
      stop_consumer();
      (void)cudaStreamDestroy(stream);
      FAIL() << "pack_async " << i << ": " << queued.error().to_string();
    }
  }
  auto st = gpu->finish(stream);
  stop = !st.has_value();
  consumer.join();
  (void)cudaStreamDestroy(stream);
  ASSERT_TRUE(st.has_value()) << st.error().to_string();
  EXPECT_EQ(consumed.load(), kSteps * plan->step_bytes());
}

// A pack and an unpack on two streams (gpu_packer.h: they may run
// concurrently) are finished apart: finish() of the pack's stream neither
// waits behind the unpack, which waits for data this thread delivers only
// afterwards, nor touches the unpack's counters.
TEST(GpuPacker, APackAndAnUnpackOnTwoStreamsAreFinishedApart) {
  EMBER_REQUIRE_DEVICE();
  const std::vector<std::uint64_t> sizes = mixed_sizes(60, 78);
  TensorSet src = make_tensors(sizes);
  fill_gradients(src, 78);
  PlanOptions o;
  o.num_channels = 2;
  auto plan = build_plan(src, o);
  ASSERT_NE(plan, nullptr);
  const std::uint64_t bytes = round_up(plan->layout().total_bytes(), 4096);
  std::unique_ptr<std::byte, decltype(&std::free)> region(
      static_cast<std::byte*>(std::aligned_alloc(4096, bytes)), &std::free);
  std::memset(region.get(), 0, bytes);
  auto buf = GpuSymBuffer::register_host(plan->layout(), std::span<std::byte>(region.get(), bytes));
  ASSERT_TRUE(buf.has_value()) << buf.error().to_string();
  GpuPackerOptions go;
  go.backpressure_timeout = 20s;
  auto gpu = GpuPacker::create(plan, go);
  ASSERT_TRUE(gpu.has_value()) << gpu.error().to_string();
  DeviceTensors in(src);
  in.upload(src);
  DeviceTensors out(src);
  ASSERT_OK(gpu->set_sources(in.const_ptrs()));
  ASSERT_OK(gpu->set_destinations(out.ptrs));
  // Blocking streams (cudaStreamCreate), as an application makes them.
  cudaStream_t pack_stream = nullptr;
  cudaStream_t unpack_stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&pack_stream), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&unpack_stream), cudaSuccess);
  ASSERT_OK(gpu->unpack_async(*buf, unpack_stream));  // waits: the recv rings are empty
  ASSERT_OK(gpu->pack_async(*buf, pack_stream));
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_OK(gpu->finish(pack_stream));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "finish() waited for the other stream";
  ASSERT_OK(loopback(buf->host_view()));  // the packed step reaches the recv rings
  ASSERT_OK(gpu->finish(unpack_stream));
  TensorSet got = make_tensors(sizes);
  out.download(got);
  std::string where;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_TRUE(same_bits(src.tensor(i), got.tensor(i), &where)) << "tensor " << i << " " << where;
  }
  (void)cudaStreamDestroy(pack_stream);
  (void)cudaStreamDestroy(unpack_stream);
}

TEST(GpuPacker, UnpackRejectsARecordThatDoesNotMatchThePlan) {
  EMBER_REQUIRE_DEVICE();
  TensorSet src = make_tensors(mixed_sizes(60, 70));
  fill_gradients(src, 70);
  PlanOptions o;
  o.num_channels = 2;
  auto plan = build_plan(src, o);
  ASSERT_NE(plan, nullptr);
  auto buf = GpuSymBuffer::allocate(plan->layout());
  auto gpu = GpuPacker::create(plan);
  ASSERT_TRUE(buf && gpu);
  DeviceTensors in(src), out(src);
  in.upload(src);
  TensorSet sentinel = make_tensors(mixed_sizes(60, 70));
  for (std::size_t i = 0; i < sentinel.descs.size(); ++i) {
    for (float& v : sentinel.tensor(i)) v = 42.0f;
  }
  out.upload(sentinel);
  ASSERT_OK(gpu->set_sources(in.const_ptrs()));
  ASSERT_OK(gpu->set_destinations(out.ptrs));
  ASSERT_OK(gpu->pack_async(*buf, nullptr));
  ASSERT_OK(gpu->finish(nullptr));
  ASSERT_OK(buf->loopback(nullptr));
  std::vector<std::byte> bytes = buffer_bytes(*buf);
  const std::uint32_t victim = plan->ring_record_begin()[1] + 1;
  const PlanRecord& r = plan->records()[victim];
  bytes[plan->layout().data_offset(r.ring, Direction::kRecv) + r.rel_pos + 16] ^= std::byte{1};  // chunk index
  ASSERT_OK(buf->copy_from_host(bytes));
  ASSERT_OK(gpu->unpack_async(*buf, nullptr));
  auto st = gpu->finish(nullptr);
  ASSERT_FALSE(st.has_value());
  EXPECT_EQ(st.error().code(), ErrorCode::kProtocol);
  EXPECT_NE(st.error().message().find("record " + std::to_string(victim)), std::string::npos)
      << st.error().message();
  TensorSet after = make_tensors(mixed_sizes(60, 70));
  out.download(after);
  for (std::size_t i = 0; i < after.descs.size(); ++i) {
    for (float v : after.tensor(i)) ASSERT_EQ(v, 42.0f) << "tensor " << i << " was written";
  }
}

TEST(GpuSymBuffer, UsesAHostRegionItsCallerRegisteredBefore) {
  EMBER_REQUIRE_DEVICE();
  const SymBufferLayout layout{2, 2, 4096};
  const std::uint64_t bytes = round_up(layout.total_bytes(), 4096);
  std::unique_ptr<std::byte, decltype(&std::free)> region(
      static_cast<std::byte*>(std::aligned_alloc(4096, bytes)), &std::free);
  ASSERT_EQ(cudaHostRegister(region.get(), bytes, cudaHostRegisterMapped | cudaHostRegisterPortable), cudaSuccess);
  {
    auto buf = GpuSymBuffer::register_host(layout, std::span<std::byte>(region.get(), bytes));
    ASSERT_TRUE(buf.has_value()) << buf.error().to_string();
    RingView send(buf->host_view(), 3, Direction::kSend);
    send.commit(64);
    ASSERT_OK(buf->loopback(nullptr));  // the kernel sees the host's positions
    EXPECT_EQ(RingView(buf->host_view(), 3, Direction::kRecv).tail(), 64u);
    EXPECT_EQ(send.head(), 64u);
  }
  // Still registered by its owner: unregistering succeeds exactly once.
  EXPECT_EQ(cudaHostUnregister(region.get()), cudaSuccess);
}

TEST(GpuPacker, ChannelsAreCappedAtHalfTheSms) {
  EMBER_REQUIRE_DEVICE();
  auto info = query_device(0);
  ASSERT_TRUE(info.has_value());
  TensorSet src = make_tensors({100});
  PlanOptions o;
  o.num_channels = max_gpu_channels(info->sm_count) + 1;
  auto plan = build_plan(src, o);
  ASSERT_NE(plan, nullptr);
  auto gpu = GpuPacker::create(plan);
  ASSERT_FALSE(gpu.has_value());
  EXPECT_EQ(gpu.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(gpu.error().message().find("half the SMs"), std::string::npos) << gpu.error().message();
  EXPECT_LE(default_gpu_channels(info->sm_count), max_gpu_channels(info->sm_count));
}

TEST(GpuPacker, RejectsCallsOutOfOrder) {
  EMBER_REQUIRE_DEVICE();
  TensorSet src = make_tensors({10, 20});
  auto plan = build_plan(src, PlanOptions{});
  ASSERT_NE(plan, nullptr);
  auto gpu = GpuPacker::create(plan);
  auto buf = GpuSymBuffer::allocate(plan->layout());
  ASSERT_TRUE(gpu && buf);
  auto st = gpu->pack_async(*buf, nullptr);
  ASSERT_FALSE(st.has_value());
  EXPECT_NE(st.error().message().find("set_sources"), std::string::npos);
  std::vector<const float*> wrong = {nullptr};
  st = gpu->set_sources(wrong);
  ASSERT_FALSE(st.has_value());
  EXPECT_NE(st.error().message().find("got 1 tensor pointers"), std::string::npos);
  auto other = GpuSymBuffer::allocate(SymBufferLayout{2, 1, 128});
  ASSERT_TRUE(other.has_value());
  DeviceTensors in(src);
  ASSERT_OK(gpu->set_sources(in.const_ptrs()));
  st = gpu->pack_async(*other, nullptr);
  ASSERT_FALSE(st.has_value());
  EXPECT_NE(st.error().message().find("plan.layout()"), std::string::npos);
}

}  // namespace
}  // namespace ember::gpu
