// Host-side access to a SymBuffer: an owning host allocation (the CPU
// reference's buffer), a non-owning view (any buffer the host can address:
// host memory, or pinned page-pool memory that CUDA also maps), and RingView,
// the transport's side of one ring.
//
// Protocol of a ring (see layout.h): the producer writes bytes at
// [tail, head + capacity), then publishes tail (release); the consumer reads
// [head, tail) after loading tail (acquire), then publishes head (release).
// One producer and one consumer per ring; they may be different threads, or
// a kernel and a host thread when the buffer is pinned host memory.
//
// Thread-safety: HostSymBuffer is move-only; its methods are not
// synchronised (reset_positions() only while no ring is in use). RingView
// methods follow the producer/consumer roles above.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "common/base/error.h"
#include "worker/gpu/layout.h"

namespace ember::gpu {

// A buffer the host can address, laid out by `layout`. Non-owning.
struct SymBufferView {
  SymBufferLayout layout{};
  std::byte* base = nullptr;  // 128-byte aligned, layout.total_bytes() long
};

// Acquire/release access to a ring position (host side).
std::uint64_t load_position_acquire(const std::uint64_t& position);
void store_position_release(std::uint64_t& position, std::uint64_t value);

class RingView {
 public:
  // pre: ring < view.layout.num_rings().
  RingView(const SymBufferView& view, std::uint64_t ring, Direction direction);

  // Up to two spans (the second when the range wraps past the ring's end).
  struct Bytes {
    std::span<std::byte> first;
    std::span<std::byte> second;
    std::uint64_t size() const { return first.size() + second.size(); }
  };

  std::uint64_t capacity_bytes() const { return capacity_; }
  std::uint64_t head() const;  // acquire
  std::uint64_t tail() const;  // acquire

  // Consumer: the published, unread bytes [head, tail). Never blocks.
  Bytes readable() const;
  // Consumer: frees `bytes` read bytes. pre (checked): bytes ≤ readable().size().
  void consume(std::uint64_t bytes);
  // Producer: the free bytes [tail, head + capacity). Never blocks.
  Bytes writable() const;
  // Producer: publishes `bytes` written bytes. pre (checked): ≤ writable().size().
  void commit(std::uint64_t bytes);

 private:
  Bytes range(std::uint64_t from, std::uint64_t length) const;

  ChannelMeta* meta_;
  std::byte* data_;
  std::uint64_t capacity_;
};

class HostSymBuffer {
 public:
  // Allocates and zeroes layout.total_bytes() bytes, 4 KiB aligned.
  // Errors: kInvalidArgument for an invalid layout; kIo (ENOMEM) when the
  // allocation fails.
  static Result<HostSymBuffer> allocate(const SymBufferLayout& layout);
  // Uses `region` (e.g. a page-pool block) without owning it; sets every
  // ring's head and tail to 0. Errors: kInvalidArgument for an invalid layout, a region
  // that is not 128-byte aligned or shorter than layout.total_bytes().
  static Result<HostSymBuffer> wrap(const SymBufferLayout& layout, std::span<std::byte> region);

  HostSymBuffer(HostSymBuffer&&) noexcept = default;
  HostSymBuffer& operator=(HostSymBuffer&&) noexcept = default;

  const SymBufferLayout& layout() const { return view_.layout; }
  std::byte* base() const { return view_.base; }
  SymBufferView view() const { return view_; }
  RingView ring(std::uint32_t channel, std::uint32_t rank, Direction d) const {
    return RingView(view_, view_.layout.ring_index(channel, rank), d);
  }
  // Sets every head and tail to 0 (rings empty). Not while rings are in use.
  void reset_positions();

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  HostSymBuffer() = default;
  std::unique_ptr<std::byte, Free> owned_;
  SymBufferView view_{};
};

// Sets every ring's head and tail to 0 (all rings empty); the rest of each
// ChannelMeta is left as it is.
void reset_positions(const SymBufferView& view);

// Moves every send ring's readable bytes into the recv ring of the same
// (channel, rank), as a transport whose peer echoes what it receives would:
// the test and benchmark stand-in for a server. Errors: kTooLarge (naming
// channel, rank, head, tail) when a recv ring has no room; earlier rings
// have then been moved.
Status loopback(const SymBufferView& view);

}  // namespace ember::gpu
