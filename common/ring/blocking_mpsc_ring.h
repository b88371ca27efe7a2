// BlockingMpscRing<T>: an MpscRing whose consumer can sleep while it is empty.
//
// Composition of MpscRing (see mpsc_ring.h for lanes, order and capacity)
// and Parker (see parker.h for the sleep/wake protocol): every successful
// push is followed by Parker::notify(), so a parked consumer is woken without
// a lost wake-up; the consumer's *_wait calls spin briefly, yield, then sleep
// on the eventfd. Producers never block: a full lane still makes try_push
// return false (back-pressure is the producer's choice: retry, yield, drop).
//
// Event loops: wake_fd() is the eventfd. prepare_to_park() / finish_park()
// bracket waiting on it; common/ring/asio_waiter.h wraps that for Boost.Asio.
//
// Thread-safety: as MpscRing, plus: *_wait, prepare_to_park and finish_park
// are consumer calls; wake() may be called from any thread.
// Cost: a push adds one seq_cst fence and a load to MpscRing's push (batch
// pushes pay it once per batch), and a write(2) only when the consumer
// sleeps.
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
    bool valid() const noexcept { return inner_.valid(); }
    std::uint32_t lane_index() const noexcept { return inner_.lane_index(); }

   private:
    friend class BlockingMpscRing;
    Producer(typename Ring::Producer inner, Parker* parker)
        : inner_(std::move(inner)), parker_(parker) {}
    typename Ring::Producer inner_;
    Parker* parker_ = nullptr;
  };

  // Errors: those of MpscRing::validate, and kIo when the eventfd cannot be
  // created.
  static Result<std::unique_ptr<BlockingMpscRing>> create(const MpscOptions& options,
                                                          const ParkOptions& park = {}) {
    EMBER_ASSIGN_OR_RETURN(std::unique_ptr<Ring> ring, Ring::create(options));
    EMBER_ASSIGN_OR_RETURN(std::unique_ptr<Parker> parker, Parker::create(park));
    return std::unique_ptr<BlockingMpscRing>(
        new BlockingMpscRing(std::move(ring), std::move(parker)));
  }

  // ---- producers ----

  // Errors: kUnavailable when all lanes are owned (see MpscRing).
  Result<Producer> make_producer() {
    EMBER_ASSIGN_OR_RETURN(typename Ring::Producer inner, ring_->make_producer());
    return Producer(std::move(inner), parker_.get());
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

  // ---- consumer: non-blocking ----

  template <typename Fn>
  std::size_t consume(Fn&& fn, std::size_t max) {
    return ring_->consume(std::forward<Fn>(fn), max);
  }
  std::size_t try_pop_batch(T* out, std::size_t max) { return ring_->try_pop_batch(out, max); }
  [[nodiscard]] bool try_pop(T& out) { return ring_->try_pop(out); }
  [[nodiscard]] std::optional<T> try_pop() { return ring_->try_pop(); }

  // ---- consumer: blocking ----

  // Consumes up to `max` items like consume(), first waiting (spin, yield,
  // sleep) up to `timeout` for at least one. Returns the number consumed: 0
  // when the timeout passed, or wake() was called, with the ring empty.
  template <typename Fn>
  std::size_t consume_wait(Fn&& fn, std::size_t max, std::chrono::nanoseconds timeout) {
    const std::size_t n = ring_->consume(fn, max);
    if (n != 0) return n;
    if (!parker_->wait([this] { return !ring_->empty_approx(); }, timeout)) return 0;
    return ring_->consume(fn, max);
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
  Ring& ring() noexcept { return *ring_; }
  const Parker& parker() const noexcept { return *parker_; }

 private:
  BlockingMpscRing(std::unique_ptr<Ring> ring, std::unique_ptr<Parker> parker)
      : ring_(std::move(ring)), parker_(std::move(parker)) {}

  std::unique_ptr<Ring> ring_;
  std::unique_ptr<Parker> parker_;
};

}  // namespace ember::ring
