// Buffer::heap and heap_lazy: the fallback allocations for received large
// messages and copies (no pool, or above its largest block), and for tests.
#include "common/transport/buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "common/base/constants.h"

namespace ember::transport {
namespace {

// Owns one aligned heap allocation; freeing it is the release.
struct HeapOwner {
  void* memory = nullptr;
  explicit HeapOwner(void* m) noexcept : memory(m) {}
  HeapOwner(HeapOwner&& other) noexcept : memory(other.memory) { other.memory = nullptr; }
  HeapOwner(const HeapOwner&) = delete;
  HeapOwner& operator=(const HeapOwner&) = delete;
  HeapOwner& operator=(HeapOwner&&) = delete;
  ~HeapOwner() { std::free(memory); }
};

// Owns one anonymous mapping; unmapping it is the release.
struct MappingOwner {
  void* memory = nullptr;
  std::size_t length = 0;
  MappingOwner(void* m, std::size_t n) noexcept : memory(m), length(n) {}
  MappingOwner(MappingOwner&& other) noexcept : memory(other.memory), length(other.length) {
    other.memory = nullptr;
  }
  MappingOwner(const MappingOwner&) = delete;
  MappingOwner& operator=(const MappingOwner&) = delete;
  MappingOwner& operator=(MappingOwner&&) = delete;
  ~MappingOwner() {
    if (memory != nullptr) ::munmap(memory, length);
  }
};

// From this size up heap_lazy() maps memory the kernel zeroes lazily.
constexpr std::size_t kLazyZeroBytes = std::size_t{1} << 20;

}  // namespace

Buffer Buffer::heap(std::size_t size_bytes) {
  // aligned_alloc needs a size that is a multiple of the alignment.
  const std::size_t rounded = (size_bytes + kSmallPageBytes - 1) / kSmallPageBytes * kSmallPageBytes;
  void* memory = std::aligned_alloc(kSmallPageBytes, rounded == 0 ? kSmallPageBytes : rounded);
  if (memory == nullptr) throw std::bad_alloc();
  std::memset(memory, 0, size_bytes);
  return adopt(std::span<std::byte>(static_cast<std::byte*>(memory), size_bytes), MemoryLocation{},
               HeapOwner(memory));
}

Buffer Buffer::heap_lazy(std::size_t size_bytes) {
  if (size_bytes < kLazyZeroBytes) return heap(size_bytes);
  const std::size_t rounded = (size_bytes + kSmallPageBytes - 1) / kSmallPageBytes * kSmallPageBytes;
  // Zero pages on first touch (no memset: that would make all of it
  // resident before a byte arrived).
  void* memory = ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) throw std::bad_alloc();
  return adopt(std::span<std::byte>(static_cast<std::byte*>(memory), size_bytes), MemoryLocation{},
               MappingOwner(memory, rounded));
}

}  // namespace ember::transport
