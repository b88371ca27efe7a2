// SymBuffer kernels: pack, unpack, loopback, placement self-check. The work
// split and the synchronisation live here; the per-tile arithmetic and ring
// addressing are tile_ops.h (shared with the host emulation the CPU tests
// run), the layout is layout.h. See kernels.h for the structure.
#include "worker/gpu/kernels.h"

#include <cuda/atomic>

#include "common/placement/placement.h"
#include "worker/gpu/tile_ops.h"

namespace ember::gpu::kernels {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kThreadsPerBlock % kWarpSize == 0);

using SysPosition = cuda::atomic_ref<std::uint64_t, cuda::thread_scope_system>;
using DevCount = cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>;
using DevWord = cuda::atomic_ref<std::uint32_t, cuda::thread_scope_device>;

__device__ std::uint64_t global_timer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Ring positions are shared with host threads (pinned host buffers) and
// other kernels: system scope. Acquire pairs with the other side's release.
__device__ std::uint64_t load_position(std::uint64_t& p) {
  return SysPosition(p).load(cuda::memory_order_acquire);
}
__device__ void publish_position(std::uint64_t& p, std::uint64_t v) {
  SysPosition(p).store(v, cuda::memory_order_release);
}

__device__ bool aborted(StepStatus* s) {
  return DevWord(s->code).load(cuda::memory_order_relaxed) != 0;
}

// Records the step's first failure; later ones are dropped.
__device__ void report(StepStatus* s, const StepStatus& v) {
  std::uint32_t expected = 0;
  if (DevWord(s->code).compare_exchange_strong(expected, v.code, cuda::memory_order_relaxed)) {
    s->ring = v.ring;
    s->direction = v.direction;
    s->record = v.record;
    s->head = v.head;
    s->tail = v.tail;
    s->need_bytes = v.need_bytes;
    s->found_key = v.found_key;
    s->found_chunk = v.found_chunk;
    s->found_elements = v.found_elements;
    s->found_codec = v.found_codec;
    s->waited_ms = v.waited_ms;
  }
}

__device__ StepStatus ring_status(StepStatusCode code, std::uint32_t ring, Direction d,
                                  std::uint64_t head, std::uint64_t tail, std::uint64_t need) {
  StepStatus s{};
  s.code = static_cast<std::uint32_t>(code);
  s.ring = ring;
  s.direction = static_cast<std::uint32_t>(d);
  s.head = head;
  s.tail = tail;
  s.need_bytes = need;
  return s;
}

// Lane 0 waits until *counter ≥ target (a count other warps raise with
// release); then every lane acquires it, so each lane's later loads see what
// the raisers wrote. False when the step was aborted meanwhile.
__device__ bool wait_count(unsigned long long& counter, unsigned long long target,
                           StepStatus* status, std::uint32_t lane) {
  bool ok = true;
  if (lane == 0) {
    while (DevCount(counter).load(cuda::memory_order_acquire) < target) {
      if (aborted(status)) {
        ok = false;
        break;
      }
      __nanosleep(64);
    }
  }
  ok = __shfl_sync(kFullMask, ok, 0);
  if (ok) (void)DevCount(counter).load(cuda::memory_order_acquire);
  return ok;
}

// Claims the warp's next unit (num_units when none is left or the step is
// aborted).
__device__ unsigned long long claim(StepCounters* c, StepStatus* status,
                                    unsigned long long num_units, std::uint32_t lane) {
  unsigned long long unit = num_units;
  if (lane == 0 && !aborted(status)) {
    unit = atomicAdd(&c->next_unit, 1ull);
  }
  return __shfl_sync(kFullMask, unit, 0);
}

// ---------------------------------------------------------------------------
// Pack.

__device__ void pack_absmax_unit(const PackLaunch& a, std::uint32_t tile_index,
                                 std::uint32_t lane) {
  const DevicePlan& p = a.plan;
  const PlanTile tile = p.tiles[tile_index];
  const PlanRecord& rec = p.records[tile.record];
  const GroupParams g = p.groups[rec.group];
  const PackTileArgs args = make_pack_tile_args(rec, tile, g, nullptr, 0, 0, a.sources[rec.tensor],
                                                a.residuals, a.send_refs, 0.0f);
  float m = absmax_tile(args, g, lane, kWarpSize);
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    m = max_ignore_nan(m, __shfl_xor_sync(kFullMask, m, offset));
  }
  if (lane == 0) {
    const std::uint32_t parity = static_cast<std::uint32_t>(a.step & 1);
    atomicMax(&a.absmax_bits[parity * p.num_records + tile.record], float_bits(m));
    if ((tile.flags & kTileFirst) != 0) {
      // The other parity's slot is next step's: nobody reads it in this launch.
      a.absmax_bits[(parity ^ 1u) * p.num_records + tile.record] = 0;
    }
    DevCount(a.record_done[tile.record]).fetch_add(1ull, cuda::memory_order_release);
  }
}

// Lane 0 only: room for the whole step in one send ring (bounded wait).
__device__ void pack_check_unit(const PackLaunch& a, std::uint32_t ring) {
  const DevicePlan& p = a.plan;
  ChannelMeta* m = p.layout.meta(a.buffer, ring, Direction::kSend);
  const std::uint64_t capacity = p.layout.ring_bytes;
  const std::uint64_t need = p.ring_step_bytes[ring];
  const std::uint64_t tail = load_position(m->tail);
  std::uint64_t head = load_position(m->head);
  if (tail % kRecordAlignBytes != 0) {
    report(a.status, ring_status(StepStatusCode::kMisaligned, ring, Direction::kSend, head, tail, need));
    return;
  }
  if (tail - head > capacity) {
    report(a.status, ring_status(StepStatusCode::kRingCorrupt, ring, Direction::kSend, head, tail, need));
    return;
  }
  std::uint64_t start = 0;
  while (capacity - (tail - head) < need) {
    const std::uint64_t now = global_timer_ns();
    if (start == 0) start = now;
    if (aborted(a.status)) return;
    if (now - start >= a.timeout_ns) {
      StepStatus s = ring_status(StepStatusCode::kSendRingFull, ring, Direction::kSend, head, tail, need);
      s.waited_ms = static_cast<std::uint32_t>((now - start) / 1000000u);
      report(a.status, s);
      return;
    }
    __nanosleep(1000);
    head = load_position(m->head);
  }
  a.ring_base[ring] = tail;
  DevCount(a.counters->rings_checked).fetch_add(1ull, cuda::memory_order_release);
}

__device__ bool pack_tile_unit(const PackLaunch& a, std::uint32_t tile_index, std::uint32_t lane) {
  const DevicePlan& p = a.plan;
  const PlanTile tile = p.tiles[tile_index];
  const PlanRecord& rec = p.records[tile.record];
  const GroupParams g = p.groups[rec.group];
  float scale = 0.0f;
  if (g.codec == Codec::kInt8) {
    const unsigned long long target = (a.step + 1) * record_num_tiles(rec.num_elements);
    if (!wait_count(a.record_done[tile.record], target, a.status, lane)) return false;
    const std::uint32_t parity = static_cast<std::uint32_t>(a.step & 1);
    scale = int8_scale_from_absmax(bits_float(
        DevWord(a.absmax_bits[parity * p.num_records + tile.record]).load(cuda::memory_order_relaxed)));
  }
  const PackTileArgs args = make_pack_tile_args(
      rec, tile, g, p.layout.data(a.buffer, rec.ring, Direction::kSend), p.layout.ring_bytes,
      a.ring_base[rec.ring], a.sources[rec.tensor], a.residuals, a.send_refs, scale);
  pack_tile(args, g, lane, kWarpSize);
  return true;
}

// Counts this block as done; true in the last block to finish, after which
// every block's writes are visible to it (threadFenceReduction pattern:
// every thread fences its ring and state writes, one thread counts; the last
// block fences again before it publishes positions).
__device__ bool last_block_done(StepCounters* c) {
  __shared__ bool last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(&c->blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (last) __threadfence_system();
  return last;
}

__device__ void reset_claims(StepCounters* c) {
  __syncthreads();
  if (threadIdx.x == 0) {
    c->next_unit = 0;
    c->blocks_done = 0;
    __threadfence();
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) pack_kernel(const PackLaunch a) {
  const DevicePlan& p = a.plan;
  const std::uint32_t lane = threadIdx.x % kWarpSize;
  const unsigned long long num_units =
      static_cast<unsigned long long>(p.num_int8_tiles) + p.num_rings + p.num_tiles;
  bool rings_ready = false;
  for (;;) {
    unsigned long long unit = claim(a.counters, a.status, num_units, lane);
    if (unit >= num_units) break;
    if (unit < p.num_int8_tiles) {
      pack_absmax_unit(a, p.int8_tiles[unit], lane);
      continue;
    }
    unit -= p.num_int8_tiles;
    if (unit < p.num_rings) {
      if (lane == 0) pack_check_unit(a, static_cast<std::uint32_t>(unit));
      __syncwarp();
      continue;
    }
    unit -= p.num_rings;
    if (!rings_ready) {
      const unsigned long long target = (a.step + 1) * p.num_rings;
      if (!wait_count(a.counters->rings_checked, target, a.status, lane)) break;
      rings_ready = true;
    }
    if (!pack_tile_unit(a, static_cast<std::uint32_t>(unit), lane)) break;
  }
  if (!last_block_done(a.counters)) return;
  if (!aborted(a.status)) {
    for (std::uint32_t ring = threadIdx.x; ring < p.num_rings; ring += blockDim.x) {
      const std::uint64_t step = p.ring_step_bytes[ring];
      if (step != 0) {
        publish_position(p.layout.meta(a.buffer, ring, Direction::kSend)->tail, a.ring_base[ring] + step);
      }
    }
  }
  reset_claims(a.counters);
}

// ---------------------------------------------------------------------------
// Unpack.

// Whole warp: a whole step of data in one recv ring, every header as the
// plan says. False when the step fails or was aborted.
__device__ bool unpack_check_unit(const UnpackLaunch& a, std::uint32_t ring, std::uint32_t lane) {
  const DevicePlan& p = a.plan;
  ChannelMeta* m = p.layout.meta(a.buffer, ring, Direction::kRecv);
  const std::uint64_t capacity = p.layout.ring_bytes;
  const std::uint64_t need = p.ring_step_bytes[ring];
  std::uint64_t head = 0;
  std::uint64_t tail = 0;
  bool ok = true;
  if (lane == 0) {
    head = load_position(m->head);
    tail = load_position(m->tail);
    if (head % kRecordAlignBytes != 0) {
      report(a.status, ring_status(StepStatusCode::kMisaligned, ring, Direction::kRecv, head, tail, need));
      ok = false;
    } else if (tail - head > capacity) {
      report(a.status, ring_status(StepStatusCode::kRingCorrupt, ring, Direction::kRecv, head, tail, need));
      ok = false;
    } else {
      std::uint64_t start = 0;
      while (tail - head < need) {
        const std::uint64_t now = global_timer_ns();
        if (start == 0) start = now;
        if (aborted(a.status)) {
          ok = false;
          break;
        }
        if (now - start >= a.timeout_ns) {
          StepStatus s = ring_status(StepStatusCode::kRecvRingEmpty, ring, Direction::kRecv, head, tail, need);
          s.waited_ms = static_cast<std::uint32_t>((now - start) / 1000000u);
          report(a.status, s);
          ok = false;
          break;
        }
        __nanosleep(1000);
        tail = load_position(m->tail);
      }
    }
  }
  ok = __shfl_sync(kFullMask, ok, 0);
  if (!ok) return false;
  head = __shfl_sync(kFullMask, head, 0);
  tail = __shfl_sync(kFullMask, tail, 0);
  (void)load_position(m->tail);  // each lane acquires before reading headers
  const std::byte* data = p.layout.data(a.buffer, ring, Direction::kRecv);
  bool bad = false;
  const std::uint32_t end = p.ring_record_begin[ring + 1];
  for (std::uint32_t ri = p.ring_record_begin[ring] + lane; ri < end && !bad; ri += kWarpSize) {
    const PlanRecord& rec = p.records[ri];
    const PackedChunkHeader h = read_header(data, capacity, head + rec.rel_pos);
    if (!header_matches(h, rec, p.groups[rec.group])) {
      StepStatus s = ring_status(StepStatusCode::kHeaderMismatch, ring, Direction::kRecv, head, tail, need);
      s.record = ri;
      s.found_key = h.key;
      s.found_chunk = h.chunk_index;
      s.found_elements = h.num_elements;
      s.found_codec = header_found_codec(h);
      report(a.status, s);
      bad = true;
    }
  }
  if (__any_sync(kFullMask, bad)) return false;
  if (lane == 0) {
    a.ring_base[ring] = head;
    DevCount(a.counters->rings_checked).fetch_add(1ull, cuda::memory_order_release);
  }
  return true;
}

__global__ void __launch_bounds__(kThreadsPerBlock, 1) unpack_kernel(const UnpackLaunch a) {
  const DevicePlan& p = a.plan;
  const std::uint32_t lane = threadIdx.x % kWarpSize;
  const unsigned long long num_units = static_cast<unsigned long long>(p.num_rings) + p.num_tiles;
  bool rings_ready = false;
  for (;;) {
    unsigned long long unit = claim(a.counters, a.status, num_units, lane);
    if (unit >= num_units) break;
    if (unit < p.num_rings) {
      if (!unpack_check_unit(a, static_cast<std::uint32_t>(unit), lane)) break;
      continue;
    }
    unit -= p.num_rings;
    if (!rings_ready) {
      const unsigned long long target = (a.step + 1) * p.num_rings;
      if (!wait_count(a.counters->rings_checked, target, a.status, lane)) break;
      rings_ready = true;
    }
    const PlanTile tile = p.tiles[unit];
    const PlanRecord& rec = p.records[tile.record];
    const GroupParams g = p.groups[rec.group];
    const UnpackTileArgs args = make_unpack_tile_args(
        rec, tile, g, p.layout.data(a.buffer, rec.ring, Direction::kRecv), p.layout.ring_bytes,
        a.ring_base[rec.ring], a.destinations[rec.tensor], a.recv_refs);
    unpack_tile(args, g, lane, kWarpSize);
  }
  if (!last_block_done(a.counters)) return;
  if (!aborted(a.status)) {
    for (std::uint32_t ring = threadIdx.x; ring < p.num_rings; ring += blockDim.x) {
      const std::uint64_t step = p.ring_step_bytes[ring];
      if (step != 0) {
        publish_position(p.layout.meta(a.buffer, ring, Direction::kRecv)->head, a.ring_base[ring] + step);
      }
    }
  }
  reset_claims(a.counters);
}

// ---------------------------------------------------------------------------
// Loopback (tests and benchmarks: a server that echoes).

constexpr std::uint32_t kLoopbackThreads = 256;

__global__ void __launch_bounds__(kLoopbackThreads) loopback_kernel(const LoopbackLaunch a) {
  const std::uint32_t ring = blockIdx.x;
  ChannelMeta* send = a.layout.meta(a.buffer, ring, Direction::kSend);
  ChannelMeta* recv = a.layout.meta(a.buffer, ring, Direction::kRecv);
  const std::uint64_t capacity = a.layout.ring_bytes;
  __shared__ std::uint64_t s_from, s_to, s_bytes;
  __shared__ bool s_ok;
  if (threadIdx.x == 0) {
    const std::uint64_t send_head = load_position(send->head);
    const std::uint64_t send_tail = load_position(send->tail);
    const std::uint64_t recv_head = load_position(recv->head);
    const std::uint64_t recv_tail = load_position(recv->tail);
    const std::uint64_t bytes = send_tail - send_head;
    s_ok = false;
    // Each ring's own positions are reported (the host loopback's RingView
    // stops on the same cases with EMBER_CHECK); a ring holding more than its
    // capacity is corrupt (the free-space subtraction below would wrap).
    if ((send_head | send_tail) % kRecordAlignBytes != 0) {
      report(a.status, ring_status(StepStatusCode::kMisaligned, ring, Direction::kSend, send_head,
                                   send_tail, bytes));
    } else if (bytes > capacity) {
      report(a.status, ring_status(StepStatusCode::kRingCorrupt, ring, Direction::kSend, send_head,
                                   send_tail, bytes));
    } else if (recv_tail % kRecordAlignBytes != 0) {
      report(a.status, ring_status(StepStatusCode::kMisaligned, ring, Direction::kRecv, recv_head,
                                   recv_tail, bytes));
    } else if (recv_tail - recv_head > capacity) {
      report(a.status, ring_status(StepStatusCode::kRingCorrupt, ring, Direction::kRecv, recv_head,
                                   recv_tail, bytes));
    } else if (capacity - (recv_tail - recv_head) < bytes) {
      report(a.status, ring_status(StepStatusCode::kNoSpace, ring, Direction::kRecv, recv_head,
                                   recv_tail, bytes));
    } else {
      s_ok = true;
    }
    s_from = send_head;
    s_to = recv_tail;
    s_bytes = bytes;
  }
  __syncthreads();
  if (!s_ok) return;
  (void)load_position(send->tail);  // each thread acquires before reading the bytes
  const std::byte* src = a.layout.data(a.buffer, ring, Direction::kSend);
  std::byte* dst = a.layout.data(a.buffer, ring, Direction::kRecv);
  for (std::uint64_t off = std::uint64_t{threadIdx.x} * 16; off < s_bytes; off += kLoopbackThreads * 16) {
    const U32x4 v = load_u32x4(src + (s_from + off) % capacity);
    store_u32x4(dst + (s_to + off) % capacity, v.x, v.y, v.z, v.w);
  }
  __threadfence_system();  // this thread's copies before the positions (below)
  __syncthreads();
  if (threadIdx.x == 0) {
    publish_position(recv->tail, s_to + s_bytes);
    publish_position(send->head, s_from + s_bytes);
  }
}

// ---------------------------------------------------------------------------
// Placement self-check.

__global__ void verify_placement_kernel(const DevicePlan p, unsigned long long* mismatches) {
  for (std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.num_records;
       i += gridDim.x * blockDim.x) {
    const PlanRecord& r = p.records[i];
    const std::uint32_t channel = placement::channel_of(r.key, r.chunk_index, p.layout.num_channels);
    const std::uint32_t server = placement::server_of(r.key, r.chunk_index, p.layout.num_ranks);
    if (p.layout.ring_index(channel, server) != r.ring) atomicAdd(mismatches, 1ull);
  }
}

}  // namespace

cudaError_t launch_pack(const PackLaunch& args, std::uint32_t num_blocks, cudaStream_t stream) {
  pack_kernel<<<num_blocks, kThreadsPerBlock, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_unpack(const UnpackLaunch& args, std::uint32_t num_blocks, cudaStream_t stream) {
  unpack_kernel<<<num_blocks, kThreadsPerBlock, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_loopback(const LoopbackLaunch& args, cudaStream_t stream) {
  const auto rings = static_cast<std::uint32_t>(args.layout.num_rings());
  loopback_kernel<<<rings, kLoopbackThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_verify_placement(const DevicePlan& plan, unsigned long long* mismatches,
                                    cudaStream_t stream) {
  const std::uint32_t blocks = plan.num_records == 0 ? 1 : (plan.num_records + 255) / 256;
  verify_placement_kernel<<<blocks < 1024 ? blocks : 1024, 256, 0, stream>>>(plan, mismatches);
  return cudaGetLastError();
}

}  // namespace ember::gpu::kernels
