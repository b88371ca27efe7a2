// The CPU backend of DeviceExchange (exchange_backend.h): CpuPacker over a
// HostSymBuffer wrapped around a caller-owned host region. In a build
// without CUDA this file also answers the CUDA backend's queries (none).
#include <utility>

#include "worker/gpu/cpu_packer.h"
#include "worker/gpu/exchange_backend.h"

namespace ember::gpu::detail {

namespace {

class CpuBackend final : public PackBackend {
 public:
  CpuBackend(CpuPacker packer, HostSymBuffer buffer)
      : packer_(std::move(packer)), buffer_(std::move(buffer)) {}

  std::string_view name() const override { return "cpu"; }
  SymBufferView host_view() const override { return buffer_.view(); }
  Status pack(std::span<const float* const> sources) override {
    return packer_.pack(sources, buffer_.view());
  }
  Status unpack(std::span<float* const> destinations) override {
    return packer_.unpack(destinations, buffer_.view());
  }
  Status reset_positions() override {
    buffer_.reset_positions();
    return ok_status();
  }

 private:
  CpuPacker packer_;
  HostSymBuffer buffer_;
};

}  // namespace

Result<std::unique_ptr<PackBackend>> make_cpu_backend(std::shared_ptr<const PackPlan> plan,
                                                      std::span<std::byte> region,
                                                      std::chrono::nanoseconds timeout) {
  if (!plan) return make_error(ErrorCode::kInvalidArgument, "cpu backend: null pack plan");
  EMBER_ASSIGN_OR_RETURN(HostSymBuffer buffer, HostSymBuffer::wrap(plan->layout(), region));
  CpuPackerOptions options;
  options.backpressure_timeout = timeout;
  EMBER_ASSIGN_OR_RETURN(CpuPacker packer, CpuPacker::create(std::move(plan), options));
  return std::unique_ptr<PackBackend>(
      std::make_unique<CpuBackend>(std::move(packer), std::move(buffer)));
}

#if !defined(EMBER_HAVE_CUDA)
bool cuda_backend_built() noexcept { return false; }

bool cuda_device_usable(int /*device*/, std::string* why) {
  if (why) *why = "this build has no CUDA support (configure with EMBER_WITH_CUDA=ON and nvcc)";
  return false;
}

int cuda_sm_count(int /*device*/) { return 0; }

Result<std::unique_ptr<PackBackend>> make_cuda_backend(std::shared_ptr<const PackPlan> /*plan*/,
                                                       std::span<std::byte> /*region*/,
                                                       int /*device*/,
                                                       std::chrono::nanoseconds /*timeout*/) {
  return make_error(ErrorCode::kUnavailable,
                    "device exchange: backend cuda requested, but this build has no CUDA support; "
                    "configure with EMBER_WITH_CUDA=ON (nvcc found) or use backend cpu");
}
#endif

}  // namespace ember::gpu::detail
