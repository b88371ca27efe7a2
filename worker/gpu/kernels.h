// Launchers of the SymBuffer kernels (kernels.cu): argument structs and
// launch functions, no kernel bodies, so host code compiled by g++
// (gpu_packer.cc) can call them. GpuPacker is the public API; this header is
// its internal contract with the kernels.
//
// Kernel structure (pack; unpack is the same without the absmax units): a
// grid of num_blocks blocks of kThreadsPerBlock threads (one block per
// channel: the SM budget is the channel count). Each warp claims work units
// from one counter, in order:
//   1. absmax units, one per int8 tile: the tile's |x| maximum is folded into
//      its record's slot (atomicMax on the float bits; values are ≥ 0), and
//      the record's completion count is raised (release);
//   2. check units, one per ring: lane 0 waits (bounded by timeout_ns) until
//      the ring has room for the whole step (unpack: holds the whole step and
//      every header matches the plan), stores the ring's base position and
//      raises rings_checked (release);
//   3. tile units: wait until all rings are checked (so a failed check leaves
//      every ring, tensor and state untouched) and, for int8, until the
//      record's absmax units are done; then pack (unpack) the tile.
// A warp only ever waits for units claimed before its own, by warps that are
// running, so the waits cannot deadlock whatever the number of resident
// blocks. The last block to finish publishes every ring's tail (unpack:
// head) with release semantics at system scope, and resets the claim
// counter. Completion counts are monotonic across launches (targets use the
// launch's `step`), so nothing else needs resetting between steps; after a
// failure the host resets everything (GpuPacker::finish).
//
// Work is balanced across blocks by the shared counter rather than by
// channel: placement hashes chunks to channels, so per-channel bytes are
// uneven, and the rings' positions are fixed by the plan anyway.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "worker/gpu/codec.h"
#include "worker/gpu/layout.h"
#include "worker/gpu/plan_types.h"

namespace ember::gpu::kernels {

inline constexpr std::uint32_t kThreadsPerBlock = 1024;
inline constexpr std::uint32_t kWarpSize = 32;

// Per kernel kind (pack, unpack), device memory, zero at creation.
struct StepCounters {
  unsigned long long next_unit;      // claim counter; reset to 0 by the last block
  unsigned long long rings_checked;  // monotonic: + num_rings per successful launch
  unsigned int blocks_done;          // reset to 0 by the last block
  unsigned int reserved;
};

// A plan in device memory.
struct DevicePlan {
  const PlanRecord* records = nullptr;
  const PlanTile* tiles = nullptr;
  const std::uint32_t* int8_tiles = nullptr;
  const GroupParams* groups = nullptr;
  const std::uint64_t* ring_step_bytes = nullptr;
  const std::uint32_t* ring_record_begin = nullptr;  // num_rings + 1 entries
  std::uint32_t num_records = 0;
  std::uint32_t num_tiles = 0;
  std::uint32_t num_int8_tiles = 0;
  std::uint32_t num_rings = 0;
  SymBufferLayout layout{};
};

struct PackLaunch {
  DevicePlan plan;
  std::byte* buffer = nullptr;              // SymBuffer base as the device sees it
  const float* const* sources = nullptr;    // [num_tensors] device pointers
  float* residuals = nullptr;               // error-feedback arena
  float* send_refs = nullptr;               // delta arena (sender)
  std::uint32_t* absmax_bits = nullptr;     // [2][num_records], parity = step & 1
  unsigned long long* record_done = nullptr;  // [num_records], monotonic
  std::uint64_t* ring_base = nullptr;       // [num_rings] scratch
  StepCounters* counters = nullptr;
  StepStatus* status = nullptr;
  std::uint64_t step = 0;                   // launches since the last reset
  std::uint64_t timeout_ns = 0;
};

struct UnpackLaunch {
  DevicePlan plan;
  std::byte* buffer = nullptr;
  float* const* destinations = nullptr;     // [num_tensors] device pointers
  float* recv_refs = nullptr;               // delta arena (receiver)
  std::uint64_t* ring_base = nullptr;
  StepCounters* counters = nullptr;
  StepStatus* status = nullptr;
  std::uint64_t step = 0;
  std::uint64_t timeout_ns = 0;
};

struct LoopbackLaunch {
  SymBufferLayout layout{};
  std::byte* buffer = nullptr;
  StepStatus* status = nullptr;
};

// Enqueue on `stream`; return the launch error (cudaGetLastError), never sync.
cudaError_t launch_pack(const PackLaunch& args, std::uint32_t num_blocks, cudaStream_t stream);
cudaError_t launch_unpack(const UnpackLaunch& args, std::uint32_t num_blocks, cudaStream_t stream);
// One block per ring: moves each send ring's readable bytes to its recv ring.
cudaError_t launch_loopback(const LoopbackLaunch& args, cudaStream_t stream);
// Adds to *mismatches the records whose ring differs from the one
// placement::channel_of/server_of give when computed on the device.
cudaError_t launch_verify_placement(const DevicePlan& plan, unsigned long long* mismatches,
                                    cudaStream_t stream);

}  // namespace ember::gpu::kernels
