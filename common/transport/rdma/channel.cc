// Channel: one RC queue pair of an rdma Connection. See rdma_transport.h for
// the message paths and internal.h for lifetimes.
//
// Credit accounting (why a sender never overruns the receiver, and why the
// credit messages themselves cannot overrun it or deadlock):
//  * Each side posts P receives: R = P - E are credited to the peer, E are
//    spare. Every SEND and WRITE with immediate consumes one posted receive
//    at the peer. A sender posts one only while credits_ > 0, except a
//    credit-only SEND (kCredit), which consumes a receive but no credit.
//  * The receiver reposts each buffer once it has handled the message (after
//    on_message returned, for a batch), then counts it in owed_; owed_ goes
//    back to the sender in the immediate of the next SEND (any type), or in
//    a kCredit once owed_ >= R/2 and nothing else carried it. kCredit
//    buffers are reposted but not counted, so kCredits never beget kCredits.
//  * At most two kCredits from one side are unhandled at the other at any
//    time: each carries >= R/2 credits, all in-flight credits together are at
//    most R (the sender's credits_ never goes below 0), so more than two
//    would carry more than R. E = 4 > 2 spares, so kCredits always find a
//    posted receive.
//  * Liveness: a sender at zero credits has R messages unacknowledged; the
//    receiver handles all of them (receiving never waits for sending), so
//    its owed_ reaches R/2 and a kCredit goes out (it needs no credit).
//  * Control bodies (grant, no-grant, release, rts) need credits like data
//    but are posted before queued data, so a rendezvous never waits behind
//    the traffic it unblocks.
#include <arpa/inet.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <boost/asio/post.hpp>

#include "common/base/check.h"
#include "common/base/logging.h"
#include "common/base/units.h"
#include "common/transport/rdma/internal.h"
#include "common/transport/rdma/memlock.h"
#include "common/wire/frame_decoder.h"

namespace ember::transport::rdma::detail {
namespace {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

// Work request ids: kind in the top byte, an index below.
enum WrKind : std::uint64_t { kWrRecv = 1, kWrSend = 2, kWrCtrl = 3, kWrWrite = 4, kWrZero = 5 };
constexpr std::uint64_t wr_id(WrKind kind, std::uint64_t seq, std::uint32_t index) {
  return (std::uint64_t{kind} << 56) | ((seq & 0xFFFFFFull) << 32) | index;
}
constexpr WrKind wr_kind(std::uint64_t id) { return static_cast<WrKind>(id >> 56); }
constexpr std::uint32_t wr_index(std::uint64_t id) { return static_cast<std::uint32_t>(id); }

constexpr std::uint32_t kMaxWritesInFlight = 16;
constexpr std::uint32_t kZeroLengthSends = 16;   // heartbeats, goodbye, credits in flight
constexpr std::size_t kMaxSlotBytes = std::size_t{1} << 20;
constexpr std::size_t kRingBudgetBytes = std::size_t{4} << 20;
constexpr std::uint32_t kSpareRecvs = 4;
constexpr auto kTeardownDrainLimit = std::chrono::seconds(2);
// Larger blocks are not granted ahead of time: the memory held for a message
// that may never come would be large, and one round trip is small beside
// the transfer. (Parameter-server chunks are partition_bytes, a few MiB.)
constexpr std::size_t kMaxRearmBytes = std::size_t{16} << 20;
// Unsolicited slots a receiver keeps granted per channel: more than the
// sender caches (kMaxCachedSlots), so a size that changes still gets a slot
// while the sender's cache is full of the old size; the sender then evicts
// (releases) the oldest, which bounds this side too.
constexpr std::uint32_t kMaxRearmedSlots = 2 * kMaxCachedSlots;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

std::shared_ptr<spdlog::logger> rdma_log() {
  static std::shared_ptr<spdlog::logger> l = log::logger("rdma");
  return l;
}

}  // namespace

Geometry Geometry::from(const Options& options) {
  Geometry g;
  g.slot_bytes = std::min<std::size_t>(options.batch_threshold_bytes / 8 * 8, kMaxSlotBytes);
  g.recv_slots = static_cast<std::uint32_t>(
      std::clamp<std::size_t>(kRingBudgetBytes / g.slot_bytes, 16, 64));
  g.spare_recvs = kSpareRecvs;
  g.credits = g.recv_slots - g.spare_recvs;
  g.send_slots = g.recv_slots - 1;
  g.ctrl_slots = static_cast<std::uint32_t>(g.slot_bytes / 64);
  g.max_send_wr = g.send_slots + g.ctrl_slots + kMaxWritesInFlight + kZeroLengthSends;
  g.cq_entries = g.max_send_wr + g.recv_slots + 16;
  g.max_batched_payload = g.slot_bytes - wire::kMinFrameBytes;
  return g;
}

void Ring::release() noexcept {
  if (private_mr != nullptr) ::ibv_dereg_mr(private_mr);
  if (private_map != nullptr) ::munmap(private_map, bytes);
  private_mr = nullptr;
  private_map = nullptr;
  owner.reset();
  base = nullptr;
  bytes = 0;
}

Channel::Channel(RdmaConnection* conn, Core& core, std::uint32_t index, std::uint32_t io_index)
    : conn_(conn),
      core_(core),
      geometry_(core.geometry),
      index_(index),
      io_index_(io_index),
      credits_(core.geometry.credits) {}

Channel::~Channel() {
  // Normal paths release everything in complete_teardown / release_unstarted.
  if (cq_ != nullptr || recv_ring_.base != nullptr || send_ring_.base != nullptr) {
    release_unstarted();
  }
}

// ---------------------------------------------------------------------------
// Set-up (CM thread).

Status Channel::prepare() {
  auto make_ring = [&](Ring& ring, const char* what) -> Status {
    const std::size_t bytes = geometry_.ring_bytes();
    const Options& o = core_.options;
    if (o.receive_allocator && !core_.regions.empty()) {
      Result<Buffer> b = o.receive_allocator(bytes);
      if (b && b->size() >= bytes) {
        if (const RegisteredRegion* r = core_.find_region(b->data(), bytes, b->location().region_id)) {
          ring.base = b->data();
          ring.bytes = bytes;
          ring.lkey = r->mr->lkey;
          ring.owner = std::move(*b);
          return ok_status();
        }
      } else if (!b) {
        rdma_log()->debug("channel {}: {} from the receive allocator failed ({}); using a private "
                          "registered ring",
                          index_, what, b.error().to_string());
      }
    }
    // Memory registered for this channel alone (its receive allocator gives
    // no registered memory): counted against RLIMIT_MEMLOCK like the pool.
    EMBER_TRY(check_memlock(bytes, fmt::format("the {} of a connection channel ({} slots of {})",
                                               what, geometry_.recv_slots,
                                               format_bytes(geometry_.slot_bytes))));
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return make_sys_error(errno, "mmap of a {}-byte {}", bytes, what);
    ibv_mr* mr = ::ibv_reg_mr(core_.pd, p, bytes, IBV_ACCESS_LOCAL_WRITE);
    if (mr == nullptr) {
      const int err = errno;
      ::munmap(p, bytes);
      return make_sys_error(err, "ibv_reg_mr of the {} ({}): if errno is ENOMEM, RLIMIT_MEMLOCK "
                                 "is too small (ulimit -l, LimitMEMLOCK=)",
                            what, format_bytes(bytes));
    }
    ring.base = static_cast<std::byte*>(p);
    ring.bytes = bytes;
    ring.lkey = mr->lkey;
    ring.private_mr = mr;
    ring.private_map = p;
    return ok_status();
  };
  EMBER_TRY(make_ring(recv_ring_, "receive ring"));
  EMBER_TRY(make_ring(send_ring_, "send ring"));
  auto enc = wire::BatchEncoder::create({.batch_threshold_bytes = geometry_.slot_bytes});
  if (!enc) return tl::unexpected<Error>(std::move(enc).error());
  encoder_.emplace(std::move(*enc));
  cq_ = ::ibv_create_cq(core_.verbs, static_cast<int>(geometry_.cq_entries), this,
                        core_.comp_channels[io_index_], 0);
  if (cq_ == nullptr) return make_sys_error(errno, "ibv_create_cq ({} entries)", geometry_.cq_entries);
  free_send_slots_.clear();
  for (std::uint32_t i = geometry_.send_slots; i > 0; --i) {
    free_send_slots_.push_back(static_cast<std::int32_t>(i - 1));
  }
  free_ctrl_slots_.clear();
  for (std::uint32_t i = geometry_.ctrl_slots; i > 0; --i) {
    free_ctrl_slots_.push_back(static_cast<std::int32_t>(i - 1));
  }
  core_.io_object_added();
  return ok_status();
}

Status Channel::create_qp(rdma_cm_id* id) {
  ibv_qp_init_attr attr{};
  attr.send_cq = cq_;
  attr.recv_cq = cq_;
  attr.qp_type = IBV_QPT_RC;
  attr.sq_sig_all = 1;
  attr.cap.max_send_wr = geometry_.max_send_wr;
  attr.cap.max_recv_wr = geometry_.recv_slots;
  attr.cap.max_send_sge = 1;
  attr.cap.max_recv_sge = 1;
  if (::rdma_create_qp(id, core_.pd, &attr) != 0) {
    return make_sys_error(errno, "rdma_create_qp (send {} / receive {} work requests)",
                          geometry_.max_send_wr, geometry_.recv_slots);
  }
  id_ = id;
  qp_ = id->qp;
  std::vector<std::uint32_t> all(geometry_.recv_slots);
  for (std::uint32_t i = 0; i < geometry_.recv_slots; ++i) all[i] = i;
  recvs_posted_ = 0;
  post_receives(all);
  if (recvs_posted_ != geometry_.recv_slots) {
    return make_error(ErrorCode::kIo, "ibv_post_recv failed while posting the receive ring");
  }
  return ok_status();
}

void Channel::reset_after_failed_attempt() {
  id_ = nullptr;
  qp_ = nullptr;
  if (cq_ != nullptr) {
    std::array<ibv_wc, 32> wc;
    while (::ibv_poll_cq(cq_, static_cast<int>(wc.size()), wc.data()) > 0) {
    }
  }
  recvs_posted_ = 0;
}

void Channel::release_unstarted() noexcept {
  if (cq_ != nullptr) {
    ::ibv_destroy_cq(cq_);
    cq_ = nullptr;
    core_.io_object_removed();
  }
  recv_ring_.release();
  send_ring_.release();
  slots_.clear();
}

// ---------------------------------------------------------------------------
// I/O thread: start, timers.

void Channel::start() {
  if (torn_down_) return;
  auto& ctx = core_.pollers[io_index_]->context();
  last_rx_ns_ = now_ns();
  last_tx_ns_.store(last_rx_ns_, std::memory_order_relaxed);
  flush_timer_ = std::make_unique<asio::steady_timer>(ctx);
  heartbeat_timer_ = std::make_unique<asio::steady_timer>(ctx);
  {
    std::lock_guard lock(mu_);
    started_ = true;
    if (flush_timer_armed_) arm_flush_timer();
  }
  core_.pollers[io_index_]->add(conn_->shared(), this);
  on_heartbeat_timer();
}

void Channel::arm_flush_timer() {
  if (!flush_timer_ || torn_down_) return;
  if (core_.options.flush_interval.count() == 0) {
    asio::post(flush_timer_->get_executor(), [self = conn_->shared(), this] { on_flush_timer(); });
    return;
  }
  flush_timer_->expires_after(core_.options.flush_interval);
  flush_timer_->async_wait([self = conn_->shared(), this](const boost::system::error_code& ec) {
    if (ec) return;
    on_flush_timer();
  });
}

void Channel::on_flush_timer() {
  Deferred d;
  {
    std::lock_guard lock(mu_);
    flush_timer_armed_ = false;
    // Armed before a cork(): the batch now waits for the flush, or for being full.
    if (tx_closed_ || corked_) return;
    close_batch_locked();
    pump_locked(d);
  }
  run_deferred(d);
}

void Channel::on_heartbeat_timer() {
  if (torn_down_ || !heartbeat_timer_) return;
  // Backstop: poll even without a completion event, so a lost notification
  // costs at most one heartbeat period, never a stall.
  core_.pollers[io_index_]->kick();
  const Options& o = core_.options;
  const std::int64_t now = now_ns();
  if (now - last_rx_ns_ > o.heartbeat_timeout.count()) {
    conn_->fail(heartbeat_timeout_error(fmt::format("{} on channel {}", conn_->describe_peer(), index_),
                                        std::chrono::nanoseconds(now - last_rx_ns_)));
    return;
  }
  if (now - last_tx_ns_.load(std::memory_order_relaxed) >= o.heartbeat_interval.count()) {
    Deferred d;
    {
      std::lock_guard lock(mu_);
      if (!tx_closed_ && !goodbye_queued_ && queue_.empty() && credits_ > 0 && !sq_full_locked()) {
        const std::uint64_t id = wr_id(kWrZero, ++next_wr_, 0);
        if (post_send_locked(protocol::MsgType::kHeartbeat, nullptr, 0, id, true, d)) {
          in_flight_.emplace_back().wr_id = id;
          conn_->heartbeats_sent.fetch_add(1, std::memory_order_relaxed);
        }
      }
    }
    run_deferred(d);
  }
  const auto period = std::min(o.heartbeat_interval, o.heartbeat_timeout / 4);
  heartbeat_timer_->expires_after(period);
  heartbeat_timer_->async_wait([self = conn_->shared(), this](const boost::system::error_code& ec) {
    if (ec) return;
    on_heartbeat_timer();
  });
}

// ---------------------------------------------------------------------------
// TX (any thread).

void Channel::open_batch_locked() {
  std::span<std::byte> out;
  if (!free_send_slots_.empty()) {
    open_slot_ = free_send_slots_.back();
    free_send_slots_.pop_back();
    out = std::span<std::byte>(send_ring_.base + static_cast<std::size_t>(open_slot_) * geometry_.slot_bytes,
                               geometry_.slot_bytes);
  } else {
    // Every send slot holds a batch waiting for credits: encode into plain
    // memory; pump copies it into a slot when one is free.
    open_slot_ = -1;
    if (!free_overflow_.empty()) {
      open_overflow_ = std::move(free_overflow_.back());
      free_overflow_.pop_back();
    } else {
      open_overflow_ = std::make_unique<std::byte[]>(geometry_.slot_bytes);
    }
    out = std::span<std::byte>(open_overflow_.get(), geometry_.slot_bytes);
  }
  encoder_->begin(out);
}

void Channel::close_batch_locked() {
  if (!encoder_->is_open()) return;
  if (encoder_->empty()) {
    encoder_->abandon();
    if (open_slot_ >= 0) free_send_slots_.push_back(open_slot_);
    if (open_overflow_) free_overflow_.push_back(std::move(open_overflow_));
    open_slot_ = -1;
    return;
  }
  std::span<std::byte> frame = encoder_->finish();
  TxEntry& e = queue_.emplace_back();
  e.kind = EntryKind::kBatch;
  e.frame = frame.data();
  e.frame_bytes = static_cast<std::uint32_t>(frame.size());
  e.slot = open_slot_;
  e.overflow = std::move(open_overflow_);
  e.messages = open_messages_;
  e.flow_bytes = open_flow_bytes_;
  open_slot_ = -1;
  open_messages_ = 0;
  open_flow_bytes_ = 0;
}

void Channel::add_item_locked(std::span<const std::byte> bytes) {
  if (!encoder_->is_open()) open_batch_locked();
  if (!encoder_->try_add(bytes, 0)) {
    close_batch_locked();
    open_batch_locked();
    const bool added = encoder_->try_add(bytes, 0);
    EMBER_CHECK_MSG(added, "a {}-byte message does not fit an empty {}-byte batch", bytes.size(),
                    geometry_.slot_bytes);
  }
}

Status Channel::send_small(std::span<const std::byte> bytes) {
  Deferred d;
  {
    std::lock_guard lock(mu_);
    if (tx_closed_ || goodbye_queued_) {
      d.flow_release = bytes.size();
      d.closed = true;
    } else {
      // The one copy of the small-message path: into the registered send slot.
      add_item_locked(bytes);
      open_flow_bytes_ += bytes.size();
      ++open_messages_;
      if (!core_.options.batching) close_batch_locked();
      if (encoder_->is_open() && !flush_timer_armed_ && !corked_) {
        flush_timer_armed_ = true;
        d.arm_flush_timer = started_;
      }
      if (!queue_.empty()) pump_locked(d);
    }
  }
  const bool closed = d.closed;
  run_deferred(d);
  if (closed) {
    return make_error(ErrorCode::kClosed, "connection is closed; message on channel {} dropped",
                      index_);
  }
  return ok_status();
}

Status Channel::send_large(Buffer&& payload, SendCompletion&& done) {
  const std::uint64_t size = payload.size();
  const RegisteredRegion* region =
      core_.find_region(payload.data(), payload.size(), payload.location().region_id);
  Deferred d;
  {
    std::unique_lock lock(mu_);
    if (tx_closed_ || goodbye_queued_) {
      lock.unlock();
      conn_->flow().release(size);
      payload.reset();
      return make_error(ErrorCode::kClosed, "connection is closed; message on channel {} dropped",
                        index_);
    }
    close_batch_locked();  // keeps order: earlier small messages go first
    TxEntry& e = queue_.emplace_back();
    e.kind = EntryKind::kLarge;
    e.payload = std::move(payload);
    e.done = std::move(done);
    e.flow_bytes = size;
    e.messages = 1;
    e.registered = region != nullptr;
    e.lkey = region != nullptr ? region->mr->lkey : 0;
    pump_locked(d);
  }
  run_deferred(d);
  return ok_status();
}

Status Channel::flush() {
  Deferred d;
  {
    std::lock_guard lock(mu_);
    corked_ = false;
    if (tx_closed_) return make_error(ErrorCode::kClosed, "connection is closed");
    close_batch_locked();
    pump_locked(d);
  }
  run_deferred(d);
  return ok_status();
}

void Channel::cork() {
  std::lock_guard lock(mu_);
  corked_ = true;
}

void Channel::begin_goodbye() {
  if (torn_down_) return;
  Deferred d;
  {
    std::lock_guard lock(mu_);
    if (tx_closed_ || goodbye_queued_) return;
    close_batch_locked();
    TxEntry& e = queue_.emplace_back();
    e.kind = EntryKind::kGoodbye;
    goodbye_queued_ = true;
    pump_locked(d);
  }
  run_deferred(d);
}

void Channel::run_deferred(Deferred& d) {
  if (d.arm_flush_timer) {
    d.arm_flush_timer = false;
    // Refused only once the channel has long finished (a send that raced
    // the teardown, on a caller thread): dropped, with its reference.
    (void)core_.io->post(core_.pollers[io_index_]->context(), [self = conn_->shared(), this] {
      std::lock_guard lock(mu_);
      arm_flush_timer();
    });
  }
  if (d.flow_release != 0) {
    conn_->flow().release(d.flow_release);
    d.flow_release = 0;
  }
  for (Finished& f : d.finished) {
    f.payload.reset();
    if (f.done) f.done(ok_status());
  }
  d.finished.clear();
  for (Finished& f : d.failed) {
    f.payload.reset();
    if (f.done) {
      f.done(tl::unexpected<Error>(
          Error(ErrorCode::kClosed, "connection closed before the message was sent")));
    }
  }
  d.failed.clear();
  if (d.fail) {
    Error e = std::move(*d.fail);
    d.fail.reset();
    conn_->fail(std::move(e));
  }
}

bool Channel::post_send_locked(protocol::MsgType type, const std::byte* data, std::uint32_t bytes,
                               std::uint64_t id, bool uses_credit, Deferred& d) {
  const std::uint32_t give = std::min(owed_, protocol::kMaxImmCredits);
  ibv_sge sge{};
  ibv_send_wr wr{};
  ibv_send_wr* bad = nullptr;
  wr.wr_id = id;
  wr.opcode = IBV_WR_SEND_WITH_IMM;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = htonl(protocol::pack_imm(type, give));
  if (bytes > 0) {
    sge.addr = reinterpret_cast<std::uintptr_t>(data);
    sge.length = bytes;
    sge.lkey = send_ring_.lkey;
    wr.sg_list = &sge;
    wr.num_sge = 1;
  }
  const int rc = ::ibv_post_send(qp_, &wr, &bad);
  conn_->write_syscalls.fetch_add(1, std::memory_order_relaxed);
  if (rc != 0) {
    if (!d.fail) {
      d.fail = Error(ErrorCode::kIo,
                     fmt::format("ibv_post_send of a {} on channel {} to {} failed",
                                 protocol::msg_type_name(type), index_, conn_->describe_peer()),
                     rc);
    }
    tx_closed_ = true;
    return false;
  }
  owed_ -= give;
  ++sends_in_flight_;
  if (uses_credit) --credits_;
  conn_->sends_posted.fetch_add(1, std::memory_order_relaxed);
  last_tx_ns_.store(now_ns(), std::memory_order_relaxed);
  return true;
}

bool Channel::post_write_locked(TxEntry& e, Deferred& d) {
  // A message larger than the device's largest message (rxe: 8 MiB) goes as
  // several plain RDMA WRITEs into the granted block, in order, the last one
  // with the immediate; only that one consumes a receive (and a credit).
  const std::uint64_t total = e.payload.size();
  while (e.write_offset < total || total == 0) {
    if (sq_full_locked() || writes_in_flight_ >= kMaxWritesInFlight) return false;
    const std::uint64_t chunk = std::min<std::uint64_t>(core_.max_write_bytes, total - e.write_offset);
    const bool last = e.write_offset + chunk == total;
    if (last && credits_ == 0) return false;
    ibv_sge sge{};
    sge.addr = reinterpret_cast<std::uintptr_t>(e.payload.data() + e.write_offset);
    sge.length = static_cast<std::uint32_t>(chunk);
    sge.lkey = e.lkey;
    ibv_send_wr wr{};
    ibv_send_wr* bad = nullptr;
    wr.wr_id = wr_id(kWrWrite, ++next_wr_, 0);
    wr.opcode = last ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    if (last) wr.imm_data = htonl(e.grant.slot);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.wr.rdma.remote_addr = e.grant.address + e.write_offset;
    wr.wr.rdma.rkey = e.grant.rkey;
    // Counted before the post: the peer may take the message, and a test
    // read the count, before this thread runs again (rxe in a 2-vCPU guest:
    // CI, 2026-12-01, 15 of 16 counted after the 16th had arrived).
    if (last) conn_->writes_posted.fetch_add(1, std::memory_order_relaxed);
    const int rc = ::ibv_post_send(qp_, &wr, &bad);
    conn_->write_syscalls.fetch_add(1, std::memory_order_relaxed);
    if (rc != 0) {
      if (last) conn_->writes_posted.fetch_sub(1, std::memory_order_relaxed);
      if (!d.fail) {
        d.fail = Error(ErrorCode::kIo,
                       fmt::format("ibv_post_send of an RDMA write of {} on channel {} to {} failed",
                                   format_bytes(chunk), index_, conn_->describe_peer()),
                       rc);
      }
      tx_closed_ = true;
      return false;
    }
    ++sends_in_flight_;
    ++writes_in_flight_;
    e.write_offset += chunk;
    last_tx_ns_.store(now_ns(), std::memory_order_relaxed);
    InFlight& f = in_flight_.emplace_back();
    f.wr_id = wr.wr_id;
    f.write = true;
    if (last) {
      --credits_;
      f.frame = true;
      f.flow_bytes = e.flow_bytes;
      f.messages = 1;
      f.payload = std::move(e.payload);
      f.done = std::move(e.done);
      return true;
    }
  }
  return false;
}

void Channel::enqueue_ctrl_locked(protocol::MsgType type, std::span<const std::byte> body) {
  CtrlMsg& m = ctrl_queue_.emplace_back();
  m.type = type;
  m.bytes = static_cast<std::uint8_t>(body.size());
  std::memcpy(m.body.data(), body.data(), body.size());
}

void Channel::pump_locked(Deferred& d) {
  if (tx_closed_ || qp_ == nullptr) return;
  bool stalled = false;
  // Control bodies first: they unblock the peer's queue (and ours).
  while (!ctrl_queue_.empty()) {
    if (credits_ == 0) {
      stalled = true;
      break;
    }
    if (free_ctrl_slots_.empty() || sq_full_locked()) break;
    const CtrlMsg& m = ctrl_queue_.front();
    const std::int32_t slot = free_ctrl_slots_.back();
    std::byte* p = send_ring_.base + static_cast<std::size_t>(geometry_.send_slots) * geometry_.slot_bytes +
                   static_cast<std::size_t>(slot) * 64;
    std::memcpy(p, m.body.data(), m.bytes);
    const std::uint64_t id = wr_id(kWrCtrl, ++next_wr_, static_cast<std::uint32_t>(slot));
    if (!post_send_locked(m.type, p, m.bytes, id, true, d)) return;
    free_ctrl_slots_.pop_back();
    InFlight& f = in_flight_.emplace_back();
    f.wr_id = id;
    f.ctrl_slot = slot;
    ctrl_queue_.pop_front();
  }
  while (!queue_.empty() && !tx_closed_) {
    if (sq_full_locked()) break;
    if (credits_ == 0) {
      stalled = true;
      break;
    }
    if (!step_entry_locked(queue_.front(), d)) break;
    queue_.pop_front();
  }
  if (stalled) conn_->credit_stalls.fetch_add(1, std::memory_order_relaxed);
}

bool Channel::step_entry_locked(TxEntry& e, Deferred& d) {
  switch (e.kind) {
    case EntryKind::kBatch: {
      if (e.slot < 0) {
        if (free_send_slots_.empty() && !reclaim_slot_locked()) return false;
        e.slot = free_send_slots_.back();
        free_send_slots_.pop_back();
        // Second copy, only under back-pressure: the batch was encoded while
        // every send slot held a batch waiting for credits.
        std::byte* dst = send_ring_.base + static_cast<std::size_t>(e.slot) * geometry_.slot_bytes;
        std::memcpy(dst, e.frame, e.frame_bytes);
        e.frame = dst;
        free_overflow_.push_back(std::move(e.overflow));
      }
      const std::uint64_t id = wr_id(kWrSend, ++next_wr_, static_cast<std::uint32_t>(e.slot));
      if (!post_send_locked(protocol::MsgType::kBatch, e.frame, e.frame_bytes, id, true, d)) return false;
      InFlight& f = in_flight_.emplace_back();
      f.wr_id = id;
      f.send_slot = e.slot;
      f.frame = true;
      f.flow_bytes = e.flow_bytes;
      f.messages = e.messages;
      return true;
    }
    case EntryKind::kGoodbye: {
      const std::uint64_t id = wr_id(kWrZero, ++next_wr_, 0);
      if (!post_send_locked(protocol::MsgType::kGoodbye, nullptr, 0, id, true, d)) return false;
      InFlight& f = in_flight_.emplace_back();
      f.wr_id = id;
      f.goodbye = true;
      return true;
    }
    case EntryKind::kLarge:
      break;
  }
  if (e.state == LargeState::kNew) {
    if (e.registered && !peer_cannot_grant_) {
      // A slot granted ahead of time serves only a message that goes in one
      // write (the receiver takes its size from that write's completion).
      std::optional<protocol::GrantBody> g;
      if (e.payload.size() <= core_.max_write_bytes) g = take_cached_grant_locked(e.payload.size());
      if (g) {
        e.grant = *g;
        e.state = LargeState::kGranted;
        conn_->cached_slot_writes.fetch_add(1, std::memory_order_relaxed);
      } else {
        if (free_ctrl_slots_.empty()) return false;
        const std::int32_t slot = free_ctrl_slots_.back();
        std::byte* p = send_ring_.base +
                       static_cast<std::size_t>(geometry_.send_slots) * geometry_.slot_bytes +
                       static_cast<std::size_t>(slot) * 64;
        e.request = ++next_request_ == 0 ? ++next_request_ : next_request_;
        protocol::encode(protocol::RtsBody{e.payload.size(), e.request},
                         std::span<std::byte, protocol::kRtsBytes>(p, protocol::kRtsBytes));
        const std::uint64_t id = wr_id(kWrCtrl, ++next_wr_, static_cast<std::uint32_t>(slot));
        if (!post_send_locked(protocol::MsgType::kRts, p, protocol::kRtsBytes, id, true, d)) return false;
        free_ctrl_slots_.pop_back();
        InFlight& f = in_flight_.emplace_back();
        f.wr_id = id;
        f.ctrl_slot = slot;
        e.state = LargeState::kAwaitGrant;
        conn_->rts_sent.fetch_add(1, std::memory_order_relaxed);
        return false;  // the head waits for the grant (or a no-grant)
      }
    } else {
      e.state = LargeState::kFragment;
      conn_->fragments_sent.fetch_add(1, std::memory_order_relaxed);
    }
  }
  switch (e.state) {
    case LargeState::kAwaitGrant:
      return false;
    case LargeState::kGranted:
      return post_write_locked(e, d);
    case LargeState::kFragment: {
      const std::size_t total = e.payload.size();
      while (credits_ > 0 && !sq_full_locked() &&
             (!free_send_slots_.empty() || reclaim_slot_locked())) {
        const bool first = e.frag_offset == 0;
        const std::size_t header = first ? protocol::kFragHeaderBytes : 0;
        const std::size_t chunk = std::min<std::size_t>(geometry_.slot_bytes - header,
                                                        total - e.frag_offset);
        const std::int32_t slot = free_send_slots_.back();
        std::byte* dst = send_ring_.base + static_cast<std::size_t>(slot) * geometry_.slot_bytes;
        if (first) {
          const std::uint64_t t = total;
          std::memcpy(dst, &t, sizeof t);
        }
        // The copy of the unregistered-memory path: into the registered ring.
        std::memcpy(dst + header, e.payload.data() + e.frag_offset, chunk);
        const std::uint64_t id = wr_id(kWrSend, ++next_wr_, static_cast<std::uint32_t>(slot));
        if (!post_send_locked(first ? protocol::MsgType::kFragFirst : protocol::MsgType::kFragNext,
                              dst, static_cast<std::uint32_t>(header + chunk), id, true, d)) {
          return false;
        }
        free_send_slots_.pop_back();
        e.frag_offset += chunk;
        InFlight& f = in_flight_.emplace_back();
        f.wr_id = id;
        f.send_slot = slot;
        if (e.frag_offset == total) {
          f.frame = true;
          f.flow_bytes = e.flow_bytes;
          f.messages = 1;
          f.payload = std::move(e.payload);
          f.done = std::move(e.done);
          return true;
        }
      }
      return false;
    }
    case LargeState::kNew:
      break;
  }
  return false;
}

bool Channel::reclaim_slot_locked() {
  // A send slot comes back when a posted SEND completes: wait for that.
  for (const InFlight& f : in_flight_) {
    if (f.send_slot >= 0) return false;
  }
  // None in flight: every slot belongs to a batch queued behind the head
  // (which needs one: an overflow batch or a fragment). Without this, the
  // head would wait for slots that only it can free. Move the last such
  // batch out of its slot (a copy, on this rare path) and take the slot.
  for (auto it = queue_.rbegin(); it != queue_.rend(); ++it) {
    if (&*it == &queue_.front()) break;
    if (it->kind != EntryKind::kBatch || it->slot < 0) continue;
    std::unique_ptr<std::byte[]> buf;
    if (!free_overflow_.empty()) {
      buf = std::move(free_overflow_.back());
      free_overflow_.pop_back();
    } else {
      buf = std::make_unique<std::byte[]>(geometry_.slot_bytes);
    }
    std::memcpy(buf.get(), it->frame, it->frame_bytes);
    free_send_slots_.push_back(it->slot);
    it->slot = -1;
    it->frame = buf.get();
    it->overflow = std::move(buf);
    return true;
  }
  return false;
}

std::optional<protocol::GrantBody> Channel::take_cached_grant_locked(std::uint64_t size_bytes) {
  auto best = grants_.end();
  for (auto it = grants_.begin(); it != grants_.end(); ++it) {
    const std::uint64_t cap = it->body.capacity_bytes;
    if (cap < size_bytes || cap > 2 * size_bytes) continue;
    if (best == grants_.end() || cap < best->body.capacity_bytes) best = it;
  }
  if (best == grants_.end()) return std::nullopt;
  protocol::GrantBody g = best->body;
  grants_.erase(best);
  return g;
}

void Channel::add_cached_grant_locked(const protocol::GrantBody& g) {
  grants_.push_back(Grant{g, ++grant_clock_});
  while (grants_.size() > kMaxCachedSlots) {
    auto lru = std::min_element(grants_.begin(), grants_.end(),
                                [](const Grant& a, const Grant& b) { return a.last_use < b.last_use; });
    std::array<std::byte, protocol::kReleaseBytes> body;
    protocol::encode(protocol::ReleaseBody{lru->body.slot}, body);
    enqueue_ctrl_locked(protocol::MsgType::kRelease, body);
    conn_->slots_released.fetch_add(1, std::memory_order_relaxed);
    grants_.erase(lru);
  }
}

void Channel::maybe_send_credit_locked(Deferred& d) {
  if (tx_closed_ || qp_ == nullptr) return;
  if (owed_ < std::max<std::uint32_t>(1, geometry_.credits / 2) || sq_full_locked()) return;
  const std::uint64_t id = wr_id(kWrZero, ++next_wr_, 0);
  if (!post_send_locked(protocol::MsgType::kCredit, nullptr, 0, id, false, d)) return;
  InFlight& f = in_flight_.emplace_back();
  f.wr_id = id;
  conn_->credit_messages_sent.fetch_add(1, std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------
// Completions (I/O thread).

bool Channel::arm() {
  if (cq_ == nullptr) return true;
  if (const int rc = ::ibv_req_notify_cq(cq_, 0); rc != 0) {
    conn_->fail(Error(ErrorCode::kIo, fmt::format("ibv_req_notify_cq on channel {}", index_), rc));
    return false;
  }
  return true;
}

std::string Channel::debug_state() {
  std::lock_guard lock(mu_);
  return fmt::format(
      "ch{} io{}: credits {} owed {} sends_in_flight {} writes_in_flight {} queue {} ctrl {} "
      "in_flight {} free_send_slots {} grants {} recvs_posted {} slots {} goodbye q/sent/recv "
      "{}/{}/{} torn_down {} draining {}",
      index_, io_index_, credits_, owed_, sends_in_flight_, writes_in_flight_, queue_.size(),
      ctrl_queue_.size(), in_flight_.size(), free_send_slots_.size(), grants_.size(), recvs_posted_,
      slots_.size(), goodbye_queued_, goodbye_sent_ok_, goodbye_received_, torn_down_, draining_);
}

std::uint64_t Channel::outstanding() const noexcept { return recvs_posted_ + sends_in_flight_; }

int Channel::poll(int budget) {
  if (cq_ == nullptr || finishing_) return 0;
  std::array<ibv_wc, 32> wc;
  int total = 0;
  std::vector<std::uint32_t> reposts;
  std::uint32_t returned = 0;
  std::uint32_t owed_new = 0;
  Deferred d;
  while (total < budget) {
    const int n = ::ibv_poll_cq(cq_, std::min<int>(static_cast<int>(wc.size()), budget - total), wc.data());
    if (n < 0) {
      conn_->fail(Error(ErrorCode::kIo, fmt::format("ibv_poll_cq failed on channel {}", index_), -n));
      break;
    }
    if (n == 0) break;
    conn_->read_syscalls.fetch_add(1, std::memory_order_relaxed);
    total += n;
    for (int i = 0; i < n; ++i) handle_wc(wc[static_cast<std::size_t>(i)], reposts, returned, owed_new, d);
  }
  if (total > 0 && !draining_) {
    if (!reposts.empty()) post_receives(reposts);
    std::lock_guard lock(mu_);
    credits_ += returned;
    owed_ += owed_new;
    pump_locked(d);
    maybe_send_credit_locked(d);
  }
  run_deferred(d);
  check_quiesced();
  if (draining_ && outstanding() == 0) finish_teardown();
  return total;
}

void Channel::handle_wc(const ibv_wc& wc, std::vector<std::uint32_t>& reposts,
                        std::uint32_t& returned, std::uint32_t& owed_new, Deferred& d) {
  const WrKind kind = wr_kind(wc.wr_id);
  if (wc.status != IBV_WC_SUCCESS) {
    if (kind == kWrRecv) {
      --recvs_posted_;
    } else {
      complete_send(wc, false, d);
    }
    if (wc.status != IBV_WC_WR_FLUSH_ERR && !torn_down_) {
      conn_->fail(Error(ErrorCode::kIo,
                        fmt::format("{} on channel {} with {} failed: {} (vendor error {:#x}){}",
                                    kind == kWrRecv ? "a receive" : "a send", index_,
                                    conn_->describe_peer(), ::ibv_wc_status_str(wc.status),
                                    wc.vendor_err,
                                    wc.status == IBV_WC_RETRY_EXC_ERR
                                        ? ": the peer stopped answering (crashed or unreachable)"
                                        : "")));
    }
    return;
  }
  if (kind != kWrRecv) {
    complete_send(wc, true, d);
    return;
  }
  --recvs_posted_;
  const std::uint32_t slot = wr_index(wc.wr_id);
  bool counts = true;
  if (torn_down_ || conn_->failing()) return;  // not reposted: the channel is going away
  if (!handle_recv(slot, wc, returned, counts)) return;
  reposts.push_back(slot);
  if (counts) ++owed_new;
}

void Channel::complete_send(const ibv_wc& wc, bool ok, Deferred& d) {
  std::lock_guard lock(mu_);
  if (in_flight_.empty() || in_flight_.front().wr_id != wc.wr_id) {
    if (!d.fail) {
      d.fail = Error(ErrorCode::kInternal,
                     fmt::format("channel {}: a send completion arrived out of order", index_));
    }
    return;
  }
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  --sends_in_flight_;
  if (f.write) --writes_in_flight_;
  if (f.send_slot >= 0) free_send_slots_.push_back(f.send_slot);
  if (f.ctrl_slot >= 0) free_ctrl_slots_.push_back(f.ctrl_slot);
  if (f.goodbye && ok) goodbye_sent_ok_ = true;
  d.flow_release += f.flow_bytes;
  if (ok && f.frame) {
    conn_->messages_sent.fetch_add(f.messages, std::memory_order_relaxed);
    conn_->bytes_sent.fetch_add(f.flow_bytes, std::memory_order_relaxed);
    conn_->frames_sent.fetch_add(1, std::memory_order_relaxed);
    conn_->tx_progress.fetch_add(1, std::memory_order_relaxed);
  }
  if (f.payload || f.done) {
    (ok ? d.finished : d.failed).push_back(Finished{std::move(f.payload), std::move(f.done)});
  }
}

bool Channel::protocol_error(std::string message) {
  conn_->fail(Error(ErrorCode::kProtocol,
                    fmt::format("{} on channel {} from {}", message, index_, conn_->describe_peer())));
  return false;
}

bool Channel::handle_recv(std::uint32_t slot, const ibv_wc& wc, std::uint32_t& returned,
                          bool& counts) {
  last_rx_ns_ = now_ns();
  if ((wc.wc_flags & IBV_WC_WITH_IMM) == 0) return protocol_error("a message without immediate data");
  const std::uint32_t imm = ntohl(wc.imm_data);
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    if (goodbye_received_) return protocol_error("an RDMA write after goodbye");
    conn_->frames_received.fetch_add(1, std::memory_order_relaxed);
    return on_write(imm, wc.byte_len);
  }
  if (wc.opcode != IBV_WC_RECV) return protocol_error(fmt::format("unexpected completion opcode {}", static_cast<int>(wc.opcode)));
  const auto parsed = protocol::unpack_imm(imm);
  if (!parsed) return protocol_error(fmt::format("unknown message type {}", imm >> 24));
  returned += parsed->credits;
  const std::span<const std::byte> body(recv_ring_.base + static_cast<std::size_t>(slot) * geometry_.slot_bytes,
                                        std::min<std::size_t>(wc.byte_len, geometry_.slot_bytes));
  using protocol::MsgType;
  const MsgType type = parsed->type;
  if (goodbye_received_ && type != MsgType::kCredit && type != MsgType::kHeartbeat &&
      type != MsgType::kGrant && type != MsgType::kNoGrant && type != MsgType::kRelease) {
    return protocol_error(fmt::format("a {} after goodbye", protocol::msg_type_name(type)));
  }
  switch (type) {
    case MsgType::kBatch:
      conn_->frames_received.fetch_add(1, std::memory_order_relaxed);
      return on_batch(body);
    case MsgType::kCredit:
      counts = false;
      return true;
    case MsgType::kHeartbeat:
      conn_->heartbeats_received.fetch_add(1, std::memory_order_relaxed);
      return true;
    case MsgType::kGoodbye:
      goodbye_received_ = true;
      conn_->peer_goodbye();
      return true;
    case MsgType::kRts:
      return on_rts(body);
    case MsgType::kGrant:
      return on_grant(body);
    case MsgType::kNoGrant:
      return on_no_grant(body);
    case MsgType::kRelease:
      return on_release(body);
    case MsgType::kFragFirst:
      return on_fragment(true, body);
    case MsgType::kFragNext:
      return on_fragment(false, body);
  }
  return protocol_error("unhandled message type");
}

bool Channel::on_batch(std::span<const std::byte> body) {
  wire::DecoderOptions opt;
  opt.max_frame_bytes = std::max(geometry_.slot_bytes, wire::kMinFrameBytes);
  auto frame = wire::decode_frame(body, opt);
  if (!frame) {
    Error e = std::move(frame).error();
    e.with_context(fmt::format("bad batch from {} on channel {}", conn_->describe_peer(), index_));
    conn_->fail(std::move(e));
    return false;
  }
  auto left = static_cast<std::uint32_t>(frame->size());
  for (const wire::Item item : *frame) {
    if (conn_->failing()) return false;
    if (item.flags != 0) {
      return protocol_error(fmt::format("an item with unknown flags {:#x}", item.flags));
    }
    Incoming msg;
    msg.channel = index_;
    msg.bytes = item.payload;
    msg.more_in_batch = --left;
    conn_->deliver(std::move(msg));
  }
  return true;
}

Result<Buffer> Channel::allocate_receive(std::uint64_t size_bytes) {
  const ReceiveAllocator& alloc = core_.options.receive_allocator;
  Result<Buffer> b = alloc ? alloc(size_bytes) : Result<Buffer>(Buffer::heap_lazy(size_bytes));
  if (!b) {
    Error e = std::move(b).error();
    e.with_context(fmt::format("while allocating {} bytes for a received large message", size_bytes));
    return tl::unexpected<Error>(std::move(e));
  }
  if (b->size() < size_bytes) {
    return make_error(ErrorCode::kInternal, "the receive allocator returned {} bytes for a request of {}",
                      b->size(), size_bytes);
  }
  return b;
}

std::uint32_t Channel::grant_slot(Buffer&& block, bool unsolicited, std::uint32_t request,
                                  std::uint64_t exact_bytes) {
  const RegisteredRegion* region =
      core_.find_region(block.data(), block.size(), block.location().region_id);
  if (region == nullptr) return 0;
  std::uint32_t id = 0;
  do {
    id = ++next_slot_;
  } while (id == 0 || slots_.count(id) != 0);
  protocol::GrantBody g;
  g.address = reinterpret_cast<std::uintptr_t>(block.data());
  g.capacity_bytes = block.size();
  g.rkey = region->mr->rkey;
  g.slot = id;
  g.request = request;
  slots_.emplace(id, Slot{std::move(block), unsolicited, exact_bytes});
  if (unsolicited) ++unsolicited_slots_;
  std::array<std::byte, protocol::kGrantBytes> body;
  protocol::encode(g, body);
  std::lock_guard lock(mu_);
  enqueue_ctrl_locked(protocol::MsgType::kGrant, body);
  return id;
}

bool Channel::on_write(std::uint32_t slot_id, std::uint32_t bytes) {
  auto it = slots_.find(slot_id);
  if (it == slots_.end()) {
    return protocol_error(fmt::format("an RDMA write into slot {}, which was not granted", slot_id));
  }
  Buffer block = std::move(it->second.block);
  const std::uint64_t exact = it->second.exact_bytes;
  if (it->second.unsolicited) --unsolicited_slots_;
  slots_.erase(it);
  // A slot granted to an RTS holds exactly the announced message (its last
  // write's byte_len is only the last chunk); an unsolicited one, one write.
  const std::uint64_t size = exact != 0 ? exact : bytes;
  if (bytes > block.size() || size > block.size() || (exact != 0 && bytes > exact)) {
    return protocol_error(fmt::format("an RDMA write of {} bytes (message {}) into a slot of {}",
                                      bytes, size, block.size()));
  }
  const std::size_t capacity = block.size();
  block.truncate(static_cast<std::size_t>(size));
  Incoming msg;
  msg.channel = index_;
  msg.owned = std::move(block);
  msg.bytes = std::span<const std::byte>(msg.owned.data(), msg.owned.size());
  conn_->deliver(std::move(msg));
  // Re-arm: the next message of this size from the peer goes without a
  // rendezvous round trip (one key's pushes, or its pull replies).
  if (!conn_->failing() && unsolicited_slots_ < kMaxRearmedSlots && capacity <= kMaxRearmBytes) {
    Result<Buffer> next = allocate_receive(capacity);
    if (next) {
      (void)grant_slot(std::move(*next), /*unsolicited=*/true, 0, 0);
    } else {
      rdma_log()->debug("channel {}: no block of {} to re-arm a slot ({})", index_,
                        format_bytes(capacity), next.error().to_string());
    }
  }
  return true;
}

bool Channel::on_rts(std::span<const std::byte> body) {
  auto rts = protocol::decode_rts(body);
  if (!rts) return protocol_error(rts.error().message());
  if (rts->size_bytes > core_.options.max_message_bytes) {
    conn_->fail(Error(ErrorCode::kTooLarge,
                      fmt::format("{} announced a message of {} on channel {}, over max_message_size {}",
                                  conn_->describe_peer(), format_bytes(rts->size_bytes), index_,
                                  format_bytes(core_.options.max_message_bytes))));
    return false;
  }
  Result<Buffer> block = allocate_receive(rts->size_bytes);
  if (!block) {
    conn_->fail(std::move(block).error());
    return false;
  }
  if (grant_slot(std::move(*block), /*unsolicited=*/false, rts->request, rts->size_bytes) == 0) {
    // The block is not RDMA-writable (no registered receive memory): ask for
    // fragments. grant_slot released nothing; the Buffer went out of scope.
    std::array<std::byte, protocol::kNoGrantBytes> nb;
    protocol::encode(protocol::NoGrantBody{rts->request}, nb);
    std::lock_guard lock(mu_);
    enqueue_ctrl_locked(protocol::MsgType::kNoGrant, nb);
  }
  return true;
}

bool Channel::on_grant(std::span<const std::byte> body) {
  auto g = protocol::decode_grant(body);
  if (!g) return protocol_error(g.error().message());
  std::lock_guard lock(mu_);
  // Counted under mu_: a sender that saw the count takes mu_ before it looks
  // for a cached slot, so it finds this grant there (counted before the lock,
  // a send in between went by RTS although the slot had arrived: CI,
  // 2026-12-01, RepeatedSizesReuseGrantedSlotsAndChangedSizesAskAgain).
  conn_->grants_received.fetch_add(1, std::memory_order_relaxed);
  if (!queue_.empty()) {
    TxEntry& head = queue_.front();
    if (head.kind == EntryKind::kLarge && head.state == LargeState::kAwaitGrant) {
      const std::uint64_t size = head.payload.size();
      const bool answers = g->request != 0 && g->request == head.request;
      // An unsolicited slot may serve the waiting message (then the RTS's own
      // grant comes later and is given back below).
      const bool fits = g->request == 0 && g->capacity_bytes >= size &&
                        g->capacity_bytes <= 2 * size && size <= core_.max_write_bytes;
      if ((answers && g->capacity_bytes >= size) || fits) {
        head.grant = *g;
        head.state = LargeState::kGranted;
        if (fits) conn_->cached_slot_writes.fetch_add(1, std::memory_order_relaxed);
        return true;  // pump runs after the poll batch
      }
    }
  }
  if (g->request != 0) {
    // The answer to an RTS whose message already went into an unsolicited
    // slot: the receiver holds it for exactly that size, so it is not kept.
    std::array<std::byte, protocol::kReleaseBytes> rel;
    protocol::encode(protocol::ReleaseBody{g->slot}, rel);
    enqueue_ctrl_locked(protocol::MsgType::kRelease, rel);
    conn_->slots_released.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  add_cached_grant_locked(*g);
  return true;
}

bool Channel::on_no_grant(std::span<const std::byte> body) {
  auto ng = protocol::decode_no_grant(body);
  if (!ng) return protocol_error(ng.error().message());
  std::lock_guard lock(mu_);
  peer_cannot_grant_ = true;
  if (!queue_.empty()) {
    TxEntry& head = queue_.front();
    if (head.kind == EntryKind::kLarge && head.state == LargeState::kAwaitGrant &&
        head.request == ng->request) {
      head.state = LargeState::kFragment;
      conn_->fragments_sent.fetch_add(1, std::memory_order_relaxed);
    }
  }
  return true;
}

bool Channel::on_release(std::span<const std::byte> body) {
  auto r = protocol::decode_release(body);
  if (!r) return protocol_error(r.error().message());
  auto it = slots_.find(r->slot);
  if (it == slots_.end()) {
    return protocol_error(fmt::format("a release of slot {}, which is not granted", r->slot));
  }
  if (it->second.unsolicited) --unsolicited_slots_;
  slots_.erase(it);  // frees the block
  return true;
}

bool Channel::on_fragment(bool first, std::span<const std::byte> body) {
  if (first) {
    if (frag_active_) return protocol_error("a new fragmented message before the last one ended");
    if (body.size() < protocol::kFragHeaderBytes) return protocol_error("a truncated first fragment");
    std::uint64_t total = 0;
    std::memcpy(&total, body.data(), sizeof total);
    if (total > core_.options.max_message_bytes) {
      conn_->fail(Error(ErrorCode::kTooLarge,
                        fmt::format("{} sent a message of {} on channel {}, over max_message_size {}",
                                    conn_->describe_peer(), format_bytes(total), index_,
                                    format_bytes(core_.options.max_message_bytes))));
      return false;
    }
    Result<Buffer> b = allocate_receive(total);
    if (!b) {
      conn_->fail(std::move(b).error());
      return false;
    }
    frag_buffer_ = std::move(*b);
    frag_total_ = total;
    frag_received_ = 0;
    frag_active_ = true;
    body = body.subspan(protocol::kFragHeaderBytes);
  } else if (!frag_active_) {
    return protocol_error("a fragment without a first fragment");
  }
  if (body.size() > frag_total_ - frag_received_) {
    return protocol_error("fragments longer than the message they announced");
  }
  std::memcpy(frag_buffer_.data() + frag_received_, body.data(), body.size());
  frag_received_ += body.size();
  if (frag_received_ < frag_total_) return true;
  frag_active_ = false;
  conn_->frames_received.fetch_add(1, std::memory_order_relaxed);
  Incoming msg;
  msg.channel = index_;
  frag_buffer_.truncate(frag_total_);
  msg.owned = std::move(frag_buffer_);
  msg.bytes = std::span<const std::byte>(msg.owned.data(), msg.owned.size());
  conn_->deliver(std::move(msg));
  return true;
}

void Channel::post_receives(const std::vector<std::uint32_t>& slots) {
  if (qp_ == nullptr || slots.empty()) return;
  std::vector<ibv_recv_wr> wrs(slots.size());
  std::vector<ibv_sge> sges(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    sges[i].addr = reinterpret_cast<std::uintptr_t>(recv_ring_.base +
                                                    static_cast<std::size_t>(slots[i]) * geometry_.slot_bytes);
    sges[i].length = static_cast<std::uint32_t>(geometry_.slot_bytes);
    sges[i].lkey = recv_ring_.lkey;
    wrs[i].wr_id = wr_id(kWrRecv, 0, slots[i]);
    wrs[i].sg_list = &sges[i];
    wrs[i].num_sge = 1;
    wrs[i].next = i + 1 < slots.size() ? &wrs[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  const int rc = ::ibv_post_recv(qp_, wrs.data(), &bad);
  if (rc != 0) {
    // Those before `bad` were posted.
    std::size_t posted = 0;
    for (ibv_recv_wr* w = wrs.data(); w != bad && w != nullptr; w = w->next) ++posted;
    recvs_posted_ += static_cast<std::uint32_t>(posted);
    if (started_) {
      conn_->fail(Error(ErrorCode::kIo, fmt::format("ibv_post_recv on channel {} failed", index_), rc));
    }
    return;
  }
  recvs_posted_ += static_cast<std::uint32_t>(slots.size());
}

void Channel::check_quiesced() {
  if (disconnect_requested_ || torn_down_ || !goodbye_received_) return;
  bool sent;
  {
    std::lock_guard lock(mu_);
    sent = goodbye_sent_ok_;
  }
  if (!sent) return;
  // Both goodbyes are through: nothing more can arrive or leave. Disconnect;
  // the DISCONNECTED event tears the channel down.
  disconnect_requested_ = true;
  conn_->request_disconnect(index_);
}

// ---------------------------------------------------------------------------
// Teardown (I/O thread).

void Channel::on_disconnected() {
  if (torn_down_) return;
  // Completions already in the CQ (the peer's goodbye among them) count
  // before the disconnect.
  while (poll(1024) > 0) {
  }
  if (torn_down_) return;
  if (!goodbye_received_ && !conn_->failing()) {
    conn_->fail(Error(ErrorCode::kIo,
                      fmt::format("{} disconnected channel {} without goodbye (it crashed, was "
                                  "killed, or its transport was destroyed)",
                                  conn_->describe_peer(), index_)));
    return;  // fail() tears every channel down
  }
  teardown();
}

void Channel::teardown() {
  if (torn_down_) return;
  torn_down_ = true;
  std::deque<TxEntry> dropped;
  std::uint64_t flow_dropped = 0;
  {
    std::lock_guard lock(mu_);
    tx_closed_ = true;
    if (encoder_ && encoder_->is_open()) {
      encoder_->abandon();
      flow_dropped += open_flow_bytes_;
      open_flow_bytes_ = 0;
    }
    dropped.swap(queue_);
    ctrl_queue_.clear();
  }
  for (TxEntry& e : dropped) flow_dropped += e.flow_bytes;
  conn_->flow().release(flow_dropped);
  if (flush_timer_) flush_timer_->cancel();
  if (heartbeat_timer_) heartbeat_timer_->cancel();
  Error reason(ErrorCode::kClosed, "connection closed before the message was sent");
  for (TxEntry& e : dropped) {
    e.payload.reset();
    if (e.done) e.done(tl::unexpected<Error>(reason));
  }
  if (frag_active_) {
    frag_buffer_.reset();
    frag_active_ = false;
  }
  // Stop the queue pair: every posted work request completes (flushed).
  if (qp_ != nullptr) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    (void)::ibv_modify_qp(qp_, &attr, IBV_QP_STATE);
  }
  draining_ = true;
  if (!started_ || outstanding() == 0) {
    finish_teardown();
    return;
  }
  drain_timer_ = std::make_unique<asio::steady_timer>(core_.pollers[io_index_]->context());
  drain_timer_->expires_after(kTeardownDrainLimit);
  drain_timer_->async_wait([self = conn_->shared(), this](const boost::system::error_code& ec) {
    if (ec || finishing_) return;
    rdma_log()->warn("channel {}: {} work requests still outstanding {} s after the queue pair "
                     "stopped; destroying it anyway",
                     index_, outstanding(),
                     std::chrono::duration_cast<std::chrono::seconds>(kTeardownDrainLimit).count());
    finish_teardown();
  });
  core_.pollers[io_index_]->kick();
}

void Channel::finish_teardown() {
  if (finishing_) return;
  finishing_ = true;
  if (drain_timer_) drain_timer_->cancel();
  if (started_) core_.pollers[io_index_]->remove(this);
  // Queue pair and id go on the CM thread; then the CQ and memory here.
  auto self = conn_->shared();
  rdma_cm_id* id = id_;
  id_ = nullptr;
  qp_ = nullptr;
  core_.cm->post([self, this, id] {
    core_.cm->destroy_id(id);
    asio::post(core_.pollers[io_index_]->context(), [self, this] { complete_teardown(); });
  });
}

void Channel::complete_teardown() {
  Deferred d;
  std::deque<InFlight> left;
  {
    std::lock_guard lock(mu_);
    left.swap(in_flight_);
    sends_in_flight_ = 0;
    writes_in_flight_ = 0;
  }
  std::uint64_t flow = 0;
  for (InFlight& f : left) {
    flow += f.flow_bytes;
    f.payload.reset();
    if (f.done) {
      f.done(tl::unexpected<Error>(Error(ErrorCode::kClosed, "connection closed before the message was sent")));
    }
  }
  conn_->flow().release(flow);
  flush_timer_.reset();
  heartbeat_timer_.reset();
  drain_timer_.reset();
  const bool counted = cq_ != nullptr;
  if (cq_ != nullptr) {
    ::ibv_destroy_cq(cq_);
    cq_ = nullptr;
  }
  recv_ring_.release();
  send_ring_.release();
  slots_.clear();
  // The last channel runs on_closed (or leaves it to a caller still running
  // a send's completion, counting an I/O object of its own meanwhile) before
  // this channel stops counting: ~Transport waits for on_closed.
  conn_->channel_finished();
  if (counted) core_.io_object_removed();
}

}  // namespace ember::transport::rdma::detail
