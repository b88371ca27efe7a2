// IDX reading with zlib, and the batch gather (see data.h for the format and
// the checks).
#include "examples/fashion_mnist/data.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <memory>

#include <fmt/ranges.h>

#include "common/base/check.h"

namespace ember::fashion_mnist {
namespace {

constexpr std::string_view kInstallHint =
    "install the Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist)";
constexpr std::string_view kCorruptHint =
    "the file is corrupt: reinstall the Debian package dataset-fashion-mnist "
    "(apt-get install --reinstall dataset-fashion-mnist)";

constexpr std::uint8_t kIdxTypeUnsignedByte = 0x08;
constexpr std::uint64_t kMaxPayloadBytes = std::uint64_t{4} << 30;
constexpr unsigned kGzBufferBytes = 256u << 10;
// First allocation for an IDX payload (the published image files hold 47 MB
// and 7.8 MB; the label files 60 kB and 10 kB).
constexpr std::uint64_t kFirstPayloadBytes = std::uint64_t{16} << 20;
constexpr std::size_t kMaxReadChunk = std::size_t{1} << 30;

struct GzClose {
  void operator()(gzFile_s* file) const { gzclose(file); }
};
using GzHandle = std::unique_ptr<gzFile_s, GzClose>;

tl::unexpected<Error> corrupt(const std::string& path, std::string_view what) {
  return make_error(ErrorCode::kCorrupt, "{}: {}; {}", path, what, kCorruptHint);
}

// Reads up to `size` bytes into `out`; fewer only at the end of the data.
// A stream error (bad deflate data, gzip CRC mismatch) is kCorrupt; a failed
// read(2) is kIo.
Result<std::size_t> read_some(gzFile file, std::uint8_t* out, std::size_t size,
                              const std::string& path) {
  std::size_t done = 0;
  while (done < size) {
    const auto chunk = static_cast<unsigned>(std::min(size - done, kMaxReadChunk));
    const int got = gzread(file, out + done, chunk);
    if (got < 0) {
      int zerr = Z_OK;
      const char* message = gzerror(file, &zerr);
      if (zerr == Z_ERRNO) {
        // EISDIR: a directory where the file should be.
        return make_sys_error(errno, "{}: read failed; the data files are those of the Debian "
                                     "package dataset-fashion-mnist (apt-get install --reinstall "
                                     "dataset-fashion-mnist)",
                              path);
      }
      return corrupt(path, fmt::format("gzip stream error ({})", message));
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  return done;
}

// True when zlib reached the end of the input in the middle of a gzip member
// (a truncated .gz file): gzread reports that as Z_BUF_ERROR, not as a failure.
bool gzip_truncated(gzFile file) {
  int zerr = Z_OK;
  gzerror(file, &zerr);
  return zerr == Z_BUF_ERROR;
}

std::string join_path(std::string_view dir, std::string_view file) {
  std::string path(dir);
  if (!path.empty() && path.back() != '/') path += '/';
  path += file;
  return path;
}

}  // namespace

namespace {

// open(2) for reading; the error names the path and the package.
Result<int> open_data_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return make_error(ErrorCode::kNotFound, "{}: no such file; {}", path, kInstallHint);
    }
    return make_sys_error(err, "{}: cannot open; {}", path, kInstallHint);
  }
  return fd;
}

}  // namespace

Result<IdxArray> read_idx_u8(const std::string& path, std::size_t expected_rank) {
  EMBER_CHECK(expected_rank >= 1 && expected_rank <= 4);
  EMBER_ASSIGN_OR_RETURN(const int fd, open_data_file(path));
  GzHandle file(gzdopen(fd, "rb"));
  if (!file) {
    const int err = errno;
    ::close(fd);
    return make_sys_error(err, "{}: cannot start reading (zlib gzdopen failed)", path);
  }
  gzbuffer(file.get(), kGzBufferBytes);

  std::array<std::uint8_t, 4> magic{};
  EMBER_ASSIGN_OR_RETURN(std::size_t got, read_some(file.get(), magic.data(), magic.size(), path));
  if (got < magic.size()) {
    return corrupt(path, fmt::format("only {} bytes, shorter than the 4-byte IDX magic", got));
  }
  const std::uint32_t expected_magic =
      (std::uint32_t{kIdxTypeUnsignedByte} << 8) | static_cast<std::uint32_t>(expected_rank);
  const std::uint32_t magic_value = (std::uint32_t{magic[0]} << 24) |
                                    (std::uint32_t{magic[1]} << 16) |
                                    (std::uint32_t{magic[2]} << 8) | std::uint32_t{magic[3]};
  if (magic_value != expected_magic) {
    return corrupt(path, fmt::format("bad IDX magic 0x{:08x}, expected 0x{:08x} (unsigned byte, "
                                     "{} dimension{})",
                                     magic_value, expected_magic, expected_rank,
                                     expected_rank == 1 ? "" : "s"));
  }

  std::array<std::uint8_t, 16> dim_bytes{};
  const std::size_t header_dim_bytes = 4 * expected_rank;
  EMBER_ASSIGN_OR_RETURN(got, read_some(file.get(), dim_bytes.data(), header_dim_bytes, path));
  if (got < header_dim_bytes) {
    return corrupt(path, fmt::format("truncated header: {} of {} dimension bytes", got,
                                     header_dim_bytes));
  }
  IdxArray array;
  array.dims.resize(expected_rank);
  std::uint64_t payload_bytes = 1;
  for (std::size_t d = 0; d < expected_rank; ++d) {
    const std::uint8_t* b = dim_bytes.data() + 4 * d;
    array.dims[d] = (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) |
                    (std::uint32_t{b[2]} << 8) | std::uint32_t{b[3]};
    // Each factor is < 2^32 and the running product is <= 4 GiB before the
    // multiplication, so the product fits in 64 bits.
    payload_bytes *= array.dims[d];
    if (payload_bytes > kMaxPayloadBytes) {
      return corrupt(path, fmt::format("dimensions {} declare more than 4 GiB of data",
                                       fmt::join(array.dims.begin(), array.dims.begin() + d + 1, "x")));
    }
  }

  // The buffer grows with the bytes that arrive (doubling, from at most
  // kFirstPayloadBytes), so a short corrupt file that declares gigabytes is
  // refused as truncated without allocating them first.
  got = 0;
  while (got < payload_bytes) {
    const std::uint64_t want =
        std::min(payload_bytes, std::max(kFirstPayloadBytes, std::uint64_t{array.data.size()} * 2));
    array.data.resize(want);
    EMBER_ASSIGN_OR_RETURN(std::size_t more,
                           read_some(file.get(), array.data.data() + got, want - got, path));
    got += more;
    if (got < want) break;  // end of input
  }
  if (got < payload_bytes) {
    return corrupt(path, fmt::format("truncated: {} of the {} data bytes that dimensions {} declare{}",
                                     got, payload_bytes, fmt::join(array.dims, "x"),
                                     gzip_truncated(file.get()) ? " (gzip stream ends early)" : ""));
  }
  // Read past the payload: finds extra bytes, and makes zlib reach the gzip
  // trailer so that its CRC and length are verified.
  std::uint8_t extra = 0;
  EMBER_ASSIGN_OR_RETURN(got, read_some(file.get(), &extra, 1, path));
  if (got != 0) {
    return corrupt(path, fmt::format("more data after the {} bytes that dimensions {} declare",
                                     payload_bytes, fmt::join(array.dims, "x")));
  }
  if (gzip_truncated(file.get())) return corrupt(path, "truncated gzip stream (trailer missing)");
  return array;
}

Result<Dataset> load_split(const std::string& images_path, const std::string& labels_path) {
  EMBER_ASSIGN_OR_RETURN(IdxArray images, read_idx_u8(images_path, 3));
  EMBER_ASSIGN_OR_RETURN(IdxArray labels, read_idx_u8(labels_path, 1));
  if (images.dims[0] != labels.dims[0]) {
    return make_error(ErrorCode::kCorrupt,
                      "{} holds {} images but {} holds {} labels; one of the files is corrupt: "
                      "reinstall the Debian package dataset-fashion-mnist "
                      "(apt-get install --reinstall dataset-fashion-mnist)",
                      images_path, images.dims[0], labels_path, labels.dims[0]);
  }
  if (images.dims[1] == 0 || images.dims[2] == 0) {
    return corrupt(images_path, fmt::format("image size {}x{}", images.dims[1], images.dims[2]));
  }
  const auto bad = std::find_if(labels.data.begin(), labels.data.end(),
                                [](std::uint8_t l) { return l >= kNumClasses; });
  if (bad != labels.data.end()) {
    return corrupt(labels_path, fmt::format("label {} at index {} is not a class (0..{})", *bad,
                                            bad - labels.data.begin(), kNumClasses - 1));
  }
  Dataset data;
  data.num_samples = images.dims[0];
  data.image_rows = images.dims[1];
  data.image_cols = images.dims[2];
  data.pixels = std::move(images.data);
  data.labels = std::move(labels.data);
  return data;
}

Status check_fashion_mnist_files(std::string_view dir) {
  for (std::string_view name : {kTrainImagesFile, kTrainLabelsFile, kTestImagesFile, kTestLabelsFile}) {
    EMBER_ASSIGN_OR_RETURN(const int fd, open_data_file(join_path(dir, name)));
    ::close(fd);
  }
  return ok_status();
}

Result<FashionMnist> load_fashion_mnist(std::string_view dir) {
  FashionMnist out;
  const std::string train_images = join_path(dir, kTrainImagesFile);
  const std::string test_images = join_path(dir, kTestImagesFile);
  EMBER_ASSIGN_OR_RETURN(out.train, load_split(train_images, join_path(dir, kTrainLabelsFile)));
  EMBER_ASSIGN_OR_RETURN(out.test, load_split(test_images, join_path(dir, kTestLabelsFile)));
  for (const auto* split : {&out.train, &out.test}) {
    if (split->image_rows != kImageRows || split->image_cols != kImageCols) {
      return corrupt(split == &out.train ? train_images : test_images,
                     fmt::format("images are {}x{}, Fashion-MNIST images are {}x{}",
                                 split->image_rows, split->image_cols, kImageRows, kImageCols));
    }
  }
  return out;
}

void gather_batch(const Dataset& data, std::span<const std::uint32_t> indices,
                  Eigen::Ref<Eigen::MatrixXf> inputs, std::span<std::uint8_t> labels) {
  const std::size_t features = data.num_features();
  EMBER_CHECK(static_cast<std::size_t>(inputs.rows()) == features);
  EMBER_CHECK(static_cast<std::size_t>(inputs.cols()) >= indices.size());
  EMBER_CHECK(labels.size() >= indices.size());
  static const std::array<float, 256> kPixelToInput = [] {
    std::array<float, 256> table{};
    for (std::size_t p = 0; p < table.size(); ++p) {
      table[p] = (static_cast<float>(p) / 255.0f - kPixelMean) / kPixelStd;
    }
    return table;
  }();
  for (std::size_t j = 0; j < indices.size(); ++j) {
    const std::size_t sample = indices[j];
    EMBER_DCHECK(sample < data.num_samples);
    const std::uint8_t* src = data.pixels.data() + sample * features;
    float* dst = inputs.col(static_cast<Eigen::Index>(j)).data();
    for (std::size_t k = 0; k < features; ++k) dst[k] = kPixelToInput[src[k]];
    labels[j] = data.labels[sample];
  }
}

}  // namespace ember::fashion_mnist
