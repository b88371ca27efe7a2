// Shard: one thread that owns a ShardCore (a slice of the key space) and, on
// shard 0, the job-wide BarrierCore. Shared-nothing: the only way in is the
// shard's BlockingMpscRing, whose producers are the transport's I/O threads
// (one lane each, so a preempted I/O thread holds back only its own lane) and
// the server's control threads.
//
// The thread pops items in batches, hands each to the core, and sends what
// the core emits through the ReplySink the server supplies. Between batches it
// wakes for the loss-policy deadlines (worker_timeout) of its cores.
//
// Thread-safety: post() from any thread; everything else is the shard
// thread's, except stop()/join() from the owner. Snapshots and learning-rate
// changes are items like requests, so they are ordered with the traffic of
// the lane they came through.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "common/record/recorder.h"
#include "common/ring/blocking_mpsc_ring.h"
#include "server/barrier_core.h"
#include "server/shard_core.h"

namespace ember::server {

// Counts down to zero and runs `done` once, on the thread that reaches it.
struct Countdown {
  std::atomic<std::uint32_t> remaining;
  std::function<void()> done;
  Countdown(std::uint32_t n, std::function<void()> fn) : remaining(n), done(std::move(fn)) {}
  void arrive() {
    if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1 && done) done();
  }
};

// Collects the snapshots of every shard for one checkpoint.
struct SnapshotCollector {
  std::mutex mutex;
  std::condition_variable cv;
  std::uint32_t remaining = 0;
  std::vector<EntrySnapshot> entries;  // guarded by mutex
  double learning_rate = 0.0;
};

struct ShardItem {
  enum class Kind : std::uint8_t {
    kRequest,         // request + dims + payload
    kWorkerLost,      // rank
    kWorkerBack,      // rank
    kDropConnection,  // request.to.connection_id
    kSetLearningRate, // value, countdown
    kSnapshot,        // collector
    kSendRaw,         // raw (an encoded message) to request.to, through hooks.send_raw
    kSendReply,       // request.header with raw as its float32 data to request.to,
                      // through hooks.sink->reply (a large reply made on an I/O thread)
    kProbe,           // countdown: arrives when the shard thread takes it (liveness)
    kJoined,          // rank joined on request.to.connection_id (the barrier's shard
                      // only): request.header is server 0's join reply and raw its
                      // body; the shard sets the step (the rank's next barrier
                      // number) and sends it through hooks.send_raw
  };
  Kind kind = Kind::kRequest;
  std::uint32_t rank = 0;
  Request request;
  std::array<std::uint64_t, proto::kMaxDims> dims{};
  Payload payload;
  double value = 0.0;
  Departure departure = Departure::kLost;  // kWorkerLost
  // kWorkerLost/kWorkerBack: the rank's membership event number (the server
  // counts them per rank, in the order it decided them). Posted from
  // different I/O threads they may reach the shard in another order; the
  // shard skips an event older than the last it applied for the rank. 0:
  // not numbered (always applied).
  std::uint64_t membership_seq = 0;
  std::shared_ptr<Countdown> countdown;
  std::shared_ptr<SnapshotCollector> collector;
  std::vector<std::byte> raw;
  TimePoint received{};
  // kRequest with recording on: the message's bytes as counted by
  // Recorder::on_enqueue (header, dims and tensor bytes); 0 otherwise.
  std::uint64_t message_bytes = 0;
};

struct ShardOptions {
  std::uint32_t index = 0;
  CoreOptions core;
  bool has_barrier = false;  // shard 0 of server 0
  std::optional<std::uint32_t> cpu;  // pin the thread here
  std::size_t ring_slots = 1024;     // per producer lane
  std::size_t max_producers = 64;
  // The shard thread polls its ring this long before it sleeps
  // ([communication] busy_poll; ring::ParkOptions::busy_poll).
  std::chrono::nanoseconds busy_poll{0};
};

// What the shard needs from the server around it. Called on the shard thread.
struct ShardHooks {
  ReplySink* sink = nullptr;
  // After each request is handled: its type and how long it took since it
  // was received (for the latency histograms).
  std::function<void(proto::MsgType type, std::chrono::nanoseconds latency)> on_handled;
  // set_learning_rate refused by a shard (cannot happen when the I/O thread
  // validated it; kept for completeness).
  std::function<void(const Error&)> on_error;
  // Sends an already encoded message (replies made on I/O threads, which
  // must not wait for a channel's send lock).
  std::function<void(const ReplyTo& to, std::span<const std::byte> bytes)> send_raw;
  // After each batch of items: the sink flushes what this thread queued
  // (replies go out together, not one flush_interval later).
  std::function<void()> after_batch;
  // Communication pattern recording: on_dequeue(channel the request came
  // on, 1, item.message_bytes) after each request is handled. Null: off (one
  // branch). Not owned; must outlive the shard's thread.
  record::Recorder* recorder = nullptr;
};

class Shard {
 public:
  // Builds the shard and its ring; the thread starts in start(). Errors: the
  // ring's (kIo for the eventfd, kInvalidArgument for sizes).
  static Result<std::unique_ptr<Shard>> create(ShardOptions options, Optimizer optimizer,
                                               ShardHooks hooks);
  ~Shard();  // stop() + join()

  // Restores entries before start(). Errors: ShardCore::restore's.
  Status restore(EntrySnapshot snapshot) {
    Status s = core_.restore(std::move(snapshot));
    publish_stats();
    return s;
  }
  Status set_learning_rate(double lr) { return core_.set_learning_rate(lr); }

  void start();
  // True on the thread of any Shard (between start() and the thread's end).
  // Lets the server tell shard threads from transport I/O threads without
  // touching the transport, which shutdown destroys while shards drain.
  static bool on_shard_thread() noexcept;

  // Queues an item. Never blocks: when the caller's lane is full the item
  // goes to an overflow list (a mutex and a deque) that the shard drains
  // after the ring, and every item after it goes there too until the shard
  // has caught up, so each producer's order is kept. (Blocking an I/O thread
  // here could deadlock: the shard may itself be waiting for that thread to
  // drain a reply queue.) Any thread.
  void post(ShardItem&& item);

  // Handles `item` on the calling thread, in place of the shard thread, when
  // that keeps every producer's order and costs the shard thread nothing:
  // only if nothing is queued (ring and overflow list empty) and the shard
  // thread is not handling an item (the consumer lock is free; try-lock, so
  // this never waits). Returns true if it handled the item; false leaves
  // `item` untouched, for post(). The server's I/O threads use it for small
  // requests: the hand-off to the shard thread and its wake-up were most of a
  // 4 KiB round trip (server.cc, dispatch). The caller must not be able to
  // block on the shard thread while it handles (replies it sends must not
  // wait; an I/O thread's sends fail instead of waiting). Any thread.
  [[nodiscard]] bool try_handle_inline(ShardItem& item);

  // Asks the thread to finish: it handles every item already queued, then
  // exits. join() waits for that. After join() the core may be read from
  // the joining thread (snapshot for the final checkpoint).
  void stop();
  void join();
  const ShardCore& core() const { return core_; }

  std::size_t queued_approx() const noexcept { return ring_->size_approx(); }
  // Tensor chunks stored, as of the end of the shard's last batch (or the
  // last restore()). Any thread; for metrics.
  std::uint64_t num_entries_approx() const noexcept {
    return num_entries_.load(std::memory_order_relaxed);  // relaxed: a statistic, publishes nothing
  }
  // Copy-on-write updates of lent parameters (CoreStats::lent_copies), as of
  // the end of the shard's last batch. Any thread; for metrics.
  std::uint64_t lent_copies_approx() const noexcept {
    return lent_copies_.load(std::memory_order_relaxed);  // relaxed: a statistic
  }
  std::uint32_t index() const noexcept { return options_.index; }

 private:
  Shard(ShardOptions options, Optimizer optimizer, ShardHooks hooks,
        std::unique_ptr<ring::BlockingMpscRing<ShardItem>> ring);
  void run();
  void handle(ShardItem& item);
  // Whether a kWorkerLost/kWorkerBack item is newer than the rank's last
  // applied one (and records it).
  bool newest_membership_event(const ShardItem& item);
  // Handles the ring's backlog and then the overflow list; returns the
  // number of overflow items handled.
  std::size_t drain_overflow();
  // Copies the core's O(1) statistics into the atomics readers see. Shard
  // thread (or the owner before start()).
  void publish_stats() noexcept {
    num_entries_.store(core_.num_entries(), std::memory_order_relaxed);  // relaxed: as above
    lent_copies_.store(core_.lent_copies(), std::memory_order_relaxed);
  }

  ShardOptions options_;
  ShardHooks hooks_;
  ShardCore core_;
  std::optional<BarrierCore> barrier_;
  // Per rank: the newest membership_seq applied (ShardItem).
  std::vector<std::uint64_t> membership_seq_;
  std::unique_ptr<ring::BlockingMpscRing<ShardItem>> ring_;
  // The consumer lock: held while items are taken from the ring and the
  // overflow list and handled, by the shard thread or by try_handle_inline.
  // The core, the barrier and the ring's consumer side are touched only
  // under it.
  std::mutex consumer_mutex_;
  std::mutex overflow_mutex_;
  std::deque<ShardItem> overflow_;                 // guarded by overflow_mutex_
  std::atomic<std::size_t> overflow_count_{0};     // > 0: producers append to overflow_
  std::atomic<bool> stopping_{false};
  std::atomic<std::uint64_t> num_entries_{0};
  std::atomic<std::uint64_t> lent_copies_{0};
  std::thread thread_;
};

// The shard that owns (key, chunk) among `num_shards` (> 0): chunk 0 of a key
// goes to a shard picked by a hash of the key that is independent of the
// server and channel placement bits, and the key's chunks follow round-robin,
// so any num_shards consecutive chunks of a tensor land on distinct shards.
// Pure function; thread-safe.
std::uint32_t shard_of(std::uint64_t key, std::uint32_t chunk_index, std::uint32_t num_shards);

}  // namespace ember::server
