// Gradient sets of the GPU SymBuffer benchmark: ResNet-50's 161 parameter
// tensors (torchvision's resnet50: 53 convolutions, 53 batch norms with
// weight and bias, the classifier's weight and bias; 25,557,032 values), and
// 10,000 tensors of 4-64 KiB (seeded, uniform in size).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace ember::bench {

inline std::vector<std::uint64_t> resnet50_gradient_sizes() {
  std::vector<std::uint64_t> sizes;
  auto conv = [&](std::uint64_t in, std::uint64_t out, std::uint64_t k) { sizes.push_back(in * out * k * k); };
  auto bn = [&](std::uint64_t c) {
    sizes.push_back(c);  // weight
    sizes.push_back(c);  // bias
  };
  conv(3, 64, 7);
  bn(64);
  std::uint64_t in = 64;
  const std::uint64_t blocks[] = {3, 4, 6, 3};
  const std::uint64_t widths[] = {64, 128, 256, 512};
  for (int stage = 0; stage < 4; ++stage) {
    const std::uint64_t w = widths[stage];
    for (std::uint64_t b = 0; b < blocks[stage]; ++b) {
      conv(in, w, 1);
      bn(w);
      conv(w, w, 3);
      bn(w);
      conv(w, 4 * w, 1);
      bn(4 * w);
      if (b == 0) {
        conv(in, 4 * w, 1);  // downsample
        bn(4 * w);
      }
      in = 4 * w;
    }
  }
  sizes.push_back(2048 * 1000);  // fc weight
  sizes.push_back(1000);         // fc bias
  return sizes;
}

inline std::vector<std::uint64_t> small_tensor_sizes(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::uint64_t> elements(1024, 16384);  // 4-64 KiB of fp32
  std::vector<std::uint64_t> sizes(count);
  for (auto& s : sizes) s = elements(rng);
  return sizes;
}

}  // namespace ember::bench
