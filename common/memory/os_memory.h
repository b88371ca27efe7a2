// OS layer of the page pool: the few Linux calls behind one contract each
// (memfd, aligned shared mappings, pre-faulting, hugepage policy probes).
// Kept apart so the policy in page_pool.cc reads as policy, and so tests can
// check the parsers without touching kernel settings.
//
// Every function is cold-path (pool creation and peer mapping only), may
// allocate, and is safe to call from any thread. Errors are ErrorCode::kIo
// with errno, unless stated otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/base/error.h"

namespace ember::memory::os {

// The selected word of a sysfs multiple-choice file, e.g. "never" from
// "always within_size advise [never] deny force". Error kInvalidArgument when
// no word is bracketed.
Result<std::string> parse_sysfs_choice(std::string_view text);

// Effective transparent-hugepage policy for 2 MiB pages of shared memory
// (memfd/tmpfs): the per-size file
// /sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled unless it
// says "inherit" or is absent, else the top-level .../shmem_enabled. Note that
// memfd follows shmem_enabled, not .../enabled (which governs anonymous memory).
struct ShmemThpPolicy {
  std::string value;  // "always", "within_size", "advise", "never", "deny", "force", or "" when unreadable
  std::string path;   // the file the value came from (for messages)
};
ShmemThpPolicy read_shmem_thp_policy();

// True when `policy` lets a 2 MiB-aligned memfd mapping that was given
// madvise(MADV_HUGEPAGE) be backed by transparent hugepages.
bool shmem_thp_policy_allows_madvise(std::string_view policy) noexcept;

// Free and total 2 MiB hugetlb pages (from /sys/kernel/mm/hugepages/
// hugepages-2048kB/); both 0 when the files cannot be read.
struct HugetlbCounts {
  std::uint64_t free_pages = 0;
  std::uint64_t total_pages = 0;
};
HugetlbCounts read_hugetlb_counts();

// memfd_create(name, MFD_CLOEXEC [| MFD_HUGETLB | MFD_HUGE_2MB]) and
// ftruncate to length_bytes. pre: length_bytes > 0 (a multiple of 2 MiB for
// hugetlb). Returns the fd; the caller owns it. The name is truncated to what
// the kernel accepts (249 bytes).
Result<int> create_memfd(std::string_view name, bool hugetlb, std::size_t length_bytes);

// Maps [0, length_bytes) of `fd` MAP_SHARED read/write at an address aligned
// to `align_bytes` (a power of two, >= 4 KiB): reserves length + align of
// address space, maps the fd over the aligned part with MAP_FIXED and returns
// the rest. The alignment lets transparent hugepages use PMD mappings and
// gives peers and RDMA a 2 MiB-aligned base. With `populate`, MAP_POPULATE
// is passed (used for peer mappings that only need page tables). ENOMEM from
// a hugetlb fd means the hugepage reservation failed. Unmap with unmap().
Result<std::byte*> map_shared_aligned(int fd, std::size_t length_bytes, std::size_t align_bytes,
                                      bool populate);

// munmap; errors are bugs here (bad pointer/length) and abort.
void unmap(std::byte* base, std::size_t length_bytes) noexcept;

// madvise(MADV_HUGEPAGE). Error kIo with errno.
Status advise_hugepage(std::byte* base, std::size_t length_bytes);

// Allocates and maps every page of [base, base + length) for writing so later
// stores do not fault: madvise(MADV_POPULATE_WRITE) (Linux >= 5.14), or, where
// the kernel lacks it (EINVAL), one write per 4 KiB page (the bytes are
// zero after memfd creation, so writing zero changes nothing). ENOMEM/EFAULT
// mean the memory could not be provided (e.g. hugetlb pages taken meanwhile).
Status populate_write(std::byte* base, std::size_t length_bytes);

// What /proc/self/smaps says about the mapping that starts at `start`.
struct VmaInfo {
  bool found = false;                 // a mapping starts exactly at `start`
  bool thp_eligible = false;          // "THPeligible: 1"
  std::uint64_t pmd_mapped_bytes = 0;  // ShmemPmdMapped + FilePmdMapped
  std::uint64_t rss_bytes = 0;        // Rss
  std::uint64_t hugetlb_bytes = 0;    // Shared_Hugetlb + Private_Hugetlb
};
// Parses smaps text (exposed for tests). `start` is the mapping's first byte.
VmaInfo parse_smaps_for(std::string_view smaps_text, std::uintptr_t start);
// Reads /proc/self/smaps; found == false when unreadable.
VmaInfo read_vma_info(const void* start);

}  // namespace ember::memory::os
