// The packer behind a DeviceExchange (device_exchange.h), one interface for
// the CPU reference (CpuPacker over a HostSymBuffer) and the CUDA kernels
// (GpuPacker over a GpuSymBuffer registered on pinned host memory). Both put
// the SymBuffer in a host region the caller owns (a page-pool block), so the
// host can move and decode records between steps through host_view().
//
// Internal to worker/gpu: DeviceExchange is the public API.
// Thread-safety: one thread at a time per backend; pack and unpack block
// until the step is done (the CUDA backend waits for its stream).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/base/error.h"
#include "worker/gpu/host_symbuffer.h"
#include "worker/gpu/pack_plan.h"

namespace ember::gpu::detail {

class PackBackend {
 public:
  virtual ~PackBackend() = default;
  virtual std::string_view name() const = 0;
  // The SymBuffer as the host addresses it (laid out by the plan).
  virtual SymBufferView host_view() const = 0;
  // One pack / unpack step of the plan (cpu_packer.h / gpu_packer.h), with
  // tensors in the backend's memory (host / device). Errors: the packer's;
  // CUDA: kInvalidArgument for a pointer the device cannot address (names
  // the tensor index and key), CUDA errors.
  virtual Status pack(std::span<const float* const> sources) = 0;
  virtual Status unpack(std::span<float* const> destinations) = 0;
  // Every ring empty again (after a failed step left bytes in one).
  virtual Status reset_positions() = 0;
};

// CpuPacker over HostSymBuffer::wrap(region). Errors: those of
// CpuPacker::create and HostSymBuffer::wrap.
Result<std::unique_ptr<PackBackend>> make_cpu_backend(std::shared_ptr<const PackPlan> plan,
                                                      std::span<std::byte> region,
                                                      std::chrono::nanoseconds timeout);

// Whether this build has the CUDA backend.
bool cuda_backend_built() noexcept;

// Whether CUDA device `device` is usable; when not, *why says why.
bool cuda_device_usable(int device, std::string* why);

// SM count of `device` (0 when unknown) for the channel cap.
int cuda_sm_count(int device);

// GpuPacker over GpuSymBuffer::register_host(region). Errors: kUnavailable
// in a build without CUDA; those of GpuPacker::create and register_host.
Result<std::unique_ptr<PackBackend>> make_cuda_backend(std::shared_ptr<const PackPlan> plan,
                                                       std::span<std::byte> region, int device,
                                                       std::chrono::nanoseconds timeout);

}  // namespace ember::gpu::detail
