// Data-path glue shared by server and worker; see runtime.h.
#include "common/proto/runtime.h"

#include "common/base/logging.h"
#include "common/transport/options_from_config.h"

namespace ember::proto {
namespace {

// Owner of a pool block inside a transport Buffer: freeing it is the release.
struct BlockOwner {
  memory::PagePool* pool = nullptr;
  memory::Block block;
  BlockOwner(memory::PagePool* p, memory::Block b) noexcept : pool(p), block(b) {}
  BlockOwner(BlockOwner&& o) noexcept : pool(std::exchange(o.pool, nullptr)), block(o.block) {}
  BlockOwner(const BlockOwner&) = delete;
  BlockOwner& operator=(const BlockOwner&) = delete;
  BlockOwner& operator=(BlockOwner&&) = delete;
  ~BlockOwner() {
    if (pool != nullptr) pool->free(block);
  }
};

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

}  // namespace

Result<transport::Options> transport_options(const config::Config& config) {
  // The [communication] mapping is transport::options_from_config's; the job
  // adds where the servers are (auto) and the worker's connect timeout.
  bool all_local = true;
  for (const auto& s : config.cluster.servers) all_local = all_local && is_loopback(s.host);
  EMBER_ASSIGN_OR_RETURN(transport::Options o,
                         transport::options_from_config(config.communication, all_local));
  o.connect_timeout = config.worker.connect_timeout;
  return o;
}

Result<std::unique_ptr<memory::PagePool>> make_pool(const config::Config& config,
                                                    const std::string& name) {
  memory::PoolOptions o;
  o.prealloc_pages = config.communication.prealloc_pages;
  switch (config.communication.pool_backing) {
    case config::PoolBacking::kAuto: o.backing = memory::BackingRequest::kAuto; break;
    case config::PoolBacking::kHugetlb: o.backing = memory::BackingRequest::kHugetlb; break;
    case config::PoolBacking::kThp: o.backing = memory::BackingRequest::kTransparentHuge; break;
    case config::PoolBacking::kPlain: o.backing = memory::BackingRequest::kPlain; break;
  }
  // "auto" may land on hugetlb (when hugepages are reserved), which cannot
  // feed sendfile: with zero_copy = "sendfile" it skips hugetlb.
  const bool sendfile = config.communication.zero_copy == config::ZeroCopy::kSendfile;
  const memory::BackingRequest requested = o.backing;
  o.backing = memory::backing_request_for_zero_copy(requested, sendfile);
  if (o.backing != requested) {
    log::logger("pool")->info(
        "page pool '{}': pool_backing = \"auto\" skips hugetlb because zero_copy = \"sendfile\" "
        "(a hugetlb memfd cannot feed sendfile: EINVAL); trying thp, then plain",
        name);
  }
  o.name = name;
  return memory::PagePool::create(o);
}

transport::Buffer pool_buffer(memory::PagePool& pool, memory::Block block, std::uint32_t region_id) {
  transport::MemoryLocation loc;
  loc.fd = pool.fd();
  loc.fd_offset = block.offset_bytes();
  loc.region_id = region_id;
  const std::span<std::byte> bytes = block.span();
  return transport::Buffer::adopt(bytes, loc, BlockOwner(&pool, block));
}

transport::Buffer allocate_buffer(memory::PagePool& pool, std::uint64_t bytes,
                                  std::uint32_t region_id, bool* fell_back) {
  if (bytes <= memory::kMaxBlockBytes) {
    if (auto block = pool.allocate(static_cast<std::size_t>(bytes))) {
      if (fell_back != nullptr) *fell_back = false;
      return pool_buffer(pool, *block, region_id);
    }
  }
  if (fell_back != nullptr) *fell_back = true;
  // Written next (a received body, a copy): resident only as far as it is
  // (a peer may declare a large message and send little of it).
  return transport::Buffer::heap_lazy(static_cast<std::size_t>(bytes));
}

transport::ReceiveAllocator pool_receive_allocator(memory::PagePool& pool, std::uint32_t region_id) {
  return [&pool, region_id](std::uint64_t size_bytes) -> Result<transport::Buffer> {
    bool fell_back = false;
    transport::Buffer b = allocate_buffer(pool, size_bytes, region_id, &fell_back);
    if (fell_back && size_bytes <= memory::kMaxBlockBytes) {
      static std::atomic<bool> warned{false};
      if (!warned.exchange(true)) {
        log::logger("pool")->warn(
            "pool '{}' exhausted: receiving into heap memory instead (slower; raise "
            "communication.prealloc_pages); see docs/troubleshooting.md#pool-exhaustion",
            pool.name());
      }
    }
    return b;
  };
}

std::string endpoint_address(transport::Kind kind, const config::HostPort& server) {
  if (kind == transport::Kind::kShm) return "@ember-" + server.to_string();
  return server.to_string();
}

}  // namespace ember::proto
