// BlockingMpscRing<T>: an MpscRing whose consumer can sleep while it is empty.
//
// Composition of MpscRing (see mpsc_ring.h for lanes, order and capacity)
// and Parker (see parker.h for the sleep/wake protocol): every successful
// push is followed by Parker::notify(), so a parked consumer is woken without
// a lost wake-up; the consumer's *_wait calls spin briefly, yield, then sleep
// on the eventfd.
// Producers choose their back-pressure: try_push* never blocks (false / 0
// when the lane is full); push_wait / push_batch_wait wait for space: spin,
// yield, then sleep on the lane's FutexFlag, which the consumer wakes (same
// arm / fence / re-check protocol) once it has freed at least half of that
// lane, so a sleeping producer costs the consumer at most one futex wake per
// half lane. A sleeping producer leaves its core to the consumer, which is
// what keeps 8 producers on 2 cores fast.
//
// Event loops: wake_fd() is the eventfd. prepare_to_park() / finish_park()
// bracket waiting on it; common/ring/asio_waiter.h wraps that for Boost.Asio.
//
// Thread-safety: as MpscRing, plus: pop_wait, pop_batch_wait, consume_wait,
// prepare_to_park and finish_park are consumer calls; push_wait and
// push_batch_wait are producer calls; wake() may be called from any thread.
// Cost: a push adds one seq_cst fence and a load to MpscRing's push (batch
// pushes pay it once per batch), and a write(2) only when the consumer
// sleeps. A consume adds one fence and a load per lane it took items from.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <utility>

#include "common/base/error.h"
#include "common/ring/mpsc_ring.h"
#include "common/ring/parker.h"

namespace ember::ring {

template <typename T, typename Hooks = NoPushHooks>
class BlockingMpscRing {
 public:
  using value_type = T;
  using Ring = MpscRing<T, Hooks>;

  // An MpscRing::Producer that also wakes the consumer. Same ownership and
  // threading rules; must be destroyed before its ring.
  class Producer {
   public:
    Producer() = default;

    [[nodiscard]] bool try_push(T&& item) noexcept {
      if (!inner_.try_push(std::move(item))) return false;
      parker_->notify();
      return true;
    }
    template <typename... Args>
    [[nodiscard]] bool try_emplace(Args&&... args) noexcept(
        std::is_nothrow_constructible_v<T, Args&&...>) {
      if (!inner_.try_emplace(std::forward<Args>(args)...)) return false;
      parker_->notify();
      return true;
    }
    [[nodiscard]] std::size_t try_push_batch(T* items, std::size_t count) noexcept {
      const std::size_t n = inner_.try_push_batch(items, count);
      if (n != 0) parker_->notify();
      return n;
    }

    // Pushes all of items[0, count) in order, waiting for space (spin,
    // yield, sleep) up to `timeout` in all. Returns how many were pushed:
    // count, or fewer when the timeout passed. Pushed items are moved-from.
    std::size_t push_batch_wait(T* items, std::size_t count, std::chrono::nanoseconds timeout) {
      return owner_->push_batch_wait_on(inner_.lane_, inner_.index_, items, count, timeout);
    }
    // Pushes `item`, waiting up to `timeout` for space; false on timeout
    // (item untouched).
    [[nodiscard]] bool push_wait(T&& item, std::chrono::nanoseconds timeout) {
      return push_batch_wait(&item, 1, timeout) == 1;
    }
    // Waits (spin, yield, sleep) until this producer's lane has a free slot;
    // false if `timeout` passed first. For callers that push with try_push*
    // and want to do something between attempts.
    [[nodiscard]] bool wait_for_space(std::chrono::nanoseconds timeout) {
      return owner_->wait_for_space_on(inner_.lane_, inner_.index_,
                                       std::chrono::steady_clock::now() + timeout);
    }

    bool valid() const noexcept { return inner_.valid(); }
    std::uint32_t lane_index() const noexcept { return inner_.lane_index(); }

   private:
    friend class BlockingMpscRing;
    Producer(typename Ring::Producer inner, BlockingMpscRing* owner)
        : inner_(std::move(inner)), parker_(owner->parker_.get()), owner_(owner) {}
    typename Ring::Producer inner_;
    Parker* parker_ = nullptr;
    BlockingMpscRing* owner_ = nullptr;
  };

  // Errors: those of MpscRing::validate, and kIo when the eventfd cannot be
  // created.
  static Result<std::unique_ptr<BlockingMpscRing>> create(const MpscOptions& options,
                                                          const ParkOptions& park = {}) {
    EMBER_ASSIGN_OR_RETURN(std::unique_ptr<Ring> ring, Ring::create(options));
    EMBER_ASSIGN_OR_RETURN(std::unique_ptr<Parker> parker, Parker::create(park));
    return std::unique_ptr<BlockingMpscRing>(
        new BlockingMpscRing(std::move(ring), std::move(parker), options.max_producers, park));
  }

  // ---- producers ----

  // Errors: kUnavailable when all lanes are owned (see MpscRing).
  Result<Producer> make_producer() {
    EMBER_ASSIGN_OR_RETURN(typename Ring::Producer inner, ring_->make_producer());
    return Producer(std::move(inner), this);
  }
  Status register_current_thread() { return ring_->register_current_thread(); }

  // Any-thread pushes through the calling thread's lane (see MpscRing).
  [[nodiscard]] bool try_push(T&& item) {
    if (!ring_->try_push(std::move(item))) return false;
    parker_->notify();
    return true;
  }
  template <typename... Args>
  [[nodiscard]] bool try_emplace(Args&&... args) {
    if (!ring_->try_emplace(std::forward<Args>(args)...)) return false;
    parker_->notify();
    return true;
  }
  [[nodiscard]] std::size_t try_push_batch(T* items, std::size_t count) {
    const std::size_t n = ring_->try_push_batch(items, count);
    if (n != 0) parker_->notify();
    return n;
  }
  // Waiting pushes through the calling thread's lane (see Producer). Return
  // 0 / false at once when the thread has no lane and none is free.
  std::size_t push_batch_wait(T* items, std::size_t count, std::chrono::nanoseconds timeout) {
    typename Ring::Lane* lane = ring_->this_thread_lane();
    if (lane == nullptr) return 0;
    return push_batch_wait_on(lane, kIndexUnknown, items, count, timeout);
  }
  [[nodiscard]] bool push_wait(T&& item, std::chrono::nanoseconds timeout) {
    return push_batch_wait(&item, 1, timeout) == 1;
  }

  // ---- consumer: non-blocking ----

  template <typename Fn>
  std::size_t consume(Fn&& fn, std::size_t max) {
    return ring_->consume(fn, max, [this](std::uint32_t index, typename Ring::Lane& lane,
                                          std::size_t) { after_lane_consumed(index, lane); });
  }
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

  // ---- consumer: blocking ----

  // Consumes up to `max` items like consume(), first waiting (spin, yield,
  // sleep) up to `timeout` for at least one. Returns the number consumed: 0
  // when the timeout passed, or wake() was called, with the ring empty.
  template <typename Fn>
  std::size_t consume_wait(Fn&& fn, std::size_t max, std::chrono::nanoseconds timeout) {
    const std::size_t n = consume(fn, max);
    if (n != 0) return n;
    if (!parker_->wait([this] { return !ring_->empty_approx(); }, timeout)) return 0;
    return consume(fn, max);
  }

  // Waits (spin, yield, sleep) up to `timeout` until the ring has items,
  // without consuming them: for a consumer that takes them under its own
  // lock (server::Shard, whose items another thread may handle in its
  // place). Returns false when the timeout passed, or wake() was called,
  // with the ring empty.
  bool wait_for_items(std::chrono::nanoseconds timeout) {
    return parker_->wait([this] { return !ring_->empty_approx(); }, timeout);
  }

  std::size_t pop_batch_wait(T* out, std::size_t max, std::chrono::nanoseconds timeout) {
    std::size_t i = 0;
    return consume_wait([&](T& item) { out[i++] = std::move(item); }, max, timeout);
  }

  [[nodiscard]] bool pop_wait(T& out, std::chrono::nanoseconds timeout) {
    return consume_wait([&](T& item) { out = std::move(item); }, 1, timeout) == 1;
  }

  // ---- consumer: event loops ----

  // See Parker::prepare_to_park: true means "now wait until wake_fd() is
  // readable, then call finish_park()"; false means items are there.
  bool prepare_to_park() noexcept {
    return parker_->prepare_to_park([this] { return !ring_->empty_approx(); });
  }
  void finish_park() noexcept { parker_->finish_park(); }
  int wake_fd() const noexcept { return parker_->fd(); }

  // Any thread: ends the consumer's current (or next) wait early.
  void wake() noexcept { parker_->wake(); }

  // ---- any thread ----

  std::size_t size_approx() const noexcept { return ring_->size_approx(); }
  bool empty_approx() const noexcept { return ring_->empty_approx(); }
  std::size_t lane_capacity() const noexcept { return ring_->lane_capacity(); }
  std::size_t max_producers() const noexcept { return ring_->max_producers(); }
  std::size_t num_producers() const noexcept { return ring_->num_producers(); }
  // The underlying ring. Consuming through it directly skips the wake-ups
  // of producers waiting in push_wait; use this class's consume calls.
  Ring& ring() noexcept { return *ring_; }
  const Parker& parker() const noexcept { return *parker_; }
  // Producers' futex sleeps while waiting for space, and the consumer's
  // wake-ups of them (statistics).
  std::uint64_t num_producer_sleeps() const noexcept {
    std::uint64_t n = 0;
    for (std::size_t i = 0; i < ring_->max_producers(); ++i) n += space_[i].num_sleeps();
    return n;
  }
  std::uint64_t num_producer_wakes() const noexcept {
    std::uint64_t n = 0;
    for (std::size_t i = 0; i < ring_->max_producers(); ++i) n += space_[i].num_wakes();
    return n;
  }

 private:
  BlockingMpscRing(std::unique_ptr<Ring> ring, std::unique_ptr<Parker> parker,
                   std::size_t max_producers, const ParkOptions& park)
      : ring_(std::move(ring)),
        parker_(std::move(parker)),
        space_(std::make_unique<FutexFlag[]>(max_producers)),
        park_(park) {}

  // Lane index not looked up yet (any-thread pushes find it only if they
  // have to sleep).
  static constexpr std::uint32_t kIndexUnknown = ~std::uint32_t{0};

  // Producer side of push_wait: push what fits, wait for space, repeat.
  std::size_t push_batch_wait_on(typename Ring::Lane* lane, std::uint32_t index, T* items,
                                 std::size_t count, std::chrono::nanoseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::size_t done = 0;
    while (true) {
      const std::size_t n = lane->try_push_batch(items + done, count - done);
      if (n != 0) {
        parker_->notify();
        done += n;
      }
      if (done == count || !wait_for_space_on(lane, index, deadline)) return done;
    }
  }

  // Waits until `lane` has a free slot: spin, yield, then sleep on the
  // lane's FutexFlag (arm, re-check, sleep; the consumer wakes it). Returns
  // false if the deadline passed first.
  bool wait_for_space_on(typename Ring::Lane* lane, std::uint32_t index,
                         std::chrono::steady_clock::time_point deadline) {
    auto has_space = [lane] { return lane->size_approx() < lane->capacity(); };
    for (std::uint32_t i = 0; i < park_.producer_spin_iterations; ++i) {
      if (has_space()) return true;
      Parker::cpu_relax();
    }
    for (std::uint32_t i = 0; i < park_.producer_yield_iterations; ++i) {
      if (has_space()) return true;
      sched_yield();
    }
    if (index == kIndexUnknown) index = ring_->index_of(lane);  // any-thread pushes only
    FutexFlag& space = space_[index];
    while (true) {
      space.arm();
      if (has_space()) {  // the re-check
        space.disarm();
        return true;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        space.disarm();
        return false;
      }
      space.sleep(deadline - now);
      space.disarm();
      if (has_space()) return true;
    }
  }

  // Consumer, after taking items from lane `index`: wakes its producer if it
  // sleeps for space and at least half the lane is free now. Every consume
  // that takes items re-checks, and the one that empties the lane frees all
  // of it, so a sleeping producer is always woken.
  void after_lane_consumed(std::uint32_t index, const typename Ring::Lane& lane) noexcept {
    FutexFlag& space = space_[index];
    if (!space.armed_after_fence()) return;
    const std::size_t free_slots = lane.capacity() - lane.size_approx();
    if (free_slots >= (lane.capacity() + 1) / 2) space.wake();
  }

  std::unique_ptr<Ring> ring_;
  std::unique_ptr<Parker> parker_;
  std::unique_ptr<FutexFlag[]> space_;  // one per lane
  ParkOptions park_;
};

}  // namespace ember::ring
