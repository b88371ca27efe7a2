#include "common/ring/lane_registry.h"

#include <algorithm>
#include <vector>

namespace ember::ring::detail {

LaneClaims::LaneClaims(std::uint32_t num_lanes)
    : num_lanes_(num_lanes), claimed_(new std::atomic<std::uint8_t>[num_lanes]) {
  for (std::uint32_t i = 0; i < num_lanes; ++i) {
    claimed_[i].store(0, std::memory_order_relaxed);  // published by the owner's construction
  }
}

std::optional<std::uint32_t> LaneClaims::claim() noexcept {
  for (std::uint32_t i = 0; i < num_lanes_; ++i) {
    // relaxed pre-check only skips owned lanes cheaply; the exchange decides.
    if (claimed_[i].load(std::memory_order_relaxed) != 0) continue;
    // acquire pairs with the release store in release(): the previous owner's
    // use of the lane happens before ours.
    if (claimed_[i].exchange(1, std::memory_order_acquire) != 0) continue;
    std::uint32_t mark = high_water_.load(std::memory_order_relaxed);  // CAS below decides
    // release pairs with the acquire load in high_water().
    while (mark < i + 1 &&
           !high_water_.compare_exchange_weak(mark, i + 1, std::memory_order_release,
                                              std::memory_order_relaxed)) {
    }
    return i;
  }
  return std::nullopt;
}

void LaneClaims::release(std::uint32_t lane) noexcept {
  // release pairs with the acquire exchange in claim().
  claimed_[lane].store(0, std::memory_order_release);
}

std::uint32_t LaneClaims::num_claimed() const noexcept {
  std::uint32_t n = 0;
  for (std::uint32_t i = 0; i < num_lanes_; ++i) {
    // relaxed: a statistic, no data is read through it.
    n += claimed_[i].load(std::memory_order_relaxed) != 0 ? 1 : 0;
  }
  return n;
}

std::uint64_t next_ring_id() noexcept {
  static std::atomic<std::uint64_t> next{1};
  // relaxed: only uniqueness matters, which the RMW gives.
  return next.fetch_add(1, std::memory_order_relaxed);
}

namespace {

struct ThreadLane {
  std::uint64_t ring_id;
  void* lane;
  std::uint32_t index;
  std::weak_ptr<LaneClaims> claims;
};

// The calling thread's registrations; releases them at thread exit.
struct ThreadLaneCache {
  std::vector<ThreadLane> lanes;

  ~ThreadLaneCache() {
    tls_last_ring_id = 0;
    tls_last_lane = nullptr;
    for (ThreadLane& entry : lanes) {
      if (std::shared_ptr<LaneClaims> claims = entry.claims.lock()) claims->release(entry.index);
    }
  }
};

ThreadLaneCache& thread_lane_cache() {
  thread_local ThreadLaneCache cache;
  return cache;
}

}  // namespace

void* find_thread_lane(std::uint64_t ring_id) {
  std::vector<ThreadLane>& lanes = thread_lane_cache().lanes;
  void* found = nullptr;
  std::erase_if(lanes, [&](const ThreadLane& entry) {
    if (entry.ring_id == ring_id) {
      found = entry.lane;
      return false;
    }
    return entry.claims.expired();  // the ring is gone; its lanes died with it
  });
  if (found != nullptr) {
    tls_last_ring_id = ring_id;
    tls_last_lane = found;
  }
  return found;
}

void add_thread_lane(std::uint64_t ring_id, void* lane, std::uint32_t index,
                     std::weak_ptr<LaneClaims> claims) {
  thread_lane_cache().lanes.push_back(ThreadLane{ring_id, lane, index, std::move(claims)});
  tls_last_ring_id = ring_id;
  tls_last_lane = lane;
}

}  // namespace ember::ring::detail
