// Chunk plans; see placement.h.
#include "common/placement/placement.h"

#include <algorithm>

#include "common/base/check.h"

namespace ember::placement {

std::vector<Chunk> chunk_plan(std::uint64_t key, std::uint64_t tensor_bytes,
                              std::uint64_t element_bytes, std::uint64_t partition_bytes,
                              std::uint32_t num_servers, std::uint32_t num_channels) {
  EMBER_CHECK(element_bytes > 0 && partition_bytes > 0 && num_servers > 0 && num_channels > 0);
  EMBER_CHECK_MSG(tensor_bytes % element_bytes == 0, "tensor_bytes={} element_bytes={}",
                  tensor_bytes, element_bytes);
  const std::uint64_t n = num_chunks(tensor_bytes, element_bytes, partition_bytes);
  std::vector<Chunk> chunks;
  chunks.reserve(n);
  for (std::uint64_t i = 0; i < n; ++i) {
    chunks.push_back(chunk_at(key, tensor_bytes, element_bytes, partition_bytes,
                              static_cast<std::uint32_t>(i), num_servers, num_channels));
  }
  return chunks;
}

Chunk chunk_at(std::uint64_t key, std::uint64_t tensor_bytes, std::uint64_t element_bytes,
               std::uint64_t partition_bytes, std::uint32_t index, std::uint32_t num_servers,
               std::uint32_t num_channels) {
  EMBER_DCHECK(index < num_chunks(tensor_bytes, element_bytes, partition_bytes));
  std::uint64_t step = partition_bytes - partition_bytes % element_bytes;
  if (step == 0) step = element_bytes;
  Chunk c;
  c.index = index;
  c.offset_bytes = index * step;
  c.length_bytes = tensor_bytes == 0 ? 0 : std::min(step, tensor_bytes - c.offset_bytes);
  c.server = server_of(key, index, num_servers);
  c.channel = channel_of(key, index, num_channels);
  return c;
}

}  // namespace ember::placement
