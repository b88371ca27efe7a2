// Copies that bypass the caches (non-temporal stores), for the one copy of a
// large pull reply. A normal copy of a buffer that does not fit in the
// last-level cache reads every destination line before writing it (the
// read-for-ownership) and evicts data the next request needs; non-temporal
// stores write whole lines straight to memory, so the copy moves 2 bytes of
// memory traffic per byte instead of 3. On the 2-core bench VM a 256 MiB copy
// in 4 MiB pieces by 2 threads ran at 18.5-19.1 GB/s against 11.6-12.9 GB/s
// with memcpy; for a buffer that fits in the cache it is slower (the reader
// then misses), hence the size rule in use_stream_copy().
//
// Technique: Intel 64 and IA-32 Architectures Optimization Reference Manual,
// "Non-temporal stores"; glibc's memcpy does the same above its
// x86_non_temporal_threshold tunable, which is derived from the cache size the
// CPU reports and is per call, whereas Ember decides per tensor (a tensor is
// copied in partition_bytes chunks, each below any such threshold).
//
// Thread-safety: pure functions; concurrent calls on disjoint buffers are fine.
#pragma once

#include <cstddef>

namespace ember::memory {

// Copies `bytes` bytes from `src` to `dst` (the ranges must not overlap, as
// with memcpy) with non-temporal stores where the CPU has them (x86-64: SSE2,
// always), else with memcpy. The stores are fenced before returning, so the
// data is visible to another thread or process that is told afterwards (by a
// ring push, a futex, a socket). Any alignment; the unaligned head and tail
// are copied with memcpy.
void stream_copy(void* dst, const void* src, std::size_t bytes) noexcept;

// The last-level cache size in bytes as the OS reports it
// (sysconf(_SC_LEVEL3_CACHE_SIZE), else level 2), or 32 MiB when unknown.
// Computed once; safe from any thread.
std::size_t last_level_cache_bytes() noexcept;

// Whether a copy that is part of moving a tensor of `tensor_bytes` should
// stream: when the tensor is at least a quarter of the last-level cache. A
// push then pull of a tensor touches three buffers of its size (gradient,
// parameters, destination), and the cache is shared with the other processes
// of the host, so from a quarter of the cache the destination would not be
// found in it anyway. On the bench VM (260 MiB reported) that streams the
// 64 MiB and 256 MiB sweep sizes and not 16 MiB.
bool use_stream_copy(std::size_t tensor_bytes) noexcept;

}  // namespace ember::memory
