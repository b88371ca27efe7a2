// Shared vocabulary of the rings: slot-count validation and the push hook
// policy.
//
// Every ring in ember::ring has a power-of-two slot count (positions are
// masked, never divided) in [1, kMaxRingSlots], and its slot array must fit
// in kMaxRingBytes. validate_ring_slots() is the one place those rules live;
// the factories (SpscRing::create, MpscRing::create) return its Error, the
// constructors EMBER_CHECK it (a bad count reaching a constructor is a bug).
//
// Thread-safety: pure functions and stateless types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/base/error.h"

namespace ember::ring {

// Largest slot count of one ring (or one MPSC lane): 2^30 slots.
inline constexpr std::size_t kMaxRingSlots = std::size_t{1} << 30;
// Largest slot array of one ring (or one MPSC lane): 16 GiB.
inline constexpr std::size_t kMaxRingBytes = std::size_t{1} << 34;

// Checks that `num_slots` is a power of two in [1, kMaxRingSlots] and that
// num_slots * slot_bytes <= kMaxRingBytes. `what` names the knob in the
// message (e.g. "SpscRing capacity", "MpscRing lane_capacity").
// Errors: kInvalidArgument (zero or not a power of two: the message proposes
// the next power of two), kTooLarge (over either maximum).
Status validate_ring_slots(std::size_t num_slots, std::size_t slot_bytes, std::string_view what);

// Default push hook policy: does nothing. A ring's Hooks::before_publish()
// runs on the producer thread after the item is constructed in its slot and
// before the position that makes it visible is published, i.e. "inside the
// push". Tests and the benchmark use it to deschedule a producer at the worst
// moment (see bench/ring/ring_bench.cc, stall case). Must be noexcept.
struct NoPushHooks {
  static void before_publish() noexcept {}
};

}  // namespace ember::ring
