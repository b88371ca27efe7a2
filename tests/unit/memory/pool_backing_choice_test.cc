// proto::make_pool maps [communication] pool_backing and zero_copy to the
// page pool's backing request: "auto" with zero_copy = "sendfile" skips
// hugetlb (a hugetlb memfd cannot feed sendfile: EINVAL) and says so in the
// log; "auto" with writev keeps every option.
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include "common/base/logging.h"
#include "common/config/config.h"
#include "common/memory/os_memory.h"
#include "common/memory/page_pool.h"
#include "common/proto/runtime.h"

namespace ember::memory {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

config::Config pool_config(const std::string& backing, const std::string& zero_copy) {
  auto c = config::parse_config("[communication]\nprealloc_pages = 2\npool_backing = \"" +
                                    backing + "\"\nzero_copy = \"" + zero_copy + "\"\n",
                                "test");
  EXPECT_TRUE(c) << c.error().to_string();
  return *c;
}

// Captures the "pool" logger's lines while alive.
class PoolLog {
 public:
  PoolLog() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) {
    log_ = ember::log::logger("pool");
    old_level_ = log_->level();
    log_->set_level(spdlog::level::info);
    log_->sinks().push_back(sink_);
  }
  ~PoolLog() {
    auto& sinks = log_->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
    log_->set_level(old_level_);
  }
  std::string text() const { return out_.str(); }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
  std::shared_ptr<spdlog::logger> log_;
  spdlog::level::level_enum old_level_{};
};

TEST(PoolBackingChoice, AutoWithSendfileNeverLandsOnHugetlbAndSaysWhy) {
  PoolLog log;
  auto pool = proto::make_pool(pool_config("auto", "sendfile"), "sendfile-auto");
  ASSERT_TRUE(pool) << pool.error().to_string();
  EXPECT_NE((*pool)->backing(), Backing::kHugetlb);
  EXPECT_TRUE((*pool)->supports_sendfile());
  const bool thp_possible = os::shmem_thp_policy_allows_madvise(os::read_shmem_thp_policy().value);
  EXPECT_EQ((*pool)->backing(), thp_possible ? Backing::kTransparentHuge : Backing::kPlain);
  const std::string text = log.text();
  EXPECT_THAT(text, HasSubstr("page pool 'sendfile-auto': pool_backing = \"auto\" skips hugetlb "
                              "because zero_copy = \"sendfile\""));
  EXPECT_THAT(text, HasSubstr("EINVAL"));
  EXPECT_THAT(text, HasSubstr("(requested auto without hugetlb)"));
}

TEST(PoolBackingChoice, AutoWithWritevKeepsHugetlbAsTheFirstChoice) {
  PoolLog log;
  auto pool = proto::make_pool(pool_config("auto", "writev"), "writev-auto");
  ASSERT_TRUE(pool) << pool.error().to_string();
  const auto counts = os::read_hugetlb_counts();
  const bool thp_possible = os::shmem_thp_policy_allows_madvise(os::read_shmem_thp_policy().value);
  if (counts.free_pages >= 2) {
    EXPECT_EQ((*pool)->backing(), Backing::kHugetlb);
  } else {
    EXPECT_EQ((*pool)->backing(), thp_possible ? Backing::kTransparentHuge : Backing::kPlain);
  }
  EXPECT_THAT(log.text(), Not(HasSubstr("skips hugetlb")));
  EXPECT_THAT(log.text(), HasSubstr("(requested auto)"));
}

TEST(PoolBackingChoice, ExplicitBackingsAreKeptWithSendfile) {
  auto plain = proto::make_pool(pool_config("plain", "sendfile"), "sendfile-plain");
  ASSERT_TRUE(plain) << plain.error().to_string();
  EXPECT_EQ((*plain)->backing(), Backing::kPlain);
  // "hugetlb" with sendfile never reaches make_pool: the config refuses it.
  auto refused = config::parse_config(
      "[communication]\npool_backing = \"hugetlb\"\nzero_copy = \"sendfile\"\n", "test");
  ASSERT_FALSE(refused);
  EXPECT_THAT(refused.error().message(), HasSubstr("a hugetlb memfd cannot feed sendfile"));
}

}  // namespace
}  // namespace ember::memory
