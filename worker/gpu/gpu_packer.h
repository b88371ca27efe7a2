// GPU SymBuffer API: a SymBuffer the device can address (device memory, or
// pinned host memory such as a page-pool region registered with CUDA), and
// GpuPacker, which packs device gradient tensors into its send rings and
// unpacks the recv rings into device tensors with the CUDA kernels of
// kernels.cu. Same layout, record format and bits as CpuPacker (the tests
// compare them); see cpu_packer.h for the step protocol.
//
// Typical use by the worker (push_device / pull_device):
//   auto plan = std::make_shared<const PackPlan>(*PackPlan::build(tensors, opts));
//   auto buffer = *GpuSymBuffer::register_host(plan->layout(), pool_region);
//   auto packer = *GpuPacker::create(plan, {});
//   packer.set_sources(grad_ptrs);          // once: device pointers, stable
//   packer.set_destinations(param_ptrs);
//   per step: packer.pack_async(buffer, stream);  packer.finish(stream);
//             transport sends the send rings (RingView on buffer.host_view()),
//             delivers the reply into the recv rings;
//             packer.unpack_async(buffer, stream); packer.finish(stream);
//
// Only built with EMBER_WITH_CUDA (defines EMBER_HAVE_CUDA).
// Thread-safety: one host thread per GpuPacker/GpuSymBuffer at a time.
// Kernels run asynchronously on the caller's stream; the tensors, the buffer
// and the packer must outlive the work enqueued on them. A packer's pack
// launches must be ordered (one stream, or events), and so must its unpack
// launches; a pack and an unpack may run concurrently. Kernels launch on the
// calling thread's current device: create() makes options.device current.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>

#include "common/base/error.h"
#include "worker/gpu/host_symbuffer.h"
#include "worker/gpu/kernels.h"
#include "worker/gpu/pack_plan.h"

namespace ember::gpu {

// The CUDA error convention's one check helper: cudaSuccess → ok, otherwise
// an Error naming `what` and the CUDA error (kUnavailable for no device or
// an old driver, kTooLarge for out of memory, kInternal otherwise).
Error cuda_error(cudaError_t error, std::string_view what);
Status cuda_check(cudaError_t error, std::string_view what);

struct GpuDeviceInfo {
  int device = 0;
  std::string name;
  int sm_count = 0;
  int compute_major = 0;
  int compute_minor = 0;
};

// Properties of CUDA device `device`. Errors: kUnavailable when there is no
// such device or no usable driver (the message says so; callers fall back to
// CpuPacker).
Result<GpuDeviceInfo> query_device(int device = 0);

// Most channels a GPU may use: half its SMs (each channel is a pack block
// and an unpack block; the rest stay with compute).
constexpr std::uint32_t max_gpu_channels(int sm_count) {
  return sm_count >= 2 ? static_cast<std::uint32_t>(sm_count / 2) : 1u;
}

// Default channel count on a GPU: kDefaultGpuChannels, capped by
// max_gpu_channels. Provisional until scripts/gpu-check.sh has measured the
// fewest channels that saturate an H200 (DeepEP ships 20 of 132 SMs).
inline constexpr std::uint32_t kDefaultGpuChannels = 24;
constexpr std::uint32_t default_gpu_channels(int sm_count) {
  return kDefaultGpuChannels < max_gpu_channels(sm_count) ? kDefaultGpuChannels
                                                          : max_gpu_channels(sm_count);
}

class GpuSymBuffer {
 public:
  // cudaMalloc of layout.total_bytes(), zeroed. Errors: kInvalidArgument
  // (invalid layout), kUnavailable / kTooLarge (CUDA).
  static Result<GpuSymBuffer> allocate(const SymBufferLayout& layout, int device = 0);
  // Pins `region` (host memory, 128-byte aligned, ≥ layout.total_bytes(),
  // e.g. a page-pool block) with cudaHostRegister and maps it for the
  // device, so the transport sends the packed bytes without another copy.
  // Sets every ring's head and tail to 0. The region must outlive the
  // buffer; it is unregistered on destruction unless it was registered
  // before (by the caller, with cudaHostRegisterMapped): that registration
  // is used and left in place. (The page pool does not register its region
  // with CUDA: each buffer registers its own block.)
  // Errors: kInvalidArgument, CUDA errors.
  static Result<GpuSymBuffer> register_host(const SymBufferLayout& layout,
                                            std::span<std::byte> region, int device = 0);

  GpuSymBuffer(GpuSymBuffer&& other) noexcept;
  GpuSymBuffer& operator=(GpuSymBuffer&& other) noexcept;
  GpuSymBuffer(const GpuSymBuffer&) = delete;
  GpuSymBuffer& operator=(const GpuSymBuffer&) = delete;
  ~GpuSymBuffer();

  const SymBufferLayout& layout() const { return layout_; }
  // Base address as kernels see it.
  std::byte* device_base() const { return device_base_; }
  // Host address of a registered host buffer; nullptr for device memory.
  std::byte* host_base() const { return host_base_; }
  // A host view (RingView, CpuPacker, loopback); pre: host_base() != nullptr.
  SymBufferView host_view() const { return SymBufferView{layout_, host_base_}; }

  // Sets every head and tail to 0. Blocks until done. Not while kernels use
  // the buffer.
  Status reset_positions();
  // Whole-buffer copies (tests, debugging). Block until done.
  // pre: bytes.size() == layout().total_bytes().
  Status copy_to_host(std::span<std::byte> bytes) const;
  Status copy_from_host(std::span<const std::byte> bytes);
  // Runs the loopback kernel (every send ring's readable bytes → its recv
  // ring) and waits for it. Errors: kTooLarge when a recv ring has no room
  // (names channel, rank, head, tail), kProtocol for misaligned positions,
  // kInternal for a ring that holds more than its capacity (each names the
  // send or recv ring whose positions are wrong).
  Status loopback(cudaStream_t stream);

 private:
  GpuSymBuffer() = default;
  void release() noexcept;

  SymBufferLayout layout_{};
  std::byte* device_base_ = nullptr;
  std::byte* host_base_ = nullptr;
  bool registered_ = false;  // we called cudaHostRegister (and must unregister)
  StepStatus* status_ = nullptr;  // device memory, for loopback
};

struct GpuPackerOptions {
  int device = 0;
  // Bounded wait of a kernel for ring space (pack) or data (unpack) before
  // the step fails with kTimeout.
  std::chrono::nanoseconds backpressure_timeout = std::chrono::seconds(5);
  // Blocks per launch; 0 = the plan's num_channels. At most half the SMs.
  std::uint32_t num_blocks = 0;
};

class GpuPacker {
 public:
  // Uploads the plan and allocates the state (zeroed). Errors:
  // kInvalidArgument (null plan, negative timeout, more channels/blocks than
  // half the device's SMs: names both numbers), kUnavailable (no device),
  // kTooLarge (out of device memory).
  static Result<GpuPacker> create(std::shared_ptr<const PackPlan> plan,
                                  const GpuPackerOptions& options = {});

  GpuPacker(GpuPacker&&) noexcept;
  GpuPacker& operator=(GpuPacker&&) noexcept;
  GpuPacker(const GpuPacker&) = delete;
  GpuPacker& operator=(const GpuPacker&) = delete;
  ~GpuPacker();

  const PackPlan& plan() const { return *f_.plan; }
  const GpuDeviceInfo& device() const { return f_.device; }
  std::uint32_t num_blocks() const { return f_.num_blocks; }

  // Device pointers of the plan's tensors ([num_elements] fp32 each, any
  // 4-byte alignment; null only for empty tensors). Uploaded once here, on
  // `stream`, which is then waited for (so not while a kernel on `stream`
  // waits for this thread); the table is on the device when this returns,
  // for launches on any stream. Later steps reuse them, so the tensors must
  // stay put. Not while a launch of this packer is in flight.
  // Errors: kInvalidArgument (count, null pointer), CUDA errors.
  Status set_sources(std::span<const float* const> device_tensors, cudaStream_t stream = nullptr);
  Status set_destinations(std::span<float* const> device_tensors, cudaStream_t stream = nullptr);

  // Enqueues one pack step on `stream` (one kernel launch; does not block).
  // Errors returned here: kInvalidArgument (no sources set, buffer laid out
  // differently), CUDA launch errors. Errors of the step itself (ring full
  // past the timeout, ...) are reported by finish().
  Status pack_async(const GpuSymBuffer& buffer, cudaStream_t stream);
  // Same for unpack (destinations must be set).
  Status unpack_async(const GpuSymBuffer& buffer, cudaStream_t stream);
  // Waits for `stream` and reports the first failure of the steps enqueued
  // on it since the last finish() of that stream: kTimeout (names channel,
  // rank, head, tail), kProtocol, kInternal, or a CUDA error. Only the kinds
  // (pack, unpack) whose latest launch went on `stream` are checked: a pack
  // and an unpack on two streams each need a finish() of their own stream.
  // After a failure that kind's counters are reset (the other kind's are
  // not) and its later steps run normally; the failed step left rings,
  // tensors and state untouched.
  Status finish(cudaStream_t stream);

  // Zeroes residuals and references. Blocks.
  Status reset_state();
  // Copies of the state arenas (tests). Block.
  Status download_state(std::vector<float>* residuals, std::vector<float>* send_refs,
                        std::vector<float>* recv_refs) const;
  // Device-side self-check: how many records sit in a ring other than the
  // one common/placement computes on the device. 0 expected. Blocks.
  Result<std::uint64_t> verify_placement();

 private:
  GpuPacker() = default;
  void release() noexcept;
  static constexpr int kPack = 0;    // index of counters, status, kinds
  static constexpr int kUnpack = 1;
  Status reset_counters(int kind, cudaStream_t stream);

  // Everything but the ownership list; copied on move.
  struct Fields {
    std::shared_ptr<const PackPlan> plan;
    GpuPackerOptions options{};
    GpuDeviceInfo device{};
    std::uint32_t num_blocks = 0;
    std::uint64_t pack_step = 0;    // launches since the last reset
    std::uint64_t unpack_step = 0;
    bool sources_set = false;
    bool destinations_set = false;
    // Per kind ([kPack], [kUnpack]): launched since its last finish(), and
    // on which stream (the latest launch).
    struct Pending {
      bool pending = false;
      cudaStream_t stream = nullptr;
    };
    Pending kinds[2] = {};
    kernels::DevicePlan device_plan{};
    const float** sources = nullptr;  // device arrays of device pointers
    float** destinations = nullptr;
    float* residuals = nullptr;
    float* send_refs = nullptr;
    float* recv_refs = nullptr;
    std::uint32_t* absmax_bits = nullptr;
    unsigned long long* record_done = nullptr;
    std::uint64_t* pack_ring_base = nullptr;
    std::uint64_t* unpack_ring_base = nullptr;
    kernels::StepCounters* counters = nullptr;  // [0] pack, [1] unpack
    StepStatus* status = nullptr;               // [0] pack, [1] unpack
    unsigned long long* mismatches = nullptr;
  };
  Fields f_;
  std::vector<void*> allocations_;  // every cudaMalloc of this packer, freed by release()
};

}  // namespace ember::gpu
