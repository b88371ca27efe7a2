// Fashion-MNIST on disk and in memory: the IDX reader, the dataset, and the
// mini-batch gather that turns pixels into model inputs.
//
// The data comes from the Debian package `dataset-fashion-mnist`, which puts
// four gzip-compressed IDX files under /usr/share/datasets/fashion-mnist/.
// IDX (LeCun et al., http://yann.lecun.com/exdb/mnist/) is a big-endian
// format: a 4-byte magic (0x00, 0x00, type code, number of dimensions), one
// uint32 size per dimension, then the elements in row-major order. We read
// type 0x08 (unsigned byte) only: images are [N, 28, 28] uint8 (magic
// 0x00000803), labels are [N] uint8 (magic 0x00000801). The reader trusts
// nothing: magic, rank, sizes, the exact payload length (no missing and no
// extra bytes), the gzip CRC, label range, and that the image and label
// files agree on N are all checked before a dataset is returned.
//
// Main invariant: a Dataset returned by a loader has labels.size() ==
// num_samples, pixels.size() == num_samples * num_features, and every label
// < kNumClasses.
//
// Thread-safety: the loaders are reentrant; a Dataset is an immutable value
// after loading, safe to read from any number of threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <Eigen/Core>

#include "common/base/error.h"

namespace ember::fashion_mnist {

inline constexpr std::string_view kDefaultDataDir = "/usr/share/datasets/fashion-mnist";
inline constexpr std::string_view kTrainImagesFile = "train-images-idx3-ubyte.gz";
inline constexpr std::string_view kTrainLabelsFile = "train-labels-idx1-ubyte.gz";
inline constexpr std::string_view kTestImagesFile = "t10k-images-idx3-ubyte.gz";
inline constexpr std::string_view kTestLabelsFile = "t10k-labels-idx1-ubyte.gz";

inline constexpr std::size_t kImageRows = 28;
inline constexpr std::size_t kImageCols = 28;
inline constexpr std::size_t kImagePixels = kImageRows * kImageCols;  // 784
inline constexpr std::size_t kNumClasses = 10;
inline constexpr std::size_t kNumTrainSamples = 60000;
inline constexpr std::size_t kNumTestSamples = 10000;

// Input normalisation: x = (pixel / 255 - kPixelMean) / kPixelStd. The two
// constants are the mean and standard deviation of all pixels of the
// 60,000 training images scaled to [0, 1] (checked by a unit test against the
// installed files).
inline constexpr float kPixelMean = 0.2860f;
inline constexpr float kPixelStd = 0.3530f;

// A decoded IDX file of unsigned bytes.
struct IdxArray {
  std::vector<std::uint32_t> dims;  // sizes, outermost first
  std::vector<std::uint8_t> data;   // product(dims) bytes, row-major
};

// Reads the IDX file at `path` (gzip-compressed or plain; zlib reads both)
// whose element type is unsigned byte and whose rank is `expected_rank`.
// Blocks on file I/O; allocates the payload.
// Errors (each names `path`):
//   kNotFound  the file does not exist: install dataset-fashion-mnist;
//   kIo        it cannot be opened or read (errno attached);
//   kCorrupt   bad magic, wrong element type or rank, implausible sizes
//              (> 4 GiB of payload), truncated data or gzip stream, bytes
//              after the declared payload, or a gzip CRC mismatch: the file
//              is corrupt, reinstall the package.
// pre: 1 <= expected_rank <= 4.
Result<IdxArray> read_idx_u8(const std::string& path, std::size_t expected_rank);

// Images and labels of one split.
struct Dataset {
  std::size_t num_samples = 0;
  std::size_t image_rows = 0;
  std::size_t image_cols = 0;
  std::vector<std::uint8_t> pixels;  // [num_samples, image_rows * image_cols] uint8, row-major
  std::vector<std::uint8_t> labels;  // [num_samples] uint8, each < kNumClasses

  std::size_t num_features() const { return image_rows * image_cols; }
  std::span<const std::uint8_t> image(std::size_t i) const {
    return std::span<const std::uint8_t>(pixels).subspan(i * num_features(), num_features());
  }
};

// Loads one split from an idx3 image file and an idx1 label file.
// Errors: those of read_idx_u8 (for either file), and kCorrupt naming both
// paths when the files disagree on the number of samples, or naming the label
// file and the first offending index when a label is >= kNumClasses.
Result<Dataset> load_split(const std::string& images_path, const std::string& labels_path);

struct FashionMnist {
  Dataset train;  // 60,000 samples in the published files
  Dataset test;   // 10,000 samples
};

// Loads both splits from `dir` (the four file names above). Additionally
// checks that the images are 28x28 (kCorrupt otherwise). Does not insist on
// the published sample counts, so a directory of smaller files in the same
// format also loads (the tests use that).
Result<FashionMnist> load_fashion_mnist(std::string_view dir = kDefaultDataDir);

// Whether the four files of `dir` can be opened for reading, without reading
// them: a quick check before slower work (fmnist-worker runs it before
// connecting), so that a wrong --data-dir is reported first. Errors: those
// of read_idx_u8's open (kNotFound naming the path and the Debian package,
// or kIo).
Status check_fashion_mnist_files(std::string_view dir = kDefaultDataDir);

// Copies and normalises the samples `indices` of `data` into the columns of
// `inputs` (column j = sample indices[j]; [num_features, indices.size()]
// float32, Eigen column-major, i.e. [batch, num_features] row-major in memory)
// and their labels into `labels`. This is the one copy of the input path: it
// gathers the shuffled samples into a dense batch. Does not allocate.
// pre: inputs.rows() == data.num_features(), inputs.cols() >= indices.size(),
//      labels.size() >= indices.size(), every index < data.num_samples.
void gather_batch(const Dataset& data, std::span<const std::uint32_t> indices,
                  Eigen::Ref<Eigen::MatrixXf> inputs, std::span<std::uint8_t> labels);

}  // namespace ember::fashion_mnist
