// Buffer: an owning, move-only handle to a contiguous run of bytes that a
// transport can send without copying, or that it hands to a receiver.
//
// The bytes usually live in a page-pool block (common/memory); a Buffer
// records where: the memfd that backs them and their offset in it, so that
// tcp can sendfile() from the fd, shm can name them to a peer that mapped the
// same memfd, and rdma can find the memory registration that covers them.
// Destroying (or reset()ting) a Buffer runs its owner's release exactly once:
// for a pool block that returns the block to its pool; for a received shm
// payload that tells the sending peer it may reuse its block.
//
// The owner is type-erased and stored inline when it fits in
// kInlineOwnerBytes (a pool block handle does), so adopting a block does not
// allocate; larger owners are placed on the heap.
//
// Thread-safety: a Buffer is a plain value; one thread uses it at a time. It
// may be moved to and destroyed on any thread, so an owner's destructor must
// be safe to run on any thread (the pool's free is).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <type_traits>
#include <utility>

namespace ember::transport {

// Where a Buffer's bytes are, for transports that move memory by reference.
struct MemoryLocation {
  // File descriptor of the memfd (or other mappable file) that backs the
  // bytes, -1 when they are plain process memory (heap, stack, a mapping of a
  // peer's memfd). Not owned by the location: the region it came from keeps it
  // open for as long as any Buffer in it lives.
  int fd = -1;
  // Byte offset of Buffer::data() within `fd`. Meaningless when fd == -1.
  std::uint64_t fd_offset = 0;
  // Id of the registered region (Transport::register_memory) that covers the
  // bytes, or kNoRegion. Lets shm and rdma find the peer's mapping / the
  // memory key without a lookup by address.
  std::uint32_t region_id = kNoRegion;

  static constexpr std::uint32_t kNoRegion = 0xFFFFFFFFu;
  bool has_fd() const noexcept { return fd >= 0; }
};

class Buffer {
 public:
  static constexpr std::size_t kInlineOwnerBytes = 48;

  Buffer() noexcept = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& other) noexcept { move_from(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      reset();
      move_from(other);
    }
    return *this;
  }
  ~Buffer() { reset(); }

  // A Buffer over `bytes` whose lifetime is tied to `owner`: the owner is
  // moved into the Buffer and destroyed when the Buffer is (that destruction
  // is the release). `bytes` must stay valid while the owner lives.
  // Allocates only when Owner is larger than kInlineOwnerBytes or not
  // nothrow-movable.
  template <typename Owner>
  static Buffer adopt(std::span<std::byte> bytes, MemoryLocation location, Owner&& owner) {
    using O = std::decay_t<Owner>;
    Buffer b;
    b.data_ = bytes.data();
    b.size_ = bytes.size();
    b.location_ = location;
    if constexpr (sizeof(O) <= kInlineOwnerBytes && alignof(O) <= alignof(std::max_align_t) &&
                  std::is_nothrow_move_constructible_v<O>) {
      ::new (static_cast<void*>(b.storage_)) O(std::forward<Owner>(owner));
      b.ops_ = &kInlineOps<O>;
    } else {
      O* heap = new O(std::forward<Owner>(owner));
      std::memcpy(b.storage_, &heap, sizeof(heap));
      b.ops_ = &kHeapOps<O>;
    }
    return b;
  }

  // A Buffer that does not own its bytes (the caller keeps them alive until
  // the transport is done: until the send completion runs). For tests and
  // for memory the caller manages itself.
  static Buffer borrow(std::span<std::byte> bytes, MemoryLocation location = {}) noexcept {
    Buffer b;
    b.data_ = bytes.data();
    b.size_ = bytes.size();
    b.location_ = location;
    return b;
  }

  // `size_bytes` of zero-initialised heap memory, 4 KiB aligned, no fd.
  // A convenience for tests and rare send paths (a copy of a caller's
  // bytes); the hot path uses pool blocks. Allocates; throws std::bad_alloc
  // like operator new.
  static Buffer heap(std::size_t size_bytes);
  // heap() for memory about to be written (a received message's body, a
  // copy of a payload): from 1 MiB up an anonymous mapping whose pages the
  // kernel zeroes when first touched, with no memset, so it is resident
  // only as far as it was written. A peer that declares a large message and
  // sends little of it costs address space, not memory. Below 1 MiB the
  // same as heap().
  static Buffer heap_lazy(std::size_t size_bytes);

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::span<std::byte> bytes() const noexcept { return {data_, size_}; }
  const MemoryLocation& location() const noexcept { return location_; }
  bool empty() const noexcept { return data_ == nullptr && ops_ == nullptr; }
  // True for an adopted Buffer (its release frees or recycles the memory);
  // false for a borrowed one (the caller manages the memory).
  bool owns_memory() const noexcept { return ops_ != nullptr; }
  explicit operator bool() const noexcept { return !empty(); }

  // Shrinks the visible length (the owner still releases the whole thing).
  // pre: size_bytes <= size().
  void truncate(std::size_t size_bytes) noexcept {
    if (size_bytes < size_) size_ = size_bytes;
  }

  // Runs the owner's release now; the Buffer becomes empty.
  void reset() noexcept {
    if (ops_ != nullptr) ops_->destroy(storage_);
    ops_ = nullptr;
    data_ = nullptr;
    size_ = 0;
    location_ = {};
  }

 private:
  struct Ops {
    void (*move)(unsigned char* from, unsigned char* to) noexcept;
    void (*destroy)(unsigned char* storage) noexcept;
  };
  template <typename O>
  static constexpr Ops kInlineOps = {
      [](unsigned char* from, unsigned char* to) noexcept {
        O* src = std::launder(reinterpret_cast<O*>(from));
        ::new (static_cast<void*>(to)) O(std::move(*src));
        src->~O();
      },
      [](unsigned char* storage) noexcept { std::launder(reinterpret_cast<O*>(storage))->~O(); }};
  template <typename O>
  static constexpr Ops kHeapOps = {
      [](unsigned char* from, unsigned char* to) noexcept { std::memcpy(to, from, sizeof(O*)); },
      [](unsigned char* storage) noexcept {
        O* heap = nullptr;
        std::memcpy(&heap, storage, sizeof(heap));
        delete heap;
      }};

  void move_from(Buffer& other) noexcept {
    data_ = other.data_;
    size_ = other.size_;
    location_ = other.location_;
    ops_ = other.ops_;
    if (ops_ != nullptr) ops_->move(other.storage_, storage_);
    other.ops_ = nullptr;
    other.data_ = nullptr;
    other.size_ = 0;
    other.location_ = {};
  }

  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  MemoryLocation location_{};
  const Ops* ops_ = nullptr;
  alignas(std::max_align_t) unsigned char storage_[kInlineOwnerBytes];
};

}  // namespace ember::transport
