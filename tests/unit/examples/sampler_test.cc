// The per-epoch shuffle and rank split: determinism, the partition property
// that makes W BSP workers equal to one process with the W-times batch, and
// option errors.
#include <algorithm>
#include <numeric>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "examples/fashion_mnist/sampler.h"

namespace ember::fashion_mnist {
namespace {

using ::testing::HasSubstr;

TEST(EpochPermutation, IsADeterministicPermutationThatChangesPerEpoch) {
  const auto a = epoch_permutation(1000, 5, 1);
  EXPECT_EQ(a, epoch_permutation(1000, 5, 1));
  EXPECT_NE(a, epoch_permutation(1000, 5, 2));
  EXPECT_NE(a, epoch_permutation(1000, 6, 1));
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::uint32_t> iota(1000);
  std::iota(iota.begin(), iota.end(), 0u);
  EXPECT_EQ(sorted, iota);
  EXPECT_NE(a, iota);
}

TEST(EpochPermutation, IsRoughlyUniform) {
  // Where element 0 lands over many epochs: every position of 8 should come
  // up about 1/8 of the time (a biased shuffle skews this badly).
  std::vector<int> count(8, 0);
  const int trials = 8000;
  for (int e = 0; e < trials; ++e) {
    const auto p = epoch_permutation(8, 3, static_cast<std::uint32_t>(e));
    ++count[std::find(p.begin(), p.end(), 0u) - p.begin()];
  }
  for (int c : count) EXPECT_NEAR(c, trials / 8, trials / 8 / 5);
}

ShardSampler make(std::size_t n, std::uint32_t rank, std::uint32_t workers, std::size_t batch) {
  auto s = ShardSampler::create(ShardOptions{n, rank, workers, batch, 77});
  EXPECT_TRUE(s) << s.error().to_string();
  return *s;
}

TEST(ShardSampler, StepsPerEpochDropTheRemainderOnEveryRank) {
  for (std::uint32_t r = 0; r < 3; ++r) {
    const ShardSampler s = make(100, r, 3, 4);
    EXPECT_EQ(s.steps_per_epoch(), 8u);  // floor(100 / 12)
    EXPECT_EQ(s.samples_per_epoch(), 32u);
  }
}

TEST(ShardSampler, RanksSplitEachStepLikeOneProcessWithTheCombinedBatch) {
  const std::size_t n = 100, batch = 4;
  const std::uint32_t workers = 3;
  const ShardSampler single = make(n, 0, 1, workers * batch);
  std::vector<std::uint32_t> single_idx, scratch;
  for (std::uint32_t epoch = 1; epoch <= 2; ++epoch) {
    single.epoch_indices(epoch, single_idx, scratch);
    std::vector<std::vector<std::uint32_t>> rank_idx(workers);
    for (std::uint32_t r = 0; r < workers; ++r) make(n, r, workers, batch).epoch_indices(epoch, rank_idx[r], scratch);
    std::set<std::uint32_t> seen;
    for (std::size_t step = 0; step < single.steps_per_epoch(); ++step) {
      std::multiset<std::uint32_t> together;
      for (std::uint32_t r = 0; r < workers; ++r) {
        together.insert(rank_idx[r].begin() + step * batch, rank_idx[r].begin() + (step + 1) * batch);
      }
      const std::multiset<std::uint32_t> want(single_idx.begin() + step * workers * batch,
                                              single_idx.begin() + (step + 1) * workers * batch);
      EXPECT_EQ(together, want) << "epoch " << epoch << " step " << step;
      for (auto i : together) EXPECT_TRUE(seen.insert(i).second) << "sample " << i << " twice";
    }
  }
}

TEST(ShardSampler, RejectsBadOptions) {
  struct Case {
    ShardOptions options;
    const char* what;
  };
  const Case cases[] = {
      {{100, 0, 0, 4, 1}, "num_workers must be > 0"},
      {{100, 2, 2, 4, 1}, "rank 2 is out of range for 2 workers"},
      {{100, 0, 1, 0, 1}, "batch_size must be > 0"},
      {{100, 0, 4, 30, 1}, "fewer than one step needs (4 workers x batch 30 = 120)"},
  };
  for (const Case& c : cases) {
    auto s = ShardSampler::create(c.options);
    ASSERT_FALSE(s) << c.what;
    EXPECT_EQ(s.error().code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(s.error().message(), HasSubstr(c.what));
  }
}

}  // namespace
}  // namespace ember::fashion_mnist
