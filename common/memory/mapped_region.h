// A peer's page pool mapped into this process (same-host shm transport).
//
// The peer sends its pool's memfd over a Unix socket (SCM_RIGHTS) together
// with the region length; MappedRegion::map maps it read/write and shared, so
// a block the peer filled at offset X is read here at base() + X with no copy.
// The mapping is 2 MiB-aligned and, by default, its page tables are populated
// at map time (MAP_POPULATE) so the first read of each page does not fault.
//
// Ownership: MappedRegion owns the mapping (unmapped on destruction) but not
// the fd: the caller may close it right after map() returns. The mapping is
// not inherited across fork() (MADV_DONTFORK): the peer's memory is reachable
// from this process only, so it is out of reach once this process exits.
// Thread-safety: a MappedRegion is immutable after map(); its const members
// may be called from any thread. Moving it is not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "common/base/error.h"

namespace ember::memory {

class MappedRegion {
 public:
  MappedRegion() = default;
  // Maps [0, length_bytes) of `fd`. Blocking (one mmap; with `populate`,
  // proportional to length). Errors:
  //   kInvalidArgument: fd < 0, length_bytes == 0 or not a multiple of 4 KiB,
  //                     or the file is shorter than length_bytes (a mapping
  //                     past the end would crash on access with SIGBUS);
  //   kIo: fstat, mmap or madvise failed (errno kept; e.g. EBADF for a
  //        closed fd).
  static Result<MappedRegion> map(int fd, std::size_t length_bytes, bool populate = true);

  MappedRegion(MappedRegion&& other) noexcept;
  MappedRegion& operator=(MappedRegion&& other) noexcept;
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  ~MappedRegion();

  std::byte* base() const noexcept { return base_; }
  std::size_t length_bytes() const noexcept { return length_bytes_; }
  bool empty() const noexcept { return base_ == nullptr; }

  // [base() + offset_bytes, + size_bytes), bounds-checked against the region
  // (offsets come from a peer and are not trusted). Error kInvalidArgument
  // naming the offset, size and region length when out of range.
  Result<std::span<std::byte>> view(std::uint64_t offset_bytes, std::size_t size_bytes) const;

  bool contains(const void* p) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    return b >= base_ && b < base_ + length_bytes_;
  }

 private:
  MappedRegion(std::byte* base, std::size_t length_bytes) noexcept
      : base_(base), length_bytes_(length_bytes) {}
  void reset() noexcept;

  std::byte* base_ = nullptr;
  std::size_t length_bytes_ = 0;
};

}  // namespace ember::memory
