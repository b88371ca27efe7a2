// Shard thread: ring → ShardCore → ReplySink; see shard.h.
#include "server/shard.h"

#include <pthread.h>
#include <sched.h>

#include <fmt/format.h>

#include "common/base/logging.h"
#include "common/base/sync_point.h"
#include "common/placement/placement.h"

namespace ember::server {

std::uint32_t shard_of(std::uint64_t key, std::uint32_t chunk_index, std::uint32_t num_shards) {
  // The key picks where its chunk 0 goes (re-mixed, so that shards are
  // independent of server_of/channel_of); chunk i goes i shards further on.
  // A large tensor's chunks are therefore dealt round-robin over the shards
  // and applied in parallel, not left to a hash that can give one shard 36
  // of 64 chunks.
  const std::uint64_t first = placement::mix64(key ^ 0x5AFE5AFE5AFE5AFEULL) % num_shards;
  return static_cast<std::uint32_t>((first + chunk_index % num_shards) % num_shards);
}

Result<std::unique_ptr<Shard>> Shard::create(ShardOptions options, Optimizer optimizer,
                                             ShardHooks hooks) {
  ring::MpscOptions ro;
  ro.lane_capacity = options.ring_slots;
  ro.max_producers = options.max_producers;
  ring::ParkOptions park;
  park.busy_poll = options.busy_poll;
  EMBER_ASSIGN_OR_RETURN(auto ring, ring::BlockingMpscRing<ShardItem>::create(ro, park));
  return std::unique_ptr<Shard>(
      new Shard(std::move(options), std::move(optimizer), std::move(hooks), std::move(ring)));
}

Shard::Shard(ShardOptions options, Optimizer optimizer, ShardHooks hooks,
             std::unique_ptr<ring::BlockingMpscRing<ShardItem>> ring)
    : options_(std::move(options)),
      hooks_(std::move(hooks)),
      core_(options_.core, std::move(optimizer)),
      ring_(std::move(ring)) {
  if (options_.has_barrier) {
    barrier_.emplace(options_.core.num_workers, options_.core.loss_policy,
                     options_.core.worker_timeout);
  }
  membership_seq_.assign(options_.core.num_workers, 0);
}

Shard::~Shard() {
  stop();
  join();
}

namespace {
thread_local bool t_shard_thread = false;
}  // namespace

bool Shard::on_shard_thread() noexcept { return t_shard_thread; }

void Shard::start() {
  thread_ = std::thread([this] {
    t_shard_thread = true;
    run();
  });
}

bool Shard::newest_membership_event(const ShardItem& item) {
  if (item.membership_seq == 0 || item.rank >= membership_seq_.size()) return true;
  std::uint64_t& newest = membership_seq_[item.rank];
  if (item.membership_seq <= newest) return false;  // overtaken by a newer event
  newest = item.membership_seq;
  return true;
}

void Shard::post(ShardItem&& item) {
  // acquire pairs with the release in drain_overflow(): once the shard has
  // emptied the list, earlier overflow items are handled before ring items.
  if (overflow_count_.load(std::memory_order_acquire) == 0 && ring_->try_push(std::move(item))) {
    return;
  }
  {
    std::lock_guard lock(overflow_mutex_);
    overflow_.push_back(std::move(item));
    overflow_count_.fetch_add(1, std::memory_order_release);
  }
  ring_->wake();
}

bool Shard::try_handle_inline(ShardItem& item) {
  // Queued items come first: they are older (this producer's own, or
  // another's that arrived earlier).
  auto idle = [this] {
    // acquire pairs with post()'s release of the overflow count.
    return overflow_count_.load(std::memory_order_acquire) == 0 && ring_->empty_approx();
  };
  if (!idle()) return false;
  std::unique_lock lock(consumer_mutex_, std::try_to_lock);
  // Re-checked under the lock: the shard thread takes items only under it,
  // so an empty ring now means every item this caller posted before was
  // handled to the end.
  if (!lock.owns_lock() || !idle()) return false;
  handle(item);
  publish_stats();
  return true;
}

std::size_t Shard::drain_overflow() {
  if (overflow_count_.load(std::memory_order_acquire) == 0) return 0;
  // Everything a producer put in the ring before it overflowed comes first.
  auto handle_item = [this](ShardItem& item) { handle(item); };
  while (ring_->consume(handle_item, 1024) != 0) {
  }
  std::deque<ShardItem> items;
  {
    std::lock_guard lock(overflow_mutex_);
    items.swap(overflow_);
    overflow_count_.store(0, std::memory_order_release);
  }
  for (ShardItem& item : items) handle(item);
  return items.size();
}

void Shard::stop() {
  stopping_.store(true, std::memory_order_release);
  ring_->wake();
}

void Shard::join() {
  if (thread_.joinable()) thread_.join();
}

void Shard::run() {
  const std::string name = fmt::format("ember-shard-{}", options_.index);
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  if (options_.cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(*options_.cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) {
      log::logger("server")->warn(
          "{}: cannot pin to CPU {}; running unpinned; see docs/troubleshooting.md#throughput-drops",
          name, *options_.cpu);
    }
  }
  auto handle_item = [this](ShardItem& item) { handle(item); };
  while (true) {
    std::chrono::nanoseconds timeout = std::chrono::milliseconds(200);
    const TimePoint now = Clock::now();
    std::optional<TimePoint> deadline = core_.next_deadline();
    if (barrier_) {
      auto b = barrier_->next_deadline();
      if (b && (!deadline || *b < *deadline)) deadline = b;
    }
    if (deadline) {
      timeout = std::max<std::chrono::nanoseconds>(std::chrono::nanoseconds(0),
                                                    std::min(timeout, *deadline - now));
    }
    // Wait for items without taking them, then take them under the
    // consumer lock (try_handle_inline may hold it meanwhile).
    if (overflow_count_.load(std::memory_order_acquire) == 0) (void)ring_->wait_for_items(timeout);
    std::size_t n = 0;
    {
      std::lock_guard lock(consumer_mutex_);
      n = ring_->consume(handle_item, 64);
      n += drain_overflow();
      if (deadline && Clock::now() >= *deadline) {
        core_.on_tick(Clock::now(), *hooks_.sink);
        if (barrier_) barrier_->on_tick(Clock::now(), *hooks_.sink);
      }
      if (n != 0) publish_stats();
    }
    if (hooks_.after_batch) hooks_.after_batch();
    if (n == 0 && stopping_.load(std::memory_order_acquire)) {
      // Drain: everything queued before stop() is handled before exiting.
      std::lock_guard lock(consumer_mutex_);
      while (ring_->consume(handle_item, 1024) != 0 || drain_overflow() != 0) {
      }
      publish_stats();
      if (hooks_.after_batch) hooks_.after_batch();
      return;
    }
  }
}

void Shard::handle(ShardItem& item) {
  const TimePoint now = Clock::now();
  ReplySink& sink = *hooks_.sink;
  switch (item.kind) {
    case ShardItem::Kind::kRequest: {
      const Request& r = item.request;
      switch (r.header.type) {
        case proto::MsgType::kInit:
          core_.on_init(r, std::span<const std::uint64_t>(item.dims.data(), r.header.ndim),
                        std::move(item.payload), now, sink);
          break;
        case proto::MsgType::kPush:
          core_.on_push(r, std::move(item.payload), now, sink);
          break;
        case proto::MsgType::kPull:
          core_.on_pull(r, now, sink);
          break;
        case proto::MsgType::kPushPull:
          core_.on_push_pull(r, std::move(item.payload), now, sink);
          break;
        case proto::MsgType::kBarrier:
          if (barrier_) {
            barrier_->on_barrier(r, now, sink);
          } else {
            sink.error(r.to, r.header,
                       Error(ErrorCode::kInternal, "barrier routed to a shard without one"));
          }
          break;
        default:
          sink.error(r.to, r.header,
                     Error(ErrorCode::kInternal,
                           fmt::format("{} routed to a shard", proto::msg_type_name(r.header.type))));
          break;
      }
      if (hooks_.on_handled) hooks_.on_handled(r.header.type, now - item.received);
      if (hooks_.recorder != nullptr) [[unlikely]] {
        hooks_.recorder->on_dequeue(r.to.channel, 1, item.message_bytes);
      }
      break;
    }
    case ShardItem::Kind::kWorkerLost:
      if (!newest_membership_event(item)) break;
      core_.on_worker_lost(item.rank, now, sink, item.departure);
      if (barrier_) barrier_->on_worker_lost(item.rank, now, sink, item.departure);
      break;
    case ShardItem::Kind::kWorkerBack:
      if (!newest_membership_event(item)) break;
      core_.on_worker_back(item.rank, now, sink);
      if (barrier_) barrier_->on_worker_back(item.rank);
      break;
    case ShardItem::Kind::kDropConnection:
      core_.drop_connection(item.request.to.connection_id);
      if (barrier_) barrier_->drop_connection(item.request.to.connection_id);
      break;
    case ShardItem::Kind::kSetLearningRate:
      if (Status s = core_.set_learning_rate(item.value); !s && hooks_.on_error) {
        hooks_.on_error(s.error());
      }
      if (item.countdown) item.countdown->arrive();
      break;
    case ShardItem::Kind::kSendRaw:
      if (hooks_.send_raw) hooks_.send_raw(item.request.to, item.raw);
      break;
    case ShardItem::Kind::kJoined:
      item.request.header.step =
          barrier_ ? barrier_->on_join(item.rank, item.request.to.connection_id, sink) : 0;
      if (hooks_.send_raw) {
        hooks_.send_raw(item.request.to, proto::encode_message(item.request.header, {}, item.raw));
      }
      break;
    case ShardItem::Kind::kProbe:
      // Passed by the shard thread as it takes a liveness probe: a test
      // stalls it here to play a stuck shard.
      EMBER_SYNC_POINT("Shard::handle:probe");
      if (item.countdown) item.countdown->arrive();
      break;
    case ShardItem::Kind::kSendReply:
      sink.reply(item.request.to, item.request.header,
                 std::span<const float>(reinterpret_cast<const float*>(item.raw.data()),
                                        item.raw.size() / sizeof(float)));
      break;
    case ShardItem::Kind::kSnapshot: {
      auto entries = core_.snapshot();
      auto& c = *item.collector;
      std::lock_guard lock(c.mutex);
      for (auto& e : entries) c.entries.push_back(std::move(e));
      c.learning_rate = core_.learning_rate();
      if (--c.remaining == 0) c.cv.notify_all();
      break;
    }
  }
}

}  // namespace ember::server
