// Step status → Error; see status.h.
#include "worker/gpu/status.h"

#include <string>

#include <fmt/format.h>

namespace ember::gpu {

namespace {

Error make(const StepStatus& s, const SymBufferLayout& layout, const PackPlan* plan,
           std::string_view op) {
  const std::uint32_t channel = layout.channel_of_ring(s.ring);
  const std::uint32_t rank = layout.rank_of_ring(s.ring);
  const char* dir = s.direction == static_cast<std::uint32_t>(Direction::kSend) ? "send" : "recv";
  switch (static_cast<StepStatusCode>(s.code)) {
    case StepStatusCode::kOk:
      return Error(ErrorCode::kInternal, fmt::format("{}: status_to_error called without an error", op));
    case StepStatusCode::kSendRingFull:
      return Error(ErrorCode::kTimeout,
                   fmt::format("{}: send ring of channel {} rank {} is full: head={} tail={} "
                               "capacity={} bytes, the step needs {} free bytes; waited {} ms for "
                               "the transport to drain it (is the transport running? raise "
                               "ring_bytes or the backpressure timeout). Nothing of this step was "
                               "written",
                               op, channel, rank, s.head, s.tail, layout.ring_bytes, s.need_bytes,
                               s.waited_ms));
    case StepStatusCode::kRecvRingEmpty:
      return Error(ErrorCode::kTimeout,
                   fmt::format("{}: recv ring of channel {} rank {} holds {} of the {} bytes of "
                               "the step: head={} tail={}; waited {} ms for the reply (is the "
                               "server answering? raise the timeout). Nothing was unpacked",
                               op, channel, rank, s.tail - s.head, s.need_bytes, s.head, s.tail,
                               s.waited_ms));
    case StepStatusCode::kHeaderMismatch: {
      std::string expected = "?";
      std::uint64_t position = s.head;
      if (plan != nullptr && s.record < plan->records().size()) {
        const PlanRecord& r = plan->records()[s.record];
        expected = fmt::format("key {} chunk {} ({} elements, {})", r.key, r.chunk_index,
                               r.num_elements, codec_name(plan->groups()[r.group].codec));
        position += r.rel_pos;
      }
      std::string found =
          s.found_codec >= 0x10000
              ? fmt::format("a bad magic 0x{:04x} (not a record)", s.found_codec & 0xffffu)
              : fmt::format("key {} chunk {} ({} elements, codec {})", s.found_key, s.found_chunk,
                            s.found_elements, s.found_codec);
      return Error(ErrorCode::kProtocol,
                   fmt::format("{}: recv ring of channel {} rank {} (head={} tail={}): record "
                               "{} at position {} should be {} but holds {}; the peer's reply "
                               "does not follow this pack plan (same tensors, groups, channels "
                               "and servers on both sides?). Nothing was unpacked",
                               op, channel, rank, s.head, s.tail, s.record, position, expected,
                               found));
    }
    case StepStatusCode::kMisaligned:
      return Error(ErrorCode::kProtocol,
                   fmt::format("{}: {} ring of channel {} rank {} is at head={} tail={}, not a "
                               "multiple of 16: bytes were added or removed outside whole steps",
                               op, dir, channel, rank, s.head, s.tail));
    case StepStatusCode::kRingCorrupt:
      return Error(ErrorCode::kInternal,
                   fmt::format("{}: {} ring of channel {} rank {} has head={} tail={}: more than "
                               "its capacity of {} bytes apart; the positions were overwritten",
                               op, dir, channel, rank, s.head, s.tail, layout.ring_bytes));
    case StepStatusCode::kNoSpace:
      return Error(ErrorCode::kTooLarge,
                   fmt::format("{}: recv ring of channel {} rank {} (head={} tail={}) has no room "
                               "for the {} bytes of its send ring; unpack before the next "
                               "loopback",
                               op, channel, rank, s.head, s.tail, s.need_bytes));
  }
  return Error(ErrorCode::kInternal,
               fmt::format("{}: unknown step status code {} on {} ring of channel {} rank {}", op,
                           s.code, dir, channel, rank));
}

}  // namespace

Error status_to_error(const StepStatus& status, const PackPlan& plan, std::string_view operation) {
  return make(status, plan.layout(), &plan, operation);
}

Error status_to_error(const StepStatus& status, const SymBufferLayout& layout,
                      std::string_view operation) {
  return make(status, layout, nullptr, operation);
}

}  // namespace ember::gpu
