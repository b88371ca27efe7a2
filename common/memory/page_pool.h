// The page pool: every buffer that carries a message lives here.
//
// One region is reserved up front, prealloc_pages x 2 MiB, backed by a memfd
// so the same bytes can be sent with sendfile (non-hugetlb backings), mapped
// by a same-host peer (MappedRegion, mapped_region.h), and registered once
// with RDMA (ibv_reg_mr) or CUDA (cudaHostRegister) over [base(), base() +
// length_bytes()). The region is pre-faulted at creation (PoolOptions::prefault)
// so allocation and the first write to a block never page-fault.
//
// Backing, tried in this order for BackingRequest::kAuto:
//   1. hugetlb: memfd_create(MFD_HUGETLB). Needs free 2 MiB hugepages, which
//      the operator provides by raising /proc/sys/vm/nr_hugepages. Cannot feed
//      sendfile/splice (the kernel answers EINVAL): supports_sendfile() is false.
//   2. transparent hugepages: a plain memfd, madvise(MADV_HUGEPAGE). For memfd
//      the kernel follows /sys/kernel/mm/transparent_hugepage/shmem_enabled
//      (not .../enabled); the pool asks the kernel (smaps "THPeligible") whether
//      the mapping qualifies and only then reports kTransparentHuge.
//   3. plain 4 KiB pages of a memfd.
// BackingRequest::kAutoNoHugetlb tries 2 then 3.
// The backing obtained is logged (logger "pool") and reported by backing() and
// stats(). An explicit request that cannot be met is an error that says which
// setting to change.
//
// Allocation: eight size classes (size_class.h, 4 KiB .. 64 MiB, x4 apart);
// every block is 4 KiB-aligned in memory and in the memfd. Blocks are carved
// lazily from the region with an atomic bump pointer; a freed block goes back
// to its class and is never returned to the OS nor given to another class.
// In front of each class's shared free list sits a per-thread cache (a
// magazine of up to 64 blocks per class), so the common allocate/free is a
// few loads and stores on thread-private memory. A magazine holds at most
// 1/256 of the region, so caches strand little memory: in a 128 MiB pool the
// classes of 1 MiB and up are uncached, in a 1 GiB pool those of 16 MiB and
// up; an uncached call costs one compare-and-swap on the shared list. A
// magazine that runs empty or full exchanges half its blocks with the shared
// list as one linked chain in one compare-and-swap (the transfer cache of
// tcmalloc). The shared lists are Treiber stacks with a 32-bit ABA tag; their
// links live in a side table, never inside the blocks, so a block's bytes are
// only ever written by its owner. A thread that uses more than 32 pools at
// once goes uncached for the others.
//
// Thread-safety: allocate, free, flush_thread_cache, block_at, contains and
// stats may be called from any thread at the same time. A block may be freed
// by a thread other than the one that allocated it. No call makes a system
// call or takes a lock on the fast path; a thread's first use of a pool and
// stats() take a process-wide mutex (cold path). create() and the destructor
// are not concurrent with other calls on the same pool.
//
// Ownership: the pool owns the memfd and the mapping; both end with the pool.
// A Block is a view: using it after free() or after the pool is destroyed is a
// bug. Blocks parked in a thread's cache return to the shared lists when the
// thread exits or calls flush_thread_cache().
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/constants.h"
#include "common/base/error.h"
#include "common/memory/size_class.h"

namespace ember::memory {

// What backs the region. Stable names: "hugetlb", "thp", "plain".
enum class Backing : std::uint8_t { kHugetlb, kTransparentHuge, kPlain };

// What the configuration asks for. kAuto tries hugetlb, then THP, then plain.
// kAutoNoHugetlb is kAuto without the hugetlb step (THP, then plain): what
// "auto" becomes when the pool must feed sendfile (see
// backing_request_for_zero_copy). Config names: "auto", "hugetlb", "thp",
// "plain"; kAutoNoHugetlb has none (backing_request_name says "auto without
// hugetlb"; parse_backing_request never returns it).
enum class BackingRequest : std::uint8_t { kAuto, kHugetlb, kTransparentHuge, kPlain, kAutoNoHugetlb };

std::string_view backing_name(Backing backing) noexcept;
std::string_view backing_request_name(BackingRequest request) noexcept;
// Parses a config value ("auto", "hugetlb", "thp", "plain"; also
// "transparent_huge"). Error kInvalidArgument naming the accepted values.
Result<BackingRequest> parse_backing_request(std::string_view text);

// False for hugetlb: a hugetlb memfd cannot be the source of sendfile/splice
// (EINVAL). The config check uses this to refuse `sendfile` with such a pool.
constexpr bool backing_supports_sendfile(Backing backing) noexcept {
  return backing != Backing::kHugetlb;
}
// Why sendfile is refused for `backing`; empty when it is supported.
std::string_view sendfile_unsupported_reason(Backing backing) noexcept;

// The request to give PagePool::create for a configured `request` when the
// pool's blocks will be sent with sendfile (`sendfile_source`): kAuto becomes
// kAutoNoHugetlb, since kAuto could land on hugetlb (whenever hugepages are
// reserved) and every large send would then fail with EINVAL. Every other
// request is returned as is (an explicit "hugetlb" with sendfile is refused
// by the config check, not here). Pure; any thread.
constexpr BackingRequest backing_request_for_zero_copy(BackingRequest request,
                                                       bool sendfile_source) noexcept {
  return sendfile_source && request == BackingRequest::kAuto ? BackingRequest::kAutoNoHugetlb
                                                             : request;
}

// prealloc_pages counts pages of this size, whatever the backing.
inline constexpr std::size_t kPoolPageBytes = kHugePageBytes;  // 2 MiB
// Upper bound for prealloc_pages (2 TiB of region): block indices are 32-bit.
inline constexpr std::size_t kMaxPreallocPages = std::size_t{1} << 20;
// Most blocks a thread caches per class.
inline constexpr std::size_t kMaxThreadCacheBlocks = 64;
// A thread caches at most region_bytes / kThreadCacheRegionShare per class.
inline constexpr std::size_t kThreadCacheRegionShare = 256;

// Test-only failure injection: the named attempt fails as if the kernel had
// refused it, so the fallback path can be tested on machines that do have
// hugepages. Never set outside tests.
struct PoolFaultInjection {
  bool deny_hugetlb = false;
  bool deny_transparent_huge = false;
};

struct PoolOptions {
  std::size_t prealloc_pages = 64;  // region size in 2 MiB pages; [1, kMaxPreallocPages]
  BackingRequest backing = BackingRequest::kAuto;
  bool prefault = true;             // fault every page in at create(); off: first touch faults
  bool thread_cache = true;         // off: every call goes to the shared lists (slower)
  std::string name = "pool";        // for logs, errors and the memfd name ("ember-pool:<name>")
  PoolFaultInjection inject;        // tests only
};

struct SizeClassStats {
  std::size_t block_bytes = 0;
  std::uint64_t blocks_in_use = 0;   // allocated and not yet freed
  std::uint64_t blocks_cached = 0;   // free, parked in threads' caches
  std::uint64_t blocks_free = 0;     // free, on the class's shared list
  std::uint64_t blocks_carved = 0;   // taken from the region so far (= sum of the three above)
};

// A snapshot. Exact when no thread is allocating or freeing; under traffic
// each counter is read at a slightly different moment.
struct PoolStats {
  Backing backing = Backing::kPlain;
  std::size_t total_pages = 0;           // prealloc_pages (2 MiB each)
  std::size_t region_bytes = 0;          // total_pages * 2 MiB
  std::uint64_t carved_bytes = 0;        // region bytes carved into blocks: the high-water mark
                                         // of bytes in use + cached, within one refill batch
  std::uint64_t pages_carved = 0;        // carved_bytes in 2 MiB pages, rounded up
  std::uint64_t bytes_in_use = 0;        // sum of capacity of blocks in use
  std::uint64_t huge_mapped_bytes = 0;   // bytes the kernel mapped with 2 MiB pages at creation
  std::uint64_t exhausted_count = 0;     // allocate() calls that failed with kPoolExhausted
  std::array<SizeClassStats, kNumSizeClasses> classes{};
};

namespace detail {
struct ThreadCache;
struct PoolInternals;
}  // namespace detail

class PagePool {
 public:
  // Reserves, maps and (by default) pre-faults the region. Blocking; takes
  // milliseconds per GiB. Errors: kInvalidArgument (prealloc_pages == 0),
  // kTooLarge (prealloc_pages > kMaxPreallocPages), kUnavailable (an explicit
  // backing cannot be had, the message naming the setting to change; or no
  // heap memory for the block tables, 9 bytes per 4 KiB of region in release
  // builds, 10 in debug builds),
  // kIo (a system call failed, e.g. not enough memory to pre-fault).
  static Result<std::unique_ptr<PagePool>> create(const PoolOptions& options);

  // Unmaps the region and closes the memfd. Blocks still in use dangle (a
  // warning is logged with their count). pre: no other thread is inside a
  // call on this pool.
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // A block of the smallest class that holds `bytes` (0 is allowed and gets a
  // 4 KiB block); block.size_bytes() == bytes. Any thread; no syscall; no lock
  // (a thread's first call on this pool registers its cache under a mutex).
  // Errors: kTooLarge when bytes > kMaxBlockBytes (64 MiB);
  //         kPoolExhausted when the class has no free block and the region has
  //         no room to carve one (the message gives pages carved of total, the
  //         class, and the knobs prealloc_pages and batch_threshold).
  [[nodiscard]] Result<Block> allocate(std::size_t bytes);

  // Returns `block` to its class. Any thread, also one that did not allocate
  // it; no syscall, no lock, never fails. An empty Block is ignored. pre: the
  // block came from this pool (checked: aborts otherwise) and is freed once
  // (checked in debug builds).
  void free(Block block) noexcept;

  // Moves the blocks cached by the calling thread for this pool back to the
  // shared lists, so other threads can have them. For a thread about to idle.
  void flush_thread_cache() noexcept;

  // Rebuilds the Block that starts at `offset_bytes` in the memfd (for
  // offsets a peer sends back), with size_bytes() = `size_bytes`. Any thread.
  // Errors: kInvalidArgument when the offset is outside the region, not
  // 4 KiB-aligned, not the start of a carved block, or size_bytes exceeds
  // the block's capacity. It cannot tell a free block from one in use.
  [[nodiscard]] Result<Block> block_at(std::uint64_t offset_bytes, std::size_t size_bytes) const;

  // True when p points into [base(), base() + length_bytes()).
  bool contains(const void* p) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    return b >= base_ && b < base_ + length_bytes_;
  }

  int fd() const noexcept { return fd_; }                       // owned by the pool
  std::byte* base() const noexcept { return base_; }            // 2 MiB-aligned
  std::size_t length_bytes() const noexcept { return length_bytes_; }
  Backing backing() const noexcept { return backing_; }
  bool supports_sendfile() const noexcept { return backing_supports_sendfile(backing_); }
  const std::string& name() const noexcept { return name_; }
  std::size_t prealloc_pages() const noexcept { return length_bytes_ / kPoolPageBytes; }
  // Blocks of `size_class` one thread may cache (0: that class is uncached).
  std::size_t thread_cache_capacity(std::size_t size_class) const noexcept {
    return cache_capacity_[size_class];
  }

  // Snapshot of the counters; takes the process-wide cache registry mutex
  // (cold path: for metrics and error messages, not per message).
  PoolStats stats() const;

 private:
  PagePool(const PoolOptions& options, int fd, std::byte* base, std::size_t length_bytes,
           Backing backing, std::uint64_t huge_mapped_bytes);

  // Treiber stack of chains per class. head = (tag << 32) | (first slot + 1).
  struct alignas(kFalseSharingBytes) SharedList {
    std::atomic<std::uint64_t> head{0};
    std::atomic<std::uint64_t> carved_blocks{0};
    // Allocations and frees not counted by a live thread cache: those that
    // bypassed a cache, and the counts of caches retired at thread exit.
    std::atomic<std::uint64_t> allocs_outside_caches{0};
    std::atomic<std::uint64_t> frees_outside_caches{0};
  };
  // Blocks carved from the region: `count` blocks of one class, contiguous
  // from slot `first`.
  struct Carved {
    std::uint32_t first = 0;
    std::uint32_t count = 0;
  };

  detail::ThreadCache* local_cache() noexcept;
  detail::ThreadCache* local_cache_slow() noexcept;
  Result<Block> allocate_slow(std::size_t size_class, std::size_t bytes, detail::ThreadCache* tc);
  void free_slow(std::uint32_t slot, std::size_t size_class, detail::ThreadCache* tc) noexcept;
  // Links `count` (>= 1) slots into a chain through next_in_chain_ and pushes
  // it on the class's shared list with one CAS.
  void push_slots(std::size_t size_class, const std::uint32_t* slots, std::size_t count) noexcept;
  // Pushes a chain that is already linked (its last link is 0).
  void push_linked_chain(std::size_t size_class, std::uint32_t head_slot) noexcept;
  // Pops one chain; returns its first slot + 1, or 0 when the list is empty.
  std::uint32_t pop_chain(std::size_t size_class) noexcept;
  // Carves up to max_blocks blocks; count 0 when the region is full.
  Carved carve(std::size_t size_class, std::size_t max_blocks) noexcept;
  // Writes up to `max_blocks` (>= 1) free slots of the class to `out` from
  // the shared list (one chain; any excess is pushed back) or, when that is
  // empty, from the region. Returns how many; 0 when exhausted.
  std::uint32_t refill(std::size_t size_class, std::uint32_t* out, std::uint32_t max_blocks) noexcept;
  void flush_cache(detail::ThreadCache& tc) noexcept;
  // Flushes and deletes `tc`. Registry mutex held.
  void retire_cache_locked(detail::ThreadCache* tc) noexcept;
  PoolStats stats_locked() const;
  tl::unexpected<Error> exhausted_error(std::size_t size_class, std::size_t bytes);
  Block make_block(std::uint32_t slot, std::size_t size_class, std::size_t bytes) const noexcept {
    const std::uint64_t offset = std::uint64_t{slot} << kMinBlockShift;
    return Block(base_ + offset, offset, static_cast<std::uint32_t>(bytes),
                 static_cast<std::uint8_t>(size_class));
  }
  void mark_allocated(std::uint32_t slot) noexcept;
  void mark_freed(std::uint32_t slot) noexcept;

  friend struct detail::PoolInternals;

  const std::uint64_t id_;  // process-unique, never reused; 0 is never an id
  const std::string name_;
  const bool use_thread_cache_;
  const int fd_;
  std::byte* const base_;
  const std::size_t length_bytes_;
  const std::uint32_t num_slots_;  // 4 KiB slots in the region
  const Backing backing_;
  const std::uint64_t huge_mapped_bytes_;
  std::array<std::uint32_t, kNumSizeClasses> cache_capacity_{};
  std::array<std::uint32_t, kNumSizeClasses> cache_batch_{};

  // Side tables indexed by slot (block start / 4 KiB). Written by the thread
  // that owns the block (or carves it), read by poppers and block_at.
  std::unique_ptr<std::atomic<std::uint32_t>[]> next_in_chain_;  // next slot + 1, 0 = end
  std::unique_ptr<std::atomic<std::uint32_t>[]> next_chain_;     // for chain heads
  std::unique_ptr<std::atomic<std::uint8_t>[]> slot_class_;      // class + 1 at a block start, else 0
  std::unique_ptr<std::atomic<std::uint8_t>[]> slot_live_;       // debug builds: 1 while allocated

  alignas(kFalseSharingBytes) std::atomic<std::uint64_t> carved_bytes_{0};
  alignas(kFalseSharingBytes) std::array<SharedList, kNumSizeClasses> lists_{};
  std::atomic<std::uint64_t> exhausted_count_{0};

  // Thread caches of this pool; guarded by the process-wide registry mutex.
  std::vector<detail::ThreadCache*> caches_;
};

// Owning handle: frees the block on destruction. Move-only. Not thread-safe
// itself (like unique_ptr); the pool must outlive it.
class UniqueBlock {
 public:
  UniqueBlock() = default;
  UniqueBlock(PagePool* pool, Block block) noexcept : pool_(pool), block_(block) {}
  UniqueBlock(UniqueBlock&& other) noexcept : pool_(other.pool_), block_(other.release()) {}
  UniqueBlock& operator=(UniqueBlock&& other) noexcept {
    if (this != &other) {
      reset();
      pool_ = other.pool_;
      block_ = other.release();
    }
    return *this;
  }
  UniqueBlock(const UniqueBlock&) = delete;
  UniqueBlock& operator=(const UniqueBlock&) = delete;
  ~UniqueBlock() { reset(); }

  const Block& get() const noexcept { return block_; }
  Block& get() noexcept { return block_; }
  const Block* operator->() const noexcept { return &block_; }
  Block* operator->() noexcept { return &block_; }
  explicit operator bool() const noexcept { return !block_.empty(); }
  // Gives up ownership without freeing.
  Block release() noexcept {
    Block b = block_;
    block_ = Block();
    return b;
  }
  void reset() noexcept {
    if (!block_.empty()) pool_->free(release());
  }

 private:
  PagePool* pool_ = nullptr;
  Block block_;
};

}  // namespace ember::memory
