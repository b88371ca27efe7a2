// Internals of the rdma transport shared by its source files: the Core (one
// per Transport), the Connection, and the Channel (one RC queue pair).
//
// Object graph and lifetimes (as in tcp): RdmaTransport (user-owned) ──shared──▶
// Core (device, protection domain, memory registrations, I/O threads with
// their pollers, the rdma_cm thread). RdmaConnection ──shared──▶ Core, owns
// its Channels. Every asynchronous handler captures a shared_ptr to the
// Connection, so it lives while work is pending. A Channel's verbs objects
// are destroyed in this order, whatever the cause: queue pair to the error
// state, its outstanding work completed (flushed) or a drain deadline
// passed, the queue pair and rdma_cm id destroyed on the CM thread, then the
// completion queue and the ring memory on the channel's I/O thread. Memory a
// queue pair may write into is never freed before the queue pair is gone.
// The Transport's destructor waits for every channel to finish before it
// stops the threads and releases the protection domain.
#pragma once

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include <boost/asio/steady_timer.hpp>

#include "common/transport/connection_core.h"
#include "common/transport/flow_control.h"
#include "common/transport/io_threads.h"
#include "common/transport/rdma/cm_thread.h"
#include "common/transport/rdma/device.h"
#include "common/transport/rdma/poller.h"
#include "common/transport/rdma/protocol.h"
#include "common/transport/rdma/rdma_transport.h"
#include "common/transport/transport.h"
#include "common/wire/batch_encoder.h"

namespace ember::transport::rdma::detail {

class RdmaConnection;

// Sizes of a channel's rings, derived from the options (see Geometry::from).
struct Geometry {
  std::size_t slot_bytes = 0;       // one receive buffer / send slot: the largest SEND
  std::uint32_t recv_slots = 0;     // P: receive buffers posted per channel
  std::uint32_t spare_recvs = 0;    // E: of those, kept for credit-only messages
  std::uint32_t credits = 0;        // R = P - E: initial send credits toward the peer
  std::uint32_t send_slots = 0;     // batch/fragment slots in the send ring (P - 1)
  std::uint32_t ctrl_slots = 0;     // control-body slots (the send ring's last slot, cut up)
  std::uint32_t max_send_wr = 0;
  std::uint32_t cq_entries = 0;
  std::size_t max_batched_payload = 0;  // slot_bytes - wire::kMinFrameBytes
  std::size_t ring_bytes() const noexcept { return slot_bytes * recv_slots; }
  static Geometry from(const Options& options);
};

struct RegisteredRegion {
  std::byte* base = nullptr;
  std::uint64_t length = 0;
  ibv_mr* mr = nullptr;
};

// The registry counts channels whose verbs objects are not yet all released
// (the I/O objects the destructor waits for) and live connections.
class Core : public TransportRegistry {
 public:
  explicit Core(Options opts) : options(std::move(opts)), geometry(Geometry::from(options)) {}
  ~Core();  // releases verbs objects; pre: every thread stopped, every channel finished

  Options options;
  Geometry geometry;
  Availability device;
  ibv_context** device_list = nullptr;  // rdma_get_devices (rdma_free_devices)
  ibv_context* verbs = nullptr;         // the chosen device, from device_list
  ibv_pd* pd = nullptr;
  std::uint64_t max_write_bytes = 0;    // port max_msg_sz: largest single RDMA WRITE
  std::unique_ptr<IoThreads> io;
  std::vector<ibv_comp_channel*> comp_channels;   // one per I/O thread
  std::vector<std::unique_ptr<Poller>> pollers;   // one per I/O thread
  std::unique_ptr<CmThread> cm;
  std::vector<RegisteredRegion> regions;          // written before listen/connect only
  std::atomic<bool> sealed{false};                // a listener or connection exists
  std::atomic<std::uint32_t> next_io{0};

  // Active-side connect attempts waiting on the rdma_cm (CM thread only).
  // ~RdmaTransport runs cancel_connects() before it waits for the connects
  // in progress: each waiting attempt, and each one that begins after it,
  // ends at once with kCancelled, so the destructor does not wait out a CM
  // reply that may not come before connect_timeout.
  void cancel_connects();
  bool connects_cancelled = false;
  std::uint64_t next_attempt = 0;
  std::unordered_map<std::uint64_t, std::function<void()>> attempt_cancellers;

  // The registered region holding [p, p + n), or nullptr. `hint` is a
  // MemoryLocation::region_id to try first. Any thread.
  const RegisteredRegion* find_region(const void* p, std::size_t n, std::uint32_t hint) const noexcept;
};

// Memory a channel posts receives from or sends from: a pool block (Buffer
// from the receive allocator, inside a registered region) or a private
// mapping registered for this channel.
struct Ring {
  Buffer owner;                 // pool block, or empty for a private mapping
  std::byte* base = nullptr;
  std::size_t bytes = 0;
  std::uint32_t lkey = 0;
  ibv_mr* private_mr = nullptr; // owned when the ring is private
  void* private_map = nullptr;  // owned (munmap) when the ring is private
  void release() noexcept;
};

class Channel final : public Pollable {
 public:
  Channel(RdmaConnection* conn, Core& core, std::uint32_t index, std::uint32_t io_index);
  ~Channel() override;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // --- set-up: CM thread, before start() ---
  // Rings, completion queue, encoder. Errors: kConfig (RLIMIT_MEMLOCK for a
  // private ring), kIo (verbs), kPoolExhausted is not returned (a pool that
  // cannot give a ring falls back to a private one).
  Status prepare();
  // Queue pair on `id` (this channel's CQ), every receive posted.
  Status create_qp(rdma_cm_id* id);
  // After a failed connect attempt destroyed the id and its queue pair:
  // empty the CQ, forget the receives, so create_qp can run again.
  void reset_after_failed_attempt();
  // Releases CQ and rings of a channel that was never started (its id, if
  // any, must already be destroyed). CM thread.
  void release_unstarted() noexcept;
  rdma_cm_id* id() const noexcept { return id_; }
  void set_id(rdma_cm_id* id) noexcept { id_ = id; }
  std::uint32_t io_index() const noexcept { return io_index_; }
  std::uint32_t index() const noexcept { return index_; }
  bool prepared() const noexcept { return cq_ != nullptr; }

  // --- I/O thread ---
  void start();
  int poll(int budget) override;
  bool arm() override;
  // The CM reported DISCONNECTED for this channel's id.
  void on_disconnected();
  // Stops the channel; ends (asynchronously) with conn->channel_finished().
  void teardown();
  // Queues the goodbye (after everything queued), for an orderly close.
  void begin_goodbye();
  // One line of internal state (credits, queues, posted work); any thread
  // (RX fields are read racily: for diagnostics only).
  std::string debug_state();

  // --- any thread ---
  Status send_small(std::span<const std::byte> bytes);
  Status send_large(Buffer&& payload, SendCompletion&& done);
  Status flush();  // closes the open batch and ends a cork()
  // Until flush(): the open batch closes only once full (no flush timer), so
  // a burst of small messages leaves in full batches.
  void cork();

 private:
  enum class EntryKind : std::uint8_t { kBatch, kLarge, kGoodbye };
  enum class LargeState : std::uint8_t { kNew, kAwaitGrant, kGranted, kFragment };
  struct Grant {
    protocol::GrantBody body;
    std::uint64_t last_use = 0;  // LRU order
  };
  struct TxEntry {
    EntryKind kind = EntryKind::kBatch;
    // batch
    std::byte* frame = nullptr;
    std::uint32_t frame_bytes = 0;
    std::int32_t slot = -1;                   // send slot holding the frame, -1: overflow
    std::unique_ptr<std::byte[]> overflow;    // frame storage when no slot was free
    std::uint64_t messages = 0;
    // large
    Buffer payload;
    SendCompletion done;
    std::uint32_t lkey = 0;
    bool registered = false;
    LargeState state = LargeState::kNew;
    std::uint32_t request = 0;
    protocol::GrantBody grant;
    std::uint64_t frag_offset = 0;
    std::uint64_t write_offset = 0;   // bytes already posted as RDMA WRITEs
    // both
    std::uint64_t flow_bytes = 0;
  };
  // A posted send work request, completed in posting order (RC send queue).
  struct InFlight {
    std::uint64_t wr_id = 0;
    std::int32_t send_slot = -1;
    std::int32_t ctrl_slot = -1;
    bool write = false;
    bool goodbye = false;
    bool frame = false;          // carries messages (counted in frames_sent)
    std::uint64_t flow_bytes = 0;
    std::uint64_t messages = 0;
    Buffer payload;
    SendCompletion done;
  };
  struct Finished {
    Buffer payload;
    SendCompletion done;
  };
  struct CtrlMsg {
    protocol::MsgType type = protocol::MsgType::kGrant;
    std::array<std::byte, protocol::kMaxControlBytes> body{};
    std::uint8_t bytes = 0;
  };
  // Receive-side slot: a block granted to the peer.
  struct Slot {
    Buffer block;
    bool unsolicited = false;
    // The announced size for a slot granted to an RTS: the message's size
    // (a chunked write's completion reports only its last chunk). 0 for an
    // unsolicited slot, which only single-write messages use: its size is
    // the completion's byte_len.
    std::uint64_t exact_bytes = 0;
  };
  // Things done under mu_ whose effects run after it is released.
  struct Deferred {
    std::optional<Error> fail;
    std::vector<Finished> finished;  // sent: completions run with ok
    std::vector<Finished> failed;    // not sent: completions run with kClosed
    bool closed = false;
    std::uint64_t flow_release = 0;
    bool arm_flush_timer = false;
  };

  // TX helpers, under mu_.
  void open_batch_locked();
  void add_item_locked(std::span<const std::byte> bytes);
  void close_batch_locked();
  void pump_locked(Deferred& d);
  bool step_entry_locked(TxEntry& e, Deferred& d);  // true: entry done (popped by caller)
  bool post_send_locked(protocol::MsgType type, const std::byte* data, std::uint32_t bytes,
                        std::uint64_t wr_id, bool uses_credit, Deferred& d);
  bool post_write_locked(TxEntry& e, Deferred& d);
  void enqueue_ctrl_locked(protocol::MsgType type, std::span<const std::byte> body);
  void maybe_send_credit_locked(Deferred& d);
  std::optional<protocol::GrantBody> take_cached_grant_locked(std::uint64_t size_bytes);
  // Frees a send slot held by a batch queued behind the head when no posted
  // SEND will return one; false when none could be freed.
  bool reclaim_slot_locked();
  void add_cached_grant_locked(const protocol::GrantBody& g);
  bool sq_full_locked() const noexcept { return sends_in_flight_ >= geometry_.max_send_wr; }
  void run_deferred(Deferred& d);

  // RX helpers, I/O thread.
  void handle_wc(const ibv_wc& wc, std::vector<std::uint32_t>& reposts, std::uint32_t& returned,
                 std::uint32_t& owed_new, Deferred& d);
  void complete_send(const ibv_wc& wc, bool ok, Deferred& d);
  // false: the connection failed (stop processing).
  bool handle_recv(std::uint32_t slot, const ibv_wc& wc, std::uint32_t& returned, bool& counts);
  bool on_batch(std::span<const std::byte> body);
  bool on_write(std::uint32_t slot_id, std::uint32_t bytes);
  bool on_rts(std::span<const std::byte> body);
  bool on_grant(std::span<const std::byte> body);
  bool on_no_grant(std::span<const std::byte> body);
  bool on_release(std::span<const std::byte> body);
  bool on_fragment(bool first, std::span<const std::byte> body);
  Result<Buffer> allocate_receive(std::uint64_t size_bytes);
  // A granted slot for `block` if it lies in a registered region (0 if not).
  std::uint32_t grant_slot(Buffer&& block, bool unsolicited, std::uint32_t request,
                           std::uint64_t exact_bytes);
  void post_receives(const std::vector<std::uint32_t>& slots);
  void check_quiesced();
  bool protocol_error(std::string message);
  void arm_flush_timer();
  void on_flush_timer();
  void on_heartbeat_timer();
  void finish_teardown();
  void complete_teardown();
  std::uint64_t outstanding() const noexcept;

  RdmaConnection* conn_;
  Core& core_;
  const Geometry& geometry_;
  const std::uint32_t index_;
  const std::uint32_t io_index_;
  rdma_cm_id* id_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_cq* cq_ = nullptr;
  Ring recv_ring_;
  Ring send_ring_;
  std::unique_ptr<boost::asio::steady_timer> flush_timer_;
  std::unique_ptr<boost::asio::steady_timer> heartbeat_timer_;
  std::unique_ptr<boost::asio::steady_timer> drain_timer_;

  // TX state, under mu_.
  std::mutex mu_;
  std::optional<wire::BatchEncoder> encoder_;
  std::int32_t open_slot_ = -1;
  std::unique_ptr<std::byte[]> open_overflow_;
  std::uint64_t open_flow_bytes_ = 0;
  std::uint64_t open_messages_ = 0;
  std::vector<std::int32_t> free_send_slots_;
  std::vector<std::int32_t> free_ctrl_slots_;
  std::vector<std::unique_ptr<std::byte[]>> free_overflow_;
  std::deque<TxEntry> queue_;
  std::deque<CtrlMsg> ctrl_queue_;
  std::deque<InFlight> in_flight_;
  std::vector<Grant> grants_;              // slots the peer granted us ahead of time
  std::uint32_t credits_ = 0;              // receives the peer has posted for us, unused
  std::uint32_t owed_ = 0;                 // receives we reposted, not yet reported
  std::uint32_t sends_in_flight_ = 0;
  std::uint32_t writes_in_flight_ = 0;
  std::uint32_t next_request_ = 0;
  std::uint64_t grant_clock_ = 0;
  std::uint64_t next_wr_ = 0;
  bool peer_cannot_grant_ = false;         // a no-grant came: send fragments directly
  bool flush_timer_armed_ = false;
  bool corked_ = false;  // cork() until flush()
  bool goodbye_queued_ = false;
  bool goodbye_sent_ok_ = false;
  bool tx_closed_ = false;
  bool started_ = false;
  std::atomic<std::int64_t> last_tx_ns_{0};

  // RX state, I/O thread only.
  std::uint32_t recvs_posted_ = 0;
  std::unordered_map<std::uint32_t, Slot> slots_;
  std::uint32_t next_slot_ = 0;
  std::uint32_t unsolicited_slots_ = 0;
  Buffer frag_buffer_;
  std::uint64_t frag_total_ = 0;
  std::uint64_t frag_received_ = 0;
  bool frag_active_ = false;
  std::int64_t last_rx_ns_ = 0;
  bool goodbye_received_ = false;
  bool disconnect_requested_ = false;
  bool torn_down_ = false;
  bool draining_ = false;
  bool finishing_ = false;
};

class RdmaConnection final : public ConnectionCore {
 public:
  RdmaConnection(std::shared_ptr<Core> core, PeerInfo peer, Handlers handlers);
  ~RdmaConnection() override;

  // --- set-up (CM thread, or the connecting thread before the CM sees it) ---
  Channel& channel(std::uint32_t i) { return *channels_[i]; }
  std::uint32_t channel_count() const noexcept { return static_cast<std::uint32_t>(channels_.size()); }
  void set_peer(PeerInfo peer) { set_peer_info(std::move(peer)); }
  // CM thread: destroys the ids, queue pairs, CQs and rings of a connection
  // that was never started (set-up failed). on_closed will not run.
  void abort_setup() noexcept;
  // Any thread, once: every channel starts (on its I/O thread).
  void start();
  // CM thread: an event for channel `ch`'s id after set-up.
  void on_cm_event(std::uint32_t ch, const CmEvent& event);

  // --- Connection ---
  Status send(std::uint32_t channel, std::span<const std::byte> bytes,
              std::chrono::nanoseconds wait) override;
  Status send(std::uint32_t channel, Buffer&& payload, SendCompletion done,
              std::chrono::nanoseconds wait) override;
  Status flush(std::uint32_t channel) override;
  Status flush_all() override;
  void cork(std::uint32_t channel) override;
  void close(std::chrono::nanoseconds drain) override;
  RdmaStats rdma_stats() const noexcept;
  std::string debug_state();

  // --- used by Channel ---
  void request_disconnect(std::uint32_t ch);
  void channel_finished();
  Core& core() { return *core_; }
  std::shared_ptr<RdmaConnection> shared() {
    return std::static_pointer_cast<RdmaConnection>(shared_from_this());
  }

  std::atomic<std::uint64_t> sends_posted{0}, writes_posted{0}, rts_sent{0}, grants_received{0},
      cached_slot_writes{0}, slots_released{0}, fragments_sent{0}, credit_messages_sent{0},
      credit_stalls{0};

 private:
  std::size_t lane_count() const noexcept override { return channels_.size(); }
  // Every started channel tears down on its I/O thread (first fail() only);
  // before start(), set-up owns the channels (abort_setup).
  void start_teardown() override;

  // on_closed, once every channel finished; and the drain timer cancelled.
  void finish_closed();

  std::shared_ptr<Core> core_;
  std::vector<std::unique_ptr<Channel>> channels_;
  std::atomic<bool> started_{false};

  // Callers running a send's completion on their own thread (send(Buffer)
  // of a payload small enough to be copied into a batch: it completes once
  // copied). transport.h promises no callback after on_closed, so the last
  // channel to finish leaves on_closed to the last of these callers when any
  // is still inside; it keeps an I/O object counted until then, so
  // ~Transport waits for that on_closed too.
  std::mutex completing_mu_;
  int callers_completing_ = 0;       // under completing_mu_
  bool closed_when_callers_done_ = false;  // under completing_mu_
};

}  // namespace ember::transport::rdma::detail
