#include "common/transport/shm/lane.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

namespace ember::transport::shm {

Result<Lane> Lane::create(const LaneGeometry& geometry, int* fd_out) {
  const std::size_t bytes = geometry.total_bytes();
  const int fd = ::memfd_create("ember-shm-lane", MFD_CLOEXEC);
  if (fd < 0) return make_sys_error(errno, "memfd_create for an shm lane");
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    return make_sys_error(err, "ftruncate shm lane to {} bytes", bytes);
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    return make_sys_error(err, "mmap shm lane of {} bytes", bytes);
  }
  Lane lane;
  lane.base_ = static_cast<std::byte*>(p);
  lane.bytes_ = bytes;
  lane.geometry_ = geometry;
  // The memfd is zero-filled: every atomic starts at 0. Construct them in
  // place (a no-op for lock-free atomics, but it makes the objects exist).
  auto* ctrl = ::new (p) LaneControl();
  ctrl->config.magic = kLaneMagic;
  ctrl->config.version = kLaneVersion;
  ctrl->config.slot_bytes = geometry.slot_bytes;
  ctrl->config.num_slots = geometry.num_slots;
  ctrl->config.credits = geometry.credits;
  *fd_out = fd;
  return lane;
}

Result<Lane> Lane::attach(int fd, const LaneGeometry& expected) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return make_sys_error(errno, "fstat of the peer's shm lane");
  const std::size_t bytes = expected.total_bytes();
  if (static_cast<std::size_t>(st.st_size) != bytes) {
    return make_error(ErrorCode::kProtocol,
                      "the peer's shm lane is {} bytes, expected {} (different ring_buffer_size or "
                      "batch_threshold on the two sides?)",
                      st.st_size, bytes);
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) return make_sys_error(errno, "mmap of the peer's shm lane");
  Lane lane;
  lane.base_ = static_cast<std::byte*>(p);
  lane.bytes_ = bytes;
  lane.geometry_ = expected;
  const LaneConfig& c = lane.control().config;
  if (c.magic != kLaneMagic || c.version != kLaneVersion || c.slot_bytes != expected.slot_bytes ||
      c.num_slots != expected.num_slots || c.credits != expected.credits) {
    return make_error(ErrorCode::kProtocol,
                      "the peer's shm lane has magic {:#x} version {} slots {}x{} B credits {}; "
                      "expected {:#x} version {} slots {}x{} B credits {}",
                      c.magic, c.version, c.num_slots, c.slot_bytes, c.credits, kLaneMagic,
                      kLaneVersion, expected.num_slots, expected.slot_bytes, expected.credits);
  }
  return lane;
}

Lane& Lane::operator=(Lane&& other) noexcept {
  if (this != &other) {
    if (base_ != nullptr) ::munmap(base_, bytes_);
    base_ = other.base_;
    bytes_ = other.bytes_;
    geometry_ = other.geometry_;
    other.base_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

Lane::~Lane() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
}

}  // namespace ember::transport::shm
