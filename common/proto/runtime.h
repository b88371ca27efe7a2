// Glue shared by ember-server and the worker client: the data path both ends
// build from the same [communication] table — transport options, the page
// pool, pool blocks as transport Buffers, and the receive allocator that
// lands large messages in pool blocks.
//
// Thread-safety: free functions; the returned allocator and Buffers are
// thread-safe to use and release from any thread (the pool's are).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/base/error.h"
#include "common/config/config.h"
#include "common/memory/page_pool.h"
#include "common/transport/transport.h"

namespace ember::proto {

// Transport options from config: kind (tcp/shm/rdma; "auto" picks shm when
// every server is on a loopback address, else rdma when an RDMA device has an
// active port, else tcp, and logs why: transport::rdma::choose_auto),
// batching, channels (resolved_num_channels), I/O threads and their CPUs,
// heartbeats, sizes, auth token. `connect_timeout` comes from [worker].
// "rdma" without a device fails later, in Transport::create (kUnavailable).
// Errors: kConfig (a value transport::Options::validate refuses).
[[nodiscard]] Result<transport::Options> transport_options(const config::Config& config);

// The page pool of [communication] (prealloc_pages, pool_backing), named
// `name` in logs; pool_backing = "auto" with zero_copy = "sendfile" skips
// hugetlb (a hugetlb memfd cannot feed sendfile) and logs why. Errors:
// those of memory::PagePool::create.
[[nodiscard]] Result<std::unique_ptr<memory::PagePool>> make_pool(const config::Config& config,
                                                                   const std::string& name);

// Wraps `block` (from `pool`) as a Buffer of block.size_bytes() whose release
// frees the block; the location names the pool's memfd, the block's offset
// and `region_id` (from Transport::register_memory, or kNoRegion).
transport::Buffer pool_buffer(memory::PagePool& pool, memory::Block block,
                              std::uint32_t region_id = transport::MemoryLocation::kNoRegion);

// A block of `bytes` as a Buffer; falls back to Buffer::heap_lazy when
// `bytes` exceeds the largest block class (64 MiB) or the pool is exhausted
// (`fell_back`, when non-null, is set then). Errors: none from the pool path
// (the heap path throws std::bad_alloc only when memory is truly gone).
transport::Buffer allocate_buffer(memory::PagePool& pool, std::uint64_t bytes,
                                  std::uint32_t region_id, bool* fell_back = nullptr);

// Receive allocator over `pool` (see allocate_buffer). The pool must outlive
// the transport that uses it.
transport::ReceiveAllocator pool_receive_allocator(memory::PagePool& pool, std::uint32_t region_id);

// The address a transport of `kind` listens on / connects to for the server
// at `server`: "host:port" for tcp; for shm the abstract Unix socket
// "@ember-<host>:<port>" (same host only).
std::string endpoint_address(transport::Kind kind, const config::HostPort& server);

}  // namespace ember::proto
