// The transport interface: how Ember moves opaque messages between a worker
// and a server, independent of the wire underneath (tcp, shm, rdma).
//
// Model (after gloo/transport and NCCL's net plugin contract):
//  * A Transport is one per process and kind; it owns the I/O threads (one
//    io_context each) and the memory registrations. It makes Listeners (server
//    side) and Connections (worker side, via connect()).
//  * A Connection links this process with one peer. It has `num_channels`
//    independent lanes (channels, numbered 0..num_channels-1): each has its own
//    batcher, its own send-buffer region and its own stream (a TCP connection,
//    a pair of shared-memory rings, a queue pair). Order is preserved per
//    channel and only per channel. The caller picks the channel (with
//    common/placement::channel_of for keyed traffic); the transport knows
//    nothing of keys.
//  * A message is one framer item of opaque bytes (0..max_message_bytes).
//    Small messages (those that fit in one batch of batch_threshold bytes with
//    their item header) are packed into batches by the common/wire framer;
//    larger ones travel alone, straight from the caller's Buffer.
//
// Invariants every implementation keeps:
//  * Per channel, messages are delivered in the order send() accepted them,
//    small and large interleaved.
//  * A Connection never holds more than Options::max_queued_bytes of accepted
//    but unsent message bytes: send() then waits (up to its timeout) or fails.
//  * on_closed runs exactly once per Connection that was handed to the user
//    (by connect() or by a Listener's on_accept), after which no other
//    callback runs for it.
//  * Every Buffer handed to send() is released exactly once: after its bytes
//    are on the wire (or no longer needed by the peer), or when the
//    Connection fails.
//
// RDMA fits the same contract: register_memory() is where ibv_reg_mr happens
// once per pool region; send(channel, Buffer, completion) is completion-driven
// (the Buffer is owned until the work completion); max_queued_bytes and the
// peer's posted receive buffers give credit-based flow control; the receive
// allocator names the pool blocks that RDMA WRITEs land in.
//
// Thread model: callbacks run on the I/O thread that serves the channel the
// message arrived on. Different channels of one Connection may be served by
// different I/O threads, so on_message may run concurrently for different
// channels of the same Connection (never concurrently for one channel).
// Callbacks must not block for long: while one runs, its channel (and the
// other channels on that I/O thread) receive nothing, which is also how a
// slow receiver pushes back on its senders.
//
// Lifetimes: a Connection or Listener may outlive its Transport (the user's
// handles stay valid), but ~Transport closes them all first (on_closed runs
// with kCancelled during it) and then joins the I/O threads. From then on a
// Connection refuses work: send() and flush() fail with kClosed, close() does
// nothing; destroying a Listener does nothing more. A call that races
// ~Transport either gets its work in before the I/O threads are joined, where
// it runs, or is refused as above; no work is ever queued for a joined
// thread (it would never run, and what it holds would leak). The same holds
// for a connect() that began before ~Transport: ~Transport cuts short the
// waits of its handshake (rdma: its wait for the CM reply) and waits for it
// to return; it returns an error
// (kCancelled, or what its peer did meanwhile), or a Connection that
// ~Transport has closed like the others.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/error.h"
#include "common/transport/buffer.h"

namespace ember::transport {

// Protocol version spoken in the handshake. Bump on any change to the
// handshake, the control records or the frame layout (and with
// common/placement's hash, which every peer must share).
inline constexpr std::uint16_t kProtocolVersion = 2;

enum class Kind : std::uint8_t {
  kTcp = 1,  // Boost.Asio over TCP (any host)
  kShm = 2,  // same host: shared memfd regions, shared-memory rings, eventfd
  kRdma = 3, // rdma-core verbs over RC queue pairs (rdma/; needs EMBER_WITH_RDMA and a device)
};
std::string_view kind_name(Kind kind) noexcept;  // "tcp", "shm", "rdma"

// How tcp sends a large message from pool memory.
enum class ZeroCopy : std::uint8_t {
  kWritev = 1,    // one gathered write of header + payload (default: measured faster on loopback)
  kSendfile = 2,  // header with write(), payload with sendfile() from the memfd (payloads of
                  // 256 KiB and more; smaller ones still go with one gathered write)
};
std::string_view zero_copy_name(ZeroCopy mode) noexcept;  // "writev", "sendfile"

enum class Role : std::uint8_t { kWorker = 1, kServer = 2 };
std::string_view role_name(Role role) noexcept;  // "worker", "server"

// Who is at the other end, as stated in its handshake.
struct PeerInfo {
  Role role = Role::kWorker;
  std::uint32_t rank = 0;          // worker rank (0 for a server; servers have an index instead)
  std::uint32_t num_channels = 0;  // agreed count, equal on both sides
  std::string address;             // "127.0.0.1:43121", or the Unix socket path for shm
};

// Receive-side memory for large messages: called on the I/O thread with the
// payload size in bytes; returns a Buffer of at least that many bytes (the
// transport truncate()s it to the exact size). Typically a page-pool block
// (transport/pool_buffer.h adapts memory::PagePool). An error closes the
// channel's Connection with that error (e.g. kPoolExhausted). When unset, the
// transport uses Buffer::heap. Must be thread-safe if the Transport has more
// than one I/O thread. Not used by shm (a received shm payload is a view of
// the sender's block; see Incoming).
using ReceiveAllocator = std::function<Result<Buffer>(std::uint64_t size_bytes)>;

// Everything a Transport needs, usually built from the [communication]
// table of the config (transport/options_from_config.h). Units are in the
// names or the types.
struct Options {
  Kind kind = Kind::kTcp;
  // Largest batch frame, header and item table included. Messages that do
  // not fit in an empty batch are sent as large messages. 512 B .. 64 MiB.
  std::uint64_t batch_threshold_bytes = 4096;
  // A non-empty open batch is sent at most this long after its first message
  // was added, or as soon as it is full, whichever is first. Zero: a batch is
  // sent as soon as the I/O thread gets to it (several may share a write).
  std::chrono::nanoseconds flush_interval{0};
  // false: every small message is its own frame and its own write system call
  // (the "batching off" baseline of the benchmark; never useful in production).
  bool batching = true;
  // An I/O thread with nothing to do polls this long before it blocks in
  // epoll_wait (transport/io_threads.h). 0: block at once.
  std::chrono::nanoseconds busy_poll{0};
  // Lanes per Connection, 1 .. 256. The listener accepts only peers that ask
  // for the same count.
  std::uint32_t num_channels = 1;
  ZeroCopy zero_copy = ZeroCopy::kWritev;
  // tcp: whether a large message's frame (wire::encode_single) has its
  // payload in the CRC32C (true) or only its header and table (false,
  // wire::kFrameFlagPrefixChecksum; TCP's own checksum guards the payload).
  // Receivers accept both. Batch frames are always covered whole. shm and
  // rdma ignore it.
  bool payload_checksum = false;
  // tcp: a thread calling send() on an idle channel writes to the socket
  // itself (no I/O-thread wake-up) up to this many bytes, then hands the rest
  // to the I/O thread. 0: send() only queues and the I/O thread writes
  // everything, which keeps the system calls' copies off the caller's core
  // when the I/O threads are pinned to cores of their own (cpu_affinity).
  // shm and rdma ignore it.
  std::size_t inline_write_bytes = std::size_t{8} << 20;
  // Number of I/O threads (each with its own io_context); channels are
  // spread over them round-robin. 1 .. 256.
  std::uint32_t num_io_threads = 1;
  // CPU per I/O thread (index i pins thread i); empty: not pinned. Pinning
  // failure is logged, not fatal.
  std::vector<int> cpu_affinity;
  // A heartbeat is sent on a channel that has sent nothing for this long; a
  // peer from which nothing (data or heartbeat) arrives for heartbeat_timeout
  // is declared dead: the Connection closes with ErrorCode::kTimeout. The
  // interval is positive and the timeout greater than it.
  std::chrono::nanoseconds heartbeat_interval = std::chrono::seconds(1);
  std::chrono::nanoseconds heartbeat_timeout = std::chrono::seconds(10);
  // Largest message (payload bytes) accepted by send() and from a peer.
  std::uint64_t max_message_bytes = std::uint64_t{1} << 30;
  // Bound on message bytes accepted by send() but not yet written (or, for
  // shm and rdma, not yet released by the peer), per Connection, all
  // channels together. A single message larger than this is still accepted
  // when nothing else is queued, so the bound is max(max_queued_bytes,
  // largest message). At least batch_threshold_bytes.
  std::uint64_t max_queued_bytes = std::uint64_t{256} << 20;
  // shm: slots in each channel's shared-memory ring, per direction (config
  // key ring_buffer_size). A slot holds one batch (batch_threshold_bytes) or
  // one large-message descriptor, so a ring costs ring_slots *
  // batch_threshold_bytes of shared memory. Power of two, 2 .. 2^24.
  std::uint32_t ring_slots = 1024;
  // Shared secret. A Listener on a non-loopback address refuses to start
  // when it is empty; when set, every peer must present the same token.
  std::string auth_token;
  // How long connect() waits for the TCP/Unix connection and the handshake.
  std::chrono::nanoseconds connect_timeout = std::chrono::seconds(10);
  ReceiveAllocator receive_allocator;

  // Checks the ranges and combinations stated at the fields (and positive
  // max_message_bytes and connect_timeout, non-negative flush_interval).
  // Errors: kConfig, naming the field and the fix.
  Status validate() const;
};

// A message handed to on_message.
struct Incoming {
  std::uint32_t channel = 0;
  // The payload. For a small message it points into the transport's receive
  // buffer and is valid only during the callback (copy it to keep it). For a
  // large message it equals owned.bytes().
  std::span<const std::byte> bytes;
  // Non-empty for a large message: the owning handle (a receive-allocator
  // block for tcp; for shm a read-only view of the sender's block, which
  // tells the sender to reuse the block when destroyed: do not write to it,
  // and copy what must outlive the Connection). Move it out to keep the
  // payload beyond the callback without copying. May be destroyed on any
  // thread.
  Buffer owned;
  bool is_large() const noexcept { return !owned.empty(); }
  // How many more messages of the same received batch follow this one on
  // this channel (they are delivered next); 0 for a batch's last message and
  // for a large one. A hint for a receiver that chooses between answering at
  // once and handing work to other threads (ember-server's inline path).
  // Control items (tcp heartbeats) may be counted.
  std::uint32_t more_in_batch = 0;
};

// Called once per large send, after the transport is done with the Buffer
// (it has already been released): ok when the bytes were handed to the
// kernel (tcp) or consumed by the peer (shm); the Connection's error
// otherwise. It runs on the thread that finished the send: an I/O thread, or
// the thread inside send()/flush() when the write completed inline (never
// under a transport lock, so it may call send()). Must not throw.
using SendCompletion = std::function<void(const Status& status)>;

// Counters, monotonic since the Connection was made. Read with stats() from
// any thread (relaxed reads: a consistent snapshot is not promised).
struct ConnectionStats {
  std::uint64_t messages_sent = 0;
  std::uint64_t messages_received = 0;
  std::uint64_t bytes_sent = 0;        // payload bytes of messages
  std::uint64_t bytes_received = 0;    // payload bytes of messages
  std::uint64_t frames_sent = 0;       // batches + large frames
  std::uint64_t frames_received = 0;
  std::uint64_t write_syscalls = 0;    // write/writev/sendmsg/sendfile/eventfd writes
  std::uint64_t read_syscalls = 0;     // read/readv/recvmsg/eventfd reads
  std::uint64_t heartbeats_sent = 0;
  std::uint64_t heartbeats_received = 0;
  std::uint64_t queued_bytes = 0;      // current value of the flow-control counter
  std::uint64_t queued_bytes_high_water = 0;
  // Advances whenever data leaves for the peer, even part of a frame (tcp:
  // bytes written to the socket; shm: ring slots published, which needs the
  // peer to have freed them; rdma: frames completed). Only its changes mean
  // anything: unchanged over a wait, the peer took nothing.
  std::uint64_t tx_progress = 0;
};

class Connection;

// Per-Connection callbacks. Both are required; both run on I/O threads and
// must not throw. (on_message, and send completions, also run on a thread in
// Connection::poll(), when it is the one that finds the message.)
struct Handlers {
  // One call per received message, in order per channel: never two at once
  // for one channel.
  std::function<void(Connection& connection, Incoming&& message)> on_message;
  // Exactly once: the Connection is closed. `reason` is kClosed for an orderly
  // close (either side called close()), kTimeout for a silent peer, kIo for a
  // reset, kMalformedFrame / kChecksumMismatch / kProtocol for a peer that sent
  // garbage, kTooLarge (a frame above the limits) or kVersionMismatch (a
  // frame of another wire version) from the frame decoder, kCancelled when
  // ~Transport closes it (see Lifetimes), or the receive allocator's error. Buffers handed to send() that
  // were not yet written have been released (their completions ran with
  // `reason`) before this call.
  std::function<void(Connection& connection, const Error& reason)> on_closed;
};

// One peer, `num_channels` lanes. Made by Transport::connect() or handed to a
// Listener's on_accept. Shared ownership: the transport keeps a reference
// while I/O is in flight, so a Connection may be dropped by the user at any
// time (dropping the last user reference does not close it; call close()).
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  virtual ~Connection() = default;

  virtual const PeerInfo& peer() const noexcept = 0;
  std::uint32_t num_channels() const noexcept { return peer().num_channels; }

  // Sends a small or large message by copy: the bytes are copied once into
  // the channel's open batch (for tcp: the batch buffer; for shm: the next
  // slot of the shared ring — this is the one copy of the small-message path)
  // and sent when the batch is full, after flush_interval, or at flush(). A
  // message too big for a batch is copied too (tcp: into a heap Buffer sent as
  // a large message; shm: through the ring in fragments): prefer the Buffer
  // overload with pool memory for those. `bytes` may be reused as soon as
  // send() returns.
  //
  // Thread-safe: any thread may call it, for any channel (a per-channel lock
  // orders concurrent callers). Blocks only when the queue (tcp, shm large) or
  // the ring (shm) is full: then waits up to `wait` for the peer to drain it.
  // On an I/O thread of this Transport it never waits (the peer may be
  // waiting for this very thread): it fails at once instead, and an shm
  // fragmented message is taken whole or not at all.
  // Errors: kInvalidArgument (channel >= num_channels), kTooLarge (over
  // max_message_bytes), kTimeout (queue still full after `wait`; nothing was
  // queued), kClosed (the Connection is closed; the message was dropped).
  virtual Status send(std::uint32_t channel, std::span<const std::byte> bytes,
                      std::chrono::nanoseconds wait = std::chrono::seconds(30)) = 0;

  // Sends `payload` as one message. Small payloads are copied into the batch
  // (as above) and released before send() returns. Large payloads are sent
  // from their memory without a copy (tcp: writev of header + payload, or
  // sendfile from location().fd when zero_copy is kSendfile and the Buffer
  // has an fd and is borrowed — sendfile's completion does not mean the
  // kernel has read the pages, so the caller must keep a borrowed payload
  // unchanged until the peer has answered; owned Buffers go by writev; shm:
  // by reference when the Buffer lies in a registered region, otherwise
  // copied through the ring in fragments; rdma: from the registered region).
  // The transport owns the payload from a successful call until it is
  // released, then runs `done` (if set): on the I/O thread, or, for a
  // payload copied inside send() (small ones; shm large ones outside every
  // registered region), on the calling thread before send() returns. Either
  // way `done` runs before on_closed (a close waits for a caller running it).
  // On an error return the payload was released and `done` is not called.
  // Thread-safety, blocking and errors as for the span overload.
  virtual Status send(std::uint32_t channel, Buffer&& payload, SendCompletion done = {},
                      std::chrono::nanoseconds wait = std::chrono::seconds(30)) = 0;

  // Closes the open batch of `channel` (or of every channel) and starts
  // sending it now. Never blocks; thread-safe. Errors: kInvalidArgument,
  // kClosed.
  virtual Status flush(std::uint32_t channel) = 0;
  // Hint that a burst of sends on `channel` follows, until flush(channel)
  // or flush_all(). The transport then closes a batch only when it is full
  // or at the flush (not after flush_interval), so a burst of small
  // messages leaves in full batches; tcp also holds the written frames back
  // and writes them together (up to 64 buffers per system call; it writes
  // once the held queue reaches 32 frames or 256 KiB, and before a send
  // would wait for room under max_queued_bytes). Messages sent
  // while corked may wait for the flush: a corking caller must flush.
  // Thread-safe; never blocks; no error.
  virtual void cork(std::uint32_t channel) { (void)channel; }
  virtual Status flush_all() = 0;

  // Orderly close: sends what is queued (bounded by `drain`), tells the peer,
  // closes every channel, then on_closed runs with kClosed on both sides.
  // Thread-safe, idempotent, never blocks (the drain is asynchronous).
  // ~Transport closes every Connection itself (kCancelled, no drain): a
  // close() concurrent with it or after it adds nothing, and queues nothing
  // once the I/O threads are being joined (see Lifetimes above).
  virtual void close(std::chrono::nanoseconds drain = std::chrono::seconds(1)) = 0;

  virtual bool is_closed() const noexcept = 0;
  virtual ConnectionStats stats() const noexcept = 0;

  // Consumes, on the calling thread, what has arrived on this connection's
  // channels: runs on_message for received messages and the completions of
  // sends the peer has given back, as the I/O thread would. For a thread
  // that is about to wait for a reply anyway: it takes the reply itself
  // instead of waiting for the I/O thread to be scheduled, which on a busy
  // machine costs a context switch per message (the same idea as a waiting
  // thread driving progress in UCX, ucp_worker_progress, or polling an RDMA
  // completion queue). A channel another thread is consuming at the moment
  // is skipped. Returns true when anything was delivered or completed.
  // Thread-safe; never blocks (runs the handlers, which must not block).
  // shm only; tcp and rdma return false (their I/O threads do all of it).
  // No error: a protocol error found here closes the connection, as on the
  // I/O thread.
  virtual bool poll() { return false; }

  // One-sided write into the peer's memory: copies `data` to bytes
  // [offset_bytes, +data.size()) of the region the peer registered as
  // `region_id` (the id its register_memory returned). Only the shm transport
  // maps peer memory (every region the peer registered before it connected
  // or listened). The peer sees the bytes once a message sent after this call
  // has arrived (the lane's release/acquire orders them). For replies written
  // straight into the requester's destination (proto::kFlagInPlace).
  // `copy`: kCached (memcpy) or kStream (memory::stream_copy: non-temporal
  // stores, for data larger than the cache).
  // Safety against a peer that gave up on us: once the peer's side of the
  // connection ends (it closed, or declared us dead after heartbeat_timeout
  // while this process was stalled), it revokes the right to write (shm
  // lane.h: memory_revoked) and this call refuses; a write already in
  // progress delays the peer's on_closed until it ends (up to its
  // heartbeat_timeout), so memory the peer reuses after its error is not
  // written afterwards.
  // Thread-safe; never blocks (the copy runs on the calling thread).
  // Errors: kUnavailable (tcp, rdma: no peer memory is mapped here);
  // kInvalidArgument (no region `region_id`, or the range lies outside it),
  // naming the region, offset, size and region length; kClosed (this side is
  // closing or the peer revoked writes; nothing was written).
  // `window`: 0, or the id of a write window the peer opened for this write
  // (open_write_window on its side, sent to us with the request); the write
  // is then refused once the peer closed that window (kClosed, nothing
  // written), as when it gave up on the request.
  enum class PeerCopy { kCached, kStream };
  virtual Status write_peer_memory(std::uint32_t region_id, std::uint64_t offset_bytes,
                                   std::span<const std::byte> data,
                                   PeerCopy copy = PeerCopy::kCached, std::uint32_t window = 0);

  // Write windows (shm): per-request permission for the peer to write into
  // our memory. A worker opens one for each pull whose reply the server
  // writes in place, sends its id with the request, and closes it when the
  // reply is in or when it gives up on the request (request_timeout): once
  // close_write_window returned, the peer's write_peer_memory with that id is
  // refused and none is in progress, so the destination can be reused. The
  // same idea as an RDMA memory window that the owner invalidates.
  // open_write_window: never blocks; thread-safe. Returns an id (never 0).
  // Errors: kUnavailable (tcp, rdma); kClosed; kTooLarge when all
  // shm::kWriteWindows windows of this connection are open (send the request
  // without a placement then).
  virtual Result<std::uint32_t> open_write_window();
  // Closes `window` (an id open_write_window returned). Waits while the peer
  // is writing through it (a copy in progress: microseconds; at most
  // heartbeat_timeout for a peer that stalled mid-copy, then logged). No-op
  // on a closed connection: its writes were revoked with it (on_closed waits
  // for a write in progress). Thread-safe; no error.
  virtual void close_write_window(std::uint32_t window) { (void)window; }
};

// The server side: accepts connections and handshakes them. A Connection is
// handed to on_accept only after every one of its channels has connected and
// passed the handshake; a refused peer (wrong token, wrong version, channel
// count mismatch, garbage) is told why, logged once, and never reaches the
// user. Destroying the Listener stops accepting; Connections it made live on.
// It may be destroyed before or after its Transport (after: ~Transport has
// closed it already and its destruction only frees it). Destroying it:
// any thread, never blocks.
class Listener {
 public:
  virtual ~Listener() = default;
  // The bound address: "127.0.0.1:43121" (port 0 in listen() resolved) or
  // the Unix socket path for shm.
  virtual std::string address() const = 0;
  // Number of peers refused so far (bad handshake), for tests and metrics.
  virtual std::uint64_t num_refused() const noexcept = 0;
};

using AcceptHandler = std::function<void(std::shared_ptr<Connection> connection)>;

// What this side says about itself in the handshake.
struct LocalIdentity {
  Role role = Role::kWorker;
  std::uint32_t rank = 0;
};

class Transport {
 public:
  // Validates `options` and starts the I/O threads. Errors: whatever
  // Options::validate() returns; kUnavailable for rdma without a device with
  // an active port, or in a build without rdma-core (EMBER_WITH_RDMA=OFF);
  // kIo when a thread or fd cannot be created.
  static Result<std::unique_ptr<Transport>> create(Options options);

  // Stops the I/O threads after closing every Connection (on_closed runs with
  // kCancelled for those still open, during this destructor), so whatever the
  // Handlers refer to must outlive the Transport. Cancels the connect() calls
  // in progress and waits for them. Blocks until every I/O object is gone.
  // Must not be called from an I/O thread, nor from a send's
  // completion (`done`), which may run on the thread that called send(): a
  // close waits for it (see send()).
  virtual ~Transport() = default;

  virtual Kind kind() const noexcept = 0;
  virtual const Options& options() const noexcept = 0;

  // Makes `region` (typically a page pool's whole memfd mapping) known to the
  // transport before any Connection exists, so that Buffers inside it can be
  // sent by reference: shm passes its fd to each peer at handshake, rdma
  // registers it once. tcp records it and needs nothing more. Returns the
  // region id to put in MemoryLocation::region_id (adapters do this).
  // Thread-safety: call before listen()/connect(), from one thread. Errors:
  // kInvalidArgument (null base, zero length, fd < 0 for shm, a length that
  // is not a multiple of 4 KiB for shm), kIo.
  struct Region {
    void* base = nullptr;
    std::uint64_t length_bytes = 0;
    int fd = -1;  // the memfd mapped at base (offset 0); not owned, kept open by the caller
  };
  virtual Result<std::uint32_t> register_memory(const Region& region) = 0;

  // Starts listening on `address` ("host:port" for tcp, port 0 for any free
  // port; a filesystem path or "@abstract-name" for shm). Every accepted
  // Connection is handed to on_accept (on an I/O thread) and then driven by
  // `handlers`. Errors: kConfig (non-loopback address with an empty
  // auth_token), kInvalidArgument (unparsable address), kIo (bind/listen).
  virtual Result<std::unique_ptr<Listener>> listen(const std::string& address, LocalIdentity self,
                                                   AcceptHandler on_accept, Handlers handlers) = 0;

  // Connects to a Listener and handshakes every channel. Blocks the calling
  // thread (not an I/O thread) for at most options().connect_timeout.
  // Errors: kInvalidArgument (address), kIo (refused/unreachable), kTimeout,
  // kClosed (the peer closed or reset the connection during the handshake),
  // kAuth ("the server refused our auth token"), kVersionMismatch (naming
  // both versions), kProtocol (the peer is not an Ember server, or the
  // channel counts differ), kCancelled (~Transport began; see Lifetimes),
  // or any other code the listener's refusal carries (its text names why).
  virtual Result<std::shared_ptr<Connection>> connect(const std::string& address,
                                                      LocalIdentity self, Handlers handlers) = 0;

  // True when the calling thread is one of this Transport's I/O threads.
  virtual bool on_io_thread() const noexcept = 0;

  // The number of I/O threads (options().num_io_threads), and a way to run
  // `task` on I/O thread `index` (0 ≤ index < num_io_threads(); taken modulo
  // otherwise) behind what is already queued there. ember-server's watchdog
  // posts its liveness probes this way: a thread stuck in one handler never
  // runs the task. Thread-safe; never blocks. Returns false, with `task`
  // destroyed unrun, once ~Transport has begun joining its I/O threads (no
  // error code: the caller is shutting the transport down itself).
  virtual std::uint32_t num_io_threads() const noexcept = 0;
  [[nodiscard]] virtual bool post_to_io_thread(std::uint32_t index, std::function<void()> task) = 0;

  // How many connect() calls are in progress: past their start (from there
  // on a ~Transport on another thread cancels them rather than racing them;
  // see Lifetimes) and not yet returned. For diagnostics and tests.
  // Thread-safe; no error.
  virtual std::size_t connects_in_progress() const noexcept = 0;
};

}  // namespace ember::transport
