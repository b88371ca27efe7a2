// SpscRing<T>: a bounded single-producer single-consumer ring.
//
// Role: the building block of Ember's queues. MpscRing gives each producer one
// SpscRing lane; the shm transport can place descriptors in one directly.
//
// Design (after rigtorp/SPSCQueue, include/rigtorp/SPSCQueue.h): a slot array
// of `capacity` slots (a power of two), a tail position written only by the
// producer and a head position written only by the consumer. Positions are
// 64-bit counters that only grow; a slot index is `position & mask`, and the
// number of items is `tail - head` (unsigned, so it stays right even across a
// 2^64 wrap). Each position lives on its own kFalseSharingBytes line, and each
// side keeps a private cached copy of the other side's position on its own
// line, re-reading the shared one only when the cached view says full (the
// producer) or empty (the consumer). Batch forms move many items and publish
// the position once.
//
// Main invariant: head <= tail <= head + capacity (modulo 2^64); exactly the
// slots in [head, tail) hold live T objects.
//
// Thread-safety: at most one producer thread and one consumer thread at a
// time. Producer calls: try_push, try_emplace, try_push_batch. Consumer calls:
// try_pop, try_pop_batch, consume. size_approx/empty_approx may be called from
// any thread (the answer may be stale). A producer (or consumer) role may move
// to another thread only through a synchronization that orders the old
// thread's calls before the new thread's (a mutex, a thread join, an acquire
// of a release).
//
// Blocking and allocation: no call blocks or allocates except the
// constructor/create (one slot array allocation). Push and pop never wait: a
// full ring is not an error, try_push returns false.
//
// Destruction destroys the items still in the ring.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <type_traits>
#include <utility>

#include "common/base/check.h"
#include "common/base/constants.h"
#include "common/base/error.h"
#include "common/ring/capacity.h"

namespace ember::ring {

template <typename T, typename Hooks = NoPushHooks>
class SpscRing {
  static_assert(std::is_nothrow_move_constructible_v<T>,
                "ring elements must be nothrow move constructible (batch push moves them)");
  static_assert(std::is_nothrow_destructible_v<T>, "ring elements must be nothrow destructible");

 public:
  using value_type = T;

  // Builds a ring of `capacity` slots (a power of two in [1, kMaxRingSlots],
  // capacity * sizeof(T) <= kMaxRingBytes). Allocates the slot array.
  // Errors: those of validate_ring_slots (kInvalidArgument, kTooLarge).
  static Result<std::unique_ptr<SpscRing>> create(std::size_t capacity) {
    EMBER_TRY(validate_ring_slots(capacity, sizeof(T), "SpscRing capacity"));
    return std::make_unique<SpscRing>(capacity);
  }

  // pre: validate_ring_slots(capacity, sizeof(T), ...) succeeds (checked).
  // `initial_position` is where head and tail start: 0 in production; tests
  // start near 2^64 to exercise the wrap of the 64-bit positions.
  explicit SpscRing(std::size_t capacity, std::uint64_t initial_position = 0)
      : tail_(initial_position),
        producer_{initial_position, capacity - 1, allocate_slots(capacity)},
        head_(initial_position),
        consumer_{initial_position, capacity - 1, producer_.slots} {}

  SpscRing(const SpscRing&) = delete;
  SpscRing& operator=(const SpscRing&) = delete;

  // Destroys the items still in the ring. pre: no thread is using the ring.
  ~SpscRing() {
    const std::uint64_t tail = tail_.load(std::memory_order_relaxed);  // owner thread, no race
    for (std::uint64_t pos = head_.load(std::memory_order_relaxed); pos != tail; ++pos) {
      slot(consumer_.slots, consumer_.mask, pos)->~T();
    }
    // Unsized form: clang enables sized deallocation only on request.
    ::operator delete(static_cast<void*>(consumer_.slots), std::align_val_t{kSlotAlignment});
  }

  // ---- producer side ----

  // Moves `item` into the ring. Returns false (item untouched) when full.
  [[nodiscard]] bool try_push(T&& item) noexcept { return try_emplace(std::move(item)); }
  [[nodiscard]] bool try_push(const T& item) noexcept(std::is_nothrow_copy_constructible_v<T>) {
    return try_emplace(item);
  }

  // Constructs an item in place from `args`. Returns false (nothing
  // constructed) when full. If the constructor throws, nothing is published
  // and the exception propagates.
  template <typename... Args>
  [[nodiscard]] bool try_emplace(Args&&... args) noexcept(
      std::is_nothrow_constructible_v<T, Args&&...>) {
    const std::uint64_t tail = tail_.load(std::memory_order_relaxed);  // own position
    if (tail - producer_.cached_other == capacity()) {
      // acquire pairs with the release store of head_ in consume(): the
      // consumer's destruction of the slot happens before we reuse it.
      producer_.cached_other = head_.load(std::memory_order_acquire);
      if (tail - producer_.cached_other == capacity()) return false;
    }
    ::new (static_cast<void*>(slot(producer_.slots, producer_.mask, tail)))
        T(std::forward<Args>(args)...);
    Hooks::before_publish();
    // release pairs with the acquire load of tail_ in consume(): the item's
    // construction happens before the consumer reads it.
    tail_.store(tail + 1, std::memory_order_release);
    return true;
  }

  // Moves as many of items[0, count) as fit, in order, and publishes them at
  // once. Returns how many were pushed (0 when full); items[0, k) are left
  // moved-from (the caller still owns and destroys them).
  [[nodiscard]] std::size_t try_push_batch(T* items, std::size_t count) noexcept {
    const std::uint64_t tail = tail_.load(std::memory_order_relaxed);  // own position
    std::uint64_t free_slots = capacity() - (tail - producer_.cached_other);
    if (free_slots < count) {
      // acquire pairs with the release store of head_ in consume().
      producer_.cached_other = head_.load(std::memory_order_acquire);
      free_slots = capacity() - (tail - producer_.cached_other);
    }
    const std::size_t n = count < free_slots ? count : static_cast<std::size_t>(free_slots);
    if (n == 0) return 0;
    for (std::size_t i = 0; i < n; ++i) {
      ::new (static_cast<void*>(slot(producer_.slots, producer_.mask, tail + i)))
          T(std::move(items[i]));
    }
    Hooks::before_publish();
    // release pairs with the acquire load of tail_ in consume().
    tail_.store(tail + n, std::memory_order_release);
    return n;
  }

  // ---- consumer side ----

  // Calls fn(T&) on up to `max` items in FIFO order, destroying each after fn
  // returns, and publishes the new head once. fn may read the item in place
  // or move from it. Returns the number consumed. If fn throws, the items it
  // finished are consumed, the one it threw on stays at the front of the ring
  // (in whatever state fn left it), and the exception propagates.
  template <typename Fn>
  std::size_t consume(Fn&& fn, std::size_t max) {
    const std::uint64_t head = head_.load(std::memory_order_relaxed);  // own position
    std::uint64_t available = consumer_.cached_other - head;
    if (available < max) {
      // acquire pairs with the release store of tail_ in try_emplace() /
      // try_push_batch(): item construction happens before we read it.
      consumer_.cached_other = tail_.load(std::memory_order_acquire);
      available = consumer_.cached_other - head;
    }
    const std::size_t n = max < available ? max : static_cast<std::size_t>(available);
    if (n == 0) return 0;
    PublishHead publish{this, head, 0};
    for (; publish.done < n; ++publish.done) {
      T* item = slot(consumer_.slots, consumer_.mask, head + publish.done);
      fn(*item);
      item->~T();
    }
    return n;  // `publish` stores head + n
  }

  // Moves up to `max` items into out[0, k) (move assignment) and returns k.
  std::size_t try_pop_batch(T* out, std::size_t max) {
    std::size_t i = 0;
    return consume([&](T& item) { out[i++] = std::move(item); }, max);
  }

  // Moves the front item into `out`. Returns false (out untouched) if empty.
  [[nodiscard]] bool try_pop(T& out) {
    return consume([&](T& item) { out = std::move(item); }, 1) == 1;
  }

  // The front item, or nullopt if empty.
  [[nodiscard]] std::optional<T> try_pop() {
    std::optional<T> out;
    consume([&](T& item) { out.emplace(std::move(item)); }, 1);
    return out;
  }

  // ---- any thread ----

  // Number of items, possibly stale by the time it returns.
  std::size_t size_approx() const noexcept {
    // acquire/acquire: only for a coherent snapshot; pairs with the release
    // stores of head_ and tail_. Head is read first so tail - head never
    // underflows (both only grow).
    const std::uint64_t head = head_.load(std::memory_order_acquire);
    const std::uint64_t tail = tail_.load(std::memory_order_acquire);
    return static_cast<std::size_t>(tail - head);
  }
  bool empty_approx() const noexcept { return size_approx() == 0; }
  std::size_t capacity() const noexcept { return static_cast<std::size_t>(consumer_.mask) + 1; }

 private:
  static constexpr std::size_t kSlotAlignment =
      alignof(T) > kFalseSharingBytes ? alignof(T) : kFalseSharingBytes;

  // One side's private line: its cached copy of the other side's position
  // and its own copy of the read-only layout, so the hot path touches only
  // this line, the shared position lines and the slots.
  struct alignas(kFalseSharingBytes) SideState {
    std::uint64_t cached_other;
    std::uint64_t mask;
    T* slots;
  };

  // Stores head + done on destruction (also when fn throws in consume()).
  struct PublishHead {
    SpscRing* ring;
    std::uint64_t head;
    std::size_t done;
    ~PublishHead() {
      // release pairs with the acquire load of head_ in try_emplace() /
      // try_push_batch(): destruction of the consumed items happens before
      // the producer reuses their slots.
      if (done != 0) ring->head_.store(head + done, std::memory_order_release);
    }
  };

  static std::size_t slot_array_bytes(std::size_t capacity) noexcept {
    const std::size_t bytes = capacity * sizeof(T);
    return (bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;  // no shared line
  }

  static T* allocate_slots(std::size_t capacity) {
    const Status valid = validate_ring_slots(capacity, sizeof(T), "SpscRing capacity");
    EMBER_CHECK_MSG(valid.has_value(), "{}", valid ? std::string() : valid.error().to_string());
    return static_cast<T*>(
        ::operator new(slot_array_bytes(capacity), std::align_val_t{kSlotAlignment}));
  }

  static T* slot(T* slots, std::uint64_t mask, std::uint64_t position) noexcept {
    return std::launder(slots + (position & mask));
  }

  // Written by the producer, read by the consumer.
  alignas(kFalseSharingBytes) std::atomic<std::uint64_t> tail_;
  SideState producer_;  // cached_other = last head seen
  // Written by the consumer, read by the producer.
  alignas(kFalseSharingBytes) std::atomic<std::uint64_t> head_;
  SideState consumer_;  // cached_other = last tail seen
};

}  // namespace ember::ring
