// Which training samples each worker sees at each step: a deterministic
// split of a per-epoch shuffle, identical on every rank.
//
// Follows torch.utils.data.distributed.DistributedSampler (shuffle=True,
// drop_last=True): for epoch e every rank computes the same permutation P of
// [0, N) (Fisher-Yates driven by SplitMix64 seeded with derive_seed(seed, e),
// rng.h), and rank r of W takes positions r, r + W, r + 2W, ... of P. Each
// rank then cuts its sequence into steps of B samples; an epoch has
// floor(N / (W * B)) steps on every rank (the same count, as BSP needs), and
// the at most W*B - 1 samples left over differ from epoch to epoch.
//
// Sample j (0 <= j < B) of step s on rank r is P[(s*B + j)*W + r]. So the
// union over ranks of step s is exactly P[s*W*B, (s+1)*W*B): the samples a
// single process with W = 1 and batch W*B takes at step s. That is what makes
// a BSP run of W workers equal (up to float rounding) to one process with the
// W-times batch.
//
// Thread-safety: const methods are safe to call concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/base/error.h"

namespace ember::fashion_mnist {

struct ShardOptions {
  std::size_t num_samples = 0;     // N, the training set size
  std::uint32_t rank = 0;          // r, 0 <= r < num_workers
  std::uint32_t num_workers = 1;   // W
  std::size_t batch_size = 1;      // B, samples per step per worker
  std::uint64_t seed = 0;          // shared by all ranks
};

// The epoch's permutation of [0, num_samples), the same for every rank.
// Allocates num_samples entries. pre: num_samples <= 2^32.
std::vector<std::uint32_t> epoch_permutation(std::size_t num_samples, std::uint64_t seed,
                                             std::uint32_t epoch);

class ShardSampler {
 public:
  // Errors: kInvalidArgument when num_workers == 0, rank >= num_workers,
  // batch_size == 0, num_samples > 2^32, or num_samples < num_workers *
  // batch_size (not even one full step: lower the batch size).
  static Result<ShardSampler> create(const ShardOptions& options);

  const ShardOptions& options() const { return options_; }
  std::size_t steps_per_epoch() const { return steps_per_epoch_; }
  // Samples this rank trains on per epoch: steps_per_epoch() * batch_size.
  std::size_t samples_per_epoch() const { return steps_per_epoch_ * options_.batch_size; }

  // This rank's sample indices for `epoch`, in step order: step s is
  // out[s*B, (s+1)*B). Resizes `out` to samples_per_epoch() (allocates on
  // first use) and uses `scratch` for the permutation.
  void epoch_indices(std::uint32_t epoch, std::vector<std::uint32_t>& out,
                     std::vector<std::uint32_t>& scratch) const;

 private:
  explicit ShardSampler(const ShardOptions& options, std::size_t steps)
      : options_(options), steps_per_epoch_(steps) {}

  ShardOptions options_;
  std::size_t steps_per_epoch_ = 0;
};

}  // namespace ember::fashion_mnist
