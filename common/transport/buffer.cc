// Buffer::heap: the fallback allocation for received large messages when no
// pool-backed receive allocator is configured, and a convenience for tests.
#include "common/transport/buffer.h"

#include <cstdlib>
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

}  // namespace ember::transport
