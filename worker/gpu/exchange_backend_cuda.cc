// The CUDA backend of DeviceExchange (exchange_backend.h): GpuPacker over a
// GpuSymBuffer registered on a caller-owned host region (a page-pool block),
// so the kernels write packed records straight into memory the host and the
// transport read. Each step launches on the backend's own stream and waits
// for it. Tensor pointers are checked with cudaPointerGetAttributes when
// they change (a host pointer in a kernel would be a sticky illegal-address
// error for the whole context) and uploaded once per change.
// Built only with EMBER_WITH_CUDA.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "worker/gpu/exchange_backend.h"
#include "worker/gpu/gpu_packer.h"

namespace ember::gpu::detail {

namespace {

// Whether the device can dereference `p` as is: device or managed memory, or
// host memory mapped at the same address.
Status check_device_pointer(const void* p, const PackPlan& plan, std::size_t index,
                            std::string_view what) {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it
    return cuda_check(e, "device exchange: cudaPointerGetAttributes");
  }
  const bool ok = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged ||
                  (attr.type == cudaMemoryTypeHost && attr.devicePointer == p);
  if (!ok) {
    return make_error(ErrorCode::kInvalidArgument,
                      "device exchange: {} tensor {} (key {}) at {} is not memory the CUDA device "
                      "can address (unregistered host memory?); pass device memory, or use the cpu "
                      "backend for host tensors",
                      what, index, plan.tensors()[index].key, p);
  }
  return ok_status();
}

class CudaBackend final : public PackBackend {
 public:
  CudaBackend(GpuPacker packer, GpuSymBuffer buffer, cudaStream_t stream, int device)
      : packer_(std::move(packer)), buffer_(std::move(buffer)), stream_(stream), device_(device) {}
  ~CudaBackend() override {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "cuda"; }
  SymBufferView host_view() const override { return buffer_.host_view(); }

  Status pack(std::span<const float* const> sources) override {
    EMBER_TRY(cuda_check(cudaSetDevice(device_), "device exchange: cudaSetDevice"));
    if (!same(sources_, sources)) {
      EMBER_TRY(check_pointers(sources, "source"));
      EMBER_TRY(packer_.set_sources(sources, stream_));
      sources_.assign(sources.begin(), sources.end());
    }
    EMBER_TRY(packer_.pack_async(buffer_, stream_));
    return packer_.finish(stream_);
  }

  Status unpack(std::span<float* const> destinations) override {
    EMBER_TRY(cuda_check(cudaSetDevice(device_), "device exchange: cudaSetDevice"));
    if (!same(destinations_, destinations)) {
      EMBER_TRY(check_pointers(destinations, "destination"));
      EMBER_TRY(packer_.set_destinations(destinations, stream_));
      destinations_.assign(destinations.begin(), destinations.end());
    }
    EMBER_TRY(packer_.unpack_async(buffer_, stream_));
    return packer_.finish(stream_);
  }

  Status reset_positions() override {
    EMBER_TRY(cuda_check(cudaSetDevice(device_), "device exchange: cudaSetDevice"));
    return buffer_.reset_positions();
  }

 private:
  template <typename T>
  static bool same(const std::vector<T>& cached, std::span<const T> now) {
    return cached.size() == now.size() && std::equal(cached.begin(), cached.end(), now.begin());
  }
  template <typename T>
  Status check_pointers(std::span<const T> pointers, std::string_view what) const {
    const PackPlan& plan = packer_.plan();
    for (std::size_t i = 0; i < pointers.size(); ++i) {
      if (pointers[i] == nullptr) continue;  // empty tensor (the packer rejects other nulls)
      EMBER_TRY(check_device_pointer(pointers[i], plan, i, what));
    }
    return ok_status();
  }

  GpuPacker packer_;
  GpuSymBuffer buffer_;
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
  std::vector<const float*> sources_;  // pointers uploaded last (set_sources)
  std::vector<float*> destinations_;
};

}  // namespace

bool cuda_backend_built() noexcept { return true; }

bool cuda_device_usable(int device, std::string* why) {
  auto info = query_device(device);
  if (!info) {
    if (why) *why = info.error().message();
    return false;
  }
  return true;
}

int cuda_sm_count(int device) {
  auto info = query_device(device);
  return info ? info->sm_count : 0;
}

Result<std::unique_ptr<PackBackend>> make_cuda_backend(std::shared_ptr<const PackPlan> plan,
                                                       std::span<std::byte> region, int device,
                                                       std::chrono::nanoseconds timeout) {
  if (!plan) return make_error(ErrorCode::kInvalidArgument, "cuda backend: null pack plan");
  GpuPackerOptions options;
  options.device = device;
  options.backpressure_timeout = timeout;
  EMBER_ASSIGN_OR_RETURN(GpuPacker packer, GpuPacker::create(plan, options));
  EMBER_ASSIGN_OR_RETURN(GpuSymBuffer buffer,
                         GpuSymBuffer::register_host(plan->layout(), region, device));
  cudaStream_t stream = nullptr;
  EMBER_TRY(cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                       "device exchange: cudaStreamCreateWithFlags"));
  return std::unique_ptr<PackBackend>(
      std::make_unique<CudaBackend>(std::move(packer), std::move(buffer), stream, device));
}

}  // namespace ember::gpu::detail
