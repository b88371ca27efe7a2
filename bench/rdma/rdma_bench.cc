// ember-bench-rdma: the single-key push/pull sweep over rdma beside tcp, on
// one host (in CI: the Soft-RoCE guest, through bench/rdma/run.sh).
//
// For each transport (tcp, rdma) a server and a client Transport live in
// this process, so one clock serves both ends. For each payload size
// (4 KiB, 64 KiB, 1 MiB, 16 MiB) the client pushes one message from its
// page pool; the server's handler answers with a pull response of the same
// size from its pool; the client waits for it. One repetition is `--iters`
// such round trips; the figure is the median over `--reps` repetitions,
// interleaved (each rep runs every transport in turn). Payload bytes are
// written once per message by the sender and read once (a word sum) by the
// receiver, as a server aggregating gradients would.
//
// Soft-RoCE is the kernel copying packets under an emulated CPU: these
// timings do not predict a NIC. They show, as ratios against tcp in the same
// guest, a change that makes the rdma path copy or round-trip more. Timings
// are printed, never judged. The last line is `SUMMARY key=value ...`.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "common/base/check.h"
#include "common/base/logging.h"
#include "common/memory/page_pool.h"
#include "common/transport/pool_buffer.h"
#include "common/transport/rdma/device.h"
#include "common/transport/transport.h"

namespace {

using namespace ember;
using namespace ember::transport;
using Clock = std::chrono::steady_clock;

struct Peer {
  std::unique_ptr<memory::PagePool> pool;
  std::unique_ptr<Transport> transport;
  std::uint32_t region = 0;
};

Peer make_peer(Kind kind) {
  Peer p;
  memory::PoolOptions po;
  po.prealloc_pages = 48;
  po.backing = memory::BackingRequest::kPlain;
  auto pool = memory::PagePool::create(po);
  EMBER_CHECK_MSG(pool.has_value(), "{}", pool.error().to_string());
  p.pool = std::move(*pool);
  Options o;
  o.kind = kind;
  o.num_channels = 1;
  o.num_io_threads = 1;
  o.auth_token = "ember-bench-rdma";
  o.max_queued_bytes = std::uint64_t{64} << 20;
  o.receive_allocator = pool_receive_allocator(*p.pool);
  auto t = Transport::create(o);
  EMBER_CHECK_MSG(t.has_value(), "{}", t.error().to_string());
  p.transport = std::move(*t);
  auto r = register_pool(*p.transport, *p.pool);
  EMBER_CHECK_MSG(r.has_value(), "{}", r.error().to_string());
  p.region = *r;
  return p;
}

void touch_write(std::span<std::byte> b, std::uint64_t seed) {
  const std::size_t words = b.size() / 8;
  for (std::size_t i = 0; i < words; ++i) {
    const std::uint64_t w = seed + i;
    std::memcpy(b.data() + 8 * i, &w, 8);
  }
}
std::uint64_t touch_read(std::span<const std::byte> b) {
  std::uint64_t sum = 0;
  const std::size_t words = b.size() / 8;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w;
    std::memcpy(&w, b.data() + 8 * i, 8);
    sum += w;
  }
  return sum;
}

// One transport's pair: server answers each push with a same-size reply.
class Pair {
 public:
  Pair(Kind kind, const std::string& ip) : server_(make_peer(kind)), client_(make_peer(kind)) {
    Handlers sh;
    sh.on_message = [this](Connection& c, Incoming&& m) {
      sink_ += touch_read(m.bytes);
      auto reply = allocate_buffer(*server_.pool, m.bytes.size(), server_.region);
      EMBER_CHECK_MSG(reply.has_value(), "{}", reply.error().to_string());
      touch_write(reply->bytes(), m.bytes.size());
      Status s = c.send(0, std::move(*reply), {}, std::chrono::nanoseconds(0));
      EMBER_CHECK_MSG(s.has_value(), "{}", s.error().to_string());
      (void)c.flush(0);
    };
    sh.on_closed = [](Connection&, const Error&) {};
    auto l = server_.transport->listen(ip + ":0", {Role::kServer, 0}, [](std::shared_ptr<Connection>) {}, sh);
    EMBER_CHECK_MSG(l.has_value(), "{}", l.error().to_string());
    listener_ = std::move(*l);
    Handlers ch;
    ch.on_message = [this](Connection&, Incoming&& m) {
      const std::uint64_t s = touch_read(m.bytes);
      std::lock_guard lock(mu_);
      sink_ += s;
      ++replies_;
      cv_.notify_all();
    };
    ch.on_closed = [](Connection&, const Error&) {};
    auto c = client_.transport->connect(listener_->address(), {Role::kWorker, 0}, ch);
    EMBER_CHECK_MSG(c.has_value(), "{}", c.error().to_string());
    conn_ = std::move(*c);
  }
  ~Pair() {
    conn_->close();
    listener_.reset();
  }

  // Seconds per round trip, over `iters` round trips of `bytes`.
  double round_trip_seconds(std::size_t bytes, int iters) {
    const auto start = Clock::now();
    for (int i = 0; i < iters; ++i) {
      auto b = allocate_buffer(*client_.pool, bytes, client_.region);
      EMBER_CHECK_MSG(b.has_value(), "{}", b.error().to_string());
      touch_write(b->bytes(), static_cast<std::uint64_t>(i));
      std::uint64_t want;
      {
        std::lock_guard lock(mu_);
        want = replies_ + 1;
      }
      Status s = conn_->send(0, std::move(*b));
      EMBER_CHECK_MSG(s.has_value(), "{}", s.error().to_string());
      (void)conn_->flush(0);
      std::unique_lock lock(mu_);
      const bool ok = cv_.wait_for(lock, std::chrono::seconds(60), [&] { return replies_ >= want; });
      EMBER_CHECK_MSG(ok, "no reply within 60 s ({} bytes)", bytes);
    }
    return std::chrono::duration<double>(Clock::now() - start).count() / iters;
  }

 private:
  Peer server_;
  Peer client_;
  std::unique_ptr<Listener> listener_;
  std::shared_ptr<Connection> conn_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t replies_ = 0;
  std::uint64_t sink_ = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ember-bench-rdma: single-key push/pull round trips, rdma beside tcp"};
  int reps = 5;
  int iters = 20;
  std::string ip;
  app.add_option("--reps", reps, "Interleaved repetitions (median)")->check(CLI::Range(1, 1000));
  app.add_option("--iters", iters, "Round trips per repetition")->check(CLI::Range(1, 100000));
  app.add_option("--ip", ip, "Address of the RDMA device's netdev (default: probed)");
  CLI11_PARSE(app, argc, argv);
  ember::log::init_program_logging("warn");

  const auto avail = rdma::probe_rdma();
  if (ip.empty()) ip = avail.address;
  if (!avail.available || ip.empty()) {
    std::printf("ember-bench-rdma: no RDMA device here (%s); run it through scripts/bench.sh rdma "
                "(the Soft-RoCE guest)\n",
                avail.detail.c_str());
    std::printf("SUMMARY rdma_available=0\n");
    return 0;
  }
  std::printf("ember-bench-rdma on %s, %d reps x %d round trips, medians\n", avail.detail.c_str(),
              reps, iters);
  const std::vector<std::size_t> sizes = {4u << 10, 64u << 10, 1u << 20, 16u << 20};
  const std::vector<std::pair<const char*, Kind>> kinds = {{"tcp", Kind::kTcp}, {"rdma", Kind::kRdma}};
  std::map<std::string, std::unique_ptr<Pair>> pairs;
  for (const auto& [name, kind] : kinds) pairs[name] = std::make_unique<Pair>(kind, ip);
  std::map<std::pair<std::string, std::size_t>, std::vector<double>> samples;
  for (int r = 0; r < reps; ++r) {
    for (std::size_t bytes : sizes) {
      const int n = bytes >= (16u << 20) ? std::max(1, iters / 8) : iters;
      for (const auto& [name, kind] : kinds) {
        samples[{name, bytes}].push_back(pairs[name]->round_trip_seconds(bytes, n));
      }
    }
  }
  std::printf("\n%-10s %14s %14s %12s\n", "payload", "tcp rt (us)", "rdma rt (us)", "rdma/tcp");
  std::string summary = "SUMMARY";
  for (std::size_t bytes : sizes) {
    const double t = median(samples[{"tcp", bytes}]) * 1e6;
    const double d = median(samples[{"rdma", bytes}]) * 1e6;
    const std::string label = bytes >= (1u << 20) ? fmt::format("{}MiB", bytes >> 20)
                                                  : fmt::format("{}KiB", bytes >> 10);
    std::printf("%-10s %14.1f %14.1f %12.2f\n", label.c_str(), t, d, d / t);
    summary += fmt::format(" rdma_over_tcp_rt_{}={:.2f}", label, d / t);
  }
  pairs.clear();
  std::printf("\n%s\n", summary.c_str());
  return 0;
}
