// ember-bench-transport: Ember's transports side by side on 127.0.0.1.
//
// One server and two clients, each its own Transport (own I/O thread) in
// this process, so one clock serves both ends. For each transport
// (tcp-writev, tcp-sendfile, shm) and payload (4 KiB, 1 MiB, 16 MiB, 64 MiB):
//  * goodput: both clients push `--total-mib` each of payload-sized
//    messages from their page pools at once; goodput = bytes of both / time
//    until the server has received and read all of them (tcp receives land
//    in the server's pool; shm lends the client's blocks and the server reads
//    them in place). The server reads every payload byte once (an XOR over
//    its words), as an aggregating server must; --no-touch skips that, and
//    shm then only moves descriptors;
//  * latency: each client does serial round trips (payload there, 8-byte ack
//    back); p50/p99 of the round-trip time.
// Peers for the same bytes: (a) a single-thread memcpy (the ceiling for one
// core moving them) and (b) Gloo's ring all-reduce over its TCP transport on
// loopback, 2 ranks, a float32 tensor of the payload size. In a 2-rank ring
// each rank sends half the tensor in reduce-scatter and half in all-gather,
// so the ranks together send 2 x tensor bytes per all-reduce; the table shows
// that aggregate (2 x algorithm bandwidth), comparable with Ember's two
// clients each pushing the tensor.
// Small messages: one client sends 64-byte messages as fast as it can, with
// batching on and off: messages per second at the server, and system calls
// per message on the sending side (tcp: write/sendmsg/sendfile; shm: doorbell
// writes) and the receiving side (reads).
//
// Every figure is the median of --reps interleaved repetitions (each rep
// runs every transport in turn). Timings are printed, never judged. The last
// line is `SUMMARY key=value ...`.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "common/base/check.h"
#include "common/base/logging.h"
#include "common/memory/page_pool.h"
#include "common/transport/pool_buffer.h"
#include "common/transport/transport.h"

#ifdef EMBER_HAVE_GLOO
#include <gloo/allreduce_ring.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>
#endif

namespace {

using namespace ember;
using namespace ember::transport;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t i = std::min(v.size() - 1, static_cast<std::size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}
std::string size_name(std::size_t s) {
  if (s >= (1u << 20)) return fmt::format("{}M", s >> 20);
  return fmt::format("{}K", s >> 10);
}

// Ack request tag in the first 8 bytes of a latency-phase message.
constexpr std::uint64_t kAckTag = 0xAC4AC4AC4AC4AC4Aull;

struct Mode {
  std::string name;
  Kind kind;
  ZeroCopy zero_copy;
};

// The server: counts what arrives, acks tagged messages.
// Counting is one relaxed add per message; the waiter is woken once, by the
// message that reaches the target, so the receive loop measures the
// transport rather than condition-variable traffic.
struct ServerSide {
  bool touch = true;  // read every received byte, as an aggregating server does
  std::atomic<std::uint64_t> sink{0};
  std::atomic<std::uint64_t> messages{0};
  std::atomic<std::uint64_t> target{~std::uint64_t{0}};
  std::mutex mu;
  std::condition_variable cv;
  // Arms a run that ends when `n` messages have arrived.
  void expect(std::uint64_t n) {
    messages.store(0);
    target.store(n);
  }
  void on_message() {
    if (messages.fetch_add(1, std::memory_order_relaxed) + 1 == target.load(std::memory_order_relaxed)) {
      std::lock_guard lock(mu);
      cv.notify_all();
    }
  }
  bool wait(std::chrono::seconds timeout = 120s) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, timeout, [&] { return messages.load() >= target.load(); });
  }
};

// A client's view of acks and of its completed sends.
struct ClientSide {
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t acks = 0;
  std::uint64_t completions = 0;  // pool blocks given back by the transport
};

struct Setup {
  Mode mode;
  std::unique_ptr<memory::PagePool> server_pool;
  std::unique_ptr<Transport> server;
  std::unique_ptr<Listener> listener;
  ServerSide server_side;
  struct Client {
    std::unique_ptr<memory::PagePool> pool;
    std::unique_ptr<Transport> transport;
    std::uint32_t region = 0;
    std::shared_ptr<Connection> conn;
    ClientSide side;
  };
  std::vector<std::unique_ptr<Client>> clients;
  std::mutex accepted_mu;
  std::vector<std::shared_ptr<Connection>> accepted;  // in connect order: client 0 first
  std::shared_ptr<Connection> accepted_first() {
    std::lock_guard lock(accepted_mu);
    return accepted.at(0);
  }
};

Options base_options(const Mode& m, bool batching) {
  Options o;
  o.kind = m.kind;
  o.zero_copy = m.zero_copy;
  o.num_channels = 1;
  o.num_io_threads = 1;
  o.batching = batching;
  o.max_message_bytes = std::uint64_t{64} << 20;
  // Bounds the pool blocks in flight per client: one size class holds at most
  // this plus one message (blocks never change class, so the pools are
  // sized for the sum over the classes the run uses).
  o.max_queued_bytes = std::uint64_t{64} << 20;
  o.heartbeat_interval = 1s;
  o.heartbeat_timeout = 60s;
  return o;
}

std::unique_ptr<memory::PagePool> make_pool(const std::string& name, std::size_t pages) {
  memory::PoolOptions po;
  po.prealloc_pages = pages;
  po.backing = memory::BackingRequest::kTransparentHuge;  // sendfile needs a non-hugetlb memfd
  po.name = name;
  auto p = memory::PagePool::create(po);
  if (!p) {
    po.backing = memory::BackingRequest::kPlain;
    p = memory::PagePool::create(po);
  }
  EMBER_CHECK_MSG(p.has_value(), "pool: {}", p.error().to_string());
  return std::move(*p);
}

bool g_touch = true;

std::unique_ptr<Setup> make_setup(const Mode& m, bool batching, int id, std::size_t client_pages,
                                  std::size_t server_pages) {
  auto s = std::make_unique<Setup>();
  s->mode = m;
  s->server_side.touch = g_touch;
  s->server_pool = make_pool("bench-server", server_pages);
  Options so = base_options(m, true);
  so.receive_allocator = pool_receive_allocator(*s->server_pool);
  auto st = Transport::create(so);
  EMBER_CHECK_MSG(st.has_value(), "{}", st.error().to_string());
  s->server = std::move(*st);
  Handlers h;
  ServerSide* side = &s->server_side;
  h.on_message = [side](Connection& c, Incoming&& msg) {
    std::uint64_t tag = 0;
    if (msg.bytes.size() >= 8) std::memcpy(&tag, msg.bytes.data(), 8);
    if (side->touch) {
      // Consume the payload: XOR of its 64-bit words (one read pass).
      std::uint64_t x = 0;
      const std::size_t words = msg.bytes.size() / 8;
      const std::byte* p = msg.bytes.data();
      for (std::size_t i = 0; i < words; ++i) {
        std::uint64_t w;
        std::memcpy(&w, p + 8 * i, 8);
        x ^= w;
      }
      side->sink.fetch_xor(x, std::memory_order_relaxed);
    }
    if (tag == kAckTag) {
      (void)c.send(msg.channel, std::span<const std::byte>(msg.bytes.data(), 8));
      (void)c.flush(msg.channel);
    }
    side->on_message();
  };
  h.on_closed = [](Connection&, const Error&) {};
  const std::string address =
      m.kind == Kind::kShm ? fmt::format("@ember-bench-{}-{}-{}", ::getpid(), m.name, id) : "127.0.0.1:0";
  Setup* raw = s.get();
  auto l = s->server->listen(
      address, {Role::kServer, 0},
      [raw](std::shared_ptr<Connection> c) {
        std::lock_guard lock(raw->accepted_mu);
        raw->accepted.push_back(std::move(c));
      },
      h);
  EMBER_CHECK_MSG(l.has_value(), "{}", l.error().to_string());
  s->listener = std::move(*l);
  for (int c = 0; c < 2; ++c) {
    auto cl = std::make_unique<Setup::Client>();
    cl->pool = make_pool("bench-client", client_pages);
    auto ct = Transport::create(base_options(m, batching));
    EMBER_CHECK(ct.has_value());
    cl->transport = std::move(*ct);
    cl->region = *register_pool(*cl->transport, *cl->pool);
    Handlers ch;
    ClientSide* cs = &cl->side;
    ch.on_message = [cs](Connection&, Incoming&&) {
      {
        std::lock_guard lock(cs->mu);
        ++cs->acks;
      }
      cs->cv.notify_all();
    };
    ch.on_closed = [](Connection&, const Error&) {};
    auto conn = cl->transport->connect(s->listener->address(), {Role::kWorker, static_cast<std::uint32_t>(c)}, ch);
    EMBER_CHECK_MSG(conn.has_value(), "{}", conn.error().to_string());
    cl->conn = *conn;
    s->clients.push_back(std::move(cl));
    // Wait until the server has handed this connection out, so accepted[]
    // follows the client order.
    for (auto deadline = Clock::now() + 10s; Clock::now() < deadline;) {
      std::lock_guard lock(s->accepted_mu);
      if (s->accepted.size() == static_cast<std::size_t>(c + 1)) break;
    }
  }
  return s;
}

// A pool block; when the pool is momentarily exhausted, retries until a
// completion (tcp: the write finished; shm: the server released it) frees
// one, for at most 60 s.
Buffer allocate_retry(Setup::Client& c, std::size_t size) {
  for (;;) {
    std::uint64_t seen;
    {
      std::lock_guard lock(c.side.mu);
      seen = c.side.completions;
    }
    Result<Buffer> b = allocate_buffer(*c.pool, size, c.region);
    if (b) return std::move(*b);
    EMBER_CHECK_MSG(b.error().code() == ErrorCode::kPoolExhausted, "{}", b.error().to_string());
    // Sleep until a send completes (its block is back in the pool).
    std::unique_lock lock(c.side.mu);
    const bool freed = c.side.cv.wait_for(lock, 60s, [&] { return c.side.completions != seen; });
    EMBER_CHECK_MSG(freed, "no pool block came back in 60 s");
  }
}

SendCompletion completion_for(Setup::Client& c) {
  return [&c](const Status&) {
    {
      std::lock_guard lock(c.side.mu);
      ++c.side.completions;
    }
    c.side.cv.notify_all();
  };
}

// Sends `count` pool-block messages of `size` (tag 0) from one client.
void push_messages(Setup::Client& c, std::size_t size, std::uint64_t count) {
  for (std::uint64_t i = 0; i < count; ++i) {
    std::optional<Buffer> b(allocate_retry(c, size));
    std::memset(b->data(), 0, 8);
    Status s = c.conn->send(0, std::move(*b), completion_for(c), 60s);
    EMBER_CHECK_MSG(s.has_value(), "{}", s.error().to_string());
  }
  (void)c.conn->flush(0);
}

// Aggregate GB/s at the server (both clients together).
double run_goodput(Setup& s, std::size_t size, std::uint64_t total_bytes) {
  const std::uint64_t count = std::max<std::uint64_t>(4, total_bytes / size);
  s.server_side.expect(2 * count);
  const auto t0 = Clock::now();
  std::thread other([&] { push_messages(*s.clients[1], size, count); });
  push_messages(*s.clients[0], size, count);
  other.join();
  const bool all_arrived = s.server_side.wait();
  EMBER_CHECK(all_arrived);
  const double t = seconds_since(t0);
  return static_cast<double>(2 * count * size) / t / 1e9;
}

// Round-trip times in microseconds, both clients at once.
std::vector<double> run_latency(Setup& s, std::size_t size, int rounds) {
  std::vector<double> all;
  std::mutex all_mu;
  auto one = [&](Setup::Client& c) {
    std::vector<double> mine;
    for (int r = 0; r < rounds; ++r) {
      std::optional<Buffer> b(allocate_retry(c, size));
      std::memcpy(b->data(), &kAckTag, 8);
      std::uint64_t before;
      {
        std::lock_guard lock(c.side.mu);
        before = c.side.acks;
      }
      const auto t0 = Clock::now();
      const Status sent = c.conn->send(0, std::move(*b), completion_for(c), 60s);
      EMBER_CHECK_MSG(sent.has_value(), "{}", sent.error().to_string());
      (void)c.conn->flush(0);
      std::unique_lock lock(c.side.mu);
      const bool acked = c.side.cv.wait_for(lock, 60s, [&] { return c.side.acks > before; });
      EMBER_CHECK(acked);
      mine.push_back(seconds_since(t0) * 1e6);
    }
    std::lock_guard lock(all_mu);
    all.insert(all.end(), mine.begin(), mine.end());
  };
  std::thread other([&] { one(*s.clients[1]); });
  one(*s.clients[0]);
  other.join();
  return all;
}

struct SmallResult {
  double rate = 0;          // messages per second
  double tx_syscalls = 0;   // per message, sender
  double rx_syscalls = 0;   // per message, receiver
};

SmallResult run_small(Setup& s, std::uint64_t count) {
  Setup::Client& c = *s.clients[0];
  s.server_side.expect(count);
  const ConnectionStats before = c.conn->stats();
  const ConnectionStats server_before = s.accepted_first()->stats();
  std::array<std::byte, 64> msg{};
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < count; ++i) {
    Status st = c.conn->send(0, msg, 60s);
    EMBER_CHECK_MSG(st.has_value(), "{}", st.error().to_string());
  }
  (void)c.conn->flush(0);
  const bool all_arrived = s.server_side.wait();
  EMBER_CHECK(all_arrived);
  const double t = seconds_since(t0);
  const ConnectionStats after = c.conn->stats();
  SmallResult r;
  r.rate = static_cast<double>(count) / t;
  r.tx_syscalls = static_cast<double>(after.write_syscalls - before.write_syscalls) / count;
  const ConnectionStats server_after = s.accepted_first()->stats();
  r.rx_syscalls = static_cast<double>(server_after.read_syscalls - server_before.read_syscalls) / count;
  return r;
}

double run_memcpy(std::size_t size, std::uint64_t total_bytes, std::vector<std::byte>& src,
                  std::vector<std::byte>& dst) {
  const std::uint64_t count = std::max<std::uint64_t>(4, total_bytes / size);
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < count; ++i) {
    std::memcpy(dst.data(), src.data(), size);
    asm volatile("" : : "r"(dst.data()) : "memory");
  }
  return static_cast<double>(count * size) / seconds_since(t0) / 1e9;
}

#ifdef EMBER_HAVE_GLOO
// Aggregate GB/s sent by both ranks of a 2-rank ring all-reduce of `size` bytes.
double run_gloo(std::size_t size, int iterations) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<double> seconds(2);
  auto rank_fn = [&](int rank) {
    gloo::transport::tcp::attr attr("127.0.0.1");
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, 2);
    ctx->connectFullMesh(*store, dev);
    std::vector<float> data(size / sizeof(float), 1.0f);
    std::vector<float*> ptrs{data.data()};
    gloo::AllreduceRing<float> algo(ctx, ptrs, static_cast<int>(data.size()));
    algo.run();  // warm-up
    const auto t0 = Clock::now();
    for (int i = 0; i < iterations; ++i) algo.run();
    seconds[rank] = seconds_since(t0) / iterations;
  };
  std::thread r1([&] { rank_fn(1); });
  rank_fn(0);
  r1.join();
  // Both ranks together send 2 x size bytes per all-reduce (see the top).
  return 2.0 * static_cast<double>(size) / std::max(seconds[0], seconds[1]) / 1e9;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("ember-bench-transport: tcp-writev, tcp-sendfile and shm vs memcpy and Gloo");
  int reps = 3;
  std::uint64_t total_mib = 256;
  std::uint64_t small_count = 400000;
  app.add_option("--reps", reps, "interleaved repetitions (median reported)")->capture_default_str();
  app.add_option("--total-mib", total_mib, "MiB pushed per client per goodput run")->capture_default_str();
  app.add_option("--small-count", small_count, "64-byte messages per small-message run")->capture_default_str();
  bool no_touch = false;
  app.add_flag("--no-touch", no_touch,
               "the server does not read received payloads (shm then only moves descriptors)");
  CLI11_PARSE(app, argc, argv);
  g_touch = !no_touch;
  log::init_program_logging("warn");

  const std::vector<Mode> modes = {{"tcp-writev", Kind::kTcp, ZeroCopy::kWritev},
                                   {"tcp-sendfile", Kind::kTcp, ZeroCopy::kSendfile},
                                   {"shm", Kind::kShm, ZeroCopy::kWritev}};
  const std::vector<std::size_t> sizes = {4u << 10, 1u << 20, 16u << 20, 64u << 20};
  const std::uint64_t total = total_mib << 20;

  std::printf("ember-bench-transport: 1 server + 2 clients on 127.0.0.1, %d interleaved reps, "
              "%llu MiB per client per goodput run, server %s payloads\n",
              reps, static_cast<unsigned long long>(total_mib), g_touch ? "reads" : "does not read");
  std::fflush(stdout);

  std::vector<std::unique_ptr<Setup>> setups;
  for (std::size_t i = 0; i < modes.size(); ++i) setups.push_back(make_setup(modes[i], true, static_cast<int>(i), 160, 150));

  // goodput[mode][size], rtt p50/p99
  std::map<std::string, std::map<std::size_t, std::vector<double>>> goodput, p50, p99;
  std::map<std::size_t, std::vector<double>> memcpy_gbs, gloo_gbs;
  std::vector<std::byte> src(sizes.back()), dst(sizes.back());
  std::memset(src.data(), 1, src.size());
  std::memset(dst.data(), 2, dst.size());
  for (int rep = 0; rep < reps; ++rep) {
    for (std::size_t size : sizes) {
      const std::uint64_t bytes = size == (4u << 10) ? total / 4 : total;
      for (auto& s : setups) {
        goodput[s->mode.name][size].push_back(run_goodput(*s, size, bytes));
        const int rounds = size <= (4u << 10) ? 400 : size <= (1u << 20) ? 100 : size <= (16u << 20) ? 20 : 8;
        auto rtt = run_latency(*s, size, rounds);
        p50[s->mode.name][size].push_back(percentile(rtt, 0.50));
        p99[s->mode.name][size].push_back(percentile(rtt, 0.99));
      }
      memcpy_gbs[size].push_back(run_memcpy(size, bytes, src, dst));
#ifdef EMBER_HAVE_GLOO
      gloo_gbs[size].push_back(run_gloo(size, size <= (1u << 20) ? 50 : 5));
#endif
    }
  }

  std::printf("\nLarge messages: goodput at the server, both clients together (GB/s), and round trip "
              "(payload there, 8 B back)\n");
  std::printf("%-13s %6s %10s %10s %10s\n", "transport", "size", "GB/s", "p50 us", "p99 us");
  for (std::size_t size : sizes) {
    for (auto& m : modes) {
      std::printf("%-13s %6s %10.2f %10.1f %10.1f\n", m.name.c_str(), size_name(size).c_str(),
                  median(goodput[m.name][size]), median(p50[m.name][size]), median(p99[m.name][size]));
    }
    std::printf("%-13s %6s %10.2f\n", "memcpy(1 thr)", size_name(size).c_str(), median(memcpy_gbs[size]));
#ifdef EMBER_HAVE_GLOO
    std::printf("%-13s %6s %10.2f   (ring all-reduce, 2 ranks, bytes both send / time)\n", "gloo-tcp",
                size_name(size).c_str(), median(gloo_gbs[size]));
#endif
  }

  // Small messages: batching on vs off.
  std::map<std::string, std::vector<SmallResult>> small_on, small_off;
  std::vector<std::unique_ptr<Setup>> unbatched;
  for (std::size_t i = 0; i < modes.size(); ++i) {
    if (modes[i].zero_copy == ZeroCopy::kSendfile) continue;  // same small path as tcp-writev
    unbatched.push_back(make_setup(modes[i], false, 100 + static_cast<int>(i), 2, 2));
  }
  for (int rep = 0; rep < reps; ++rep) {
    for (auto& s : setups) {
      if (s->mode.zero_copy == ZeroCopy::kSendfile) continue;
      small_on[s->mode.name].push_back(run_small(*s, small_count));
    }
    for (auto& s : unbatched) small_off[s->mode.name].push_back(run_small(*s, small_count / 8));
  }
  auto med = [](const std::vector<SmallResult>& v, double SmallResult::*f) {
    std::vector<double> x;
    for (auto& r : v) x.push_back(r.*f);
    return median(x);
  };
  std::printf("\nSmall messages (64 B): rate at the server and sender system calls per message\n");
  std::printf("%-13s %-9s %14s %16s %16s\n", "transport", "batching", "msgs/s", "tx syscalls/msg",
              "rx syscalls/msg");
  for (auto& [name, v] : small_on) {
    std::printf("%-13s %-9s %14.0f %16.4f %16.4f\n", name.c_str(), "on", med(v, &SmallResult::rate),
                med(v, &SmallResult::tx_syscalls), med(v, &SmallResult::rx_syscalls));
    std::printf("%-13s %-9s %14.0f %16.4f %16.4f\n", name.c_str(), "off",
                med(small_off[name], &SmallResult::rate), med(small_off[name], &SmallResult::tx_syscalls),
                med(small_off[name], &SmallResult::rx_syscalls));
  }

  // Ratios.
  auto g = [&](const char* m, std::size_t size) { return median(goodput[m][size]); };
  // sendfile becomes the recommended default only when it is clearly faster
  // (> 5%) at both large sizes; otherwise writev (no memfd requirement).
  const double sf16 = g("tcp-sendfile", 16u << 20) / g("tcp-writev", 16u << 20);
  const double sf64 = g("tcp-sendfile", 64u << 20) / g("tcp-writev", 64u << 20);
  const char* default_zero_copy = (sf16 > 1.05 && sf64 > 1.05) ? "sendfile" : "writev";
  std::string summary = fmt::format(
      "SUMMARY shm_vs_memcpy_16m={:.2f} shm_vs_memcpy_64m={:.2f} tcp_writev_vs_memcpy_64m={:.2f} "
      "sendfile_vs_writev_16m={:.2f} sendfile_vs_writev_64m={:.2f} tcp_writev_64m_vs_1m={:.2f} "
      "tcp_writev_64m_vs_16m={:.2f} shm_64m_vs_1m={:.2f}",
      g("shm", 16u << 20) / median(memcpy_gbs[16u << 20]), g("shm", 64u << 20) / median(memcpy_gbs[64u << 20]),
      g("tcp-writev", 64u << 20) / median(memcpy_gbs[64u << 20]),
      g("tcp-sendfile", 16u << 20) / g("tcp-writev", 16u << 20),
      g("tcp-sendfile", 64u << 20) / g("tcp-writev", 64u << 20),
      g("tcp-writev", 64u << 20) / g("tcp-writev", 1u << 20),
      g("tcp-writev", 64u << 20) / g("tcp-writev", 16u << 20), g("shm", 64u << 20) / g("shm", 1u << 20));
#ifdef EMBER_HAVE_GLOO
  summary += fmt::format(" tcp_writev_vs_gloo_16m={:.2f} tcp_writev_vs_gloo_64m={:.2f} shm_vs_gloo_16m={:.2f}",
                         g("tcp-writev", 16u << 20) / median(gloo_gbs[16u << 20]),
                         g("tcp-writev", 64u << 20) / median(gloo_gbs[64u << 20]),
                         g("shm", 16u << 20) / median(gloo_gbs[16u << 20]));
#endif
  summary += fmt::format(
      " batching_speedup_tcp={:.1f} batching_speedup_shm={:.1f} tcp_syscalls_per_msg_batched={:.4f} "
      "tcp_syscalls_per_msg_unbatched={:.2f} default_zero_copy={}",
      med(small_on["tcp-writev"], &SmallResult::rate) / med(small_off["tcp-writev"], &SmallResult::rate),
      med(small_on["shm"], &SmallResult::rate) / med(small_off["shm"], &SmallResult::rate),
      med(small_on["tcp-writev"], &SmallResult::tx_syscalls),
      med(small_off["tcp-writev"], &SmallResult::tx_syscalls), default_zero_copy);
  // Tear down connections before the transports (each Setup in order).
  unbatched.clear();
  setups.clear();
  std::printf("\n%s\n", summary.c_str());
  return 0;
}
