// ember-bench-gpu: throughput of the SymBuffer pack/unpack path.
//
// Workloads: (a) ResNet-50's 161 gradient tensors, (b) 10,000 tensors of
// 4-64 KiB (bench/gpu/workloads.h). Everywhere: the CPU reference packer
// (fp32, bf16, int8) against memcpy of the same bytes, tensor by tensor into
// one buffer (what a worker without packing does). With a CUDA device: the
// pack and unpack kernels against one cudaMemcpyAsync device-to-device of the
// same bytes (the ceiling), the host time of one pack call, and a channel
// sweep showing the fewest channels (SMs) that reach 90% of the best pack
// bandwidth. Bandwidths count the fp32 gradient bytes once. Medians of
// interleaved repetitions; never fails on a timing. The last line is
// `SUMMARY key=value ...` (ratios; `gpu=absent` without a device).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench/gpu/workloads.h"
#include "worker/gpu/cpu_packer.h"
#include "worker/gpu/host_symbuffer.h"
#include "worker/gpu/pack_plan.h"

#if defined(EMBER_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "worker/gpu/gpu_packer.h"
#endif

namespace {

using Clock = std::chrono::steady_clock;
using ember::gpu::Codec;
using ember::gpu::CompressionOptions;
using ember::gpu::PackPlan;
using ember::gpu::PlanOptions;
using ember::gpu::TensorDesc;

constexpr std::uint64_t kPartitionBytes = 4096000;  // BytePS's default chunk
constexpr std::uint32_t kServers = 2;

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Workload {
  std::string name;
  std::vector<std::uint64_t> sizes;
  std::uint64_t elements = 0;
  std::uint64_t bytes() const { return elements * sizeof(float); }
};

Workload make_workload(std::string name, std::vector<std::uint64_t> sizes) {
  Workload w{std::move(name), std::move(sizes), 0};
  for (std::uint64_t s : w.sizes) w.elements += s;
  return w;
}

std::vector<TensorDesc> descs_of(const Workload& w) {
  std::vector<TensorDesc> d;
  d.reserve(w.sizes.size());
  for (std::size_t i = 0; i < w.sizes.size(); ++i) d.push_back({i, w.sizes[i], 0});
  return d;
}

std::shared_ptr<const PackPlan> make_plan(const Workload& w, Codec codec, std::uint32_t channels,
                                          std::uint32_t workers) {
  PlanOptions o;
  o.num_channels = channels;
  o.num_servers = kServers;
  o.num_workers = workers;
  o.partition_bytes = kPartitionBytes;
  o.groups = {CompressionOptions{codec}};
  auto plan = PackPlan::build(descs_of(w), o);
  if (!plan) {
    fmt::print(stderr, "pack plan: {}\n", plan.error().to_string());
    std::exit(1);
  }
  return std::make_shared<const PackPlan>(std::move(*plan));
}

// Offsets of each tensor in one allocation, 64-byte aligned (as framework
// allocators hand them out).
std::vector<std::uint64_t> tensor_offsets(const Workload& w, std::uint64_t* total_elements) {
  std::vector<std::uint64_t> off;
  std::uint64_t pos = 0;
  for (std::uint64_t s : w.sizes) {
    off.push_back(pos);
    pos += (s + 15) / 16 * 16;
  }
  *total_elements = pos;
  return off;
}

struct Summary {
  std::string line = "SUMMARY";
  void add(const std::string& key, double value) { line += fmt::format(" {}={:.3f}", key, value); }
  void add(const std::string& key, const std::string& value) { line += fmt::format(" {}={}", key, value); }
};

// ---------------------------------------------------------------------------
// CPU reference vs memcpy.

void run_cpu(const Workload& w, int reps, Summary& summary) {
  std::uint64_t padded = 0;
  const std::vector<std::uint64_t> offsets = tensor_offsets(w, &padded);
  std::vector<float> storage(padded);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : storage) v = normal(rng);
  std::vector<const float*> sources;
  for (std::uint64_t o : offsets) sources.push_back(storage.data() + o);
  std::vector<float> gathered(w.elements);

  const Codec codecs[] = {Codec::kFp32, Codec::kBf16, Codec::kInt8};
  struct Variant {
    std::shared_ptr<const PackPlan> plan;
    std::unique_ptr<ember::gpu::HostSymBuffer> buffer;
    std::unique_ptr<ember::gpu::CpuPacker> packer;
    std::vector<double> times;
  };
  std::vector<Variant> variants;
  for (Codec c : codecs) {
    Variant v;
    v.plan = make_plan(w, c, 4, 8);
    auto buf = ember::gpu::HostSymBuffer::allocate(v.plan->layout());
    auto packer = ember::gpu::CpuPacker::create(v.plan);
    if (!buf || !packer) {
      fmt::print(stderr, "cpu setup failed\n");
      std::exit(1);
    }
    v.buffer = std::make_unique<ember::gpu::HostSymBuffer>(std::move(*buf));
    v.packer = std::make_unique<ember::gpu::CpuPacker>(std::move(*packer));
    variants.push_back(std::move(v));
  }
  std::vector<double> memcpy_times;
  for (int rep = 0; rep < reps; ++rep) {
    Clock::time_point t0 = Clock::now();
    std::uint64_t pos = 0;
    for (std::size_t i = 0; i < w.sizes.size(); ++i) {
      std::memcpy(gathered.data() + pos, sources[i], w.sizes[i] * sizeof(float));
      pos += w.sizes[i];
    }
    memcpy_times.push_back(seconds_since(t0));
    for (Variant& v : variants) {
      v.buffer->reset_positions();
      t0 = Clock::now();
      auto st = v.packer->pack(sources, v.buffer->view());
      v.times.push_back(seconds_since(t0));
      if (!st) {
        fmt::print(stderr, "cpu pack: {}\n", st.error().to_string());
        std::exit(1);
      }
    }
  }
  const double gb = static_cast<double>(w.bytes()) / 1e9;
  const double t_memcpy = median(memcpy_times);
  fmt::print("  {:<10} {:>9.1f} MB  memcpy {:>6.2f} GB/s", w.name, gb * 1e3, gb / t_memcpy);
  for (std::size_t i = 0; i < variants.size(); ++i) {
    const double t = median(variants[i].times);
    fmt::print("  pack {} {:>6.2f} GB/s ({:.2f}x)", ember::gpu::codec_name(codecs[i]), gb / t, t_memcpy / t);
    summary.add(fmt::format("cpu_pack_{}_vs_memcpy_{}", ember::gpu::codec_name(codecs[i]), w.name),
                t_memcpy / t);
  }
  fmt::print("\n");
}

// ---------------------------------------------------------------------------
// CUDA kernels vs cudaMemcpy.

#if defined(EMBER_HAVE_CUDA)

#define BENCH_CUDA(expr)                                                                    \
  do {                                                                                      \
    const cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                                \
      fmt::print(stderr, "{}:{}: {}: {}\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

#define BENCH_OK(expr)                                                              \
  do {                                                                              \
    auto&& st_ = (expr);                                                            \
    if (!st_) {                                                                     \
      fmt::print(stderr, "{}:{}: {}\n", __FILE__, __LINE__, st_.error().to_string()); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

struct DeviceSet {
  float* src = nullptr;
  float* dst = nullptr;
  float* copy = nullptr;
  std::vector<const float*> sources;
  std::vector<float*> destinations;

  explicit DeviceSet(const Workload& w) {
    std::uint64_t padded = 0;
    const std::vector<std::uint64_t> offsets = tensor_offsets(w, &padded);
    BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&src), padded * sizeof(float)));
    BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&dst), padded * sizeof(float)));
    BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&copy), w.bytes()));
    std::vector<float> host(padded);
    std::mt19937 rng(2);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : host) v = normal(rng);
    BENCH_CUDA(cudaMemcpy(src, host.data(), padded * sizeof(float), cudaMemcpyHostToDevice));
    for (std::uint64_t o : offsets) {
      sources.push_back(src + o);
      destinations.push_back(dst + o);
    }
  }
  ~DeviceSet() {
    (void)cudaFree(src);
    (void)cudaFree(dst);
    (void)cudaFree(copy);
  }
};

struct GpuTimes {
  double memcpy_s = 0, pack_s = 0, unpack_s = 0, host_pack_s = 0;
};

// Interleaved repetitions of: D2D copy of the same bytes | pack | (echo) |
// unpack. Rings drain every repetition, so each pack starts on free rings.
GpuTimes time_gpu(const Workload& w, DeviceSet& d, Codec codec, std::uint32_t channels, int reps,
                  cudaStream_t stream) {
  auto plan = make_plan(w, codec, channels, 8);
  auto buf = ember::gpu::GpuSymBuffer::allocate(plan->layout());
  BENCH_OK(buf);
  auto packer = ember::gpu::GpuPacker::create(plan);
  BENCH_OK(packer);
  BENCH_OK(packer->set_sources(d.sources));
  BENCH_OK(packer->set_destinations(d.destinations));
  cudaEvent_t ev[6];
  for (cudaEvent_t& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  std::vector<double> t_copy, t_pack, t_unpack, t_host;
  for (int rep = -2; rep < reps; ++rep) {  // two warm-up repetitions
    BENCH_CUDA(cudaEventRecord(ev[0], stream));
    BENCH_CUDA(cudaMemcpyAsync(d.copy, d.src, w.bytes(), cudaMemcpyDeviceToDevice, stream));
    BENCH_CUDA(cudaEventRecord(ev[1], stream));
    BENCH_CUDA(cudaEventRecord(ev[2], stream));
    const Clock::time_point h0 = Clock::now();
    BENCH_OK(packer->pack_async(*buf, stream));
    const double host_s = seconds_since(h0);
    BENCH_CUDA(cudaEventRecord(ev[3], stream));
    BENCH_OK(packer->finish(stream));
    BENCH_OK(buf->loopback(stream));
    BENCH_CUDA(cudaEventRecord(ev[4], stream));
    BENCH_OK(packer->unpack_async(*buf, stream));
    BENCH_CUDA(cudaEventRecord(ev[5], stream));
    BENCH_OK(packer->finish(stream));
    if (rep < 0) continue;
    float ms[3];
    BENCH_CUDA(cudaEventElapsedTime(&ms[0], ev[0], ev[1]));
    BENCH_CUDA(cudaEventElapsedTime(&ms[1], ev[2], ev[3]));
    BENCH_CUDA(cudaEventElapsedTime(&ms[2], ev[4], ev[5]));
    t_copy.push_back(ms[0] / 1e3);
    t_pack.push_back(ms[1] / 1e3);
    t_unpack.push_back(ms[2] / 1e3);
    t_host.push_back(host_s);
  }
  for (cudaEvent_t& e : ev) (void)cudaEventDestroy(e);
  return GpuTimes{median(t_copy), median(t_pack), median(t_unpack), median(t_host)};
}

bool run_gpu(const std::vector<Workload>& workloads, int reps, Summary& summary) {
  auto info = ember::gpu::query_device(0);
  if (!info) {
    fmt::print("gpu: no device ({}); GPU rows skipped\n", info.error().message());
    summary.add("gpu", "absent");
    return false;
  }
  const std::uint32_t max_channels = ember::gpu::max_gpu_channels(info->sm_count);
  const std::uint32_t channels = ember::gpu::default_gpu_channels(info->sm_count);
  fmt::print("gpu: {} ({} SMs, sm_{}{}), default channels {}, at most {}\n", info->name, info->sm_count,
             info->compute_major, info->compute_minor, channels, max_channels);
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreate(&stream));

  fmt::print("\n  {:<10} {:>6} {:>5} {:>10} {:>10} {:>10} {:>8} {:>8} {:>9} {:>9}\n", "workload", "codec",
             "ch", "d2d GB/s", "pack GB/s", "unpk GB/s", "pack/d2d", "unpk/d2d", "p+u/2d2d", "host us");
  const char* targets[] = {"0.80", "0.60"};
  for (std::size_t wi = 0; wi < workloads.size(); ++wi) {
    const Workload& w = workloads[wi];
    DeviceSet d(w);
    const double gb = static_cast<double>(w.bytes()) / 1e9;
    for (Codec codec : {Codec::kFp32, Codec::kBf16, Codec::kInt8}) {
      const GpuTimes t = time_gpu(w, d, codec, channels, reps, stream);
      const double pack_ratio = t.memcpy_s / t.pack_s;
      const double unpack_ratio = t.memcpy_s / t.unpack_s;
      const double both_ratio = 2 * t.memcpy_s / (t.pack_s + t.unpack_s);
      fmt::print("  {:<10} {:>6} {:>5} {:>10.1f} {:>10.1f} {:>10.1f} {:>8.2f} {:>8.2f} {:>9.2f} {:>9.2f}\n",
                 w.name, ember::gpu::codec_name(codec), channels, gb / t.memcpy_s, gb / t.pack_s,
                 gb / t.unpack_s, pack_ratio, unpack_ratio, both_ratio, t.host_pack_s * 1e6);
      const std::string suffix = fmt::format("{}_{}", ember::gpu::codec_name(codec), w.name);
      summary.add("gpu_pack_vs_d2d_" + suffix, pack_ratio);
      if (codec == Codec::kFp32) {
        summary.add("gpu_unpack_vs_d2d_" + suffix, unpack_ratio);
        summary.add("gpu_pack_unpack_vs_d2d_" + suffix, both_ratio);
        summary.add("gpu_host_us_per_pack_" + w.name, t.host_pack_s * 1e6);
        fmt::print("  {:<10} target: pack+unpack >= {} of d2d, host <= 10 us per call\n", "", targets[wi]);
      }
    }
  }

  // Channel sweep (ResNet-50, fp32): the fewest channels within 90% of the best.
  const Workload& w = workloads.front();
  DeviceSet d(w);
  const double gb = static_cast<double>(w.bytes()) / 1e9;
  fmt::print("\n  channel sweep, {} fp32 pack:\n  {:>5} {:>10} {:>10} {:>8}\n", w.name, "ch", "pack GB/s",
             "unpk GB/s", "pack/d2d");
  std::vector<std::pair<std::uint32_t, double>> sweep;
  for (std::uint32_t c : {1u, 2u, 4u, 8u, 12u, 16u, 20u, 24u, 32u, 40u, 48u, 56u, 64u, max_channels}) {
    if (c > max_channels || (!sweep.empty() && sweep.back().first >= c)) continue;
    const GpuTimes t = time_gpu(w, d, Codec::kFp32, c, std::max(3, reps / 2), stream);
    sweep.emplace_back(c, gb / t.pack_s);
    fmt::print("  {:>5} {:>10.1f} {:>10.1f} {:>8.2f}\n", c, gb / t.pack_s, gb / t.unpack_s, t.memcpy_s / t.pack_s);
  }
  double best = 0.0;
  for (const auto& [c, bw] : sweep) best = std::max(best, bw);
  std::uint32_t fewest = max_channels;
  for (const auto& [c, bw] : sweep) {
    if (bw >= 0.9 * best) {
      fewest = c;
      break;
    }
  }
  fmt::print("  fewest channels within 90% of the best ({:.1f} GB/s): {}\n", best, fewest);
  summary.add("gpu_min_channels_saturating", static_cast<double>(fewest));
  summary.add("gpu_default_channels", static_cast<double>(channels));
  (void)cudaStreamDestroy(stream);
  return true;
}

#else

bool run_gpu(const std::vector<Workload>&, int, Summary& summary) {
  fmt::print("gpu: built without CUDA (EMBER_WITH_CUDA=OFF); GPU rows skipped\n");
  summary.add("gpu", "absent");
  return false;
}

#endif

}  // namespace

int main(int argc, char** argv) {
  // Plain flags (CLI11's header trips g++ 12's -Wnull-dereference at -O2).
  int cpu_reps = 5;
  int gpu_reps = 20;
  bool quick = false;
  bool no_cpu = false;
  std::size_t small_count = 10'000;
  const char* usage =
      "usage: ember-bench-gpu [--quick] [--no-cpu] [--cpu-reps N] [--gpu-reps N] [--small-tensors N]\n";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto number = [&](long lo, long hi) -> long {
      char* end = nullptr;
      const long v = i + 1 < argc ? std::strtol(argv[i + 1], &end, 10) : 0;
      if (i + 1 >= argc || end == argv[i + 1] || *end != '\0' || v < lo || v > hi) {
        fmt::print(stderr, "ember-bench-gpu: {} needs a number in [{}, {}]\n{}", arg, lo, hi, usage);
        std::exit(2);
      }
      ++i;
      return v;
    };
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--no-cpu") {
      no_cpu = true;
    } else if (arg == "--cpu-reps") {
      cpu_reps = static_cast<int>(number(1, 1000));
    } else if (arg == "--gpu-reps") {
      gpu_reps = static_cast<int>(number(1, 10000));
    } else if (arg == "--small-tensors") {
      small_count = static_cast<std::size_t>(number(1, 1'000'000));
    } else if (arg == "-h" || arg == "--help") {
      fmt::print("{}", usage);
      return 0;
    } else {
      fmt::print(stderr, "ember-bench-gpu: unknown argument '{}'\n{}", arg, usage);
      return 2;
    }
  }
  if (quick) {
    cpu_reps = std::min(cpu_reps, 3);
    gpu_reps = std::min(gpu_reps, 5);
    small_count = std::min<std::size_t>(small_count, 2000);
  }
  const std::vector<Workload> workloads = {
      make_workload("resnet50", ember::bench::resnet50_gradient_sizes()),
      make_workload(small_count == 10'000 ? "10k" : fmt::format("{}small", small_count),
                    ember::bench::small_tensor_sizes(small_count, 7))};
  fmt::print("ember-bench-gpu: {} = {} tensors ({} values), {} = {} tensors of 4-64 KiB; chunks of {} bytes, "
             "{} servers\n",
             workloads[0].name, workloads[0].sizes.size(), workloads[0].elements, workloads[1].name,
             workloads[1].sizes.size(), kPartitionBytes, kServers);
  Summary summary;
  if (!no_cpu) {
    fmt::print("\ncpu reference (4 channels), medians of {} interleaved repetitions:\n", cpu_reps);
    for (const Workload& w : workloads) run_cpu(w, cpu_reps, summary);
  }
  fmt::print("\n");
  run_gpu(workloads, gpu_reps, summary);
  fmt::print("\n{}\n", summary.line);
  return 0;
}
