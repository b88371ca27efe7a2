// ember-bench-ring: Ember's MPSC ring against its peers, side by side.
//
// What runs: 1, 2 and 8 producer threads -> 1 consumer thread, 16-byte
// messages ({tag = producer << 56 | sequence, timestamp}), through
//   ember        BlockingMpscRing, lanes of --slots slots (default 1,024);
//                producers push batches of 32 (one tail publish per batch),
//                the consumer takes up to 256 per call (one head publish per
//                lane per call) and parks on its eventfd when idle
//   mutex        unbounded std::mutex + std::condition_variable +
//                std::deque ("std channel"): one lock + notify_one per
//                message; the consumer pops up to 256 per lock
//   moodycamel   moodycamel::ConcurrentQueue, per-message enqueue with a
//                ProducerToken (its fast path), try_dequeue_bulk(256)
//   moodycamel_bulk  same with enqueue_bulk of 32 (batching on both sides,
//                like ember; reported for an even comparison)
//   boost        boost::lockfree::queue, per-message push and pop
// Peers without a blocking wait (moodycamel, boost) make the consumer yield
// when it finds the queue empty; producers of the bounded ember ring wait
// for space when their lane is full (wait_for_space: spin, yield, then sleep
// on the lane's futex until the consumer has freed half the lane).
//
// Throughput: messages per ms from the start barrier until the consumer has
// received every message; the median over --reps repetitions, interleaved
// (rep 1 of every queue and producer count, then rep 2, ...), so drift in
// the machine's load hits every queue alike. A calibration pass first sizes
// each queue's runs to about --run-ms (a fixed count would give the fast
// queues runs of a few ms, shorter than a scheduler time slice).
// Latency: every 64th message carries the steady_clock time taken just
// before the push call that accepted it; the consumer reads the clock once
// per received batch holding samples. p50/p99 per run, median over reps. A
// clock read costs 30-60 ns here, so sampling keeps it off the rate.
// Order: the consumer checks each producer's sequence (no loss, no
// duplicate, FIFO per producer) for every queue.
//
// Stall case: 8 producers; producer 0 sleeps 1 ms inside its push (after
// writing its items, before publishing them: MpscRing's Hooks policy) 100
// times. Reported: messages of the other 7 producers consumed during those
// stalls (total and the smallest count of any one stall). For contrast, the
// mutex queue with the same 1 ms sleep inside its critical section.
//
// The benchmark never fails on timing; it prints a table and ends with one
// line `SUMMARY key=value ...` (ratios ember/peer, ember's latency, stalls).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <latch>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <boost/lockfree/queue.hpp>
#include <concurrentqueue/concurrentqueue.h>  // see CMakeLists.txt on its warnings
#include <fmt/format.h>

#include "common/ring/blocking_mpsc_ring.h"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct Msg {
  std::uint64_t tag;    // producer << 56 | sequence
  std::uint64_t ts_ns;  // steady_clock ns at push, on sampled messages; 0 otherwise
};
static_assert(sizeof(Msg) == 16);

constexpr std::uint64_t kSampleEvery = 64;
constexpr std::size_t kProducerBatch = 32;
constexpr std::size_t kConsumerBatch = 256;
constexpr std::uint64_t kSeqMask = (std::uint64_t{1} << 56) - 1;

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
          .count());
}

Msg make_msg(std::uint32_t producer, std::uint64_t seq) {
  return Msg{std::uint64_t{producer} << 56 | seq, 0};
}
bool sampled(const Msg& m) { return (m.tag & kSeqMask) % kSampleEvery == 0; }

// Consumer-side accounting: order per producer, count, latency samples.
class Sink {
 public:
  explicit Sink(std::size_t producers, std::uint64_t expected)
      : next_(producers, 0) {
    latencies_ns_.reserve(expected / kSampleEvery + 16);
  }
  void accept(const Msg& m) {
    const std::size_t p = static_cast<std::size_t>(m.tag >> 56);
    const std::uint64_t seq = m.tag & kSeqMask;
    if (p >= next_.size() || seq != next_[p]) {
      order_ok_ = false;
    } else {
      ++next_[p];
    }
    ++received_;
    if (p != 0) ++received_others_;
    if (m.ts_ns != 0 && num_pending_ < kConsumerBatch) pending_ts_[num_pending_++] = m.ts_ns;
  }
  // Call after each received batch: one clock read for its samples.
  void end_batch() {
    if (num_pending_ == 0) return;
    const std::uint64_t now = now_ns();
    for (std::size_t i = 0; i < num_pending_; ++i) latencies_ns_.push_back(now - pending_ts_[i]);
    num_pending_ = 0;
  }
  std::uint64_t received() const { return received_; }
  std::uint64_t received_others() const { return received_others_; }
  bool order_ok() const { return order_ok_; }
  std::vector<std::uint64_t>& latencies_ns() { return latencies_ns_; }

 private:
  std::vector<std::uint64_t> next_;
  std::uint64_t received_ = 0;
  std::uint64_t received_others_ = 0;
  bool order_ok_ = true;
  std::uint64_t pending_ts_[kConsumerBatch]{};
  std::size_t num_pending_ = 0;
  std::vector<std::uint64_t> latencies_ns_;
};

// Producer loop for per-message queues: stamp, then push.
template <typename PushOne>
void produce_single(std::uint32_t p, std::uint64_t count, PushOne&& push_one) {
  for (std::uint64_t seq = 0; seq < count; ++seq) {
    Msg m = make_msg(p, seq);
    if (seq % kSampleEvery == 0) m.ts_ns = now_ns();
    push_one(m);
  }
}

// Producer loop for batch queues: fill a batch, stamp its samples just
// before each push attempt, push until all of it is in. try_push_batch
// returns how many it took; `on_full` runs when it took none.
template <typename TryPushBatch, typename OnFull>
void produce_batches(std::uint32_t p, std::uint64_t count, TryPushBatch&& try_push_batch,
                     OnFull&& on_full, const std::atomic<bool>* stop = nullptr) {
  Msg batch[kProducerBatch];
  for (std::uint64_t seq = 0; seq < count; seq += kProducerBatch) {
    if (stop != nullptr && stop->load(std::memory_order_relaxed)) return;  // flag only
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kProducerBatch, count - seq));
    for (std::size_t i = 0; i < n; ++i) batch[i] = make_msg(p, seq + i);
    std::size_t done = 0;
    while (done < n) {
      std::uint64_t stamp = 0;  // one clock read per attempt, only if it carries a sample
      for (std::size_t i = done; i < n; ++i) {
        if (sampled(batch[i])) batch[i].ts_ns = stamp != 0 ? stamp : (stamp = now_ns());
      }
      const std::size_t k = try_push_batch(batch + done, n - done);
      done += k;
      if (k == 0) on_full();
    }
  }
}

// ---------------------------------------------------------------- queues ---

// Ember: BlockingMpscRing with per-producer lanes, batching on both sides.
template <typename Hooks = ember::ring::NoPushHooks>
class EmberQueue {
 public:
  using Ring = ember::ring::BlockingMpscRing<Msg, Hooks>;
  EmberQueue(std::size_t producers, std::size_t slots)
      : ring_(Ring::create({.lane_capacity = slots, .max_producers = producers}).value()) {}
  static const char* name() { return "ember"; }

  void produce(std::uint32_t p, std::uint64_t count, std::latch& start,
               const std::atomic<bool>* stop = nullptr) {
    auto producer = ring_->make_producer().value();
    start.arrive_and_wait();
    produce_batches(
        p, count, [&](Msg* items, std::size_t n) { return producer.try_push_batch(items, n); },
        [&] { (void)producer.wait_for_space(1s); }, stop);
  }
  // Calls fn(push) on this thread with a producer lane; push(items, n)
  // pushes all n, yielding while the lane is full.
  template <typename Fn>
  void with_pusher(Fn&& fn) {
    auto producer = ring_->make_producer().value();
    fn([&](Msg* items, std::size_t n) {
      std::size_t done = 0;
      while (done < n) done += producer.push_batch_wait(items + done, n - done, 1s);
    });
  }
  void consume(Sink& sink) {
    ring_->consume_wait([&](Msg& m) { sink.accept(m); }, kConsumerBatch, 50ms);
    sink.end_batch();
  }
  bool empty() const { return ring_->empty_approx(); }

 private:
  std::unique_ptr<Ring> ring_;
};

// The "std channel": unbounded, one lock per message. With kStallable, a
// producer whose thread-local stall flag is armed sleeps 1 ms while holding
// the lock (the stall-case contrast).
struct NoStall {
  static void in_critical_section() noexcept {}
};

template <typename Stall = NoStall>
class MutexQueue {
 public:
  MutexQueue(std::size_t, std::size_t) {}
  static const char* name() { return "mutex"; }

  void push(const Msg& m) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(m);
      Stall::in_critical_section();
    }
    ready_.notify_one();
  }
  void produce(std::uint32_t p, std::uint64_t count, std::latch& start,
               const std::atomic<bool>* stop = nullptr) {
    start.arrive_and_wait();
    if (stop == nullptr) {
      produce_single(p, count, [&](const Msg& m) { push(m); });
    } else {
      produce_batches(
          p, count,
          [&](Msg* items, std::size_t n) {
            for (std::size_t i = 0; i < n; ++i) push(items[i]);
            return n;
          },
          [] {}, stop);
    }
  }
  template <typename Fn>
  void with_pusher(Fn&& fn) {
    fn([&](Msg* items, std::size_t n) {
      for (std::size_t i = 0; i < n; ++i) push(items[i]);
    });
  }
  void consume(Sink& sink) {
    Msg local[kConsumerBatch];
    std::size_t n = 0;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait_for(lock, 50ms, [&] { return !queue_.empty(); });
      while (n < kConsumerBatch && !queue_.empty()) {
        local[n++] = queue_.front();
        queue_.pop_front();
      }
    }
    for (std::size_t i = 0; i < n; ++i) sink.accept(local[i]);
    sink.end_batch();
  }
  bool empty() {
    std::lock_guard<std::mutex> lock(mutex_);
    return queue_.empty();
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Msg> queue_;
};

template <bool kBulk>
class MoodycamelQueue {
 public:
  MoodycamelQueue(std::size_t, std::size_t) : queue_(64 * 1024), consumer_token_(queue_) {}
  static const char* name() { return kBulk ? "moodycamel_bulk" : "moodycamel"; }

  void produce(std::uint32_t p, std::uint64_t count, std::latch& start,
               const std::atomic<bool>* = nullptr) {
    moodycamel::ProducerToken token(queue_);
    start.arrive_and_wait();
    if constexpr (kBulk) {
      produce_batches(
          p, count,
          [&](Msg* items, std::size_t n) { return queue_.enqueue_bulk(token, items, n) ? n : 0; },
          [] { std::this_thread::yield(); });
    } else {
      produce_single(p, count, [&](const Msg& m) {
        while (!queue_.enqueue(token, m)) std::this_thread::yield();
      });
    }
  }
  void consume(Sink& sink) {
    Msg local[kConsumerBatch];
    const std::size_t n = queue_.try_dequeue_bulk(consumer_token_, local, kConsumerBatch);
    if (n == 0) {
      std::this_thread::yield();
      return;
    }
    for (std::size_t i = 0; i < n; ++i) sink.accept(local[i]);
    sink.end_batch();
  }

 private:
  moodycamel::ConcurrentQueue<Msg> queue_;
  moodycamel::ConsumerToken consumer_token_;
};

class BoostQueue {
 public:
  BoostQueue(std::size_t, std::size_t) : queue_(64 * 1024) {}
  static const char* name() { return "boost"; }

  void produce(std::uint32_t p, std::uint64_t count, std::latch& start,
               const std::atomic<bool>* = nullptr) {
    start.arrive_and_wait();
    produce_single(p, count, [&](const Msg& m) {
      while (!queue_.push(m)) std::this_thread::yield();
    });
  }
  void consume(Sink& sink) {
    Msg local[kConsumerBatch];
    std::size_t n = 0;
    while (n < kConsumerBatch && queue_.pop(local[n])) ++n;
    if (n == 0) {
      std::this_thread::yield();
      return;
    }
    for (std::size_t i = 0; i < n; ++i) sink.accept(local[i]);
    sink.end_batch();
  }

 private:
  boost::lockfree::queue<Msg> queue_;
};

// ------------------------------------------------------------------ runs ---

struct RunResult {
  double msgs_per_ms = 0;
  double p50_us = 0;
  double p99_us = 0;
  bool order_ok = true;
};

double percentile_us(std::vector<std::uint64_t>& v, double q) {
  if (v.empty()) return 0;
  const std::size_t k = std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return static_cast<double>(v[k]) / 1000.0;
}

template <typename Queue>
RunResult run_once(std::size_t producers, std::uint64_t total, std::size_t slots) {
  Queue queue(producers, slots);
  const std::uint64_t per_producer = total / producers;
  const std::uint64_t expected = per_producer * producers;
  Sink sink(producers, expected);
  std::latch start(static_cast<std::ptrdiff_t>(producers + 1));
  std::vector<std::thread> threads;
  for (std::size_t p = 0; p < producers; ++p) {
    threads.emplace_back([&, p] { queue.produce(static_cast<std::uint32_t>(p), per_producer, start); });
  }
  start.arrive_and_wait();
  const auto t0 = Clock::now();
  while (sink.received() < expected) queue.consume(sink);
  const auto t1 = Clock::now();
  for (auto& t : threads) t.join();
  RunResult r;
  const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  r.msgs_per_ms = static_cast<double>(expected) / ms;
  r.p50_us = percentile_us(sink.latencies_ns(), 0.50);
  r.p99_us = percentile_us(sink.latencies_ns(), 0.99);
  r.order_ok = sink.order_ok() && sink.received() == expected;
  return r;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct Series {
  std::string queue;
  std::size_t producers;
  std::uint64_t messages;  // per run, calibrated
  std::vector<double> rate, p50, p99;
  bool order_ok = true;
  double rate_median() const { return median(rate); }
};

// ----------------------------------------------------------------- stalls ---

// The stalling producer arms its thread-local flag before a push; the hook
// then sleeps 1 ms inside that push and records how many messages of the
// other producers the consumer took meanwhile.
struct StallState {
  std::atomic<std::uint64_t> consumed_others{0};  // written by the consumer only
  std::vector<std::uint64_t> per_stall;           // written by the stalling producer only
  double stalled_ms = 0;
};
StallState g_stall;
thread_local bool t_stall_armed = false;

void stall_now() {
  // relaxed: a progress counter; the 1 ms sleep dwarfs any staleness.
  const std::uint64_t before = g_stall.consumed_others.load(std::memory_order_relaxed);
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(1ms);
  g_stall.stalled_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  g_stall.per_stall.push_back(g_stall.consumed_others.load(std::memory_order_relaxed) - before);
}

struct StallHooks {
  static void before_publish() noexcept {
    if (t_stall_armed) {
      t_stall_armed = false;
      stall_now();
    }
  }
};
struct StallInLock {
  static void in_critical_section() noexcept { StallHooks::before_publish(); }
};

struct StallResult {
  std::uint64_t consumed_total = 0;
  std::uint64_t consumed_min = 0;
  std::size_t stalls = 0;
  double stalled_ms = 0;
  bool order_ok = true;
};

template <typename Queue>
StallResult run_stall_case(std::size_t slots, int num_stalls) {
  constexpr std::size_t kProducers = 8;
  g_stall.consumed_others.store(0);
  g_stall.per_stall.clear();
  g_stall.stalled_ms = 0;
  Queue queue(kProducers, slots);
  std::atomic<bool> stop{false};
  std::atomic<std::size_t> producers_done{0};
  std::latch start(kProducers + 1);
  Sink sink(kProducers, 1 << 20);
  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    // Producer 0: 64 batches (2,048 messages) between stalls, then a
    // stalled push.
    queue.with_pusher([&](auto&& push) {
      std::uint64_t seq = 0;
      Msg batch[kProducerBatch];
      auto push_next_batch = [&] {
        for (std::size_t i = 0; i < kProducerBatch; ++i) batch[i] = make_msg(0, seq++);
        push(batch, kProducerBatch);
      };
      start.arrive_and_wait();
      for (int s = 0; s < num_stalls; ++s) {
        for (int i = 0; i < 64; ++i) push_next_batch();
        t_stall_armed = true;
        push_next_batch();
      }
    });
    stop = true;
    producers_done.fetch_add(1);
  });
  for (std::size_t p = 1; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      queue.produce(static_cast<std::uint32_t>(p), std::numeric_limits<std::uint32_t>::max(), start,
                    &stop);
      producers_done.fetch_add(1);
    });
  }
  start.arrive_and_wait();
  while (!(producers_done.load() == kProducers && queue.empty())) {
    queue.consume(sink);
    // relaxed: read by the stalling producer as a progress counter.
    g_stall.consumed_others.store(sink.received_others(), std::memory_order_relaxed);
  }
  for (auto& t : threads) t.join();
  StallResult r;
  r.stalls = g_stall.per_stall.size();
  for (std::uint64_t n : g_stall.per_stall) r.consumed_total += n;
  r.consumed_min = g_stall.per_stall.empty()
                       ? 0
                       : *std::min_element(g_stall.per_stall.begin(), g_stall.per_stall.end());
  r.stalled_ms = g_stall.stalled_ms;
  r.order_ok = sink.order_ok();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ember-bench-ring: Ember's MPSC ring vs the mutex queue, moodycamel and "
               "boost::lockfree, 1/2/8 producers -> 1 consumer, 16-byte messages"};
  double run_ms = 120;
  int reps = 5;
  std::size_t slots = 1024;
  int stalls = 100;
  app.add_option("--run-ms", run_ms,
                 "target duration of one run; each queue's message count is calibrated to it")
      ->capture_default_str();
  app.add_option("--reps", reps, "interleaved repetitions (median reported)")->capture_default_str();
  app.add_option("--slots", slots, "ember lane capacity in slots (power of two)")
      ->capture_default_str();
  app.add_option("--stalls", stalls, "1 ms stalls in the stall case")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (auto ok = ember::ring::MpscRing<Msg>::validate({.lane_capacity = slots, .max_producers = 8});
      !ok) {
    std::fprintf(stderr, "ember-bench-ring: --slots: %s\n", ok.error().to_string().c_str());
    return 2;
  }

  struct Contender {
    const char* name;
    RunResult (*run)(std::size_t producers, std::uint64_t messages, std::size_t slots);
  };
  const std::vector<Contender> contenders{
      {EmberQueue<>::name(), &run_once<EmberQueue<>>},
      {MutexQueue<>::name(), &run_once<MutexQueue<>>},
      {MoodycamelQueue<false>::name(), &run_once<MoodycamelQueue<false>>},
      {MoodycamelQueue<true>::name(), &run_once<MoodycamelQueue<true>>},
      {BoostQueue::name(), &run_once<BoostQueue>},
  };
  const std::vector<std::size_t> producer_counts{1, 2, 8};
  std::vector<Series> series;
  auto series_for = [&](const std::string& queue, std::size_t producers) -> Series& {
    for (Series& s : series) {
      if (s.queue == queue && s.producers == producers) return s;
    }
    series.push_back(Series{queue, producers, 0, {}, {}, {}, true});
    return series.back();
  };
  const auto bench_start = Clock::now();
  std::fprintf(stderr, "ember-bench-ring: ~%.0f ms per run, %d reps, %zu slots per ember lane\n",
               run_ms, reps, slots);
  // Calibration (not recorded): size each run to about run_ms.
  // Bounds keep a noisy calibration from producing runs of a few ms or of
  // seconds. The minimum matters for the unbounded queues: on a short run
  // their producers can push everything within one scheduler time slice
  // while the consumer waits for a core, and the run then measures only the
  // consumer draining a full queue alone.
  constexpr std::uint64_t kCalibrationMessages = std::uint64_t{1} << 19;
  constexpr std::uint64_t kMinMessages = std::uint64_t{1} << 20;
  constexpr std::uint64_t kMaxMessages = std::uint64_t{1} << 23;
  for (std::size_t producers : producer_counts) {
    for (const Contender& c : contenders) {
      const RunResult r = c.run(producers, kCalibrationMessages, slots);
      const double wanted = r.msgs_per_ms * run_ms;
      std::uint64_t messages = static_cast<std::uint64_t>(
          std::clamp(wanted, static_cast<double>(kMinMessages), static_cast<double>(kMaxMessages)));
      messages = (messages + 255) / 256 * 256;
      series_for(c.name, producers).messages = messages;
    }
  }
  for (int rep = 0; rep < reps; ++rep) {
    for (std::size_t producers : producer_counts) {
      for (const Contender& c : contenders) {
        Series& s = series_for(c.name, producers);
        const RunResult r = c.run(producers, s.messages, slots);
        s.rate.push_back(r.msgs_per_ms);
        s.p50.push_back(r.p50_us);
        s.p99.push_back(r.p99_us);
        s.order_ok = s.order_ok && r.order_ok;
      }
    }
    std::fprintf(stderr, "  rep %d/%d done (%.1f s)\n", rep + 1, reps,
                 std::chrono::duration<double>(Clock::now() - bench_start).count());
  }

  std::printf("\nThroughput and push->pop latency (median of %d interleaved reps; every %llu-th "
              "message timed)\n",
              reps, static_cast<unsigned long long>(kSampleEvery));
  std::printf("%-16s %9s %10s %12s %12s %12s %10s %10s %7s\n", "queue", "producers",
              "msgs/run", "msgs/ms", "min", "max", "p50 us", "p99 us", "order");
  for (std::size_t producers : producer_counts) {
    for (const Series& s : series) {
      if (s.producers != producers) continue;
      std::printf("%-16s %9zu %10llu %12.0f %12.0f %12.0f %10.1f %10.1f %7s\n", s.queue.c_str(),
                  s.producers, static_cast<unsigned long long>(s.messages), s.rate_median(),
                  *std::min_element(s.rate.begin(), s.rate.end()),
                  *std::max_element(s.rate.begin(), s.rate.end()), median(s.p50), median(s.p99),
                  s.order_ok ? "ok" : "BROKEN");
    }
  }
  auto ratio = [&](const char* peer, std::size_t producers) {
    const double peer_rate = series_for(peer, producers).rate_median();
    return peer_rate > 0 ? series_for("ember", producers).rate_median() / peer_rate : 0.0;
  };
  std::printf("\nember / peer throughput\n%-16s", "producers");
  for (std::size_t producers : producer_counts) std::printf(" %8zu", producers);
  std::printf("\n");
  for (const char* peer : {"mutex", "moodycamel", "moodycamel_bulk", "boost"}) {
    std::printf("%-16s", peer);
    for (std::size_t producers : producer_counts) std::printf(" %7.2fx", ratio(peer, producers));
    std::printf("\n");
  }

  const StallResult ember_stall = run_stall_case<EmberQueue<StallHooks>>(slots, stalls);
  const StallResult mutex_stall = run_stall_case<MutexQueue<StallInLock>>(slots, stalls);
  std::printf("\nStall case: 8 producers, producer 0 sleeps 1 ms inside its push, %d times\n",
              stalls);
  std::printf("%-16s %8s %12s %22s %20s %7s\n", "queue", "stalls", "stalled ms",
              "others consumed total", "min in one stall", "order");
  for (const auto& [name, r] : {std::pair{"ember", ember_stall}, std::pair{"mutex", mutex_stall}}) {
    std::printf("%-16s %8zu %12.1f %22llu %20llu %7s\n", name, r.stalls, r.stalled_ms,
                static_cast<unsigned long long>(r.consumed_total),
                static_cast<unsigned long long>(r.consumed_min), r.order_ok ? "ok" : "BROKEN");
  }

  const Series& ember8 = series_for("ember", 8);
  bool all_ordered = ember_stall.order_ok && mutex_stall.order_ok;
  for (const Series& s : series) all_ordered = all_ordered && s.order_ok;
  std::printf("\ntargets (8 producers): >= 5.7x mutex, >= 2x moodycamel, p99 <= 150 us at %zu "
              "slots; total time %.1f s\n",
              slots, std::chrono::duration<double>(Clock::now() - bench_start).count());
  std::printf(
      "SUMMARY p1_vs_mutex=%.2f p2_vs_mutex=%.2f p8_vs_mutex=%.2f p8_vs_moodycamel=%.2f "
      "p8_vs_moodycamel_bulk=%.2f p8_vs_boost=%.2f p50_us=%.1f p99_us=%.1f slots=%zu "
      "stall_consumed=%llu stall_min=%llu mutex_stall_consumed=%llu order_ok=%d\n",
      ratio("mutex", 1), ratio("mutex", 2), ratio("mutex", 8), ratio("moodycamel", 8),
      ratio("moodycamel_bulk", 8), ratio("boost", 8), median(ember8.p50), median(ember8.p99),
      slots, static_cast<unsigned long long>(ember_stall.consumed_total),
      static_cast<unsigned long long>(ember_stall.consumed_min),
      static_cast<unsigned long long>(mutex_stall.consumed_total), all_ordered ? 1 : 0);
  return 0;
}
