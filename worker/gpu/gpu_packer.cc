// Host side of the GPU SymBuffer; see gpu_packer.h. Compiled by the host
// compiler; the kernels are reached through kernels.h.
#include "worker/gpu/gpu_packer.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "worker/gpu/codec.h"
#include "worker/gpu/status.h"

namespace ember::gpu {

Error cuda_error(cudaError_t error, std::string_view what) {
  ErrorCode code = ErrorCode::kInternal;
  switch (error) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      code = ErrorCode::kUnavailable;
      break;
    case cudaErrorMemoryAllocation:
      code = ErrorCode::kTooLarge;
      break;
    default:
      break;
  }
  return Error(code, fmt::format("{}: CUDA error {} ({})", what, cudaGetErrorName(error),
                                 cudaGetErrorString(error)));
}

Status cuda_check(cudaError_t error, std::string_view what) {
  if (error == cudaSuccess) return ok_status();
  return tl::unexpected(cuda_error(error, what));
}

Result<GpuDeviceInfo> query_device(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error state
    return tl::unexpected(cuda_error(e, "no usable CUDA device (cudaGetDeviceCount)"));
  }
  if (device < 0 || device >= count) {
    return make_error(ErrorCode::kUnavailable, "CUDA device {} does not exist ({} present)", device,
                      count);
  }
  cudaDeviceProp prop{};
  EMBER_TRY(cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties"));
  GpuDeviceInfo info;
  info.device = device;
  info.name = prop.name;
  info.sm_count = prop.multiProcessorCount;
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  return info;
}

// ---------------------------------------------------------------------------
// GpuSymBuffer

namespace {

Status check_layout(const SymBufferLayout& layout) {
  if (!layout.valid()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "SymBuffer layout {} channels x {} ranks x {} ring bytes is invalid (ring "
                      "bytes must be a positive multiple of 128)",
                      layout.num_channels, layout.num_ranks, layout.ring_bytes);
  }
  return ok_status();
}

}  // namespace

Result<GpuSymBuffer> GpuSymBuffer::allocate(const SymBufferLayout& layout, int device) {
  EMBER_TRY(check_layout(layout));
  EMBER_TRY(cuda_check(cudaSetDevice(device), fmt::format("cudaSetDevice({})", device)));
  GpuSymBuffer b;
  b.layout_ = layout;
  void* p = nullptr;
  EMBER_TRY(cuda_check(cudaMalloc(&p, layout.total_bytes()),
                       fmt::format("SymBuffer: cudaMalloc of {} bytes", layout.total_bytes())));
  b.device_base_ = static_cast<std::byte*>(p);
  EMBER_TRY(cuda_check(cudaMemset(p, 0, layout.total_bytes()), "SymBuffer: cudaMemset"));
  void* s = nullptr;
  EMBER_TRY(cuda_check(cudaMalloc(&s, sizeof(StepStatus)), "SymBuffer: cudaMalloc of the status"));
  b.status_ = static_cast<StepStatus*>(s);
  EMBER_TRY(cuda_check(cudaDeviceSynchronize(), "SymBuffer: zeroing"));
  return b;
}

Result<GpuSymBuffer> GpuSymBuffer::register_host(const SymBufferLayout& layout,
                                                 std::span<std::byte> region, int device) {
  EMBER_TRY(check_layout(layout));
  if (reinterpret_cast<std::uintptr_t>(region.data()) % kRegionAlignBytes != 0 ||
      region.size() < layout.total_bytes()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "SymBuffer: host region at {} of {} bytes must be {}-byte aligned and hold "
                      "{} bytes",
                      static_cast<const void*>(region.data()), region.size(), kRegionAlignBytes,
                      layout.total_bytes());
  }
  EMBER_TRY(cuda_check(cudaSetDevice(device), fmt::format("cudaSetDevice({})", device)));
  GpuSymBuffer b;
  b.layout_ = layout;
  b.host_base_ = region.data();
  // Whole pages where the region allows (older drivers want page-aligned sizes).
  const std::size_t bytes = std::min<std::size_t>(region.size(), round_up(layout.total_bytes(), 4096));
  const cudaError_t reg = cudaHostRegister(region.data(), bytes,
                                           cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (reg == cudaErrorHostMemoryAlreadyRegistered) {
    (void)cudaGetLastError();  // the caller registered it already: use that
  } else {
    EMBER_TRY(cuda_check(reg, fmt::format("SymBuffer: cudaHostRegister of {} bytes", bytes)));
    b.registered_ = true;
  }
  void* dp = nullptr;
  EMBER_TRY(cuda_check(cudaHostGetDevicePointer(&dp, region.data(), 0),
                       "SymBuffer: cudaHostGetDevicePointer"));
  b.device_base_ = static_cast<std::byte*>(dp);
  void* s = nullptr;
  EMBER_TRY(cuda_check(cudaMalloc(&s, sizeof(StepStatus)), "SymBuffer: cudaMalloc of the status"));
  b.status_ = static_cast<StepStatus*>(s);
  gpu::reset_positions(b.host_view());
  return b;
}

GpuSymBuffer::GpuSymBuffer(GpuSymBuffer&& other) noexcept
    : layout_(other.layout_),
      device_base_(std::exchange(other.device_base_, nullptr)),
      host_base_(std::exchange(other.host_base_, nullptr)),
      registered_(std::exchange(other.registered_, false)),
      status_(std::exchange(other.status_, nullptr)) {}

GpuSymBuffer& GpuSymBuffer::operator=(GpuSymBuffer&& other) noexcept {
  if (this != &other) {
    release();
    layout_ = other.layout_;
    device_base_ = std::exchange(other.device_base_, nullptr);
    host_base_ = std::exchange(other.host_base_, nullptr);
    registered_ = std::exchange(other.registered_, false);
    status_ = std::exchange(other.status_, nullptr);
  }
  return *this;
}

GpuSymBuffer::~GpuSymBuffer() { release(); }

void GpuSymBuffer::release() noexcept {
  if (registered_) {
    (void)cudaHostUnregister(host_base_);
  } else if (host_base_ == nullptr && device_base_ != nullptr) {
    (void)cudaFree(device_base_);  // device memory we allocated
  }
  if (status_ != nullptr) (void)cudaFree(status_);
  device_base_ = nullptr;
  host_base_ = nullptr;
  registered_ = false;
  status_ = nullptr;
}

Status GpuSymBuffer::reset_positions() {
  if (host_base_ != nullptr) {
    gpu::reset_positions(host_view());
    return ok_status();
  }
  for (std::uint64_t ring = 0; ring < layout_.num_rings(); ++ring) {
    for (Direction d : {Direction::kSend, Direction::kRecv}) {
      EMBER_TRY(cuda_check(cudaMemset(layout_.meta(device_base_, ring, d), 0, sizeof(ChannelMeta)),
                           "SymBuffer: resetting positions"));
    }
  }
  return cuda_check(cudaDeviceSynchronize(), "SymBuffer: resetting positions");
}

Status GpuSymBuffer::copy_to_host(std::span<std::byte> bytes) const {
  if (bytes.size() != layout_.total_bytes()) {
    return make_error(ErrorCode::kInvalidArgument, "SymBuffer copy: {} bytes given, buffer has {}",
                      bytes.size(), layout_.total_bytes());
  }
  return cuda_check(cudaMemcpy(bytes.data(), device_base_, bytes.size(), cudaMemcpyDefault),
                    "SymBuffer: copy to host");
}

Status GpuSymBuffer::copy_from_host(std::span<const std::byte> bytes) {
  if (bytes.size() != layout_.total_bytes()) {
    return make_error(ErrorCode::kInvalidArgument, "SymBuffer copy: {} bytes given, buffer has {}",
                      bytes.size(), layout_.total_bytes());
  }
  // A pageable source may still be in flight when cudaMemcpy returns.
  EMBER_TRY(cuda_check(cudaMemcpy(device_base_, bytes.data(), bytes.size(), cudaMemcpyDefault),
                       "SymBuffer: copy from host"));
  return cuda_check(cudaDeviceSynchronize(), "SymBuffer: copy from host");
}

Status GpuSymBuffer::loopback(cudaStream_t stream) {
  EMBER_TRY(cuda_check(cudaMemsetAsync(status_, 0, sizeof(StepStatus), stream), "loopback: status"));
  kernels::LoopbackLaunch args;
  args.layout = layout_;
  args.buffer = device_base_;
  args.status = status_;
  EMBER_TRY(cuda_check(kernels::launch_loopback(args, stream), "loopback: launch"));
  StepStatus s{};
  EMBER_TRY(cuda_check(cudaMemcpyAsync(&s, status_, sizeof s, cudaMemcpyDeviceToHost, stream),
                       "loopback: status"));
  EMBER_TRY(cuda_check(cudaStreamSynchronize(stream), "loopback"));
  if (s.code != 0) return tl::unexpected(status_to_error(s, layout_, "loopback"));
  return ok_status();
}

// ---------------------------------------------------------------------------
// GpuPacker

namespace {

template <typename T>
Result<T*> device_array(std::vector<void*>& owned, std::size_t count, std::string_view what) {
  void* p = nullptr;
  const std::size_t bytes = std::max<std::size_t>(count * sizeof(T), 16);
  EMBER_TRY(cuda_check(cudaMalloc(&p, bytes), fmt::format("GpuPacker: cudaMalloc of {} ({} bytes)",
                                                          what, bytes)));
  owned.push_back(p);
  EMBER_TRY(cuda_check(cudaMemset(p, 0, bytes), fmt::format("GpuPacker: zeroing {}", what)));
  return static_cast<T*>(p);
}

template <typename T>
Result<T*> upload(std::vector<void*>& owned, std::span<const T> host, std::string_view what) {
  EMBER_ASSIGN_OR_RETURN(T * p, device_array<T>(owned, host.size(), what));
  if (!host.empty()) {
    EMBER_TRY(cuda_check(cudaMemcpy(p, host.data(), host.size_bytes(), cudaMemcpyHostToDevice),
                         fmt::format("GpuPacker: uploading {}", what)));
  }
  return p;
}

}  // namespace

Result<GpuPacker> GpuPacker::create(std::shared_ptr<const PackPlan> plan,
                                    const GpuPackerOptions& options) {
  if (plan == nullptr) return make_error(ErrorCode::kInvalidArgument, "GpuPacker: no pack plan given");
  if (options.backpressure_timeout.count() < 0) {
    return make_error(ErrorCode::kInvalidArgument, "GpuPacker: backpressure_timeout {} ns is negative",
                      options.backpressure_timeout.count());
  }
  EMBER_ASSIGN_OR_RETURN(GpuDeviceInfo info, query_device(options.device));
  const std::uint32_t cap = max_gpu_channels(info.sm_count);
  const std::uint32_t channels = plan->layout().num_channels;
  if (channels > cap) {
    return make_error(ErrorCode::kInvalidArgument,
                      "GpuPacker: {} channels exceed half the SMs of device {} ({}, {} SMs): at "
                      "most {}; lower [communication] channels",
                      channels, info.device, info.name, info.sm_count, cap);
  }
  const std::uint32_t blocks = options.num_blocks == 0 ? channels : options.num_blocks;
  if (blocks > cap) {
    return make_error(ErrorCode::kInvalidArgument,
                      "GpuPacker: num_blocks {} exceeds half the SMs of device {} ({} SMs): at "
                      "most {}",
                      blocks, info.device, info.sm_count, cap);
  }
  EMBER_TRY(cuda_check(cudaSetDevice(info.device), fmt::format("cudaSetDevice({})", info.device)));

  GpuPacker p;
  Fields& f = p.f_;
  std::vector<void*>& owned = p.allocations_;
  f.plan = std::move(plan);
  f.options = options;
  f.device = info;
  f.num_blocks = blocks;
  const PackPlan& pl = *f.plan;

  kernels::DevicePlan& dp = f.device_plan;
  EMBER_ASSIGN_OR_RETURN(dp.records, upload(owned, pl.records(), "records"));
  EMBER_ASSIGN_OR_RETURN(dp.tiles, upload(owned, pl.tiles(), "tiles"));
  EMBER_ASSIGN_OR_RETURN(dp.int8_tiles, upload(owned, pl.int8_tiles(), "int8 tiles"));
  EMBER_ASSIGN_OR_RETURN(dp.groups, upload(owned, pl.groups(), "groups"));
  EMBER_ASSIGN_OR_RETURN(dp.ring_step_bytes, upload(owned, pl.ring_step_bytes(), "ring step bytes"));
  EMBER_ASSIGN_OR_RETURN(dp.ring_record_begin, upload(owned, pl.ring_record_begin(), "ring records"));
  dp.num_records = static_cast<std::uint32_t>(pl.records().size());
  dp.num_tiles = static_cast<std::uint32_t>(pl.tiles().size());
  dp.num_int8_tiles = static_cast<std::uint32_t>(pl.int8_tiles().size());
  dp.num_rings = static_cast<std::uint32_t>(pl.layout().num_rings());
  dp.layout = pl.layout();

  const std::size_t tensors = pl.tensors().size();
  EMBER_ASSIGN_OR_RETURN(f.sources, device_array<const float*>(owned, tensors, "source table"));
  EMBER_ASSIGN_OR_RETURN(f.destinations, device_array<float*>(owned, tensors, "destination table"));
  EMBER_ASSIGN_OR_RETURN(f.residuals, device_array<float>(owned, pl.residual_arena_elements(), "residuals"));
  EMBER_ASSIGN_OR_RETURN(f.send_refs, device_array<float>(owned, pl.ref_arena_elements(), "send references"));
  EMBER_ASSIGN_OR_RETURN(f.recv_refs, device_array<float>(owned, pl.ref_arena_elements(), "recv references"));
  EMBER_ASSIGN_OR_RETURN(f.absmax_bits, device_array<std::uint32_t>(owned, 2 * pl.records().size(), "absmax"));
  EMBER_ASSIGN_OR_RETURN(f.record_done,
                         device_array<unsigned long long>(owned, pl.records().size(), "record counts"));
  EMBER_ASSIGN_OR_RETURN(f.pack_ring_base, device_array<std::uint64_t>(owned, dp.num_rings, "ring bases"));
  EMBER_ASSIGN_OR_RETURN(f.unpack_ring_base, device_array<std::uint64_t>(owned, dp.num_rings, "ring bases"));
  EMBER_ASSIGN_OR_RETURN(f.counters, device_array<kernels::StepCounters>(owned, 2, "counters"));
  EMBER_ASSIGN_OR_RETURN(f.status, device_array<StepStatus>(owned, 2, "status"));
  EMBER_ASSIGN_OR_RETURN(f.mismatches, device_array<unsigned long long>(owned, 1, "mismatch count"));
  EMBER_TRY(cuda_check(cudaDeviceSynchronize(), "GpuPacker: setup"));
  return p;
}

GpuPacker::GpuPacker(GpuPacker&& other) noexcept
    : f_(std::move(other.f_)), allocations_(std::exchange(other.allocations_, {})) {}

GpuPacker& GpuPacker::operator=(GpuPacker&& other) noexcept {
  if (this != &other) {
    release();
    f_ = std::move(other.f_);
    allocations_ = std::exchange(other.allocations_, {});
  }
  return *this;
}

GpuPacker::~GpuPacker() { release(); }

void GpuPacker::release() noexcept {
  for (void* p : allocations_) (void)cudaFree(p);
  allocations_.clear();
}

namespace {

// A pointer table to the device, complete when this returns. cudaMemcpy from
// pageable memory may return before the DMA has landed and is ordered only
// on the legacy default stream, not before a kernel on a non-blocking
// stream; so the copy goes on `stream` and that stream is waited for.
Status upload_table(void* device, const void* host, std::size_t bytes, cudaStream_t stream,
                    std::string_view what) {
  EMBER_TRY(cuda_check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream),
                       fmt::format("{}: upload", what)));
  return cuda_check(cudaStreamSynchronize(stream), fmt::format("{}: upload", what));
}

}  // namespace

Status GpuPacker::set_sources(std::span<const float* const> device_tensors, cudaStream_t stream) {
  const PackPlan& pl = *f_.plan;
  if (device_tensors.size() != pl.tensors().size()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "set_sources: got {} tensor pointers but the pack plan has {} tensors",
                      device_tensors.size(), pl.tensors().size());
  }
  for (std::size_t i = 0; i < device_tensors.size(); ++i) {
    if (device_tensors[i] == nullptr && pl.tensors()[i].num_elements > 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "set_sources: tensor {} (key {}, {} elements) is null", i, pl.tensors()[i].key,
                        pl.tensors()[i].num_elements);
    }
  }
  if (!device_tensors.empty()) {
    EMBER_TRY(upload_table(f_.sources, device_tensors.data(), device_tensors.size_bytes(), stream,
                           "set_sources"));
  }
  f_.sources_set = true;
  return ok_status();
}

Status GpuPacker::set_destinations(std::span<float* const> device_tensors, cudaStream_t stream) {
  const PackPlan& pl = *f_.plan;
  if (device_tensors.size() != pl.tensors().size()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "set_destinations: got {} tensor pointers but the pack plan has {} tensors",
                      device_tensors.size(), pl.tensors().size());
  }
  for (std::size_t i = 0; i < device_tensors.size(); ++i) {
    if (device_tensors[i] == nullptr && pl.tensors()[i].num_elements > 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "set_destinations: tensor {} (key {}, {} elements) is null", i,
                        pl.tensors()[i].key, pl.tensors()[i].num_elements);
    }
  }
  if (!device_tensors.empty()) {
    EMBER_TRY(upload_table(f_.destinations, device_tensors.data(), device_tensors.size_bytes(),
                           stream, "set_destinations"));
  }
  f_.destinations_set = true;
  return ok_status();
}

namespace {

Status check_buffer_layout(const GpuSymBuffer& buffer, const PackPlan& plan, std::string_view op) {
  const SymBufferLayout& want = plan.layout();
  const SymBufferLayout& got = buffer.layout();
  if (buffer.device_base() == nullptr || !(got == want)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{}: SymBuffer is laid out as {} channels x {} ranks x {} ring bytes, but the "
                      "pack plan needs {} x {} x {}; allocate the buffer from plan.layout()",
                      op, got.num_channels, got.num_ranks, got.ring_bytes, want.num_channels,
                      want.num_ranks, want.ring_bytes);
  }
  return ok_status();
}

}  // namespace

Status GpuPacker::pack_async(const GpuSymBuffer& buffer, cudaStream_t stream) {
  if (!f_.sources_set) {
    return make_error(ErrorCode::kInvalidArgument, "pack_async: call set_sources() first");
  }
  EMBER_TRY(check_buffer_layout(buffer, *f_.plan, "pack_async"));
  kernels::PackLaunch a;
  a.plan = f_.device_plan;
  a.buffer = buffer.device_base();
  a.sources = f_.sources;
  a.residuals = f_.residuals;
  a.send_refs = f_.send_refs;
  a.absmax_bits = f_.absmax_bits;
  a.record_done = f_.record_done;
  a.ring_base = f_.pack_ring_base;
  a.counters = &f_.counters[0];
  a.status = &f_.status[0];
  a.step = f_.pack_step;
  a.timeout_ns = static_cast<std::uint64_t>(f_.options.backpressure_timeout.count());
  EMBER_TRY(cuda_check(kernels::launch_pack(a, f_.num_blocks, stream), "pack_async: launch"));
  ++f_.pack_step;
  f_.kinds[kPack] = Fields::Pending{true, stream};
  return ok_status();
}

Status GpuPacker::unpack_async(const GpuSymBuffer& buffer, cudaStream_t stream) {
  if (!f_.destinations_set) {
    return make_error(ErrorCode::kInvalidArgument, "unpack_async: call set_destinations() first");
  }
  EMBER_TRY(check_buffer_layout(buffer, *f_.plan, "unpack_async"));
  kernels::UnpackLaunch a;
  a.plan = f_.device_plan;
  a.buffer = buffer.device_base();
  a.destinations = f_.destinations;
  a.recv_refs = f_.recv_refs;
  a.ring_base = f_.unpack_ring_base;
  a.counters = &f_.counters[1];
  a.status = &f_.status[1];
  a.step = f_.unpack_step;
  a.timeout_ns = static_cast<std::uint64_t>(f_.options.backpressure_timeout.count());
  EMBER_TRY(cuda_check(kernels::launch_unpack(a, f_.num_blocks, stream), "unpack_async: launch"));
  ++f_.unpack_step;
  f_.kinds[kUnpack] = Fields::Pending{true, stream};
  return ok_status();
}

Status GpuPacker::reset_counters(int kind, cudaStream_t stream) {
  // Only the failed kind's state: the other kind may be running on another
  // stream, and its counters are its own ([0] pack, [1] unpack; the record
  // counts and absmax words are the pack kernel's).
  EMBER_TRY(cuda_check(cudaMemsetAsync(&f_.status[kind], 0, sizeof(StepStatus), stream), "reset"));
  EMBER_TRY(cuda_check(cudaMemsetAsync(&f_.counters[kind], 0, sizeof(kernels::StepCounters), stream),
                       "reset"));
  if (kind == kPack) {
    const std::size_t records = f_.plan->records().size();
    EMBER_TRY(cuda_check(cudaMemsetAsync(f_.record_done, 0,
                                         std::max<std::size_t>(records, 1) * sizeof(unsigned long long),
                                         stream),
                         "reset"));
    EMBER_TRY(cuda_check(cudaMemsetAsync(f_.absmax_bits, 0,
                                         std::max<std::size_t>(2 * records, 1) * sizeof(std::uint32_t),
                                         stream),
                         "reset"));
  }
  EMBER_TRY(cuda_check(cudaStreamSynchronize(stream), "reset"));
  (kind == kPack ? f_.pack_step : f_.unpack_step) = 0;
  return ok_status();
}

Status GpuPacker::finish(cudaStream_t stream) {
  EMBER_TRY(cuda_check(cudaStreamSynchronize(stream), "finish: a pack/unpack kernel failed"));
  // The kinds whose last launch went on this stream (their earlier ones
  // are ordered before it). A kind running on another stream is left alone.
  bool mine[2] = {};
  for (int k : {kPack, kUnpack}) mine[k] = f_.kinds[k].pending && f_.kinds[k].stream == stream;
  if (!mine[kPack] && !mine[kUnpack]) return ok_status();
  // Read on `stream`, not the legacy default stream: a synchronous
  // cudaMemcpy would wait behind work on every blocking stream (an unpack
  // waiting for data this thread delivers after finish returns).
  StepStatus s[2] = {};
  EMBER_TRY(cuda_check(cudaMemcpyAsync(s, f_.status, sizeof s, cudaMemcpyDeviceToHost, stream),
                       "finish: status"));
  EMBER_TRY(cuda_check(cudaStreamSynchronize(stream), "finish: status"));
  std::optional<Error> first;
  for (int k : {kPack, kUnpack}) {
    if (!mine[k]) continue;
    f_.kinds[k].pending = false;
    if (s[k].code == 0) continue;
    Error e = status_to_error(s[k], *f_.plan, k == kPack ? "pack" : "unpack");
    if (Status reset = reset_counters(k, stream); !reset) {
      // The step's own failure stays the error; the reset's joins it.
      e = Error(e.code(), fmt::format("{}; resetting the counters afterwards failed too: {}",
                                      e.message(), reset.error().to_string()));
    }
    if (!first) first = std::move(e);
  }
  if (first) return tl::unexpected(std::move(*first));
  return ok_status();
}

Status GpuPacker::reset_state() {
  const PackPlan& pl = *f_.plan;
  EMBER_TRY(cuda_check(cudaMemset(f_.residuals, 0, pl.residual_arena_elements() * sizeof(float)), "reset_state"));
  EMBER_TRY(cuda_check(cudaMemset(f_.send_refs, 0, pl.ref_arena_elements() * sizeof(float)), "reset_state"));
  EMBER_TRY(cuda_check(cudaMemset(f_.recv_refs, 0, pl.ref_arena_elements() * sizeof(float)), "reset_state"));
  return cuda_check(cudaDeviceSynchronize(), "reset_state");
}

Status GpuPacker::download_state(std::vector<float>* residuals, std::vector<float>* send_refs,
                                 std::vector<float>* recv_refs) const {
  const PackPlan& pl = *f_.plan;
  const struct {
    std::vector<float>* out;
    const float* src;
    std::uint64_t n;
  } parts[] = {{residuals, f_.residuals, pl.residual_arena_elements()},
               {send_refs, f_.send_refs, pl.ref_arena_elements()},
               {recv_refs, f_.recv_refs, pl.ref_arena_elements()}};
  for (const auto& part : parts) {
    if (part.out == nullptr) continue;
    part.out->assign(part.n, 0.0f);
    if (part.n != 0) {
      EMBER_TRY(cuda_check(cudaMemcpy(part.out->data(), part.src, part.n * sizeof(float),
                                      cudaMemcpyDeviceToHost),
                           "download_state"));
    }
  }
  return ok_status();
}

Result<std::uint64_t> GpuPacker::verify_placement() {
  EMBER_TRY(cuda_check(cudaMemset(f_.mismatches, 0, sizeof(unsigned long long)), "verify_placement"));
  EMBER_TRY(cuda_check(kernels::launch_verify_placement(f_.device_plan, f_.mismatches, nullptr),
                       "verify_placement: launch"));
  unsigned long long n = 0;
  EMBER_TRY(cuda_check(cudaMemcpy(&n, f_.mismatches, sizeof n, cudaMemcpyDeviceToHost),
                       "verify_placement"));
  return static_cast<std::uint64_t>(n);
}

}  // namespace ember::gpu
