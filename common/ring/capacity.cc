#include "common/ring/capacity.h"

#include <bit>
#include <limits>

namespace ember::ring {

Status validate_ring_slots(std::size_t num_slots, std::size_t slot_bytes, std::string_view what) {
  if (num_slots == 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{} must be a power of two between 1 and {} slots (got 0)", what,
                      kMaxRingSlots);
  }
  if (num_slots > kMaxRingSlots) {
    return make_error(ErrorCode::kTooLarge, "{} of {} slots exceeds the maximum of {} slots", what,
                      num_slots, kMaxRingSlots);
  }
  if (!std::has_single_bit(num_slots)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{} must be a power of two (got {} slots); use {} instead", what, num_slots,
                      std::bit_ceil(num_slots));
  }
  if (slot_bytes != 0 && num_slots > kMaxRingBytes / slot_bytes) {
    return make_error(ErrorCode::kTooLarge,
                      "{} of {} slots x {} bytes per slot exceeds the {}-byte limit of one ring; "
                      "use fewer slots or a smaller element (e.g. a pointer to the payload)",
                      what, num_slots, slot_bytes, kMaxRingBytes);
  }
  return ok_status();
}

}  // namespace ember::ring
