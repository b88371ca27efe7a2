// Mapping of a peer's pool memfd; see mapped_region.h.
#include "common/memory/mapped_region.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <utility>

#include "common/base/constants.h"
#include "common/memory/os_memory.h"

namespace ember::memory {

Result<MappedRegion> MappedRegion::map(int fd, std::size_t length_bytes, bool populate) {
  if (fd < 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot map a peer's page pool: fd {} is not a file descriptor", fd);
  }
  if (length_bytes == 0 || length_bytes % kSmallPageBytes != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot map a peer's page pool: length {} bytes is not a positive "
                      "multiple of 4096",
                      length_bytes);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return make_sys_error(errno, "cannot map a peer's page pool: fstat(fd {}) failed", fd);
  }
  if (st.st_size < 0 || static_cast<std::uint64_t>(st.st_size) < length_bytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot map a peer's page pool: fd {} holds {} bytes, fewer than the {} "
                      "announced",
                      fd, static_cast<long long>(st.st_size), length_bytes);
  }
  auto base = os::map_shared_aligned(fd, length_bytes, kHugePageBytes, populate);
  if (!base) {
    return tl::unexpected(std::move(base.error()).with_context("cannot map a peer's page pool"));
  }
  MappedRegion region(*base, length_bytes);
  // Not inherited by a child of fork(): the peer counts on this process's
  // access ending when it exits (the shm transport watches its pidfd before
  // it reuses memory it lent or that we could write).
  if (::madvise(*base, length_bytes, MADV_DONTFORK) != 0) {
    return make_sys_error(errno, "cannot map a peer's page pool: madvise(MADV_DONTFORK) on {} bytes failed",
                          length_bytes);
  }
  return region;
}

MappedRegion::MappedRegion(MappedRegion&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)),
      length_bytes_(std::exchange(other.length_bytes_, 0)) {}

MappedRegion& MappedRegion::operator=(MappedRegion&& other) noexcept {
  if (this != &other) {
    reset();
    base_ = std::exchange(other.base_, nullptr);
    length_bytes_ = std::exchange(other.length_bytes_, 0);
  }
  return *this;
}

MappedRegion::~MappedRegion() { reset(); }

void MappedRegion::reset() noexcept {
  os::unmap(base_, length_bytes_);
  base_ = nullptr;
  length_bytes_ = 0;
}

Result<std::span<std::byte>> MappedRegion::view(std::uint64_t offset_bytes,
                                                std::size_t size_bytes) const {
  if (offset_bytes > length_bytes_ || size_bytes > length_bytes_ - offset_bytes) {
    return make_error(ErrorCode::kInvalidArgument,
                      "peer block [{}, +{}) lies outside the mapped region of {} bytes",
                      offset_bytes, size_bytes, length_bytes_);
  }
  return std::span<std::byte>(base_ + offset_bytes, size_bytes);
}

}  // namespace ember::memory
