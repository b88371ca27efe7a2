// Deterministic random numbers for the Fashion-MNIST example: parameter
// initialisation and the per-epoch shuffle.
//
// Every rank of a data-parallel job must draw the same numbers from the same
// seed, so nothing here uses the standard library's distributions (their
// algorithms are implementation-defined): the generator is SplitMix64
// (Steele, Lea, Flood, "Fast Splittable Pseudorandom Number Generators",
// OOPSLA 2014; Vigna's reference splitmix64.c), bounded integers use
// rejection of the biased low range (as OpenBSD's arc4random_uniform), and
// normal variates use the Box-Muller transform (Box and Muller, "A Note on the
// Generation of Random Normal Deviates", 1958).
//
// Thread-safety: a SplitMix64 is a plain value; one per thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>

namespace ember::fashion_mnist {

// SplitMix64's output function: a bijective 64-bit mixer.
constexpr std::uint64_t splitmix64_mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// A seed for an independent stream `stream` (a tensor key, an epoch number)
// derived from a job seed, so that streams do not overlap in practice.
constexpr std::uint64_t derive_seed(std::uint64_t seed, std::uint64_t stream) {
  return splitmix64_mix(seed ^ splitmix64_mix(stream + 0x9E3779B97F4A7C15ULL));
}

class SplitMix64 {
 public:
  explicit constexpr SplitMix64(std::uint64_t seed) : state_(seed) {}

  constexpr std::uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ULL;
    return splitmix64_mix(state_);
  }

  // Uniform integer in [0, bound), unbiased. pre: bound > 0.
  constexpr std::uint64_t below(std::uint64_t bound) {
    // 2^64 mod bound: the values below it are the over-represented ones.
    const std::uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      const std::uint64_t x = next();
      if (x >= threshold) return x % bound;
    }
  }

  // Uniform double in [0, 1) with 53 random bits.
  constexpr double uniform01() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  // Standard normal variate (Box-Muller; both outputs of a pair are used).
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - uniform01();  // (0, 1]: log is finite
    const double u2 = uniform01();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  std::uint64_t state_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

}  // namespace ember::fashion_mnist
