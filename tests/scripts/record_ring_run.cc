// record_ring_run: a small recorded run for the plot test. One MpscRing per
// channel (common/ring, as the worker's channels use), one producer thread
// per rank pushing messages of seeded random sizes through the channel its
// key maps to, one consumer thread draining all channels in bursts — with a
// Recorder hooked in the way recorder.h tells the data path to hook it
// (on_enqueue before the push is visible, on_dequeue after the pop).
// Rank 0 sends four times as much as the others, so the plot has a hot rank.
//
//   record_ring_run OUT_FILE [--channels 4] [--ranks 4] [--messages 20000] [--seed 1]
//
// Exits 0 when the file is written; prints the seed.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/record/recorder.h"
#include "common/ring/mpsc_ring.h"

namespace {

struct Msg {
  std::uint32_t rank = 0;
  std::uint32_t bytes = 0;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace ember;
  if (argc < 2) {
    std::fprintf(stderr, "usage: record_ring_run OUT_FILE [--channels N] [--ranks N] [--messages N] [--seed S]\n");
    return 2;
  }
  std::uint32_t channels = 4, ranks = 4, messages = 20000, seed = 1;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const auto v = static_cast<std::uint32_t>(std::strtoul(argv[i + 1], nullptr, 10));
    if (k == "--channels") channels = v;
    else if (k == "--ranks") ranks = v;
    else if (k == "--messages") messages = v;
    else if (k == "--seed") seed = v;
    else {
      std::fprintf(stderr, "record_ring_run: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  std::printf("record_ring_run: seed %u\n", seed);
  record::RecorderOptions o;
  o.path = argv[1];
  o.source = "record_ring_run";
  o.num_channels = channels;
  o.num_ranks = ranks;
  o.sample_interval = std::chrono::microseconds(200);
  auto rec = record::Recorder::create(o);
  if (!rec) {
    std::fprintf(stderr, "record_ring_run: %s\n", rec.error().to_string().c_str());
    return 1;
  }
  std::vector<std::unique_ptr<ring::MpscRing<Msg>>> rings;
  for (std::uint32_t c = 0; c < channels; ++c) {
    auto r = ring::MpscRing<Msg>::create(ring::MpscOptions{256, ranks + 1});
    if (!r) {
      std::fprintf(stderr, "record_ring_run: %s\n", r.error().to_string().c_str());
      return 1;
    }
    rings.push_back(std::move(*r));
  }
  std::atomic<std::uint32_t> producers_left{ranks};
  std::vector<std::thread> threads;
  for (std::uint32_t rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      std::mt19937_64 rng(seed * 1000003ull + rank);
      // Mostly small gradients (64 B .. 4 KiB), some large (64 KiB .. 1 MiB).
      std::uniform_int_distribution<std::uint32_t> small(64, 4096), large(65536, 1 << 20);
      std::uniform_int_distribution<std::uint32_t> pick(0, 9), key(0, 1023);
      const std::uint32_t n = rank == 0 ? messages * 4 : messages;
      for (std::uint32_t i = 0; i < n; ++i) {
        const std::uint32_t bytes = pick(rng) == 0 ? large(rng) : small(rng);
        const std::uint32_t channel = key(rng) % channels;
        (*rec)->on_enqueue(channel, rank, bytes);
        while (!rings[channel]->try_push(Msg{rank, bytes})) std::this_thread::yield();
      }
      producers_left.fetch_sub(1, std::memory_order_release);
    });
  }
  threads.emplace_back([&] {
    std::vector<Msg> batch(64);
    while (true) {
      const bool done = producers_left.load(std::memory_order_acquire) == 0;
      std::size_t got_any = 0;
      for (std::uint32_t c = 0; c < channels; ++c) {
        const std::size_t n = rings[c]->try_pop_batch(batch.data(), batch.size());
        std::uint64_t bytes = 0;
        for (std::size_t i = 0; i < n; ++i) bytes += batch[i].bytes;
        if (n > 0) (*rec)->on_dequeue(c, n, bytes);
        got_any += n;
      }
      if (done && got_any == 0) break;
      if (got_any == 0) std::this_thread::yield();
    }
  });
  for (auto& t : threads) t.join();
  if (auto s = (*rec)->close(); !s) {
    std::fprintf(stderr, "record_ring_run: %s\n", s.error().to_string().c_str());
    return 1;
  }
  std::printf("record_ring_run: wrote %s\n", argv[1]);
  return 0;
}
