// Payload: float32 tensor elements handed to a shard (a gradient or initial
// values) together with whatever keeps them alive.
//
// A large message's bytes are adopted without a copy: the transport Buffer
// (a receive-pool block for tcp, a view of the worker's block for shm) moves
// into the Payload and is released when the shard is done with it (after the
// optimizer consumed it, or after a BSP round folded it). A small message
// lives in the transport's batch buffer only during the receive callback, so
// it is copied once into heap memory: that is the one copy of the small
// path. Misaligned large payloads (not a multiple of 4 bytes from an aligned
// base: only a peer that breaks the layout rules can cause it) are copied too.
//
// Thread-safety: a plain move-only value; it may be moved to and destroyed on
// any thread (Buffer's release is thread-safe).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "common/transport/buffer.h"

namespace ember::server {

class Payload {
 public:
  Payload() = default;
  Payload(Payload&&) noexcept = default;
  Payload& operator=(Payload&&) noexcept = default;

  // Copies `bytes` (a whole number of float32) into new heap memory.
  static Payload copy_of(std::span<const std::byte> bytes);
  // Adopts `buffer`; the elements are bytes [offset_bytes, offset_bytes +
  // 4 * num_elements) of it. pre: that range lies within buffer.size().
  static Payload adopt(transport::Buffer buffer, std::size_t offset_bytes, std::size_t num_elements);
  // Test helper: copies `values`.
  static Payload of(std::span<const float> values);

  std::span<const float> values() const noexcept { return {data_, size_}; }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0 && !owner_; }
  // Releases the memory now (a folded BSP contribution frees its block early).
  void reset() noexcept {
    owner_.reset();
    data_ = nullptr;
    size_ = 0;
    is_copy_ = false;
  }
  // Keeps the elements in a heap copy and releases an adopted buffer now:
  // over shm that buffer is the worker's own pool block, which the worker
  // gets back only at its release, so a contribution the shard must keep
  // for a round that cannot complete (a failed rank) would otherwise hold the
  // worker's push forever. No-op for a copy or an empty Payload.
  void detach();

 private:
  transport::Buffer owner_;
  const float* data_ = nullptr;
  std::size_t size_ = 0;
  bool is_copy_ = false;  // the elements are this Payload's own heap copy (copy_of)
};

}  // namespace ember::server
