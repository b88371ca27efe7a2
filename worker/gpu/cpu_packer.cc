// CPU reference packer; see cpu_packer.h. Walks each ring's records in
// order; every element goes through codec.h's pack_element/unpack_element,
// the same functions the kernels call, so the bits agree.
#include "worker/gpu/cpu_packer.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <thread>

#include "worker/gpu/status.h"

namespace ember::gpu {

static_assert(std::endian::native == std::endian::little,
              "records are little-endian and written with memcpy");

namespace {

using Clock = std::chrono::steady_clock;

// Copies n bytes to/from ring position `pos`, splitting at the ring's end.
void ring_write(std::byte* ring, std::uint64_t capacity, std::uint64_t pos, const void* src,
                std::uint64_t n) {
  const std::uint64_t slot = pos % capacity;
  const std::uint64_t first = std::min(n, capacity - slot);
  std::memcpy(ring + slot, src, first);
  std::memcpy(ring, static_cast<const std::byte*>(src) + first, n - first);
}

void ring_read(const std::byte* ring, std::uint64_t capacity, std::uint64_t pos, void* dst,
               std::uint64_t n) {
  const std::uint64_t slot = pos % capacity;
  const std::uint64_t first = std::min(n, capacity - slot);
  std::memcpy(dst, ring + slot, first);
  std::memcpy(static_cast<std::byte*>(dst) + first, ring, n - first);
}

// Bounded wait of one step: true as soon as ready() holds, false once the
// step's deadline (its start + backpressure_timeout, shared by every ring it
// waits for) has passed without it; then *waited_ms says how long the step
// has waited since `start`.
template <typename Ready>
bool wait_until(Ready&& ready, Clock::time_point start, std::chrono::nanoseconds timeout,
                std::uint32_t* waited_ms) {
  for (;;) {
    if (ready()) return true;
    const Clock::duration waited = Clock::now() - start;
    if (waited >= timeout) {
      *waited_ms = static_cast<std::uint32_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(waited).count());
      return false;
    }
    std::this_thread::yield();
  }
}

// One record: header, payload (at most two contiguous segments, split at
// an element boundary because the payload starts 16-byte aligned and the
// capacity is a multiple of 128), zero padding.
template <Codec C, bool kDelta, bool kEf>
void pack_record(const PlanRecord& r, float prescale, const float* src, float* res, float* ref,
                 std::byte* ring, std::uint64_t capacity, std::uint64_t pos) {
  constexpr std::uint64_t kElementBytes = codec_element_bytes(C);
  const std::uint64_t n = r.num_elements;
  float scale = 0.0f;
  if constexpr (C == Codec::kInt8) {
    float absmax = 0.0f;
    for (std::uint64_t i = 0; i < n; ++i) {
      absmax = max_ignore_nan(absmax, absmax_input<kDelta, kEf>(src[i], kEf ? res[i] : 0.0f,
                                                               kDelta ? ref[i] : 0.0f, prescale));
    }
    scale = int8_scale_from_absmax(absmax);
  }
  PackedChunkHeader h{};
  h.key = r.key;
  h.elem_offset = r.elem_offset;
  h.chunk_index = r.chunk_index;
  h.num_elements = r.num_elements;
  h.scale = C == Codec::kInt8 ? scale : 1.0f;
  h.codec = static_cast<std::uint8_t>(C);
  h.flags = kDelta ? kRecordFlagDelta : 0;
  h.magic = kRecordMagic;
  ring_write(ring, capacity, pos, &h, sizeof h);

  std::uint64_t slot = (pos + kRecordHeaderBytes) % capacity;
  std::uint64_t i = 0;
  while (i < n) {
    const std::uint64_t end = std::min(n, i + (capacity - slot) / kElementBytes);
    std::byte* out = ring + slot;
    if (C == Codec::kFp32 && !kDelta && !kEf && prescale == 1.0f) {
      // pack_element is the identity here: the same bits, copied at once.
      std::memcpy(out, src + i, (end - i) * kElementBytes);
      i = end;
    }
    for (; i < end; ++i, out += kElementBytes) {
      const PackedElement p = pack_element<C, kDelta, kEf>(src[i], kEf ? res[i] : 0.0f,
                                                           kDelta ? ref[i] : 0.0f, prescale, scale);
      std::memcpy(out, &p.bits, kElementBytes);
      if constexpr (kEf) res[i] = p.residual;
      if constexpr (kDelta) ref[i] = p.ref;
    }
    slot = 0;
  }
  const std::uint64_t payload_end = kRecordHeaderBytes + n * kElementBytes;
  const std::byte zeros[kRecordAlignBytes] = {};
  ring_write(ring, capacity, pos + payload_end, zeros, record_bytes(n, C) - payload_end);
}

template <Codec C, bool kDelta>
void unpack_record(const PlanRecord& r, float* dst, float* ref, const std::byte* ring,
                   std::uint64_t capacity, std::uint64_t pos) {
  constexpr std::uint64_t kElementBytes = codec_element_bytes(C);
  PackedChunkHeader h;
  ring_read(ring, capacity, pos, &h, sizeof h);
  const float scale = h.scale;
  const std::uint64_t n = r.num_elements;
  std::uint64_t slot = (pos + kRecordHeaderBytes) % capacity;
  std::uint64_t i = 0;
  while (i < n) {
    const std::uint64_t end = std::min(n, i + (capacity - slot) / kElementBytes);
    const std::byte* in = ring + slot;
    if (C == Codec::kFp32 && !kDelta) {
      std::memcpy(dst + i, in, (end - i) * kElementBytes);  // unpack_element is the identity
      i = end;
    }
    for (; i < end; ++i, in += kElementBytes) {
      std::uint32_t bits = 0;
      std::memcpy(&bits, in, kElementBytes);
      const float out = unpack_element<C, kDelta>(bits, kDelta ? ref[i] : 0.0f, scale);
      dst[i] = out;
      if constexpr (kDelta) ref[i] = out;
    }
    slot = 0;
  }
}

using PackFn = void (*)(const PlanRecord&, float, const float*, float*, float*, std::byte*,
                        std::uint64_t, std::uint64_t);
using UnpackFn = void (*)(const PlanRecord&, float*, float*, const std::byte*, std::uint64_t,
                          std::uint64_t);

template <Codec C>
PackFn pack_fn(const GroupParams& g) {
  if (g.delta) return g.error_feedback ? &pack_record<C, true, true> : &pack_record<C, true, false>;
  return g.error_feedback ? &pack_record<C, false, true> : &pack_record<C, false, false>;
}

PackFn pack_fn(const GroupParams& g) {
  switch (g.codec) {
    case Codec::kFp32: return pack_fn<Codec::kFp32>(g);
    case Codec::kBf16: return pack_fn<Codec::kBf16>(g);
    case Codec::kFp16: return pack_fn<Codec::kFp16>(g);
    case Codec::kInt8: return pack_fn<Codec::kInt8>(g);
  }
  return nullptr;
}

template <Codec C>
UnpackFn unpack_fn(const GroupParams& g) {
  return g.delta ? &unpack_record<C, true> : &unpack_record<C, false>;
}

UnpackFn unpack_fn(const GroupParams& g) {
  switch (g.codec) {
    case Codec::kFp32: return unpack_fn<Codec::kFp32>(g);
    case Codec::kBf16: return unpack_fn<Codec::kBf16>(g);
    case Codec::kFp16: return unpack_fn<Codec::kFp16>(g);
    case Codec::kInt8: return unpack_fn<Codec::kInt8>(g);
  }
  return nullptr;
}

StepStatus ring_status(StepStatusCode code, std::uint64_t ring, Direction d, std::uint64_t head,
                       std::uint64_t tail, std::uint64_t need) {
  StepStatus s{};
  s.code = static_cast<std::uint32_t>(code);
  s.ring = static_cast<std::uint32_t>(ring);
  s.direction = static_cast<std::uint32_t>(d);
  s.head = head;
  s.tail = tail;
  s.need_bytes = need;
  return s;
}

}  // namespace

Result<CpuPacker> CpuPacker::create(std::shared_ptr<const PackPlan> plan,
                                    const CpuPackerOptions& options) {
  if (plan == nullptr) {
    return make_error(ErrorCode::kInvalidArgument, "CpuPacker: no pack plan given");
  }
  if (options.backpressure_timeout.count() < 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "CpuPacker: backpressure_timeout {} ns is negative",
                      options.backpressure_timeout.count());
  }
  CpuPacker p;
  p.options_ = options;
  p.residuals_.assign(plan->residual_arena_elements(), 0.0f);
  p.send_refs_.assign(plan->ref_arena_elements(), 0.0f);
  p.recv_refs_.assign(plan->ref_arena_elements(), 0.0f);
  p.bases_.assign(plan->layout().num_rings(), 0);
  p.plan_ = std::move(plan);
  return p;
}

void CpuPacker::reset_state() {
  std::fill(residuals_.begin(), residuals_.end(), 0.0f);
  std::fill(send_refs_.begin(), send_refs_.end(), 0.0f);
  std::fill(recv_refs_.begin(), recv_refs_.end(), 0.0f);
}

Status CpuPacker::check_buffer(const SymBufferView& buffer, std::size_t num_tensors) const {
  const SymBufferLayout& want = plan_->layout();
  if (buffer.base == nullptr || !(buffer.layout == want)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "SymBuffer is laid out as {} channels x {} ranks x {} ring bytes (base {}), "
                      "but the pack plan needs {} x {} x {}; allocate the buffer from "
                      "plan.layout()",
                      buffer.layout.num_channels, buffer.layout.num_ranks, buffer.layout.ring_bytes,
                      static_cast<const void*>(buffer.base), want.num_channels, want.num_ranks,
                      want.ring_bytes);
  }
  if (num_tensors != plan_->tensors().size()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "got {} tensor pointers but the pack plan has {} tensors", num_tensors,
                      plan_->tensors().size());
  }
  return ok_status();
}

Status CpuPacker::pack(std::span<const float* const> sources, const SymBufferView& buffer) {
  EMBER_TRY(check_buffer(buffer, sources.size()));
  const PackPlan& plan = *plan_;
  for (std::size_t i = 0; i < sources.size(); ++i) {
    if (sources[i] == nullptr && plan.tensors()[i].num_elements > 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "pack: source of tensor {} (key {}, {} elements) is null", i,
                        plan.tensors()[i].key, plan.tensors()[i].num_elements);
    }
  }
  const SymBufferLayout& layout = plan.layout();
  const std::uint64_t capacity = layout.ring_bytes;

  // 1. Room for the whole step in every ring, before anything is written.
  // One timeout for the step, not one per ring (as the kernel's rings wait
  // side by side).
  const Clock::time_point start = Clock::now();
  for (std::uint64_t ring = 0; ring < layout.num_rings(); ++ring) {
    ChannelMeta* meta = layout.meta(buffer.base, ring, Direction::kSend);
    const std::uint64_t tail = load_position_acquire(meta->tail);
    std::uint64_t head = load_position_acquire(meta->head);
    const std::uint64_t need = plan.ring_step_bytes()[ring];
    if (tail % kRecordAlignBytes != 0) {
      return tl::unexpected(status_to_error(
          ring_status(StepStatusCode::kMisaligned, ring, Direction::kSend, head, tail, need), plan,
          "pack"));
    }
    if (tail - head > capacity) {
      return tl::unexpected(status_to_error(
          ring_status(StepStatusCode::kRingCorrupt, ring, Direction::kSend, head, tail, need), plan,
          "pack"));
    }
    std::uint32_t waited_ms = 0;
    const bool ok = wait_until(
        [&] {
          head = load_position_acquire(meta->head);
          return capacity - (tail - head) >= need;
        },
        start, options_.backpressure_timeout, &waited_ms);
    if (!ok) {
      StepStatus s = ring_status(StepStatusCode::kSendRingFull, ring, Direction::kSend, head, tail, need);
      s.waited_ms = waited_ms;
      return tl::unexpected(status_to_error(s, plan, "pack"));
    }
    bases_[ring] = tail;
  }

  // 2. Every record, ring by ring.
  const std::span<const PlanRecord> records = plan.records();
  for (const PlanRecord& r : records) {
    const GroupParams& g = plan.groups()[r.group];
    const float* src = sources[r.tensor] == nullptr ? nullptr : sources[r.tensor] + r.elem_offset;
    float* res = g.error_feedback ? residuals_.data() + r.residual_offset : nullptr;
    float* ref = g.delta ? send_refs_.data() + r.ref_offset : nullptr;
    pack_fn(g)(r, g.prescale, src, res, ref, layout.data(buffer.base, r.ring, Direction::kSend),
               capacity, bases_[r.ring] + r.rel_pos);
  }

  // 3. Publish.
  for (std::uint64_t ring = 0; ring < layout.num_rings(); ++ring) {
    const std::uint64_t step = plan.ring_step_bytes()[ring];
    if (step != 0) {
      store_position_release(layout.meta(buffer.base, ring, Direction::kSend)->tail,
                             bases_[ring] + step);
    }
  }
  return ok_status();
}

Status CpuPacker::unpack(std::span<float* const> destinations, const SymBufferView& buffer) {
  EMBER_TRY(check_buffer(buffer, destinations.size()));
  const PackPlan& plan = *plan_;
  for (std::size_t i = 0; i < destinations.size(); ++i) {
    if (destinations[i] == nullptr && plan.tensors()[i].num_elements > 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "unpack: destination of tensor {} (key {}, {} elements) is null", i,
                        plan.tensors()[i].key, plan.tensors()[i].num_elements);
    }
  }
  const SymBufferLayout& layout = plan.layout();
  const std::uint64_t capacity = layout.ring_bytes;

  // 1. A whole step in every ring, and every header as the plan says. One
  // timeout for the step, as in pack.
  const Clock::time_point start = Clock::now();
  for (std::uint64_t ring = 0; ring < layout.num_rings(); ++ring) {
    ChannelMeta* meta = layout.meta(buffer.base, ring, Direction::kRecv);
    const std::uint64_t head = load_position_acquire(meta->head);
    std::uint64_t tail = load_position_acquire(meta->tail);
    const std::uint64_t need = plan.ring_step_bytes()[ring];
    if (head % kRecordAlignBytes != 0) {
      return tl::unexpected(status_to_error(
          ring_status(StepStatusCode::kMisaligned, ring, Direction::kRecv, head, tail, need), plan,
          "unpack"));
    }
    if (tail - head > capacity) {
      return tl::unexpected(status_to_error(
          ring_status(StepStatusCode::kRingCorrupt, ring, Direction::kRecv, head, tail, need), plan,
          "unpack"));
    }
    std::uint32_t waited_ms = 0;
    const bool ok = wait_until(
        [&] {
          tail = load_position_acquire(meta->tail);
          return tail - head >= need;
        },
        start, options_.backpressure_timeout, &waited_ms);
    if (!ok) {
      StepStatus s = ring_status(StepStatusCode::kRecvRingEmpty, ring, Direction::kRecv, head, tail, need);
      s.waited_ms = waited_ms;
      return tl::unexpected(status_to_error(s, plan, "unpack"));
    }
    bases_[ring] = head;
    const std::byte* data = layout.data(buffer.base, ring, Direction::kRecv);
    for (std::uint32_t ri = plan.ring_record_begin()[ring]; ri < plan.ring_record_begin()[ring + 1];
         ++ri) {
      const PlanRecord& r = plan.records()[ri];
      const GroupParams& g = plan.groups()[r.group];
      PackedChunkHeader h;
      ring_read(data, capacity, head + r.rel_pos, &h, sizeof h);
      if (!header_is(h, r.key, r.chunk_index, r.elem_offset, r.num_elements, g.codec, g.delta != 0)) {
        StepStatus s = ring_status(StepStatusCode::kHeaderMismatch, ring, Direction::kRecv, head,
                                   tail, need);
        s.record = ri;
        s.found_key = h.key;
        s.found_chunk = h.chunk_index;
        s.found_elements = h.num_elements;
        s.found_codec = header_found_codec(h);
        return tl::unexpected(status_to_error(s, plan, "unpack"));
      }
    }
  }

  // 2. Decode.
  for (const PlanRecord& r : plan.records()) {
    const GroupParams& g = plan.groups()[r.group];
    float* dst = destinations[r.tensor] == nullptr ? nullptr : destinations[r.tensor] + r.elem_offset;
    float* ref = g.delta ? recv_refs_.data() + r.ref_offset : nullptr;
    unpack_fn(g)(r, dst, ref, layout.data(buffer.base, r.ring, Direction::kRecv), capacity,
                 bases_[r.ring] + r.rel_pos);
  }

  // 3. Free the bytes.
  for (std::uint64_t ring = 0; ring < layout.num_rings(); ++ring) {
    const std::uint64_t step = plan.ring_step_bytes()[ring];
    if (step != 0) {
      store_position_release(layout.meta(buffer.base, ring, Direction::kRecv)->head,
                             bases_[ring] + step);
    }
  }
  return ok_status();
}

}  // namespace ember::gpu
