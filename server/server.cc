// ember-server wiring: transport callbacks → shards → replies; checkpoints;
// metrics. See server.h for the design.
#include "server/server.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/base/logging.h"
#include "common/base/sync_point.h"
#include "common/memory/page_pool.h"
#include "common/memory/stream_copy.h"
#include "common/metrics/metrics.h"
#include "common/placement/placement.h"
#include "common/proto/message.h"
#include "common/proto/runtime.h"
#include "common/record/recorder.h"
#include "common/transport/tcp/address.h"
#include "common/transport/transport.h"
#include "server/checkpoint.h"
#include "server/metrics_http.h"
#include "server/shard.h"

namespace ember::server {
namespace {

// The traffic counters the server exports (bytes, frames, messages each
// way), summed over connections.
void add_traffic(transport::ConnectionStats& total, const transport::ConnectionStats& s) {
  total.bytes_received += s.bytes_received;
  total.bytes_sent += s.bytes_sent;
  total.frames_received += s.frames_received;
  total.frames_sent += s.frames_sent;
  total.messages_received += s.messages_received;
  total.messages_sent += s.messages_sent;
}

proto::Consistency to_proto(config::Consistency c) {
  switch (c) {
    case config::Consistency::kBsp: return proto::Consistency::kBsp;
    case config::Consistency::kAsp: return proto::Consistency::kAsp;
    case config::Consistency::kSsp: return proto::Consistency::kSsp;
  }
  return proto::Consistency::kBsp;
}

proto::LossPolicy to_proto(config::WorkerLossPolicy p) {
  switch (p) {
    case config::WorkerLossPolicy::kWait: return proto::LossPolicy::kWait;
    case config::WorkerLossPolicy::kShrink: return proto::LossPolicy::kShrink;
    case config::WorkerLossPolicy::kFail: return proto::LossPolicy::kFail;
  }
  return proto::LossPolicy::kWait;
}

proto::OptimizerCode to_proto(config::OptimizerType t) {
  switch (t) {
    case config::OptimizerType::kSgd: return proto::OptimizerCode::kSgd;
    case config::OptimizerType::kMomentum: return proto::OptimizerCode::kMomentum;
    case config::OptimizerType::kAdam: return proto::OptimizerCode::kAdam;
    case config::OptimizerType::kAdamW: return proto::OptimizerCode::kAdamW;
    case config::OptimizerType::kAdagrad: return proto::OptimizerCode::kAdagrad;
  }
  return proto::OptimizerCode::kSgd;
}

// Error replies logged per connection before going quiet.
constexpr std::uint32_t kLoggedErrorsPerConnection = 8;
// Requests of chunks up to this size may be handled on the I/O thread that
// received them (dispatch): at 64 KiB an optimizer update takes a few
// microseconds, about what the hand-off to a shard thread costs.
constexpr std::size_t kInlineMaxBytes = std::size_t{64} << 10;
// A request with at least this many more of its batch behind it goes to its
// shard thread even when the shard is idle: the batch is enough work to run
// on the shard threads in parallel, while the I/O thread decodes the rest.
// bench/pushpull, 10,000 keys of 64 bytes over shm (batches of ~35): a
// pipelined step took 61-63 ms with every request handled inline, 47-56 ms
// with none; a lone request (serial round trip) stays inline.
constexpr std::uint32_t kInlineMaxFollowing = 8;
// Ranks with their own step gauge.
constexpr std::uint32_t kMaxRankGauges = 256;

// On an I/O thread handling a request inline (dispatch): the shard whose
// item it is. A reply that cannot leave at once is posted to that shard, so
// a worker that stops reading holds back only the shards that own its keys,
// as when the shard handles the request itself; otherwise (no inline
// request) to shard connection_id % shards.
thread_local std::optional<std::uint32_t> t_inline_shard;

// Channels this (shard or control) thread sent on since its last flush.
struct Dirty {
  std::shared_ptr<transport::Connection> conn;
  std::uint32_t channel = 0;
};
thread_local std::vector<Dirty> t_dirty;

void mark_dirty(const std::shared_ptr<transport::Connection>& conn, std::uint32_t channel) {
  for (const Dirty& d : t_dirty) {
    if (d.conn == conn && d.channel == channel) return;
  }
  t_dirty.push_back(Dirty{conn, channel});
}

// Sends the open batches of every channel this thread wrote to.
void flush_dirty() {
  for (const Dirty& d : t_dirty) (void)d.conn->flush(d.channel);
  t_dirty.clear();
}

struct ConnState {
  std::uint64_t id = 0;
  std::shared_ptr<transport::Connection> conn;
  std::uint32_t rank = 0;
  std::string peer;
  // A data request whose payload is the next message on its channel. Each
  // slot is touched only by the I/O thread of its channel.
  struct Pending {
    bool active = false;
    proto::Header header;
    std::array<std::uint64_t, proto::kMaxDims> dims{};
    std::optional<proto::ReplyPlacement> placement;
  };
  std::vector<Pending> pending;
  // Held while a header and its following payload are sent, so that replies
  // from different shard threads do not interleave on a channel.
  std::vector<std::unique_ptr<std::mutex>> send_mutex;
  std::atomic<std::uint32_t> errors_logged{0};
  std::atomic<bool> placement_warned{false};  // an unusable reply placement was logged
  std::atomic<bool> closing{false};
  // This server called close() on it (bad input, a refused join, a reply cut
  // short, shutdown): when it ends, the worker did not leave of its own accord.
  std::atomic<bool> closed_here{false};
  // Of those, a close whose cause the log already names (bad input: its
  // "closing the connection" line; shutdown): its end is logged as this
  // server's close, not with the transport's reason. A reply cut short is
  // not one: the send failed because the connection was failing, and the
  // transport's reason is the news.
  std::atomic<bool> close_explained{false};
  // Refused at accept (rank outside the job, or a rank that already has a
  // live connection): the worker's join is answered with this error, then
  // the connection is closed. Never counted in rank_connections.
  std::optional<Error> refused;
  // Stands for its rank: counted in rank_connections, its end is the rank's
  // loss. Set at accept unless refused there; cleared when its join is
  // refused (another [cluster] table, partition_bytes), so that a process
  // that never was a worker of this job neither brings a lost rank back nor
  // loses it again. Guarded by conns_mutex.
  bool member = false;
  // Its rank was lost when it connected: the rank is back (kWorkerBack) at
  // its first message that is not a refused join, not at accept.
  std::atomic<bool> back_pending{false};
  // Messages handled (on_message, past the checks of a refused connection):
  // a refused join that was the first takes the connection out of its
  // rank's count; one after other messages is a bad request of a member.
  std::atomic<std::uint64_t> messages{0};
};

}  // namespace

struct Server::Impl final : ReplySink {
  config::Config config;
  std::shared_ptr<spdlog::logger> log = log::logger("server");
  std::unique_ptr<memory::PagePool> pool;
  std::atomic<std::uint32_t> region_id{transport::MemoryLocation::kNoRegion};
  std::uint64_t small_message_limit = 0;
  transport::Kind transport_kind = transport::Kind::kTcp;  // set in start(), before the shards
  // Small requests may be handled on the I/O thread (dispatch): over shm
  // only. Over tcp the I/O thread's own cost per message is higher, and
  // taking the updates off the shard threads lowered pipelined 4 KiB pushes
  // from 107k-132k to 95k-122k per second (bench/pushpull) for a serial
  // round trip that already meets its target. Set in start().
  bool inline_small = false;

  metrics::Registry registry;
  metrics::Counter* bad_messages = nullptr;
  metrics::Counter* checksum_failures = nullptr;
  metrics::Counter* error_replies = nullptr;
  metrics::Counter* replies_in_place = nullptr;
  metrics::Counter* requests_inline = nullptr;
  metrics::Counter* replies_lent = nullptr;
  metrics::Gauge* lent_copies = nullptr;
  metrics::Counter* checkpoints_written = nullptr;
  metrics::Counter* checkpoint_failures = nullptr;
  metrics::Gauge* last_checkpoint_time = nullptr;
  metrics::Gauge* workers_connected = nullptr;
  metrics::Counter* bytes_in = nullptr;
  metrics::Counter* bytes_out = nullptr;
  metrics::Counter* frames_in = nullptr;
  metrics::Counter* frames_out = nullptr;
  metrics::Counter* messages_in = nullptr;
  metrics::Counter* messages_out = nullptr;
  metrics::Gauge* batch_fill = nullptr;
  metrics::Gauge* pool_in_use = nullptr;
  metrics::Gauge* pool_region = nullptr;
  metrics::Gauge* entries = nullptr;
  std::vector<metrics::Gauge*> ring_items;
  std::vector<metrics::Gauge*> worker_step;
  metrics::Histogram* latency_push = nullptr;
  metrics::Histogram* latency_pull = nullptr;
  metrics::Histogram* latency_push_pull = nullptr;
  metrics::Histogram* latency_other = nullptr;

  // Communication pattern recording ([communication] record_pattern); null
  // when off. Declared before the shards: their threads call its hooks.
  std::unique_ptr<record::Recorder> recorder;
  std::vector<std::unique_ptr<Shard>> shards;
  // Per shard, then per transport I/O thread: whether it took its last
  // liveness probe (check_liveness; the calling thread's).
  std::vector<std::shared_ptr<std::atomic<bool>>> liveness_probes;
  std::vector<std::shared_ptr<std::atomic<bool>>> io_liveness_probes;
  std::unique_ptr<transport::Transport> transport;
  std::unique_ptr<transport::Listener> listener;
  std::string address;
  std::unique_ptr<MetricsHttp> metrics_http;

  // Connections.
  mutable std::shared_mutex conns_mutex;
  std::unordered_map<const transport::Connection*, std::shared_ptr<ConnState>> by_ptr;
  std::unordered_map<std::uint64_t, std::shared_ptr<ConnState>> by_id;
  std::vector<std::uint32_t> rank_connections;  // guarded by conns_mutex
  std::vector<std::uint8_t> rank_lost;          // guarded by conns_mutex
  // Per rank: the number of its last loss or return (ShardItem::
  // membership_seq), counted in the order they are decided here: the
  // shards then apply a loss and a return posted from two I/O threads in
  // that order, whatever order their lanes deliver them in.
  std::vector<std::uint64_t> rank_events;       // guarded by conns_mutex
  std::condition_variable_any conns_cv;
  std::atomic<std::uint64_t> next_conn_id{1};
  // Counters of closed connections (refused joins included), folded into
  // the byte/frame counters. Taken inside conns_mutex, never around it.
  std::mutex closed_stats_mutex;
  transport::ConnectionStats closed_stats;

  // Checkpoints.
  std::mutex ckpt_mutex;
  std::condition_variable ckpt_cv;
  bool ckpt_stop = false;
  std::deque<Request> ckpt_waiters;  // worker requests waiting for a checkpoint
  std::uint64_t ckpt_local_requests = 0;
  std::uint64_t ckpt_local_done = 0;
  Result<std::uint64_t> ckpt_local_result = std::uint64_t{0};
  std::uint64_t next_sequence = 1;
  std::thread ckpt_thread;
  std::mutex ckpt_write_mutex;  // one checkpoint at a time

  bool shut_down = false;
  // init() finished: only then is a final checkpoint written, and only then
  // does shutdown() log "shutting down" / "stopped" (after a failed start
  // they came before its error and read as if the server had run).
  bool started = false;

  // ---- setup ----

  Status init(const config::Config& cfg);
  void make_metrics();
  Status restore_checkpoint();
  // Held from restore_checkpoint() until the Impl dies (after the last
  // checkpoint): this server's exclusive use of checkpoint_dir.
  CheckpointDirLock ckpt_lock;
  // kConfig when a restored chunk is not one this server owns under the
  // current partition_bytes and server list (see restore_checkpoint).
  Status check_checkpoint_layout(const CheckpointData& d, const std::string& path) const;
  // An init's chunk (num_chunks, chunk_index, offset, length) must be the
  // one placement::chunk_plan gives with this server's partition_bytes and
  // server list, and this server must own it: the store would otherwise
  // hold a layout that no worker of the job asks for, and that the next
  // restore refuses (check_checkpoint_layout). kInvalidArgument otherwise.
  Status check_init_layout(const proto::Header& h,
                           const std::array<std::uint64_t, proto::kMaxDims>& dims) const;

  // ---- transport callbacks (I/O threads) ----

  std::shared_ptr<ConnState> find(const transport::Connection& c) const {
    std::shared_lock lock(conns_mutex);
    auto it = by_ptr.find(&c);
    return it == by_ptr.end() ? nullptr : it->second;
  }
  std::shared_ptr<ConnState> find_id(std::uint64_t id) const {
    std::shared_lock lock(conns_mutex);
    auto it = by_id.find(id);
    return it == by_id.end() ? nullptr : it->second;
  }
  void on_accept(std::shared_ptr<transport::Connection> conn);
  void on_message(transport::Connection& conn, transport::Incoming&& msg);
  void on_closed(transport::Connection& conn, const Error& reason);
  void close_bad(ConnState& c, const Error& why);
  // Closes `c` from this side, marked as such (ConnState::closed_here).
  void close_here(ConnState& c, std::chrono::nanoseconds drain = std::chrono::seconds(1));
  // `more_in_batch`: the received message's Incoming::more_in_batch.
  void dispatch(ConnState& c, std::uint32_t channel, const proto::Header& h,
                const std::array<std::uint64_t, proto::kMaxDims>& dims, Payload payload,
                const std::optional<proto::ReplyPlacement>& placement = std::nullopt,
                std::uint32_t more_in_batch = 0);
  void handle_join(ConnState& c, std::uint32_t channel, const proto::MessageView& m);
  // A lost rank is back: at its connection's first message that is not a
  // refused join (c.back_pending). I/O thread.
  void rejoin(ConnState& c);
  // Answers a join with `why` and takes the connection out of its rank's
  // count (ConnState::member). I/O thread.
  void refuse_join(ConnState& c, std::uint32_t channel, const proto::Header& h, Error why);
  void handle_set_lr(ConnState& c, std::uint32_t channel, const proto::MessageView& m);
  void handle_checkpoint(ConnState& c, std::uint32_t channel, const proto::Header& h);
  // `membership_seq`: kWorkerLost/kWorkerBack's event number (ShardItem).
  void broadcast(ShardItem::Kind kind, std::uint32_t rank, std::uint64_t conn_id,
                 Departure departure = Departure::kLost, std::uint64_t membership_seq = 0);

  // ---- replies (shard threads, I/O threads, checkpoint thread) ----

  // `lease`: `payload` stays valid and unchanged while it is held
  // (ReplySink::reply_lent); a large reply over tcp is then sent from it
  // without a copy. Null: `payload` is valid only during the call.
  void send_message(const ReplyTo& to, const proto::Header& h, std::span<const std::byte> payload,
                    std::shared_ptr<const void> lease = nullptr);
  // Sends encoded bytes under the channel's send lock. An I/O thread must not
  // wait (for the lock, whose holder may be waiting for that thread to drain,
  // or for room): it sends only when both are there at once, and otherwise
  // hands the message to a shard thread (fallback_shard).
  void send_raw(const ReplyTo& to, std::span<const std::byte> bytes);
  // The same, to the connection already looked up.
  void send_raw_to(ConnState& c, const ReplyTo& to, std::span<const std::byte> bytes);
  // How long one try of a shard (or checkpoint) thread waits for room in a
  // worker's send queue (tcp, shm large) or ring (shm): heartbeat_timeout,
  // the silence after which a peer counts as gone.
  std::chrono::nanoseconds reply_wait() const { return config.communication.heartbeat_timeout; }
  // Runs `attempt` (a send that waits reply_wait(); a failed one queued
  // nothing) until it is not kTimeout, or until a kTimeout finds that nothing
  // left for the worker since the previous one (ConnectionStats::tx_progress):
  // a worker that drains its replies, however slowly (a slow link, big
  // tensors), is waited for as before (backpressure); one that reads nothing
  // is given up on after two tries. Stats are read only after a timeout.
  template <class Attempt>
  Status send_while_draining(ConnState& c, Attempt&& attempt) {
    std::optional<std::uint64_t> progress;  // at the previous timeout
    for (;;) {
      Status s = attempt();
      if (s || s.error().code() != ErrorCode::kTimeout) return s;
      const std::uint64_t now = c.conn->stats().tx_progress;
      if (progress == now) return s;
      progress = now;
    }
  }
  // After a reply from a thread that may wait was not sent (`e`). kTimeout
  // (send_while_draining saw no frame leave for reply_wait): the worker reads
  // none of its replies, and every reply to it would hold this thread, and
  // every worker its shard serves, as long again. Its connection is closed,
  // logged once with the peer: the worker reconnects and re-sends what it had
  // in flight (pushes are deduplicated), so nothing the server accepted is
  // lost. Other errors (kClosed: the worker went) are logged at debug level.
  void reply_not_sent(ConnState& c, const Error& e);
  // A shard thread never is one, and must not read `transport`: shutdown()
  // destroys it (joining the I/O threads) while the shards still drain.
  // The shard that sends a reply an I/O thread could not (t_inline_shard).
  std::uint32_t fallback_shard(const ReplyTo& to) const {
    return t_inline_shard ? *t_inline_shard : static_cast<std::uint32_t>(to.connection_id % shards.size());
  }
  bool on_io_thread() const {
    return !Shard::on_shard_thread() && transport && transport->on_io_thread();
  }
  void reply(const ReplyTo& to, const proto::Header& header, std::span<const float> values) override {
    send_message(to, header, std::as_bytes(values));
  }
  void reply_lent(const ReplyTo& to, const proto::Header& header, std::span<const float> values,
                  std::shared_ptr<const void> lease) override {
    send_message(to, header, std::as_bytes(values), std::move(lease));
  }
  using ReplySink::error;
  void error(const ReplyTo& to, const proto::Header& request, const Error& err,
             std::uint64_t reply_step) override;
  // ember_server_worker_step: pushes the shard recorded, not every push seen
  // (a refused one names a step the rank never reaches).
  void push_recorded(std::uint32_t rank, std::uint64_t step) override {
    if (rank < worker_step.size()) worker_step[rank]->raise_to(static_cast<double>(step));
  }
  // error() with the "bad request from worker" log line (naming `request`
  // as it came) only when `log_it` (false: a failure of the server's own,
  // logged where it happened).
  void reply_error(const ReplyTo& to, const proto::Header& request, const Error& err,
                   std::uint64_t reply_step, bool log_it);
  // Whether this is the first kOutOfStep refusal of (rank, key, chunk) (then it is logged).
  bool first_out_of_step(std::uint32_t rank, std::uint64_t key, std::uint32_t chunk);
  std::mutex out_of_step_mutex;
  std::set<std::tuple<std::uint32_t, std::uint64_t, std::uint32_t>> out_of_step_logged;

  // ---- checkpoints ----

  void checkpoint_loop();
  Result<std::uint64_t> write_checkpoint_now(bool shards_running);
  // Asks the checkpoint thread for a checkpoint and waits for it.
  Result<std::uint64_t> checkpoint_request();

  // ---- metrics ----

  void refresh_metrics();

  Status shutdown();
};

// ---------------------------------------------------------------------------
// setup

void Server::Impl::make_metrics() {
  bad_messages = &registry.counter("ember_server_bad_messages_total",
                                   "Messages that failed decoding or broke the protocol; each "
                                   "closed its connection");
  checksum_failures = &registry.counter("ember_server_checksum_failures_total",
                                        "Connections closed for a frame checksum mismatch");
  error_replies = &registry.counter("ember_server_error_replies_total",
                                    "Requests answered with an error (unknown key, shape, stale "
                                    "step, lost worker, ...)");
  replies_in_place = &registry.counter(
      "ember_server_replies_in_place_total",
      "Pull and push_pull replies whose parameters were written straight into the worker's "
      "memory (shm, proto kFlagInPlace)");
  requests_inline = &registry.counter(
      "ember_server_requests_inline_total",
      "Small push, pull and push_pull requests handled on the I/O thread that received them, "
      "their shard being idle (shm only), instead of being handed to the shard thread");
  replies_lent = &registry.counter(
      "ember_server_replies_zero_copy_total",
      "Large pull and push_pull replies sent over tcp straight from the parameter store, "
      "without a copy (bsp)");
  lent_copies = &registry.gauge(
      "ember_server_lent_copies",
      "Optimizer updates that found a zero-copy reply of the parameters still in flight and "
      "updated a copy instead (copy on write); should stay near 0");
  checkpoints_written =
      &registry.counter("ember_server_checkpoints_written_total", "Checkpoints written");
  // The checkpoint thread is outside the watchdog's liveness check (a slow
  // write must not get a serving server restarted): these two are how an
  // operator sees checkpoints stop or fail (docs/troubleshooting.md).
  checkpoint_failures = &registry.counter("ember_server_checkpoint_failures_total",
                                          "Checkpoint writes that failed (logged with the cause)");
  last_checkpoint_time = &registry.gauge(
      "ember_server_last_checkpoint_timestamp_seconds",
      "Unix time (seconds) at which the newest checkpoint began its snapshot: the one restored at "
      "start, then each one written; 0 before any");
  workers_connected =
      &registry.gauge("ember_server_workers_connected", "Worker ranks with a live connection");
  bytes_in = &registry.counter("ember_server_bytes_received_total", "Message payload bytes received");
  bytes_out = &registry.counter("ember_server_bytes_sent_total", "Message payload bytes sent");
  frames_in = &registry.counter("ember_server_frames_received_total", "Frames (batches and large) received");
  frames_out = &registry.counter("ember_server_frames_sent_total", "Frames (batches and large) sent");
  messages_in = &registry.counter("ember_server_messages_received_total", "Messages received");
  messages_out = &registry.counter("ember_server_messages_sent_total", "Messages sent");
  batch_fill = &registry.gauge("ember_server_batch_fill_ratio",
                               "Received payload bytes per frame over batch_threshold (capped at 1)");
  pool_in_use = &registry.gauge("ember_pool_bytes_in_use", "Page-pool bytes in allocated blocks");
  pool_region = &registry.gauge("ember_pool_region_bytes", "Page-pool region size");
  entries = &registry.gauge("ember_server_entries", "Tensor chunks stored on this server");
  // Info metric (value 1, the fact in the label) for `emberctl status`.
  registry
      .gauge("ember_pool_backing_info", "What backs the page pool: hugetlb, thp or plain pages",
             {{"backing", std::string(memory::backing_name(pool->backing()))}})
      .set(1);
  for (std::size_t i = 0; i < shards.size(); ++i) {
    ring_items.push_back(&registry.gauge("ember_server_shard_ring_items",
                                         "Items queued in a shard's ring",
                                         {{"shard", std::to_string(i)}}));
  }
  for (std::uint32_t r = 0; r < std::min(config.cluster.num_workers, kMaxRankGauges); ++r) {
    worker_step.push_back(&registry.gauge("ember_server_worker_step",
                                          "Highest push step recorded from a worker rank (refused pushes do not count)",
                                          {{"rank", std::to_string(r)}}));
  }
  const auto buckets = metrics::latency_us_buckets();
  latency_push = &registry.histogram("ember_server_request_latency_us",
                                     "Time from receipt to handling by the shard", buckets,
                                     {{"type", "push"}});
  latency_pull = &registry.histogram("ember_server_request_latency_us",
                                     "Time from receipt to handling by the shard", buckets,
                                     {{"type", "pull"}});
  latency_push_pull = &registry.histogram("ember_server_request_latency_us",
                                          "Time from receipt to handling by the shard", buckets,
                                          {{"type", "push_pull"}});
  latency_other = &registry.histogram("ember_server_request_latency_us",
                                      "Time from receipt to handling by the shard", buckets,
                                      {{"type", "other"}});
}

namespace {

// How a chunk that a peer's init or a checkpoint entry describes compares
// with the chunk this job's layout (placement::chunk_plan with the server's
// partition_bytes and server list) puts at its index. Computes that one chunk
// alone (placement::chunk_at), whatever the tensor's size.
struct LayoutComparison {
  std::uint64_t num_chunks = 0;  // chunks the layout cuts the tensor into
  bool same_count = false;       // the described count is num_chunks and its index < num_chunks
  placement::Chunk chunk;        // the layout's chunk at the index; set when same_count
  bool matches = false;          // same_count, and the offset and length agree

  // ", chunk i being elements [o, +n)" when same_count, else "".
  std::string expected_chunk_text(std::uint32_t index, std::uint64_t element_bytes) const {
    return same_count ? fmt::format(", chunk {} being elements [{}, +{})", index,
                                    chunk.offset_bytes / element_bytes, chunk.length_bytes / element_bytes)
                      : std::string();
  }
};

// pre: element_bytes > 0, partition_bytes > 0, num_servers > 0, and
// elements * element_bytes does not overflow (shapes are bounded by
// proto::kMaxElements, checked by the decoder and the checkpoint reader).
LayoutComparison compare_with_layout(std::uint64_t key, std::uint64_t bytes, std::uint64_t element_bytes,
                                     std::uint64_t partition_bytes, std::uint32_t num_servers,
                                     std::uint64_t num_chunks, std::uint32_t index,
                                     std::uint64_t offset_elements, std::uint64_t length_elements) {
  LayoutComparison c;
  c.num_chunks = placement::num_chunks(bytes, element_bytes, partition_bytes);
  c.same_count = num_chunks == c.num_chunks && index < c.num_chunks;
  if (!c.same_count) return c;
  c.chunk = placement::chunk_at(key, bytes, element_bytes, partition_bytes, index, num_servers, 1);
  c.matches = offset_elements * element_bytes == c.chunk.offset_bytes &&
              length_elements * element_bytes == c.chunk.length_bytes;
  return c;
}

}  // namespace

Status Server::Impl::check_checkpoint_layout(const CheckpointData& d, const std::string& path) const {
  // Every chunk must be one that this server, with this partition_bytes and
  // server list, owns: otherwise the workers' chunks (placement::chunk_plan)
  // would not match the restored ones and every init of the key would fail
  // with a shape error that does not say why.
  const auto& sc = config.server;
  const auto num_servers = static_cast<std::uint32_t>(config.cluster.servers.size());
  for (const auto& e : d.entries) {
    std::uint64_t elements = 1;
    for (const std::uint64_t dim : e.shape) elements *= dim;
    const std::uint64_t element_bytes = proto::dtype_bytes(e.dtype);
    if (element_bytes == 0) continue;  // the checkpoint reader refuses such entries
    const std::uint64_t bytes = elements * element_bytes;
    // (The reader refused chunks outside their tensor already.)
    const LayoutComparison want =
        compare_with_layout(e.key, bytes, element_bytes, sc.partition_bytes, num_servers, e.num_chunks,
                            e.chunk_index, e.offset_elements, e.params.size());
    if (!want.matches) {
      return make_error(ErrorCode::kConfig,
                        "checkpoint '{}' was written with another [server] partition_bytes: it "
                        "holds key {} ({} bytes) as chunk {} of {} (elements [{}, +{})), and "
                        "partition_bytes = {} cuts it into {} chunk(s){}; use the partition_bytes "
                        "the job started with, or another checkpoint_dir to start fresh",
                        path, e.key, bytes, e.chunk_index, e.num_chunks, e.offset_elements,
                        e.params.size(), sc.partition_bytes, want.num_chunks,
                        want.expected_chunk_text(e.chunk_index, element_bytes));
    }
    if (want.chunk.server != sc.server_index) {
      return make_error(ErrorCode::kConfig,
                        "checkpoint '{}' holds chunk {} of key {}, which with {} server(s) in "
                        "[cluster] servers belongs to server {}, not to this server {}: it was "
                        "written by a job with another server list; use the job's server list, "
                        "or another checkpoint_dir to start fresh",
                        path, e.chunk_index, e.key, num_servers, want.chunk.server, sc.server_index);
    }
  }
  return ok_status();
}

Status Server::Impl::check_init_layout(const proto::Header& h,
                                       const std::array<std::uint64_t, proto::kMaxDims>& dims) const {
  const std::uint64_t element_bytes = proto::dtype_bytes(h.dtype);
  if (element_bytes == 0) return ok_status();  // the shard refuses the dtype itself
  // The decoder checked the shape: its product is at most kMaxElements.
  std::uint64_t elements = 1;
  for (std::uint8_t d = 0; d < h.ndim; ++d) elements *= dims[d];
  const std::uint64_t bytes = elements * element_bytes;
  const auto& sc = config.server;
  const auto num_servers = static_cast<std::uint32_t>(config.cluster.servers.size());
  const LayoutComparison want =
      compare_with_layout(h.key, bytes, element_bytes, sc.partition_bytes, num_servers, h.num_chunks,
                          h.chunk_index, h.offset_elements, h.num_elements);
  if (!want.matches) {
    return make_error(ErrorCode::kInvalidArgument,
                      "init of key {} ({} bytes) as chunk {} of {} (elements [{}, +{})) is not "
                      "this job's layout: [server] partition_bytes = {} cuts it into {} chunk(s){}; "
                      "every worker and server of a job needs the same partition_bytes (the "
                      "Ember client computes it: use it, or the same placement::chunk_plan)",
                      h.key, bytes, h.chunk_index, h.num_chunks, h.offset_elements, h.num_elements,
                      sc.partition_bytes, want.num_chunks,
                      want.expected_chunk_text(h.chunk_index, element_bytes));
  }
  if (want.chunk.server != sc.server_index) {
    return make_error(ErrorCode::kInvalidArgument,
                      "init of chunk {} of key {} sent to server {}, but with {} server(s) in "
                      "[cluster] servers it belongs to server {}; every worker and server of a "
                      "job needs the same server list",
                      h.chunk_index, h.key, sc.server_index, num_servers, want.chunk.server);
  }
  return ok_status();
}

Status Server::Impl::restore_checkpoint() {
  const auto& sc = config.server;
  if (sc.checkpoint_dir.empty()) return ok_status();
  // Fail now, not at the first checkpoint (or at SIGTERM after the whole job).
  if (Status st = prepare_checkpoint_dir(sc.checkpoint_dir); !st) {
    Error err = st.error();
    err.with_context(
        "[server] checkpoint_dir is not usable (point it at a writable directory, or set it to "
        "\"\" to turn checkpoints off)");
    return tl::unexpected(err);
  }
  // Before reading anything: a second live server of this index on the
  // directory would restore the first one's state and replace its files.
  EMBER_ASSIGN_OR_RETURN(ckpt_lock, lock_checkpoint_dir(sc.checkpoint_dir, sc.server_index));
  // Refused files are renamed aside, so pruning after the next write keeps
  // the newest checkpoint_keep valid ones (the restored one among them).
  EMBER_ASSIGN_OR_RETURN(LoadResult loaded, load_newest_checkpoint(sc.checkpoint_dir, sc.server_index));
  next_sequence = loaded.next_sequence;
  if (!loaded.data) {
    if (loaded.refused.empty()) {
      log->info("no checkpoint to restore in '{}'", sc.checkpoint_dir);
    } else {
      // Every file was refused (each logged above): the job's state is not
      // restored, which the operator must notice.
      log->warn("no valid checkpoint in '{}': all {} refused and set aside as *.corrupt; starting "
                "with no parameters (workers' init registers them again). To restore, put a valid "
                "checkpoint back, or stop this server before the workers start",
                sc.checkpoint_dir, loaded.refused.size());
    }
    return ok_status();
  }
  CheckpointData& d = *loaded.data;
  if (d.optimizer != config.optimizer.type) {
    return make_error(ErrorCode::kConfig,
                      "checkpoint '{}' was written with optimizer \"{}\" but optimizer.type is "
                      "\"{}\"; use the same optimizer, or another checkpoint_dir to start fresh",
                      loaded.path.string(), config::to_string(d.optimizer),
                      config::to_string(config.optimizer.type));
  }
  if (d.consistency != to_proto(config.server.consistency)) {
    log->warn("checkpoint '{}' was written under consistency \"{}\"; continuing under \"{}\"",
              loaded.path.string(), proto::consistency_name(d.consistency),
              config::to_string(config.server.consistency));
  }
  if (d.hyper_parameters) {
    const std::string changed = changed_hyper_parameters(*d.hyper_parameters, config.optimizer);
    if (!changed.empty()) {
      log->warn("checkpoint '{}' was written with other [optimizer] settings: {}; this config's "
                "apply to the restored state from the next update on. Restart with the "
                "checkpoint's values to resume the same run (docs/checkpoint-format.md)",
                loaded.path.string(), changed);
    }
  } else if (const std::string changed = format1_default_changes(config.optimizer);
             !changed.empty()) {
    log->warn("checkpoint '{}' is in format 1, written by an earlier build whose [optimizer] "
              "defaults differ where this config sets nothing: {} (docs/checkpoint-format.md)",
              loaded.path.string(), changed);
  }
  EMBER_TRY(check_checkpoint_layout(d, loaded.path.string()));
  const std::size_t n = d.entries.size();
  for (auto& e : d.entries) {
    const std::uint32_t s = shard_of(e.key, e.chunk_index, static_cast<std::uint32_t>(shards.size()));
    if (Status st = shards[s]->restore(std::move(e)); !st) {
      Error err = st.error();
      err.with_context(fmt::format("restoring checkpoint '{}'", loaded.path.string()));
      return tl::unexpected(err);
    }
  }
  // The reader refused a rate that is not finite and > 0, so this holds;
  // should a shard refuse it anyway, the log names the rate in force.
  double rate_in_force = d.learning_rate;
  for (auto& s : shards) {
    if (Status st = s->set_learning_rate(d.learning_rate); !st) {
      log->warn("checkpoint learning rate {} refused ({}); keeping the configured rate",
                d.learning_rate, st.error().message());
      rate_in_force = config.optimizer.learning_rate;
    }
  }
  log->info("restored checkpoint '{}': sequence {}, {} tensor chunk(s), learning rate {}",
            loaded.path.string(), d.sequence, n, rate_in_force);
  last_checkpoint_time->set(static_cast<double>(d.created_unix_ns) * 1e-9);
  // The checkpoint's rate resumes the run as it was (a rate set at run time
  // included); one lowered in the config after a divergence would otherwise
  // be ignored without a word.
  if (rate_in_force != config.optimizer.learning_rate) {
    log->warn("checkpoint '{}' holds learning rate {}, the rate in force when it was written; it "
              "applies, not [optimizer] learning_rate {} of this config. To change it, call "
              "set_learning_rate from a worker after the restore",
              loaded.path.string(), rate_in_force, config.optimizer.learning_rate);
  }
  return ok_status();
}

Status Server::Impl::init(const config::Config& cfg) {
  config = cfg;
  const auto& sc = config.server;
  small_message_limit = config.communication.batch_threshold_bytes > 512
                            ? config.communication.batch_threshold_bytes - 256
                            : 256;

  EMBER_ASSIGN_OR_RETURN(pool, proto::make_pool(config, "server"));
  // The channel count the transport will use (proto::transport_options
  // resolves it the same way).
  EMBER_ASSIGN_OR_RETURN(
      recorder, record::Recorder::from_config(config, "server", sc.server_index,
                                              config::resolved_num_channels(config.communication)));
  if (recorder) {
    log->info("recording the communication pattern to '{}' ([communication] record_pattern)",
              recorder->path().string());
  }
  auto optimizer = Optimizer::create(config.optimizer);
  if (!optimizer) {
    return make_error(ErrorCode::kConfig, "optimizer: {}", optimizer.error().message());
  }

  EMBER_ASSIGN_OR_RETURN(transport::Options topts, proto::transport_options(config));
  transport_kind = topts.kind;
  inline_small = transport_kind == transport::Kind::kShm;
  for (std::uint32_t i = 0; i < sc.num_shards; ++i) {
    ShardOptions so;
    so.index = i;
    so.core.num_workers = config.cluster.num_workers;
    so.core.consistency = to_proto(sc.consistency);
    so.core.staleness = sc.staleness_steps;
    so.core.loss_policy = to_proto(sc.on_worker_loss);
    so.core.worker_timeout = sc.worker_timeout;
    so.core.name = fmt::format("server {} shard {}", sc.server_index, i);
    so.core.lend_params =
        transport_kind == transport::Kind::kTcp && sc.consistency == config::Consistency::kBsp;
    so.has_barrier = i == 0 && sc.server_index == 0;
    if (!sc.shard_cpu_affinity.empty()) {
      so.cpu = sc.shard_cpu_affinity[i % sc.shard_cpu_affinity.size()];
    }
    so.ring_slots = 1024;
    so.max_producers = config.communication.num_io_threads + 16;
    so.busy_poll = config.communication.busy_poll;
    ShardHooks hooks;
    hooks.sink = this;
    hooks.on_handled = [this](proto::MsgType type, std::chrono::nanoseconds latency) {
      const double us = std::chrono::duration<double, std::micro>(latency).count();
      switch (type) {
        case proto::MsgType::kPush: latency_push->observe(us); break;
        case proto::MsgType::kPull: latency_pull->observe(us); break;
        // Its own type: counted as a pull, a job of push_pulls showed no pushes.
        case proto::MsgType::kPushPull: latency_push_pull->observe(us); break;
        default: latency_other->observe(us); break;
      }
    };
    hooks.on_error = [this](const Error& e) { log->warn("shard: {}", e.to_string()); };
    hooks.send_raw = [this](const ReplyTo& to, std::span<const std::byte> bytes) {
      send_raw(to, bytes);
    };
    hooks.after_batch = [] { flush_dirty(); };
    hooks.recorder = recorder.get();
    EMBER_ASSIGN_OR_RETURN(auto shard, Shard::create(std::move(so), *optimizer, std::move(hooks)));
    shards.push_back(std::move(shard));
  }
  rank_connections.assign(config.cluster.num_workers, 0);
  rank_lost.assign(config.cluster.num_workers, 0);
  rank_events.assign(config.cluster.num_workers, 0);
  make_metrics();
  EMBER_TRY(restore_checkpoint());
  for (auto& s : shards) s->start();

  // Transport and listener.
  topts.receive_allocator = [this](std::uint64_t size) -> Result<transport::Buffer> {
    return proto::pool_receive_allocator(*pool, region_id.load(std::memory_order_acquire))(size);
  };
  const transport::Kind kind = topts.kind;
  EMBER_ASSIGN_OR_RETURN(transport, transport::Transport::create(std::move(topts)));
  transport::Transport::Region region{pool->base(), pool->length_bytes(), pool->fd()};
  EMBER_ASSIGN_OR_RETURN(const std::uint32_t rid, transport->register_memory(region));
  region_id.store(rid, std::memory_order_release);

  transport::Handlers handlers;
  handlers.on_message = [this](transport::Connection& c, transport::Incoming&& m) {
    on_message(c, std::move(m));
  };
  handlers.on_closed = [this](transport::Connection& c, const Error& reason) { on_closed(c, reason); };
  const std::string listen_at = proto::endpoint_address(kind, config::effective_listen(config));
  auto l = transport->listen(
      listen_at, transport::LocalIdentity{transport::Role::kServer, sc.server_index},
      [this](std::shared_ptr<transport::Connection> c) { on_accept(std::move(c)); }, handlers);
  if (!l) {
    Error err = l.error();
    if (err.sys_errno() == EADDRINUSE) {
      return tl::unexpected(Error(
          ErrorCode::kIo,
          fmt::format("[server] listen: {} is already in use: another process listens there "
                      "(another ember-server? `ss -ltnp` names it, `ss -lxp` for shm); stop it, or "
                      "give this server another address with --listen HOST:PORT",
                      listen_at),
          EADDRINUSE));
    }
    err.with_context("[server] listen");
    return tl::unexpected(err);
  }
  listener = std::move(*l);
  address = listener->address();
  // An shm listener's name is the address text, and workers use the text of
  // [cluster] servers: a --listen spelled otherwise ("127.0.0.1:7000" for
  // "localhost:7000") is a server no worker of this config finds.
  if (const config::HostPort& entry = config.cluster.servers.at(sc.server_index);
      kind == transport::Kind::kShm && sc.listen && sc.listen->port == entry.port &&
      sc.listen->host != entry.host) {
    log->warn("listening over shm as '{}', but [cluster] servers names this server '{}': shm "
              "workers look for '{}' and will not find this server; spell --listen (or [server] "
              "listen) as in [cluster] servers",
              listen_at, entry.to_string(), proto::endpoint_address(kind, entry));
  }

  if (sc.metrics_listen) {
    EMBER_ASSIGN_OR_RETURN(
        metrics_http,
        MetricsHttp::start(sc.metrics_listen->host, sc.metrics_listen->port, registry,
                           [this] { refresh_metrics(); },
                           [this]() -> Result<std::string> {
                             EMBER_ASSIGN_OR_RETURN(const std::uint64_t seq, checkpoint_request());
                             return fmt::format("sequence {}", seq);
                           },
                           config.communication.auth_token));
  }
  if (!sc.checkpoint_dir.empty()) ckpt_thread = std::thread([this] { checkpoint_loop(); });
  started = true;
  log->info("server {} of {} listening on {} ({}, {} channel(s), {} I/O thread(s), {} shard(s), "
            "{} consistency, optimizer {}, {} worker(s))",
            sc.server_index, config.cluster.servers.size(), address, transport::kind_name(kind),
            transport->options().num_channels, transport->options().num_io_threads, shards.size(),
            config::to_string(sc.consistency), config::to_string(config.optimizer.type),
            config.cluster.num_workers);
  return ok_status();
}

// ---------------------------------------------------------------------------
// transport callbacks

void Server::Impl::broadcast(ShardItem::Kind kind, std::uint32_t rank, std::uint64_t conn_id,
                             Departure departure, std::uint64_t membership_seq) {
  for (auto& s : shards) {
    ShardItem item;
    item.kind = kind;
    item.rank = rank;
    item.departure = departure;
    item.membership_seq = membership_seq;
    item.request.to.connection_id = conn_id;
    item.received = Clock::now();
    s->post(std::move(item));
  }
}

void Server::Impl::on_accept(std::shared_ptr<transport::Connection> conn) {
  const transport::PeerInfo& peer = conn->peer();
  auto new_state = [&] {
    auto state = std::make_shared<ConnState>();
    state->id = next_conn_id.fetch_add(1, std::memory_order_relaxed);
    state->conn = conn;
    state->rank = peer.rank;
    state->peer = peer.address;
    state->pending.resize(peer.num_channels);
    for (std::uint32_t i = 0; i < peer.num_channels; ++i) {
      state->send_mutex.push_back(std::make_unique<std::mutex>());
    }
    return state;
  };
  // A refused worker learns why from its join's error reply (then the
  // connection closes); anything else is closed at once.
  auto refuse = [&](Error why, std::shared_ptr<ConnState> state) {
    state->refused = std::move(why);
    std::unique_lock lock(conns_mutex);
    by_ptr[conn.get()] = state;
    by_id[state->id] = state;
  };
  if (peer.role != transport::Role::kWorker) {
    // Only workers talk to a server: a peer that says it is a server (or
    // anything else) is a misdirected process, not a worker with a bad rank.
    bad_messages->inc();
    log->warn("refusing {} '{}': its handshake says it is a {}, and ember-server serves only "
              "workers; servers never connect to each other, so check what runs at that address",
              transport::role_name(peer.role), peer.address, transport::role_name(peer.role));
    conn->close();
    return;
  }
  if (peer.rank >= config.cluster.num_workers) {
    bad_messages->inc();
    log->warn("refusing {} '{}' with rank {}: this job has {} worker(s) (cluster.num_workers); "
              "see docs/troubleshooting.md#worker-loss",
              transport::role_name(peer.role), peer.address, peer.rank, config.cluster.num_workers);
    refuse(Error(ErrorCode::kConfig,
                 fmt::format("rank {} is outside this job: it has {} worker(s) (ranks 0 .. {}; "
                             "[cluster] num_workers); give this worker a rank in that range or "
                             "every process the same [cluster] table",
                             peer.rank, config.cluster.num_workers, config.cluster.num_workers - 1)),
           new_state());
    return;
  }
  auto state = new_state();
  bool back = false;
  {
    // Two live workers with one rank would have each other's pushes dropped
    // as re-sends: refuse the second (retryable: a worker reconnecting
    // before this server noticed its old connection die gets in once the
    // old one is declared lost). Checked and counted under one lock, so two
    // I/O threads cannot both admit the same rank.
    std::unique_lock lock(conns_mutex);
    if (rank_connections[peer.rank] > 0) {
      std::string other;
      for (const auto& [id, s] : by_id) {
        if (s->rank == peer.rank && s->member) other = s->peer;
      }
      lock.unlock();
      log->warn("refusing worker '{}' with rank {}: rank {} is already connected from {}; see "
                "docs/troubleshooting.md#worker-loss",
                peer.address, peer.rank, peer.rank, other);
      refuse(Error(ErrorCode::kUnavailable,
                   fmt::format("rank {} is already connected from {}: two workers cannot share a "
                               "rank; give each a distinct rank, or, if that worker is gone, retry "
                               "after heartbeat_timeout ({} ms) has declared it lost",
                               peer.rank, other,
                               std::chrono::duration_cast<std::chrono::milliseconds>(
                                   config.communication.heartbeat_timeout)
                                   .count())),
             state);
      return;
    }
    // A member's id is taken here, under the lock that admits one
    // connection per rank at a time: a rank's connections get growing ids
    // in the order they are admitted, which BarrierCore::on_join relies on
    // (the id taken in new_state() could be older than that of a connection
    // of the rank admitted, and closed, in between).
    state->id = next_conn_id.fetch_add(1, std::memory_order_relaxed);
    by_ptr[conn.get()] = state;
    by_id[state->id] = state;
    state->member = true;
    back = rank_connections[peer.rank]++ == 0 && rank_lost[peer.rank];
    state->back_pending.store(back, std::memory_order_relaxed);
  }
  log->info("worker {} connected from {}{}", peer.rank, peer.address,
            back ? " (it had no connection; back once its join succeeds)" : "");
}

void Server::Impl::rejoin(ConnState& c) {
  std::uint64_t seq = 0;
  {
    std::lock_guard lock(conns_mutex);
    if (!c.back_pending.exchange(false)) return;
    if (c.member && rank_lost[c.rank]) {
      rank_lost[c.rank] = 0;
      seq = ++rank_events[c.rank];
    }
  }
  if (seq == 0) return;
  log->info("worker {} ({}) is back (rejoining)", c.rank, c.peer);
  broadcast(ShardItem::Kind::kWorkerBack, c.rank, 0, Departure::kLost, seq);
}

void Server::Impl::refuse_join(ConnState& c, std::uint32_t channel, const proto::Header& h,
                               Error why) {
  if (c.messages.load() == 1) {
    // The connection's first message: it never was the rank's worker.
    // (Later, it spoke as the rank already, perhaps brought it back: it
    // stays a member, and its close below is the rank's loss as usual.)
    std::lock_guard lock(conns_mutex);
    c.back_pending.store(false);
    if (c.member) {
      c.member = false;
      --rank_connections[c.rank];
    }
  }
  conns_cv.notify_all();
  // Answered, then closed (as a refusal at accept is): nothing more from
  // it is served, and the rank's slot is free for its real worker.
  if (c.closing.exchange(true)) return;
  error(ReplyTo{c.id, channel}, h, std::move(why));
  close_here(c);
}

void Server::Impl::on_closed(transport::Connection& conn, const Error& reason) {
  std::shared_ptr<ConnState> state;
  std::uint64_t lost_seq = 0;  // the rank's loss event, when its last connection went
  {
    std::unique_lock lock(conns_mutex);
    auto it = by_ptr.find(&conn);
    if (it == by_ptr.end()) return;  // refused at accept
    state = it->second;
    // Its bytes leave by_id, where refresh_metrics counts live connections:
    // they go to closed_stats first (a refused join's too), so the totals
    // never lose them between two scrapes.
    {
      const transport::ConnectionStats s = conn.stats();
      std::lock_guard stats_lock(closed_stats_mutex);
      add_traffic(closed_stats, s);
    }
    by_ptr.erase(it);
    by_id.erase(state->id);
    if (!state->member) {
      // Refused at accept or at its join: never counted as the rank's
      // connection. What it sent after a refused join (a raw client) goes.
      lock.unlock();
      conns_cv.notify_all();
      if (!state->refused) broadcast(ShardItem::Kind::kDropConnection, state->rank, state->id);
      return;
    }
    if (--rank_connections[state->rank] == 0) {
      rank_lost[state->rank] = 1;
      lost_seq = ++rank_events[state->rank];
    }
  }
  conns_cv.notify_all();
  if (reason.code() == ErrorCode::kChecksumMismatch) checksum_failures->inc();
  // A frame the decoder refused (bad fields, another wire version, over
  // max_message_size): the transport closed the connection for it.
  if (reason.code() == ErrorCode::kMalformedFrame || reason.code() == ErrorCode::kVersionMismatch ||
      reason.code() == ErrorCode::kTooLarge) {
    bad_messages->inc();
  }
  if (state->close_explained.load()) {
    // This server closed it for a cause logged already (bad input,
    // shutdown): however the transport saw the end (no goodbye, a reset),
    // that is what ended it.
    log->info("worker {} ({}) disconnected: this server closed the connection", state->rank,
              state->peer);
  } else if (reason.code() == ErrorCode::kClosed || reason.code() == ErrorCode::kCancelled) {
    log->info("worker {} ({}) disconnected", state->rank, state->peer);
  } else {
    // The pointer once: a transport reason may carry its own.
    const std::string why = reason.to_string();
    const bool pointed = why.find("docs/troubleshooting.md#") != std::string::npos;
    log->warn("worker {} ({}) lost: {}{}", state->rank, state->peer, why,
              pointed ? "" : "; see docs/troubleshooting.md#worker-loss");
  }
  broadcast(ShardItem::Kind::kDropConnection, state->rank, state->id);
  if (lost_seq != 0) {
    // An orderly close (kClosed: the worker's goodbye came) that this server
    // did not start: the worker closed it. Errors (no goodbye, reset,
    // heartbeat timeout) and this server's own closes are losses.
    const bool by_worker = reason.code() == ErrorCode::kClosed && !state->closed_here.load();
    broadcast(ShardItem::Kind::kWorkerLost, state->rank, state->id,
              by_worker ? Departure::kClosed : Departure::kLost, lost_seq);
  }
}

void Server::Impl::close_bad(ConnState& c, const Error& why) {
  bad_messages->inc();
  if (!c.closing.exchange(true)) {
    log->warn("closing the connection of worker {} ({}): {}", c.rank, c.peer, why.to_string());
  }
  c.close_explained.store(true);
  close_here(c);
}

void Server::Impl::close_here(ConnState& c, std::chrono::nanoseconds drain) {
  c.closed_here.store(true);
  c.conn->close(drain);
}

bool Server::Impl::first_out_of_step(std::uint32_t rank, std::uint64_t key, std::uint32_t chunk) {
  std::lock_guard lock(out_of_step_mutex);
  return out_of_step_logged.emplace(rank, key, chunk).second;
}

void Server::Impl::error(const ReplyTo& to, const proto::Header& request, const Error& err,
                         std::uint64_t reply_step) {
  reply_error(to, request, err, reply_step, true);
}

void Server::Impl::reply_error(const ReplyTo& to, const proto::Header& request, const Error& err,
                               std::uint64_t reply_step, bool log_it) {
  error_replies->inc();
  auto c = find_id(to.connection_id);
  if (!c) return;
  const bool noisy =
      log_it && err.code() != ErrorCode::kWorkerLost && err.code() != ErrorCode::kCancelled;
  // kOutOfStep: logged once per (rank, key, chunk), whatever the connection
  // (a restored server refuses each key of each worker once, then they resync).
  const bool out_of_step = err.code() == ErrorCode::kOutOfStep;
  if (out_of_step ? first_out_of_step(c->rank, request.key, request.chunk_index)
                  : noisy && c->errors_logged.fetch_add(1, std::memory_order_relaxed) <
                                 kLoggedErrorsPerConnection) {
    log->warn("bad request from worker {} ({}): {}: {}", c->rank, c->peer, proto::describe(request),
              err.to_string());
  }
  proto::Header answered = request;
  answered.step = reply_step;
  send_raw(to, proto::encode_error_reply(answered, err));
}

void Server::Impl::send_raw(const ReplyTo& to, std::span<const std::byte> bytes) {
  auto c = find_id(to.connection_id);
  if (!c) return;  // the worker went away; nothing to answer
  send_raw_to(*c, to, bytes);
}

void Server::Impl::send_raw_to(ConnState& c, const ReplyTo& to, std::span<const std::byte> bytes) {
  if (to.channel >= c.send_mutex.size()) return;
  if (on_io_thread()) {
    // Sent here when that cannot wait: the channel's lock is free and the
    // transport takes the message at once (on an I/O thread a send that
    // would wait fails instead). Flushed at once: an I/O thread has no
    // after_batch. Otherwise a shard thread sends it.
    {
      std::unique_lock channel_lock(*c.send_mutex[to.channel], std::try_to_lock);
      if (channel_lock.owns_lock() && c.conn->send(to.channel, bytes, std::chrono::nanoseconds(0))) {
        (void)c.conn->flush(to.channel);
        return;
      }
    }
    ShardItem item;
    item.kind = ShardItem::Kind::kSendRaw;
    item.request.to = to;
    item.raw.assign(bytes.begin(), bytes.end());
    shards[fallback_shard(to)]->post(std::move(item));
    return;
  }
  std::lock_guard channel_lock(*c.send_mutex[to.channel]);
  if (Status s = send_while_draining(c, [&] { return c.conn->send(to.channel, bytes, reply_wait()); });
      !s) {
    reply_not_sent(c, s.error());
  }
  mark_dirty(c.conn, to.channel);
}

void Server::Impl::reply_not_sent(ConnState& c, const Error& e) {
  if (e.code() != ErrorCode::kTimeout) {
    log->debug("reply to worker {} not sent: {}", c.rank, e.to_string());
    return;
  }
  if (c.closing.exchange(true)) return;
  log->warn("worker {} ({}) reads none of its replies: {} (nothing left for it in {} ms, twice "
            "[communication] heartbeat_timeout); closing its connection, so that this server's "
            "other workers are served; the worker reconnects and re-sends what it had in flight",
            c.rank, c.peer, e.message(),
            std::chrono::duration_cast<std::chrono::milliseconds>(2 * reply_wait()).count());
  c.close_explained.store(true);
  close_here(c, std::chrono::nanoseconds(0));
}

void Server::Impl::send_message(const ReplyTo& to, const proto::Header& h,
                                std::span<const std::byte> payload,
                                std::shared_ptr<const void> lease) {
  auto c = find_id(to.connection_id);
  if (!c) return;  // the worker went away; nothing to answer
  const std::size_t prefix = proto::prefix_bytes(h);
  const std::size_t total = prefix + payload.size();
  Status s;
  if (to.channel >= c->send_mutex.size()) return;
  // In place (proto::kFlagInPlace): the one copy of a pull reply goes
  // straight into the worker's destination, and the reply carries no data.
  // A placement this connection cannot write (not shm, outside the worker's
  // regions) is ignored: the data is sent as usual.
  bool placed = false;
  if (to.placement && h.status == ErrorCode::kOk && !payload.empty() &&
      (h.type == proto::MsgType::kPull || h.type == proto::MsgType::kPushPull)) {
    // A chunk of a tensor too large to stay in the cache is streamed
    // (memory/stream_copy.h); num_chunks x this chunk is the tensor's size
    // within one chunk.
    const auto copy = memory::use_stream_copy(std::size_t{h.num_chunks} * payload.size())
                          ? transport::Connection::PeerCopy::kStream
                          : transport::Connection::PeerCopy::kCached;
    Status w = c->conn->write_peer_memory(to.placement->region_id, to.placement->offset_bytes,
                                          payload, copy, to.placement->window);
    if (w) {
      placed = true;
    } else if (w.error().code() == ErrorCode::kClosed) {
      // The worker ended the connection, or closed this request's write
      // window (it gave up on the request): nothing to answer.
      return;
    } else if (!c->placement_warned.exchange(true, std::memory_order_relaxed)) {
      log->warn("worker {} ({}): reply placement not usable, sending the data instead: {}",
                c->rank, c->peer, w.error().message());
    }
  }
  // The reply to a placed request: its header alone, flagged kFlagInPlace.
  std::array<std::byte, proto::kHeaderBytes> in_place_header;
  if (placed) {
    replies_in_place->inc();
    proto::Header head = h;
    head.flags |= proto::kFlagInPlace;
    proto::encode_prefix(head, {}, in_place_header);
  }
  if (on_io_thread()) {
    // Sent without waiting (send_raw) when it is one small message: the
    // header alone when the data went in place, or a small reply. Large data
    // (a placement that could not be used) goes the usual way, header then
    // data from pool memory, sent by a shard thread, which may wait.
    if (placed) {
      send_raw_to(*c, to, in_place_header);
    } else if (total <= small_message_limit) {
      send_raw_to(*c, to, proto::encode_message(h, {}, payload));
    } else {
      ShardItem item;
      item.kind = ShardItem::Kind::kSendReply;
      item.request.to = to;
      item.request.to.placement.reset();  // tried above
      item.request.header = h;
      // Copy (named): the parameters as of now, since they change after
      // this call; the shard then copies them once more into pool memory.
      // Rare: dispatch inlines no pull whose reply needs it, so only a
      // placement that cannot be used, or another worker's parked pull
      // answered by an inline push, comes here.
      item.raw.assign(payload.begin(), payload.end());
      shards[fallback_shard(to)]->post(std::move(item));
    }
    return;
  }
  std::lock_guard channel_lock(*c->send_mutex[to.channel]);
  if (placed) {
    s = send_while_draining(*c, [&] { return c->conn->send(to.channel, in_place_header, reply_wait()); });
  } else if (total <= small_message_limit) {
    thread_local std::vector<std::byte> buf;
    buf.resize(total);
    proto::encode_prefix(h, {}, buf);
    if (!payload.empty()) std::memcpy(buf.data() + prefix, payload.data(), payload.size());
    s = send_while_draining(*c, [&] { return c->conn->send(to.channel, buf, reply_wait()); });
  } else {
    // Header, then the data as the next message in a block of exactly its
    // size. Over tcp a lent payload goes out from the parameter store (the
    // lease keeps it unchanged until the send completes). Otherwise the one
    // copy of a pull reply: the parameters as of now, into pool memory (shm
    // and rdma send from the pool only; the parameters change after this call).
    proto::Header head = h;
    head.flags |= proto::kFlagPayloadFollows;
    std::array<std::byte, proto::kHeaderBytes> hb;
    proto::encode_prefix(head, {}, hb);
    const bool lend = lease && transport_kind == transport::Kind::kTcp;
    if (lend) replies_lent->inc();
    // Made again for each try: a send that fails releases its Buffer.
    auto data = [&] {
      if (lend) {
        // The transport only reads a Buffer it sends.
        std::span<std::byte> bytes{const_cast<std::byte*>(payload.data()), payload.size()};
        return transport::Buffer::adopt(bytes, {}, lease);
      }
      transport::Buffer b =
          proto::allocate_buffer(*pool, payload.size(), region_id.load(std::memory_order_acquire));
      std::memcpy(b.data(), payload.data(), payload.size());
      return b;
    };
    s = send_while_draining(*c, [&] { return c->conn->send(to.channel, hb, reply_wait()); });
    if (s) {
      s = send_while_draining(*c, [&] { return c->conn->send(to.channel, data(), {}, reply_wait()); });
      // The header went out without its payload: the channel is out of step.
      if (!s && s.error().code() != ErrorCode::kTimeout) close_here(*c);
    }
  }
  if (!s) reply_not_sent(*c, s.error());
  mark_dirty(c->conn, to.channel);
}

void Server::Impl::dispatch(ConnState& c, std::uint32_t channel, const proto::Header& h,
                            const std::array<std::uint64_t, proto::kMaxDims>& dims, Payload payload,
                            const std::optional<proto::ReplyPlacement>& placement,
                            std::uint32_t more_in_batch) {
  if (h.type == proto::MsgType::kInit) {
    if (Status st = check_init_layout(h, dims); !st) {
      error(ReplyTo{c.id, channel}, h, st.error());
      return;
    }
  }
  ShardItem item;
  item.kind = ShardItem::Kind::kRequest;
  item.request.to = ReplyTo{c.id, channel};
  item.request.to.placement = placement;
  item.request.header = h;
  item.dims = dims;
  item.payload = std::move(payload);
  item.received = Clock::now();
  if (recorder) [[unlikely]] {
    // Before the post: the shard may handle it at once (head <= tail).
    item.message_bytes = proto::prefix_bytes(h) + item.payload.size() * sizeof(float);
    recorder->on_enqueue(channel, h.worker_rank, item.message_bytes);
  }
  const std::uint32_t s = h.type == proto::MsgType::kBarrier
                              ? 0
                              : shard_of(h.key, h.chunk_index, static_cast<std::uint32_t>(shards.size()));
  // A push, pull or push_pull of a chunk of at most kInlineMaxBytes, and with
  // fewer than kInlineMaxFollowing requests of its batch behind it, is
  // handled right here when the shard is idle (Shard::try_handle_inline):
  // handing it over cost a ring hop and the shard thread's wake-up, most of a
  // 4 KiB round trip. Its reply is as small (the chunk's elements, from the
  // header) and goes out through the I/O thread's non-waiting send
  // (send_message, send_raw). Larger chunks stay on the shard threads, where
  // their updates run in parallel and off the I/O thread.
  const bool small = item.payload.size() * sizeof(float) <= kInlineMaxBytes &&
                     h.num_elements <= kInlineMaxBytes / sizeof(float);
  // A pull's reply leaves from the I/O thread only when it is written in
  // place or fits one small message; otherwise the shard would send it
  // anyway (after a copy), so the shard handles the request.
  const bool reply_fits = h.type == proto::MsgType::kPush || placement.has_value() ||
                          proto::prefix_bytes(h) + h.num_elements * sizeof(float) <= small_message_limit;
  const bool data = h.type == proto::MsgType::kPush || h.type == proto::MsgType::kPull ||
                    h.type == proto::MsgType::kPushPull;
  if (inline_small && small && reply_fits && data && more_in_batch < kInlineMaxFollowing &&
      recorder == nullptr) {
    t_inline_shard = s;
    const bool handled = shards[s]->try_handle_inline(item);
    t_inline_shard.reset();
    if (handled) {
      requests_inline->inc();
      return;
    }
  }
  shards[s]->post(std::move(item));
}

void Server::Impl::handle_join(ConnState& c, std::uint32_t channel, const proto::MessageView& m) {
  const proto::Header& h = m.header;
  const auto body = proto::decode_join_request(m.payload.first<sizeof(proto::JoinRequestBody)>());
  const auto& cl = config.cluster;
  if (body.num_workers != cl.num_workers || body.num_servers != cl.servers.size() ||
      body.server_index != config.server.server_index) {
    refuse_join(c, channel, h,
          Error(ErrorCode::kConfig,
                fmt::format("worker {} has a different [cluster] table: it expects {} worker(s) "
                            "and {} server(s) and thinks this is server {}; this server has {} "
                            "worker(s), {} server(s) and is server {}. Give every process the same "
                            "[cluster] table",
                            c.rank, body.num_workers, body.num_servers, body.server_index,
                            cl.num_workers, cl.servers.size(), config.server.server_index)));
    return;
  }
  if (body.partition_check != 0 &&
      body.partition_check != proto::partition_check(config.server.partition_bytes)) {
    refuse_join(c, channel, h,
          Error(ErrorCode::kConfig,
                fmt::format("worker {} has a different [server] partition_bytes: this server cuts "
                            "tensors into chunks of {} bytes, and a worker that cuts them "
                            "otherwise would address other chunks. Give every process the same "
                            "partition_bytes",
                            c.rank, config.server.partition_bytes)));
    return;
  }
  proto::JoinReplyBody rb{};
  rb.num_workers = cl.num_workers;
  rb.num_servers = static_cast<std::uint32_t>(cl.servers.size());
  rb.server_index = config.server.server_index;
  rb.consistency = static_cast<std::uint8_t>(to_proto(config.server.consistency));
  rb.loss_policy = static_cast<std::uint8_t>(to_proto(config.server.on_worker_loss));
  rb.num_shards = static_cast<std::uint16_t>(shards.size());
  rb.staleness = config.server.consistency == config::Consistency::kSsp
                     ? config.server.staleness_steps
                     : 0;
  rb.optimizer = static_cast<std::uint8_t>(to_proto(config.optimizer.type));
  rb.nesterov = config.optimizer.type == config::OptimizerType::kMomentum && config.optimizer.nesterov;
  rb.optimizer_check = proto::optimizer_check(optimizer_numbers(config.optimizer));
  const auto body_bytes = proto::encode_body(rb);
  rejoin(c);  // before the reply: the shards see the rank back before its requests
  proto::Header reply = proto::reply_header(h);
  const ReplyTo to{c.id, channel};
  if (config.server.server_index != 0) {
    send_message(to, reply, body_bytes);
    return;
  }
  // Server 0's reply carries the number the rank's next barrier carries. The
  // barrier's shard gives it as it supersedes the rank's older connections
  // (BarrierCore::on_join), so no barrier of a predecessor completes after
  // the number is read.
  ShardItem item;
  item.kind = ShardItem::Kind::kJoined;
  item.rank = c.rank;
  item.request.to = to;
  item.request.header = reply;
  item.raw.assign(body_bytes.begin(), body_bytes.end());
  shards[0]->post(std::move(item));
}

void Server::Impl::handle_set_lr(ConnState& c, std::uint32_t channel, const proto::MessageView& m) {
  const double lr = proto::decode_f64(m.payload.first<8>());
  const ReplyTo to{c.id, channel};
  if (!std::isfinite(lr) || lr <= 0.0) {
    error(to, m.header,
          Error(ErrorCode::kInvalidArgument,
                fmt::format("learning rate must be > 0 and finite (got {})", lr)));
    return;
  }
  const proto::Header request = m.header;
  auto countdown = std::make_shared<Countdown>(
      static_cast<std::uint32_t>(shards.size()), [this, to, request] {
        send_message(to, proto::reply_header(request), {});
      });
  log->info("worker {} set the learning rate to {}", c.rank, lr);
  for (auto& s : shards) {
    ShardItem item;
    item.kind = ShardItem::Kind::kSetLearningRate;
    item.value = lr;
    item.countdown = countdown;
    s->post(std::move(item));
  }
}

void Server::Impl::handle_checkpoint(ConnState& c, std::uint32_t channel, const proto::Header& h) {
  if (config.server.checkpoint_dir.empty()) {
    error(ReplyTo{c.id, channel}, h,
          Error(ErrorCode::kConfig,
                "checkpoints are off on this server: set server.checkpoint_dir"));
    return;
  }
  {
    std::lock_guard lock(ckpt_mutex);
    ckpt_waiters.push_back(Request{ReplyTo{c.id, channel}, h});
  }
  ckpt_cv.notify_all();
}

void Server::Impl::on_message(transport::Connection& conn, transport::Incoming&& msg) {
  auto c = find(conn);
  if (!c) return;  // refused at accept, or closing
  if (msg.channel >= c->pending.size()) {
    close_bad(*c, Error(ErrorCode::kProtocol, fmt::format("message on channel {}", msg.channel)));
    return;
  }
  ConnState::Pending& pending = c->pending[msg.channel];
  if (pending.active) {
    pending.active = false;
    const proto::Header& h = pending.header;
    const std::uint64_t n = proto::tensor_bytes(h);
    if (msg.bytes.size() != n) {
      close_bad(*c, Error(ErrorCode::kMalformedFrame,
                          fmt::format("{}: announced {} payload bytes, the next message has {}",
                                      proto::describe(h), n, msg.bytes.size())));
      return;
    }
    Payload p = msg.is_large() ? Payload::adopt(std::move(msg.owned), 0, h.num_elements)
                               : Payload::copy_of(msg.bytes);
    dispatch(*c, msg.channel, h, pending.dims, std::move(p), pending.placement, msg.more_in_batch);
    return;
  }
  auto decoded = proto::decode(msg.bytes);
  if (!decoded) {
    close_bad(*c, decoded.error());
    return;
  }
  const proto::MessageView& m = *decoded;
  const proto::Header& h = m.header;
  if (c->refused) {
    // Answer the join with the reason, then close (the reply is sent first).
    // Sent here, on the I/O thread: no shard thread ever sends on a refused
    // connection, so there is no send lock to wait for; close() drains it.
    if (h.type == proto::MsgType::kJoin && !c->closing.exchange(true)) {
      error_replies->inc();
      const auto reply = proto::encode_error_reply(h, *c->refused);
      (void)c->conn->send(msg.channel, reply);
      (void)c->conn->flush(msg.channel);
      close_here(*c);
    }
    return;
  }
  if (h.is_reply()) {
    close_bad(*c, Error(ErrorCode::kProtocol, fmt::format("a worker sent a reply: {}", proto::describe(h))));
    return;
  }
  if (h.worker_rank != c->rank) {
    close_bad(*c, Error(ErrorCode::kProtocol,
                        fmt::format("{} claims rank {} but the connection's handshake said rank {}",
                                    proto::describe(h), h.worker_rank, c->rank)));
    return;
  }
  c->messages.fetch_add(1, std::memory_order_relaxed);
  if (c->back_pending.load(std::memory_order_relaxed) && h.type != proto::MsgType::kJoin)
      [[unlikely]] {
    rejoin(*c);  // a client that sends without a join (handle_join does it for joins)
  }
  switch (h.type) {
    case proto::MsgType::kJoin:
      handle_join(*c, msg.channel, m);
      return;
    case proto::MsgType::kSetLearningRate:
      handle_set_lr(*c, msg.channel, m);
      return;
    case proto::MsgType::kCheckpoint:
      handle_checkpoint(*c, msg.channel, h);
      return;
    case proto::MsgType::kBarrier:
      if (config.server.server_index != 0) {
        error(ReplyTo{c->id, msg.channel}, h,
              Error(ErrorCode::kInvalidArgument,
                    fmt::format("barrier sent to server {}; barriers are held by server 0",
                                config.server.server_index)));
        return;
      }
      dispatch(*c, msg.channel, h, m.dims, Payload{});
      return;
    case proto::MsgType::kInit:
    case proto::MsgType::kPush:
    case proto::MsgType::kPushPull:
    case proto::MsgType::kPull: {
      if ((h.flags & proto::kFlagPayloadFollows) != 0) {
        pending.active = true;
        pending.header = h;
        pending.dims = m.dims;
        pending.placement = m.placement;
        return;
      }
      Payload p;
      const bool has_data = h.type == proto::MsgType::kPush || h.type == proto::MsgType::kPushPull ||
                            (h.type == proto::MsgType::kInit && (h.flags & proto::kFlagNoData) == 0);
      if (has_data) {
        const std::size_t offset = proto::prefix_bytes(h);
        p = msg.is_large() ? Payload::adopt(std::move(msg.owned), offset, h.num_elements)
                           : Payload::copy_of(m.payload);
      }
      dispatch(*c, msg.channel, h, m.dims, std::move(p), m.placement, msg.more_in_batch);
      return;
    }
  }
}

// ---------------------------------------------------------------------------
// checkpoints

Result<std::uint64_t> Server::Impl::write_checkpoint_now(bool shards_running) {
  std::lock_guard write_lock(ckpt_write_mutex);
  const auto began = Clock::now();
  CheckpointData data;
  data.server_index = config.server.server_index;
  data.num_workers = config.cluster.num_workers;
  data.optimizer = config.optimizer.type;
  data.hyper_parameters = OptimizerHyperParameters::of(config.optimizer);
  data.consistency = to_proto(config.server.consistency);
  data.created_unix_ns = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::system_clock::now().time_since_epoch())
          .count());
  if (shards_running) {
    auto collector = std::make_shared<SnapshotCollector>();
    collector->remaining = static_cast<std::uint32_t>(shards.size());
    for (auto& s : shards) {
      ShardItem item;
      item.kind = ShardItem::Kind::kSnapshot;
      item.collector = collector;
      s->post(std::move(item));
    }
    std::unique_lock lock(collector->mutex);
    collector->cv.wait(lock, [&] { return collector->remaining == 0; });
    data.entries = std::move(collector->entries);
    data.learning_rate = collector->learning_rate;
  } else {
    for (auto& s : shards) {
      auto e = s->core().snapshot();
      for (auto& x : e) data.entries.push_back(std::move(x));
      data.learning_rate = s->core().learning_rate();
    }
  }
  std::sort(data.entries.begin(), data.entries.end(), [](const EntrySnapshot& a, const EntrySnapshot& b) {
    return a.key != b.key ? a.key < b.key : a.chunk_index < b.chunk_index;
  });
  data.sequence = next_sequence++;
  auto path = write_checkpoint(config.server.checkpoint_dir, data, config.server.checkpoint_keep);
  if (!path) {
    Error err = path.error();
    // What to do, for the causes an operator can fix.
    std::string_view hint;
    switch (err.sys_errno()) {
      case ENOSPC:
      case EDQUOT:
        hint = "free space on the file system of [server] checkpoint_dir, or lower "
               "[server] checkpoint_keep";
        break;
      case EROFS:
      case EACCES:
      case EPERM:
        hint = "make [server] checkpoint_dir writable for the server's user";
        break;
      default: break;
    }
    if (!hint.empty()) {
      // After the cause (to_string puts the errno text last).
      err = Error(err.code(), fmt::format("{}{}; {}", err.message(), err.cause(), hint));
    }
    checkpoint_failures->inc();
    log->error("checkpoint {} failed: {}", data.sequence, err.to_string());
    return tl::unexpected(err);
  }
  checkpoints_written->inc();
  last_checkpoint_time->set(static_cast<double>(data.created_unix_ns) * 1e-9);
  log->info("checkpoint {} written: '{}' ({} tensor chunk(s), {:.1f} ms)", data.sequence,
            path->string(), data.entries.size(),
            std::chrono::duration<double, std::milli>(Clock::now() - began).count());
  return data.sequence;
}

void Server::Impl::checkpoint_loop() {
  pthread_setname_np(pthread_self(), "ember-ckpt");
  const auto interval = config.server.checkpoint_interval;
  auto next_due = Clock::now() + interval;
  std::unique_lock lock(ckpt_mutex);
  while (true) {
    auto wake = [&] {
      return ckpt_stop || !ckpt_waiters.empty() || ckpt_local_requests > ckpt_local_done;
    };
    if (interval.count() > 0) {
      ckpt_cv.wait_until(lock, next_due, wake);
    } else {
      ckpt_cv.wait(lock, wake);
    }
    if (ckpt_stop) return;
    const bool due = interval.count() > 0 && Clock::now() >= next_due;
    if (!due && ckpt_waiters.empty() && ckpt_local_requests == ckpt_local_done) continue;
    std::deque<Request> waiters = std::move(ckpt_waiters);
    ckpt_waiters.clear();
    const std::uint64_t local_target = ckpt_local_requests;
    lock.unlock();
    auto result = write_checkpoint_now(true);
    for (const Request& w : waiters) {
      if (result) {
        proto::Header r = proto::reply_header(w.header);
        r.step = *result;
        send_message(w.to, r, {});
      } else {
        // The server's own failure, logged above: not a bad request.
        reply_error(w.to, w.header, result.error(), w.header.step, /*log_it=*/false);
      }
    }
    flush_dirty();
    lock.lock();
    ckpt_local_result = result;
    ckpt_local_done = local_target;
    ckpt_cv.notify_all();
    next_due = Clock::now() + interval;
  }
}

// ---------------------------------------------------------------------------
// metrics

void Server::Impl::refresh_metrics() {
  transport::ConnectionStats total;
  std::uint32_t connected = 0;
  {
    // conns_mutex first, as on_closed takes them: a connection is then
    // either still in by_id or already in closed_stats.
    std::shared_lock lock(conns_mutex);
    {
      std::lock_guard stats_lock(closed_stats_mutex);
      total = closed_stats;
    }
    for (const auto& [id, c] : by_id) add_traffic(total, c->conn->stats());
    for (auto n : rank_connections) connected += n > 0 ? 1 : 0;
  }
  workers_connected->set(connected);
  bytes_in->raise_to(total.bytes_received);
  bytes_out->raise_to(total.bytes_sent);
  frames_in->raise_to(total.frames_received);
  frames_out->raise_to(total.frames_sent);
  messages_in->raise_to(total.messages_received);
  messages_out->raise_to(total.messages_sent);
  if (total.frames_received > 0) {
    const double per_frame = static_cast<double>(total.bytes_received) /
                             static_cast<double>(total.frames_received);
    batch_fill->set(std::min(1.0, per_frame / static_cast<double>(config.communication.batch_threshold_bytes)));
  }
  const memory::PoolStats ps = pool->stats();
  pool_in_use->set(static_cast<double>(ps.bytes_in_use));
  pool_region->set(static_cast<double>(ps.region_bytes));
  std::uint64_t stored = 0, copies = 0;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    ring_items[i]->set(static_cast<double>(shards[i]->queued_approx()));
    stored += shards[i]->num_entries_approx();
    copies += shards[i]->lent_copies_approx();
  }
  entries->set(static_cast<double>(stored));
  lent_copies->set(static_cast<double>(copies));
}

// ---------------------------------------------------------------------------
// shutdown

Status Server::Impl::shutdown() {
  if (shut_down) return ok_status();
  shut_down = true;
  if (started) log->info("shutting down: draining connections and shards");
  listener.reset();
  std::vector<std::shared_ptr<ConnState>> open;
  {
    std::shared_lock lock(conns_mutex);
    for (const auto& [id, c] : by_id) open.push_back(c);
  }
  for (auto& c : open) {
    c->close_explained.store(true);
    close_here(*c, std::chrono::milliseconds(500));
  }
  {
    std::shared_lock lock(conns_mutex);
    conns_cv.wait_for(lock, std::chrono::seconds(2), [&] { return by_id.empty(); });
  }
  open.clear();
  {
    std::lock_guard lock(ckpt_mutex);
    ckpt_stop = true;
  }
  ckpt_cv.notify_all();
  if (ckpt_thread.joinable()) ckpt_thread.join();
  {
    // Connections still open after the drain leave the books before their
    // transport goes: a scrape during the rest of the shutdown
    // (refresh_metrics) must not ask a connection of a destroyed transport
    // for its stats. Their traffic stays counted.
    std::unique_lock lock(conns_mutex);
    std::lock_guard stats_lock(closed_stats_mutex);
    for (const auto& [id, c] : by_id) add_traffic(closed_stats, c->conn->stats());
    by_id.clear();
    by_ptr.clear();
  }
  transport.reset();  // joins the I/O threads: no more items after this
  for (auto& s : shards) s->stop();
  for (auto& s : shards) s->join();
  if (recorder) {
    // No hook runs any more: the I/O and shard threads are joined.
    if (Status s = recorder->close(); !s) {
      log->warn("communication pattern recording incomplete: {}", s.error().to_string());
    } else {
      log->info("communication pattern recorded to '{}'", recorder->path().string());
    }
  }
  Status result;
  if (started && !config.server.checkpoint_dir.empty()) {
    auto r = write_checkpoint_now(false);
    if (!r) result = tl::unexpected(r.error());
  }
  metrics_http.reset();
  if (started) log->info("stopped");
  return result;
}

// ---------------------------------------------------------------------------
// Server

Server::Server() : impl_(std::make_unique<Impl>()) {}

Server::~Server() {
  if (impl_) (void)impl_->shutdown();
}

Status check_listen_address(const config::Config& config) {
  if (const auto& metrics = config.server.metrics_listen) {
    // Resolved as the endpoint resolves it at start, whatever the transport.
    EMBER_TRY(MetricsHttp::resolve(metrics->host, metrics->port));
  }
  // tcp and rdma listeners refuse a non-loopback address without a token,
  // and "auto" listens with tcp (and rdma where a port is active); shm
  // stays on the host.
  if (config.communication.transport == config::Transport::kShm) return ok_status();
  const std::string address =
      proto::endpoint_address(transport::Kind::kTcp, config::effective_listen(config));
  auto endpoint = transport::tcp::resolve_endpoint(address);
  if (!endpoint) {
    Error e = endpoint.error();
    e.with_context("[server] listen (or [cluster] servers for this server_index, or --listen)");
    return tl::unexpected(e);
  }
  if (!endpoint->address().is_loopback() && config.communication.auth_token.empty()) {
    return make_error(ErrorCode::kConfig,
                      "listening on {} (not a loopback address) needs an auth token: set "
                      "[communication] auth_token to a shared secret on the server and the workers",
                      address);
  }
  return ok_status();
}

std::array<double, 7> optimizer_numbers(const config::OptimizerConfig& o) {
  // Only what the type reads (optimizer_uses). -0.0 is 0.0.
  auto used = [](bool use, double v) { return use && v != 0.0 ? v : 0.0; };
  const OptimizerUses u = optimizer_uses(o.type);
  return {used(true, o.learning_rate),       used(u.momentum, o.momentum),
          used(u.betas, o.beta1),            used(u.betas, o.beta2),
          used(u.epsilon, o.epsilon_or_default()), used(true, o.weight_decay_or_default()),
          used(u.initial_accumulator, o.initial_accumulator)};
}

Status check_checkpoint_dir(const config::Config& config) {
  const std::string& dir = config.server.checkpoint_dir;
  if (dir.empty()) return ok_status();
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path target = fs::absolute(dir, ec);
  if (ec) target = dir;
  // The nearest existing path: the directory itself, or the parent the
  // start will create it in.
  fs::path at = target;
  while (!fs::exists(at, ec) && at.has_parent_path() && at.parent_path() != at) {
    at = at.parent_path();
  }
  auto refuse = [&](const std::string& why) -> Status {
    return tl::unexpected(Error(
        ErrorCode::kConfig,
        fmt::format("[server] checkpoint_dir '{}': {}; point it at a writable directory, or set it "
                    "to \"\" to turn checkpoints off",
                    dir, why)));
  };
  if (!fs::is_directory(at, ec)) {
    return refuse(at == target ? std::string("is not a directory")
                               : fmt::format("cannot be created: '{}' is not a directory",
                                             at.string()));
  }
  if (Status st = probe_writable(at); !st) {
    return refuse(st.error().message() + st.error().cause());
  }
  return ok_status();
}

Status checkpoint_dir_free(const config::Config& config) {
  if (config.server.checkpoint_dir.empty()) return ok_status();
  return check_checkpoint_dir_free(config.server.checkpoint_dir, config.server.server_index);
}

Status check_record_path(const config::Config& config) {
  const config::CommunicationConfig& c = config.communication;
  if (!c.record_pattern || c.record_path.empty()) return ok_status();
  namespace fs = std::filesystem;
  const fs::path file = record::recording_path(c.record_path, "server", config.server.server_index);
  const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
  auto refuse = [&](const std::string& why) -> Status {
    return tl::unexpected(Error(
        ErrorCode::kConfig,
        fmt::format("[communication] record_path '{}': the recording '{}' cannot be written: {}; "
                    "create the directory, or point record_path into a writable one",
                    c.record_path, file.string(), why)));
  };
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return refuse(fmt::format("'{}' is not a directory (the recorder creates no directories)",
                              dir.string()));
  }
  if (Status st = probe_writable(dir); !st) return refuse(st.error().message() + st.error().cause());
  return ok_status();
}

Status check_shard_cpus(const config::Config& config) {
  return config::check_cpus_available(config.server.shard_cpu_affinity,
                                      "server.shard_cpu_affinity");
}

Result<std::unique_ptr<Server>> Server::create(const config::Config& config) {
  EMBER_TRY(config::validate(config, "config"));
  EMBER_TRY(check_shard_cpus(config));
  std::unique_ptr<Server> server(new Server());
  if (Status s = server->impl_->init(config); !s) {
    (void)server->impl_->shutdown();
    return tl::unexpected(s.error());
  }
  return server;
}

std::string Server::address() const { return impl_->address; }

std::string Server::metrics_address() const {
  return impl_->metrics_http ? impl_->metrics_http->address() : std::string();
}

Status Server::shutdown() { return impl_->shutdown(); }

Result<std::uint64_t> Server::checkpoint_now() { return impl_->checkpoint_request(); }

Status Server::check_liveness() {
  // Per thread: a probe still waiting from the previous call marks it stuck
  // and gets no second one behind it; a taken one is replaced by a fresh
  // probe, handed to `post` (false: not posted, nothing to watch).
  using Probes = std::vector<std::shared_ptr<std::atomic<bool>>>;
  auto sweep = [](Probes& probes, std::size_t threads, const auto& post) {
    probes.resize(threads);
    std::vector<std::uint32_t> stuck;
    for (std::uint32_t i = 0; i < threads; ++i) {
      if (probes[i] && !probes[i]->load(std::memory_order_acquire)) {
        stuck.push_back(i);
        continue;
      }
      probes[i] = std::make_shared<std::atomic<bool>>(false);
      if (!post(i, probes[i])) probes[i].reset();
    }
    return stuck;
  };
  auto& shards = impl_->shards;
  const auto stuck = sweep(impl_->liveness_probes, shards.size(), [&](std::uint32_t i, auto taken) {
    ShardItem item;
    item.kind = ShardItem::Kind::kProbe;
    item.countdown = std::make_shared<Countdown>(
        1, [taken] { taken->store(true, std::memory_order_release); });
    shards[i]->post(std::move(item));
    return true;
  });
  // The transport's I/O threads: one stuck in a handler stops every
  // connection it serves as surely as a stuck shard stops its keys.
  auto& transport = impl_->transport;
  const auto io_stuck = sweep(impl_->io_liveness_probes, transport ? transport->num_io_threads() : 0,
                              [&](std::uint32_t i, auto taken) {
                                return transport->post_to_io_thread(i, [taken] {
                                  // Passed by the I/O thread as it takes the probe: a
                                  // test stalls it here to play a stuck handler.
                                  EMBER_SYNC_POINT("Server::io_probe");
                                  taken->store(true, std::memory_order_release);
                                });
                              });
  if (stuck.empty() && io_stuck.empty()) return ok_status();
  std::string what;
  if (!stuck.empty()) what = fmt::format("shard thread(s) {}", fmt::join(stuck, ", "));
  if (!io_stuck.empty()) {
    what += fmt::format("{}I/O thread(s) {}", what.empty() ? "" : " and ", fmt::join(io_stuck, ", "));
  }
  return make_error(ErrorCode::kTimeout,
                    "{} of server {} ran no task since the previous liveness check (stuck in "
                    "one, or starved of CPU)",
                    what, impl_->config.server.server_index);
}

Result<std::uint64_t> Server::Impl::checkpoint_request() {
  if (config.server.checkpoint_dir.empty()) {
    return make_error(ErrorCode::kConfig, "checkpoints are off: set server.checkpoint_dir");
  }
  std::unique_lock lock(ckpt_mutex);
  if (ckpt_stop) return make_error(ErrorCode::kCancelled, "server shutting down");
  const std::uint64_t target = ++ckpt_local_requests;
  ckpt_cv.notify_all();
  ckpt_cv.wait(lock, [&] { return ckpt_local_done >= target || ckpt_stop; });
  if (ckpt_local_done < target) return make_error(ErrorCode::kCancelled, "server shutting down");
  return ckpt_local_result;
}

}  // namespace ember::server
