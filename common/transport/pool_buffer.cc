#include "common/transport/pool_buffer.h"

namespace ember::transport {
namespace {

// Frees one block on destruction. 32 bytes: stored inline in the Buffer.
struct BlockOwner {
  memory::PagePool* pool;
  memory::Block block;
  BlockOwner(memory::PagePool* p, memory::Block b) noexcept : pool(p), block(b) {}
  BlockOwner(BlockOwner&& o) noexcept : pool(o.pool), block(o.block) { o.pool = nullptr; }
  BlockOwner(const BlockOwner&) = delete;
  BlockOwner& operator=(const BlockOwner&) = delete;
  BlockOwner& operator=(BlockOwner&&) = delete;
  ~BlockOwner() {
    if (pool != nullptr) pool->free(block);
  }
};

}  // namespace

Result<std::uint32_t> register_pool(Transport& transport, memory::PagePool& pool) {
  return transport.register_memory(
      Transport::Region{pool.base(), static_cast<std::uint64_t>(pool.length_bytes()), pool.fd()});
}

Buffer pool_buffer(memory::PagePool& pool, memory::Block block, std::uint32_t region_id) {
  const MemoryLocation location{pool.fd(), block.offset_bytes(), region_id};
  const std::span<std::byte> bytes = block.span();
  return Buffer::adopt(bytes, location, BlockOwner(&pool, block));
}

Result<Buffer> allocate_buffer(memory::PagePool& pool, std::size_t size_bytes,
                               std::uint32_t region_id) {
  EMBER_ASSIGN_OR_RETURN(memory::Block block, pool.allocate(size_bytes));
  return pool_buffer(pool, block, region_id);
}

ReceiveAllocator pool_receive_allocator(memory::PagePool& pool, std::uint32_t region_id) {
  return [&pool, region_id](std::uint64_t size_bytes) -> Result<Buffer> {
    return allocate_buffer(pool, static_cast<std::size_t>(size_bytes), region_id);
  };
}

}  // namespace ember::transport
