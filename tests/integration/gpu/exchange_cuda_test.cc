// DeviceExchange on the CUDA backend against a real server in this process:
// device tensors pushed and pulled give the plain Worker's values bit for
// bit (fp32), and the same bits as the CPU backend for every compressed
// group (the kernels and the CPU reference agree bit for bit); host pointers
// are rejected before a kernel sees them. Label gpu: skips without a CUDA
// device, fails instead when EMBER_REQUIRE_GPU=1 (scripts/gpu-check.sh).
#include <cuda_runtime_api.h>

#include <cstdlib>

#include "tests/integration/gpu/exchange_support.h"
#include "worker/gpu/gpu_packer.h"

namespace ember::gpu::test {
namespace {

constexpr std::uint64_t kPlainKeys = 1'000'000;

#define REQUIRE_CUDA_DEVICE()                                                        \
  do {                                                                               \
    auto info_ = query_device(0);                                                    \
    if (!info_) {                                                                    \
      const char* require_ = std::getenv("EMBER_REQUIRE_GPU");                       \
      if (require_ != nullptr && std::string(require_) == "1") {                     \
        FAIL() << "EMBER_REQUIRE_GPU=1 but " << info_.error().to_string();          \
      }                                                                              \
      GTEST_SKIP() << "no CUDA device: " << info_.error().to_string();              \
    }                                                                                \
  } while (0)

// A model's tensors in one device allocation; odd tensors start one float
// past a 16-byte boundary (unaligned, as a framework's views may be).
class DeviceModel {
 public:
  explicit DeviceModel(const HostModel& shape) {
    std::uint64_t n = 0;
    for (std::size_t i = 0; i < shape.descs.size(); ++i) {
      n += i % 2;
      offsets_.push_back(n);
      n += shape.descs[i].num_elements + 3;
      n -= n % 4;
      n += 4;
    }
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&base_), std::max<std::uint64_t>(n, 1) * sizeof(float)), cudaSuccess);
    for (std::size_t i = 0; i < shape.descs.size(); ++i) {
      const TensorDesc& d = shape.descs[i];
      const_views_.push_back({d.key, base_ + offsets_[i], d.num_elements});
      views_.push_back({d.key, base_ + offsets_[i], d.num_elements});
    }
  }
  ~DeviceModel() { (void)cudaFree(base_); }
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  void upload(const HostModel& m) {
    for (std::size_t i = 0; i < m.values.size(); ++i) {
      ASSERT_EQ(cudaMemcpy(base_ + offsets_[i], m.values[i].data(), m.values[i].size() * 4,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  void download(HostModel& m) const {
    for (std::size_t i = 0; i < m.values.size(); ++i) {
      ASSERT_EQ(cudaMemcpy(m.values[i].data(), base_ + offsets_[i], m.values[i].size() * 4,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
  }
  std::span<const ConstTensorView> const_views() const { return const_views_; }
  std::span<const TensorView> views() const { return views_; }

 private:
  float* base_ = nullptr;
  std::vector<std::uint64_t> offsets_;
  std::vector<ConstTensorView> const_views_;
  std::vector<TensorView> views_;
};

DeviceExchangeOptions cuda_options(std::vector<CompressionOptions> groups = {CompressionOptions{}}) {
  DeviceExchangeOptions o;
  o.backend = ExchangeBackend::kCuda;
  o.groups = std::move(groups);
  return o;
}

std::vector<std::uint64_t> test_sizes(std::size_t num_small, std::uint64_t seed) {
  std::vector<std::uint64_t> sizes = {0, 1, 7, 1023, 1024, 5001, 3, 4099, 0, 65537};
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::uint64_t> small(0, 40);
  for (std::size_t i = 0; i < num_small; ++i) sizes.push_back(small(rng));
  return sizes;
}

TEST(DeviceExchangeCuda, Fp32DeviceTensorsMatchThePlainWorkerBitForBit) {
  REQUIRE_CUDA_DEVICE();
  LocalServer s(exchange_config(4));
  auto w = s.worker();
  ASSERT_TRUE(w);
  HostModel init = make_model(test_sizes(2000, 11), 10);
  std::mt19937_64 rng(12);
  fill_random(init, rng, 0.5f, 4.0f);
  auto ex = DeviceExchange::create(*w, init.descs, cuda_options());
  ASSERT_TRUE(ex) << ex.error().to_string();
  ASSERT_EQ((*ex)->backend(), ExchangeBackend::kCuda);
  DeviceModel grads_d(init), params_d(init);
  params_d.upload(init);
  PlainReference plain{*w, kPlainKeys};
  auto ih = (*ex)->init_device(params_d.const_views());
  ASSERT_TRUE(plain.init(init));
  ASSERT_TRUE(ih.wait());
  HostModel grads = init, ex_params = init, plain_params = init;
  for (int step = 0; step < 3; ++step) {
    fill_random(grads, rng, 1e-3f, 2.0f);
    grads_d.upload(grads);
    auto pushed = (*ex)->push_device(grads_d.const_views()).wait();
    ASSERT_TRUE(pushed) << pushed.error().to_string();
    ASSERT_TRUE(plain.push(grads));
    auto pulled = (*ex)->pull_device(params_d.views()).wait();
    ASSERT_TRUE(pulled) << pulled.error().to_string();
    ASSERT_TRUE(plain.pull(plain_params));
    params_d.download(ex_params);
    ASSERT_TRUE(bits_equal(ex_params, plain_params)) << "step " << step;
  }
}

TEST(DeviceExchangeCuda, CompressedGroupsGiveTheCpuBackendsBits) {
  REQUIRE_CUDA_DEVICE();
  LocalServer s(exchange_config(4));
  auto w = s.worker();
  ASSERT_TRUE(w);
  std::vector<CompressionOptions> groups = {{Codec::kBf16},
                                            {Codec::kFp16, false, false, 1.0f / 3.0f},
                                            {Codec::kInt8, false, true},
                                            {Codec::kBf16, true, false},
                                            {Codec::kInt8, true, true}};
  const std::vector<std::uint32_t> group_of = {0, 1, 2, 3, 4};
  HostModel init = make_model(test_sizes(500, 21), 10, group_of);
  HostModel init_cpu = make_model(test_sizes(500, 21), 10 + kPlainKeys, group_of);
  std::mt19937_64 rng(22);
  fill_random(init, rng, 0.5f, 4.0f);
  init_cpu.values = init.values;
  auto gpu_ex = DeviceExchange::create(*w, init.descs, cuda_options(groups));
  ASSERT_TRUE(gpu_ex) << gpu_ex.error().to_string();
  DeviceExchangeOptions cpu = cuda_options(groups);
  cpu.backend = ExchangeBackend::kCpu;
  auto cpu_ex = DeviceExchange::create(*w, init_cpu.descs, cpu);
  ASSERT_TRUE(cpu_ex) << cpu_ex.error().to_string();

  DeviceModel grads_d(init), params_d(init);
  params_d.upload(init);
  auto gi = (*gpu_ex)->init_device(params_d.const_views());
  ASSERT_TRUE((*cpu_ex)->init_device(init_cpu.const_views()).wait());
  ASSERT_TRUE(gi.wait());
  HostModel grads = init_cpu, gpu_params = init, cpu_params = init_cpu;
  for (int step = 0; step < 4; ++step) {
    fill_random(grads, rng, 1e-3f, 2.0f);
    grads_d.upload(grads);
    ASSERT_TRUE((*gpu_ex)->push_device(grads_d.const_views()).wait());
    ASSERT_TRUE((*cpu_ex)->push_device(grads.const_views()).wait());
    ASSERT_TRUE((*gpu_ex)->pull_device(params_d.views()).wait());
    auto cpu_views = cpu_params.views();
    ASSERT_TRUE((*cpu_ex)->pull_device(cpu_views).wait());
    params_d.download(gpu_params);
    HostModel relabelled = cpu_params;
    relabelled.descs = gpu_params.descs;
    ASSERT_TRUE(bits_equal(gpu_params, relabelled)) << "step " << step;
  }
}

TEST(DeviceExchangeCuda, HostPointersAreRejectedBeforeAKernelSeesThem) {
  REQUIRE_CUDA_DEVICE();
  LocalServer s(exchange_config(2));
  auto w = s.worker();
  ASSERT_TRUE(w);
  HostModel m = make_model({4, 3000}, 5);
  auto ex = DeviceExchange::create(*w, m.descs, cuda_options());
  ASSERT_TRUE(ex) << ex.error().to_string();
  DeviceModel d(m);
  d.upload(m);
  ASSERT_TRUE((*ex)->init_device(d.const_views()).wait());
  auto r = (*ex)->push_device(m.const_views()).wait();  // host memory
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument) << r.error().to_string();
  EXPECT_NE(r.error().message().find("cannot address"), std::string::npos) << r.error().to_string();
  // The device path still works afterwards.
  auto ok = (*ex)->push_device(d.const_views()).wait();
  ASSERT_TRUE(ok) << ok.error().to_string();
  EXPECT_EQ(*ok, 0u);
}

}  // namespace
}  // namespace ember::gpu::test
