// The worker client: request issue, reply matching, reconnects, timeouts and
// the pipeline scope. Semantics in worker.h.
#include "worker/worker.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <queue>
#include <set>
#include <shared_mutex>
#include <thread>

#include <unistd.h>
#include <unordered_map>
#include <utility>

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/base/logging.h"
#include "common/base/sync_point.h"
#include "common/base/units.h"
#include "common/memory/page_pool.h"
#include "common/placement/placement.h"
#include "common/proto/message.h"
#include "common/proto/runtime.h"
#include "common/record/recorder.h"
#include "common/ring/mpsc_ring.h"
#include "common/transport/transport.h"
#include "worker/tcp_probe.h"

namespace ember {

using worker_detail::Op;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// TensorBuffer

TensorBuffer::TensorBuffer(TensorBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      pool_(std::exchange(o.pool_, nullptr)),
      block_offset_(o.block_offset_),
      num_blocks_(o.num_blocks_) {}

TensorBuffer& TensorBuffer::operator=(TensorBuffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    pool_ = std::exchange(o.pool_, nullptr);
    block_offset_ = o.block_offset_;
    num_blocks_ = o.num_blocks_;
  }
  return *this;
}

TensorBuffer::~TensorBuffer() { release(); }

void TensorBuffer::release() noexcept {
  if (data_ == nullptr) return;
  if (pool_ != nullptr) {
    for (std::uint32_t i = 0; i < num_blocks_; ++i) {
      const std::uint64_t offset = block_offset_ + std::uint64_t{i} * memory::kMaxBlockBytes;
      const std::size_t piece = num_blocks_ == 1 ? size_ : memory::kMaxBlockBytes;
      if (auto block = pool_->block_at(offset, piece)) pool_->free(*block);
    }
  } else {
    std::free(data_);
  }
  data_ = nullptr;
  size_ = 0;
  pool_ = nullptr;
}

// ---------------------------------------------------------------------------
// Impl

namespace {

constexpr std::uint32_t kPendingShards = 16;

// A server's error text as the caller and the log get it: control bytes
// (a NUL would end it early for a C caller of ember_last_error) as \xNN.
std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      out += fmt::format("\\x{:02x}", u);
    } else {
      out += c;
    }
  }
  return out;
}

// A write window a request holds (shm, in place: the server writes the
// reply's parameters straight into the caller's destination through it).
// The operation counts it as a send in flight (Op::send_started), so it is
// not done while the server may still write; destroying the lease closes the
// window (transport::Connection::close_write_window: from then on a late
// reply writes nothing) and ends that count. Move-only.
class WindowLease {
 public:
  WindowLease() = default;
  WindowLease(std::shared_ptr<transport::Connection> conn, std::uint32_t id, std::shared_ptr<Op> op)
      : conn_(std::move(conn)), id_(id), op_(std::move(op)) {
    op_->send_started();
  }
  WindowLease(WindowLease&& o) noexcept
      : conn_(std::move(o.conn_)), id_(std::exchange(o.id_, 0)), op_(std::move(o.op_)) {}
  WindowLease& operator=(WindowLease&& o) noexcept {
    if (this != &o) {
      reset();
      conn_ = std::move(o.conn_);
      id_ = std::exchange(o.id_, 0);
      op_ = std::move(o.op_);
    }
    return *this;
  }
  WindowLease(const WindowLease&) = delete;
  WindowLease& operator=(const WindowLease&) = delete;
  ~WindowLease() { reset(); }
  bool open() const noexcept { return id_ != 0; }
  void reset() noexcept {
    if (id_ == 0) return;
    conn_->close_write_window(std::exchange(id_, 0));
    conn_.reset();
    std::shared_ptr<Op> op = std::move(op_);
    op->send_finished();
  }

 private:
  std::shared_ptr<transport::Connection> conn_;
  std::uint32_t id_ = 0;
  std::shared_ptr<Op> op_;
};

struct PendingReq {
  std::shared_ptr<Op> op;
  proto::MsgType type = proto::MsgType::kPush;
  std::byte* dest = nullptr;  // pull / push_pull destination of this chunk; join body
  std::uint64_t dest_bytes = 0;
  bool in_place = false;  // sent with a proto::ReplyPlacement for `dest`
  WindowLease window;     // in place: the write window the placement names
  std::uint32_t server = 0;
  std::uint64_t conn_gen = 0;
  // What a re-send after a lost connection needs: the request as issued
  // (same request id, key, chunk and step), its channel, its tensor bytes
  // (the caller's memory, valid until the operation is done) and how often
  // it was re-sent so far.
  proto::Header header;
  std::array<std::uint64_t, proto::kMaxDims> dims{};
  std::span<const std::byte> data;
  std::shared_ptr<const std::vector<std::byte>> owned_data;  // backs `data` when the caller's
                                                             // bytes do not outlive the call
  std::uint32_t channel = 0;
  std::uint32_t resends = 0;
};

// Above any step a server names (a server that does breaks the protocol).
using proto::kLargestStep;

// The numbers of a worker's barriers (server 0's BarrierCore tells a re-sent
// barrier from the next one by them). Failed barriers (timed out, lost,
// refused) give their numbers back once no later one is outstanding, as a
// failed push gives its step back: the caller's retries are the same
// barriers to server 0 (which replaces one still waiting, or answers one
// that completed meanwhile again), not the next ones, which would leave this
// worker barriers ahead of the others for good. The worker's timer fails
// operations in deadline order, so of barriers A < B both timed out, A fails
// first, while B still holds the top number: A is remembered and given back
// with B. Thread-safe.
class BarrierNumbering {
 public:
  // The first call sets the next number (server 0's first join reply);
  // later calls (rejoins) change nothing.
  void seed_once(std::uint64_t next) {
    std::lock_guard lock(mu_);
    if (seeded_) return;
    seeded_ = true;
    next_ = next;
  }
  std::uint64_t take() {
    std::lock_guard lock(mu_);
    return next_++;
  }
  void failed(std::uint64_t n) {
    std::lock_guard lock(mu_);
    failed_.insert(n);
    while (next_ > 0 && failed_.erase(next_ - 1) == 1) --next_;
  }
  // Answered: every barrier numbered before it was answered too (server 0
  // answers a rank's barriers in number order), so those that failed here
  // (timed out just before their answer) have nothing to give back.
  void succeeded(std::uint64_t n) {
    std::lock_guard lock(mu_);
    failed_.erase(failed_.begin(), failed_.upper_bound(n));
  }

 private:
  std::mutex mu_;
  bool seeded_ = false;
  std::uint64_t next_ = 0;
  std::set<std::uint64_t> failed_;
};

// How often at most the timer thread sweeps the requests of failed
// operations out of the pending table (PendingTable::take_failed).
constexpr std::chrono::milliseconds kFailedSweepInterval{500};

// request id → waiting request, sharded to keep I/O and app threads apart.
class PendingTable {
 public:
  void insert(std::uint64_t id, PendingReq req) {
    Shard& s = shard(id);
    std::lock_guard lock(s.mutex);
    s.map.emplace(id, std::move(req));
  }
  std::optional<PendingReq> take(std::uint64_t id) {
    bool elsewhere = false;
    return take_reply(id, std::nullopt, &elsewhere);
  }
  // The request `id` sent to `server` (any server: nullopt); nullopt when
  // there is none (and `*elsewhere` = whether `id` waits on another server:
  // left there).
  std::optional<PendingReq> take_reply(std::uint64_t id, std::optional<std::uint32_t> server,
                                       bool* elsewhere) {
    Shard& s = shard(id);
    std::lock_guard lock(s.mutex);
    auto it = s.map.find(id);
    *elsewhere = it != s.map.end() && server && it->second.server != *server;
    if (it == s.map.end() || *elsewhere) return std::nullopt;
    PendingReq r = std::move(it->second);
    s.map.erase(it);
    return r;
  }
  // Removes the requests of `op` that hold a write window (in place).
  std::vector<PendingReq> take_windows_of(const Op* op) {
    return take_if([op](const PendingReq& r) { return r.op.get() == op && r.window.open(); });
  }
  // Removes the requests whose operation has failed (timed out, a sibling
  // chunk's error) and that hold no open write window: a late reply to one
  // is dropped as unknown, as it would be ignored anyway. Returns them, to
  // be destroyed outside the locks.
  std::vector<PendingReq> take_failed() {
    return take_if([](const PendingReq& r) { return r.op->failed() && !r.window.open(); });
  }
  std::size_t size() {
    std::size_t n = 0;
    for (Shard& s : shards_) {
      std::lock_guard lock(s.mutex);
      n += s.map.size();
    }
    return n;
  }
  // Removes every request sent to `server` over connection generation `gen`.
  std::vector<PendingReq> take_connection(std::uint32_t server, std::uint64_t gen) {
    return take_if([=](const PendingReq& r) { return r.server == server && r.conn_gen == gen; });
  }

 private:
  struct Shard {
    std::mutex mutex;
    std::unordered_map<std::uint64_t, PendingReq> map;
  };
  Shard& shard(std::uint64_t id) { return shards_[id % kPendingShards]; }
  // Removes (and returns) every request `pred` holds for, shard by shard.
  template <typename Pred>
  std::vector<PendingReq> take_if(Pred pred) {
    std::vector<PendingReq> out;
    for (Shard& s : shards_) {
      std::lock_guard lock(s.mutex);
      for (auto it = s.map.begin(); it != s.map.end();) {
        if (pred(it->second)) {
          out.push_back(std::move(it->second));
          it = s.map.erase(it);
        } else {
          ++it;
        }
      }
    }
    return out;
  }
  std::array<Shard, kPendingShards> shards_;
};

struct KeyState {
  std::vector<std::uint64_t> shape;
  std::uint64_t num_elements = 0;
  std::vector<placement::Chunk> chunks;
  std::string servers;  // the chunks' servers, for error texts: "0, 2"
  std::atomic<std::uint64_t> next_step{0};
  // Pushes (and push_pulls) of this key issued and not yet done: queued in a
  // pipeline, in flight, or waiting for a reply. A pull refused out of step
  // while some are unanswered overtook this worker's own pushes (a direct
  // pull beside an unflushed pipeline): its step is not reset then.
  std::atomic<std::uint32_t> pushes_unanswered{0};
  // Its init: kInitPending while in flight, kInitDone once one succeeded,
  // kInitFailed when it failed before any did. A failed key is not this
  // worker's: pushes and pulls of it are refused (not sent with a layout the
  // servers refused), and the next init starts over, with any shape.
  static constexpr int kInitPending = 0, kInitDone = 1, kInitFailed = 2;
  std::atomic<int> init_state{kInitPending};
  // Held from taking a request's step until its chunks are handed to their
  // channels, so that requests of this key leave in step order whichever
  // threads issue them (a channel delivers in the order of send()). Waited
  // for at most request_timeout (the holder may be reconnecting). A flag
  // under a mutex and a condition variable rather than a timed_mutex:
  // ThreadSanitizer does not see pthread_mutex_clocklock take the lock.
  struct IssueGate {
    std::mutex mutex;
    std::condition_variable released;
    bool held = false;  // under mutex

    // Takes the gate, waiting until `deadline`; false if it is still held.
    bool enter(Clock::time_point deadline) {
      std::unique_lock lock(mutex);
      if (!released.wait_until(lock, deadline, [this] { return !held; })) return false;
      held = true;
      return true;
    }
    void leave() {
      {
        std::lock_guard lock(mutex);
        held = false;
      }
      released.notify_one();
    }
  };
  IssueGate issue_gate;
  // Under issue_gate: the thread (issuing_thread_token()) whose pipelined
  // request of this key went last into a channel ring, where it may still
  // be; 0 for none. A request from another thread or a direct one first
  // flushes those rings: a ring's per-thread lanes keep no order between
  // threads.
  std::uint64_t queued_by = 0;
};

// A number per thread, never reused (std::thread::id values are, and a new
// thread with a finished one's id gets another ring lane).
std::uint64_t issuing_thread_token() {
  static std::atomic<std::uint64_t> next{1};
  thread_local const std::uint64_t token = next.fetch_add(1, std::memory_order_relaxed);
  return token;
}

// One request ready to go to a server channel.
struct Outgoing {
  std::uint32_t server = 0;
  std::uint32_t channel = 0;
  proto::Header header;
  std::array<std::uint64_t, proto::kMaxDims> dims{};
  std::span<const std::byte> data;  // tensor bytes to send (push, init)
  std::shared_ptr<Op> op;
  PendingReq pending;  // what to register under header.request_id
  std::uint64_t join_gen = 0;  // kJoin: the connection generation it goes out on
  // A re-send: the connection generation its burst goes out on (run_resend),
  // and only that one. Lost meanwhile, the request goes back to the
  // re-sender's queue, to be merged in issue order with the requests that
  // connection's loss queues (resend_loop).
  std::uint64_t resend_gen = 0;
};

// Issue (request id) order, so that per key a re-sent step never overtakes
// an earlier one.
void sort_in_issue_order(std::vector<PendingReq>& requests) {
  std::sort(requests.begin(), requests.end(), [](const PendingReq& a, const PendingReq& b) {
    return a.header.request_id < b.header.request_id;
  });
}

// Requests of one lost connection, handed to the link's re-sender thread.
// The re-sender merges every job queued when it takes one (resend_loop).
struct ResendJob {
  std::uint64_t gen = 0;  // the connection generation that was lost
  Error reason;           // why it closed
  std::vector<PendingReq> requests;  // in request-id (issue) order
};

using ChannelRing = ring::MpscRing<Outgoing>;

// Bytes a request puts on the wire: its encoded header and dims plus the
// tensor bytes it carries (what the recorder counts per channel and rank).
std::uint64_t message_bytes(const Outgoing& o) {
  return proto::prefix_bytes(o.header) + o.data.size();
}

struct ServerLink {
  std::uint32_t index = 0;
  std::string address;
  std::mutex mutex;  // guards conn, gen, connecting, joined_gen, join_error, join_error_gen
  std::shared_ptr<transport::Connection> conn;
  std::uint64_t gen = 0;
  // A thread is connecting generation gen + 1 (Impl::connection), without
  // holding `mutex`: other senders wait on joined_cv. Notified when it ends.
  bool connecting = false;
  // The generation whose join succeeded. conn is published before its join
  // is sent (the join goes out on it), so while joined_gen != gen only the
  // join may use it: every other sender waits on joined_cv (with mutex), so
  // that nothing reaches a server whose join the worker may still refuse
  // (check_same_settings). Notified when a join ends either way, and when
  // the worker closes its connections.
  std::uint64_t joined_gen = 0;
  std::condition_variable joined_cv;
  // The error of the last join that failed, and its generation: the outcome
  // of the senders that waited for that join.
  std::optional<Error> join_error;
  std::uint64_t join_error_gen = 0;
  std::vector<std::unique_ptr<std::mutex>> channel_mutex;  // keeps header+payload adjacent
  std::vector<std::unique_ptr<ChannelRing>> rings;         // pipeline queues
  std::vector<std::unique_ptr<std::mutex>> ring_consumer;  // one flusher per ring
  // Re-sending (Impl::resend_loop). on_closed (an I/O thread) queues a job
  // and never blocks; the link's re-sender thread, started on first use,
  // reconnects and re-sends. While jobs are queued or running
  // (resends_queued > 0), other senders to this server wait (bounded by
  // request_timeout) so that re-sent requests go out before newer ones.
  std::mutex resend_mutex;  // guards resend_jobs, resender; never held across a blocking call
  std::condition_variable resend_cv;
  std::deque<ResendJob> resend_jobs;
  std::thread resender;
  // Jobs queued or running. Written under resend_mutex; the senders' fast-path
  // load (acquire) pairs with those writes (release).
  std::atomic<std::uint32_t> resends_queued{0};
  // The newest connection generation whose on_closed has run (its requests
  // are taken and their re-send queued). Guarded by resend_mutex; waited on
  // with resend_cv. A connection reports is_closed() before its on_closed
  // runs: a sender that found it closed waits for this before reconnecting,
  // so that the lost requests are re-sent before its newer one (per key,
  // the server refuses a step that overtakes an earlier one: kOutOfStep).
  std::uint64_t announced_gen = 0;
  // Generation of a connection this side closed because the server broke
  // the protocol: its requests are not re-sent (0: none).
  std::atomic<std::uint64_t> poisoned_gen{0};
  // The join found settings that differ from this worker's config; warned.
  std::atomic<bool> settings_warned{false};
  std::atomic<bool> optimizer_warned{false};  // the same, for [optimizer]
  // What the last successful join of this server said of its settings, and
  // the connection generation of that join (Impl::check_same_settings
  // compares the servers, skipping a record whose connection is gone: the
  // server may have restarted with other settings). Guarded by
  // Impl::settings_mutex.
  std::optional<proto::JoinReplyBody> settings;
  std::uint64_t settings_gen = 0;
  // Attempts of the last reconnect cycle to this server when it failed, or
  // ended at a request's deadline (0: the last connect succeeded). While set, a new request reconnects
  // with one attempt instead of a full cycle (connect(quick)), so after the
  // re-sender gave up, each later call fails at once (or finds the server
  // back) rather than waiting out connect_retries again.
  std::atomic<std::uint32_t> failed_cycle_attempts{0};
  // That cycle was cut short by a request's deadline (after at least half a
  // request_timeout) rather than running all its attempts.
  std::atomic<bool> failed_cycle_cut{false};
};

// "\"momentum\" with Nesterov", as the join's messages name an optimizer.
std::string optimizer_text(std::string_view name, bool nesterov) {
  return fmt::format("\"{}\"{}", name, nesterov ? " with Nesterov" : "");
}

// The optimizer a join reply names, in optimizer_text's form.
std::string optimizer_text(const proto::JoinReplyBody& b) {
  return optimizer_text(proto::optimizer_name(static_cast<proto::OptimizerCode>(b.optimizer)),
                        b.nesterov != 0);
}

// This host's physical memory in bytes (sysconf); 0 when unknown.
std::uint64_t host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page_size);
}

std::uint64_t product(std::span<const std::uint64_t> shape, bool& overflow) {
  std::uint64_t n = 1;
  overflow = false;
  for (std::uint64_t d : shape) {
    if (d != 0 && n > proto::kMaxElements / d) overflow = true;
    n *= d;
  }
  return n;
}

}  // namespace

struct Worker::Impl {
  config::Config config;
  std::shared_ptr<spdlog::logger> log = log::logger("worker");
  // Rank 0 was told once that its init values were not used (the servers
  // had the key already, at a later step). Shared with init callbacks.
  std::shared_ptr<std::atomic<bool>> resumed_warned = std::make_shared<std::atomic<bool>>(false);
  std::unique_ptr<memory::PagePool> pool;
  // Communication pattern recording ([communication] record_pattern); null
  // when off. Declared before the rings and links so that it outlives them.
  std::unique_ptr<record::Recorder> recorder;
  std::atomic<std::uint32_t> region_id{transport::MemoryLocation::kNoRegion};
  transport::Kind kind = transport::Kind::kTcp;
  std::uint32_t num_channels = 1;
  std::uint64_t small_limit = 0;
  std::unique_ptr<transport::Transport> transport;
  std::vector<std::unique_ptr<ServerLink>> servers;
  std::mutex settings_mutex;  // guards every ServerLink::settings
  PendingTable pending;
  std::atomic<std::uint64_t> next_request_id{1};
  // The number the next barrier() carries (server 0's BarrierCore tells a
  // re-sent barrier from the next one by it): seeded from server 0's first
  // join reply, so a restarted worker goes on where its predecessor stopped.
  // Shared with the barrier operations, which may finish after the Worker.
  std::shared_ptr<BarrierNumbering> barrier_numbers = std::make_shared<BarrierNumbering>();

  mutable std::shared_mutex keys_mutex;
  std::unordered_map<Key, std::shared_ptr<KeyState>> keys;

  // Request deadlines. Every deadline is now + request_timeout, taken under
  // timer_mutex, so appending keeps the queue in deadline order (a FIFO, not
  // a heap). A finished request's entry is dropped when it reaches the front
  // or by the sweep in new_op: the entry's weak_ptr keeps the Op's memory
  // (make_shared) allocated, and a queue that kept every request for
  // request_timeout grew by ~350 bytes per request (GBs at 100k requests/s
  // with the default 60 s) and page-faulted as it grew.
  struct Timer {
    Clock::time_point deadline;
    std::weak_ptr<Op> op;
  };
  mutable std::mutex timer_mutex;
  std::condition_variable timer_cv;
  // Operations have failed whose requests may still sit in `pending` (a
  // timeout; an error from one server of a multi-server operation; a server
  // that broke the protocol): the timer thread sweeps them out
  // (PendingTable::take_failed) within about kFailedSweepInterval.
  std::atomic<bool> sweep_due{false};
  void request_sweep() {
    sweep_due.store(true, std::memory_order_release);
    timer_cv.notify_one();  // without timer_mutex: a missed wake-up waits for the next timer
  }
  std::deque<Timer> timers;
  std::size_t timers_sweep_at = kTimerSweepMin;  // sweep when the queue reaches this size
  static constexpr std::size_t kTimerSweepMin = 64;
  // True when the request behind `t` is finished (or gone). Under
  // timer_mutex: an Op locked here goes to `keep`, which the caller destroys
  // after unlocking, so an Op whose last owner let go meanwhile is not
  // destroyed (with its callbacks) under the lock.
  static bool finished(const Timer& t, std::vector<std::shared_ptr<Op>>& keep) {
    if (t.op.expired()) return true;
    auto op = t.op.lock();
    if (!op) return true;
    const bool done = op->done_flag.load(std::memory_order_acquire);
    keep.push_back(std::move(op));
    return done;
  }
  bool stopping = false;  // the timer thread ends (under timer_mutex)
  // The Worker is being destroyed: no reconnect back-off, no re-send. Set
  // under timer_mutex (connect's back-off waits on timer_cv); read anywhere.
  std::atomic<bool> closing{false};
  std::thread timer_thread;

  // What a request being re-sent is waiting for, appended to its timeout
  // error so that it names the server, the attempts and the knob. Per
  // operation and server: the chunks of one operation on several servers
  // (their re-senders, senders) set and clear their notes independently.
  std::mutex notes_mutex;
  std::map<std::pair<const Op*, std::uint32_t>, std::string> resend_notes;

  ~Impl() { stop(); }

  void close_connections() {
    for (auto& s : servers) {
      std::lock_guard lock(s->mutex);
      if (s->conn) s->conn->close(std::chrono::milliseconds(200));
      s->joined_cv.notify_all();  // senders waiting for a join see it closed
    }
  }

  void stop() {
    {
      std::lock_guard lock(timer_mutex);
      if (closing.load()) return;
      closing.store(true);
    }
    timer_cv.notify_all();  // interrupts connect back-offs
    for (auto& s : servers) {
      std::lock_guard lock(s->resend_mutex);
      s->resend_cv.notify_all();
    }
    // Closing fails the requests a re-sender may be waiting on (its join);
    // the timer thread still runs, so each of its waits is bounded.
    close_connections();
    for (auto& s : servers) {
      std::thread t;
      {
        std::lock_guard lock(s->resend_mutex);
        t = std::move(s->resender);
      }
      if (t.joinable()) t.join();
    }
    {
      std::lock_guard lock(timer_mutex);
      stopping = true;
    }
    timer_cv.notify_all();
    if (timer_thread.joinable()) timer_thread.join();
    close_connections();  // one a re-sender opened meanwhile
    for (auto& s : servers) {
      for (std::uint32_t c = 0; c < s->rings.size(); ++c) {
        s->rings[c]->consume(
            [this, c](Outgoing& o) {
              if (recorder) recorder->on_dequeue(c, 1, message_bytes(o));
              o.op->fail(Error(ErrorCode::kClosed, "worker destroyed"));
            },
            ~std::size_t{0});
      }
    }
    transport.reset();  // runs on_closed: pending operations fail with kClosed
    if (recorder) {
      if (Status s = recorder->close(); !s) {
        log->warn("communication pattern recording incomplete: {}", s.error().to_string());
      } else {
        log->info("communication pattern recorded to '{}'", recorder->path().string());
      }
    }
  }

  // ---- setup ----
  Status init(const config::Config& cfg);
  // quick: one attempt (see ServerLink::failed_cycle_attempts), else
  // connect_retries + 1 with back-off.
  // `deadline`: a request's (Op::deadline); no attempt starts after it (one
  // may end up to connect_timeout later), and the error is then kTimeout. A
  // cycle so cut short counts as failed (failed_cycle_attempts) when it ran
  // at least half a request_timeout: a caller that came to it with little
  // time left says nothing of the server.
  Result<std::shared_ptr<transport::Connection>> connect(
      ServerLink& link, std::uint64_t gen, bool quick = false,
      Clock::time_point deadline = Clock::time_point::max());
  // Joins the connection of generation `gen`, which this thread opened.
  Status join(ServerLink& link, std::uint64_t gen);
  // Refuses a server whose consistency, staleness, loss policy or
  // [optimizer] differs from another server's of this job (a tensor cut over
  // both would be updated two ways); records its settings otherwise.
  Status check_same_settings(ServerLink& link, const proto::JoinReplyBody& body, std::uint64_t gen);
  // The link's open connection, reconnecting (and joining) when it is
  // closed. `after_resends`: a sender other than the re-sender; when the
  // connection was lost, it first waits (bounded by request_timeout) for the
  // loss to be announced (on_closed) and for the re-sends it queued.
  // `for_join`: the join of the connection of generation `gen` (in), which
  // this thread just opened: the one request sent on a connection before its
  // join succeeded, and only on that connection (kClosed once it closed or
  // another took its place). Every other sender waits for that join to end
  // (within request_timeout). One thread connects at a time (ServerLink::
  // connecting); link.mutex is not held across the connect cycle.
  // `deadline`: the request's (Op::deadline; for the re-sender, the latest
  // of its requests'): no wait (for another thread's connect or join, for
  // re-sends) lasts past it, no connect attempt starts after it, and after
  // a wait an open connection is not returned past it; then kTimeout. The
  // join this thread sends after its connect may take up to request_timeout
  // more. Without one (the first connect, in init()), waits have a safety
  // bound (twice request_timeout) and the connect cycle runs to its end.
  // `waiter`: the sender's operation, whose timeout error then says what it
  // waited for (a note, see timer_loop); null for the re-sender.
  Result<std::shared_ptr<transport::Connection>> connection(
      ServerLink& link, std::uint64_t& gen, bool after_resends = false, bool for_join = false,
      Clock::time_point deadline = Clock::time_point::max(), const Op* waiter = nullptr);
  // Waits (bounded by request_timeout and `deadline`) until on_closed of
  // generation `gen` has run. False if it has not by then.
  bool wait_announced(ServerLink& link, std::uint64_t gen,
                      Clock::time_point deadline = Clock::time_point::max());

  // ---- I/O callbacks ----
  // Per connection: a reply header whose payload is the next message on its
  // channel (payload-follows). Each slot is used by its channel's consumer
  // only: the I/O thread, or a thread in Connection::poll (Handle::wait),
  // which owns the channel's receive side meanwhile (one at a time).
  struct FollowState {
    std::vector<std::optional<proto::Header>> slots;
    std::uint64_t gen = 0;  // the connection's generation
  };
  void on_reply(std::uint32_t server, FollowState& follow, transport::Connection& conn,
                transport::Incoming&& msg);
  // Completes (or fails) the request `h` answers. Returns what the server
  // did wrong when the reply breaks the protocol (the request, if any, has
  // failed with kProtocol already): the caller then closes the connection,
  // whose other replies cannot be trusted either, and only then `window`
  // (the request's write window, handed over: see broke in on_reply).
  std::optional<std::string> handle_reply(std::uint32_t server, const proto::Header& h,
                                          std::span<const std::byte> payload, WindowLease& window);
  void on_closed(std::uint32_t server, std::uint64_t gen, const Error& reason);

  // ---- re-sending after a lost connection ----
  // Whether the requests of connection `gen` to `link`, closed with `reason`,
  // may be re-sent: resend_attempts > 0, the Worker is not closing, this side
  // did not close it for a protocol error, and the reason is one a reconnect
  // can cure (reset, heartbeat timeout, orderly close by the peer).
  bool can_resend(const ServerLink& link, std::uint64_t gen, const Error& reason) const;
  // The error of a request that is not (or no longer) re-sent.
  Error lost_error(const ServerLink& link, const Error& reason, std::uint32_t resends,
                   std::string_view why_not) const;
  // Queues `job` for the link's re-sender (started on first use). Never blocks.
  void queue_resend(ServerLink& link, ResendJob&& job);
  void resend_loop(ServerLink& link);
  void run_resend(ServerLink& link, ResendJob&& job);
  // Senders other than the re-sender wait here while re-sends are queued
  // (bounded by request_timeout and `deadline`).
  void wait_for_resends(ServerLink& link, Clock::time_point deadline = Clock::time_point::max());
  void set_note(const Op* op, std::uint32_t server, std::string note);
  void clear_note(const Op* op, std::uint32_t server);

  // ---- issue ----
  // `what` names the request in a timeout error ("push_pull of key 3 step
  // 7 to server 0").
  std::shared_ptr<Op> new_op(std::uint32_t parts, std::string what = {});
  std::uint64_t new_request_id() { return next_request_id.fetch_add(1, std::memory_order_relaxed); }
  // `resending`: the caller is the re-sender or a join (they never wait for
  // queued re-sends).
  void send(Outgoing&& o, bool flush_now, bool resending = false);
  void flush_ring(ServerLink& link, std::uint32_t channel);
  Status flush_all_rings();
  void issue(Outgoing&& o, bool pipelined);
  // Whether the servers run asp, as their joins said (they agree:
  // check_same_settings); this worker's config before any join.
  bool servers_run_asp() {
    std::lock_guard lock(settings_mutex);
    for (const auto& link : servers) {
      if (link->settings) {
        return static_cast<proto::Consistency>(link->settings->consistency) ==
               proto::Consistency::kAsp;
      }
    }
    return config.server.consistency == config::Consistency::kAsp;
  }
  std::shared_ptr<KeyState> key_state(Key key) const {
    std::shared_lock lock(keys_mutex);
    auto it = keys.find(key);
    return it == keys.end() ? nullptr : it->second;
  }
  // Whether all of [p, p + n) lies in the page pool (n > 0).
  bool in_pool(const std::byte* p, std::size_t n) const {
    return n > 0 && pool->contains(p) && pool->contains(p + n - 1);
  }
  bool is_large(std::uint64_t data_bytes, const proto::Header& h) const {
    return data_bytes > 0 && proto::prefix_bytes(h) + data_bytes > small_limit;
  }

  Handle init_key(Key key, std::span<const std::uint64_t> shape, std::span<const float> values);
  Handle tensor_op(proto::MsgType type, Key key, std::span<const float> gradient,
                   std::span<float> out, std::optional<std::uint64_t> step, bool pipelined);
  // `before_done`: Op::before_done of the operation (set before it is sent).
  Handle broadcast(proto::MsgType type, std::span<const std::byte> payload, proto::DType dtype,
                   std::uint64_t num_elements, bool server0_only, std::uint64_t step,
                   std::function<void(const Result<std::uint64_t>&)> before_done = {});

  void timer_loop();
};

Status Worker::Impl::init(const config::Config& cfg) {
  config = cfg;
  EMBER_TRY(config::validate(config, "config"));
  EMBER_ASSIGN_OR_RETURN(pool, proto::make_pool(config, fmt::format("worker{}", config.worker.rank)));
  EMBER_ASSIGN_OR_RETURN(transport::Options topts, proto::transport_options(config));
  kind = topts.kind;
  num_channels = topts.num_channels;
  EMBER_ASSIGN_OR_RETURN(recorder, record::Recorder::from_config(config, "worker",
                                                                 config.worker.rank, num_channels));
  if (recorder) {
    log->info("recording the communication pattern to '{}' ([communication] record_pattern)",
              recorder->path().string());
  }
  small_limit = config.communication.batch_threshold_bytes > 512
                    ? config.communication.batch_threshold_bytes - 256
                    : 256;
  topts.receive_allocator = [this](std::uint64_t size) -> Result<transport::Buffer> {
    return proto::pool_receive_allocator(*pool, region_id.load(std::memory_order_acquire))(size);
  };
  EMBER_ASSIGN_OR_RETURN(transport, transport::Transport::create(std::move(topts)));
  transport::Transport::Region region{pool->base(), pool->length_bytes(), pool->fd()};
  EMBER_ASSIGN_OR_RETURN(const std::uint32_t rid, transport->register_memory(region));
  region_id.store(rid, std::memory_order_release);

  ring::MpscOptions ro;
  ro.lane_capacity = 1024;
  ro.max_producers = 64;
  for (std::uint32_t i = 0; i < config.cluster.servers.size(); ++i) {
    auto link = std::make_unique<ServerLink>();
    link->index = i;
    link->address = proto::endpoint_address(kind, config.cluster.servers[i]);
    for (std::uint32_t c = 0; c < num_channels; ++c) {
      link->channel_mutex.push_back(std::make_unique<std::mutex>());
      link->ring_consumer.push_back(std::make_unique<std::mutex>());
      EMBER_ASSIGN_OR_RETURN(auto r, ChannelRing::create(ro));
      link->rings.push_back(std::move(r));
    }
    servers.push_back(std::move(link));
  }
  timer_thread = std::thread([this] { timer_loop(); });
  for (auto& link : servers) {
    std::uint64_t gen = 0;
    EMBER_TRY(connection(*link, gen));
  }
  log->info("worker {} of {} connected to {} server(s) over {} ({} channel(s))", config.worker.rank,
            config.cluster.num_workers, servers.size(), transport::kind_name(kind), num_channels);
  return ok_status();
}

Result<std::shared_ptr<transport::Connection>> Worker::Impl::connect(ServerLink& link,
                                                                    std::uint64_t gen, bool quick,
                                                                    Clock::time_point deadline) {
  transport::Handlers handlers;
  const std::uint32_t s = link.index;
  auto follow = std::make_shared<FollowState>();
  follow->slots.resize(num_channels);
  follow->gen = gen;
  handlers.on_message = [this, s, follow](transport::Connection& c, transport::Incoming&& m) {
    on_reply(s, *follow, c, std::move(m));
  };
  handlers.on_closed = [this, s, gen](transport::Connection&, const Error& reason) {
    on_closed(s, gen, reason);
  };
  const std::uint32_t attempts = quick ? 1 : config.worker.connect_retries + 1;
  std::chrono::milliseconds backoff(50);
  Error last;
  std::uint32_t made = 0;  // attempts actually made
  bool hopeless = false;   // an error a retry cannot cure ended the loop early
  bool out_of_time = false;  // the request's deadline ended the loop early
  const Clock::time_point started = Clock::now();
  for (std::uint32_t attempt = 1; attempt <= attempts; ++attempt) {
    if (closing.load()) {
      last = Error(ErrorCode::kClosed, "the worker is shutting down");
      break;
    }
    if (attempt > 1 && Clock::now() >= deadline) {
      out_of_time = true;
      break;
    }
    auto conn = transport->connect(
        link.address, transport::LocalIdentity{transport::Role::kWorker, config.worker.rank},
        handlers);
    made = attempt;
    if (conn) {
      link.failed_cycle_attempts.store(0, std::memory_order_relaxed);
      return std::move(*conn);
    }
    last = conn.error();
    const ErrorCode code = last.code();
    if (code == ErrorCode::kAuth || code == ErrorCode::kVersionMismatch ||
        code == ErrorCode::kProtocol || code == ErrorCode::kConfig ||
        code == ErrorCode::kInvalidArgument) {
      hopeless = true;
      break;  // retrying cannot help
    }
    {
      std::unique_lock lock(timer_mutex);
      if (closing.load()) break;
      // Back-off between attempts (the server may still be starting); a
      // Worker being destroyed interrupts it.
      timer_cv.wait_until(lock, std::min(deadline, Clock::now() + backoff),
                          [&] { return closing.load(); });
    }
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
  // An shm worker that found no shm listener: a tcp listener at the same
  // host:port is most likely this job's server, on another transport. Only
  // after a whole failed cycle (seconds), not on the quick path; a server
  // there logs the probe at info level as a harmless port probe.
  std::string mismatch;
  if (!hopeless && !quick && !out_of_time && kind == transport::Kind::kShm && !closing.load()) {
    const config::HostPort& hp = config.cluster.servers.at(link.index);
    if (worker_detail::accepts_tcp(hp.host, hp.port, std::chrono::milliseconds(500))) {
      mismatch = fmt::format(
          "; but something accepts tcp at {}: if that is this job's ember-server, its "
          "[communication] transport is not this worker's \"shm\"; give workers and servers the "
          "same transport",
          hp.to_string());
    }
  }
  if (hopeless) {
    last.with_context(fmt::format("worker {}: cannot connect to server {} at {} (attempt {}; not "
                                  "retried: a retry cannot cure {})",
                                  config.worker.rank, link.index, link.address, made,
                                  error_code_name(last.code())));
  } else if (out_of_time) {
    // Counts as a failed cycle (a cycle longer than request_timeout would
    // otherwise never end as one): later requests try once each. Not when
    // the caller had little time left (a flush of a request queued long
    // ago): one refused attempt then is no evidence the server is gone.
    if (!closing.load() && Clock::now() - started >= config.worker.request_timeout / 2) {
      link.failed_cycle_cut.store(true, std::memory_order_relaxed);
      link.failed_cycle_attempts.store(made, std::memory_order_relaxed);
    }
    last = Error(ErrorCode::kTimeout,
                 fmt::format("the request's [worker] request_timeout ({}) ran out after attempt "
                             "{} of {} ([worker] connect_retries); the last attempt: {}",
                             std::chrono::duration_cast<std::chrono::milliseconds>(
                                 config.worker.request_timeout),
                             made, attempts, last.to_string()));
    last.with_context(fmt::format("worker {}: cannot connect to server {} at {}",
                                  config.worker.rank, link.index, link.address));
  } else if (quick) {
    const bool cut = link.failed_cycle_cut.load(std::memory_order_relaxed);
    last.with_context(fmt::format(
        "worker {}: cannot connect to server {} at {} (1 attempt: the last reconnect already "
        "failed after {} attempt(s) {}; restart the server or check the address)",
        config.worker.rank, link.index, link.address,
        link.failed_cycle_attempts.load(std::memory_order_relaxed),
        cut ? "when a request's [worker] request_timeout ran out" : "of [worker] connect_retries"));
  } else {
    if (!closing.load()) {
      link.failed_cycle_cut.store(false, std::memory_order_relaxed);
      link.failed_cycle_attempts.store(made, std::memory_order_relaxed);
    }
    last.with_context(fmt::format("worker {}: cannot connect to server {} at {} (after {} of {} "
                                  "attempt(s); [worker] connect_retries, connect_timeout{})",
                                  config.worker.rank, link.index, link.address, made, attempts,
                                  mismatch));
  }
  return tl::unexpected(last);
}

bool Worker::Impl::wait_announced(ServerLink& link, std::uint64_t gen, Clock::time_point deadline) {
  std::unique_lock lock(link.resend_mutex);
  link.resend_cv.wait_until(lock, std::min(deadline, Clock::now() + config.worker.request_timeout),
                            [&] { return closing.load() || link.announced_gen >= gen; });
  return link.announced_gen >= gen;
}

Result<std::shared_ptr<transport::Connection>> Worker::Impl::connection(ServerLink& link,
                                                                       std::uint64_t& gen,
                                                                       bool after_resends,
                                                                       bool for_join,
                                                                       Clock::time_point deadline,
                                                                       const Op* waiter) {
  std::unique_lock lock(link.mutex);
  if (for_join) {
    // The join goes on the connection its thread opened, or not at all (that
    // thread's connection() then fails or retries as for a lost one).
    if (link.conn && !link.conn->is_closed() && link.gen == gen) return link.conn;
    return make_error(ErrorCode::kClosed,
                      "worker {}: the connection to server {} at {} closed before its join went out",
                      config.worker.rank, link.index, link.address);
  }
  // Without a deadline (only the first connect, in init(), which no other
  // thread can be connecting meanwhile), a wait has a safety bound.
  const bool bounded = deadline != Clock::time_point::max();
  const Clock::time_point wait_end =
      bounded ? deadline : Clock::now() + 2 * config.worker.request_timeout;
  auto timed_out = [&](std::string_view while_what) {
    return make_error(ErrorCode::kTimeout,
                      "worker {}: gave up waiting for server {} at {} while {}: {}",
                      config.worker.rank, link.index, link.address, while_what,
                      bounded ? fmt::format("the request's [worker] request_timeout ({}) ran out",
                                            std::chrono::duration_cast<std::chrono::milliseconds>(
                                                config.worker.request_timeout))
                              : std::string("twice [worker] request_timeout passed"));
  };
  // While this sender waits, its operation's timeout error (timer_loop)
  // says what for. Set on the slow paths only. Cleared here when a
  // connection is returned; after an error the caller clears it once it has
  // failed the operation, so that a timer firing in between still says it.
  struct Note {
    Impl* impl;
    const Op* op;
    std::uint32_t server;
    bool set = false;
    bool connected = false;
    ~Note() {
      if (set && connected) impl->clear_note(op, server);
    }
  } note{this, waiter, link.index};
  auto wait_note = [&](std::string_view while_what) {
    if (waiter == nullptr) return;
    note.set = true;
    set_note(waiter, link.index,
             fmt::format("waiting for server {} at {} while {}", link.index, link.address,
                         while_what));
  };
  // The lost connection (generation) whose re-sends this sender waited
  // for, and whose loss any thread here waited to see announced.
  std::uint64_t waited_resends_gen = 0;
  std::uint64_t waited_announce_gen = 0;
  bool waited = false;
  for (;;) {
    if (closing.load()) {
      return make_error(ErrorCode::kClosed, "worker {}: shutting down while server {} connects",
                        config.worker.rank, link.index);
    }
    const bool open = link.conn && !link.conn->is_closed();
    if (!link.connecting && open && link.joined_gen == link.gen) {
      // After a wait, a request whose time is up stays unsent (it would
      // overtake re-sends still queued, and its caller has a kTimeout).
      if (waited && bounded && Clock::now() >= deadline) return timed_out("it was connecting");
      gen = link.gen;
      note.connected = true;
      return link.conn;
    }
    if (link.connecting || (open && link.join_error_gen != link.gen)) {
      // Another thread connects (link.mutex is not held across a connect
      // cycle, so that check_same_settings of another server and stop() never
      // wait for one) or joins this connection; nothing may reach a server
      // before its join succeeded (the join may refuse it:
      // check_same_settings). Wait for that to end.
      const std::uint64_t watched = link.connecting ? link.gen + 1 : link.gen;
      const std::string_view what = link.connecting ? "another thread connects" : "it joins";
      waited = true;
      wait_note(what);
      const bool ended = link.joined_cv.wait_until(lock, wait_end, [&] {
        if (closing.load()) return true;
        if (link.connecting) return false;
        if (link.gen != watched) return true;  // that connect failed: no such generation
        return !link.conn || link.conn->is_closed() || link.joined_gen == watched ||
               link.join_error_gen == watched;
      });
      if (!ended) return timed_out(what);
      if (link.gen == watched && link.join_error_gen == watched && link.join_error &&
          link.poisoned_gen.load() == watched) {
        // The join this sender waited for was refused (another [cluster]
        // table, other server settings): that is its outcome too, rather
        // than a join of its own to be refused again. A join that failed on
        // a lost connection or a timeout is not: the sender goes on as after
        // any lost connection (below), and its request is sent once a
        // connection joins.
        return tl::unexpected(*link.join_error);
      }
      continue;
    }
    if (after_resends && link.conn && waited_resends_gen != link.gen) {
      // Lost: its requests go first (on_closed queues them; the re-sender
      // reconnects). Then use whatever connection is open. Again if that
      // one is lost too before this sender gets to it.
      waited_resends_gen = link.gen;
      waited_announce_gen = link.gen;
      waited = true;
      const std::uint64_t lost_gen = link.gen;
      lock.unlock();
      wait_note("its lost requests were re-sent");
      wait_announced(link, lost_gen, deadline);
      wait_for_resends(link, deadline);
      lock.lock();
      if (bounded && Clock::now() >= deadline) return timed_out("its lost requests were re-sent");
      continue;
    }
    if (link.conn && waited_announce_gen != link.gen) {
      // Whoever reconnects (the re-sender too) first lets on_closed of the
      // lost connection queue its re-sends: counted in resends_queued
      // before the loss is announced, they make every other sender wait
      // (send() checks again after connection()) instead of overtaking
      // them on the new connection. Bounded; a loss never announced by
      // then does not hold the reconnect up further.
      waited_announce_gen = link.gen;
      const std::uint64_t lost_gen = link.gen;
      lock.unlock();
      wait_announced(link, lost_gen, deadline);
      lock.lock();
      continue;
    }
    break;
  }
  if (bounded && Clock::now() >= deadline) return timed_out("its connection was lost");
  // This thread connects. Others wait (above) for it to end.
  const std::uint64_t new_gen = link.gen + 1;
  link.connecting = true;
  lock.unlock();
  wait_note("this call reconnected");
  // A sender after a failed reconnect cycle tries once (the re-sender, and
  // the first connect, always make the whole cycle).
  const bool quick =
      after_resends && link.failed_cycle_attempts.load(std::memory_order_relaxed) > 0;
  auto connected = connect(link, new_gen, quick, deadline);
  lock.lock();
  link.connecting = false;
  if (!connected || closing.load()) {
    link.joined_cv.notify_all();
    if (!connected) return tl::unexpected(connected.error());
    // stop() closes link.conn after setting `closing`; this one it cannot see.
    (*connected)->close();
    return make_error(ErrorCode::kClosed, "worker {}: shutting down while connecting to server {}",
                      config.worker.rank, link.index);
  }
  auto conn = std::move(*connected);
  link.conn = conn;
  link.gen = new_gen;
  gen = new_gen;
  link.joined_cv.notify_all();  // waiters now wait for its join
  lock.unlock();
  Status joined = join(link, new_gen);
  if (!joined) {
    const ErrorCode code = joined.error().code();
    if (code != ErrorCode::kIo && code != ErrorCode::kTimeout && code != ErrorCode::kClosed &&
        code != ErrorCode::kUnavailable) {
      link.poisoned_gen.store(new_gen);  // refused (another [cluster] table): nothing to re-send
    }
    conn->close();
  }
  {
    std::lock_guard g(link.mutex);
    if (joined && link.gen == new_gen) link.joined_gen = new_gen;
    if (!joined && link.gen == new_gen) {  // not over a newer connection's record
      link.join_error = joined.error();
      link.join_error_gen = new_gen;
    }
    link.joined_cv.notify_all();
  }
  if (!joined) return tl::unexpected(joined.error());
  note.connected = true;
  return conn;
}

Status Worker::Impl::join(ServerLink& link, std::uint64_t gen) {
  proto::JoinReplyBody body{};
  auto op = new_op(1, fmt::format("join of server {}", link.index));
  Outgoing o;
  o.server = link.index;
  o.channel = 0;
  o.header.type = proto::MsgType::kJoin;
  o.header.worker_rank = config.worker.rank;
  o.op = op;
  o.join_gen = gen;
  o.pending.dest = reinterpret_cast<std::byte*>(&body);
  o.pending.dest_bytes = sizeof body;
  const proto::JoinRequestBody jb{config.cluster.num_workers,
                                  static_cast<std::uint32_t>(config.cluster.servers.size()),
                                  link.index,
                                  proto::partition_check(config.server.partition_bytes)};
  const auto jb_bytes = proto::encode_body(jb);
  o.data = jb_bytes;
  send(std::move(o), true, true);
  Handle h(op);
  auto r = h.wait();
  if (!r) {
    Error e = r.error();
    e.with_context(fmt::format("joining server {} at {}", link.index, link.address));
    return tl::unexpected(e);
  }
  // The server refuses a join whose counts differ from its own; one that
  // accepts and answers others breaks the protocol (its key map would differ
  // from this worker's).
  if (body.num_workers != config.cluster.num_workers || body.num_servers != servers.size() ||
      body.server_index != link.index || body.num_shards == 0) {
    return tl::unexpected(Error(
        ErrorCode::kProtocol,
        fmt::format("server {} at {} broke the protocol: it accepted this worker's join (num_workers "
                    "{}, {} server(s), index {}) but answered num_workers {}, {} server(s), index "
                    "{}, {} shard(s); check that it runs the same Ember version",
                    link.index, link.address, config.cluster.num_workers, servers.size(),
                    link.index, body.num_workers, body.num_servers, body.server_index,
                    body.num_shards)));
  }
  EMBER_TRY(check_same_settings(link, body, gen));
  if (link.index == 0) barrier_numbers->seed_once(*r);  // before any barrier(): create() joins
  const std::string_view server_consistency =
      proto::consistency_name(static_cast<proto::Consistency>(body.consistency));
  log->debug("joined server {} ({}, {} shard(s))", link.index, server_consistency, body.num_shards);
  // The server's consistency is what applies; a config that says otherwise
  // is a job whose processes disagree (one server on asp among bsp ones, a
  // worker told ssp): say so once per server, or every report that quotes
  // this worker's config is wrong without a hint.
  const std::string_view mine = config::to_string(config.server.consistency);
  const bool ssp = config.server.consistency == config::Consistency::kSsp;
  if ((server_consistency != mine || (ssp && body.staleness != config.server.staleness_steps)) &&
      !link.settings_warned.exchange(true, std::memory_order_relaxed)) {
    log->warn("server {} ({}) runs consistency \"{}\"{}, but this worker's config says \"{}\"{}: "
              "the server's setting applies to the keys it holds; give every process the same "
              "[server] table",
              link.index, link.address, server_consistency,
              body.consistency == static_cast<std::uint8_t>(proto::Consistency::kSsp)
                  ? fmt::format(" with staleness {}", body.staleness)
                  : "",
              mine, ssp ? fmt::format(" with staleness {}", config.server.staleness_steps) : "");
  }
  // The same for the optimizer: the server applies its own [optimizer]; a
  // worker config naming another one (which the example trainer and its
  // single-process baseline quote) describes a job that is not running.
  // The learning rate is not compared: workers may change it at run time.
  const bool my_nesterov =
      config.optimizer.type == config::OptimizerType::kMomentum && config.optimizer.nesterov;
  const std::string server_optimizer = optimizer_text(body);
  const std::string my_optimizer = optimizer_text(config::to_string(config.optimizer.type), my_nesterov);
  if (server_optimizer != my_optimizer &&
      !link.optimizer_warned.exchange(true, std::memory_order_relaxed)) {
    log->warn("server {} ({}) applies optimizer {}, but this worker's config says {}: the "
              "server's optimizer updates the keys it holds; give every process the same "
              "[optimizer] table",
              link.index, link.address, server_optimizer, my_optimizer);
  }
  return ok_status();
}

Status Worker::Impl::check_same_settings(ServerLink& link, const proto::JoinReplyBody& body,
                                         std::uint64_t gen) {
  auto consistency_text = [](const proto::JoinReplyBody& b) {
    const auto c = static_cast<proto::Consistency>(b.consistency);
    return fmt::format("consistency \"{}\"{}, on_worker_loss \"{}\"", proto::consistency_name(c),
                       c == proto::Consistency::kSsp ? fmt::format(" (staleness {})", b.staleness)
                                                     : "",
                       proto::loss_policy_name(static_cast<proto::LossPolicy>(b.loss_policy)));
  };
  // Lock order: settings_mutex, then a link's mutex (nothing takes them the
  // other way round).
  std::lock_guard lock(settings_mutex);
  auto connected_gen = [](ServerLink& l) -> std::optional<std::uint64_t> {
    std::lock_guard g(l.mutex);
    if (!l.conn || l.conn->is_closed()) return std::nullopt;
    return l.gen;
  };
  for (const auto& other : servers) {
    // A server compares with the others only, and only with what they said
    // on the connection they still have: a server that restarted since may
    // run other settings (all of them may have been restarted with a new
    // [optimizer] table), and its next join records them.
    if (other.get() == &link || !other->settings) continue;
    if (connected_gen(*other) != other->settings_gen) continue;
    const proto::JoinReplyBody& o = *other->settings;
    std::string what;
    std::string_view table;
    if (consistency_text(body) != consistency_text(o)) {
      what = fmt::format("runs {}, but server {} ({}) runs {}", consistency_text(body), other->index,
                         other->address, consistency_text(o));
      table = "[server] consistency, staleness and on_worker_loss";
    } else if (optimizer_text(body) != optimizer_text(o)) {
      what = fmt::format("applies optimizer {}, but server {} ({}) applies optimizer {}",
                         optimizer_text(body), other->index, other->address, optimizer_text(o));
      table = "[optimizer] table";
    } else if (body.optimizer_check != 0 && o.optimizer_check != 0 &&
               body.optimizer_check != o.optimizer_check) {
      what = fmt::format("has other [optimizer] numbers than server {} ({}): learning_rate, "
                         "momentum, beta1, beta2, epsilon, weight_decay or initial_accumulator "
                         "differ",
                         other->index, other->address);
      table = "[optimizer] table";
    } else {
      continue;
    }
    return make_error(ErrorCode::kConfig,
                      "server {} ({}) {}: the chunks of a tensor cut over both would be updated "
                      "two ways. Give every server the same {} (compare `ember-server "
                      "--print-config` of each) and restart the one that differs",
                      link.index, link.address, what, table);
  }
  link.settings = body;
  // The generation of the connection that said it (the join's), not the
  // link's current one: a newer connection opened meanwhile has not joined
  // yet, and its server may run other settings.
  link.settings_gen = gen;
  return ok_status();
}

std::shared_ptr<Op> Worker::Impl::new_op(std::uint32_t parts, std::string what) {
  auto op = std::make_shared<Op>(parts);
  op->what_text = std::move(what);
  op->busy_poll = config.communication.busy_poll;
  std::vector<std::shared_ptr<Op>> keep;  // destroyed after the lock (see finished())
  {
    std::lock_guard lock(timer_mutex);
    auto is_finished = [&keep](const Timer& t) { return finished(t, keep); };
    // Requests mostly finish in the order they were issued: drop the
    // finished ones at the front. One that waits long (a barrier, an ssp
    // pull) would hold everything behind it, so the whole queue is swept
    // whenever it has doubled since the last sweep (amortised O(1)).
    while (!timers.empty() && is_finished(timers.front())) timers.pop_front();
    if (timers.empty()) timers_sweep_at = kTimerSweepMin;  // a burst's threshold ends with it
    if (timers.size() >= timers_sweep_at) {
      std::erase_if(timers, is_finished);
      timers_sweep_at = std::max(kTimerSweepMin, 2 * timers.size());
    }
    op->deadline = Clock::now() + config.worker.request_timeout;
    timers.push_back(Timer{op->deadline, op});
  }
  // The timer thread is not woken: deadlines only grow, and on an empty
  // queue it sleeps at most request_timeout (timer_loop), so it is awake by
  // this deadline. (A wake-up per request, which an emptied queue would
  // otherwise need, cost a context switch per request: the 4 KiB round trip
  // of bench/pushpull went from ~15-25 to ~40-50 us on 2 cores.)
  return op;
}

void Worker::Impl::timer_loop() {
  pthread_setname_np(pthread_self(), "ember-wtimer");
  std::unique_lock lock(timer_mutex);
  Clock::time_point last_failed_sweep{};
  while (!stopping) {
    const Clock::time_point now = Clock::now();
    const bool expired = !timers.empty() && now >= timers.front().deadline;
    if (!expired) {
      // Between timeouts: the requests of failed operations (sweep_due) are
      // swept at most every kFailedSweepInterval, so a burst of timeouts
      // costs one scan, done after all of them.
      const Clock::time_point sweep_at = last_failed_sweep + kFailedSweepInterval;
      if (sweep_due.load(std::memory_order_acquire) && now >= sweep_at) {
        sweep_due.store(false, std::memory_order_relaxed);
        last_failed_sweep = now;
        lock.unlock();
        (void)pending.take_failed();  // destroyed here, outside every lock
        lock.lock();
        continue;
      }
      // new_op does not wake this thread: any deadline added while it sleeps
      // is at least request_timeout away from now. request_sweep() does.
      Clock::time_point wake =
          timers.empty() ? now + config.worker.request_timeout : timers.front().deadline;
      if (sweep_due.load(std::memory_order_acquire)) wake = std::min(wake, sweep_at);
      timer_cv.wait_until(lock, wake);
      continue;
    }
    std::weak_ptr<Op> weak = std::move(timers.front().op);
    timers.pop_front();
    lock.unlock();
    if (auto op = weak.lock()) {
      std::string note;
      {
        std::lock_guard notes(notes_mutex);
        for (auto it = resend_notes.lower_bound({op.get(), 0});
             it != resend_notes.end() && it->first.first == op.get(); ++it) {
          note += "; " + it->second;
        }
      }
      if ((op->what_verb == "pull" || op->what_verb == "push_pull") && !servers_run_asp()) {
        // Under bsp/ssp the usual cause is another worker, not the network.
        note += "; under bsp and ssp a pull waits for the other workers' pushes of its step (ssp: "
                "until the slowest worker is within [server] staleness steps): check that every "
                "worker runs, and their steps with `emberctl status` (a worker that pushed a "
                "step twice is one ahead of the others)";
      }
      const std::string what = op->what();
      op->fail(Error(ErrorCode::kTimeout,
                     fmt::format("{}{}no reply within [worker] request_timeout ({}){}", what,
                                 what.empty() ? "" : ": ",
                                 std::chrono::duration_cast<std::chrono::milliseconds>(
                                     config.worker.request_timeout),
                                 note)));
      // Its in-place requests are given up: their windows close (a late
      // reply writes nothing, and one being written is waited for), and
      // then the operation is done. (Only shm has windows: no scan of the
      // pending table per timeout over tcp or rdma.)
      if (kind == transport::Kind::kShm) (void)pending.take_windows_of(op.get());
      // The timed-out requests themselves leave the table too (they used to
      // stay until a reply or their connection's end: a server that stays
      // up but stops answering grew it without bound): swept between
      // timeouts, one scan for all the timeouts of a while.
      sweep_due.store(true, std::memory_order_release);
    }
    lock.lock();
  }
}

void Worker::Impl::on_closed(std::uint32_t server, std::uint64_t gen, const Error& reason) {
  ServerLink& link = *servers[server];
  // On every return: the loss of `gen` is announced (after its re-send job,
  // if any, was queued).
  struct Announce {
    ServerLink& link;
    std::uint64_t gen;
    ~Announce() {
      {
        std::lock_guard lock(link.resend_mutex);
        link.announced_gen = std::max(link.announced_gen, gen);
      }
      link.resend_cv.notify_all();
    }
  } announce{link, gen};
  auto lost = pending.take_connection(server, gen);
  // Their write windows went with the connection (its writes are revoked,
  // and on_closed runs after one in progress): the operations stop counting
  // them now, so a timeout during the reconnect ends them at once.
  for (auto& r : lost) r.window = WindowLease();
  const std::uint32_t max_resends = config.worker.resend_attempts;
  const bool resend = !lost.empty() && can_resend(link, gen, reason);
  ResendJob job;
  std::vector<PendingReq> failed;
  for (auto& r : lost) {
    // A join belongs to its connection: the reconnect joins again.
    if (resend && r.type != proto::MsgType::kJoin && r.resends < max_resends) {
      job.requests.push_back(std::move(r));
    } else {
      failed.push_back(std::move(r));
    }
  }
  // Requests whose operation has already failed (timed out, or a sibling
  // chunk's error) and that the timer thread has not swept out yet
  // (take_failed): the caller has seen their error, so they are not news.
  const auto newly_failed = static_cast<std::size_t>(
      std::count_if(failed.begin(), failed.end(), [](const PendingReq& r) { return !r.op->failed(); }));
  if (newly_failed > 0 ||
      (job.requests.empty() && reason.code() != ErrorCode::kClosed &&
       reason.code() != ErrorCode::kCancelled)) {
    // The pointer once: a transport reason may carry its own.
    const std::string why = reason.to_string();
    const bool pointed = why.find("docs/troubleshooting.md#") != std::string::npos;
    log->warn("connection to server {} ({}) closed: {}; {} request(s) failed{}", server,
              link.address, why, newly_failed,
              pointed ? "" : "; see docs/troubleshooting.md#worker-loss");
  }
  for (auto& r : failed) {
    std::string why_not;
    if (r.type == proto::MsgType::kJoin) {
      why_not = "";
    } else if (max_resends == 0) {
      why_not = "not re-sent ([worker] resend_attempts = 0)";
    } else if (closing.load()) {
      why_not = "not re-sent: the worker is shutting down";
    } else if (!resend) {
      why_not = fmt::format("not re-sent: a reconnect cannot cure '{}' ({})",
                            error_code_name(reason.code()),
                            link.poisoned_gen.load() == gen ? "the server broke the protocol"
                                                            : "not a lost connection");
    } else {
      why_not = fmt::format("re-sent {} time(s) already, all [worker] resend_attempts = {} allows",
                            r.resends, max_resends);
    }
    r.op->fail(lost_error(link, reason, r.resends, why_not));
  }
  if (job.requests.empty()) return;
  log->warn("connection to server {} ({}) closed: {}; reconnecting to re-send {} request(s) "
            "([worker] resend_attempts = {})",
            server, link.address, reason.to_string(), job.requests.size(), max_resends);
  sort_in_issue_order(job.requests);
  job.gen = gen;
  job.reason = reason;
  queue_resend(link, std::move(job));
}

bool Worker::Impl::can_resend(const ServerLink& link, std::uint64_t gen, const Error& reason) const {
  if (config.worker.resend_attempts == 0 || closing.load()) return false;
  if (link.poisoned_gen.load() == gen) return false;
  switch (reason.code()) {
    case ErrorCode::kIo:           // reset, crash (no goodbye)
    case ErrorCode::kTimeout:      // heartbeat timeout
    case ErrorCode::kClosed:       // orderly close by the peer (restart, drain)
    case ErrorCode::kUnavailable:
      return true;
    default:                       // kCancelled (own shutdown), protocol, auth, config, ...
      return false;
  }
}

Error Worker::Impl::lost_error(const ServerLink& link, const Error& reason, std::uint32_t resends,
                               std::string_view why_not) const {
  (void)resends;
  return Error(ErrorCode::kClosed,
               fmt::format("connection to server {} ({}) lost before the reply: {}{}{}", link.index,
                           link.address, reason.to_string(), why_not.empty() ? "" : "; ",
                           why_not));
}

void Worker::Impl::set_note(const Op* op, std::uint32_t server, std::string note) {
  std::lock_guard lock(notes_mutex);
  resend_notes[{op, server}] = std::move(note);
}

void Worker::Impl::clear_note(const Op* op, std::uint32_t server) {
  std::lock_guard lock(notes_mutex);
  resend_notes.erase({op, server});
}

void Worker::Impl::queue_resend(ServerLink& link, ResendJob&& job) {
  {
    std::lock_guard lock(link.resend_mutex);
    if (!closing.load()) {
      link.resends_queued.fetch_add(1, std::memory_order_release);
      link.resend_jobs.push_back(std::move(job));
      if (!link.resender.joinable()) {
        link.resender = std::thread([this, &link] { resend_loop(link); });
      }
      job.requests.clear();
    }
  }
  link.resend_cv.notify_all();
  // Closing (stop() moved the thread out already, or is about to): fail here.
  for (auto& r : job.requests) {
    r.op->fail(lost_error(link, job.reason, r.resends, "not re-sent: the worker is shutting down"));
  }
}

void Worker::Impl::wait_for_resends(ServerLink& link, Clock::time_point deadline) {
  // Sync point: a sender that found re-sends queued, before it waits for them.
  EMBER_SYNC_POINT("Worker::wait_for_resends");
  std::unique_lock lock(link.resend_mutex);
  // Bounded: a sender never waits longer than its own request could.
  link.resend_cv.wait_until(
      lock, std::min(deadline, Clock::now() + config.worker.request_timeout), [&] {
        return closing.load() || link.resends_queued.load(std::memory_order_acquire) == 0;
      });
}

void Worker::Impl::resend_loop(ServerLink& link) {
  pthread_setname_np(pthread_self(), "ember-wresend");
  for (;;) {
    ResendJob job;
    {
      std::unique_lock lock(link.resend_mutex);
      link.resend_cv.wait(lock, [&] { return closing.load() || !link.resend_jobs.empty(); });
      if (link.resend_jobs.empty()) return;  // closing, nothing left
      job = std::move(link.resend_jobs.front());
      link.resend_jobs.pop_front();
      // Every job queued meanwhile joins this one, in issue order: requests
      // of a burst that its connection lost under it (handed back by send())
      // go after the older ones that loss's on_closed queued, whichever
      // queue_resend came first. The first job's loss is the one reported.
      if (!link.resend_jobs.empty()) {
        for (ResendJob& later : link.resend_jobs) {
          for (auto& r : later.requests) job.requests.push_back(std::move(r));
          link.resends_queued.fetch_sub(1, std::memory_order_release);  // this job's count stays
        }
        link.resend_jobs.clear();
        sort_in_issue_order(job.requests);
      }
    }
    run_resend(link, std::move(job));
    {
      std::lock_guard lock(link.resend_mutex);
      link.resends_queued.fetch_sub(1, std::memory_order_release);
    }
    link.resend_cv.notify_all();
  }
}

void Worker::Impl::run_resend(ServerLink& link, ResendJob&& job) {
  const std::uint32_t max_resends = config.worker.resend_attempts;
  std::vector<PendingReq>& reqs = job.requests;
  std::vector<const Op*> noted;
  for (const auto& r : reqs) noted.push_back(r.op.get());
  struct ClearNotes {
    Impl* impl;
    const std::vector<const Op*>& ops;
    std::uint32_t server;
    ~ClearNotes() {
      for (const Op* op : ops) impl->clear_note(op, server);
    }
  } clear_notes{this, noted, link.index};
  const std::string lost = fmt::format("connection to server {} ({}) lost before the reply: {}",
                                       link.index, link.address, job.reason.to_string());
  Error last = job.reason;
  std::chrono::milliseconds backoff(50);
  bool back_off = false;
  for (;;) {
    // Requests whose operation is over (timed out, or failed on another
    // chunk; or failed and waiting for a send to finish) are dropped: the
    // caller may reuse their buffers.
    std::erase_if(reqs, [](const PendingReq& r) { return r.op->failed(); });
    if (reqs.empty()) return;
    if (closing.load()) {
      for (auto& r : reqs) {
        r.op->fail(Error(ErrorCode::kClosed, lost + "; not re-sent: the worker is shutting down"));
      }
      return;
    }
    if (back_off) {
      // Between reconnect attempts (connect() backs off within one attempt);
      // a Worker being destroyed interrupts it.
      back_off = false;
      {
        std::unique_lock lock(timer_mutex);
        timer_cv.wait_for(lock, backoff, [&] { return closing.load(); });
      }
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
      continue;  // re-check `closing` and the operations
    }
    std::vector<PendingReq> keep;
    for (auto& r : reqs) {
      if (r.resends >= max_resends) {
        r.op->fail(Error(ErrorCode::kClosed,
                         fmt::format("{}; re-sending gave up after {} attempt(s) ([worker] "
                                     "resend_attempts = {}); the last: {}",
                                     lost, r.resends, max_resends, last.to_string())));
        continue;
      }
      ++r.resends;
      set_note(r.op.get(), link.index,
               fmt::format("{}; re-sending, attempt {} of [worker] resend_attempts = {}; the last "
                           "error: {}",
                           lost, r.resends, max_resends, last.to_string()));
      keep.push_back(std::move(r));
    }
    reqs = std::move(keep);
    if (reqs.empty()) return;
    // Reconnecting is of no use once every request has timed out: the cycle
    // ends with the last one's deadline.
    Clock::time_point latest = Clock::time_point::min();
    for (const auto& r : reqs) latest = std::max(latest, r.op->deadline);
    std::uint64_t gen = 0;
    auto conn = connection(link, gen, false, false, latest);
    if (!conn) {
      last = conn.error();
      const ErrorCode code = last.code();
      if (code != ErrorCode::kIo && code != ErrorCode::kTimeout && code != ErrorCode::kClosed &&
          code != ErrorCode::kUnavailable) {
        for (auto& r : reqs) {
          r.op->fail(Error(code, fmt::format("{}; re-sending stopped, reconnecting failed: {}",
                                             lost, last.to_string())));
        }
        return;
      }
      back_off = true;
      continue;
    }
    // connection() may have taken a whole reconnect cycle: drop what timed
    // out meanwhile (send() checks once more after opening a window).
    std::erase_if(reqs, [](const PendingReq& r) { return r.op->failed(); });
    if (reqs.empty()) return;
    log->info("reconnected to server {} ({}); re-sending {} request(s)", link.index, link.address,
              reqs.size());
    // Sync point: the re-sender thread, reconnected and joined, before the
    // burst of re-sends goes out on connection `gen`.
    EMBER_SYNC_POINT("Worker::run_resend:before_burst");
    for (auto& r : reqs) {
      Outgoing o;
      o.server = link.index;
      o.channel = r.channel;
      o.header = r.header;
      o.dims = r.dims;
      o.data = r.data;
      o.op = r.op;
      o.pending = std::move(r);
      o.resend_gen = gen;
      // This send's completion (the previous one was counted when it ran).
      if (is_large(o.data.size(), o.header)) o.op->add_parts(1);
      send(std::move(o), true, true);
    }
    return;
  }
}

void Worker::Impl::on_reply(std::uint32_t server, FollowState& follow, transport::Connection& conn,
                            transport::Incoming&& msg) {
  // A server that breaks the protocol: logged, and every request waiting on
  // this connection fails with what it did (kProtocol), not with the bare
  // "closed" of the close that follows; nothing is re-sent to it.
  auto broke = [&](const std::string& what) {
    log->error("server {} broke the protocol: {}; closing the connection", server, what);
    servers[server]->poisoned_gen.store(follow.gen);
    std::vector<PendingReq> waiting = pending.take_connection(server, follow.gen);
    // Closed before their windows are: closing a window of a live shm lane
    // waits for a write in progress (as in on_closed, after the close).
    conn.close();
    bool finished = false;
    for (PendingReq& r : waiting) {
      r.window = WindowLease();
      finished |= r.op->fail(Error(ErrorCode::kProtocol,
                                   fmt::format("server {} at {} broke the protocol: {}; the "
                                               "connection was closed (check that it runs the "
                                               "same Ember version)",
                                               server, servers[server]->address, what)));
    }
    if (finished) request_sweep();  // their requests to other servers
  };
  if (msg.channel >= follow.slots.size()) {
    broke(fmt::format("it sent on channel {}, of {}", msg.channel, follow.slots.size()));
    return;
  }
  auto& slot = follow.slots[msg.channel];
  if (slot) {
    const proto::Header h = *slot;
    slot.reset();
    if (msg.bytes.size() != proto::tensor_bytes(h)) {
      broke(fmt::format("{} announced {} bytes, the next message has {}", proto::describe(h),
                        proto::tensor_bytes(h), msg.bytes.size()));
      return;
    }
    WindowLease window;  // closed after the connection, if it breaks
    if (auto wrong = handle_reply(server, h, msg.bytes, window)) broke(*wrong);
    return;
  }
  auto decoded = proto::decode(msg.bytes);
  if (!decoded || !decoded->header.is_reply()) {
    broke(decoded ? fmt::format("it sent a request ({})", proto::describe(decoded->header))
                  : fmt::format("it sent a message that does not decode ({})",
                                decoded.error().to_string()));
    return;
  }
  if ((decoded->header.flags & proto::kFlagPayloadFollows) != 0) {
    slot = decoded->header;
    return;
  }
  WindowLease window;  // closed after the connection, if it breaks
  if (auto wrong = handle_reply(server, decoded->header, decoded->payload, window)) broke(*wrong);
}

std::optional<std::string> Worker::Impl::handle_reply(std::uint32_t server, const proto::Header& h,
                                                      std::span<const std::byte> payload,
                                                      WindowLease& window) {
  bool elsewhere = false;
  auto req = pending.take_reply(h.request_id, server, &elsewhere);
  if (!req) {
    if (elsewhere) {
      return fmt::format("its reply {} names request id {}, which this worker sent to another "
                         "server",
                         proto::describe(h), h.request_id);
    }
    if (h.request_id == 0 || h.request_id >= next_request_id.load(std::memory_order_relaxed)) {
      return fmt::format("its reply {} names request id {}, which this worker never issued",
                         proto::describe(h), h.request_id);
    }
    // Issued, and failed since (timed out, a sibling chunk's error): its
    // caller has its answer already.
    log->debug("server {}: late reply {} to request id {} dropped (the request failed or timed "
               "out before)",
               server, proto::describe(h), h.request_id);
    return std::nullopt;
  }
  Op& op = *req->op;
  // A protocol break fails the operation with kProtocol naming it, and is
  // returned so that the connection closes.
  auto broken = [&](std::string what) -> std::optional<std::string> {
    window = std::move(req->window);
    if (op.fail(Error(ErrorCode::kProtocol,
                      fmt::format("server {} broke the protocol: {}; check that the server runs "
                                  "the same Ember version",
                                  server, what)))) {
      request_sweep();
    }
    return what;
  };
  // A reply answers the request it names: same type, key and chunk
  // (reply_header copies them), and parameters are float32, the one type
  // this worker stores. Another is a server that breaks the protocol; taken
  // as it comes, it would complete the call with data of another kind or
  // tensor.
  const proto::Header& sent = req->header;
  const bool parameters = h.status == ErrorCode::kOk && h.num_elements > 0 &&
                          (h.type == proto::MsgType::kPull || h.type == proto::MsgType::kPushPull);
  if (h.type != req->type || h.key != sent.key || h.chunk_index != sent.chunk_index ||
      (parameters && h.dtype != proto::DType::kFloat32)) {
    return broken(fmt::format("its reply {} does not answer the request {} it names (id {})",
                              proto::describe(h), proto::describe(sent), h.request_id));
  }
  // The step a reply names becomes the key's step (out of step, init) or the
  // caller's result; a server's step moves by one per round.
  if (h.step > kLargestStep) {
    return broken(fmt::format("its reply {} names step {}, above the largest a run reaches ({})",
                              proto::describe(h), h.step, kLargestStep));
  }
  // The first error finishes the operation; its requests to other servers
  // (chunks) are then swept out of the table.
  auto fail = [&](Error e) {
    if (op.fail(std::move(e))) request_sweep();
  };
  if (h.status != ErrorCode::kOk) {
    const std::string text = printable(
        std::string_view(reinterpret_cast<const char*>(payload.data()), payload.size()));
    if (h.status == ErrorCode::kOutOfStep || h.status == ErrorCode::kStale) {
      // The reply's step is the step the server expects; the operation's
      // on_out_of_step moves the key's step there. Named like a timeout.
      const std::string what = op.what();
      std::string hint;
      if (h.type == proto::MsgType::kPull) {
        const auto ks = key_state(h.key);
        const std::uint32_t unanswered =
            ks ? ks->pushes_unanswered.load(std::memory_order_acquire) : 0;
        if (unanswered != 0) {
          hint = fmt::format(
              "; but this worker has {} push(es) of key {} not yet answered: the pull "
              "overtook them, so the step is not reset and step(key) stays {}: wait for "
              "those pushes, then pull again",
              unanswered, h.key, ks->next_step.load(std::memory_order_acquire));
        }
      }
      if (op.fail_out_of_step(Error(h.status, fmt::format("{}{}server {}: {}{}", what,
                                                          what.empty() ? "" : ": ", server, text,
                                                          hint)),
                              h.step)) {
        request_sweep();
      }
      return std::nullopt;
    }
    fail(Error(h.status, fmt::format("server {}: {}", server, text)));
    return std::nullopt;
  }
  switch (h.type) {
    case proto::MsgType::kPull:
    case proto::MsgType::kPushPull:
    case proto::MsgType::kJoin: {
      if ((h.flags & proto::kFlagInPlace) != 0) {
        // The server wrote the parameters into req->dest already (the
        // request's placement); the lane's ordering makes them visible here.
        if (!req->in_place || proto::tensor_bytes(h) != req->dest_bytes) {
          return broken(fmt::format("its reply {} says it wrote {} bytes in place; the request "
                                    "{} ({} bytes)",
                                    proto::describe(h), proto::tensor_bytes(h),
                                    req->in_place ? "asked for that" : "named no place",
                                    req->dest_bytes));
        }
        op.complete_part(h.step);
        return std::nullopt;
      }
      if (payload.size() != req->dest_bytes) {
        return broken(fmt::format("its reply {} carries {} bytes, expected {}",
                                  proto::describe(h), payload.size(), req->dest_bytes));
      }
      {
        std::lock_guard lock(op.mutex);
        // The one copy of a pull: receive buffer → the caller's tensor. Skipped
        // when the operation already finished (timeout): the caller may have
        // reused the memory.
        if (!op.done && req->dest_bytes > 0) std::memcpy(req->dest, payload.data(), req->dest_bytes);
      }
      op.complete_part(h.step);
      return std::nullopt;
    }
    default:
      op.complete_part(h.step);
      return std::nullopt;
  }
}

void Worker::Impl::send(Outgoing&& o, bool flush_now, bool resending) {
  ServerLink& link = *servers[o.server];
  std::uint64_t gen = 0;
  Result<std::shared_ptr<transport::Connection>> conn;
  if (o.resend_gen != 0) {
    // A re-send goes out on its burst's connection or not at all: on a newer
    // one it would overtake the requests the burst already re-sent on the
    // lost one (older), which that loss's on_closed queues.
    gen = o.resend_gen;
    {
      std::lock_guard g(link.mutex);
      if (link.gen == gen && link.conn && !link.conn->is_closed()) conn = link.conn;
    }
    if (!*conn) {
      // Back to the re-sender's queue, after on_closed's job (resend_loop
      // merges them in issue order). Its window went with the connection.
      if (is_large(o.data.size(), o.header)) o.op->complete_part(std::nullopt);  // no completion
      wait_announced(link, gen, o.op->deadline);
      if (o.op->failed()) return;
      ResendJob job;
      job.gen = gen;
      job.reason = Error(ErrorCode::kClosed,
                         fmt::format("the connection to server {} at {} closed while lost requests "
                                     "were re-sent on it",
                                     link.index, link.address));
      job.requests.push_back(std::move(o.pending));
      queue_resend(link, std::move(job));
      return;
    }
    if (o.op->failed()) return;  // timed out meanwhile (as below)
  }
  while (!*conn) {
    // Re-sent requests of this server go first (rare: a connection was lost).
    if (!resending && link.resends_queued.load(std::memory_order_acquire) != 0) [[unlikely]] {
      set_note(o.op.get(), link.index,
               fmt::format("waiting for server {} at {} while its lost requests were re-sent",
                           link.index, link.address));
      wait_for_resends(link, o.op->deadline);
      if (link.resends_queued.load(std::memory_order_acquire) != 0 &&
          Clock::now() >= o.op->deadline) {
        // Sent now, it would overtake them (and its caller has a kTimeout).
        // The note goes after the failure: a timer firing first says it too.
        o.op->fail(Error(ErrorCode::kTimeout,
                         fmt::format("worker {}: gave up waiting for server {} at {} while its lost "
                                     "requests were re-sent: the request's [worker] request_timeout "
                                     "({}) ran out",
                                     config.worker.rank, link.index, link.address,
                                     std::chrono::duration_cast<std::chrono::milliseconds>(
                                         config.worker.request_timeout))));
        clear_note(o.op.get(), link.index);
        return;
      }
      clear_note(o.op.get(), link.index);
    }
    // Sync point: any thread sending a request (the caller's, a flusher),
    // after its check for queued re-sends, before it asks for the connection.
    EMBER_SYNC_POINT("Worker::send:before_connection");
    gen = o.join_gen;
    conn = connection(link, gen, !resending, o.header.type == proto::MsgType::kJoin,
                      o.op->deadline, resending ? nullptr : o.op.get());
    if (!conn) {
      o.op->fail(conn.error());
      clear_note(o.op.get(), link.index);  // connection() leaves it to here (see its Note)
      return;
    }
    // connection() may have waited (a reconnect, a join, re-sends) past the
    // operation's request_timeout: the caller has its error, and a request it
    // saw fail (a learning-rate change) must not take effect after all.
    if (o.op->failed()) return;
    // Re-sends queued since the check above go first too: this thread may
    // have been descheduled between the check and connection() while the
    // connection was lost and the re-sender reconnected and joined, so the
    // connection it got is the one the re-sends are about to use. (A loss
    // after this point is handled by the send's own failure, below.)
    if (resending || link.resends_queued.load(std::memory_order_acquire) == 0) break;
    conn = std::shared_ptr<transport::Connection>();  // asked again after them
  }
  if (kind == transport::Kind::kShm) {
    std::lock_guard lock(o.op->mutex);
    o.op->progress = *conn;  // wait() consumes replies from it (handle.h)
  }
  o.header.request_id = o.header.request_id != 0 ? o.header.request_id : new_request_id();
  o.pending.op = o.op;
  o.pending.type = o.header.type;
  o.pending.server = o.server;
  o.pending.conn_gen = gen;
  o.pending.header = o.header;
  if (o.header.ndim != 0) o.pending.dims = o.dims;
  o.pending.data = o.data;
  o.pending.channel = o.channel;
  const std::uint64_t id = o.header.request_id;
  const bool large = is_large(o.data.size(), o.header);
  // In place (proto::kFlagInPlace): a large reply's parameters are written by
  // the server straight into the caller's pool memory (shm maps it on the
  // server) — one copy instead of two. Kept off the stored header: a re-send
  // decides again.
  std::optional<proto::ReplyPlacement> placement;
  if (kind == transport::Kind::kShm &&
      (o.header.type == proto::MsgType::kPull || (o.header.type == proto::MsgType::kPushPull && large)) &&
      is_large(o.pending.dest_bytes, o.header) && in_pool(o.pending.dest, o.pending.dest_bytes)) {
    placement = proto::ReplyPlacement{region_id.load(std::memory_order_acquire), 0,
                                      static_cast<std::uint64_t>(o.pending.dest - pool->base())};
  }
  // A re-sent request's window belonged to its lost connection.
  o.pending.window = WindowLease();
  if (placement) {
    // The server writes through a window of this request: when the worker
    // gives up on it (request_timeout), closing the window stops a late
    // reply from writing into memory the caller may have reused.
    if (auto w = (*conn)->open_write_window()) {
      placement->window = *w;
      o.pending.window = WindowLease(*conn, *w, o.op);
    } else {
      placement.reset();  // every window is open: the reply brings its data
    }
  }
  o.pending.in_place = placement.has_value();
  pending.insert(id, std::move(o.pending));
  if (placement && o.op->failed()) {
    // Given up meanwhile (request_timeout during a reconnect): the timer
    // closed the windows it found, perhaps before this one was registered.
    // Taking the request back closes its window; nothing is sent.
    pending.take(id);
    return;
  }
  // `lost_completion`: a large send whose completion will not run (its
  // part must be counted here if the request is re-sent).
  auto fail = [&](Error e, bool lost_completion) {
    if (e.code() == ErrorCode::kClosed && can_resend(link, gen, e)) {
      // The connection closed under this send: re-send it like the requests
      // on_closed finds, unless on_closed took it already (then it did). Once
      // on_closed has run, its job (earlier requests) is queued before this one.
      const bool announced = wait_announced(link, gen, o.op->deadline);
      auto req = pending.take(id);
      if (!req) return;
      req->window = WindowLease();  // closed with its connection (as in on_closed)
      if (lost_completion) o.op->complete_part(std::nullopt);
      if (!announced && !closing.load()) {
        // The request's time ran out first: queued now, it would go ahead
        // of the earlier requests on_closed is still to queue.
        o.op->fail(Error(ErrorCode::kTimeout,
                         fmt::format("worker {}: the connection to server {} at {} closed while "
                                     "{} was sent, and the request's [worker] request_timeout "
                                     "({}) ran out before its lost requests were queued for a "
                                     "re-send: {}",
                                     config.worker.rank, link.index, link.address,
                                     proto::msg_type_name(o.header.type),
                                     std::chrono::duration_cast<std::chrono::milliseconds>(
                                         config.worker.request_timeout),
                                     e.to_string())));
        return;
      }
      if (req->type != proto::MsgType::kJoin && req->resends < config.worker.resend_attempts) {
        ResendJob job;
        job.gen = gen;
        job.reason = e;
        job.requests.push_back(std::move(*req));
        queue_resend(link, std::move(job));
        return;
      }
    } else {
      pending.take(id);
    }
    e.with_context(fmt::format("sending {} to server {}", proto::msg_type_name(o.header.type), o.server));
    o.op->fail(std::move(e));
  };
  std::lock_guard channel_lock(*link.channel_mutex[o.channel]);
  transport::Connection& c = **conn;
  if (placement) o.header.flags |= proto::kFlagInPlace;
  if (!large) {
    thread_local std::vector<std::byte> buf;
    const std::size_t prefix = proto::prefix_bytes(o.header);
    buf.resize(prefix + o.data.size() + (placement ? sizeof(proto::ReplyPlacement) : 0));
    proto::encode_prefix(o.header, std::span(o.dims.data(), o.header.ndim), buf);
    if (!o.data.empty()) std::memcpy(buf.data() + prefix, o.data.data(), o.data.size());
    if (placement) {
      const auto body = proto::encode_body(*placement);
      std::memcpy(buf.data() + prefix, body.data(), body.size());  // a pull: no data
    }
    if (Status s = c.send(o.channel, buf); !s) return fail(s.error(), false);
  } else {
    o.header.flags |= proto::kFlagPayloadFollows;
    std::array<std::byte, proto::kHeaderBytes + 8 * proto::kMaxDims + sizeof(proto::ReplyPlacement)>
        head;
    std::size_t prefix = proto::prefix_bytes(o.header);
    proto::encode_prefix(o.header, std::span(o.dims.data(), o.header.ndim), head);
    if (placement) {
      const auto body = proto::encode_body(*placement);
      std::memcpy(head.data() + prefix, body.data(), body.size());
      prefix += body.size();
    }
    if (Status s = c.send(o.channel, std::span(head.data(), prefix)); !s) return fail(s.error(), true);
    auto* bytes = const_cast<std::byte*>(o.data.data());
    transport::Buffer payload;
    // Borrowed: the transport reads the caller's memory after send() returns
    // (queued for the socket, or lent to the server over shm), so the
    // operation may not be done before its completion runs (Op::send_started).
    bool borrowed = true;
    if (in_pool(bytes, o.data.size())) {
      transport::MemoryLocation loc;
      loc.fd = pool->fd();
      loc.fd_offset = static_cast<std::uint64_t>(bytes - pool->base());
      loc.region_id = region_id.load(std::memory_order_acquire);
      payload = transport::Buffer::borrow(std::span(bytes, o.data.size()), loc);
    } else if (kind == transport::Kind::kTcp) {
      payload = transport::Buffer::borrow(std::span(bytes, o.data.size()));
    } else {
      // shm sends by reference only from registered memory: one copy into the pool.
      payload = proto::allocate_buffer(*pool, o.data.size(), region_id.load(std::memory_order_acquire));
      std::memcpy(payload.data(), bytes, o.data.size());
      borrowed = false;
    }
    std::shared_ptr<Op> op = o.op;
    if (borrowed) op->send_started();
    Status s = c.send(o.channel, std::move(payload), [this, op, borrowed](const Status& st) {
      // First: a failure recorded meanwhile (request_timeout) finishes here.
      if (borrowed) op->send_finished();
      if (st || (config.worker.resend_attempts > 0 && !closing.load())) {
        // Failed with resending on: the connection is lost, and its request
        // (the reply part, still open) is re-sent with a fresh completion,
        // or fails, when on_closed runs next.
        op->complete_part(std::nullopt);
      } else {
        op->fail(st.error());
      }
    });
    // On error the payload was released and the completion will not run.
    // The header went out: the server now takes the next message on this
    // channel as its payload, so the connection cannot be used any more.
    if (!s) {
      if (borrowed) op->send_finished();
      c.close();
      return fail(s.error(), true);
    }
  }
  if (flush_now) (void)c.flush(o.channel);
}

void Worker::Impl::flush_ring(ServerLink& link, std::uint32_t channel) {
  std::lock_guard consumer(*link.ring_consumer[channel]);
  std::shared_ptr<transport::Connection> conn;
  {
    std::lock_guard lock(link.mutex);
    conn = link.conn;
  }
  // The burst leaves in as few writes as the transport can gather
  // (Connection::cork; tcp: up to 64 buffers per system call, about 4.5x
  // fewer writes for pipelined 4 KiB pushes), then goes out at the flush.
  if (conn) conn->cork(channel);
  link.rings[channel]->consume(
      [this, channel](Outgoing& o) {
        if (recorder) [[unlikely]] {
          recorder->on_dequeue(channel, 1, message_bytes(o));
        }
        send(std::move(o), false);
      },
      ~std::size_t{0});
  if (conn) (void)conn->flush(channel);
}

Status Worker::Impl::flush_all_rings() {
  Status first;
  for (auto& link : servers) {
    for (std::uint32_t c = 0; c < num_channels; ++c) flush_ring(*link, c);
    std::shared_ptr<transport::Connection> conn;
    {
      std::lock_guard lock(link->mutex);
      conn = link->conn;
    }
    if (conn) {
      if (Status s = conn->flush_all(); !s && first) first = s;
    }
  }
  return first;
}

void Worker::Impl::issue(Outgoing&& o, bool pipelined) {
  // Recording off: one predictable branch per request (`recorder` never
  // changes after init).
  record::Recorder* const rec = recorder.get();
  if (!pipelined) {
    if (rec != nullptr) [[unlikely]] {
      // Passes through the channel at once: enters and leaves together.
      const std::uint64_t bytes = message_bytes(o);
      rec->on_enqueue(o.channel, config.worker.rank, bytes);
      rec->on_dequeue(o.channel, 1, bytes);
    }
    send(std::move(o), true);
    return;
  }
  ServerLink& link = *servers[o.server];
  ChannelRing& ring = *link.rings[o.channel];
  const std::uint32_t channel = o.channel;
  std::uint64_t bytes = 0;
  if (rec != nullptr) [[unlikely]] {
    // Before the push: once in the ring, a flusher may take it (head <= tail).
    bytes = message_bytes(o);
    rec->on_enqueue(channel, config.worker.rank, bytes);
  }
  if (ring.try_push(std::move(o))) return;
  // Full (or no lane left for this thread): make room by sending what is queued.
  flush_ring(link, channel);
  if (ring.try_push(std::move(o))) return;
  // Still no room (more threads than lanes): send directly; it leaves the
  // channel without passing through the ring.
  if (rec != nullptr) [[unlikely]] rec->on_dequeue(channel, 1, bytes);
  send(std::move(o), false);
}

Handle Worker::Impl::init_key(Key key, std::span<const std::uint64_t> shape,
                              std::span<const float> values) {
  if (shape.size() > proto::kMaxDims) {
    return Handle::failed(Error(ErrorCode::kInvalidArgument,
                                fmt::format("init of key {}: {} dimensions, at most {}", key,
                                            shape.size(), proto::kMaxDims)));
  }
  bool overflow = false;
  const std::uint64_t n = product(shape, overflow);
  // Each dimension too, as the server's decoder checks it: [0, 2^41] has no
  // elements but is a malformed init, whose connection the server closes.
  const bool dim_too_large = std::ranges::any_of(
      shape, [](std::uint64_t d) { return d > proto::kMaxElements; });
  if (overflow || n > proto::kMaxElements || dim_too_large) {
    return Handle::failed(Error(ErrorCode::kInvalidArgument,
                                fmt::format("init of key {}: shape [{}] is too large: the "
                                            "elements, and each dimension, are at most {}",
                                            key, fmt::join(shape, ", "), proto::kMaxElements)));
  }
  // Every rank pulls the whole tensor into its own memory, so a tensor
  // larger than this host's memory cannot be used here. Refused before any
  // request: a rank other than 0 would otherwise send one init per chunk (a
  // million for 4 TiB at the default partition_bytes) and the servers would
  // hold each until rank 0's init, which can never come.
  if (const std::uint64_t mem = host_memory_bytes(); mem != 0 && n * sizeof(float) > mem) {
    return Handle::failed(Error(
        ErrorCode::kTooLarge,
        fmt::format("init of key {}: shape [{}] is {} of float32 but this host has {} of memory; "
                    "every worker pulls the whole tensor, so split it into several keys",
                    key, fmt::join(shape, ", "), format_bytes(n * sizeof(float)),
                    format_bytes(mem))));
  }
  const bool rank0 = config.worker.rank == 0;
  if ((rank0 && values.size() != n) || (!rank0 && !values.empty() && values.size() != n)) {
    return Handle::failed(Error(
        ErrorCode::kInvalidArgument,
        fmt::format("init of key {}: shape [{}] has {} elements but {} values were given{}", key,
                    fmt::join(shape, ", "), n, values.size(),
                    rank0 ? " (rank 0 provides the initial values)" : "")));
  }
  std::shared_ptr<KeyState> ks;
  {
    std::unique_lock lock(keys_mutex);
    auto& slot = keys[key];
    if (slot && slot->init_state.load(std::memory_order_acquire) == KeyState::kInitFailed) {
      slot = nullptr;  // its init failed: start over
    }
    if (slot && !std::equal(slot->shape.begin(), slot->shape.end(), shape.begin(), shape.end())) {
      return Handle::failed(Error(ErrorCode::kShapeMismatch,
                                  fmt::format("key {} was init-ed here with shape [{}]; now [{}]: "
                                              "a key keeps its shape; use that one, or another key",
                                              key, fmt::join(slot->shape, ", "),
                                              fmt::join(shape, ", "))));
    }
    if (!slot) {
      slot = std::make_shared<KeyState>();
      slot->shape.assign(shape.begin(), shape.end());
      slot->num_elements = n;
      slot->chunks = placement::chunk_plan(key, n * sizeof(float), sizeof(float),
                                           config.server.partition_bytes,
                                           static_cast<std::uint32_t>(servers.size()), num_channels);
      std::vector<std::uint32_t> to;
      for (const placement::Chunk& ch : slot->chunks) {
        if (std::find(to.begin(), to.end(), ch.server) == to.end()) to.push_back(ch.server);
      }
      slot->servers = fmt::format("{}", fmt::join(to, ", "));
    }
    ks = slot;
  }
  auto op = new_op(static_cast<std::uint32_t>(ks->chunks.size()),
                   fmt::format("init of key {} on server(s) {}{}", key, ks->servers,
                               rank0 ? "" : " (it waits until rank 0 has registered the key: is "
                                            "rank 0 running and calling init of it?)"));
  op->before_done = [ks, key, rank0, logger = log, warned = resumed_warned](
                        const Result<std::uint64_t>& r) {
    if (r) {
      ks->next_step.store(*r, std::memory_order_release);
      ks->init_state.store(KeyState::kInitDone, std::memory_order_release);
      if (rank0 && *r > 0 && !warned->exchange(true)) {
        logger->warn("key {} resumes at step {}: the servers already hold it (a restored "
                     "checkpoint, a running job, or an earlier init of it), so these init values "
                     "were not used; pull for the parameters and continue from the step init "
                     "returned (said for the first such key only)",
                     key, *r);
      }
      return;
    }
    // Refused (another shape on the servers, rank 0 lost, a timeout): unless
    // another init of it succeeded, the key is not this worker's.
    int expected = KeyState::kInitPending;
    ks->init_state.compare_exchange_strong(expected, KeyState::kInitFailed, std::memory_order_acq_rel);
  };
  const auto value_bytes = std::as_bytes(values);
  for (const placement::Chunk& ch : ks->chunks) {
    Outgoing o;
    o.server = ch.server;
    o.channel = ch.channel;
    o.op = op;
    proto::Header& h = o.header;
    h.type = proto::MsgType::kInit;
    h.dtype = proto::DType::kFloat32;
    h.key = key;
    h.chunk_index = ch.index;
    h.num_chunks = static_cast<std::uint32_t>(ks->chunks.size());
    h.worker_rank = config.worker.rank;
    h.ndim = static_cast<std::uint8_t>(shape.size());
    h.num_elements = ch.length_bytes / sizeof(float);
    h.offset_elements = ch.offset_bytes / sizeof(float);
    std::copy(shape.begin(), shape.end(), o.dims.begin());
    if (rank0) {
      o.data = value_bytes.subspan(ch.offset_bytes, ch.length_bytes);
      if (is_large(o.data.size(), h)) op->add_parts(1);
    } else {
      h.flags = proto::kFlagNoData;
    }
    issue(std::move(o), false);
  }
  return Handle(op);
}

Handle Worker::Impl::tensor_op(proto::MsgType type, Key key, std::span<const float> gradient,
                               std::span<float> out, std::optional<std::uint64_t> step,
                               bool pipelined) {
  auto ks = key_state(key);
  if (!ks) {
    return Handle::failed(Error(ErrorCode::kNotFound,
                                fmt::format("{} of key {}: the key was not init-ed by this worker; "
                                            "call init(key, shape, values) first",
                                            proto::msg_type_name(type), key)));
  }
  if (ks->init_state.load(std::memory_order_acquire) == KeyState::kInitFailed) {
    return Handle::failed(Error(ErrorCode::kNotFound,
                                fmt::format("{} of key {}: its init failed, so the key is not "
                                            "this worker's; call init(key, shape, values) again "
                                            "(with the job's shape, if it was refused for its shape)",
                                            proto::msg_type_name(type), key)));
  }
  const bool sends = type == proto::MsgType::kPush || type == proto::MsgType::kPushPull;
  const bool receives = type == proto::MsgType::kPull || type == proto::MsgType::kPushPull;
  if ((sends && gradient.size() != ks->num_elements) || (receives && out.size() != ks->num_elements)) {
    return Handle::failed(Error(
        ErrorCode::kInvalidArgument,
        fmt::format("{} of key {}: the tensor has {} elements but {} were given", proto::msg_type_name(type),
                    key, ks->num_elements, sends ? gradient.size() : out.size())));
  }
  if (step && *step >= kLargestStep) {
    // A reply naming such a step is refused as a broken server (see
    // handle_reply), and a key's counter moved there could not go on.
    return Handle::failed(Error(
        ErrorCode::kInvalidArgument,
        fmt::format("{} of key {}: step {} is not below the largest step {}; steps count "
                    "training iterations from 0",
                    proto::msg_type_name(type), key, *step, kLargestStep)));
  }
  if (!ks->issue_gate.enter(Clock::now() + config.worker.request_timeout)) {
    return Handle::failed(Error(
        ErrorCode::kTimeout,
        fmt::format("{} of key {}: another thread's request of this key was still being handed "
                    "to its channel after [worker] request_timeout ({} ms; reconnecting to, or "
                    "waiting for room at, server(s) {}); nothing was sent",
                    proto::msg_type_name(type), key,
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        config.worker.request_timeout)
                        .count(),
                    ks->servers)));
  }
  struct Leave {
    KeyState::IssueGate& gate;
    ~Leave() { gate.leave(); }
  } in_step_order{ks->issue_gate};
  const std::uint64_t self = issuing_thread_token();
  if (ks->queued_by != 0 && (!pipelined || ks->queued_by != self)) {
    for (const placement::Chunk& ch : ks->chunks) flush_ring(*servers[ch.server], ch.channel);
  }
  ks->queued_by = pipelined ? self : 0;
  // Counted before the step is taken, so a pull on another thread never
  // sees the step advanced without the push that advanced it.
  if (sends) ks->pushes_unanswered.fetch_add(1, std::memory_order_acq_rel);
  std::uint64_t s = 0;
  if (step) {
    s = *step;
    if (sends) {
      // Keep the counter ahead of explicit steps.
      std::uint64_t cur = ks->next_step.load(std::memory_order_relaxed);
      while (cur < s + 1 && !ks->next_step.compare_exchange_weak(cur, s + 1)) {
      }
    }
  } else if (sends) {
    s = ks->next_step.fetch_add(1, std::memory_order_acq_rel);
  } else {
    s = ks->next_step.load(std::memory_order_acquire);
  }
  auto op = new_op(static_cast<std::uint32_t>(ks->chunks.size()));
  op->what_verb = proto::msg_type_name(type);
  op->what_key = key;
  op->what_step = s;
  op->what_servers = ks->servers;
  // The callbacks below point at the key's state; the Op keeps it alive.
  // (Raw pointers: the callbacks stay within std::function's own storage,
  // where shared_ptr captures cost an allocation each per request.)
  KeyState* const k = ks.get();
  op->context = ks;
  // kOutOfStep: the server is at another step for this key (restored from
  // an older checkpoint); the caller continues from there. Not for a pull
  // that overtook this worker's own unanswered pushes of the key: those are
  // on their way (or queued), and resetting the step under them would make
  // the next push reuse a step the server then applies (and drops) as a
  // duplicate.
  op->on_out_of_step = [k, sends](std::uint64_t server_step, ErrorCode code) {
    if (code == ErrorCode::kStale) {
      // The push's round closed without this worker (shrink): the steps
      // before the server's are over. Up to there, never back: later pushes
      // may be on their way already.
      std::uint64_t cur = k->next_step.load(std::memory_order_acquire);
      while (cur < server_step &&
             !k->next_step.compare_exchange_weak(cur, server_step, std::memory_order_acq_rel)) {
      }
      return;
    }
    if (!sends && k->pushes_unanswered.load(std::memory_order_acquire) != 0) return;
    k->next_step.store(server_step, std::memory_order_release);
  };
  if (sends) {
    const bool counted_step = !step;
    op->before_done = [k, s, counted_step](const Result<std::uint64_t>& r) {
      k->pushes_unanswered.fetch_sub(1, std::memory_order_acq_rel);
      // A push refused out of step or as stale does not give its step back:
      // the counter was moved to the server's step. Nor does a push with an
      // explicit step.
      if (!counted_step || r || r.error().code() == ErrorCode::kOutOfStep ||
          r.error().code() == ErrorCode::kStale) {
        return;
      }
      // A failed push gives its step back (when no later one was issued), so
      // the caller's retry pushes the same step: the server applies a step
      // once per (worker, key, step), so a retry of a push it did apply is
      // dropped, and one it never saw is applied. Without this, a push that
      // never reached the server left a hole the BSP round waits on forever.
      std::uint64_t expected = s + 1;
      k->next_step.compare_exchange_strong(expected, s, std::memory_order_acq_rel);
    };
  }
  const auto grad_bytes = std::as_bytes(gradient);
  const auto out_bytes = std::as_writable_bytes(out);
  for (const placement::Chunk& ch : ks->chunks) {
    Outgoing o;
    o.server = ch.server;
    o.channel = ch.channel;
    o.op = op;
    proto::Header& h = o.header;
    h.type = type;
    h.dtype = proto::DType::kFloat32;
    h.key = key;
    h.step = s;
    h.chunk_index = ch.index;
    h.num_chunks = static_cast<std::uint32_t>(ks->chunks.size());
    h.worker_rank = config.worker.rank;
    h.num_elements = ch.length_bytes / sizeof(float);
    h.offset_elements = ch.offset_bytes / sizeof(float);
    if (sends) {
      o.data = grad_bytes.subspan(ch.offset_bytes, ch.length_bytes);
      if (is_large(o.data.size(), h)) op->add_parts(1);
    }
    if (receives) {
      o.pending.dest = out_bytes.data() + ch.offset_bytes;
      o.pending.dest_bytes = ch.length_bytes;
    }
    h.request_id = new_request_id();
    issue(std::move(o), pipelined);
  }
  return Handle(op);
}

Handle Worker::Impl::broadcast(proto::MsgType type, std::span<const std::byte> payload,
                               proto::DType dtype, std::uint64_t num_elements, bool server0_only,
                               std::uint64_t step,
                               std::function<void(const Result<std::uint64_t>&)> before_done) {
  const std::uint32_t n = server0_only ? 1 : static_cast<std::uint32_t>(servers.size());
  auto op = new_op(n, fmt::format("{} to {}", proto::msg_type_name(type),
                                  server0_only ? "server 0" : "every server"));
  op->before_done = std::move(before_done);
  std::shared_ptr<const std::vector<std::byte>> owned;
  if (!payload.empty()) owned = std::make_shared<const std::vector<std::byte>>(payload.begin(), payload.end());
  for (std::uint32_t s = 0; s < n; ++s) {
    Outgoing o;
    o.server = s;
    o.channel = 0;
    o.op = op;
    o.header.type = type;
    o.header.dtype = dtype;
    o.header.num_elements = num_elements;
    o.header.worker_rank = config.worker.rank;
    o.header.step = step;
    if (!payload.empty()) {
      // The caller's bytes may not outlive this call; a re-send needs them.
      o.pending.owned_data = owned;
      o.data = *owned;
    }
    issue(std::move(o), false);
  }
  return Handle(op);
}

// ---------------------------------------------------------------------------
// Worker

Worker::Worker() : impl_(std::make_unique<Impl>()) {}
Worker::~Worker() = default;

Result<std::unique_ptr<Worker>> Worker::create(const config::Config& config) {
  std::unique_ptr<Worker> w(new Worker());
  EMBER_TRY(w->impl_->init(config));
  return w;
}

Result<std::unique_ptr<Worker>> Worker::create_from_file(const std::filesystem::path& path,
                                                         std::span<const std::string> overrides) {
  EMBER_ASSIGN_OR_RETURN(config::Config config, config::load_config_file(path));
  EMBER_TRY(config::apply_overrides(config, overrides));
  return create(config);
}

std::uint32_t Worker::rank() const noexcept { return impl_->config.worker.rank; }
std::uint32_t Worker::num_workers() const noexcept { return impl_->config.cluster.num_workers; }
std::uint32_t Worker::num_servers() const noexcept {
  return static_cast<std::uint32_t>(impl_->config.cluster.servers.size());
}
const config::Config& Worker::config() const noexcept { return impl_->config; }

TensorBuffer Worker::allocate(std::size_t bytes) {
  TensorBuffer b;
  memory::PagePool& pool = *impl_->pool;
  if (bytes <= memory::kMaxBlockBytes) {
    if (auto block = pool.allocate(bytes)) {
      b.data_ = block->data();
      b.size_ = bytes;
      b.pool_ = &pool;
      b.block_offset_ = block->offset_bytes();
      b.num_blocks_ = 1;
      return b;
    }
  } else {
    // Consecutive largest-class blocks, if the pool carves them contiguously.
    const std::size_t n = (bytes + memory::kMaxBlockBytes - 1) / memory::kMaxBlockBytes;
    std::vector<memory::Block> blocks;
    for (std::size_t i = 0; i < n; ++i) {
      auto block = pool.allocate(memory::kMaxBlockBytes);
      if (!block) break;
      blocks.push_back(*block);
    }
    // Freed blocks come back in any order: contiguous as a set is enough.
    std::sort(blocks.begin(), blocks.end(),
              [](const memory::Block& a, const memory::Block& c) { return a.data() < c.data(); });
    bool contiguous = true;
    for (std::size_t i = 1; i < blocks.size(); ++i) {
      contiguous = contiguous && blocks[i].data() == blocks[i - 1].data() + memory::kMaxBlockBytes;
    }
    if (contiguous && blocks.size() == n) {
      b.data_ = blocks.front().data();
      b.size_ = bytes;
      b.pool_ = &pool;
      b.block_offset_ = blocks.front().offset_bytes();
      b.num_blocks_ = static_cast<std::uint32_t>(n);
      return b;
    }
    for (auto& block : blocks) pool.free(block);
  }
  // Pool exhausted, or no contiguous run: page-aligned heap memory.
  const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, rounded);
  if (p == nullptr) throw std::bad_alloc();
  b.data_ = static_cast<std::byte*>(p);
  b.size_ = bytes;
  return b;
}

Handle Worker::init(Key key, std::span<const std::uint64_t> shape, std::span<const float> values) {
  return impl_->init_key(key, shape, values);
}

Handle Worker::push(Key key, std::span<const float> gradient) {
  return impl_->tensor_op(proto::MsgType::kPush, key, gradient, {}, std::nullopt, false);
}
Handle Worker::push(Key key, std::span<const float> gradient, std::uint64_t step) {
  return impl_->tensor_op(proto::MsgType::kPush, key, gradient, {}, step, false);
}
Handle Worker::pull(Key key, std::span<float> out) {
  return impl_->tensor_op(proto::MsgType::kPull, key, {}, out, std::nullopt, false);
}
Handle Worker::pull(Key key, std::span<float> out, std::uint64_t step) {
  return impl_->tensor_op(proto::MsgType::kPull, key, {}, out, step, false);
}
Handle Worker::push_pull(Key key, std::span<const float> gradient, std::span<float> out) {
  return impl_->tensor_op(proto::MsgType::kPushPull, key, gradient, out, std::nullopt, false);
}
Handle Worker::push_pull(Key key, std::span<const float> gradient, std::span<float> out,
                         std::uint64_t step) {
  return impl_->tensor_op(proto::MsgType::kPushPull, key, gradient, out, step, false);
}

Handle Worker::barrier() {
  auto numbering = impl_->barrier_numbers;
  const std::uint64_t n = numbering->take();
  return impl_->broadcast(proto::MsgType::kBarrier, {}, proto::DType::kNone, 0, true, n,
                          [numbering, n](const Result<std::uint64_t>& r) {
                            if (r) {
                              numbering->succeeded(n);
                            } else {
                              numbering->failed(n);
                            }
                          });
}

Handle Worker::set_learning_rate(double learning_rate) {
  if (!std::isfinite(learning_rate) || learning_rate <= 0.0) {
    return Handle::failed(Error(ErrorCode::kInvalidArgument,
                                fmt::format("learning rate must be > 0 and finite (got {})",
                                            learning_rate)));
  }
  // The payload must outlive the send: it is copied into the batch at once
  // (8 bytes are always a small message), so a local is enough.
  const auto bytes = proto::encode_f64(learning_rate);
  return impl_->broadcast(proto::MsgType::kSetLearningRate, bytes, proto::DType::kFloat64, 1,
                          false, 0);
}

Handle Worker::checkpoint() {
  return impl_->broadcast(proto::MsgType::kCheckpoint, {}, proto::DType::kNone, 0, false, 0);
}

std::size_t Worker::pending_requests() const { return impl_->pending.size(); }

std::size_t Worker::tracked_deadlines() const {
  std::lock_guard lock(impl_->timer_mutex);
  return impl_->timers.size();
}

std::uint64_t Worker::step(Key key) const {
  auto ks = impl_->key_state(key);
  return ks ? ks->next_step.load(std::memory_order_acquire) : 0;
}

Pipeline Worker::pipeline() { return Pipeline(impl_.get()); }

// ---------------------------------------------------------------------------
// Pipeline

Pipeline::Pipeline(Worker::Impl* impl) : impl_(impl), mutex_(std::make_unique<std::mutex>()) {}

Pipeline::Pipeline(Pipeline&& o) noexcept
    : impl_(std::exchange(o.impl_, nullptr)),
      handles_(std::move(o.handles_)),
      mutex_(std::move(o.mutex_)) {}

Pipeline::~Pipeline() {
  if (impl_ != nullptr) (void)flush();
}

Handle Pipeline::enqueue(Key key, std::span<const float> gradient) {
  Handle h = impl_->tensor_op(proto::MsgType::kPush, key, gradient, {}, std::nullopt, true);
  std::lock_guard lock(*mutex_);
  handles_.push_back(h);
  return h;
}

Handle Pipeline::enqueue_pull(Key key, std::span<float> out) {
  Handle h = impl_->tensor_op(proto::MsgType::kPull, key, {}, out, std::nullopt, true);
  std::lock_guard lock(*mutex_);
  handles_.push_back(h);
  return h;
}

Handle Pipeline::enqueue_push_pull(Key key, std::span<const float> gradient, std::span<float> out) {
  Handle h = impl_->tensor_op(proto::MsgType::kPushPull, key, gradient, out, std::nullopt, true);
  std::lock_guard lock(*mutex_);
  handles_.push_back(h);
  return h;
}

Status Pipeline::flush() { return impl_->flush_all_rings(); }

Status Pipeline::wait() {
  Status first = flush();
  std::vector<Handle> handles;
  {
    std::lock_guard lock(*mutex_);
    handles = std::move(handles_);
    handles_.clear();
  }
  Status all = wait_all(handles);
  if (first && !all) first = all;
  return first;
}

}  // namespace ember
