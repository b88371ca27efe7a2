// Deterministic placement of keys and tensor chunks on servers and channels.
//
// Every worker, every server and the GPU pack plan compute the same map from
// (key, chunk index) to (server index, channel index), with no coordination:
// the map depends only on the key, the chunk index and the counts. Chunking
// follows ps-lite/BytePS: a tensor larger than partition_bytes is cut into
// ceil(bytes / step) chunks of step bytes, step being partition_bytes rounded
// down to a multiple of the element size (at least one element; the last
// chunk shorter), each placed independently so large tensors spread over servers
// and channels. Chunk boundaries are multiples of the element size.
//
// The hash is one step of SplitMix64 (Steele, Lea, Flood, "Fast Splittable
// Pseudorandom Number Generators", OOPSLA 2014): add the golden-ratio gamma,
// then mix with David Stafford's "Mix13" variant of MurmurHash3's finaliser
// (shifts 30, 27, 31 and his two multipliers), as Java 8's SplittableRandom
// and Vigna's splitmix64.c do. It mixes consecutive keys (0, 1, 2, ...) into
// well-spread values. Changing it breaks compatibility
// between workers and servers of different versions: the protocol version
// must change with it.
//
// Thread-safety: pure functions; no allocation except chunk_plan's vector.
// Usable from host and device code (EMBER_HOST_DEVICE) where marked.
#pragma once

#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define EMBER_HOST_DEVICE __host__ __device__
#else
#define EMBER_HOST_DEVICE
#endif

namespace ember::placement {

EMBER_HOST_DEVICE constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Identity of one chunk: chunk 0 of a tensor that is not cut is the tensor.
EMBER_HOST_DEVICE constexpr std::uint64_t chunk_hash(std::uint64_t key, std::uint32_t chunk_index) {
  return mix64(key ^ mix64(chunk_index));
}

// Server that owns (key, chunk). pre: num_servers > 0.
EMBER_HOST_DEVICE constexpr std::uint32_t server_of(std::uint64_t key, std::uint32_t chunk_index,
                                                    std::uint32_t num_servers) {
  return static_cast<std::uint32_t>(chunk_hash(key, chunk_index) % num_servers);
}

// Channel (lane) that carries (key, chunk). Uses different hash bits than
// server_of so that one server's chunks still spread over all channels.
// pre: num_channels > 0.
EMBER_HOST_DEVICE constexpr std::uint32_t channel_of(std::uint64_t key, std::uint32_t chunk_index,
                                                     std::uint32_t num_channels) {
  return static_cast<std::uint32_t>((chunk_hash(key, chunk_index) >> 32) % num_channels);
}

struct Chunk {
  std::uint32_t index = 0;          // chunk number within the tensor
  std::uint64_t offset_bytes = 0;   // from the tensor's first byte
  std::uint64_t length_bytes = 0;   // > 0 except for a zero-byte tensor's single chunk
  std::uint32_t server = 0;         // server_of(key, index, num_servers)
  std::uint32_t channel = 0;        // channel_of(key, index, num_channels)
};

// Cuts a tensor of `tensor_bytes` into chunks of at most `partition_bytes`
// (rounded down to a multiple of `element_bytes`, at least one element) and
// places each. A zero-byte tensor yields one zero-length chunk (so init and
// pull still reach its owner). pre: element_bytes > 0, partition_bytes > 0,
// num_servers > 0, num_channels > 0, tensor_bytes % element_bytes == 0, and
// num_chunks(...) < 2^32 (chunk indices are 32-bit on the wire).
std::vector<Chunk> chunk_plan(std::uint64_t key, std::uint64_t tensor_bytes,
                              std::uint64_t element_bytes, std::uint64_t partition_bytes,
                              std::uint32_t num_servers, std::uint32_t num_channels);

// Chunk `index` of chunk_plan's result, computed alone (no allocation,
// whatever the tensor's size). pre: as chunk_plan's, and
// index < num_chunks(tensor_bytes, element_bytes, partition_bytes).
Chunk chunk_at(std::uint64_t key, std::uint64_t tensor_bytes, std::uint64_t element_bytes,
               std::uint64_t partition_bytes, std::uint32_t index, std::uint32_t num_servers,
               std::uint32_t num_channels);

// Number of chunks chunk_plan would return.
EMBER_HOST_DEVICE constexpr std::uint64_t num_chunks(std::uint64_t tensor_bytes,
                                                     std::uint64_t element_bytes,
                                                     std::uint64_t partition_bytes) {
  std::uint64_t step = partition_bytes - partition_bytes % element_bytes;
  if (step == 0) step = element_bytes;
  return tensor_bytes == 0 ? 1 : (tensor_bytes + step - 1) / step;
}

}  // namespace ember::placement
