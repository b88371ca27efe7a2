// Helpers for the Fashion-MNIST example tests: synthetic IDX files in a
// temporary directory, and small synthetic datasets that a tiny MLP learns
// in a few hundred steps.
#pragma once

#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "examples/fashion_mnist/data.h"
#include "examples/fashion_mnist/rng.h"

namespace ember::fashion_mnist::testing {

// The bytes of an IDX file of unsigned bytes: magic 0x0000 08 <rank>, the
// big-endian dims, then `payload`. `magic` overrides the computed magic.
inline std::vector<std::uint8_t> idx_bytes(const std::vector<std::uint32_t>& dims,
                                           const std::vector<std::uint8_t>& payload,
                                           std::int64_t magic = -1) {
  const std::uint32_t m = magic >= 0 ? static_cast<std::uint32_t>(magic)
                                     : (0x08u << 8) | static_cast<std::uint32_t>(dims.size());
  std::vector<std::uint8_t> out;
  auto put32 = [&](std::uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(v >> shift));
  };
  put32(m);
  for (std::uint32_t d : dims) put32(d);
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

inline void write_plain(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

inline void write_gzip(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  if (!bytes.empty()) {
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
              static_cast<int>(bytes.size()));
  }
  ASSERT_EQ(gzclose(f), Z_OK);
}

inline std::vector<std::uint8_t> read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(f), {});
}

// A fresh directory under the system temp dir, removed with its contents.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("ember-fmnist-{}-{}-{}", ::getpid(), info ? info->test_suite_name() : "x",
                        info ? info->name() : "y");
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// `num_samples` images of rows x cols pixels whose class is visible: label
// c lights pixel c and pixel (c + 5) mod (rows*cols) over uniform noise in
// [0, 80). Labels cycle through a seeded shuffle of 0..9.
inline Dataset make_learnable_dataset(std::size_t num_samples, std::size_t rows, std::size_t cols,
                                      std::uint64_t seed) {
  Dataset d;
  d.num_samples = num_samples;
  d.image_rows = rows;
  d.image_cols = cols;
  const std::size_t features = rows * cols;
  d.pixels.resize(num_samples * features);
  d.labels.resize(num_samples);
  SplitMix64 rng(seed);
  for (std::size_t i = 0; i < num_samples; ++i) {
    const auto label = static_cast<std::uint8_t>(rng.below(kNumClasses));
    d.labels[i] = label;
    std::uint8_t* px = d.pixels.data() + i * features;
    for (std::size_t k = 0; k < features; ++k) px[k] = static_cast<std::uint8_t>(rng.below(80));
    px[label % features] = 255;
    px[(label + 5) % features] = 200;
  }
  return d;
}

}  // namespace ember::fashion_mnist::testing
