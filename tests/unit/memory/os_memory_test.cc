#include "common/memory/os_memory.h"

#include <unistd.h>

#include <gtest/gtest.h>

namespace ember::memory::os {
namespace {

TEST(OsMemory, ParsesTheSelectedSysfsChoice) {
  auto v = parse_sysfs_choice("always within_size advise [never] deny force\n");
  ASSERT_TRUE(v.has_value()) << v.error().to_string();
  EXPECT_EQ(*v, "never");
  auto first = parse_sysfs_choice("[always] madvise never");
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(*first, "always");
}

TEST(OsMemory, SysfsChoiceWithoutBracketIsAnError) {
  for (const char* text : {"", "always madvise never", "always [] never", "[never"}) {
    auto v = parse_sysfs_choice(text);
    ASSERT_FALSE(v.has_value()) << "'" << text << "'";
    EXPECT_EQ(v.error().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(v.error().message().find("selected"), std::string::npos) << v.error().message();
  }
}

TEST(OsMemory, ShmemPoliciesThatHonourMadvise) {
  EXPECT_TRUE(shmem_thp_policy_allows_madvise("advise"));
  EXPECT_TRUE(shmem_thp_policy_allows_madvise("always"));
  EXPECT_TRUE(shmem_thp_policy_allows_madvise("within_size"));
  EXPECT_TRUE(shmem_thp_policy_allows_madvise("force"));
  EXPECT_FALSE(shmem_thp_policy_allows_madvise("never"));
  EXPECT_FALSE(shmem_thp_policy_allows_madvise("deny"));
  EXPECT_FALSE(shmem_thp_policy_allows_madvise(""));
}

constexpr const char* kSmaps =
    "7f0000000000-7f0000400000 rw-s 00000000 00:01 1025   /memfd:ember-pool:a (deleted)\n"
    "Size:               4096 kB\n"
    "Rss:                4096 kB\n"
    "ShmemPmdMapped:     2048 kB\n"
    "FilePmdMapped:         0 kB\n"
    "Shared_Hugetlb:        0 kB\n"
    "Private_Hugetlb:       0 kB\n"
    "THPeligible:           1\n"
    "VmFlags: rd wr sh mr mw me ms hg\n"
    "7f0000400000-7f0000403000 rw-p 00000000 00:00 0\n"
    "Size:                 12 kB\n"
    "Rss:                   8 kB\n"
    "ShmemPmdMapped:        0 kB\n"
    "THPeligible:           0\n";

TEST(OsMemory, ReadsTheMappingThatStartsAtTheAddress) {
  const VmaInfo a = parse_smaps_for(kSmaps, 0x7f0000000000ULL);
  EXPECT_TRUE(a.found);
  EXPECT_TRUE(a.thp_eligible);
  EXPECT_EQ(a.pmd_mapped_bytes, 2048u << 10);
  EXPECT_EQ(a.rss_bytes, 4096u << 10);
  const VmaInfo b = parse_smaps_for(kSmaps, 0x7f0000400000ULL);
  EXPECT_TRUE(b.found);
  EXPECT_FALSE(b.thp_eligible) << "fields of the first mapping must not leak into the second";
  EXPECT_EQ(b.rss_bytes, 8u << 10);
  EXPECT_FALSE(parse_smaps_for(kSmaps, 0x7f0000001000ULL).found)
      << "an address inside a mapping is not its start";
}

TEST(OsMemory, ReadsThisProcessSmaps) {
  auto fd = create_memfd("os-memory-test", false, 1 << 21);
  ASSERT_TRUE(fd.has_value()) << fd.error().to_string();
  auto base = map_shared_aligned(*fd, 1 << 21, 1 << 21, /*populate=*/true);
  ASSERT_TRUE(base.has_value()) << base.error().to_string();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(*base) % (1 << 21), 0u);
  const VmaInfo info = read_vma_info(*base);
  EXPECT_TRUE(info.found);
  EXPECT_EQ(info.rss_bytes, std::uint64_t{1} << 21) << "MAP_POPULATE maps every page";
  unmap(*base, 1 << 21);
  ::close(*fd);
}

}  // namespace
}  // namespace ember::memory::os
