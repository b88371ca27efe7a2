// Linux calls behind the page pool; see os_memory.h for each contract.
#include "common/memory/os_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>

#include "common/base/check.h"
#include "common/base/constants.h"

#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21U << 26)  // HUGETLB_FLAG_ENCODE_2MB (linux/memfd.h)
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // asm-generic/mman-common.h, Linux 5.14
#endif

namespace ember::memory::os {
namespace {

// Whole file as text; empty on any error (sysfs/procfs files are small or
// streamed, and a missing file is a normal answer here).
std::string read_text_file(const char* path) {
  std::string out;
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[16384];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

std::uint64_t parse_u64_prefix(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  std::uint64_t value = 0;
  std::from_chars(text.data(), text.data() + text.size(), value);
  return value;
}

}  // namespace

Result<std::string> parse_sysfs_choice(std::string_view text) {
  const auto open = text.find('[');
  const auto close = open == std::string_view::npos ? open : text.find(']', open);
  if (open == std::string_view::npos || close == std::string_view::npos || close == open + 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "sysfs choice '{}' has no selected [word]", text);
  }
  return std::string(text.substr(open + 1, close - open - 1));
}

ShmemThpPolicy read_shmem_thp_policy() {
  static constexpr const char* kPerSize =
      "/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled";
  static constexpr const char* kTop = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
  auto per_size = parse_sysfs_choice(read_text_file(kPerSize));
  if (per_size && *per_size != "inherit") return {*per_size, kPerSize};
  auto top = parse_sysfs_choice(read_text_file(kTop));
  if (top) return {*top, kTop};
  return {"", kTop};
}

bool shmem_thp_policy_allows_madvise(std::string_view policy) noexcept {
  return policy == "always" || policy == "within_size" || policy == "advise" || policy == "force";
}

HugetlbCounts read_hugetlb_counts() {
  HugetlbCounts counts;
  counts.free_pages =
      parse_u64_prefix(read_text_file("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages"));
  counts.total_pages =
      parse_u64_prefix(read_text_file("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"));
  return counts;
}

Result<int> create_memfd(std::string_view name, bool hugetlb, std::size_t length_bytes) {
  static constexpr std::size_t kMaxNameBytes = 249;  // MFD_NAME_MAX_LEN in mm/memfd.c
  std::string name_z(name.substr(0, kMaxNameBytes));
  unsigned flags = MFD_CLOEXEC;
  if (hugetlb) flags |= MFD_HUGETLB | MFD_HUGE_2MB;
  const int fd = ::memfd_create(name_z.c_str(), flags);
  if (fd < 0) {
    return make_sys_error(errno, "memfd_create('{}'{}) failed", name_z,
                          hugetlb ? ", MFD_HUGETLB" : "");
  }
  if (::ftruncate(fd, static_cast<off_t>(length_bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    return make_sys_error(err, "ftruncate of memfd '{}' to {} bytes failed", name_z, length_bytes);
  }
  return fd;
}

Result<std::byte*> map_shared_aligned(int fd, std::size_t length_bytes, std::size_t align_bytes,
                                      bool populate) {
  EMBER_CHECK(align_bytes >= kSmallPageBytes && (align_bytes & (align_bytes - 1)) == 0);
  const std::size_t reserve_bytes = length_bytes + align_bytes;
  void* reserved = ::mmap(nullptr, reserve_bytes, PROT_NONE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) {
    return make_sys_error(errno, "reserving {} bytes of address space failed", reserve_bytes);
  }
  const auto reserved_addr = reinterpret_cast<std::uintptr_t>(reserved);
  const std::uintptr_t aligned = (reserved_addr + align_bytes - 1) & ~(align_bytes - 1);
  int flags = MAP_SHARED | MAP_FIXED;
  if (populate) flags |= MAP_POPULATE;
  void* mapped = ::mmap(reinterpret_cast<void*>(aligned), length_bytes, PROT_READ | PROT_WRITE,
                        flags, fd, 0);
  if (mapped == MAP_FAILED) {
    const int err = errno;
    ::munmap(reserved, reserve_bytes);
    return make_sys_error(err, "mmap of fd {} ({} bytes, MAP_SHARED) failed", fd, length_bytes);
  }
  // Return the unused head and tail of the reservation.
  if (aligned > reserved_addr) ::munmap(reserved, aligned - reserved_addr);
  const std::uintptr_t tail = aligned + length_bytes;
  const std::uintptr_t reserved_end = reserved_addr + reserve_bytes;
  if (reserved_end > tail) ::munmap(reinterpret_cast<void*>(tail), reserved_end - tail);
  return static_cast<std::byte*>(mapped);
}

void unmap(std::byte* base, std::size_t length_bytes) noexcept {
  if (base == nullptr) return;
  const int rc = ::munmap(base, length_bytes);
  EMBER_CHECK_MSG(rc == 0, "munmap({}, {}) failed: errno {}", static_cast<void*>(base),
                  length_bytes, errno);
}

Status advise_hugepage(std::byte* base, std::size_t length_bytes) {
  if (::madvise(base, length_bytes, MADV_HUGEPAGE) != 0) {
    return make_sys_error(errno, "madvise(MADV_HUGEPAGE) on {} bytes failed", length_bytes);
  }
  return ok_status();
}

Status populate_write(std::byte* base, std::size_t length_bytes) {
  if (::madvise(base, length_bytes, MADV_POPULATE_WRITE) == 0) return ok_status();
  const int err = errno;
  if (err != EINVAL) {
    return make_sys_error(err, "pre-faulting {} bytes (MADV_POPULATE_WRITE) failed", length_bytes);
  }
  // Older kernel: fault each page in by writing to it. The memfd is fresh,
  // so every byte is zero and writing zero changes nothing.
  for (std::size_t off = 0; off < length_bytes; off += kSmallPageBytes) {
    *reinterpret_cast<volatile unsigned char*>(base + off) = 0;
  }
  return ok_status();
}

VmaInfo parse_smaps_for(std::string_view text, std::uintptr_t start) {
  VmaInfo info;
  bool inside = false;
  while (!text.empty()) {
    const auto eol = text.find('\n');
    std::string_view line = text.substr(0, eol);
    text.remove_prefix(eol == std::string_view::npos ? text.size() : eol + 1);
    const auto first_space = line.find(' ');
    const std::string_view first = line.substr(0, first_space);
    if (first.empty()) continue;
    if (first.back() != ':') {
      // A mapping header: "start-end perms offset dev inode [path]".
      if (inside) break;  // the mapping we wanted has ended
      const auto dash = first.find('-');
      std::uintptr_t begin = 0;
      const auto [ptr, ec] = std::from_chars(first.data(), first.data() + dash, begin, 16);
      inside = dash != std::string_view::npos && ec == std::errc() && begin == start;
      (void)ptr;
      if (inside) info.found = true;
      continue;
    }
    if (!inside) continue;
    const std::string_view key = first.substr(0, first.size() - 1);
    const std::string_view rest =
        first_space == std::string_view::npos ? std::string_view() : line.substr(first_space);
    const std::uint64_t value = parse_u64_prefix(rest);
    if (key == "THPeligible") {
      info.thp_eligible = value != 0;
    } else if (key == "ShmemPmdMapped" || key == "FilePmdMapped") {
      info.pmd_mapped_bytes += value << 10;
    } else if (key == "Rss") {
      info.rss_bytes = value << 10;
    } else if (key == "Shared_Hugetlb" || key == "Private_Hugetlb") {
      info.hugetlb_bytes += value << 10;
    }
  }
  return info;
}

VmaInfo read_vma_info(const void* start) {
  return parse_smaps_for(read_text_file("/proc/self/smaps"),
                         reinterpret_cast<std::uintptr_t>(start));
}

}  // namespace ember::memory::os
