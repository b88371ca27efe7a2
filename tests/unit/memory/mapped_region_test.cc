#include "common/memory/mapped_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/memory/page_pool.h"

namespace ember::memory {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<PagePool> make_pool(std::size_t pages) {
  PoolOptions o;
  o.prealloc_pages = pages;
  o.name = "mapped-region-test";
  auto pool = PagePool::create(o);
  EXPECT_TRUE(pool.has_value()) << pool.error().to_string();
  return pool ? std::move(*pool) : nullptr;
}

TEST(MappedRegion, PeerSeesTheBytesOfABlockAtItsOffset) {
  auto pool = make_pool(2);
  ASSERT_NE(pool, nullptr);
  auto region = MappedRegion::map(pool->fd(), pool->length_bytes());
  ASSERT_TRUE(region.has_value()) << region.error().to_string();
  EXPECT_NE(region->base(), pool->base()) << "a second mapping of the same memfd";
  EXPECT_EQ(region->length_bytes(), pool->length_bytes());

  auto filler = pool->allocate(4096);
  auto b = pool->allocate(100000);
  ASSERT_TRUE(filler && b);
  std::memcpy(b->data(), "gradient", 8);
  auto view = region->view(b->offset_bytes(), 8);
  ASSERT_TRUE(view.has_value()) << view.error().to_string();
  EXPECT_EQ(std::memcmp(view->data(), "gradient", 8), 0);
  // And back: the peer writes, the owner reads.
  std::memcpy(view->data(), "reply!!!", 8);
  EXPECT_EQ(std::memcmp(b->data(), "reply!!!", 8), 0);
  EXPECT_TRUE(region->contains(view->data()));
  pool->free(*b);
  pool->free(*filler);
}

TEST(MappedRegion, MappingSurvivesClosingTheFd) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  const int dup_fd = ::dup(pool->fd());
  ASSERT_GE(dup_fd, 0);
  auto region = MappedRegion::map(dup_fd, pool->length_bytes(), /*populate=*/false);
  ::close(dup_fd);
  ASSERT_TRUE(region.has_value());
  pool->base()[123] = std::byte{42};
  EXPECT_EQ(region->base()[123], std::byte{42});
}

TEST(MappedRegion, ViewRejectsRangesOutsideTheRegion) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  auto region = MappedRegion::map(pool->fd(), pool->length_bytes());
  ASSERT_TRUE(region.has_value());
  const std::uint64_t len = region->length_bytes();
  EXPECT_TRUE(region->view(0, len).has_value());
  EXPECT_TRUE(region->view(len, 0).has_value());
  for (auto [offset, size] : {std::pair<std::uint64_t, std::size_t>{0, len + 1},
                              {len, 1},
                              {len - 10, 11},
                              {~std::uint64_t{0}, 1},
                              {1, ~std::size_t{0}}}) {
    auto v = region->view(offset, size);
    ASSERT_FALSE(v.has_value()) << offset << "+" << size;
    EXPECT_EQ(v.error().code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(v.error().message(), HasSubstr("outside the mapped region"));
  }
}

TEST(MappedRegion, RejectsABadFd) {
  auto r = MappedRegion::map(-1, 4096);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(r.error().message(), HasSubstr("fd -1"));

  const int fd = ::memfd_create("closed", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ::close(fd);
  auto closed = MappedRegion::map(fd, 4096);
  ASSERT_FALSE(closed.has_value());
  EXPECT_EQ(closed.error().code(), ErrorCode::kIo);
  EXPECT_EQ(closed.error().sys_errno(), EBADF);
}

TEST(MappedRegion, RejectsLengthsThatAreNotPagesOrLongerThanTheFile) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  for (std::size_t bad : {std::size_t{0}, std::size_t{100}, std::size_t{4097}}) {
    auto r = MappedRegion::map(pool->fd(), bad);
    ASSERT_FALSE(r.has_value()) << bad;
    EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(r.error().message(), HasSubstr("multiple of 4096"));
  }
  auto longer = MappedRegion::map(pool->fd(), pool->length_bytes() + 4096);
  ASSERT_FALSE(longer.has_value());
  EXPECT_EQ(longer.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(longer.error().message(), HasSubstr("fewer than the"));
}

TEST(MappedRegion, MoveTransfersTheMapping) {
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  auto r = MappedRegion::map(pool->fd(), pool->length_bytes());
  ASSERT_TRUE(r.has_value());
  std::byte* base = r->base();
  MappedRegion moved = std::move(*r);
  EXPECT_TRUE(r->empty());
  EXPECT_EQ(moved.base(), base);
  MappedRegion assigned;
  assigned = std::move(moved);
  EXPECT_TRUE(moved.empty());
  EXPECT_EQ(assigned.base(), base);
  pool->base()[7] = std::byte{9};
  EXPECT_EQ(assigned.base()[7], std::byte{9});
}

TEST(MappedRegion, AChildOfForkDoesNotInheritThePeersMemory) {
  // The shm transport gives lent memory back when the peer's process exits
  // (its pidfd): a child the peer forked must not keep a way in.
  auto pool = make_pool(1);
  ASSERT_NE(pool, nullptr);
  auto r = MappedRegion::map(pool->fd(), pool->length_bytes());
  ASSERT_TRUE(r.has_value()) << r.error().to_string();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // msync on an address range that is not mapped fails with ENOMEM.
    const bool mapped = ::msync(r->base(), 4096, MS_ASYNC) == 0;
    const bool pool_mapped = ::msync(pool->base(), 4096, MS_ASYNC) == 0;
    ::_exit(mapped ? 1 : (pool_mapped ? 0 : 2));
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 1) << "the child still maps the peer's pool";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child lost its own pool's mapping too (unexpected)";
  EXPECT_EQ(::msync(r->base(), 4096, MS_ASYNC), 0) << "the parent's mapping is gone";
}

}  // namespace
}  // namespace ember::memory
