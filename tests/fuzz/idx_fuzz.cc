// Fuzz target: the Fashion-MNIST IDX reader (examples/fashion_mnist/data.h),
// plain or gzip-compressed. The first input byte picks the expected rank
// (1..4); the rest is the file, handed over through a memfd so that the
// reader's own open/zlib path runs. Never crashes, reads out of bounds or
// allocates more than the input can fill (the payload grows as bytes
// arrive); refusals are kCorrupt naming the path; what it accepts has the
// expected rank and exactly product(dims) bytes.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/base/check.h"
#include "examples/fashion_mnist/data.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t rank = 1 + data[0] % 4;
  const int fd = ::memfd_create("idx_fuzz", MFD_CLOEXEC);
  EMBER_CHECK(fd >= 0);
  std::size_t done = 1;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    EMBER_CHECK(n > 0);
    done += static_cast<std::size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  auto idx = ember::fashion_mnist::read_idx_u8(path, rank);
  ::close(fd);
  if (!idx) {
    EMBER_CHECK(idx.error().code() == ember::ErrorCode::kCorrupt);
    EMBER_CHECK(idx.error().message().find(path) != std::string::npos);
    return 0;
  }
  EMBER_CHECK(idx->dims.size() == rank);
  std::uint64_t elements = 1;
  for (const std::uint32_t d : idx->dims) elements *= d;
  EMBER_CHECK(idx->data.size() == elements);
  return 0;
}
