// Adapters between the page pool (common/memory) and transport Buffers.
//
// A pool block becomes a Buffer whose release is PagePool::free and whose
// MemoryLocation names the pool's memfd, the block's offset in it and the
// pool's region id in a Transport, so tcp can sendfile() it and shm can lend
// it to the peer without a copy. The pool must be registered with the
// Transport (register_pool) before listen()/connect() for shm to lend it.
//
// Thread-safety: any thread (PagePool::allocate/free are thread-safe). The
// pool must outlive every Buffer made from it.
#pragma once

#include <cstdint>

#include "common/memory/page_pool.h"
#include "common/transport/transport.h"

namespace ember::transport {

// Registers the pool's whole region (base, length, memfd) with `transport`.
// Errors: as Transport::register_memory.
Result<std::uint32_t> register_pool(Transport& transport, memory::PagePool& pool);

// Adopts `block` (non-empty, from `pool`): the Buffer covers
// block.span() and frees the block when released. No allocation.
Buffer pool_buffer(memory::PagePool& pool, memory::Block block,
                   std::uint32_t region_id = MemoryLocation::kNoRegion);

// A pool block of `size_bytes` as a Buffer. Errors: as PagePool::allocate
// (kTooLarge over 64 MiB, kPoolExhausted).
Result<Buffer> allocate_buffer(memory::PagePool& pool, std::size_t size_bytes,
                               std::uint32_t region_id = MemoryLocation::kNoRegion);

// A ReceiveAllocator (Options::receive_allocator) that lands large received
// messages in `pool`. Errors from it close the connection that asked.
ReceiveAllocator pool_receive_allocator(memory::PagePool& pool,
                                        std::uint32_t region_id = MemoryLocation::kNoRegion);

}  // namespace ember::transport
