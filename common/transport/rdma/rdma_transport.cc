// rdma transport: the Transport, its Connections and Listeners, and the
// rdma_cm connection state machines. See rdma_transport.h for the model and
// internal.h for lifetimes; channel.cc has the data path.
#include "common/transport/rdma/rdma_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <future>
#include <map>
#include <random>
#include <utility>

#include <boost/asio/post.hpp>

#include "common/base/check.h"
#include "common/base/logging.h"
#include "common/base/units.h"
#include "common/transport/handshake.h"
#include "common/transport/rdma/internal.h"
#include "common/transport/rdma/memlock.h"
#include "common/transport/tcp/address.h"

namespace ember::transport::rdma {
namespace detail {
namespace {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// rdma_cm reject reason (IB CM REJ) when the listener's user rejected: the
// private data then carries its Reply.
constexpr int kRejectConsumerDefined = 28;
constexpr milliseconds kFirstBackoff{10};
constexpr milliseconds kMaxBackoff{500};
constexpr milliseconds kMaxResolveTimeout{2000};

std::shared_ptr<spdlog::logger> rdma_log() {
  static std::shared_ptr<spdlog::logger> l = log::logger("rdma");
  return l;
}

std::string sockaddr_to_string(const sockaddr* sa) {
  char text[INET6_ADDRSTRLEN] = {};
  if (sa == nullptr) return "?";
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    ::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text);
    return fmt::format("{}:{}", text, ntohs(in->sin_port));
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof text);
    return fmt::format("[{}]:{}", text, ntohs(in6->sin6_port));
  }
  return "?";
}

// Runs fn on the CM thread and waits for its result (never from the CM thread).
template <typename Fn>
auto run_on_cm(Core& core, Fn fn) -> decltype(fn()) {
  using R = decltype(fn());
  auto task = std::make_shared<std::packaged_task<R()>>(std::move(fn));
  std::future<R> f = task->get_future();
  core.cm->post([task] { (*task)(); });
  return f.get();
}

std::string device_mismatch(const Core& core, rdma_cm_id* id, const std::string& address) {
  return fmt::format("address {} belongs to RDMA device {}, but this transport uses {} (it registered "
                     "its memory there): use an address of {}'s netdev",
                     address, id->verbs != nullptr ? ::ibv_get_device_name(id->verbs->device) : "?",
                     core.device.device, core.device.device);
}

}  // namespace

// ---------------------------------------------------------------------------
// Core.

void Core::cancel_connects() {
  connects_cancelled = true;
  // Each finish() erases its own entry: run them from a moved-out list.
  auto cancellers = std::move(attempt_cancellers);
  attempt_cancellers.clear();
  for (auto& [id, cancel] : cancellers) cancel();
}

Core::~Core() {
  pollers.clear();
  for (ibv_comp_channel* c : comp_channels) {
    if (c != nullptr) ::ibv_destroy_comp_channel(c);
  }
  for (RegisteredRegion& r : regions) {
    if (r.mr != nullptr) ::ibv_dereg_mr(r.mr);
  }
  if (pd != nullptr) ::ibv_dealloc_pd(pd);
  if (device_list != nullptr) ::rdma_free_devices(device_list);
}

const RegisteredRegion* Core::find_region(const void* p, std::size_t n, std::uint32_t hint) const noexcept {
  const auto* b = static_cast<const std::byte*>(p);
  auto covers = [&](const RegisteredRegion& r) {
    return b >= r.base && n <= r.length && static_cast<std::uint64_t>(b - r.base) <= r.length - n;
  };
  if (b == nullptr) return nullptr;
  if (hint < regions.size() && covers(regions[hint])) return &regions[hint];
  for (const RegisteredRegion& r : regions) {
    if (covers(r)) return &r;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------
// RdmaConnection.

RdmaConnection::RdmaConnection(std::shared_ptr<Core> core, PeerInfo peer, Handlers handlers)
    : ConnectionCore(std::move(peer), std::move(handlers), core->options.max_queued_bytes,
                     core->options.max_message_bytes),
      core_(std::move(core)) {
  const std::uint32_t n = core_->options.num_channels;
  for (std::uint32_t i = 0; i < n; ++i) {
    const std::uint32_t io = core_->next_io.fetch_add(1, std::memory_order_relaxed) % core_->io->size();
    channels_.push_back(std::make_unique<Channel>(this, *core_, i, io));
  }
}

RdmaConnection::~RdmaConnection() = default;

void RdmaConnection::abort_setup() noexcept {
  suppress_on_closed();
  (void)begin_close();  // never handed out: later calls see a closed Connection
  for (auto& ch : channels_) {
    if (ch->id() != nullptr) {
      core_->cm->destroy_id(ch->id());
      ch->set_id(nullptr);
    }
    ch->release_unstarted();
  }
}

void RdmaConnection::start() {
  if (started_.exchange(true)) return;
  auto self = shared();
  for (auto& ch : channels_) {
    Channel* c = ch.get();
    // Refused only when the Transport is being destroyed meanwhile.
    (void)core_->io->post(core_->pollers[c->io_index()]->context(), [self, c] {
      c->start();
      // A failure before start() could not tear the channels down (set-up
      // owned them then): do it now.
      if (self->failing()) c->teardown();
    });
  }
}

void RdmaConnection::on_cm_event(std::uint32_t ch, const CmEvent& ev) {
  Channel* c = channels_[ch].get();
  auto self = shared();
  switch (ev.type) {
    case RDMA_CM_EVENT_DISCONNECTED:
      asio::post(core_->pollers[c->io_index()]->context(), [self, c] { c->on_disconnected(); });
      return;
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
      fail(Error(ErrorCode::kUnavailable,
                 fmt::format("RDMA device {} was removed (channel {} to {})", core_->device.device, ch,
                             describe_peer())));
      return;
    case RDMA_CM_EVENT_TIMEWAIT_EXIT:
      rdma_log()->debug("channel {} to {}: queue pair left timewait", ch, describe_peer());
      return;
    case RDMA_CM_EVENT_ADDR_CHANGE:
      rdma_log()->warn("channel {} to {}: the local address changed; the connection continues until "
                       "an error",
                       ch, describe_peer());
      return;
    case RDMA_CM_EVENT_ESTABLISHED:
      return;  // the passive side may see it after its set-up already completed
    default:
      // CONNECT_ERROR/UNREACHABLE/REJECTED after set-up: the channel is dead.
      fail(Error(ErrorCode::kIo, fmt::format("channel {} to {}: {} (status {})", ch, describe_peer(),
                                             cm_event_name(ev.type), ev.status)));
      return;
  }
}

Status RdmaConnection::send(std::uint32_t channel, std::span<const std::byte> bytes,
                            std::chrono::nanoseconds wait) {
  EMBER_TRY(check_send(channel, bytes.size()));
  if (bytes.size() > core_->geometry.max_batched_payload) {
    // Too big for a batch: copied once into a heap Buffer and sent as a
    // large message (as fragments: heap memory is not registered). Callers
    // with big payloads should pass a pool Buffer, which avoids both copies.
    Buffer copy = Buffer::heap(bytes.size());
    std::memcpy(copy.data(), bytes.data(), bytes.size());
    return send(channel, std::move(copy), {}, wait);
  }
  EMBER_TRY(flow().acquire(bytes.size(), wait, !core_->io->on_io_thread()));
  return channels_[channel]->send_small(bytes);
}

Status RdmaConnection::send(std::uint32_t channel, Buffer&& payload, SendCompletion done,
                            std::chrono::nanoseconds wait) {
  Buffer owned = std::move(payload);  // released on every error path below
  EMBER_TRY(check_send(channel, owned.size()));
  if (owned.size() <= core_->geometry.max_batched_payload) {
    // Copied into the batch: `done` runs here, on the caller thread, counted
    // so that on_closed comes after it (callers_completing_).
    {
      std::lock_guard lock(completing_mu_);
      ++callers_completing_;
    }
    Status s = send(channel, std::span<const std::byte>(owned.data(), owned.size()), wait);
    owned.reset();
    if (s && done) done(ok_status());
    bool announce = false;
    {
      std::lock_guard lock(completing_mu_);
      announce = --callers_completing_ == 0 && std::exchange(closed_when_callers_done_, false);
    }
    if (announce) {
      finish_closed();
      core_->io_object_removed();  // after on_closed, as channel_finished() counted it
    }
    return s;
  }
  EMBER_TRY(flow().acquire(owned.size(), wait, !core_->io->on_io_thread()));
  return channels_[channel]->send_large(std::move(owned), std::move(done));
}

Status RdmaConnection::flush(std::uint32_t channel) {
  EMBER_TRY(check_channel(channel));
  if (is_closed()) return closed_error();
  return channels_[channel]->flush();
}

void RdmaConnection::cork(std::uint32_t channel) {
  if (channel < channels_.size()) channels_[channel]->cork();
}

Status RdmaConnection::flush_all() {
  if (is_closed()) return closed_error();
  for (auto& ch : channels_) EMBER_TRY(ch->flush());
  return ok_status();
}

void RdmaConnection::close(std::chrono::nanoseconds drain) {
  if (!begin_close()) return;
  // A refused post: ~Transport has closed this Connection (kCancelled) and
  // is stopping the I/O threads; nothing is left to do (queued, it leaked).
  auto self = shared();
  for (auto& ch : channels_) {
    Channel* c = ch.get();
    (void)core_->io->post(core_->pollers[c->io_index()]->context(),
                          [self, c] { c->begin_goodbye(); });
  }
  // The drain bound: whatever is still open after it is torn down.
  asio::io_context& ctx = core_->pollers[channels_[0]->io_index()]->context();
  (void)core_->io->post(ctx, [self, &ctx, drain] { self->arm_drain_timer(ctx, drain); });
}

void RdmaConnection::start_teardown() {
  if (!started_.load()) return;  // set-up owns the channels (abort_setup)
  auto self = shared();
  for (auto& ch : channels_) {
    Channel* c = ch.get();
    // Never refused: the Transport's shutdown waits for this channel first.
    (void)core_->io->post(core_->pollers[c->io_index()]->context(), [self, c] { c->teardown(); });
  }
}

void RdmaConnection::request_disconnect(std::uint32_t ch) {
  auto self = shared();
  Channel* c = channels_[ch].get();
  core_->cm->post([self, c] {
    if (c->id() != nullptr) (void)::rdma_disconnect(c->id());
  });
}

void RdmaConnection::channel_finished() {
  if (!part_finished(channels_.size())) return;
  {
    std::lock_guard lock(completing_mu_);
    if (callers_completing_ > 0) {
      // The last caller out announces; until then ~Transport waits.
      closed_when_callers_done_ = true;
      core_->io_object_added();
      return;
    }
  }
  finish_closed();
}

void RdmaConnection::finish_closed() {
  cancel_drain_timer(core_->pollers[channels_[0]->io_index()]->context());
  announce_closed();
}

std::string RdmaConnection::debug_state() {
  std::string out;
  for (auto& ch : channels_) out += ch->debug_state() + "\n";
  return out;
}

RdmaStats RdmaConnection::rdma_stats() const noexcept {
  RdmaStats s;
  s.sends_posted = sends_posted.load(std::memory_order_relaxed);
  s.writes_posted = writes_posted.load(std::memory_order_relaxed);
  s.rts_sent = rts_sent.load(std::memory_order_relaxed);
  s.grants_received = grants_received.load(std::memory_order_relaxed);
  s.cached_slot_writes = cached_slot_writes.load(std::memory_order_relaxed);
  s.slots_released = slots_released.load(std::memory_order_relaxed);
  s.fragments_sent = fragments_sent.load(std::memory_order_relaxed);
  s.credit_messages_sent = credit_messages_sent.load(std::memory_order_relaxed);
  s.credit_stalls = credit_stalls.load(std::memory_order_relaxed);
  return s;
}

namespace {

// ---------------------------------------------------------------------------
// Active side: one channel's connect, as a state machine on the CM thread.
// The connecting thread waits for `done` (or its deadline, then cancels).

class ConnectAttempt : public std::enable_shared_from_this<ConnectAttempt> {
 public:
  ConnectAttempt(std::shared_ptr<Core> core, std::shared_ptr<RdmaConnection> conn, std::uint32_t ch,
                 const sockaddr_storage& dst, std::string address, Clock::time_point deadline,
                 std::vector<std::byte> private_data)
      : core_(std::move(core)),
        conn_(std::move(conn)),
        ch_(ch),
        dst_(dst),
        address_(std::move(address)),
        deadline_(deadline),
        private_data_(std::move(private_data)) {}

  // CM thread.
  void begin() {
    if (finished_) return;
    auto self = shared_from_this();
    if (core_->connects_cancelled) {
      finish(make_error(ErrorCode::kCancelled, "the transport is shutting down"));
      return;
    }
    if (!cancellable_) {
      cancellable_ = true;
      canceller_ = core_->next_attempt++;
      std::weak_ptr<ConnectAttempt> weak = self;
      core_->attempt_cancellers.emplace(canceller_, [weak] {
        if (auto a = weak.lock()) a->finish(make_error(ErrorCode::kCancelled, "the transport is shutting down"));
      });
    }
    auto id = core_->cm->create_id([self](const CmEvent& ev) { self->on_event(ev); });
    if (!id) {
      finish(tl::unexpected<Error>(std::move(id).error()));
      return;
    }
    id_ = *id;
    if (::rdma_resolve_addr(id_, nullptr, reinterpret_cast<sockaddr*>(&dst_),
                            resolve_timeout_ms()) != 0) {
      retry(fmt::format("rdma_resolve_addr: {}", std::strerror(errno)));
    }
  }

  // Caller thread: blocks until done or the deadline; then cancels.
  Result<handshake::Reply> wait() {
    std::unique_lock lock(mu_);
    if (!cv_.wait_until(lock, deadline_, [&] { return done_; })) {
      lock.unlock();
      auto self = shared_from_this();
      core_->cm->post([self] {
        self->finish(make_error(ErrorCode::kTimeout,
                                "no connection to {} on channel {} within connect_timeout{}",
                                self->address_, self->ch_,
                                self->last_failure_.empty() ? std::string()
                                                            : " (last failure: " + self->last_failure_ + ")"));
      });
      lock.lock();
      cv_.wait(lock, [&] { return done_; });
    }
    if (!result_) return tl::unexpected<Error>(result_.error());
    return reply_;
  }

 private:
  int resolve_timeout_ms() const {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline_ - Clock::now());
    return static_cast<int>(std::clamp(left, milliseconds(100), kMaxResolveTimeout).count());
  }

  void on_event(const CmEvent& ev) {
    if (finished_ || ev.id != id_) return;
    Channel& c = conn_->channel(ch_);
    switch (ev.type) {
      case RDMA_CM_EVENT_ADDR_RESOLVED:
        if (id_->verbs != core_->verbs) {
          finish(make_error(ErrorCode::kUnavailable, "{}", device_mismatch(*core_, id_, address_)));
          return;
        }
        if (::rdma_resolve_route(id_, resolve_timeout_ms()) != 0) {
          retry(fmt::format("rdma_resolve_route: {}", std::strerror(errno)));
        }
        return;
      case RDMA_CM_EVENT_ROUTE_RESOLVED: {
        if (Status s = c.create_qp(id_); !s) {
          finish(tl::unexpected<Error>(s.error()));
          return;
        }
        rdma_conn_param p{};
        p.private_data = private_data_.data();
        p.private_data_len = static_cast<std::uint8_t>(private_data_.size());
        p.responder_resources = 0;
        p.initiator_depth = 0;
        p.retry_count = 7;
        p.rnr_retry_count = 7;  // credits make RNR impossible; never give up if it happens
        if (::rdma_connect(id_, &p) != 0) retry(fmt::format("rdma_connect: {}", std::strerror(errno)));
        return;
      }
      case RDMA_CM_EVENT_ESTABLISHED: {
        auto reply = protocol::decode_reply_data(ev.private_data);
        if (!reply) {
          fail_established(std::move(reply).error());
          return;
        }
        if (reply->version != kProtocolVersion) {
          fail_established(Error(ErrorCode::kVersionMismatch,
                                 fmt::format("protocol version mismatch: this side speaks version {}, "
                                             "{} speaks version {}; run the same Ember release on "
                                             "both sides",
                                             kProtocolVersion, address_, reply->version)));
          return;
        }
        if (reply->num_channels != core_->options.num_channels) {
          fail_established(Error(ErrorCode::kProtocol,
                                 fmt::format("{} accepted {} channels, we asked for {}", address_,
                                             reply->num_channels, core_->options.num_channels)));
          return;
        }
        // From here the connection's handler takes this id's events.
        std::weak_ptr<RdmaConnection> weak = conn_;
        const std::uint32_t ch = ch_;
        core_->cm->set_handler(id_, [weak, ch](const CmEvent& e) {
          if (auto strong = weak.lock()) strong->on_cm_event(ch, e);
        });
        c.set_id(id_);
        id_ = nullptr;  // owned by the channel now
        reply_ = std::move(*reply);
        finish(ok_status());
        return;
      }
      case RDMA_CM_EVENT_REJECTED: {
        if (ev.status == kRejectConsumerDefined && !ev.private_data.empty()) {
          auto reply = protocol::decode_reply_data(ev.private_data);
          if (reply && reply->status != ErrorCode::kOk) {
            finish(tl::unexpected<Error>(Error(
                reply->status, fmt::format("{} refused the connection: {}", address_, reply->text))));
            return;
          }
        }
        finish(tl::unexpected<Error>(Error(
            ErrorCode::kIo,
            fmt::format("connection refused by {}: no Ember rdma listener on that address and port "
                        "(rdma_cm reject reason {})",
                        address_, ev.status),
            ECONNREFUSED)));
        return;
      }
      case RDMA_CM_EVENT_ADDR_ERROR:
      case RDMA_CM_EVENT_ROUTE_ERROR:
      case RDMA_CM_EVENT_UNREACHABLE:
      case RDMA_CM_EVENT_CONNECT_ERROR:
        retry(fmt::format("{} (status {})", cm_event_name(ev.type), ev.status));
        return;
      case RDMA_CM_EVENT_DISCONNECTED:
        retry("disconnected before the connection was established");
        return;
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
        finish(make_error(ErrorCode::kUnavailable, "RDMA device {} was removed while connecting to {}",
                          core_->device.device, address_));
        return;
      case RDMA_CM_EVENT_TIMEWAIT_EXIT:
      case RDMA_CM_EVENT_ADDR_CHANGE:
        rdma_log()->debug("connect to {}: {} (ignored)", address_, cm_event_name(ev.type));
        return;
      case RDMA_CM_EVENT_CONNECT_REQUEST:
      case RDMA_CM_EVENT_CONNECT_RESPONSE:
      case RDMA_CM_EVENT_MULTICAST_JOIN:
      case RDMA_CM_EVENT_MULTICAST_ERROR:
        // Not possible on an active id with a queue pair; never a hang.
        finish(make_error(ErrorCode::kInternal, "unexpected {} while connecting to {}",
                          cm_event_name(ev.type), address_));
        return;
    }
    finish(make_error(ErrorCode::kInternal, "unknown rdma_cm event {} while connecting to {}",
                      static_cast<int>(ev.type), address_));
  }

  void fail_established(Error e) {
    (void)::rdma_disconnect(id_);
    finish(tl::unexpected<Error>(std::move(e)));
  }

  // Transient failure: a fresh id after a backoff, until the deadline.
  void retry(std::string why) {
    last_failure_ = std::move(why);
    drop_id();
    const auto backoff = std::min(kFirstBackoff * (1 << std::min(attempt_, 6)), kMaxBackoff);
    ++attempt_;
    if (Clock::now() + backoff >= deadline_) {
      finish(make_error(ErrorCode::kTimeout,
                        "cannot connect channel {} to {} within connect_timeout after {} attempts: "
                        "{}",
                        ch_, address_, attempt_, last_failure_));
      return;
    }
    rdma_log()->debug("connect to {} channel {}: {}; retrying in {} ms", address_, ch_, last_failure_,
                      backoff.count());
    timer_ = std::make_unique<asio::steady_timer>(core_->cm->context());
    timer_->expires_after(backoff);
    auto self = shared_from_this();
    timer_->async_wait([self](const boost::system::error_code& ec) {
      if (!ec) self->begin();
    });
  }

  void drop_id() {
    if (id_ == nullptr) return;
    core_->cm->destroy_id(id_);
    id_ = nullptr;
    conn_->channel(ch_).reset_after_failed_attempt();
  }

  void finish(Status s) {
    if (finished_) return;
    finished_ = true;
    if (cancellable_) core_->attempt_cancellers.erase(canceller_);
    if (timer_) timer_->cancel();
    if (!s) drop_id();
    std::lock_guard lock(mu_);
    result_ = std::move(s);
    done_ = true;
    cv_.notify_all();
  }

  std::shared_ptr<Core> core_;
  std::shared_ptr<RdmaConnection> conn_;
  const std::uint32_t ch_;
  sockaddr_storage dst_;
  const std::string address_;
  const Clock::time_point deadline_;
  const std::vector<std::byte> private_data_;
  // CM thread.
  rdma_cm_id* id_ = nullptr;
  int attempt_ = 0;
  bool finished_ = false;
  bool cancellable_ = false;     // in core_->attempt_cancellers under canceller_
  std::uint64_t canceller_ = 0;
  std::string last_failure_;
  std::unique_ptr<asio::steady_timer> timer_;
  // Shared with the caller.
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status result_;
  handshake::Reply reply_;
};

// ---------------------------------------------------------------------------
// Passive side.

class ListenerState : public std::enable_shared_from_this<ListenerState> {
 public:
  ListenerState(std::shared_ptr<Core> core, LocalIdentity self, AcceptHandler on_accept,
                Handlers handlers)
      : core_(std::move(core)), cm_ctx_(core_->cm->context()), self_(self),
        on_accept_(std::move(on_accept)), handlers_(std::move(handlers)) {}

  // CM thread.
  Status open(const sockaddr_storage& addr) {
    auto self = shared_from_this();
    auto id = core_->cm->create_id([self](const CmEvent& ev) { self->on_listen_event(ev); });
    if (!id) return tl::unexpected<Error>(std::move(id).error());
    id_ = *id;
    auto* sa = const_cast<sockaddr*>(reinterpret_cast<const sockaddr*>(&addr));
    if (::rdma_bind_addr(id_, sa) != 0) {
      const int err = errno;
      close_on_cm();
      return make_sys_error(err, "cannot listen on {} (rdma_bind_addr): is it an address of an RDMA "
                                 "device's netdev? (`rdma link` shows them; for Soft-RoCE, the "
                                 "netdev rxe sits on)",
                            sockaddr_to_string(sa));
    }
    if (id_->verbs != nullptr && id_->verbs != core_->verbs) {
      const std::string why = device_mismatch(*core_, id_, sockaddr_to_string(sa));
      close_on_cm();
      return make_error(ErrorCode::kUnavailable, "{}", why);
    }
    if (::rdma_listen(id_, 128) != 0) {
      const int err = errno;
      close_on_cm();
      return make_sys_error(err, "rdma_listen on {}", sockaddr_to_string(sa));
    }
    address_ = sockaddr_to_string(::rdma_get_local_addr(id_));
    return ok_status();
  }

  // Any thread. Refused once the Transport is being destroyed: it closed us
  // already, and its CM thread may be gone (core_->cm is reset).
  void close() {
    auto self = shared_from_this();
    (void)core_->io->post(cm_ctx_, [self] { self->close_on_cm(); });
  }
  const std::string& address() const { return address_; }
  std::uint64_t num_refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  struct Session {
    std::shared_ptr<RdmaConnection> conn;
    std::vector<bool> requested;  // per channel
    std::size_t established = 0;
    std::unique_ptr<asio::steady_timer> timer;
    std::string address;
  };

  void close_on_cm() {
    if (closed_) return;
    closed_ = true;
    if (id_ != nullptr) core_->cm->destroy_id(id_);
    id_ = nullptr;
    for (auto& [sid, s] : sessions_) {
      if (s.timer) s.timer->cancel();
      s.conn->abort_setup();
    }
    sessions_.clear();
  }

  void on_listen_event(const CmEvent& ev) {
    switch (ev.type) {
      case RDMA_CM_EVENT_CONNECT_REQUEST:
        on_request(ev);
        return;
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
        rdma_log()->error("listener {}: RDMA device {} was removed; no longer accepting", address_,
                          core_->device.device);
        close_on_cm();
        return;
      default:
        rdma_log()->debug("listener {}: {} (ignored)", address_, cm_event_name(ev.type));
        return;
    }
  }

  void refuse(rdma_cm_id* id, const Error& why, const std::string& peer) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    rdma_log()->warn("listener {}: refused {}: {}", address_, peer, why.to_string());
    handshake::Reply r;
    r.status = why.code();
    r.role = self_.role;
    r.rank = self_.rank;
    r.num_channels = core_->options.num_channels;
    r.text = why.message();
    const auto bytes = protocol::encode_reply_data(r, protocol::kMaxRejectDataBytes);
    (void)::rdma_reject(id, bytes.data(), static_cast<std::uint8_t>(bytes.size()));
    if (id->qp != nullptr) ::rdma_destroy_qp(id);
    ::rdma_destroy_id(id);
  }

  void on_request(const CmEvent& ev) {
    rdma_cm_id* id = ev.id;
    const std::string peer = sockaddr_to_string(::rdma_get_peer_addr(id));
    if (closed_) {
      refuse(id, Error(ErrorCode::kClosed, "the listener is closing"), peer);
      return;
    }
    auto data = protocol::decode_connect_data(ev.private_data);
    if (!data) {
      refuse(id, data.error(), peer);
      return;
    }
    handshake::Expectations expect;
    expect.kind = Kind::kRdma;
    expect.num_channels = core_->options.num_channels;
    expect.auth_token = "";  // compared by digest below
    expect.self_role = self_.role;
    if (Status s = handshake::check_hello(data->hello, expect); !s) {
      refuse(id, s.error(), peer);
      return;
    }
    const std::string& token = core_->options.auth_token;
    if (!token.empty() &&
        !handshake::tokens_equal(
            fmt::format("{:016x}", protocol::token_digest(token, data->hello.session_id)),
            fmt::format("{:016x}", data->token_digest))) {
      refuse(id,
             Error(ErrorCode::kAuth, "auth token mismatch: set the same [communication] auth_token "
                                     "on the server and the workers"),
             peer);
      return;
    }
    if (id->verbs != core_->verbs) {
      refuse(id, Error(ErrorCode::kUnavailable, device_mismatch(*core_, id, address_)), peer);
      return;
    }
    const handshake::Hello& hello = data->hello;
    auto [it, inserted] = sessions_.try_emplace(hello.session_id);
    Session& s = it->second;
    if (inserted) {
      PeerInfo info;
      info.role = hello.role;
      info.rank = hello.rank;
      info.num_channels = hello.num_channels;
      info.address = peer;
      s.conn = std::make_shared<RdmaConnection>(core_, info, handlers_);
      s.requested.assign(hello.num_channels, false);
      s.address = peer;
      s.timer = std::make_unique<asio::steady_timer>(core_->cm->context());
      s.timer->expires_after(core_->options.connect_timeout);
      const std::uint64_t sid = hello.session_id;
      std::weak_ptr<ListenerState> weak = shared_from_this();
      s.timer->async_wait([weak, sid](const boost::system::error_code& e) {
        if (e) return;
        if (auto l = weak.lock()) {
          l->drop_session(sid, "not every channel connected within connect_timeout");
        }
      });
    } else if (s.conn->peer().rank != hello.rank || s.conn->peer().role != hello.role ||
               s.requested[hello.channel]) {
      refuse(id,
             Error(ErrorCode::kProtocol,
                   fmt::format("channel {} of session {:#x} arrived twice or with another identity",
                               hello.channel, hello.session_id)),
             peer);
      return;
    }
    s.requested[hello.channel] = true;
    Channel& c = s.conn->channel(hello.channel);
    Status st = c.prepare();
    if (st) st = c.create_qp(id);
    if (!st) {
      refuse(id, st.error(), peer);
      drop_session(hello.session_id, "cannot set up a channel: " + st.error().to_string());
      return;
    }
    c.set_id(id);
    const std::uint64_t sid = hello.session_id;
    const std::uint32_t ch = hello.channel;
    std::weak_ptr<ListenerState> weak = shared_from_this();
    core_->cm->set_handler(id, [weak, sid, ch](const CmEvent& e) {
      if (auto l = weak.lock()) l->on_session_event(sid, ch, e);
    });
    handshake::Reply r;
    r.status = ErrorCode::kOk;
    r.role = self_.role;
    r.rank = self_.rank;
    r.num_channels = core_->options.num_channels;
    const auto reply = protocol::encode_reply_data(r, protocol::kMaxAcceptDataBytes);
    rdma_conn_param p{};
    p.private_data = reply.data();
    p.private_data_len = static_cast<std::uint8_t>(reply.size());
    p.retry_count = 7;
    p.rnr_retry_count = 7;
    if (::rdma_accept(id, &p) != 0) {
      drop_session(sid, fmt::format("rdma_accept failed: {}", std::strerror(errno)));
    }
  }

  void on_session_event(std::uint64_t sid, std::uint32_t ch, const CmEvent& ev) {
    auto it = sessions_.find(sid);
    if (it == sessions_.end()) return;
    Session& s = it->second;
    switch (ev.type) {
      case RDMA_CM_EVENT_ESTABLISHED:
        if (++s.established < s.requested.size()) return;
        complete(sid);
        return;
      case RDMA_CM_EVENT_TIMEWAIT_EXIT:
      case RDMA_CM_EVENT_ADDR_CHANGE:
        return;
      default:
        drop_session(sid, fmt::format("channel {}: {} (status {}) before the connection was "
                                      "established",
                                      ch, cm_event_name(ev.type), ev.status));
        return;
    }
  }

  void drop_session(std::uint64_t sid, const std::string& why) {
    auto it = sessions_.find(sid);
    if (it == sessions_.end()) return;
    Session s = std::move(it->second);
    sessions_.erase(it);
    if (s.timer) s.timer->cancel();
    rdma_log()->warn("listener {}: dropped the connection attempt of {}: {}", address_, s.address, why);
    s.conn->abort_setup();
  }

  void complete(std::uint64_t sid) {
    auto it = sessions_.find(sid);
    Session s = std::move(it->second);
    sessions_.erase(it);
    if (s.timer) s.timer->cancel();
    std::shared_ptr<RdmaConnection> conn = s.conn;
    std::weak_ptr<RdmaConnection> weak = conn;
    for (std::uint32_t ch = 0; ch < conn->channel_count(); ++ch) {
      core_->cm->set_handler(conn->channel(ch).id(), [weak, ch](const CmEvent& e) {
        if (auto c = weak.lock()) c->on_cm_event(ch, e);
      });
    }
    core_->add_connection(conn);
    rdma_log()->info("listener {}: {} {} connected from {} with {} channel(s)", address_,
                     role_name(conn->peer().role), conn->peer().rank, conn->peer().address,
                     conn->channel_count());
    AcceptHandler on_accept = on_accept_;
    asio::post(core_->pollers[conn->channel(0).io_index()]->context(), [conn, on_accept] {
      if (on_accept) on_accept(conn);
      conn->start();
    });
  }

  std::shared_ptr<Core> core_;
  // The CM thread's context, for close() through the I/O threads' gate
  // (never touched once the gate is closed: the CmThread may be gone).
  asio::io_context& cm_ctx_;
  LocalIdentity self_;
  AcceptHandler on_accept_;
  Handlers handlers_;
  // CM thread.
  rdma_cm_id* id_ = nullptr;
  std::map<std::uint64_t, Session> sessions_;
  bool closed_ = false;
  std::string address_;
  std::atomic<std::uint64_t> refused_{0};
};

// ---------------------------------------------------------------------------
class RdmaTransport final : public Transport {
 public:
  explicit RdmaTransport(std::shared_ptr<Core> core) : core_(std::move(core)) {}

  ~RdmaTransport() override {
    EMBER_CHECK_MSG(!core_->io->on_io_thread() && !core_->cm->on_thread(),
                    "a Transport must not be destroyed on its I/O or rdma_cm thread");
    // The connects in progress first: one waiting for the CM ends now with
    // kCancelled, instead of holding shut_down() up to connect_timeout.
    run_on_cm(*core_, [this] {
      core_->cancel_connects();
      return 0;
    });
    core_->shut_down();  // waits until every channel finished
    // From here other threads queue nothing more for the poller and CM
    // threads (a close() racing this destructor, a Listener destroyed after
    // it); what they queued before runs ahead of the posts below.
    core_->io->close_gate();
    // Every id is gone (channels destroy theirs before they count as
    // finished; listeners closed above, in order on the CM thread).
    run_on_cm(*core_, [] { return 0; });
    core_->cm.reset();
    for (std::uint32_t i = 0; i < core_->io->size(); ++i) {
      std::promise<void> done;
      Poller* p = core_->pollers[i].get();
      asio::post(p->context(), [p, &done] {
        p->shutdown();
        done.set_value();
      });
      done.get_future().wait();
    }
    core_->io->stop();
  }

  Kind kind() const noexcept override { return Kind::kRdma; }
  const Options& options() const noexcept override { return core_->options; }

  Result<std::uint32_t> register_memory(const Region& region) override {
    if (region.base == nullptr || region.length_bytes == 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "register_memory: region needs a base address and a non-zero length");
    }
    if (core_->sealed.load()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "register_memory must be called before listen() and connect() (the rdma "
                        "transport registers each region once, at start)");
    }
    EMBER_TRY(check_memlock(region.length_bytes,
                            fmt::format("a registered region of {} (the page pool: prealloc_pages)",
                                        format_bytes(region.length_bytes))));
    ibv_mr* mr = ::ibv_reg_mr(core_->pd, region.base, region.length_bytes,
                              IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (mr == nullptr) {
      const int err = errno;
      if (err == ENOMEM || err == EPERM) {
        // The kernel's own memlock check (e.g. pages pinned by others since).
        return tl::unexpected<Error>(Error(
            ErrorCode::kConfig,
            fmt::format("ibv_reg_mr of {} failed: the kernel refused to pin the memory "
                        "(RLIMIT_MEMLOCK): raise it with LimitMEMLOCK=infinity in the systemd "
                        "unit, `ulimit -l unlimited`, or --ulimit memlock=-1 for a container",
                        format_bytes(region.length_bytes)),
            err));
      }
      return make_sys_error(err, "ibv_reg_mr of {} at {}", format_bytes(region.length_bytes),
                            region.base);
    }
    core_->regions.push_back(RegisteredRegion{static_cast<std::byte*>(region.base),
                                              region.length_bytes, mr});
    rdma_log()->info("registered {} with {} (lkey {:#x}, rkey {:#x})",
                     format_bytes(region.length_bytes), core_->device.device, mr->lkey, mr->rkey);
    return static_cast<std::uint32_t>(core_->regions.size() - 1);
  }

  Result<std::unique_ptr<Listener>> listen(const std::string& address, LocalIdentity self,
                                           AcceptHandler on_accept, Handlers handlers) override {
    EMBER_TRY(require_handlers(handlers, "listen"));
    EMBER_ASSIGN_OR_RETURN(auto endpoint, tcp::resolve_endpoint(address));
    if (!endpoint.address().is_loopback() && core_->options.auth_token.empty()) {
      return make_error(ErrorCode::kConfig,
                        "listening on {} (not a loopback address) needs an auth token: set "
                        "[communication] auth_token to a shared secret on the server and the workers",
                        address);
    }
    core_->sealed.store(true);
    sockaddr_storage ss{};
    std::memcpy(&ss, endpoint.data(), endpoint.size());
    auto state = std::make_shared<ListenerState>(core_, self, std::move(on_accept), std::move(handlers));
    EMBER_TRY(run_on_cm(*core_, [&] { return state->open(ss); }));
    core_->add_listener_closer([state] { state->close(); });
    rdma_log()->info("listening on {} (device {})", state->address(), core_->device.device);
    return std::unique_ptr<Listener>(new ListenerHandle<ListenerState>(state));
  }

  // Races ~RdmaTransport safely once begin_connect() ran: from there on only
  // `core` is used (never this object), and ~RdmaTransport waits for the
  // scope to end before it stops the CM and poller threads. It first cancels
  // the connect attempts (Core::cancel_connects): one waiting for the CM
  // reply ends with kCancelled, as a tcp or shm handshake wait does.
  Result<std::shared_ptr<Connection>> connect(const std::string& address, LocalIdentity self,
                                              Handlers handlers) override {
    const std::shared_ptr<Core> core = core_;
    EMBER_ASSIGN_OR_RETURN(auto in_progress, core->begin_connect());
    EMBER_TRY(require_handlers(handlers, "connect"));
    if (core->io->on_io_thread() || core->cm->on_thread()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "connect() blocks and must not be called on an I/O thread");
    }
    EMBER_ASSIGN_OR_RETURN(auto endpoint, tcp::resolve_endpoint(address));
    core->sealed.store(true);
    const Options& o = core->options;
    const auto deadline = Clock::now() + o.connect_timeout;
    std::random_device rd;
    const std::uint64_t session =
        (std::uint64_t{rd()} << 32) ^ rd() ^
        static_cast<std::uint64_t>(Clock::now().time_since_epoch().count());
    sockaddr_storage dst{};
    std::memcpy(&dst, endpoint.data(), endpoint.size());
    const std::string peer_address = tcp::endpoint_to_string(endpoint);
    PeerInfo info;
    info.role = Role::kServer;
    info.num_channels = o.num_channels;
    info.address = peer_address;
    auto conn = std::make_shared<RdmaConnection>(core, info, std::move(handlers));
    auto abort = [&] { run_on_cm(*core, [&] { conn->abort_setup(); return 0; }); };
    handshake::Reply last;
    for (std::uint32_t c = 0; c < o.num_channels; ++c) {
      Status prepared = run_on_cm(*core, [&] { return conn->channel(c).prepare(); });
      if (!prepared) {
        abort();
        return tl::unexpected<Error>(prepared.error());
      }
      handshake::Hello hello;
      hello.role = self.role;
      hello.kind = Kind::kRdma;
      hello.rank = self.rank;
      hello.num_channels = o.num_channels;
      hello.channel = c;
      hello.session_id = session;
      hello.max_message_bytes = o.max_message_bytes;
      hello.token = o.auth_token;
      auto attempt = std::make_shared<ConnectAttempt>(core, conn, c, dst, peer_address, deadline,
                                                      protocol::encode_connect_data(hello));
      core->cm->post([attempt] { attempt->begin(); });
      auto reply = attempt->wait();
      if (!reply) {
        abort();
        Error e = std::move(reply).error();
        if (c > 0) e.with_context(fmt::format("while connecting channel {} to {}", c, peer_address));
        return tl::unexpected<Error>(std::move(e));
      }
      last = std::move(*reply);
    }
    info.role = last.role;
    info.rank = last.rank;
    conn->set_peer(info);
    core->add_connection(conn);
    conn->start();
    return std::shared_ptr<Connection>(conn);
  }

  bool on_io_thread() const noexcept override { return core_->io->on_io_thread(); }
  std::uint32_t num_io_threads() const noexcept override { return core_->io->size(); }
  bool post_to_io_thread(std::uint32_t index, std::function<void()> task) override {
    return core_->io->post(core_->io->context(index), std::move(task));
  }
  std::size_t connects_in_progress() const noexcept override { return core_->connects_in_progress(); }

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace
}  // namespace detail

Result<std::unique_ptr<Transport>> create_rdma_transport(Options options) {
  using namespace detail;
  EMBER_CHECK(options.kind == Kind::kRdma);
  EMBER_TRY(options.validate());
  Availability avail = probe_rdma();
  if (!avail.available) {
    return make_error(ErrorCode::kUnavailable,
                      "transport = \"rdma\" but this host has no usable RDMA device: {}. Load the "
                      "device's driver (for Soft-RoCE: `rdma link add rxe0 type rxe netdev "
                      "<netdev>`), or use transport = \"tcp\" (or \"auto\", which picks rdma only "
                      "when a device is up)",
                      avail.detail);
  }
  auto core = std::make_shared<Core>(std::move(options));
  core->device = avail;
  int num = 0;
  core->device_list = ::rdma_get_devices(&num);
  for (int i = 0; core->device_list != nullptr && i < num; ++i) {
    if (avail.device == ::ibv_get_device_name(core->device_list[i]->device)) {
      core->verbs = core->device_list[i];
    }
  }
  if (core->verbs == nullptr) {
    return make_error(ErrorCode::kUnavailable,
                      "RDMA device {} is not visible to rdma_cm (rdma_get_devices found {} devices)",
                      avail.device, num);
  }
  ibv_port_attr port{};
  if (const int rc = ::ibv_query_port(core->verbs, avail.port_num, &port); rc != 0) {
    return tl::unexpected<Error>(Error(ErrorCode::kIo, fmt::format("ibv_query_port {} port {}",
                                                                   avail.device, avail.port_num), rc));
  }
  core->max_write_bytes = port.max_msg_sz;
  core->pd = ::ibv_alloc_pd(core->verbs);
  if (core->pd == nullptr) return make_sys_error(errno, "ibv_alloc_pd on {}", avail.device);
  EMBER_ASSIGN_OR_RETURN(core->cm, CmThread::start());
  for (std::uint32_t i = 0; i < core->options.num_io_threads; ++i) {
    ibv_comp_channel* cc = ::ibv_create_comp_channel(core->verbs);
    if (cc == nullptr) return make_sys_error(errno, "ibv_create_comp_channel");
    core->comp_channels.push_back(cc);
  }
  EMBER_ASSIGN_OR_RETURN(core->io,
                         IoThreads::start(core->options.num_io_threads, core->options.cpu_affinity,
                                                  core->options.busy_poll));
  for (std::uint32_t i = 0; i < core->options.num_io_threads; ++i) {
    core->pollers.push_back(std::make_unique<Poller>(core->io->context(i), core->comp_channels[i]));
  }
  rdma_log()->info("rdma transport on {}: {} I/O thread(s), {} receive buffers of {} per channel",
                   avail.detail, core->options.num_io_threads, core->geometry.recv_slots,
                   format_bytes(core->geometry.slot_bytes));
  return std::unique_ptr<Transport>(new RdmaTransport(std::move(core)));
}

std::string rdma_debug_state(Connection& connection) {
  if (auto* c = dynamic_cast<detail::RdmaConnection*>(&connection)) return c->debug_state();
  return "";
}

std::optional<RdmaStats> rdma_stats(const Connection& connection) {
  if (const auto* c = dynamic_cast<const detail::RdmaConnection*>(&connection)) return c->rdma_stats();
  return std::nullopt;
}

}  // namespace ember::transport::rdma
