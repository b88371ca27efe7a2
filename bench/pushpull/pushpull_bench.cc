// ember-bench-pushpull: Ember's push/pull path end to end, beside its peers,
// in one process (scripts/bench.sh pushpull).
//
// Sections, each with tcp and shm:
//  1. ResNet-50 step: the 161 gradient tensors of ResNet-50 (torchvision's
//     layout: 53 convolutions, 53 batch norms with weight and bias, the fully
//     connected layer; 25,557,032 float32) pushed and pulled every step
//     (push_pull, all in flight) by 2 workers through 1 server under BSP.
//     Step time and goodput (gradient bytes per worker per second), against
//     Gloo's ring all-reduce over TCP of the same tensors (2 ranks, libgloo-dev)
//     and the memcpy ceiling of the same bytes (one thread copying the
//     gradients out and the parameters back: 2 x 102 MB). Beside the default
//     tcp row, "ember-tcp+crc" runs tcp with payload_checksum = true (every
//     payload byte in the frame CRC32C, one more pass over it on each end).
//  2. 10,000 keys of 64 bytes, pushed and pulled each step by the 2 workers:
//     through a pipeline (the framer packs them into batches) against the
//     same requests each flushed on its own (one frame per message).
//  3. One key, push then pull, 4 KiB .. 256 MiB, 1 worker: serial (p50/p99
//     per operation, goodput) and with 8 requests in flight (goodput); the
//     process's minor page faults per operation in steady state; and
//     pipelined 4 KiB operations per second. Beside them, the memory
//     reference of each size (memory_reference): where its goodput falls, the
//     machine's caches, not Ember, set the fall.
//
// The server runs one shard thread per CPU, each pinned to its CPU
// (default_shards), unless --set server.shards / server.shard_cpu_affinity
// say otherwise.
//
// Everything runs in this process: the server (ember::server::Server), the
// workers (ember::Worker, one thread each) and Gloo's ranks (threads). Each
// figure is the median over --reps repetitions, the systems interleaved
// within a repetition. Absolute times mean little on a small shared machine;
// the ratios are the point. The benchmark never fails on a timing. The last
// line is `SUMMARY key=value ...`.
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#ifdef EMBER_HAVE_GLOO
#include <gloo/allreduce_ring.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>
#endif

#include "common/base/logging.h"
#include "common/config/config.h"
#include "common/memory/size_class.h"
#include "common/memory/stream_copy.h"
#include "server/server.h"
#include "worker/worker.h"

namespace {

using Clock = std::chrono::steady_clock;
using ember::Handle;
using ember::Key;
using ember::TensorBuffer;
using ember::Worker;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t i = std::min(v.size() - 1, static_cast<std::size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

long minor_faults() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

std::string size_name(std::size_t bytes) {
  if (bytes >= (1u << 20)) return fmt::format("{} MiB", bytes >> 20);
  return fmt::format("{} KiB", bytes >> 10);
}

// torchvision's ResNet-50 parameter shapes, in registration order.
std::vector<std::vector<std::uint64_t>> resnet50_shapes() {
  std::vector<std::vector<std::uint64_t>> s;
  auto conv = [&](std::uint64_t out, std::uint64_t in, std::uint64_t k) { s.push_back({out, in, k, k}); };
  auto bn = [&](std::uint64_t c) {
    s.push_back({c});
    s.push_back({c});
  };
  conv(64, 3, 7);
  bn(64);
  std::uint64_t in = 64;
  const std::uint64_t planes[] = {64, 128, 256, 512};
  const int blocks[] = {3, 4, 6, 3};
  for (int layer = 0; layer < 4; ++layer) {
    for (int b = 0; b < blocks[layer]; ++b) {
      const std::uint64_t p = planes[layer];
      conv(p, in, 1);
      bn(p);
      conv(p, p, 3);
      bn(p);
      conv(p * 4, p, 1);
      bn(p * 4);
      if (b == 0) {
        conv(p * 4, in, 1);  // downsample
        bn(p * 4);
      }
      in = p * 4;
    }
  }
  s.push_back({1000, 2048});
  s.push_back({1000});
  return s;
}

std::uint64_t elements(const std::vector<std::uint64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::uint64_t{1}, std::multiplies<>());
}

// Float spans carved from 64 MiB pool buffers (so tensors stay in pool memory).
class Arena {
 public:
  Arena(Worker& w, std::size_t total_floats) {
    const std::size_t chunk = ember::memory::kMaxBlockBytes / sizeof(float);
    for (std::size_t done = 0; done < total_floats + 2 * chunk / 64; done += chunk) {
      buffers_.push_back(w.allocate(ember::memory::kMaxBlockBytes));
    }
  }
  std::span<float> take(std::size_t n) {
    const std::size_t aligned = (n + 1023) / 1024 * 1024;  // 4 KiB steps
    if (used_ + aligned > buffers_[current_].floats().size()) {
      ++current_;
      used_ = 0;
    }
    std::span<float> out = buffers_[current_].floats().subspan(used_, n);
    used_ += aligned;
    return out;
  }
  bool all_in_pool() const {
    return std::all_of(buffers_.begin(), buffers_.end(), [](const TensorBuffer& b) { return b.in_pool(); });
  }

 private:
  std::vector<TensorBuffer> buffers_;
  std::size_t current_ = 0;
  std::size_t used_ = 0;
};

// --set KEY=VALUE config overrides, applied to every cluster's config.
std::vector<std::pair<std::string, std::string>> g_overrides;

// The CPUs this process may run on.
std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  return cpus;
}

// The server's shard threads unless --set server.shards says otherwise: one
// per CPU this process may run on (2 on the 2-core machines this runs on), so
// the chunks of a large tensor are applied in parallel, each shard pinned to
// its own CPU (server.shard_cpu_affinity; --set server.shard_cpu_affinity=[]
// unpins). With 1 shard the shm ResNet-50 step measured 52-62 ms, with 2
// unpinned 30-50 ms (which depends on where the scheduler first put the
// shard threads, polling threads are not moved), with 2 pinned 26-30 ms; a
// 256 MiB push took 46 ms with 1 shard and 22-26 ms with 2; tcp stayed
// within noise.
unsigned default_shards() {
  return static_cast<unsigned>(std::clamp(static_cast<int>(allowed_cpus().size()), 1, 8));
}

// An in-process server and its workers.
struct Cluster {
  std::string transport;
  std::unique_ptr<ember::server::Server> server;
  std::vector<std::unique_ptr<Worker>> workers;

  // `extra`: overrides applied after --set (a variant of the default config).
  static std::unique_ptr<Cluster> make(
      const std::string& transport, std::uint32_t num_workers, std::uint32_t server_pages,
      std::uint32_t worker_pages,
      const std::vector<std::pair<std::string, std::string>>& extra = {}) {
    static std::atomic<int> counter{0};
    auto c = std::make_unique<Cluster>();
    c->transport = transport;
    const std::string listen =
        transport == "shm"
            ? fmt::format("127.0.0.1:{}", 20000 + (::getpid() * 13 + counter.fetch_add(1) * 101) % 40000)
            : "127.0.0.1:0";
    auto text = fmt::format(
        "[communication]\ntransport = \"{}\"\nprealloc_pages = {}\n"
        "[cluster]\nservers = [\"{}\"]\nnum_workers = {}\n"
        "[server]\nconsistency = \"bsp\"\nlog_level = \"warn\"\nshards = {}\nshard_cpu_affinity = [{}]\n"
        "[optimizer]\ntype = \"sgd\"\nlearning_rate = 1e-9\n"
        "[worker]\nrequest_timeout = \"300s\"\n",
        transport, server_pages, transport == "shm" ? listen : "127.0.0.1:1", num_workers,
        default_shards(), fmt::join(allowed_cpus(), ", "));
    auto cfg = ember::config::parse_config(text, "bench");
    if (!cfg) {
      std::fprintf(stderr, "bench: %s\n", cfg.error().to_string().c_str());
      return nullptr;
    }
    using Overrides = std::vector<std::pair<std::string, std::string>>;
    for (const Overrides* list : {static_cast<const Overrides*>(&g_overrides), &extra}) {
      for (const auto& [key, value] : *list) {
        if (auto s = ember::config::set_value(*cfg, key, value); !s) {
          std::fprintf(stderr, "bench: --set %s=%s: %s\n", key.c_str(), value.c_str(),
                       s.error().to_string().c_str());
          return nullptr;
        }
      }
    }
    if (auto s = ember::config::set_listen(*cfg, listen); !s) return nullptr;
    auto server = ember::server::Server::create(*cfg);
    if (!server) {
      std::fprintf(stderr, "bench: server (%s): %s\n", transport.c_str(), server.error().to_string().c_str());
      return nullptr;
    }
    c->server = std::move(*server);
    const std::string addr = transport == "shm" ? listen : c->server->address();
    const std::string servers[] = {addr};
    (void)ember::config::set_servers(*cfg, servers);
    (void)ember::config::set_value(*cfg, "communication.prealloc_pages", std::to_string(worker_pages));
    c->workers.resize(num_workers);
    std::vector<std::thread> threads;
    for (std::uint32_t r = 0; r < num_workers; ++r) {
      threads.emplace_back([&, r, wc = *cfg]() mutable {
        ember::config::set_worker_rank(wc, r);
        auto w = Worker::create(wc);
        if (w) {
          c->workers[r] = std::move(*w);
        } else {
          std::fprintf(stderr, "bench: worker %u: %s\n", r, w.error().to_string().c_str());
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& w : c->workers) {
      if (!w) return nullptr;
    }
    return c;
  }

  // Runs fn(rank) on one thread per worker; returns the wall time.
  template <typename Fn>
  double on_all(Fn fn) {
    const auto t0 = Clock::now();
    std::vector<std::thread> threads;
    for (std::uint32_t r = 0; r < workers.size(); ++r) threads.emplace_back([&, r] { fn(r); });
    for (auto& t : threads) t.join();
    return seconds_since(t0);
  }
};

template <typename R>
bool check(const R& s, const char* what) {
  if (!s) std::fprintf(stderr, "bench: %s: %s\n", what, s.error().to_string().c_str());
  return static_cast<bool>(s);
}

// ---- section 1: ResNet-50 ----

struct ResnetRun {
  std::unique_ptr<Cluster> cluster;
  std::vector<std::vector<std::uint64_t>> shapes;
  std::vector<std::unique_ptr<Arena>> arenas;  // per worker
  std::vector<std::vector<std::span<float>>> grads, outs;

  bool setup(const std::string& transport,
             const std::vector<std::pair<std::string, std::string>>& extra = {}) {
    shapes = resnet50_shapes();
    std::size_t total = 0;
    for (const auto& s : shapes) total += elements(s);
    // Per worker: gradients + parameters (~205 MB in 64 MiB buffers).
    cluster = Cluster::make(transport, 2, 384, 300, extra);
    if (!cluster) return false;
    grads.resize(2);
    outs.resize(2);
    for (std::uint32_t r = 0; r < 2; ++r) {
      arenas.push_back(std::make_unique<Arena>(*cluster->workers[r], 2 * total));
      for (const auto& s : shapes) {
        auto g = arenas[r]->take(elements(s));
        std::fill(g.begin(), g.end(), 1e-3f * static_cast<float>(r + 1));
        grads[r].push_back(g);
        outs[r].push_back(arenas[r]->take(elements(s)));
      }
    }
    bool ok = true;
    cluster->on_all([&](std::uint32_t r) {
      std::vector<Handle> hs;
      for (std::size_t k = 0; k < shapes.size(); ++k) {
        hs.push_back(cluster->workers[r]->init(k, shapes[k],
                                               r == 0 ? std::span<const float>(outs[r][k]) : std::span<const float>()));
      }
      if (!check(ember::wait_all(hs), "resnet init")) ok = false;
    });
    return ok;
  }

  // One BSP step; seconds.
  double step() {
    return cluster->on_all([&](std::uint32_t r) {
      std::vector<Handle> hs;
      hs.reserve(shapes.size());
      for (std::size_t k = 0; k < shapes.size(); ++k) {
        hs.push_back(cluster->workers[r]->push_pull(k, grads[r][k], outs[r][k]));
      }
      check(ember::wait_all(hs), "resnet step");
    });
  }
};

#ifdef EMBER_HAVE_GLOO
// Seconds per step of ring all-reduces of every tensor, 2 ranks over TCP.
std::vector<double> gloo_resnet(const std::vector<std::vector<std::uint64_t>>& shapes, int steps) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::vector<double>> times(2);
  auto rank_fn = [&](int rank) {
    gloo::transport::tcp::attr attr("127.0.0.1");
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, 2);
    ctx->connectFullMesh(*store, dev);
    std::vector<std::vector<float>> data;
    std::vector<std::unique_ptr<gloo::AllreduceRing<float>>> algos;
    for (const auto& s : shapes) data.emplace_back(elements(s), 1e-3f);
    for (auto& d : data) {
      std::vector<float*> ptrs{d.data()};
      algos.push_back(std::make_unique<gloo::AllreduceRing<float>>(ctx, ptrs, static_cast<int>(d.size())));
    }
    for (auto& a : algos) a->run();  // warm-up
    for (int s = 0; s < steps; ++s) {
      const auto t0 = Clock::now();
      for (auto& a : algos) a->run();
      times[rank].push_back(seconds_since(t0));
    }
  };
  std::thread r1([&] { rank_fn(1); });
  rank_fn(0);
  r1.join();
  std::vector<double> out(times[0].size());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = std::max(times[0][i], times[1][i]);
  return out;
}
#endif

// Seconds to copy `bytes` out and back once (the ceiling of a push + pull).
double memcpy_ceiling(std::size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  std::memcpy(b.data(), a.data(), bytes);  // warm (fault in)
  const auto t0 = Clock::now();
  std::memcpy(b.data(), a.data(), bytes);
  asm volatile("" : : "r"(b.data()) : "memory");
  std::memcpy(a.data(), b.data(), bytes);
  asm volatile("" : : "r"(a.data()) : "memory");
  return seconds_since(t0);
}

// ---- section 2: tiny keys ----

struct TinyRun {
  Cluster* cluster = nullptr;
  static constexpr int kKeys = 10000;
  static constexpr Key kBase = 100000;
  std::vector<std::vector<float>> grad, out;  // per worker: kKeys * 16

  bool setup(Cluster& c) {
    cluster = &c;
    grad.assign(2, std::vector<float>(kKeys * 16, 1e-3f));
    out.assign(2, std::vector<float>(kKeys * 16));
    const std::uint64_t shape[] = {16};
    bool ok = true;
    c.on_all([&](std::uint32_t r) {
      std::vector<Handle> hs;
      for (int k = 0; k < kKeys; ++k) {
        hs.push_back(c.workers[r]->init(kBase + k, shape,
                                        r == 0 ? std::span<const float>(out[r]).subspan(k * 16, 16)
                                               : std::span<const float>()));
      }
      if (!check(ember::wait_all(hs), "tiny init")) ok = false;
    });
    return ok;
  }
  double step(bool pipelined) {
    return cluster->on_all([&](std::uint32_t r) {
      Worker& w = *cluster->workers[r];
      if (pipelined) {
        auto pipe = w.pipeline();
        for (int k = 0; k < kKeys; ++k) {
          pipe.enqueue_push_pull(kBase + k, std::span<const float>(grad[r]).subspan(k * 16, 16),
                                 std::span<float>(out[r]).subspan(k * 16, 16));
        }
        check(pipe.wait(), "tiny pipelined");
      } else {
        std::vector<Handle> hs;
        hs.reserve(kKeys);
        for (int k = 0; k < kKeys; ++k) {
          hs.push_back(w.push_pull(kBase + k, std::span<const float>(grad[r]).subspan(k * 16, 16),
                                   std::span<float>(out[r]).subspan(k * 16, 16)));
        }
        check(ember::wait_all(hs), "tiny unbatched");
      }
    });
  }
};

// ---- section 3: single-key sweep ----

struct SweepResult {
  std::vector<double> push_s, pull_s;  // serial, per operation
  double inflight_gbs = 0;             // 8 in flight, push+pull bytes per second
  double faults_per_op = 0;
};

// The memory reference of one push then pull of `bytes`: the two passes any
// parameter server makes over a tensor, done here on buffers of the same size
// with no messaging, the way Ember's server does them: the tensor cut into
// partition_bytes chunks, chunk i on thread i % threads (as chunks spread over
// the shards), each thread running the update (p -= lr * g: reads g, reads
// and writes p) and then the reply copy (out = p, streamed past the cache when
// memory::use_stream_copy says so, as the server's in-place reply does). The
// threads are started and parked before the clock starts, so a small size is
// not charged a thread start (the shards are long-lived). Its goodput falls
// where the three buffers stop fitting in the caches: that part of Ember's
// fall from 16 MiB to 256 MiB is the machine's. Seconds for the two passes,
// median of `reps`.
double memory_reference(std::size_t bytes, unsigned threads, std::size_t chunk_bytes, int reps) {
  const std::size_t n = bytes / sizeof(float);
  const std::size_t chunk = std::max<std::size_t>(1, chunk_bytes / sizeof(float));
  const std::size_t chunks = (n + chunk - 1) / chunk;
  threads = static_cast<unsigned>(std::clamp<std::size_t>(threads, 1, chunks));
  const bool stream = ember::memory::use_stream_copy(bytes);
  std::vector<float> g(n, 1e-3f), p(n, 0.5f), out(n, 0.0f);
  auto passes = [&](unsigned t) {
    const float lr = 1e-9f;
    for (std::size_t c = t; c < chunks; c += threads) {
      const std::size_t begin = c * chunk, end = std::min(n, begin + chunk);
      float* __restrict pp = p.data();
      const float* __restrict gp = g.data();
      for (std::size_t i = begin; i < end; ++i) pp[i] -= lr * gp[i];
      asm volatile("" : : "r"(pp) : "memory");
    }
    for (std::size_t c = t; c < chunks; c += threads) {
      const std::size_t begin = c * chunk, end = std::min(n, begin + chunk);
      if (stream) {
        ember::memory::stream_copy(out.data() + begin, p.data() + begin, (end - begin) * sizeof(float));
      } else {
        std::memcpy(out.data() + begin, p.data() + begin, (end - begin) * sizeof(float));
      }
      asm volatile("" : : "r"(out.data()) : "memory");
    }
  };
  // Parked helpers: each waits for the next round number, runs, reports done.
  std::atomic<int> round{0}, done{0};
  std::atomic<bool> quit{false};
  std::vector<std::thread> helpers;
  for (unsigned t = 1; t < threads; ++t) {
    helpers.emplace_back([&, t] {
      for (int seen = 0;;) {
        int r;
        while ((r = round.load(std::memory_order_acquire)) == seen && !quit.load()) std::this_thread::yield();
        if (quit.load()) return;
        seen = r;
        passes(t);
        done.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  }
  std::vector<double> t;
  for (int r = 0; r < reps + 1; ++r) {
    done.store(0);
    const auto t0 = Clock::now();
    round.fetch_add(1, std::memory_order_acq_rel);
    passes(0);
    while (done.load(std::memory_order_acquire) != static_cast<int>(threads) - 1) std::this_thread::yield();
    if (r > 0) t.push_back(seconds_since(t0));  // the first one faults the pages in
  }
  quit.store(true);
  for (auto& h : helpers) h.join();
  return median(t);
}

struct SweepRun {
  std::unique_ptr<Cluster> cluster;
  std::map<std::size_t, Key> keys;
  std::map<std::size_t, TensorBuffer> grads, outs;

  bool setup(const std::string& transport, const std::vector<std::size_t>& sizes) {
    std::size_t total = 0;
    for (auto s : sizes) total += 2 * s;
    const auto pages = static_cast<std::uint32_t>(total / (2u << 20) * 3 / 2 + 96);
    cluster = Cluster::make(transport, 1, 384, pages);
    if (!cluster) return false;
    Worker& w = *cluster->workers[0];
    Key next = 500000;
    for (auto s : sizes) {
      keys[s] = next++;
      grads[s] = w.allocate(s);
      outs[s] = w.allocate(s);
      std::fill(grads[s].floats().begin(), grads[s].floats().end(), 1e-3f);
      std::fill(outs[s].floats().begin(), outs[s].floats().end(), 0.5f);
      const std::uint64_t shape[] = {s / 4};
      if (!check(w.init(keys[s], shape, outs[s].floats()).wait(), "sweep init")) return false;
    }
    return true;
  }

  SweepResult run(std::size_t size, int ops) {
    Worker& w = *cluster->workers[0];
    const Key key = keys[size];
    SweepResult r;
    auto g = grads[size].floats();
    auto o = outs[size].floats();
    // Warm-up: the pools and the server's buffers reach their steady state.
    for (int i = 0; i < 2; ++i) {
      check(w.push(key, g).wait(), "sweep push");
      check(w.pull(key, o).wait(), "sweep pull");
    }
    const long f0 = minor_faults();
    for (int i = 0; i < ops; ++i) {
      auto t0 = Clock::now();
      check(w.push(key, g).wait(), "sweep push");
      r.push_s.push_back(seconds_since(t0));
      t0 = Clock::now();
      check(w.pull(key, o).wait(), "sweep pull");
      r.pull_s.push_back(seconds_since(t0));
    }
    r.faults_per_op = static_cast<double>(minor_faults() - f0) / (2.0 * ops);
    // 8 in flight: 8 pushes, then 8 pulls (the pulls share one destination:
    // their contents are not inspected).
    const int batches = std::max(1, ops / 4);
    const auto t0 = Clock::now();
    for (int b = 0; b < batches; ++b) {
      std::vector<Handle> hs;
      for (int i = 0; i < 8; ++i) hs.push_back(w.push(key, g));
      check(ember::wait_all(hs), "sweep push x8");
      hs.clear();
      for (int i = 0; i < 8; ++i) hs.push_back(w.pull(key, o));
      check(ember::wait_all(hs), "sweep pull x8");
    }
    r.inflight_gbs = 16.0 * batches * static_cast<double>(size) / seconds_since(t0) / 1e9;
    return r;
  }

  // Pipelined 4 KiB pushes per second over `keys` distinct keys.
  double pipelined_4k_ops(int rounds) {
    Worker& w = *cluster->workers[0];
    const int n = 256;
    static std::vector<float> grad(1024, 1e-3f);
    const std::uint64_t shape[] = {1024};
    std::vector<Handle> inits;
    std::vector<float> init(1024, 0.0f);
    for (int k = 0; k < n; ++k) inits.push_back(w.init(700000 + k, shape, init));
    check(ember::wait_all(inits), "4k init");
    const auto t0 = Clock::now();
    for (int r = 0; r < rounds; ++r) {
      auto pipe = w.pipeline();
      for (int k = 0; k < n; ++k) pipe.enqueue(700000 + k, grad);
      check(pipe.wait(), "4k pipelined");
    }
    return static_cast<double>(rounds) * n / seconds_since(t0);
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("ember-bench-pushpull: Ember push/pull (tcp, shm) vs Gloo all-reduce and memcpy");
  int reps = 3;
  int steps = 3;
  bool quick = false;
  std::vector<std::string> sections{"resnet", "tiny", "sweep"};
  std::vector<std::string> transports{"tcp", "shm"};
  app.add_option("--sections", sections, "sections to run: resnet tiny sweep")->capture_default_str();
  app.add_option("--transports", transports, "transports to run: tcp shm")->capture_default_str();
  app.add_option("--reps", reps, "interleaved repetitions (medians reported)")->capture_default_str();
  app.add_option("--steps", steps, "ResNet-50 steps per repetition")->capture_default_str();
  app.add_flag("--quick", quick, "smaller run: 1 rep, 2 steps, sweep up to 64 MiB");
  std::vector<std::string> sets;
  app.add_option("--set", sets, "config override KEY=VALUE, e.g. communication.busy_poll=0us");
  CLI11_PARSE(app, argc, argv);
  for (const std::string& s : sets) {
    const auto eq = s.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::fprintf(stderr, "bench: --set %s: expected KEY=VALUE\n", s.c_str());
      return 2;
    }
    g_overrides.emplace_back(s.substr(0, eq), s.substr(eq + 1));
  }
  if (quick) {
    reps = 1;
    steps = 2;
  }
  ember::log::init_program_logging("warn");
  unsigned shard_count = default_shards();
  for (const auto& [key, value] : g_overrides) {
    if (key == "server.shards") shard_count = static_cast<unsigned>(std::max(1, std::atoi(value.c_str())));
  }
  // The chunk size the server cuts tensors into, for the memory reference.
  std::uint64_t partition_bytes = ember::config::Config{}.server.partition_bytes;
  if (auto cfg = ember::config::parse_config("", "bench")) {
    for (const auto& [key, value] : g_overrides) (void)ember::config::set_value(*cfg, key, value);
    partition_bytes = cfg->server.partition_bytes;
  }
  std::string pinning = fmt::format("pinned to CPUs [{}]", fmt::join(allowed_cpus(), ", "));
  for (const auto& [key, value] : g_overrides) {
    if (key == "server.shard_cpu_affinity") pinning = "shard_cpu_affinity = " + value;
  }
  std::printf("server: %u shard thread(s), %s (--set server.shards=N, server.shard_cpu_affinity=[...] "
              "to change); transports:",
              shard_count, pinning.c_str());
  for (const auto& t : transports) std::printf(" %s", t.c_str());
  std::printf("\n");
  auto wanted = [&](const char* name) {
    return std::find(sections.begin(), sections.end(), name) != sections.end();
  };

  // ---- 1. ResNet-50 ----
  const auto shapes = resnet50_shapes();
  std::size_t total = 0;
  for (const auto& s : shapes) total += elements(s);
  const double grad_bytes = static_cast<double>(total) * 4;
  std::map<std::string, std::vector<double>> step_s;
  if (wanted("resnet")) {
    std::printf("== ResNet-50 gradients: %zu tensors, %zu float32 (%.1f MB); 2 workers, 1 server, BSP, "
                "push_pull of every tensor per step\n",
                shapes.size(), total, grad_bytes / 1e6);
    std::fflush(stdout);
    // "tcp+crc": tcp with [communication] payload_checksum = true, to show
    // what checking every payload byte end to end costs (unless --set chose it).
    std::vector<std::pair<std::string, std::vector<std::pair<std::string, std::string>>>> variants;
    for (const auto& t : transports) {
      variants.push_back({t, {}});
      const bool chosen = std::any_of(g_overrides.begin(), g_overrides.end(), [](const auto& kv) {
        return kv.first == "communication.payload_checksum";
      });
      if (t == "tcp" && !chosen) {
        variants.push_back({"tcp+crc", {{"communication.payload_checksum", "true"}}});
      }
    }
    std::map<std::string, std::unique_ptr<ResnetRun>> runs;
    for (const auto& [name, extra] : variants) {
      auto run = std::make_unique<ResnetRun>();
      if (run->setup(name == "tcp+crc" ? "tcp" : name, extra)) {
        run->step();  // warm-up
        runs[name] = std::move(run);
      } else {
        std::printf("  (%s: setup failed, skipped)\n", name.c_str());
      }
    }
    for (int rep = 0; rep < reps; ++rep) {
      for (const auto& [name, extra] : variants) {
        if (!runs.count(name)) continue;
        for (int s = 0; s < steps; ++s) step_s["ember-" + name].push_back(runs[name]->step());
      }
#ifdef EMBER_HAVE_GLOO
      for (double x : gloo_resnet(shapes, steps)) step_s["gloo-ring-tcp"].push_back(x);
#endif
      step_s["memcpy ceiling"].push_back(memcpy_ceiling(static_cast<std::size_t>(grad_bytes)));
    }
  }
  const double gloo_ms = median(step_s["gloo-ring-tcp"]) * 1e3;
  if (wanted("resnet")) std::printf("%-16s %14s %14s %10s\n", "system", "step ms (p50)", "goodput GB/s", "vs gloo");
  for (const char* name : {"ember-tcp", "ember-tcp+crc", "ember-shm", "gloo-ring-tcp", "memcpy ceiling"}) {
    if (!step_s.count(name)) continue;
    const double ms = median(step_s[name]) * 1e3;
    std::printf("%-16s %14.1f %14.2f %10s\n", name, ms, grad_bytes / (ms / 1e3) / 1e9,
                gloo_ms > 0 ? fmt::format("{:.2f}", ms / gloo_ms).c_str() : "-");
  }
  std::fflush(stdout);

  // ---- 2. tiny keys ----
  std::map<std::string, std::vector<double>> tiny_s;
  if (wanted("tiny")) {
    std::printf("\n== 10,000 keys of 64 bytes; 2 workers, BSP, push_pull of every key per step\n");
    std::map<std::string, std::unique_ptr<Cluster>> clusters;
    std::map<std::string, TinyRun> tiny;
    for (const auto& t : transports) {
      auto c = Cluster::make(t, 2, 64, 32);
      if (!c) continue;
      clusters[t] = std::move(c);
      if (!tiny[t].setup(*clusters[t])) {
        clusters.erase(t);
        continue;
      }
      tiny[t].step(true);
      tiny[t].step(false);
    }
    for (int rep = 0; rep < reps; ++rep) {
      for (auto& [t, run] : tiny) {
        if (!clusters.count(t)) continue;
        tiny_s[t + " batched"].push_back(run.step(true));
        tiny_s[t + " unbatched"].push_back(run.step(false));
      }
    }
  }
  if (wanted("tiny")) std::printf("%-18s %12s %16s\n", "path", "step ms", "messages/s");
  for (const auto& t : transports) {
    for (const char* mode : {"batched", "unbatched"}) {
      const std::string name = t + " " + mode;
      if (!tiny_s.count(name)) continue;
      const double s = median(tiny_s[name]);
      std::printf("%-18s %12.1f %16.0f\n", name.c_str(), s * 1e3, 2.0 * 2 * TinyRun::kKeys / s);
    }
  }
  std::fflush(stdout);

  // ---- 3. single-key sweep ----
  std::vector<std::size_t> sizes{4u << 10, 1u << 20, 16u << 20, 64u << 20};
  if (!quick) sizes.push_back(256u << 20);
  if (wanted("sweep")) std::printf("\n== one key, push then pull; 1 worker; serial and 8 in flight\n");
  std::map<std::string, std::map<std::size_t, std::vector<SweepResult>>> sweep;
  std::map<std::string, std::vector<double>> ops4k;
  std::map<std::size_t, std::vector<double>> reference_s;  // memory_reference, per size
  if (wanted("sweep")) {
    std::map<std::string, SweepRun> runs;
    for (const auto& t : transports) {
      if (!runs[t].setup(t, sizes)) runs.erase(t);
    }
    for (int rep = 0; rep < reps; ++rep) {
      for (auto& [t, run] : runs) {
        for (auto s : sizes) {
          const int ops = s <= (4u << 10) ? 2000 : s <= (1u << 20) ? 200 : s <= (16u << 20) ? 24 : 8;
          sweep[t][s].push_back(run.run(s, ops));
        }
        ops4k[t].push_back(run.pipelined_4k_ops(20));
      }
      for (auto s : sizes) reference_s[s].push_back(memory_reference(s, shard_count, partition_bytes, s <= (1u << 20) ? 50 : 4));
    }
  }
  if (wanted("sweep")) {
    std::printf("%-5s %8s %11s %11s %11s %11s %12s %12s %10s\n", "tport", "size", "push p50us",
                "push p99us", "pull p50us", "pull p99us", "serial GB/s", "8-fly GB/s", "faults/op");
  }
  std::map<std::string, std::map<std::size_t, double>> serial_gbs, push_p50_us;
  double faults_big = 0;
  for (const auto& t : transports) {
    for (auto s : sizes) {
      auto& rs = sweep[t][s];
      if (rs.empty()) continue;
      std::vector<double> pushes, pulls, fly, faults, gbs;
      for (auto& r : rs) {
        pushes.insert(pushes.end(), r.push_s.begin(), r.push_s.end());
        pulls.insert(pulls.end(), r.pull_s.begin(), r.pull_s.end());
        fly.push_back(r.inflight_gbs);
        faults.push_back(r.faults_per_op);
      }
      const double op_s = median(pushes) + median(pulls);
      serial_gbs[t][s] = 2.0 * static_cast<double>(s) / op_s / 1e9;
      push_p50_us[t][s] = median(pushes) * 1e6;
      if (s == sizes.back()) faults_big = std::max(faults_big, median(faults));
      std::printf("%-5s %8s %11.1f %11.1f %11.1f %11.1f %12.2f %12.2f %10.2f\n", t.c_str(),
                  size_name(s).c_str(), median(pushes) * 1e6, percentile(pushes, 0.99) * 1e6,
                  median(pulls) * 1e6, percentile(pulls, 0.99) * 1e6, serial_gbs[t][s], median(fly),
                  median(faults));
    }
  }
  std::map<std::size_t, double> reference_gbs;
  for (auto s : sizes) {
    if (reference_s[s].empty()) continue;
    reference_gbs[s] = 2.0 * static_cast<double>(s) / median(reference_s[s]) / 1e9;
    std::printf("%-5s %8s %11s %11s %11s %11s %12.2f %12s %10s\n", "ref", size_name(s).c_str(), "-",
                "-", "-", "-", reference_gbs[s], "-", "-");
  }
  if (!reference_gbs.empty()) {
    std::printf("(ref: the memory reference, the update pass and the reply copy over buffers of "
                "that size, in partition_bytes chunks over as many threads as the server has shards, "
                "no messaging: where ref falls from 16 MiB, the machine's caches set the fall; "
                "SUMMARY *_goodput_%s_vs_ref is Ember's goodput over ref's at that size)\n",
                size_name(sizes.back()) == "256 MiB" ? "256m" : "64m");
  }
  for (const auto& t : transports) {
    if (ops4k.count(t)) std::printf("%s: pipelined 4 KiB pushes: %.0f ops/s\n", t.c_str(), median(ops4k[t]));
  }

  // ---- summary ----
  auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  const double tcp_ms = median(step_s["ember-tcp"]) * 1e3;
  const double tcp_crc_ms = median(step_s["ember-tcp+crc"]) * 1e3;
  const double shm_ms = median(step_s["ember-shm"]) * 1e3;
  const std::size_t big = sizes.back();
  const char* big_tag = size_name(big) == "256 MiB" ? "256m" : "64m";
  std::printf("\ntargets: shm step <= 0.5 x gloo, tcp step <= 1 x gloo; goodput flat 16 MiB -> %s; "
              "0 faults/op; 4 KiB push p50 <= 50 us tcp, <= 15 us shm; >= 100000 pipelined 4 KiB ops/s\n",
              size_name(big).c_str());
  std::printf(
      "SUMMARY shm_step_vs_gloo=%.2f tcp_step_vs_gloo=%.2f tcp_crc_step_vs_gloo=%.2f "
      "tcp_step_vs_memcpy=%.2f "
      "tcp_goodput_%s_vs_16m=%.2f shm_goodput_%s_vs_16m=%.2f ref_goodput_%s_vs_16m=%.2f "
      "tcp_goodput_%s_vs_ref=%.2f shm_goodput_%s_vs_ref=%.2f faults_per_op_%s=%.2f "
      "tcp_push_4k_p50_us=%.1f shm_push_4k_p50_us=%.1f tcp_pipelined_4k_ops_per_s=%.0f "
      "shm_pipelined_4k_ops_per_s=%.0f tiny_tcp_batched_vs_unbatched=%.2f tiny_shm_batched_vs_unbatched=%.2f\n",
      ratio(shm_ms, gloo_ms), ratio(tcp_ms, gloo_ms), ratio(tcp_crc_ms, gloo_ms),
      ratio(tcp_ms, median(step_s["memcpy ceiling"]) * 1e3),
      big_tag, ratio(serial_gbs["tcp"][big], serial_gbs["tcp"][16u << 20]),
      big_tag, ratio(serial_gbs["shm"][big], serial_gbs["shm"][16u << 20]),
      big_tag, ratio(reference_gbs[big], reference_gbs[16u << 20]),
      big_tag, ratio(serial_gbs["tcp"][big], reference_gbs[big]),
      big_tag, ratio(serial_gbs["shm"][big], reference_gbs[big]),
      big_tag, faults_big, push_p50_us["tcp"][4u << 10],
      push_p50_us["shm"][4u << 10], median(ops4k["tcp"]), median(ops4k["shm"]),
      ratio(median(tiny_s["tcp unbatched"]), median(tiny_s["tcp batched"])),
      ratio(median(tiny_s["shm unbatched"]), median(tiny_s["shm batched"])));
  return 0;
}
