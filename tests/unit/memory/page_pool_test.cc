#include "common/memory/page_pool.h"

#include <sys/resource.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include "common/base/logging.h"
#include "common/memory/os_memory.h"

namespace ember::memory {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<PagePool> make_pool(std::size_t pages, PoolOptions options = {}) {
  options.prealloc_pages = pages;
  if (options.name == "pool") {
    options.name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  }
  auto pool = PagePool::create(options);
  EXPECT_TRUE(pool.has_value()) << pool.error().to_string();
  return pool ? std::move(*pool) : nullptr;
}

// Everything allocatable of one class, in allocation order.
std::vector<Block> drain(PagePool& pool, std::size_t bytes) {
  std::vector<Block> blocks;
  for (;;) {
    auto b = pool.allocate(bytes);
    if (!b) {
      EXPECT_EQ(b.error().code(), ErrorCode::kPoolExhausted) << b.error().to_string();
      return blocks;
    }
    blocks.push_back(*b);
  }
}

std::uint64_t minor_faults_this_thread() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  return static_cast<std::uint64_t>(ru.ru_minflt);
}

// ---------------------------------------------------------------- creation

TEST(PagePool, CreateRejectsZeroPages) {
  PoolOptions o;
  o.prealloc_pages = 0;
  auto pool = PagePool::create(o);
  ASSERT_FALSE(pool.has_value());
  EXPECT_EQ(pool.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(pool.error().message(), HasSubstr("prealloc_pages is 0"));
}

TEST(PagePool, CreateRejectsTooManyPages) {
  PoolOptions o;
  o.prealloc_pages = kMaxPreallocPages + 1;
  auto pool = PagePool::create(o);
  ASSERT_FALSE(pool.has_value());
  EXPECT_EQ(pool.error().code(), ErrorCode::kTooLarge);
  EXPECT_THAT(pool.error().message(), HasSubstr("prealloc_pages"));
  EXPECT_THAT(pool.error().message(), HasSubstr("maximum"));
}

TEST(PagePool, RegionIsAMemfdOfTheRequestedPages) {
  auto pool = make_pool(3);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->length_bytes(), 3 * kPoolPageBytes);
  EXPECT_EQ(pool->prealloc_pages(), 3u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(pool->base()) % kPoolPageBytes, 0u)
      << "2 MiB-aligned base";
  struct stat st {};
  ASSERT_EQ(fstat(pool->fd(), &st), 0);
  EXPECT_EQ(static_cast<std::size_t>(st.st_size), pool->length_bytes());
  EXPECT_TRUE(pool->contains(pool->base()));
  EXPECT_TRUE(pool->contains(pool->base() + pool->length_bytes() - 1));
  EXPECT_FALSE(pool->contains(pool->base() + pool->length_bytes()));
  EXPECT_FALSE(pool->contains(pool->base() - 1));
}

// ---------------------------------------------------------------- alignment, classes

TEST(PagePool, EveryBlockIs4KibAlignedAndInsideTheRegion) {
  auto pool = make_pool(64);
  ASSERT_NE(pool, nullptr);
  std::vector<Block> blocks;
  const std::size_t sizes[] = {1, 4096, 5000, 20000, 70000, 300000, 1 << 20, (1 << 20) + 1,
                               (4 << 20) + 3, 16 << 20};
  for (int round = 0; round < 3; ++round) {
    for (std::size_t bytes : sizes) {
      auto b = pool->allocate(bytes);
      ASSERT_TRUE(b.has_value()) << bytes << ": " << b.error().to_string();
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % kBlockAlignBytes, 0u);
      EXPECT_EQ(b->offset_bytes() % kBlockAlignBytes, 0u);
      EXPECT_EQ(b->data(), pool->base() + b->offset_bytes());
      EXPECT_EQ(b->size_bytes(), bytes);
      EXPECT_GE(b->capacity_bytes(), bytes);
      EXPECT_LE(b->offset_bytes() + b->capacity_bytes(), pool->length_bytes());
      EXPECT_TRUE(pool->contains(b->data()));
      blocks.push_back(*b);
    }
  }
  std::sort(blocks.begin(), blocks.end(),
            [](const Block& a, const Block& b) { return a.offset_bytes() < b.offset_bytes(); });
  for (std::size_t i = 1; i < blocks.size(); ++i) {
    EXPECT_LE(blocks[i - 1].offset_bytes() + blocks[i - 1].capacity_bytes(),
              blocks[i].offset_bytes())
        << "blocks " << i - 1 << " and " << i << " overlap";
  }
  for (const Block& b : blocks) pool->free(b);
}

TEST(PagePool, AllocateChoosesTheSmallestClassThatHolds) {
  auto pool = make_pool(64);
  ASSERT_NE(pool, nullptr);
  const struct {
    std::size_t bytes;
    std::size_t size_class;
  } cases[] = {{0, 0},          {1, 0},          {4096, 0},           {4097, 1},
               {16384, 1},      {16385, 2},      {65536, 2},          {65537, 3},
               {262144, 3},     {262145, 4},     {1 << 20, 4},        {(1 << 20) + 1, 5},
               {4 << 20, 5},    {(4 << 20) + 1, 6}, {16 << 20, 6},    {(16 << 20) + 1, 7}};
  for (const auto& tc : cases) {
    auto b = pool->allocate(tc.bytes);
    ASSERT_TRUE(b.has_value()) << tc.bytes << ": " << b.error().to_string();
    EXPECT_EQ(b->size_class(), tc.size_class) << tc.bytes << " bytes";
    EXPECT_EQ(b->capacity_bytes(), size_class_bytes(tc.size_class));
    pool->free(*b);
  }
}

TEST(PagePool, LargestClassHoldsA64MibMessage) {
  auto pool = make_pool(40);  // 80 MiB
  ASSERT_NE(pool, nullptr);
  auto b = pool->allocate(64 << 20);
  ASSERT_TRUE(b.has_value()) << b.error().to_string();
  EXPECT_EQ(b->size_class(), kNumSizeClasses - 1);
  std::memset(b->data(), 0xab, b->size_bytes());  // every byte is writable
  pool->free(*b);
}

TEST(PagePool, TooLargeRequestNamesTheLargestClass) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  auto b = pool->allocate(kMaxBlockBytes + 1);
  ASSERT_FALSE(b.has_value());
  EXPECT_EQ(b.error().code(), ErrorCode::kTooLarge);
  EXPECT_THAT(b.error().message(), HasSubstr("64 MiB"));
  EXPECT_THAT(b.error().message(), HasSubstr(std::to_string(kMaxBlockBytes + 1)));
}

TEST(PagePool, ZeroBytesGetASmallestBlock) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  auto b = pool->allocate(0);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->size_bytes(), 0u);
  EXPECT_EQ(b->capacity_bytes(), kMinBlockBytes);
  pool->free(*b);
}

// ---------------------------------------------------------------- reuse

TEST(PagePool, FreedBlockIsHandedOutAgain) {
  auto pool = make_pool(4);
  ASSERT_NE(pool, nullptr);
  auto a = pool->allocate(10000);
  ASSERT_TRUE(a.has_value());
  const auto offset = a->offset_bytes();
  pool->free(*a);
  auto b = pool->allocate(9000);  // same class
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->offset_bytes(), offset) << "the last freed block comes back first";
  pool->free(*b);
}

TEST(PagePool, FreedBlocksAreReusedWithoutCarvingMore) {
  auto pool = make_pool(8);
  ASSERT_NE(pool, nullptr);
  for (std::size_t bytes : {std::size_t{4096}, std::size_t{60000}, std::size_t{1} << 20}) {
    std::vector<Block> first;
    for (int i = 0; i < 100 && first.size() < 8; ++i) first.push_back(*pool->allocate(bytes));
    const auto carved = pool->stats().carved_bytes;
    for (const Block& b : first) pool->free(b);
    for (int round = 0; round < 5; ++round) {
      std::vector<Block> again;
      for (std::size_t i = 0; i < first.size(); ++i) {
        auto b = pool->allocate(bytes);
        ASSERT_TRUE(b.has_value());
        again.push_back(*b);
      }
      for (const Block& b : again) pool->free(b);
    }
    EXPECT_EQ(pool->stats().carved_bytes, carved) << bytes << "-byte blocks were carved anew";
  }
}

TEST(PagePool, AllBlocksOfAFullPoolComeBackAfterFree) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  auto all = drain(*pool, 4096);
  ASSERT_EQ(all.size(), kPoolPageBytes / 4096);
  for (const Block& b : all) pool->free(b);
  auto again = drain(*pool, 4096);
  EXPECT_EQ(again.size(), all.size());
  for (const Block& b : again) pool->free(b);
}

TEST(PagePool, BlockFreedOnAnotherThreadIsReusable) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  auto all = drain(*pool, 16384);
  ASSERT_EQ(all.size(), kPoolPageBytes / 16384);
  std::thread other([&] {
    for (const Block& b : all) pool->free(b);
  });  // exits: its cache goes back to the shared list
  other.join();
  auto again = drain(*pool, 16384);
  EXPECT_EQ(again.size(), all.size());
  for (const Block& b : again) pool->free(b);
  EXPECT_EQ(pool->stats().classes[1].blocks_in_use, 0u);
}

TEST(PagePool, FlushThreadCacheReturnsCachedBlocksToTheSharedList) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  ASSERT_GT(pool->thread_cache_capacity(0), 0u);
  auto all = drain(*pool, 4096);
  for (const Block& b : all) pool->free(b);
  auto before = pool->stats().classes[0];
  EXPECT_EQ(before.blocks_cached, pool->thread_cache_capacity(0));
  EXPECT_EQ(before.blocks_cached + before.blocks_free, all.size());
  pool->flush_thread_cache();
  auto after = pool->stats().classes[0];
  EXPECT_EQ(after.blocks_cached, 0u);
  EXPECT_EQ(after.blocks_free, all.size());
}

TEST(PagePool, UniqueBlockFreesOnDestruction) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  {
    UniqueBlock owned(pool.get(), *pool->allocate(5000));
    EXPECT_EQ(pool->stats().classes[1].blocks_in_use, 1u);
    UniqueBlock moved = std::move(owned);
    EXPECT_FALSE(owned);
    EXPECT_TRUE(moved);
    EXPECT_EQ(pool->stats().classes[1].blocks_in_use, 1u);
  }
  EXPECT_EQ(pool->stats().classes[1].blocks_in_use, 0u);
}

// ---------------------------------------------------------------- exhaustion

TEST(PagePool, ExhaustionMessageNamesPagesClassAndKnobs) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  auto all = drain(*pool, 4096);
  EXPECT_EQ(all.size(), 512u) << "a 2 MiB region holds 512 blocks of 4 KiB";
  auto fail = pool->allocate(100);
  ASSERT_FALSE(fail.has_value());
  EXPECT_EQ(fail.error().code(), ErrorCode::kPoolExhausted);
  const std::string& m = fail.error().message();
  EXPECT_THAT(m, HasSubstr("no free 4 KiB block (size class 0 of 8)"));
  EXPECT_THAT(m, HasSubstr("1 of 1 pages"));
  EXPECT_THAT(m, HasSubstr("2 MiB of them in blocks in use"));
  EXPECT_THAT(m, HasSubstr("512 blocks in use"));
  EXPECT_THAT(m, HasSubstr("prealloc_pages (now 1)"));
  EXPECT_THAT(m, HasSubstr("batch_threshold"));
  EXPECT_THAT(m, HasSubstr(pool->name()));
  EXPECT_EQ(pool->stats().exhausted_count, 2u) << "drain's failure and this one";
  for (const Block& b : all) pool->free(b);
}

TEST(PagePool, RegionSmallerThanTheBlockSaysHowManyPagesAreNeeded) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  auto fail = pool->allocate(3 << 20);  // class 4 MiB
  ASSERT_FALSE(fail.has_value());
  EXPECT_EQ(fail.error().code(), ErrorCode::kPoolExhausted);
  EXPECT_THAT(fail.error().message(), HasSubstr("4 MiB block"));
  EXPECT_THAT(fail.error().message(), HasSubstr("at least 2"));
}

TEST(PagePool, FreeBlocksNeverChangeClass) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  auto a = pool->allocate(1 << 20);
  auto b = pool->allocate(1 << 20);
  ASSERT_TRUE(a && b);
  pool->free(*a);
  pool->free(*b);
  auto small = pool->allocate(4096);
  ASSERT_FALSE(small.has_value()) << "the region is carved into two 1 MiB blocks";
  EXPECT_EQ(small.error().code(), ErrorCode::kPoolExhausted);
  EXPECT_THAT(small.error().message(), HasSubstr("2 MiB lie free in other classes"));
  auto again = pool->allocate(1 << 20);
  ASSERT_TRUE(again.has_value()) << again.error().to_string();
  pool->free(*again);
}

TEST(PagePool, ExhaustionReportsBlocksParkedInOtherThreadsCaches) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  const std::size_t cached = pool->thread_cache_capacity(0);
  ASSERT_GT(cached, 0u);
  std::mutex mu;
  std::condition_variable cv;
  bool freed = false;
  bool release = false;
  std::thread holder([&] {
    auto all = drain(*pool, 4096);
    for (const Block& b : all) pool->free(b);
    std::unique_lock<std::mutex> lock(mu);
    freed = true;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return freed; }));
  }
  auto mine = drain(*pool, 4096);
  EXPECT_EQ(mine.size(), 512 - cached) << "the holder's cache is out of reach while it lives";
  auto fail = pool->allocate(4096);
  ASSERT_FALSE(fail.has_value());
  EXPECT_THAT(fail.error().message(),
              HasSubstr(std::to_string(cached) + " parked in other threads' caches"));
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  holder.join();  // thread exit returns its cache
  auto more = drain(*pool, 4096);
  EXPECT_EQ(more.size(), cached);
  for (const Block& b : mine) pool->free(b);
  for (const Block& b : more) pool->free(b);
}

// ---------------------------------------------------------------- block_at

TEST(PagePool, BlockAtRebuildsABlockFromItsOffset) {
  auto pool = make_pool(2);
  ASSERT_NE(pool, nullptr);
  auto a = pool->allocate(70000);
  ASSERT_TRUE(a.has_value());
  std::memcpy(a->data(), "hello", 5);
  auto view = pool->block_at(a->offset_bytes(), 5);
  ASSERT_TRUE(view.has_value()) << view.error().to_string();
  EXPECT_EQ(view->data(), a->data());
  EXPECT_EQ(view->size_class(), a->size_class());
  EXPECT_EQ(view->capacity_bytes(), a->capacity_bytes());
  EXPECT_EQ(view->size_bytes(), 5u);
  EXPECT_EQ(std::memcmp(view->data(), "hello", 5), 0);
  pool->free(*view);  // the rebuilt view frees the block
  EXPECT_EQ(pool->stats().classes[a->size_class()].blocks_in_use, 0u);
}

TEST(PagePool, BlockAtRejectsOffsetsThatAreNotBlocks) {
  auto pool = make_pool(2);
  ASSERT_NE(pool, nullptr);
  auto a = pool->allocate(70000);  // 256 KiB class, offset 0
  ASSERT_TRUE(a.has_value());
  const struct {
    std::uint64_t offset;
    std::size_t size;
    const char* says;
  } cases[] = {
      {pool->length_bytes(), 1, "outside the region"},
      {~std::uint64_t{0}, 1, "outside the region"},
      {a->offset_bytes() + 100, 1, "not 4 KiB-aligned"},
      {a->offset_bytes() + 4096, 1, "not the start of a block"},
      {pool->length_bytes() - 4096, 1, "not the start of a block"},
      {a->offset_bytes(), a->capacity_bytes() + 1, "exceed the block's capacity"},
  };
  for (const auto& c : cases) {
    auto r = pool->block_at(c.offset, c.size);
    ASSERT_FALSE(r.has_value()) << c.offset;
    EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(r.error().message(), HasSubstr(c.says)) << c.offset;
  }
  pool->free(*a);
}

// ---------------------------------------------------------------- stats

TEST(PagePool, StatsCountBlocksPerClassAndTheHighWaterMark) {
  auto pool = make_pool(8);
  ASSERT_NE(pool, nullptr);
  PoolStats s0 = pool->stats();
  EXPECT_EQ(s0.total_pages, 8u);
  EXPECT_EQ(s0.region_bytes, 8 * kPoolPageBytes);
  EXPECT_EQ(s0.carved_bytes, 0u);
  EXPECT_EQ(s0.backing, pool->backing());

  std::vector<Block> small, mid;
  for (int i = 0; i < 3; ++i) small.push_back(*pool->allocate(100));
  for (int i = 0; i < 2; ++i) mid.push_back(*pool->allocate(200000));
  PoolStats s1 = pool->stats();
  EXPECT_EQ(s1.classes[0].blocks_in_use, 3u);
  EXPECT_EQ(s1.classes[3].blocks_in_use, 2u);
  EXPECT_EQ(s1.bytes_in_use, 3 * 4096u + 2 * 262144u);
  for (const auto& c : s1.classes) {
    EXPECT_EQ(c.blocks_carved, c.blocks_in_use + c.blocks_cached + c.blocks_free);
  }
  EXPECT_GE(s1.carved_bytes, s1.bytes_in_use);
  EXPECT_EQ(s1.pages_carved, (s1.carved_bytes + kPoolPageBytes - 1) / kPoolPageBytes);

  for (const Block& b : small) pool->free(b);
  for (const Block& b : mid) pool->free(b);
  PoolStats s2 = pool->stats();
  EXPECT_EQ(s2.bytes_in_use, 0u);
  EXPECT_EQ(s2.classes[0].blocks_in_use, 0u);
  EXPECT_EQ(s2.carved_bytes, s1.carved_bytes) << "the high-water mark does not go down";
}

// ---------------------------------------------------------------- pre-faulting

TEST(PagePool, PrefaultedBlocksDoNotFaultOnFirstWrite) {
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "a sanitizer's shadow memory faults on the first touch of every page";
#endif
  auto pool = make_pool(4);
  ASSERT_NE(pool, nullptr);
  std::vector<Block> blocks;
  for (int i = 0; i < 7; ++i) blocks.push_back(*pool->allocate(1 << 20));
  const auto before = minor_faults_this_thread();
  for (const Block& b : blocks) {
    for (std::size_t off = 0; off < b.capacity_bytes(); off += 4096) {
      b.data()[off] = std::byte{1};
    }
  }
  const auto faults = minor_faults_this_thread() - before;
  EXPECT_LE(faults, 2u) << "writes to 7 MiB of pre-faulted blocks faulted " << faults << " times";
  for (const Block& b : blocks) pool->free(b);
}

TEST(PagePool, WithoutPrefaultFirstWritesFault) {
  PoolOptions o;
  o.prefault = false;
  o.backing = BackingRequest::kPlain;
  auto pool = make_pool(4, o);
  ASSERT_NE(pool, nullptr);
  auto b = pool->allocate(4 << 20);
  ASSERT_TRUE(b.has_value());
  const auto before = minor_faults_this_thread();
  for (std::size_t off = 0; off < b->capacity_bytes(); off += 4096) b->data()[off] = std::byte{1};
  const auto faults = minor_faults_this_thread() - before;
  EXPECT_GE(faults, 100u) << "the measurement itself must see faults when there are some";
  pool->free(*b);
}

// ---------------------------------------------------------------- backing

TEST(PagePool, BackingNamesAndParsing) {
  EXPECT_EQ(backing_name(Backing::kHugetlb), "hugetlb");
  EXPECT_EQ(backing_name(Backing::kTransparentHuge), "thp");
  EXPECT_EQ(backing_name(Backing::kPlain), "plain");
  for (auto r : {BackingRequest::kAuto, BackingRequest::kHugetlb,
                 BackingRequest::kTransparentHuge, BackingRequest::kPlain}) {
    auto parsed = parse_backing_request(backing_request_name(r));
    ASSERT_TRUE(parsed.has_value());
    EXPECT_EQ(*parsed, r);
  }
  auto bad = parse_backing_request("huge");
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(bad.error().message(), HasSubstr("auto, hugetlb, thp, plain"));
  EXPECT_FALSE(backing_supports_sendfile(Backing::kHugetlb));
  EXPECT_TRUE(backing_supports_sendfile(Backing::kTransparentHuge));
  EXPECT_TRUE(backing_supports_sendfile(Backing::kPlain));
  EXPECT_THAT(std::string(sendfile_unsupported_reason(Backing::kHugetlb)), HasSubstr("EINVAL"));
  EXPECT_TRUE(sendfile_unsupported_reason(Backing::kPlain).empty());
}

TEST(PagePool, AutoFallsBackWhenHugetlbIsNotAvailable) {
  PoolOptions o;
  o.inject.deny_hugetlb = true;
  auto pool = make_pool(2, o);
  ASSERT_NE(pool, nullptr);
  EXPECT_NE(pool->backing(), Backing::kHugetlb);
  EXPECT_TRUE(pool->supports_sendfile());
  const bool thp_possible =
      os::shmem_thp_policy_allows_madvise(os::read_shmem_thp_policy().value);
  EXPECT_EQ(pool->backing(), thp_possible ? Backing::kTransparentHuge : Backing::kPlain);
  auto b = pool->allocate(4096);
  ASSERT_TRUE(b.has_value());
  pool->free(*b);
}

TEST(PagePool, AutoFallsBackToPlainPagesWhenNoHugepagesAtAll) {
  PoolOptions o;
  o.inject.deny_hugetlb = true;
  o.inject.deny_transparent_huge = true;
  auto pool = make_pool(2, o);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->backing(), Backing::kPlain);
  EXPECT_EQ(pool->stats().backing, Backing::kPlain);
  EXPECT_EQ(pool->stats().huge_mapped_bytes, 0u);
}

TEST(PagePool, AutoPicksTheBestBackingThisMachineOffers) {
  const auto counts = os::read_hugetlb_counts();
  const bool thp_possible =
      os::shmem_thp_policy_allows_madvise(os::read_shmem_thp_policy().value);
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  if (counts.free_pages >= 1) {
    EXPECT_EQ(pool->backing(), Backing::kHugetlb);
  } else {
    EXPECT_EQ(pool->backing(), thp_possible ? Backing::kTransparentHuge : Backing::kPlain);
  }
}

TEST(PagePool, AutoSkipsHugetlbWhenThePoolFeedsSendfile) {
  // The mapping: only "auto" changes, and only for a sendfile source.
  EXPECT_EQ(backing_request_for_zero_copy(BackingRequest::kAuto, true),
            BackingRequest::kAutoNoHugetlb);
  EXPECT_EQ(backing_request_for_zero_copy(BackingRequest::kAuto, false), BackingRequest::kAuto);
  for (auto r : {BackingRequest::kHugetlb, BackingRequest::kTransparentHuge,
                 BackingRequest::kPlain, BackingRequest::kAutoNoHugetlb}) {
    EXPECT_EQ(backing_request_for_zero_copy(r, true), r) << backing_request_name(r);
    EXPECT_EQ(backing_request_for_zero_copy(r, false), r) << backing_request_name(r);
  }
  EXPECT_EQ(backing_request_name(BackingRequest::kAutoNoHugetlb), "auto without hugetlb");
  // Not a config value.
  EXPECT_FALSE(parse_backing_request("auto without hugetlb").has_value());

  // The pool: never hugetlb, even where hugepages are reserved; THP when the
  // kernel allows it, else plain pages, like auto after a hugetlb refusal.
  PoolOptions o;
  o.backing = BackingRequest::kAutoNoHugetlb;
  auto pool = make_pool(2, o);
  ASSERT_NE(pool, nullptr);
  EXPECT_NE(pool->backing(), Backing::kHugetlb);
  EXPECT_TRUE(pool->supports_sendfile());
  const bool thp_possible =
      os::shmem_thp_policy_allows_madvise(os::read_shmem_thp_policy().value);
  EXPECT_EQ(pool->backing(), thp_possible ? Backing::kTransparentHuge : Backing::kPlain);
  o.inject.deny_transparent_huge = true;
  auto plain = make_pool(1, o);
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->backing(), Backing::kPlain);
}

TEST(PagePool, ExplicitHugetlbRequestWithoutHugepagesSaysWhatToRaise) {
  PoolOptions o;
  o.prealloc_pages = 1;
  o.backing = BackingRequest::kHugetlb;
  o.name = "explicit-hugetlb";
  auto pool = PagePool::create(o);
  if (os::read_hugetlb_counts().free_pages >= 1) {
    // This machine has hugepages: the request is met, and sendfile is off.
    ASSERT_TRUE(pool.has_value()) << pool.error().to_string();
    EXPECT_EQ((*pool)->backing(), Backing::kHugetlb);
    EXPECT_FALSE((*pool)->supports_sendfile());
    return;
  }
  ASSERT_FALSE(pool.has_value());
  EXPECT_EQ(pool.error().code(), ErrorCode::kUnavailable);
  EXPECT_THAT(pool.error().message(), HasSubstr("/proc/sys/vm/nr_hugepages"));
  EXPECT_THAT(pool.error().message(), HasSubstr("explicit-hugetlb"));
}

TEST(PagePool, ExplicitHugetlbRequestThatFailsIsAnError) {
  PoolOptions o;
  o.backing = BackingRequest::kHugetlb;
  o.inject.deny_hugetlb = true;
  o.prealloc_pages = 1;
  auto pool = PagePool::create(o);
  ASSERT_FALSE(pool.has_value());
  EXPECT_EQ(pool.error().code(), ErrorCode::kUnavailable);
  EXPECT_THAT(pool.error().message(), HasSubstr("backing 'hugetlb' was requested"));
}

TEST(PagePool, ExplicitThpRequestFollowsTheShmemPolicy) {
  PoolOptions o;
  o.backing = BackingRequest::kTransparentHuge;
  o.prealloc_pages = 2;
  auto pool = PagePool::create(o);
  const auto policy = os::read_shmem_thp_policy();
  if (os::shmem_thp_policy_allows_madvise(policy.value)) {
    ASSERT_TRUE(pool.has_value()) << pool.error().to_string();
    EXPECT_EQ((*pool)->backing(), Backing::kTransparentHuge);
    EXPECT_TRUE((*pool)->supports_sendfile());
    return;
  }
  ASSERT_FALSE(pool.has_value());
  EXPECT_EQ(pool.error().code(), ErrorCode::kUnavailable);
  EXPECT_THAT(pool.error().message(), HasSubstr("shmem_enabled"));
  EXPECT_THAT(pool.error().message(), HasSubstr("'" + policy.value + "'"));
}

TEST(PagePool, ExplicitThpRequestThatFailsIsAnError) {
  PoolOptions o;
  o.backing = BackingRequest::kTransparentHuge;
  o.inject.deny_transparent_huge = true;
  o.prealloc_pages = 1;
  auto pool = PagePool::create(o);
  ASSERT_FALSE(pool.has_value());
  EXPECT_EQ(pool.error().code(), ErrorCode::kUnavailable);
  EXPECT_THAT(pool.error().message(), HasSubstr("backing 'thp' was requested"));
}

TEST(PagePool, PlainRequestGetsPlainPages) {
  PoolOptions o;
  o.backing = BackingRequest::kPlain;
  auto pool = make_pool(1, o);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->backing(), Backing::kPlain);
  EXPECT_TRUE(pool->supports_sendfile());
}

TEST(PagePool, SendfileFromTheMemfdSendsTheBlockBytes) {
  PoolOptions o;
  o.inject.deny_hugetlb = true;  // sendfile needs a non-hugetlb memfd
  auto pool = make_pool(1, o);
  ASSERT_NE(pool, nullptr);
  ASSERT_TRUE(pool->supports_sendfile());
  auto filler = pool->allocate(4096);  // so our block does not start at offset 0
  auto b = pool->allocate(3000);
  ASSERT_TRUE(filler && b);
  ASSERT_GT(b->offset_bytes(), 0u);
  for (std::size_t i = 0; i < b->size_bytes(); ++i) b->data()[i] = std::byte(i * 7);
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  off_t offset = static_cast<off_t>(b->offset_bytes());
  const ssize_t sent = sendfile(sv[0], pool->fd(), &offset, b->size_bytes());
  ASSERT_EQ(sent, static_cast<ssize_t>(b->size_bytes())) << std::strerror(errno);
  std::vector<std::byte> got(b->size_bytes());
  std::size_t have = 0;
  while (have < got.size()) {
    const ssize_t n = read(sv[1], got.data() + have, got.size() - have);
    ASSERT_GT(n, 0);
    have += static_cast<std::size_t>(n);
  }
  EXPECT_EQ(std::memcmp(got.data(), b->data(), got.size()), 0);
  close(sv[0]);
  close(sv[1]);
  pool->free(*b);
  pool->free(*filler);
}

TEST(PagePool, LogsWhichBackingWasObtained) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto log = ember::log::logger("pool");
  const auto old_level = log->level();
  log->set_level(spdlog::level::info);
  log->sinks().push_back(sink);
  PoolOptions o;
  o.inject.deny_hugetlb = true;
  o.inject.deny_transparent_huge = true;
  o.name = "logged-pool";
  {
    auto pool = PagePool::create(o);
    ASSERT_TRUE(pool.has_value());
  }
  log->sinks().pop_back();
  log->set_level(old_level);
  const std::string text = out.str();
  EXPECT_THAT(text, HasSubstr("page pool 'logged-pool'"));
  EXPECT_THAT(text, HasSubstr("backed by plain (requested auto)"));
  EXPECT_THAT(text, HasSubstr("hugetlb: hugetlb backing refused by fault injection"));
  EXPECT_THAT(text, HasSubstr("thp: transparent hugepages refused by fault injection"));
}

// ---------------------------------------------------------------- misuse

TEST(PagePoolDeathTest, FreeOfAForeignBlockAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto a = make_pool(1);
  auto b = make_pool(1);
  ASSERT_TRUE(a && b);
  auto block = a->allocate(4096);
  ASSERT_TRUE(block.has_value());
  EXPECT_DEATH(b->free(*block), "not from this pool");
  a->free(*block);
}

TEST(PagePoolDeathTest, DoubleFreeAbortsInDebugBuilds) {
#ifdef NDEBUG
  GTEST_SKIP() << "double-free detection is a debug-build check (EMBER_DCHECK level)";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  auto block = pool->allocate(4096);
  ASSERT_TRUE(block.has_value());
  pool->free(*block);
  EXPECT_DEATH(pool->free(*block), "double free");
#endif
}

}  // namespace
}  // namespace ember::memory
