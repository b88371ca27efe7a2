// Page pool: region setup (backing choice, pre-faulting), size-class free
// lists, per-thread caches and their process-wide registry. See page_pool.h.
//
// Invariants:
//  - A slot (4 KiB unit of the region) that starts a carved block has
//    slot_class_[slot] = class + 1 forever after; other slots hold 0.
//  - Every free block of class c is in exactly one place: a magazine of one
//    thread cache, or a chain on lists_[c]. A chain holds at most
//    max(1, cache_batch_[c]) blocks, which is <= cache_capacity_[c] when that
//    is non-zero, so a popped chain always fits an empty magazine.
//  - A ThreadCache is reachable from its pool's caches_ and from one thread's
//    TLS table. It is deleted under the registry mutex, either by the pool's
//    destructor or by its thread's exit hook (after checking, by pool id, that
//    the pool is still alive). Pool ids are never reused, so a stale TLS entry
//    never matches a live pool.
#include "common/memory/page_pool.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <new>
#include <optional>
#include <unordered_map>
#include <utility>

#include "common/base/check.h"
#include "common/base/logging.h"
#include "common/base/units.h"
#include "common/memory/os_memory.h"

namespace ember::memory {
namespace detail {

// One class's cache in one thread. `slots` and the counters are written only
// by the owning thread; stats() reads the counters from other threads, hence
// the relaxed atomics (single writer: load + store, no read-modify-write).
struct Magazine {
  std::atomic<std::uint32_t> count{0};
  std::atomic<std::uint64_t> allocs{0};
  std::atomic<std::uint64_t> frees{0};
  std::uint32_t slots[kMaxThreadCacheBlocks];
};

struct ThreadCache {
  std::array<Magazine, kNumSizeClasses> mags;
};

}  // namespace detail

namespace {

#ifdef NDEBUG
constexpr bool kDebugBuild = false;  // slot_live_ exists only in debug builds
#else
constexpr bool kDebugBuild = true;
#endif

using detail::Magazine;
using detail::ThreadCache;

constexpr auto kRelaxed = std::memory_order_relaxed;
constexpr std::size_t kMaxPoolsPerThread = 32;

inline void bump(std::atomic<std::uint64_t>& counter) noexcept {
  counter.store(counter.load(kRelaxed) + 1, kRelaxed);  // single writer
}

// The one pool a thread used last. Initial-exec TLS: a plain %fs-relative
// load on the fast path (the default model for -fPIC code would call
// __tls_get_addr). Kept to 16 bytes so it fits the static TLS surplus even
// when the library is dlopen()ed (the Python package).
struct TlsFast {
  std::uint64_t pool_id;
  ThreadCache* cache;
};
[[gnu::tls_model("initial-exec")]] constinit thread_local TlsFast t_fast{0, nullptr};

// All pools this thread has a cache for (cold path).
struct TlsEntry {
  std::uint64_t pool_id;
  ThreadCache* cache;
};
struct TlsSlow {
  std::uint32_t num_entries;
  bool exiting;  // the exit hook ran: caches are gone, later calls go uncached
  TlsEntry entries[kMaxPoolsPerThread];
};
constinit thread_local TlsSlow t_slow{};

struct Registry {
  std::mutex mu;
  std::unordered_map<std::uint64_t, PagePool*> live;  // guarded by mu
};
Registry& registry() {
  // Leaked on purpose: thread-exit hooks may run after static destructors.
  static Registry* r = new Registry();
  return *r;
}

std::atomic<std::uint64_t> g_next_pool_id{1};

}  // namespace

namespace detail {

struct PoolInternals {
  // Runs at thread exit: returns this thread's cached blocks to live pools.
  static void release_thread_caches() noexcept {
    t_slow.exiting = true;
    t_fast = TlsFast{0, nullptr};
    std::lock_guard<std::mutex> lock(registry().mu);
    for (std::uint32_t i = 0; i < t_slow.num_entries; ++i) {
      const auto it = registry().live.find(t_slow.entries[i].pool_id);
      if (it != registry().live.end()) it->second->retire_cache_locked(t_slow.entries[i].cache);
    }
    t_slow.num_entries = 0;
  }
};

}  // namespace detail

namespace {

struct ThreadExitHook {
  ThreadExitHook() = default;
  ThreadExitHook(const ThreadExitHook&) = delete;
  ThreadExitHook& operator=(const ThreadExitHook&) = delete;
  ~ThreadExitHook() { detail::PoolInternals::release_thread_caches(); }
};

void arm_thread_exit_hook() {
  // First use constructs it and registers its destructor for this thread.
  static thread_local ThreadExitHook hook;
  (void)&hook;
}

}  // namespace

std::string_view backing_name(Backing backing) noexcept {
  switch (backing) {
    case Backing::kHugetlb: return "hugetlb";
    case Backing::kTransparentHuge: return "thp";
    case Backing::kPlain: return "plain";
  }
  return "unknown";
}

std::string_view backing_request_name(BackingRequest request) noexcept {
  switch (request) {
    case BackingRequest::kAuto: return "auto";
    case BackingRequest::kHugetlb: return "hugetlb";
    case BackingRequest::kTransparentHuge: return "thp";
    case BackingRequest::kPlain: return "plain";
    case BackingRequest::kAutoNoHugetlb: return "auto without hugetlb";
  }
  return "unknown";
}

Result<BackingRequest> parse_backing_request(std::string_view text) {
  if (text == "auto") return BackingRequest::kAuto;
  if (text == "hugetlb") return BackingRequest::kHugetlb;
  if (text == "thp" || text == "transparent_huge") return BackingRequest::kTransparentHuge;
  if (text == "plain") return BackingRequest::kPlain;
  return make_error(ErrorCode::kInvalidArgument,
                    "unknown page pool backing '{}'; use one of auto, hugetlb, thp, plain", text);
}

std::string_view sendfile_unsupported_reason(Backing backing) noexcept {
  if (backing_supports_sendfile(backing)) return {};
  return "the page pool is backed by hugetlb pages, and the kernel cannot sendfile/splice from a "
         "hugetlb memfd (EINVAL); use backing 'thp' or 'plain', or a transport mode without "
         "sendfile";
}

namespace {

// A mapped memfd region before the pool object exists; unmaps and closes
// itself unless released.
struct RegionGuard {
  int fd = -1;
  std::byte* base = nullptr;
  std::size_t length_bytes = 0;
  Backing backing = Backing::kPlain;
  std::string note;  // why a THP request ended up plain

  RegionGuard() = default;
  RegionGuard(RegionGuard&& o) noexcept
      : fd(std::exchange(o.fd, -1)), base(std::exchange(o.base, nullptr)),
        length_bytes(o.length_bytes), backing(o.backing), note(std::move(o.note)) {}
  RegionGuard& operator=(RegionGuard&&) = delete;
  RegionGuard(const RegionGuard&) = delete;
  ~RegionGuard() {
    os::unmap(base, length_bytes);
    if (fd >= 0) ::close(fd);
  }
};

Result<RegionGuard> attempt_hugetlb(const std::string& memfd_name, std::size_t length_bytes,
                                    const PoolFaultInjection& inject) {
  const std::size_t pages = length_bytes / kPoolPageBytes;
  if (inject.deny_hugetlb) {
    return make_error(ErrorCode::kUnavailable, "hugetlb backing refused by fault injection");
  }
  RegionGuard region;
  region.length_bytes = length_bytes;
  region.backing = Backing::kHugetlb;
  auto fd = os::create_memfd(memfd_name, /*hugetlb=*/true, length_bytes);
  if (!fd) {
    return make_error(ErrorCode::kUnavailable,
                      "the kernel refused a hugetlb memfd ({}); is hugetlbfs support built in?",
                      fd.error().to_string());
  }
  region.fd = *fd;
  auto base = os::map_shared_aligned(region.fd, length_bytes, kPoolPageBytes, false);
  if (!base) {
    const auto counts = os::read_hugetlb_counts();
    if (base.error().sys_errno() == ENOMEM) {
      return make_error(ErrorCode::kUnavailable,
                        "not enough free 2 MiB hugepages: the pool needs {}, {} of {} are free; "
                        "raise /proc/sys/vm/nr_hugepages to at least {} (sysctl -w "
                        "vm.nr_hugepages={}), or use backing 'thp' or 'plain'",
                        pages, counts.free_pages, counts.total_pages,
                        counts.total_pages - counts.free_pages + pages,
                        counts.total_pages - counts.free_pages + pages);
    }
    return make_error(ErrorCode::kUnavailable, "mapping the hugetlb memfd failed: {}",
                      base.error().to_string());
  }
  region.base = *base;
  return region;
}

Result<RegionGuard> attempt_shmem(const std::string& memfd_name, std::size_t length_bytes,
                                  bool want_thp, const PoolFaultInjection& inject) {
  RegionGuard region;
  region.length_bytes = length_bytes;
  region.backing = Backing::kPlain;
  EMBER_ASSIGN_OR_RETURN(region.fd, os::create_memfd(memfd_name, /*hugetlb=*/false, length_bytes));
  EMBER_ASSIGN_OR_RETURN(region.base,
                         os::map_shared_aligned(region.fd, length_bytes, kPoolPageBytes, false));
  if (!want_thp) return region;
  if (inject.deny_transparent_huge) {
    region.note = "transparent hugepages refused by fault injection";
    return region;
  }
  if (auto advised = os::advise_hugepage(region.base, length_bytes); !advised) {
    region.note = fmt::format("madvise(MADV_HUGEPAGE) failed ({}); the kernel may lack THP",
                              advised.error().to_string());
    return region;
  }
  // The kernel's own verdict for this mapping; sysfs policy when smaps is
  // unreadable (e.g. a restricted /proc).
  const auto policy = os::read_shmem_thp_policy();
  const auto vma = os::read_vma_info(region.base);
  const bool eligible =
      vma.found ? vma.thp_eligible : os::shmem_thp_policy_allows_madvise(policy.value);
  if (eligible) {
    region.backing = Backing::kTransparentHuge;
  } else {
    region.note = fmt::format(
        "transparent hugepages for shared memory are off ({} is '{}'); write 'advise' to it "
        "to back pools with THP",
        policy.path, policy.value.empty() ? "unreadable" : policy.value);
  }
  return region;
}

}  // namespace

Result<std::unique_ptr<PagePool>> PagePool::create(const PoolOptions& options) {
  if (options.prealloc_pages == 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "page pool '{}': prealloc_pages is 0; it must be at least 1 (2 MiB pages); "
                      "set [communication] prealloc_pages",
                      options.name);
  }
  if (options.prealloc_pages > kMaxPreallocPages) {
    return make_error(ErrorCode::kTooLarge,
                      "page pool '{}': prealloc_pages {} exceeds the maximum {} ({} of 2 MiB "
                      "pages); lower [communication] prealloc_pages",
                      options.name, options.prealloc_pages, kMaxPreallocPages,
                      format_bytes(kMaxPreallocPages * kPoolPageBytes));
  }
  const auto start = std::chrono::steady_clock::now();
  const std::size_t length_bytes = options.prealloc_pages * kPoolPageBytes;
  const std::string memfd_name = "ember-pool:" + options.name;
  const auto request = options.backing;
  std::string fallback_notes;

  std::optional<RegionGuard> region;
  if (request == BackingRequest::kAuto || request == BackingRequest::kHugetlb) {
    auto huge = attempt_hugetlb(memfd_name, length_bytes, options.inject);
    if (huge) {
      region.emplace(std::move(*huge));
    } else if (request == BackingRequest::kHugetlb) {
      return tl::unexpected(std::move(huge.error())
                                .with_context(fmt::format("page pool '{}': backing 'hugetlb' "
                                                          "was requested but",
                                                          options.name)));
    } else {
      fallback_notes = fmt::format("hugetlb: {}", huge.error().message());
    }
  } else if (request == BackingRequest::kAutoNoHugetlb) {
    fallback_notes = "hugetlb: skipped, the pool feeds sendfile (a hugetlb memfd cannot: EINVAL)";
  }
  if (!region) {
    const bool want_thp = request != BackingRequest::kPlain;
    auto shm = attempt_shmem(memfd_name, length_bytes, want_thp, options.inject);
    if (!shm) {
      return tl::unexpected(std::move(shm.error())
                                .with_context(fmt::format("page pool '{}'", options.name)));
    }
    if (request == BackingRequest::kTransparentHuge && shm->backing != Backing::kTransparentHuge) {
      return make_error(ErrorCode::kUnavailable,
                        "page pool '{}': backing 'thp' was requested but {}; or use backing "
                        "'auto' or 'plain'",
                        options.name, shm->note);
    }
    if (!shm->note.empty()) {
      if (!fallback_notes.empty()) fallback_notes += "; ";
      fallback_notes += "thp: " + shm->note;
    }
    region.emplace(std::move(*shm));
  }

  if (options.prefault) {
    if (auto populated = os::populate_write(region->base, length_bytes); !populated) {
      return tl::unexpected(std::move(populated.error())
                                .with_context(fmt::format(
                                    "page pool '{}': pre-faulting {} ({} pages) failed; free "
                                    "memory or lower prealloc_pages",
                                    options.name, format_bytes(length_bytes),
                                    options.prealloc_pages)));
    }
  }
  const auto vma = os::read_vma_info(region->base);
  const std::uint64_t huge_mapped_bytes =
      region->backing == Backing::kHugetlb ? vma.hugetlb_bytes : vma.pmd_mapped_bytes;

  std::unique_ptr<PagePool> pool;
  try {
    pool.reset(new PagePool(options, region->fd, region->base, length_bytes, region->backing,
                            huge_mapped_bytes));
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kUnavailable,
                      "page pool '{}': no memory for the block tables of {} ({} bytes per 4 KiB); "
                      "lower prealloc_pages",
                      options.name, format_bytes(length_bytes),
                      2 * sizeof(std::uint32_t) + sizeof(std::uint8_t) + (kDebugBuild ? 1 : 0));
  }
  region->fd = -1;  // now owned by the pool
  region->base = nullptr;

  const auto elapsed_ms = std::chrono::duration<double, std::milli>(
                              std::chrono::steady_clock::now() - start)
                              .count();
  auto log = ember::log::logger("pool");
  log->info("page pool '{}': {} pages of 2 MiB ({}) backed by {} (requested {}), {}, fd {}, "
            "{} mapped with 2 MiB pages, ready in {:.1f} ms{}{}",
            pool->name_, options.prealloc_pages, format_bytes(length_bytes),
            backing_name(pool->backing_), backing_request_name(request),
            options.prefault ? "pre-faulted" : "not pre-faulted", pool->fd_,
            format_bytes(huge_mapped_bytes), elapsed_ms, fallback_notes.empty() ? "" : "; ",
            fallback_notes);
  if (pool->backing_ == Backing::kTransparentHuge && options.prefault && vma.found &&
      huge_mapped_bytes == 0) {
    log->warn("page pool '{}': THP was granted but the kernel mapped no 2 MiB pages "
              "(fragmented memory?); the pool works with 4 KiB pages; see "
              "docs/troubleshooting.md#throughput-drops",
              pool->name_);
  }
  return pool;
}

PagePool::PagePool(const PoolOptions& options, int fd, std::byte* base, std::size_t length_bytes,
                   Backing backing, std::uint64_t huge_mapped_bytes)
    : id_(g_next_pool_id.fetch_add(1, kRelaxed)),
      name_(options.name),
      use_thread_cache_(options.thread_cache),
      fd_(fd),
      base_(base),
      length_bytes_(length_bytes),
      num_slots_(static_cast<std::uint32_t>(length_bytes >> kMinBlockShift)),
      backing_(backing),
      huge_mapped_bytes_(huge_mapped_bytes),
      next_in_chain_(new std::atomic<std::uint32_t>[num_slots_]()),
      next_chain_(new std::atomic<std::uint32_t>[num_slots_]()),
      slot_class_(new std::atomic<std::uint8_t>[num_slots_]()) {
#ifndef NDEBUG
  slot_live_.reset(new std::atomic<std::uint8_t>[num_slots_]());
#endif
  for (std::size_t c = 0; c < kNumSizeClasses; ++c) {
    const std::size_t share = length_bytes_ / (kThreadCacheRegionShare * size_class_bytes(c));
    cache_capacity_[c] = static_cast<std::uint32_t>(std::min(kMaxThreadCacheBlocks, share));
    cache_batch_[c] = std::max<std::uint32_t>(1, cache_capacity_[c] / 2);
  }
  std::lock_guard<std::mutex> lock(registry().mu);
  registry().live.emplace(id_, this);
}

PagePool::~PagePool() {
  PoolStats final_stats;
  {
    std::lock_guard<std::mutex> lock(registry().mu);
    final_stats = stats_locked();
    registry().live.erase(id_);
    for (ThreadCache* tc : caches_) delete tc;
    caches_.clear();
  }
  std::uint64_t in_use = 0;
  for (const auto& c : final_stats.classes) in_use += c.blocks_in_use;
  if (in_use != 0) {
    ember::log::logger("pool")->warn(
        "page pool '{}' destroyed with {} blocks ({}) still in use; they now dangle", name_,
        in_use, format_bytes(final_stats.bytes_in_use));
  }
  os::unmap(base_, length_bytes_);
  if (fd_ >= 0) ::close(fd_);
}

// ---- debug-build double-free detection ----

#ifndef NDEBUG
void PagePool::mark_allocated(std::uint32_t slot) noexcept {
  const auto was = slot_live_[slot].exchange(1, kRelaxed);
  EMBER_CHECK_MSG(was == 0, "page pool '{}': block at offset {} handed out while in use "
                  "(a free list is corrupt)", name_, std::uint64_t{slot} << kMinBlockShift);
}
void PagePool::mark_freed(std::uint32_t slot) noexcept {
  const auto was = slot_live_[slot].exchange(0, kRelaxed);
  EMBER_CHECK_MSG(was == 1, "page pool '{}': double free of the block at offset {}", name_,
                  std::uint64_t{slot} << kMinBlockShift);
}
#else
void PagePool::mark_allocated(std::uint32_t) noexcept {}
void PagePool::mark_freed(std::uint32_t) noexcept {}
#endif

// ---- thread caches ----

inline ThreadCache* PagePool::local_cache() noexcept {
  if (t_fast.pool_id == id_) [[likely]] return t_fast.cache;
  return local_cache_slow();
}

ThreadCache* PagePool::local_cache_slow() noexcept {
  if (!use_thread_cache_ || t_slow.exiting) return nullptr;
  for (std::uint32_t i = 0; i < t_slow.num_entries; ++i) {
    if (t_slow.entries[i].pool_id == id_) {
      t_fast = TlsFast{id_, t_slow.entries[i].cache};
      return t_slow.entries[i].cache;
    }
  }
  std::lock_guard<std::mutex> lock(registry().mu);
  // Forget caches of pools that are gone (their destructor deleted them).
  std::uint32_t kept = 0;
  for (std::uint32_t i = 0; i < t_slow.num_entries; ++i) {
    if (registry().live.count(t_slow.entries[i].pool_id) != 0) {
      t_slow.entries[kept++] = t_slow.entries[i];
    }
  }
  t_slow.num_entries = kept;
  if (kept == kMaxPoolsPerThread) return nullptr;  // this thread uses too many pools: uncached
  auto* tc = new (std::nothrow) ThreadCache();
  if (tc == nullptr) return nullptr;
  try {
    caches_.push_back(tc);
    arm_thread_exit_hook();
  } catch (...) {
    if (!caches_.empty() && caches_.back() == tc) caches_.pop_back();
    delete tc;
    return nullptr;
  }
  t_slow.entries[t_slow.num_entries++] = TlsEntry{id_, tc};
  t_fast = TlsFast{id_, tc};
  return tc;
}

void PagePool::flush_cache(ThreadCache& tc) noexcept {
  for (std::size_t c = 0; c < kNumSizeClasses; ++c) {
    Magazine& m = tc.mags[c];
    std::uint32_t n = m.count.load(kRelaxed);
    const std::uint32_t piece = cache_batch_[c];  // keeps chains <= batch blocks
    while (n > 0) {
      const std::uint32_t k = std::min(n, piece);
      push_slots(c, &m.slots[n - k], k);
      n -= k;
    }
    m.count.store(0, kRelaxed);
  }
}

void PagePool::flush_thread_cache() noexcept {
  if (t_fast.pool_id == id_) {
    flush_cache(*t_fast.cache);
    return;
  }
  for (std::uint32_t i = 0; i < t_slow.num_entries; ++i) {
    if (t_slow.entries[i].pool_id == id_) flush_cache(*t_slow.entries[i].cache);
  }
}

void PagePool::retire_cache_locked(ThreadCache* tc) noexcept {
  flush_cache(*tc);
  for (std::size_t c = 0; c < kNumSizeClasses; ++c) {
    lists_[c].allocs_outside_caches.fetch_add(tc->mags[c].allocs.load(kRelaxed), kRelaxed);
    lists_[c].frees_outside_caches.fetch_add(tc->mags[c].frees.load(kRelaxed), kRelaxed);
  }
  caches_.erase(std::remove(caches_.begin(), caches_.end(), tc), caches_.end());
  delete tc;
}

// ---- shared lists (Treiber stacks of chains) ----
//
// head = (tag << 32) | (first slot + 1); 0 in the low half = empty. The tag
// grows on every successful push and pop, so a head value is never seen twice
// within 2^32 operations (ABA). Links are written before the release CAS that
// publishes them and read after the acquire load that found the head.

void PagePool::push_linked_chain(std::size_t size_class, std::uint32_t head_slot) noexcept {
  auto& head = lists_[size_class].head;
  std::uint64_t old = head.load(kRelaxed);
  for (;;) {
    next_chain_[head_slot].store(static_cast<std::uint32_t>(old), kRelaxed);
    const std::uint64_t next = (((old >> 32) + 1) << 32) | (std::uint64_t{head_slot} + 1);
    // Release pairs with the acquire load/CAS in pop_chain: the links above
    // (and the chain's next_in_chain_ links) are visible to the popper.
    if (head.compare_exchange_weak(old, next, std::memory_order_release, kRelaxed)) return;
  }
}

void PagePool::push_slots(std::size_t size_class, const std::uint32_t* slots,
                          std::size_t count) noexcept {
  for (std::size_t i = 0; i + 1 < count; ++i) {
    next_in_chain_[slots[i]].store(slots[i + 1] + 1, kRelaxed);
  }
  next_in_chain_[slots[count - 1]].store(0, kRelaxed);
  push_linked_chain(size_class, slots[0]);
}

std::uint32_t PagePool::pop_chain(std::size_t size_class) noexcept {
  auto& head = lists_[size_class].head;
  // Acquire pairs with the release CAS in push_linked_chain.
  std::uint64_t old = head.load(std::memory_order_acquire);
  for (;;) {
    const auto first_plus1 = static_cast<std::uint32_t>(old);
    if (first_plus1 == 0) return 0;
    // May read a link that a concurrent pop/push is changing; the CAS then
    // fails because the tag moved, and the value is discarded.
    const std::uint32_t rest = next_chain_[first_plus1 - 1].load(kRelaxed);
    const std::uint64_t next = (((old >> 32) + 1) << 32) | rest;
    if (head.compare_exchange_weak(old, next, std::memory_order_acquire,
                                   std::memory_order_acquire)) {
      return first_plus1;
    }
  }
}

PagePool::Carved PagePool::carve(std::size_t size_class, std::size_t max_blocks) noexcept {
  const std::uint64_t block_bytes = size_class_bytes(size_class);
  std::uint64_t cur = carved_bytes_.load(kRelaxed);
  std::uint64_t count = 0;
  do {
    count = std::min<std::uint64_t>(max_blocks, (length_bytes_ - cur) / block_bytes);
    if (count == 0) return {};
    // Relaxed: the bump only hands out address ranges; the slot_class_ marks
    // below are published by whatever hands the block to another thread.
  } while (!carved_bytes_.compare_exchange_weak(cur, cur + count * block_bytes, kRelaxed));
  const auto first = static_cast<std::uint32_t>(cur >> kMinBlockShift);
  const auto step = static_cast<std::uint32_t>(block_bytes >> kMinBlockShift);
  for (std::uint32_t i = 0; i < count; ++i) {
    slot_class_[first + i * step].store(static_cast<std::uint8_t>(size_class + 1), kRelaxed);
  }
  lists_[size_class].carved_blocks.fetch_add(count, kRelaxed);
  return Carved{first, static_cast<std::uint32_t>(count)};
}

std::uint32_t PagePool::refill(std::size_t size_class, std::uint32_t* out,
                               std::uint32_t max_blocks) noexcept {
  if (const std::uint32_t head_plus1 = pop_chain(size_class); head_plus1 != 0) {
    std::uint32_t n = 0;
    std::uint32_t cur = head_plus1;
    while (cur != 0 && n < max_blocks) {
      out[n++] = cur - 1;
      cur = next_in_chain_[cur - 1].load(kRelaxed);
    }
    if (cur != 0) push_linked_chain(size_class, cur - 1);  // the part that did not fit
    return n;
  }
  const Carved carved = carve(size_class, max_blocks);
  const auto step = static_cast<std::uint32_t>(size_class_bytes(size_class) >> kMinBlockShift);
  // Highest slot first, so the magazine (a stack) hands out ascending addresses.
  for (std::uint32_t i = 0; i < carved.count; ++i) {
    out[i] = carved.first + (carved.count - 1 - i) * step;
  }
  return carved.count;
}

// ---- allocate / free ----

namespace {
[[gnu::cold, gnu::noinline]] tl::unexpected<Error> too_large_error(std::size_t bytes) {
  return make_error(ErrorCode::kTooLarge,
                    "page pool: a {}-byte block was requested, more than the largest size class "
                    "({}, class {}); send it in pieces of at most {}",
                    bytes, format_bytes(kMaxBlockBytes), kNumSizeClasses - 1,
                    format_bytes(kMaxBlockBytes));
}
}  // namespace

Result<Block> PagePool::allocate(std::size_t bytes) {
  const std::size_t c = size_class_for(bytes);
  if (c >= kNumSizeClasses) [[unlikely]] return too_large_error(bytes);
  ThreadCache* tc = local_cache();
  if (tc != nullptr) [[likely]] {
    Magazine& m = tc->mags[c];
    const std::uint32_t n = m.count.load(kRelaxed);
    if (n != 0) [[likely]] {
      const std::uint32_t slot = m.slots[n - 1];
      m.count.store(n - 1, kRelaxed);
      bump(m.allocs);
      mark_allocated(slot);
      return make_block(slot, c, bytes);
    }
  }
  return allocate_slow(c, bytes, tc);
}

Result<Block> PagePool::allocate_slow(std::size_t size_class, std::size_t bytes, ThreadCache* tc) {
  std::uint32_t slot = 0;
  if (tc != nullptr && cache_capacity_[size_class] != 0) {
    Magazine& m = tc->mags[size_class];  // empty: the fast path found nothing
    const std::uint32_t n = refill(size_class, m.slots, cache_batch_[size_class]);
    if (n == 0) return exhausted_error(size_class, bytes);
    slot = m.slots[n - 1];
    m.count.store(n - 1, kRelaxed);
    bump(m.allocs);
  } else {
    if (refill(size_class, &slot, 1) == 0) return exhausted_error(size_class, bytes);
    if (tc != nullptr) {
      bump(tc->mags[size_class].allocs);
    } else {
      lists_[size_class].allocs_outside_caches.fetch_add(1, kRelaxed);
    }
  }
  mark_allocated(slot);
  return make_block(slot, size_class, bytes);
}

void PagePool::free(Block block) noexcept {
  if (block.data_ == nullptr) return;
  const std::uint64_t offset = block.offset_bytes_;
  EMBER_CHECK_MSG(offset < length_bytes_ && block.data_ == base_ + offset &&
                      (offset & (kBlockAlignBytes - 1)) == 0,
                  "page pool '{}': free of a block that is not from this pool (data {}, offset "
                  "{}, pool base {}, length {})",
                  name_, static_cast<void*>(block.data_), offset, static_cast<void*>(base_),
                  length_bytes_);
  const auto slot = static_cast<std::uint32_t>(offset >> kMinBlockShift);
  const std::size_t c = block.size_class_;
  EMBER_DCHECK_MSG(slot_class_[slot].load(kRelaxed) == c + 1,
                   "page pool '{}': block at offset {} freed as class {} but carved as class {}",
                   name_, offset, c, int{slot_class_[slot].load(kRelaxed)} - 1);
  mark_freed(slot);
  ThreadCache* tc = local_cache();
  if (tc != nullptr) [[likely]] {
    Magazine& m = tc->mags[c];
    const std::uint32_t n = m.count.load(kRelaxed);
    if (n < cache_capacity_[c]) [[likely]] {
      m.slots[n] = slot;
      m.count.store(n + 1, kRelaxed);
      bump(m.frees);
      return;
    }
  }
  free_slow(slot, c, tc);
}

void PagePool::free_slow(std::uint32_t slot, std::size_t size_class, ThreadCache* tc) noexcept {
  if (tc != nullptr && cache_capacity_[size_class] != 0) {
    // Magazine full: hand the top `batch` blocks to the shared list as one chain.
    Magazine& m = tc->mags[size_class];
    std::uint32_t n = m.count.load(kRelaxed);
    const std::uint32_t batch = cache_batch_[size_class];
    push_slots(size_class, &m.slots[n - batch], batch);
    n -= batch;
    m.slots[n] = slot;
    m.count.store(n + 1, kRelaxed);
    bump(m.frees);
    return;
  }
  push_slots(size_class, &slot, 1);
  if (tc != nullptr) {
    bump(tc->mags[size_class].frees);
  } else {
    lists_[size_class].frees_outside_caches.fetch_add(1, kRelaxed);
  }
}

Result<Block> PagePool::block_at(std::uint64_t offset_bytes, std::size_t size_bytes) const {
  if (offset_bytes >= length_bytes_) {
    return make_error(ErrorCode::kInvalidArgument,
                      "page pool '{}': offset {} is outside the region of {} bytes", name_,
                      offset_bytes, length_bytes_);
  }
  if ((offset_bytes & (kBlockAlignBytes - 1)) != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "page pool '{}': offset {} is not 4 KiB-aligned, so it cannot start a block",
                      name_, offset_bytes);
  }
  const auto slot = static_cast<std::uint32_t>(offset_bytes >> kMinBlockShift);
  const std::uint8_t class_plus1 = slot_class_[slot].load(kRelaxed);
  if (class_plus1 == 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "page pool '{}': offset {} is not the start of a block", name_,
                      offset_bytes);
  }
  const std::size_t c = class_plus1 - 1u;
  if (size_bytes > size_class_bytes(c)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "page pool '{}': {} bytes at offset {} exceed the block's capacity {}",
                      name_, size_bytes, offset_bytes, size_class_bytes(c));
  }
  return make_block(slot, c, size_bytes);
}

// ---- stats and errors (cold) ----

PoolStats PagePool::stats() const {
  std::lock_guard<std::mutex> lock(registry().mu);
  return stats_locked();
}

PoolStats PagePool::stats_locked() const {
  PoolStats s;
  s.backing = backing_;
  s.total_pages = length_bytes_ / kPoolPageBytes;
  s.region_bytes = length_bytes_;
  s.carved_bytes = carved_bytes_.load(kRelaxed);
  s.pages_carved = (s.carved_bytes + kPoolPageBytes - 1) / kPoolPageBytes;
  s.huge_mapped_bytes = huge_mapped_bytes_;
  s.exhausted_count = exhausted_count_.load(kRelaxed);
  for (std::size_t c = 0; c < kNumSizeClasses; ++c) {
    std::uint64_t allocs = lists_[c].allocs_outside_caches.load(kRelaxed);
    std::uint64_t frees = lists_[c].frees_outside_caches.load(kRelaxed);
    std::uint64_t cached = 0;
    for (const ThreadCache* tc : caches_) {
      allocs += tc->mags[c].allocs.load(kRelaxed);
      frees += tc->mags[c].frees.load(kRelaxed);
      cached += tc->mags[c].count.load(kRelaxed);
    }
    auto& out = s.classes[c];
    out.block_bytes = size_class_bytes(c);
    out.blocks_carved = lists_[c].carved_blocks.load(kRelaxed);
    out.blocks_in_use = allocs > frees ? allocs - frees : 0;
    out.blocks_cached = cached;
    const std::uint64_t accounted = out.blocks_in_use + cached;
    out.blocks_free = out.blocks_carved > accounted ? out.blocks_carved - accounted : 0;
    s.bytes_in_use += out.blocks_in_use * out.block_bytes;
  }
  return s;
}

tl::unexpected<Error> PagePool::exhausted_error(std::size_t size_class, std::size_t bytes) {
  exhausted_count_.fetch_add(1, kRelaxed);
  const std::size_t block_bytes = size_class_bytes(size_class);
  const std::size_t total_pages = length_bytes_ / kPoolPageBytes;
  if (block_bytes > length_bytes_) {
    return make_error(ErrorCode::kPoolExhausted,
                      "page pool '{}': a {}-byte request needs a {} block (size class {} of {}), "
                      "larger than the whole region ({} pages of 2 MiB); raise prealloc_pages "
                      "(now {}) to at least {}; see docs/troubleshooting.md#pool-exhaustion",
                      name_, bytes, format_bytes(block_bytes), size_class, kNumSizeClasses,
                      total_pages, total_pages, block_bytes / kPoolPageBytes);
  }
  const PoolStats s = stats();
  const auto& cls = s.classes[size_class];
  std::uint64_t free_elsewhere = 0;
  for (std::size_t c = 0; c < kNumSizeClasses; ++c) {
    if (c != size_class) {
      free_elsewhere += (s.classes[c].blocks_free + s.classes[c].blocks_cached) *
                        s.classes[c].block_bytes;
    }
  }
  return make_error(
      ErrorCode::kPoolExhausted,
      "page pool '{}' exhausted: no free {} block (size class {} of {}) for a {}-byte request; "
      "{} of {} pages (2 MiB) are carved into blocks, {} of them in blocks in use; this class "
      "has {} blocks in use and {} parked in other threads' caches; {} lie free in other "
      "classes (blocks never change class). Raise prealloc_pages (now {}) in [communication], "
      "or lower batch_threshold so that fewer bytes wait in batches; see "
      "docs/troubleshooting.md#pool-exhaustion",
      name_, format_bytes(block_bytes), size_class, kNumSizeClasses, bytes, s.pages_carved,
      total_pages, format_bytes(s.bytes_in_use), cls.blocks_in_use, cls.blocks_cached,
      format_bytes(free_elsewhere), total_pages);
}

}  // namespace ember::memory
