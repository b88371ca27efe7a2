// Per-epoch shuffle and rank split (see sampler.h).
#include "examples/fashion_mnist/sampler.h"

#include <numeric>
#include <utility>

#include "common/base/check.h"
#include "examples/fashion_mnist/rng.h"

namespace ember::fashion_mnist {
namespace {

constexpr std::size_t kMaxSamples = std::size_t{1} << 32;

void fill_permutation(std::size_t num_samples, std::uint64_t seed, std::uint32_t epoch,
                      std::vector<std::uint32_t>& out) {
  EMBER_CHECK(num_samples <= kMaxSamples);
  out.resize(num_samples);
  std::iota(out.begin(), out.end(), std::uint32_t{0});
  SplitMix64 rng(derive_seed(seed, epoch));
  // Fisher-Yates (Durstenfeld's in-place form), last position first.
  for (std::size_t i = num_samples; i > 1; --i) {
    const std::size_t j = rng.below(i);
    std::swap(out[i - 1], out[j]);
  }
}

}  // namespace

std::vector<std::uint32_t> epoch_permutation(std::size_t num_samples, std::uint64_t seed,
                                             std::uint32_t epoch) {
  std::vector<std::uint32_t> out;
  fill_permutation(num_samples, seed, epoch, out);
  return out;
}

Result<ShardSampler> ShardSampler::create(const ShardOptions& options) {
  if (options.num_workers == 0) {
    return make_error(ErrorCode::kInvalidArgument, "sampler: num_workers must be > 0");
  }
  if (options.rank >= options.num_workers) {
    return make_error(ErrorCode::kInvalidArgument,
                      "sampler: rank {} is out of range for {} workers (ranks 0..{})", options.rank,
                      options.num_workers, options.num_workers - 1);
  }
  if (options.batch_size == 0) {
    return make_error(ErrorCode::kInvalidArgument, "sampler: batch_size must be > 0");
  }
  if (options.num_samples > kMaxSamples) {
    return make_error(ErrorCode::kInvalidArgument, "sampler: {} samples, at most 2^32 supported",
                      options.num_samples);
  }
  const std::size_t per_step = std::size_t{options.num_workers} * options.batch_size;
  if (options.num_samples < per_step) {
    return make_error(ErrorCode::kInvalidArgument,
                      "sampler: {} samples are fewer than one step needs ({} workers x batch {} = "
                      "{}); lower the batch size",
                      options.num_samples, options.num_workers, options.batch_size, per_step);
  }
  return ShardSampler(options, options.num_samples / per_step);
}

void ShardSampler::epoch_indices(std::uint32_t epoch, std::vector<std::uint32_t>& out,
                                 std::vector<std::uint32_t>& scratch) const {
  fill_permutation(options_.num_samples, options_.seed, epoch, scratch);
  const std::size_t count = samples_per_epoch();
  out.resize(count);
  for (std::size_t i = 0; i < count; ++i) {
    out[i] = scratch[i * options_.num_workers + options_.rank];
  }
}

}  // namespace ember::fashion_mnist
