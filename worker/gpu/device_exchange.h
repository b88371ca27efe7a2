// DeviceExchange: the worker API for device tensors (push_device /
// pull_device). It sits on an existing ember::Worker and moves a model's
// gradient tensors through the GPU SymBuffer path: packed per channel into
// the send regions of a SymBuffer (CUDA kernels when a GPU is present, the
// CPU reference packer otherwise), compressed per key group, and sent
// through the Worker — the same pool buffers, channels and transport as CPU
// gradients. Pulled parameters come back the same way and are unpacked into
// the device tensors (host tensors on the CPU path).
//
// Tensors. A model is a list of TensorDesc {key, num_elements, group}: each
// tensor is [num_elements] fp32, contiguous, any 4-byte alignment. On the
// CUDA backend the data pointers are device memory (cudaMalloc, managed, or
// host memory mapped for the device); on the CPU backend they are host
// memory. The list is fixed at create(); every call passes the same tensors
// in the same order (checked: key and num_elements of each).
//
// Path of a push_device step (copies named):
//   1. pack: every tensor → records in the push SymBuffer's send rings, one
//      ring per (channel, server rank), the same chunk → (server, channel)
//      map as Worker (common/placement chunk_plan), compressed per group
//      (codec.h: fp32, bf16/fp16 prescaled, int8 per-chunk absmax, delta,
//      error feedback). The SymBuffer lives in the Worker's page pool
//      (pinned and mapped for the GPU on the CUDA backend). [copy 1, encoding]
//   2. the records of each ring are moved to its recv ring and decoded there
//      by the CPU reference receiver into an fp32 staging image of the model
//      in the page pool, as the server would decode them. [copies 2, 3]
//   3. each tensor is pushed through Worker::pipeline() from that pool
//      image (zero-copy over tcp; small chunks are batched per channel).
// What the server gets. The server stores fp32 parameters and accepts fp32
// gradients only, so each element it receives is the receiver's
// reconstruction divided back by the group's prescale:
//     server value = reconstruction(v) / prescale,
//     v = g · prescale (+ residual, error feedback),
//     reconstruction = decode(encode(v − ref)) + ref (delta) or decode(encode(v)).
// For an fp32 group without delta/feedback (prescale 1) that is g, bit for
// bit; for bf16/fp16/int8 it is g rounded by the codec, within the bounds
// documented in codec.h (bf16 2^-8·|v|, fp16 2^-11·|v| in the normal range,
// int8 (0.5 + 2^-15)·absmax/127 per chunk), plus one fp32 rounding of the
// division when prescale ≠ 1. The server then aggregates as for any CPU
// push (BSP: the mean over workers), so a DeviceExchange push and a plain
// Worker::push of the same tensor mean the same thing. The error-feedback
// residual carries what the codec dropped into the next step.
//
// Path of a pull_device step: Worker::pipeline() pulls every tensor into an
// fp32 pool image [copy 1, the Worker's copy out of its receive buffer];
// the CPU reference packs the image as fp32 records into the pull
// SymBuffer's send rings [copy 2], moves them to the recv rings [copy 3]
// and the backend unpacks them into the destination tensors [copy 4, a
// kernel on the CUDA backend]. Pulled parameters are never compressed:
// destinations get the server's fp32 values bit for bit.
//
// Asynchrony. Every call returns a Handle (worker/handle.h) at once; errors
// found before anything is sent (tensor list mismatch, wrong sizes, null
// pointers, a pack step that failed) come back as an already failed Handle.
// The Handle completes when every tensor's operation is done, with the
// first error or the smallest step over the tensors (push: the step pushed;
// pull, init: the step to compute next). A pull_device writes the
// destinations only after every pull succeeded: on failure no destination
// has changed. A push_device that fails after packing has still advanced
// the error-feedback residuals and delta references (as a failed
// Worker::push loses that step's gradient).
//
// Buffers. Sources may be reused as soon as push_device returns (they are
// packed before it returns). Destinations must stay valid until the
// pull_device Handle is done. At most one push_device and one pull_device
// (or init_device) is in flight: a call while the previous one of its kind
// is still running first waits for it.
//
// Thread-safety: create, init_device, push_device, pull_device and
// destruction from one thread at a time (the training thread). Handles may
// be waited on from any thread. Completion runs on a thread owned by the
// DeviceExchange (it unpacks pulled parameters there, and on the CUDA
// backend launches the unpack kernel from it). The Worker must outlive the
// DeviceExchange; destruction waits for every operation in flight.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "common/base/error.h"
#include "worker/gpu/pack_plan.h"
#include "worker/handle.h"
#include "worker/worker.h"

namespace ember::gpu {

// Which packer moves bytes between tensors and the SymBuffer.
enum class ExchangeBackend : std::uint8_t {
  kAuto = 0,  // CUDA when built with it and a device is present, else CPU
  kCpu = 1,   // the CPU reference (cpu_packer.h); tensors in host memory
  kCuda = 2,  // the CUDA kernels (gpu_packer.h); tensors in device memory
};
std::string_view backend_name(ExchangeBackend backend);

struct DeviceExchangeOptions {
  ExchangeBackend backend = ExchangeBackend::kAuto;
  // Compression per key group; TensorDesc::group indexes it (pack_plan.h).
  std::vector<CompressionOptions> groups = {CompressionOptions{}};
  // SymBuffer lanes. 0: the Worker's channel count (config `channels`), so a
  // chunk's ring is the channel the Worker sends it on; on the CUDA backend
  // capped at max_gpu_channels(SM count). A count other than the Worker's is
  // allowed (the Worker re-maps chunks to its own channels when pushing).
  std::uint32_t num_channels = 0;
  int device = 0;  // CUDA device (kCuda / kAuto)
  // Bounded wait of a pack or unpack step for ring space or data.
  std::chrono::nanoseconds backpressure_timeout = std::chrono::seconds(5);
};

// One tensor of a call: `key` and `num_elements` must equal the plan's
// entry at the same index. `data` may be null only when num_elements is 0.
struct ConstTensorView {
  std::uint64_t key = 0;
  const float* data = nullptr;
  std::uint64_t num_elements = 0;
};
struct TensorView {
  std::uint64_t key = 0;
  float* data = nullptr;
  std::uint64_t num_elements = 0;
};

class DeviceExchange {
 public:
  // Builds the push plan (options.groups) and the pull plan (fp32), places
  // both SymBuffers and the fp32 staging images in the Worker's page pool
  // (heap when the pool is exhausted), selects the backend, and starts the
  // completion thread. Blocks briefly (CUDA: device query, plan upload).
  // Errors: every PackPlan::build error (kInvalidArgument: duplicate key,
  // unknown group, bad prescale, ...; kTooLarge); kInvalidArgument for a
  // negative backpressure_timeout or an unknown backend value;
  // kUnavailable for backend kCuda in a build without CUDA or with no usable
  // device (the message says which); CUDA errors from GpuPacker::create /
  // GpuSymBuffer::register_host (kInvalidArgument: more channels than half
  // the SMs; kTooLarge: out of memory).
  static Result<std::unique_ptr<DeviceExchange>> create(Worker& worker,
                                                        std::span<const TensorDesc> tensors,
                                                        const DeviceExchangeOptions& options = {});

  ~DeviceExchange();
  DeviceExchange(const DeviceExchange&) = delete;
  DeviceExchange& operator=(const DeviceExchange&) = delete;

  // The backend chosen at create() (never kAuto) and its name ("cpu",
  // "cuda"); why kAuto chose CPU, when it did ("" otherwise).
  ExchangeBackend backend() const noexcept;
  std::string_view backend_name() const noexcept;
  std::string_view cpu_fallback_reason() const noexcept;

  const PackPlan& push_plan() const noexcept;
  const PackPlan& pull_plan() const noexcept;

  // Registers every tensor with the servers (Worker::init with shape
  // [num_elements]). Rank 0 passes the initial values of every tensor (one
  // view per plan tensor, backend memory); other ranks pass an empty span
  // (they receive rank 0's values). Values are read before this returns.
  // Errors (in the Handle): kInvalidArgument (list mismatch, see push_device;
  // rank 0 without values), a pack step's errors, and Worker::init's errors
  // (kShapeMismatch: a key exists with another shape; kWorkerLost).
  Handle init_device(std::span<const ConstTensorView> values);

  // Pushes this step's gradients (one view per plan tensor, in plan order,
  // backend memory). Blocks while packing (and while the previous
  // push_device is still in flight). Errors (in the Handle):
  //   kInvalidArgument: a tensor count other than the plan's, a view whose
  //     key or num_elements differs from the plan's tensor at that index,
  //     a null pointer for a non-empty tensor, (CUDA) a pointer the device
  //     cannot address — each message names the index, the key and the fix;
  //   kTimeout / kProtocol / kInternal / kTooLarge (a recv ring without
  //     room for its send ring) from the pack step (names channel, rank,
  //     head and tail);
  //   Worker::push's errors (kNotFound: key not init-ed; kStale;
  //     kOutOfStep; kInvalidArgument from the server; kClosed; kTimeout;
  //     see worker.h), the first one.
  Handle push_device(std::span<const ConstTensorView> gradients);

  // Pulls every tensor's parameters into `parameters` (one view per plan
  // tensor, backend memory, written only once every pull succeeded).
  // Blocks only while a previous pull_device / init_device is in flight.
  // Errors (in the Handle): kInvalidArgument as push_device; Worker::pull's
  // errors (kNotFound, kWorkerLost, kClosed, kTimeout); the unpack step's
  // errors (kTimeout, kProtocol: names channel, rank, head, tail).
  Handle pull_device(std::span<const TensorView> parameters);

  struct Impl;

 private:
  explicit DeviceExchange(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ember::gpu
