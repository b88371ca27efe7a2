// ember-bench-pool: Ember's page pool against glibc malloc and mimalloc.
//
// What runs: two persistent worker threads (so thread caches, mimalloc heaps
// and glibc arenas are warm: steady state), block sizes log-uniform in
// [4 KiB, 4 MiB] from a fixed seed (the same sequence for every allocator),
// through
//   ember     PagePool::allocate / PagePool::free (a pre-faulted pool of
//             --pages 2 MiB pages, backing 'auto')
//   mimalloc  mi_malloc / mi_free (libmimalloc 2.0, linked directly)
//   glibc     __libc_malloc / __libc_free: glibc's allocator called by its
//             own entry points, because linking libmimalloc.so interposes
//             the plain malloc/free symbols process-wide
// in two workloads:
//   local     each thread keeps a window of 8 live blocks: free the oldest,
//             allocate the next (alloc and free on the same thread)
//   cross     each thread allocates, writes the block and passes it to the
//             other thread through a 64-slot SPSC ring; the receiver reads
//             it and frees it (every free on the thread that did not
//             allocate, as a server does with a worker's message)
// and two ways of using the block:
//   header    write the first 64 bytes (a message header): allocator cost
//   pages     write one byte in every 4 KiB page of the requested size
//             (a message body): shows page faults of memory the allocator
//             returned to the OS and takes back
// One op = one allocation and its free. ns/op = wall time of the run / ops
// per thread (two threads on two cores). Minor page faults per op come from
// getrusage(RUSAGE_SELF) around the run. Each measured number is the median
// of --reps repetitions, interleaved (rep 1 of every allocator and workload,
// then rep 2, ...) after one untimed warm-up round, so drift in the load of
// this shared machine hits every allocator alike.
//
// Never fails on timing; prints a table and ends with one line
// `SUMMARY key=value ...` (ratios ember/peer; ember's faults per op).
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <mimalloc.h>

#include "common/base/constants.h"
#include "common/base/logging.h"
#include "common/base/units.h"
#include "common/memory/page_pool.h"

extern "C" {
// glibc's own malloc entry points (exported by libc.so.6, GLIBC_2.2.5).
void* __libc_malloc(std::size_t size);
void __libc_free(void* p);
}

namespace {

using Clock = std::chrono::steady_clock;
using ember::memory::Block;
using ember::memory::PagePool;

constexpr int kThreads = 2;
constexpr std::size_t kWindow = 8;       // live blocks per thread, local workload
constexpr std::size_t kRingSlots = 64;   // cross workload ring, per direction
constexpr std::size_t kNumSizes = 4096;  // size sequence length per thread
constexpr std::size_t kHeaderBytes = 64;

// ---- allocators: same shape, called directly (templates, no virtual calls)

struct EmberAlloc {
  static constexpr const char* kName = "ember";
  PagePool* pool;
  using Handle = Block;
  Handle alloc(std::size_t n) {
    auto b = pool->allocate(n);
    if (!b) {
      std::fprintf(stderr, "ember-bench-pool: %s\n", b.error().to_string().c_str());
      std::abort();
    }
    return *b;
  }
  void free(Handle h) { pool->free(h); }
  static std::byte* data(const Handle& h) { return h.data(); }
};

struct MiAlloc {
  static constexpr const char* kName = "mimalloc";
  using Handle = void*;
  Handle alloc(std::size_t n) { return mi_malloc(n); }
  void free(Handle h) { mi_free(h); }
  static std::byte* data(Handle h) { return static_cast<std::byte*>(h); }
};

struct GlibcAlloc {
  static constexpr const char* kName = "glibc";
  using Handle = void*;
  Handle alloc(std::size_t n) { return __libc_malloc(n); }
  void free(Handle h) { __libc_free(h); }
  static std::byte* data(Handle h) { return static_cast<std::byte*>(h); }
};

enum class Touch { kHeader, kPages };

inline void write_block(std::byte* p, std::size_t n, Touch touch, std::uint8_t v) {
  if (touch == Touch::kHeader) {
    std::memset(p, v, std::min(n, kHeaderBytes));
  } else {
    for (std::size_t off = 0; off < n; off += ember::kSmallPageBytes) p[off] = std::byte{v};
  }
}

// ---- a minimal SPSC ring for the cross workload (same for every allocator)

template <typename T>
class HandoffRing {
 public:
  bool try_push(const T& v) {
    const auto t = tail_.load(std::memory_order_relaxed);
    if (t - head_cache_ == kRingSlots) {
      head_cache_ = head_.load(std::memory_order_acquire);  // pairs with pop's release
      if (t - head_cache_ == kRingSlots) return false;
    }
    slots_[t % kRingSlots] = v;
    tail_.store(t + 1, std::memory_order_release);  // pairs with pop's acquire
    return true;
  }
  bool try_pop(T& out) {
    const auto h = head_.load(std::memory_order_relaxed);
    if (h == tail_cache_) {
      tail_cache_ = tail_.load(std::memory_order_acquire);
      if (h == tail_cache_) return false;
    }
    out = slots_[h % kRingSlots];
    head_.store(h + 1, std::memory_order_release);
    return true;
  }

 private:
  alignas(ember::kFalseSharingBytes) std::atomic<std::uint64_t> head_{0};
  std::uint64_t tail_cache_ = 0;
  alignas(ember::kFalseSharingBytes) std::atomic<std::uint64_t> tail_{0};
  std::uint64_t head_cache_ = 0;
  alignas(ember::kFalseSharingBytes) T slots_[kRingSlots];
};

// ---- workloads; each returns when this thread is done

template <typename A>
void run_local(A& a, const std::vector<std::size_t>& sizes, std::size_t ops, Touch touch) {
  typename A::Handle live[kWindow] = {};
  std::size_t live_size[kWindow] = {};
  for (std::size_t i = 0; i < kWindow; ++i) {
    live_size[i] = sizes[i % kNumSizes];
    live[i] = a.alloc(live_size[i]);
    write_block(A::data(live[i]), live_size[i], touch, 1);
  }
  for (std::size_t i = 0; i < ops; ++i) {
    const std::size_t w = i % kWindow;
    a.free(live[w]);
    live_size[w] = sizes[(i + kWindow) % kNumSizes];
    live[w] = a.alloc(live_size[w]);
    write_block(A::data(live[w]), live_size[w], touch, static_cast<std::uint8_t>(i));
  }
  for (std::size_t i = 0; i < kWindow; ++i) a.free(live[i]);
}

std::atomic<std::uint64_t> g_sink{0};

template <typename A>
void run_cross(A& a, const std::vector<std::size_t>& sizes, std::size_t ops, Touch touch,
               HandoffRing<typename A::Handle>& out, HandoffRing<typename A::Handle>& in) {
  std::size_t received = 0;
  std::uint64_t sink = 0;
  auto drain = [&] {
    const std::size_t before = received;
    typename A::Handle h;
    while (in.try_pop(h)) {
      sink += static_cast<std::uint64_t>(A::data(h)[0]);  // the receiver reads the message
      a.free(h);
      ++received;
    }
    return received != before;
  };
  // With no progress, yield: on a busy 2-core machine the peer may be
  // descheduled, and spinning would only keep it off the core longer.
  for (std::size_t i = 0; i < ops; ++i) {
    const std::size_t n = sizes[i % kNumSizes];
    auto h = a.alloc(n);
    write_block(A::data(h), n, touch, static_cast<std::uint8_t>(i));
    while (!out.try_push(h)) {
      if (!drain()) std::this_thread::yield();
    }
    drain();
  }
  while (received < ops) {  // the peer sends as many as we do
    if (!drain()) std::this_thread::yield();
  }
  g_sink.fetch_add(sink, std::memory_order_relaxed);
}

// ---- two persistent threads driven by barriers

class Team {
 public:
  Team() : start_(kThreads + 1), done_(kThreads + 1) {
    for (int t = 0; t < kThreads; ++t) threads_.emplace_back([this, t] { loop(t); });
  }
  ~Team() {
    job_ = nullptr;
    start_.arrive_and_wait();
    for (auto& t : threads_) t.join();
  }
  // Runs job(thread index) on both threads; returns wall ns from the first
  // start to the last finish and the minor faults of the process meanwhile.
  struct Timing {
    double wall_ns;       // first start to last finish
    double cpu_ns;        // CPU time of both threads together
    double minor_faults;  // whole process
  };
  Timing run(std::function<void(int)> job) {
    job_ = std::move(job);
    rusage before{};
    getrusage(RUSAGE_SELF, &before);
    start_.arrive_and_wait();
    done_.arrive_and_wait();
    rusage after{};
    getrusage(RUSAGE_SELF, &after);
    const auto first = *std::min_element(begin_ns_, begin_ns_ + kThreads);
    const auto last = *std::max_element(end_ns_, end_ns_ + kThreads);
    std::int64_t cpu = 0;
    for (int t = 0; t < kThreads; ++t) cpu += cpu_end_ns_[t] - cpu_begin_ns_[t];
    return {static_cast<double>(last - first), static_cast<double>(cpu),
            static_cast<double>(after.ru_minflt - before.ru_minflt)};
  }

 private:
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
        .count();
  }
  static std::int64_t thread_cpu_ns() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
  }
  void loop(int t) {
    for (;;) {
      start_.arrive_and_wait();
      if (!job_) return;
      begin_ns_[t] = now_ns();
      cpu_begin_ns_[t] = thread_cpu_ns();
      job_(t);
      cpu_end_ns_[t] = thread_cpu_ns();
      end_ns_[t] = now_ns();
      done_.arrive_and_wait();
    }
  }
  std::barrier<> start_;
  std::barrier<> done_;
  std::function<void(int)> job_;
  std::int64_t begin_ns_[kThreads] = {};
  std::int64_t end_ns_[kThreads] = {};
  std::int64_t cpu_begin_ns_[kThreads] = {};
  std::int64_t cpu_end_ns_[kThreads] = {};
  std::vector<std::thread> threads_;
};

struct Sample {
  double cpu_ns_per_op;
  double wall_ns_per_op;
  double faults_per_op;
};

template <typename A>
Sample measure(Team& team, A& a, const std::string& workload, Touch touch,
               const std::vector<std::vector<std::size_t>>& sizes, std::size_t ops) {
  Team::Timing t{};
  if (workload == "local") {
    t = team.run([&](int me) { run_local(a, sizes[me], ops, touch); });
  } else {
    HandoffRing<typename A::Handle> rings[2];
    t = team.run([&](int me) { run_cross(a, sizes[me], ops, touch, rings[me], rings[1 - me]); });
  }
  const auto total_ops = static_cast<double>(ops * kThreads);
  return {t.cpu_ns / total_ops, t.wall_ns / static_cast<double>(ops),
          t.minor_faults / total_ops};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 7;
  std::size_t header_ops = 200000;
  std::size_t page_ops = 4000;
  std::size_t pages = 512;
  std::string only;  // run a single allocator (profiling); the SUMMARY then lacks ratios
  // --name=value options; CLI11 is avoided here because its inlined string
  // code trips g++ 12's -Wnull-dereference at -O2 (a false positive).
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : arg.substr(eq + 1);
    char* end = nullptr;
    const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
    const bool number = !value.empty() && end != nullptr && *end == '\0';
    if (name == "--help" || name == "-h") {
      std::printf("usage: ember-bench-pool [--reps=N (7)] [--header-ops=N (200000)] "
                  "[--page-ops=N (4000)] [--pages=N (512, 2 MiB each)] "
                  "[--only=ember|mimalloc|glibc (profiling; no SUMMARY)]\n");
      return 0;
    } else if (name == "--only" && (value == "ember" || value == "mimalloc" || value == "glibc")) {
      only = value;
    } else if (name == "--reps" && number && v >= 1 && v <= 101) {
      reps = static_cast<int>(v);
    } else if (name == "--header-ops" && number && v >= 100) {
      header_ops = v;
    } else if (name == "--page-ops" && number && v >= 100) {
      page_ops = v;
    } else if (name == "--pages" && number && v >= 64 && v <= ember::memory::kMaxPreallocPages) {
      pages = v;
    } else {
      std::fprintf(stderr,
                   "ember-bench-pool: bad argument '%s' (want --reps=1..101, --header-ops>=100, "
                   "--page-ops>=100, --pages=64..%zu; see --help)\n",
                   arg.c_str(), ember::memory::kMaxPreallocPages);
      return 2;
    }
  }
  ember::log::init_program_logging("info");

  ember::memory::PoolOptions options;
  options.prealloc_pages = pages;
  options.name = "bench";
  auto created = PagePool::create(options);
  if (!created) {
    std::fprintf(stderr, "ember-bench-pool: %s\n", created.error().to_string().c_str());
    return 1;
  }
  PagePool& pool = **created;

  // Log-uniform sizes in [4 KiB, 4 MiB], one sequence per thread.
  std::vector<std::vector<std::size_t>> sizes(kThreads);
  std::mt19937_64 rng(20240601);
  std::uniform_real_distribution<double> exponent(12.0, 22.0);
  for (auto& seq : sizes) {
    for (std::size_t i = 0; i < kNumSizes; ++i) {
      seq.push_back(static_cast<std::size_t>(std::exp2(exponent(rng))));
    }
  }

  EmberAlloc ember_alloc{&pool};
  MiAlloc mi_alloc;
  GlibcAlloc glibc_alloc;
  Team team;

  const std::vector<std::string> workloads = {"local", "cross"};
  const std::vector<Touch> touches = {Touch::kHeader, Touch::kPages};
  const std::vector<std::string> allocators =
      only.empty() ? std::vector<std::string>{"ember", "mimalloc", "glibc"}
                   : std::vector<std::string>{only};
  // key: workload/touch/allocator -> samples
  std::map<std::string, std::vector<Sample>> samples;
  auto key = [](const std::string& w, Touch t, const std::string& a) {
    return w + "/" + (t == Touch::kHeader ? "header" : "pages") + "/" + a;
  };
  auto one = [&](const std::string& w, Touch t, const std::string& a, bool record) {
    const std::size_t ops = t == Touch::kHeader ? header_ops : page_ops;
    Sample s{};
    if (a == "ember") s = measure(team, ember_alloc, w, t, sizes, ops);
    if (a == "mimalloc") s = measure(team, mi_alloc, w, t, sizes, ops);
    if (a == "glibc") s = measure(team, glibc_alloc, w, t, sizes, ops);
    if (record) samples[key(w, t, a)].push_back(s);
  };

  std::printf("ember-bench-pool: %d threads, sizes log-uniform 4 KiB..4 MiB, pool %zu pages "
              "(%s backing), %d reps (median), ops/thread/run: header %zu, pages %zu\n",
              kThreads, pages, std::string(ember::memory::backing_name(pool.backing())).c_str(),
              reps, header_ops, page_ops);
  for (int rep = -1; rep < reps; ++rep) {  // rep -1: untimed warm-up
    for (const auto& w : workloads) {
      for (Touch t : touches) {
        // Rotate the order so no allocator always runs first.
        for (std::size_t i = 0; i < allocators.size(); ++i) {
          const auto& a = allocators[(i + static_cast<std::size_t>(rep + 1)) % allocators.size()];
          one(w, t, a, rep >= 0);
        }
      }
    }
    std::fflush(stdout);
  }

  std::printf("\n%-7s %-7s %-9s %12s %12s %11s %11s\n", "work", "touch", "allocator",
              "cpu ns/op", "wall ns/op", "faults/op", "ember/peer");
  std::map<std::string, double> cpu, wall, faults;
  for (const auto& w : workloads) {
    for (Touch t : touches) {
      for (const auto& a : allocators) {
        std::vector<double> c, n, f;
        for (const auto& s : samples[key(w, t, a)]) {
          c.push_back(s.cpu_ns_per_op);
          n.push_back(s.wall_ns_per_op);
          f.push_back(s.faults_per_op);
        }
        cpu[key(w, t, a)] = median(c);
        wall[key(w, t, a)] = median(n);
        faults[key(w, t, a)] = median(f);
      }
      for (const auto& a : allocators) {
        const std::string ratio =
            (a == "ember" || !only.empty())
                ? std::string()
                : fmt::format("{:.3f}", cpu[key(w, t, "ember")] / cpu[key(w, t, a)]);
        std::printf("%-7s %-7s %-9s %12.1f %12.1f %11.3f %11s\n", w.c_str(),
                    t == Touch::kHeader ? "header" : "pages", a.c_str(), cpu[key(w, t, a)],
                    wall[key(w, t, a)], faults[key(w, t, a)], ratio.c_str());
      }
    }
  }
  std::printf("(cpu ns/op: both threads' CPU time / ops, robust to other load on the machine; "
              "wall ns/op: run time / ops per thread; ember/peer: cpu ns ratio)\n");

  auto geomean_ratio = [&](std::map<std::string, double>& m, Touch t, const std::string& peer) {
    double log_sum = 0;
    for (const auto& w : workloads) {
      log_sum += std::log(m[key(w, t, "ember")] / m[key(w, t, peer)]);
    }
    return std::exp(log_sum / static_cast<double>(workloads.size()));
  };
  auto max_faults = [&](const std::string& a) {
    double m = 0;
    for (const auto& w : workloads) {
      for (Touch t : touches) m = std::max(m, faults[key(w, t, a)]);
    }
    return m;
  };
  const auto stats = pool.stats();
  std::printf("\nember pool after the run: %s carved of %s, %s mapped with 2 MiB pages\n",
              ember::format_bytes(stats.carved_bytes).c_str(),
              ember::format_bytes(stats.region_bytes).c_str(),
              ember::format_bytes(stats.huge_mapped_bytes).c_str());
  if (!only.empty()) return 0;  // no peers, no ratios
  std::printf(
      "SUMMARY ns_ratio_vs_mimalloc=%.3f ns_ratio_vs_glibc=%.3f "
      "ns_ratio_vs_mimalloc_local=%.3f ns_ratio_vs_mimalloc_cross=%.3f "
      "wall_ns_ratio_vs_mimalloc=%.3f pages_ns_ratio_vs_mimalloc=%.3f "
      "pages_ns_ratio_vs_glibc=%.3f faults_per_op=%.4f mimalloc_faults_per_op=%.4f "
      "glibc_faults_per_op=%.4f\n",
      geomean_ratio(cpu, Touch::kHeader, "mimalloc"), geomean_ratio(cpu, Touch::kHeader, "glibc"),
      cpu[key("local", Touch::kHeader, "ember")] / cpu[key("local", Touch::kHeader, "mimalloc")],
      cpu[key("cross", Touch::kHeader, "ember")] / cpu[key("cross", Touch::kHeader, "mimalloc")],
      geomean_ratio(wall, Touch::kHeader, "mimalloc"),
      geomean_ratio(cpu, Touch::kPages, "mimalloc"), geomean_ratio(cpu, Touch::kPages, "glibc"),
      max_faults("ember"), max_faults("mimalloc"), max_faults("glibc"));
  return 0;
}
