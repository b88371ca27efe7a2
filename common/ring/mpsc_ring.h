// MpscRing<T>: a bounded multi-producer single-consumer queue made of one
// SpscRing lane per producer.
//
// Why lanes: Ember runs 8 producers (worker app threads, server I/O threads)
// on as few as 2 cores, so producers are preempted all the time. In a shared
// Vyukov-style ring a producer preempted between claiming a slot and filling
// it blocks the consumer at that slot until it runs again (milliseconds). With
// one lane per producer a preempted producer holds back only its own lane; the
// consumer keeps draining the others. Order per producer is the lane's FIFO
// order; there is no order between producers.
//
// Design: up to `max_producers` lanes of `lane_capacity` slots (a power of
// two) each; a lane's slot array is allocated the first time its index is
// claimed and kept until the ring dies (a released lane is reused, items and
// all, by the next producer that claims it). Producers:
//  - an explicit Producer handle (make_producer()) owns a lane until the
//    handle is destroyed; use it where a thread pushes on a hot path;
//  - or any thread calls MpscRing::try_push(): the calling thread's lane is
//    claimed on its first push and released when the thread exits.
// A lane claim fails when all max_producers lanes are owned; make_producer()
// and register_current_thread() then return an Error naming the knob.
// The consumer visits lanes round-robin from where it stopped last time and
// takes a batch from each, publishing each lane's head once per batch.
// Batch pushes (try_push_batch) likewise publish the lane's tail once.
//
// Main invariant: each lane is an SpscRing with one owner at a time; the
// consumer only ever reads lanes below the claims' high-water mark.
//
// Thread-safety: producer calls (Producer::*, MpscRing::try_push*) from any
// number of threads, a Producer handle from one thread at a time. Consumer
// calls (try_pop*, consume) from one thread at a time. size_approx /
// empty_approx from any thread. make_producer / register_current_thread
// from any thread.
//
// Blocking and allocation: nothing blocks. Pushes and pops do not allocate,
// except the first push of a thread on a ring (it claims a lane: allocates
// the lane's slots the first time that lane index is used, and an entry in
// the thread's lane cache) and make_producer() (same lane allocation). Those
// allocations throw std::bad_alloc if memory is exhausted.
//
// Destruction destroys the items still in every lane. pre: no Producer handle
// is alive and no thread is pushing (checked for handles).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "common/base/check.h"
#include "common/base/constants.h"
#include "common/base/error.h"
#include "common/base/logging.h"
#include "common/ring/capacity.h"
#include "common/ring/lane_registry.h"
#include "common/ring/spsc_ring.h"

namespace ember::ring {

// Largest max_producers of one MpscRing.
inline constexpr std::size_t kMaxProducerLanes = 4096;

struct MpscOptions {
  // Slots per producer lane; a power of two. Total capacity is
  // lane_capacity * max_producers items.
  std::size_t lane_capacity = 1024;
  // Lanes, i.e. producers (handles + pushing threads) that may be alive at once.
  std::size_t max_producers = 64;
};

template <typename T, typename Hooks>
class BlockingMpscRing;

template <typename T, typename Hooks = NoPushHooks>
class MpscRing {
 public:
  using value_type = T;
  using Lane = SpscRing<T, Hooks>;

  // A producer's exclusive lane. Move-only; an empty (default or moved-from)
  // handle must not push. Destroying the handle releases the lane (items
  // already pushed stay and are consumed normally). Use from one thread at a
  // time. Must be destroyed before its ring.
  class Producer {
   public:
    Producer() = default;
    Producer(Producer&& other) noexcept
        : ring_(std::exchange(other.ring_, nullptr)), lane_(std::exchange(other.lane_, nullptr)),
          index_(other.index_) {}
    Producer& operator=(Producer&& other) noexcept {
      if (this != &other) {
        reset();
        ring_ = std::exchange(other.ring_, nullptr);
        lane_ = std::exchange(other.lane_, nullptr);
        index_ = other.index_;
      }
      return *this;
    }
    Producer(const Producer&) = delete;
    Producer& operator=(const Producer&) = delete;
    ~Producer() { reset(); }

    // Moves `item` into this producer's lane; false (item untouched) when the
    // lane is full. Never blocks or allocates.
    [[nodiscard]] bool try_push(T&& item) noexcept { return lane_->try_push(std::move(item)); }

    // Constructs an item in place; false when the lane is full.
    template <typename... Args>
    [[nodiscard]] bool try_emplace(Args&&... args) noexcept(
        std::is_nothrow_constructible_v<T, Args&&...>) {
      return lane_->try_emplace(std::forward<Args>(args)...);
    }

    // Moves as many of items[0, count) as fit, publishes them once and
    // returns how many (see SpscRing::try_push_batch).
    [[nodiscard]] std::size_t try_push_batch(T* items, std::size_t count) noexcept {
      return lane_->try_push_batch(items, count);
    }

    bool valid() const noexcept { return lane_ != nullptr; }
    std::uint32_t lane_index() const noexcept { return index_; }

   private:
    friend class MpscRing;
    template <typename, typename>
    friend class BlockingMpscRing;
    Producer(MpscRing* ring, Lane* lane, std::uint32_t index)
        : ring_(ring), lane_(lane), index_(index) {}
    void reset() noexcept {
      if (ring_ != nullptr) {
        ring_->release_handle_lane(index_);
        ring_ = nullptr;
        lane_ = nullptr;
      }
    }

    MpscRing* ring_ = nullptr;
    Lane* lane_ = nullptr;
    std::uint32_t index_ = 0;
  };

  // Checks `options`. Errors: kInvalidArgument (lane_capacity not a power of
  // two, max_producers 0), kTooLarge (lane_capacity over kMaxRingSlots or
  // its bytes over kMaxRingBytes, max_producers over kMaxProducerLanes).
  static Status validate(const MpscOptions& options) {
    EMBER_TRY(validate_ring_slots(options.lane_capacity, sizeof(T), "MpscRing lane_capacity"));
    if (options.max_producers == 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "MpscRing max_producers must be at least 1 (got 0): it is the number of "
                        "threads and Producer handles that may push at once");
    }
    if (options.max_producers > kMaxProducerLanes) {
      return make_error(ErrorCode::kTooLarge, "MpscRing max_producers of {} exceeds the maximum {}",
                        options.max_producers, kMaxProducerLanes);
    }
    return ok_status();
  }

  // Builds a ring; lanes are allocated lazily. Errors: those of validate().
  static Result<std::unique_ptr<MpscRing>> create(const MpscOptions& options) {
    EMBER_TRY(validate(options));
    return std::make_unique<MpscRing>(options);
  }

  // pre: validate(options) succeeds (checked).
  explicit MpscRing(const MpscOptions& options)
      : config_{checked(options).lane_capacity,
                std::make_unique<std::atomic<Lane*>[]>(options.max_producers),
                std::make_shared<detail::LaneClaims>(
                    static_cast<std::uint32_t>(options.max_producers)),
                detail::next_ring_id()} {}

  MpscRing(const MpscRing&) = delete;
  MpscRing& operator=(const MpscRing&) = delete;

  ~MpscRing() {
    // relaxed: a diagnostic; handles are destroyed by their owners before this.
    EMBER_CHECK_MSG(live_handles_.load(std::memory_order_relaxed) == 0,
                    "MpscRing destroyed while {} Producer handle(s) are alive; destroy them first",
                    live_handles_.load(std::memory_order_relaxed));
    for (std::uint32_t i = 0; i < config_.claims->num_lanes(); ++i) {
      delete config_.lanes[i].load(std::memory_order_relaxed);  // no concurrent users
    }
  }

  // ---- producers ----

  // Claims a lane for an explicit producer handle.
  // Errors: kUnavailable when all max_producers lanes are owned (by handles
  // or by threads that pushed through try_push() and have not exited).
  Result<Producer> make_producer() {
    const std::optional<std::uint32_t> index = config_.claims->claim();
    if (!index) return lanes_exhausted_error();
    // relaxed: a counter checked in the destructor only.
    live_handles_.fetch_add(1, std::memory_order_relaxed);
    return Producer(this, lane_for_claimed(*index), *index);
  }

  // Claims the calling thread's lane now (try_push() does it on first use).
  // Lets a thread learn up front whether it may push. Idempotent.
  // Errors: kUnavailable when all lanes are owned.
  Status register_current_thread() {
    if (this_thread_lane() == nullptr) return lanes_exhausted_error();
    return ok_status();
  }

  // Pushes through the calling thread's lane (claimed on the thread's first
  // push, released when the thread exits). Returns false when the lane is
  // full, or when the thread has no lane and none is free; the second case
  // is logged once per ring and register_current_thread() returns its Error.
  [[nodiscard]] bool try_push(T&& item) { return try_emplace(std::move(item)); }

  template <typename... Args>
  [[nodiscard]] bool try_emplace(Args&&... args) {
    Lane* lane = this_thread_lane();
    return lane != nullptr && lane->try_emplace(std::forward<Args>(args)...);
  }

  [[nodiscard]] std::size_t try_push_batch(T* items, std::size_t count) {
    Lane* lane = this_thread_lane();
    return lane == nullptr ? 0 : lane->try_push_batch(items, count);
  }

  // ---- consumer ----

  // Calls fn(T&) on up to `max` items and destroys each after fn returns
  // (see SpscRing::consume for fn's contract). Lanes are visited round-robin
  // starting one past the lane this call started from last time; each lane
  // gives as many as it has up to what is left of `max`. Returns the number
  // consumed; fewer than `max` means every lane was seen empty.
  template <typename Fn>
  std::size_t consume(Fn&& fn, std::size_t max) {
    return consume(fn, max, [](std::uint32_t, Lane&, std::size_t) {});
  }

  // Same, and calls on_lane(lane_index, lane, n) after taking n > 0 items
  // from a lane (BlockingMpscRing wakes that lane's waiting producer there).
  template <typename Fn, typename OnLane>
  std::size_t consume(Fn&& fn, std::size_t max, OnLane&& on_lane) {
    const std::uint32_t num_lanes = config_.claims->high_water();
    if (num_lanes == 0 || max == 0) return 0;
    std::uint32_t start = next_lane_ < num_lanes ? next_lane_ : 0;
    next_lane_ = start + 1;
    std::size_t done = 0;
    for (std::uint32_t k = 0; k < num_lanes && done < max; ++k) {
      std::uint32_t i = start + k;
      if (i >= num_lanes) i -= num_lanes;
      // acquire pairs with the release store in lane_for_claimed(): the
      // lane's construction happens before we use it.
      Lane* lane = config_.lanes[i].load(std::memory_order_acquire);
      if (lane == nullptr) continue;
      const std::size_t n = lane->consume(fn, max - done);
      if (n != 0) {
        done += n;
        on_lane(i, *lane, n);
      }
    }
    return done;
  }

  // Moves up to `max` items into out[0, k) and returns k.
  std::size_t try_pop_batch(T* out, std::size_t max) {
    std::size_t i = 0;
    return consume([&](T& item) { out[i++] = std::move(item); }, max);
  }

  [[nodiscard]] bool try_pop(T& out) {
    return consume([&](T& item) { out = std::move(item); }, 1) == 1;
  }

  [[nodiscard]] std::optional<T> try_pop() {
    std::optional<T> out;
    consume([&](T& item) { out.emplace(std::move(item)); }, 1);
    return out;
  }

  // ---- any thread ----

  std::size_t size_approx() const noexcept {
    std::size_t n = 0;
    for_each_lane([&](const Lane& lane) { n += lane.size_approx(); });
    return n;
  }
  bool empty_approx() const noexcept {
    const std::uint32_t num_lanes = config_.claims->high_water();
    for (std::uint32_t i = 0; i < num_lanes; ++i) {
      // acquire pairs with the release store in lane_for_claimed().
      const Lane* lane = config_.lanes[i].load(std::memory_order_acquire);
      if (lane != nullptr && !lane->empty_approx()) return false;
    }
    return true;
  }

  std::size_t lane_capacity() const noexcept { return config_.lane_capacity; }
  std::size_t max_producers() const noexcept { return config_.claims->num_lanes(); }
  // Lanes owned right now (handles + registered live threads).
  std::size_t num_producers() const noexcept { return config_.claims->num_claimed(); }

 private:
  // Read-only after construction; shared by producers and the consumer.
  struct Config {
    std::size_t lane_capacity;
    std::unique_ptr<std::atomic<Lane*>[]> lanes;
    std::shared_ptr<detail::LaneClaims> claims;  // thread caches hold weak_ptrs to it
    std::uint64_t id;
  };

  static const MpscOptions& checked(const MpscOptions& options) {
    const Status valid = validate(options);
    EMBER_CHECK_MSG(valid.has_value(), "{}", valid ? std::string() : valid.error().to_string());
    return options;
  }

  template <typename Fn>
  void for_each_lane(Fn&& fn) const {
    const std::uint32_t num_lanes = config_.claims->high_water();
    for (std::uint32_t i = 0; i < num_lanes; ++i) {
      // acquire pairs with the release store in lane_for_claimed().
      const Lane* lane = config_.lanes[i].load(std::memory_order_acquire);
      if (lane != nullptr) fn(*lane);
    }
  }

  // The lane object of a lane this thread just claimed; allocates it on the
  // index's first claim. Only the claimer writes the pointer.
  Lane* lane_for_claimed(std::uint32_t index) {
    // relaxed: the claim's acquire already ordered any earlier store of this
    // pointer (by a previous owner) before us.
    Lane* lane = config_.lanes[index].load(std::memory_order_relaxed);
    if (lane == nullptr) {
      lane = new Lane(config_.lane_capacity);
      // release pairs with the acquire loads in consume() / empty_approx().
      config_.lanes[index].store(lane, std::memory_order_release);
    }
    return lane;
  }

  void release_handle_lane(std::uint32_t index) noexcept {
    config_.claims->release(index);
    live_handles_.fetch_sub(1, std::memory_order_relaxed);  // counter, see make_producer()
  }

  Lane* this_thread_lane() {
    if (detail::tls_last_ring_id == config_.id) return static_cast<Lane*>(detail::tls_last_lane);
    if (void* lane = detail::find_thread_lane(config_.id)) return static_cast<Lane*>(lane);
    const std::optional<std::uint32_t> index = config_.claims->claim();
    if (!index) {
      // relaxed: only dedupes the log line.
      if (!warned_exhausted_.exchange(true, std::memory_order_relaxed)) {
        log::logger("ring")->warn("{}", lanes_exhausted_error().value().to_string());
      }
      return nullptr;
    }
    Lane* lane = lane_for_claimed(*index);
    detail::add_thread_lane(config_.id, lane, *index, config_.claims);
    return lane;
  }

  template <typename, typename>
  friend class BlockingMpscRing;

  // Index of a lane object (slow path of blocking pushes only).
  std::uint32_t index_of(const Lane* lane) const noexcept {
    const std::uint32_t num_lanes = config_.claims->high_water();
    for (std::uint32_t i = 0; i < num_lanes; ++i) {
      // relaxed: the caller owns `lane`, whose pointer it has seen already.
      if (config_.lanes[i].load(std::memory_order_relaxed) == lane) return i;
    }
    EMBER_CHECK_MSG(false, "lane {} is not a lane of this MpscRing", static_cast<const void*>(lane));
    return 0;
  }

  tl::unexpected<Error> lanes_exhausted_error() const {
    return make_error(ErrorCode::kUnavailable,
                      "MpscRing: all {} producer lanes are in use (Producer handles plus threads "
                      "that pushed and have not exited); raise MpscOptions::max_producers or "
                      "release Producer handles",
                      config_.claims->num_lanes());
  }

  alignas(kFalseSharingBytes) const Config config_;
  // Consumer-private: where the next consume() starts.
  alignas(kFalseSharingBytes) std::uint32_t next_lane_ = 0;
  // Cold: producer bookkeeping.
  alignas(kFalseSharingBytes) std::atomic<std::size_t> live_handles_{0};
  std::atomic<bool> warned_exhausted_{false};
};

}  // namespace ember::ring
