// IDX reader and Fashion-MNIST loader: good files, each corruption class as
// an Error naming the path and the package, the batch gather, and the real
// installed files when present.
#include <filesystem>
#include <fstream>
#include <numeric>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "examples/fashion_mnist/data.h"
#include "tests/unit/examples/test_util.h"

namespace ember::fashion_mnist {
namespace {

using ::testing::HasSubstr;
using testing::idx_bytes;
using testing::TempDir;
using testing::write_gzip;
using testing::write_plain;

std::vector<std::uint8_t> iota_bytes(std::size_t n, std::uint8_t first = 0) {
  std::vector<std::uint8_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

void expect_corrupt(const Result<IdxArray>& r, const std::string& path, const std::string& what) {
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kCorrupt) << r.error().to_string();
  EXPECT_THAT(r.error().message(), HasSubstr(path));
  EXPECT_THAT(r.error().message(), HasSubstr(what));
  EXPECT_THAT(r.error().message(), HasSubstr("apt-get install --reinstall dataset-fashion-mnist"));
}

TEST(ReadIdx, ReadsGzipImagesAndLabels) {
  TempDir dir;
  const auto images = iota_bytes(3 * 2 * 4);
  write_gzip(dir.file("img.gz"), idx_bytes({3, 2, 4}, images));
  write_gzip(dir.file("lbl.gz"), idx_bytes({3}, {7, 0, 9}));
  auto img = read_idx_u8(dir.file("img.gz"), 3);
  ASSERT_TRUE(img) << img.error().to_string();
  EXPECT_EQ(img->dims, (std::vector<std::uint32_t>{3, 2, 4}));
  EXPECT_EQ(img->data, images);
  auto lbl = read_idx_u8(dir.file("lbl.gz"), 1);
  ASSERT_TRUE(lbl) << lbl.error().to_string();
  EXPECT_EQ(lbl->dims, (std::vector<std::uint32_t>{3}));
  EXPECT_EQ(lbl->data, (std::vector<std::uint8_t>{7, 0, 9}));
}

TEST(ReadIdx, ReadsUncompressedFile) {
  TempDir dir;
  write_plain(dir.file("lbl"), idx_bytes({4}, {1, 2, 3, 4}));
  auto lbl = read_idx_u8(dir.file("lbl"), 1);
  ASSERT_TRUE(lbl) << lbl.error().to_string();
  EXPECT_EQ(lbl->data, (std::vector<std::uint8_t>{1, 2, 3, 4}));
}

TEST(ReadIdx, MissingFileIsNotFoundAndNamesThePackage) {
  TempDir dir;
  const std::string path = dir.file("absent.gz");
  auto r = read_idx_u8(path, 1);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kNotFound);
  EXPECT_THAT(r.error().message(), HasSubstr(path));
  EXPECT_THAT(r.error().message(), HasSubstr("apt-get install dataset-fashion-mnist"));
}

TEST(ReadIdx, BadMagicIsCorrupt) {
  TempDir dir;
  write_gzip(dir.file("a.gz"), idx_bytes({2}, {1, 2}, 0x12340801));
  expect_corrupt(read_idx_u8(dir.file("a.gz"), 1), dir.file("a.gz"), "bad IDX magic 0x12340801");
  // A label file where an image file is expected: the rank differs.
  write_gzip(dir.file("b.gz"), idx_bytes({2}, {1, 2}));
  expect_corrupt(read_idx_u8(dir.file("b.gz"), 3), dir.file("b.gz"), "expected 0x00000803");
  // Element type int32 (0x0C) instead of unsigned byte.
  write_gzip(dir.file("c.gz"), idx_bytes({1}, {0, 0, 0, 1}, 0x00000C01));
  expect_corrupt(read_idx_u8(dir.file("c.gz"), 1), dir.file("c.gz"), "bad IDX magic 0x00000c01");
}

TEST(ReadIdx, ShortFilesAreCorrupt) {
  TempDir dir;
  write_gzip(dir.file("empty.gz"), {});
  expect_corrupt(read_idx_u8(dir.file("empty.gz"), 1), dir.file("empty.gz"), "only 0 bytes");
  write_gzip(dir.file("hdr.gz"), {0x00, 0x00, 0x08, 0x03, 0x00, 0x00});
  expect_corrupt(read_idx_u8(dir.file("hdr.gz"), 3), dir.file("hdr.gz"),
                 "truncated header: 2 of 12 dimension bytes");
}

TEST(ReadIdx, TruncatedPayloadIsCorrupt) {
  TempDir dir;
  // Declares 5 images of 2x2 but holds 3.
  write_gzip(dir.file("img.gz"), idx_bytes({5, 2, 2}, iota_bytes(12)));
  expect_corrupt(read_idx_u8(dir.file("img.gz"), 3), dir.file("img.gz"),
                 "truncated: 12 of the 20 data bytes that dimensions 5x2x2 declare");
}

TEST(ReadIdx, TruncatedGzipStreamIsCorrupt) {
  TempDir dir;
  const std::string path = dir.file("img.gz");
  // Random pixels do not compress: half the .gz file is about half the data.
  std::vector<std::uint8_t> pixels(50 * 4 * 4);
  SplitMix64 rng(7);
  for (auto& p : pixels) p = static_cast<std::uint8_t>(rng.next());
  write_gzip(path, idx_bytes({50, 4, 4}, pixels));
  auto bytes = testing::read_all(path);
  ASSERT_GT(bytes.size(), 800u);
  // Cut inside the deflate data: the payload comes up short.
  write_plain(path, std::vector<std::uint8_t>(bytes.begin(), bytes.begin() + bytes.size() / 2));
  expect_corrupt(read_idx_u8(path, 3), path, "gzip stream ends early");
  // Cut inside the 8-byte trailer: the payload is complete, the stream is not.
  write_plain(path, std::vector<std::uint8_t>(bytes.begin(), bytes.end() - 4));
  expect_corrupt(read_idx_u8(path, 3), path, "truncated gzip stream");
}

TEST(ReadIdx, GzipChecksumMismatchIsCorrupt) {
  TempDir dir;
  const std::string path = dir.file("lbl.gz");
  write_gzip(path, idx_bytes({6}, {1, 2, 3, 4, 5, 6}));
  auto bytes = testing::read_all(path);
  bytes[bytes.size() - 8] ^= 0xFF;  // first byte of the CRC-32 in the trailer
  write_plain(path, bytes);
  expect_corrupt(read_idx_u8(path, 1), path, "gzip stream error");
}

TEST(ReadIdx, BytesAfterThePayloadAreCorrupt) {
  TempDir dir;
  auto bytes = idx_bytes({2}, {1, 2});
  bytes.push_back(3);
  write_gzip(dir.file("lbl.gz"), bytes);
  expect_corrupt(read_idx_u8(dir.file("lbl.gz"), 1), dir.file("lbl.gz"),
                 "more data after the 2 bytes");
}

TEST(ReadIdx, ImplausibleSizesAreCorruptBeforeAllocating) {
  TempDir dir;
  write_gzip(dir.file("img.gz"), idx_bytes({0xFFFFFFFF, 0xFFFF, 0xFFFF}, {}));
  expect_corrupt(read_idx_u8(dir.file("img.gz"), 3), dir.file("img.gz"), "more than 4 GiB");
}

TEST(LoadSplit, CountMismatchIsCorruptNamingBothFiles) {
  TempDir dir;
  write_gzip(dir.file("img.gz"), idx_bytes({3, 2, 2}, iota_bytes(12)));
  write_gzip(dir.file("lbl.gz"), idx_bytes({4}, {0, 1, 2, 3}));
  auto r = load_split(dir.file("img.gz"), dir.file("lbl.gz"));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kCorrupt);
  EXPECT_THAT(r.error().message(), HasSubstr(dir.file("img.gz") + " holds 3 images"));
  EXPECT_THAT(r.error().message(), HasSubstr(dir.file("lbl.gz") + " holds 4 labels"));
  EXPECT_THAT(r.error().message(), HasSubstr("dataset-fashion-mnist"));
}

TEST(LoadSplit, LabelOutOfRangeIsCorrupt) {
  TempDir dir;
  write_gzip(dir.file("img.gz"), idx_bytes({3, 1, 1}, {0, 1, 2}));
  write_gzip(dir.file("lbl.gz"), idx_bytes({3}, {0, 10, 2}));
  auto r = load_split(dir.file("img.gz"), dir.file("lbl.gz"));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kCorrupt);
  EXPECT_THAT(r.error().message(), HasSubstr("label 10 at index 1"));
}

TEST(LoadSplit, MissingLabelsFileNamesIt) {
  TempDir dir;
  write_gzip(dir.file("img.gz"), idx_bytes({1, 1, 1}, {0}));
  auto r = load_split(dir.file("img.gz"), dir.file("lbl.gz"));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kNotFound);
  EXPECT_THAT(r.error().message(), HasSubstr(dir.file("lbl.gz")));
}

void write_split(const TempDir& dir, std::string_view images, std::string_view labels,
                 std::uint32_t n, std::uint32_t rows, std::uint32_t cols) {
  std::vector<std::uint8_t> pixels(std::size_t{n} * rows * cols);
  for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<std::uint8_t>(i * 7);
  std::vector<std::uint8_t> lbl(n);
  for (std::uint32_t i = 0; i < n; ++i) lbl[i] = static_cast<std::uint8_t>(i % 10);
  write_gzip(dir.file(std::string(images)), idx_bytes({n, rows, cols}, pixels));
  write_gzip(dir.file(std::string(labels)), idx_bytes({n}, lbl));
}

TEST(LoadFashionMnist, LoadsADirectoryOfSmallFiles) {
  TempDir dir;
  write_split(dir, kTrainImagesFile, kTrainLabelsFile, 12, 28, 28);
  write_split(dir, kTestImagesFile, kTestLabelsFile, 5, 28, 28);
  auto data = load_fashion_mnist(dir.path());
  ASSERT_TRUE(data) << data.error().to_string();
  EXPECT_EQ(data->train.num_samples, 12u);
  EXPECT_EQ(data->test.num_samples, 5u);
  EXPECT_EQ(data->train.num_features(), kImagePixels);
  EXPECT_EQ(data->train.labels[11], 1);
  EXPECT_EQ(data->test.image(1)[0], static_cast<std::uint8_t>(784 * 7));
}

TEST(LoadFashionMnist, WrongImageSizeIsCorrupt) {
  TempDir dir;
  write_split(dir, kTrainImagesFile, kTrainLabelsFile, 4, 28, 28);
  write_split(dir, kTestImagesFile, kTestLabelsFile, 4, 4, 4);
  auto data = load_fashion_mnist(dir.path());
  ASSERT_FALSE(data);
  EXPECT_EQ(data.error().code(), ErrorCode::kCorrupt);
  EXPECT_THAT(data.error().message(), HasSubstr(std::string(kTestImagesFile)));
  EXPECT_THAT(data.error().message(), HasSubstr("images are 4x4"));
}

TEST(LoadFashionMnist, MissingDirectorySaysWhatToInstall) {
  TempDir dir;
  auto data = load_fashion_mnist(dir.file("nowhere"));
  ASSERT_FALSE(data);
  EXPECT_EQ(data.error().code(), ErrorCode::kNotFound);
  EXPECT_THAT(data.error().message(), HasSubstr(std::string(kTrainImagesFile)));
  EXPECT_THAT(data.error().message(), HasSubstr("apt-get install dataset-fashion-mnist"));
}

TEST(CheckFashionMnistFiles, NamesTheFirstMissingFileAndThePackage) {
  TempDir dir;
  Status st = check_fashion_mnist_files(dir.file("nowhere"));
  ASSERT_FALSE(st);
  EXPECT_EQ(st.error().code(), ErrorCode::kNotFound);
  EXPECT_THAT(st.error().message(), HasSubstr(std::string(kTrainImagesFile)));
  EXPECT_THAT(st.error().message(), HasSubstr("apt-get install dataset-fashion-mnist"));
  // Three of four present: the fourth is named.
  for (std::string_view name : {kTrainImagesFile, kTrainLabelsFile, kTestImagesFile}) {
    std::ofstream(dir.file(std::string(name))) << "x";
  }
  st = check_fashion_mnist_files(dir.path());
  ASSERT_FALSE(st);
  EXPECT_THAT(st.error().message(), HasSubstr(std::string(kTestLabelsFile)));
  std::ofstream(dir.file(std::string(kTestLabelsFile))) << "x";
  EXPECT_TRUE(check_fashion_mnist_files(dir.path()));  // opened, not read
}

TEST(GatherBatch, NormalisesPixelsIntoColumnsInIndexOrder) {
  Dataset d;
  d.num_samples = 3;
  d.image_rows = 1;
  d.image_cols = 2;
  d.pixels = {0, 255, 10, 20, 51, 102};
  d.labels = {4, 5, 6};
  Eigen::MatrixXf x(2, 4);
  x.setConstant(-99.0f);
  std::vector<std::uint8_t> labels(4, 99);
  const std::vector<std::uint32_t> idx{2, 0};
  gather_batch(d, idx, x, labels);
  auto norm = [](float p) { return (p / 255.0f - kPixelMean) / kPixelStd; };
  EXPECT_FLOAT_EQ(x(0, 0), norm(51));
  EXPECT_FLOAT_EQ(x(1, 0), norm(102));
  EXPECT_FLOAT_EQ(x(0, 1), norm(0));
  EXPECT_FLOAT_EQ(x(1, 1), norm(255));
  EXPECT_EQ(x(0, 2), -99.0f);  // columns past the batch are untouched
  EXPECT_EQ(labels, (std::vector<std::uint8_t>{6, 4, 99, 99}));
}

TEST(RealFashionMnist, LoadsPublishedFilesWithBalancedClassesAndKnownStatistics) {
  const std::string train = std::string(kDefaultDataDir) + "/" + std::string(kTrainImagesFile);
  if (!std::filesystem::exists(train)) {
    GTEST_SKIP() << train << " is absent: apt-get install dataset-fashion-mnist";
  }
  auto data = load_fashion_mnist();
  ASSERT_TRUE(data) << data.error().to_string();
  ASSERT_EQ(data->train.num_samples, kNumTrainSamples);
  ASSERT_EQ(data->test.num_samples, kNumTestSamples);
  std::vector<std::size_t> train_counts(kNumClasses), test_counts(kNumClasses);
  for (auto l : data->train.labels) ++train_counts[l];
  for (auto l : data->test.labels) ++test_counts[l];
  EXPECT_EQ(train_counts, std::vector<std::size_t>(kNumClasses, 6000));
  EXPECT_EQ(test_counts, std::vector<std::size_t>(kNumClasses, 1000));
  // The normalisation constants are the training pixels' mean and std.
  double sum = 0.0, sum_sq = 0.0;
  for (auto p : data->train.pixels) {
    const double x = p / 255.0;
    sum += x;
    sum_sq += x * x;
  }
  const double n = static_cast<double>(data->train.pixels.size());
  const double mean = sum / n;
  const double stddev = std::sqrt(sum_sq / n - mean * mean);
  EXPECT_NEAR(mean, kPixelMean, 1e-3);
  EXPECT_NEAR(stddev, kPixelStd, 1e-3);
}

}  // namespace
}  // namespace ember::fashion_mnist
