// Lane bookkeeping for MpscRing (internal; include mpsc_ring.h instead).
//
// LaneClaims: which of an MpscRing's producer lanes are owned. A producer
// (an explicit MpscRing::Producer handle, or a thread's implicit lane) claims
// the lowest free lane and releases it when done; the claim is the only
// synchronization between a lane's successive owners.
//
// Thread lane cache: the per-thread map from ring id to the lane the thread
// registered on that ring, used by MpscRing's any-thread try_push(). Ring ids
// come from a process-wide counter and are never reused, so a stale entry of
// a destroyed ring can never match a live one. When a thread exits, its
// lanes are released on every ring that still exists (found through a
// weak_ptr to the ring's LaneClaims, so ring destruction and thread exit may
// race safely).
//
// Thread-safety: LaneClaims is safe from any thread. The thread lane cache
// functions act on the calling thread's own cache.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

namespace ember::ring::detail {

class LaneClaims {
 public:
  explicit LaneClaims(std::uint32_t num_lanes);

  // Claims the lowest free lane and returns its index, or nullopt when all
  // lanes are owned. Everything the lane's previous owner did before
  // release() happens before the new owner's first use. Lock-free; no
  // allocation.
  std::optional<std::uint32_t> claim() noexcept;

  // Gives a lane back. pre: the caller owns `lane`.
  void release(std::uint32_t lane) noexcept;

  // One past the highest lane index ever claimed (lanes at or above it have
  // never been used). Monotonic.
  std::uint32_t high_water() const noexcept {
    // acquire pairs with the release CAS in claim(): a consumer that sees the
    // new mark also sees everything the claimer did before raising it.
    return high_water_.load(std::memory_order_acquire);
  }

  std::uint32_t num_claimed() const noexcept;
  std::uint32_t num_lanes() const noexcept { return num_lanes_; }

 private:
  std::uint32_t num_lanes_;
  std::unique_ptr<std::atomic<std::uint8_t>[]> claimed_;
  std::atomic<std::uint32_t> high_water_{0};
};

// A fresh ring id (never 0, never reused in this process).
std::uint64_t next_ring_id() noexcept;

// Fast-path memo of the calling thread's most recent lookup (ring id 0 means
// none). constinit thread_local of trivial types: no TLS init wrapper.
inline constinit thread_local std::uint64_t tls_last_ring_id = 0;
inline constinit thread_local void* tls_last_lane = nullptr;

// The lane the calling thread registered on ring `ring_id`, or nullptr.
// Updates the memo on a hit; drops entries of destroyed rings.
void* find_thread_lane(std::uint64_t ring_id);

// Records that the calling thread owns lane `index` (object `lane`) of ring
// `ring_id`; the lane is released through `claims` when the thread exits, if
// the ring still exists then. Updates the memo. Allocates (the cache grows).
void add_thread_lane(std::uint64_t ring_id, void* lane, std::uint32_t index,
                     std::weak_ptr<LaneClaims> claims);

}  // namespace ember::ring::detail
