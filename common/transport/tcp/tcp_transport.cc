// tcp transport implementation. See tcp_transport.h for the stream format
// and the write/read model.
//
// Object graph and lifetimes:
//   TcpTransport (user-owned) ──shared──▶ Core (options, I/O threads, live
//   Connections and Listeners). TcpConnection ──shared──▶ Core, owns its
//   Channels (unique). Every asynchronous handler captures a
//   shared_ptr<TcpConnection>, so a Connection lives while I/O is pending.
//   Asio I/O objects (sockets, timers, acceptors) are destroyed on their I/O
//   thread by teardown, which always happens before the Core joins its
//   threads, so no I/O object outlives its io_context. Work from other
//   threads goes through IoThreads::post, which refuses it once the threads
//   are being joined (a close() or a Listener's destruction that comes that
//   late finds everything closed already; queued, it would leak).
//
// Locking: one mutex per channel (TX state: encoder, queue, writer role).
// The RX state of a channel is touched only by its I/O thread. A writer
// drops the channel lock around each system call (`in_syscall_`), and the fd
// is never closed while a system call may be using it.
#include "common/transport/tcp/tcp_transport.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <cstdlib>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include "common/base/check.h"
#include "common/base/logging.h"
#include "common/base/units.h"
#include "common/transport/accept_pacer.h"
#include "common/transport/refusal_log.h"
#include "common/transport/connection_core.h"
#include "common/transport/control.h"
#include "common/transport/flow_control.h"
#include "common/transport/handshake.h"
#include "common/transport/io_threads.h"
#include "common/transport/receive_body.h"
#include "common/transport/stream_io.h"
#include "common/transport/tcp/address.h"
#include "common/wire/batch_encoder.h"
#include "common/wire/frame_decoder.h"

namespace ember::transport::tcp {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using std::chrono::nanoseconds;

constexpr std::size_t kMaxIov = 64;
// Queue entries (a large message is 2-3 buffers) after which a corked
// channel writes anyway: about what one gathered write takes.
constexpr std::size_t kCorkedEntries = kMaxIov / 2;
// Held frame bytes after which a corked channel writes anyway.
constexpr std::size_t kCorkedBytes = std::size_t{256} << 10;
// Reads per readiness event before yielding to other handlers on the thread.
constexpr int kReadsPerEvent = 16;
constexpr std::size_t kReceiveBufferBytes = std::size_t{256} << 10;
// Smallest payload sent with sendfile when zero_copy = sendfile.
constexpr std::size_t kSendfileMinBytes = std::size_t{256} << 10;

std::shared_ptr<spdlog::logger> tcp_log() {
  static std::shared_ptr<spdlog::logger> l = log::logger("tcp");
  return l;
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<nanoseconds>(Clock::now().time_since_epoch()).count();
}

void ignore_sigpipe_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      ::signal(SIGPIPE, SIG_IGN);
    }
  });
}

Status set_socket_options(int fd) {
  int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) {
    return make_sys_error(errno, "setsockopt(TCP_NODELAY)");
  }
  return ok_status();
}

class Core;
class TcpConnection;

// ---------------------------------------------------------------------------
// One piece of an outgoing entry: bytes in memory, or a range of a file.
struct Segment {
  const std::byte* data = nullptr;
  int fd = -1;
  std::uint64_t file_offset = 0;
  std::size_t bytes = 0;
};

// A frame queued for writing.
struct TxEntry {
  std::array<Segment, 3> segments{};
  std::uint8_t num_segments = 0;
  std::uint8_t segment = 0;        // first segment not fully written
  std::size_t segment_offset = 0;  // bytes of it written
  std::byte* batch_buffer = nullptr;  // batch: recycled after the write
  std::uint64_t flow_bytes = 0;       // released after the write
  std::uint64_t messages = 0;
  std::uint64_t frame_bytes = 0;
  alignas(8) std::array<std::byte, wire::kSinglePrefixBytes> prefix{};  // large: frame prefix
  Buffer payload;                     // large: owned until written
  SendCompletion done;
  bool done_set = false;
};

// What finished writing, to be released outside the channel lock.
struct Finished {
  Buffer payload;
  SendCompletion done;
};

// ---------------------------------------------------------------------------
class Channel {
 public:
  Channel(TcpConnection* conn, std::uint32_t index, asio::io_context& ctx,
          std::unique_ptr<tcp::socket> socket, const Options& options,
          wire::BatchEncoder encoder, const wire::DecoderOptions& decoder_options)
      : conn_(conn),
        index_(index),
        ctx_(ctx),
        socket_(std::move(socket)),
        fd_(socket_->native_handle()),
        options_(options),
        encoder_(std::move(encoder)),
        bodies_(&options.receive_allocator),
        decoder_options_(with_allocator(decoder_options, &bodies_)),
        decoder_(make_decoder(decoder_options_)) {}

  static wire::DecoderOptions with_allocator(wire::DecoderOptions o, wire::BodyAllocator* a) {
    o.body_allocator = a;
    return o;
  }
  static wire::FrameDecoder make_decoder(const wire::DecoderOptions& o) {
    auto d = wire::FrameDecoder::create(o);
    EMBER_CHECK_MSG(d.has_value(), "decoder options rejected: {}", d.error().to_string());
    return std::move(*d);
  }

  // Called once, on the I/O thread, after construction.
  void start();

  // --- TX: any thread ---
  // `after` (a small message sent as a Buffer): once `bytes` are copied into
  // the batch, its payload is released and its completion runs, on this
  // thread and counted as a writer, so on_closed cannot come before it.
  Status send_small(std::span<const std::byte> bytes, bool control, Finished* after = nullptr);
  Status send_large(Buffer&& payload, SendCompletion&& done);
  Status flush();
  void cork();
  // I/O thread: queue a goodbye and shut down the write side once it is out.
  void begin_goodbye();
  // Under mu_: appends one item to the open batch (opening one, or closing a
  // full one first).
  void add_item_locked(std::span<const std::byte> bytes, std::uint32_t flags);

  // I/O thread: drop everything, close the socket, count the channel done.
  void teardown();

  asio::io_context& context() { return ctx_; }
  wire::FrameDecoder& decoder() { return decoder_; }
  ReceiveBodies& bodies() { return bodies_; }
  std::int64_t last_tx_ns() const { return last_tx_ns_.load(std::memory_order_relaxed); }

 private:
  // Under mu_: closes the open batch (if any items) into the queue.
  void close_batch_locked();
  // Under mu_: takes the writer role if free; true when the caller must
  // call write_loop().
  bool claim_writer_locked() {
    if (writer_active_ || queue_.empty() || tx_closed_) return false;
    // Corked: hold the queue until flush(), or until it gathers as many
    // buffers as one write takes, or enough bytes that holding them gains
    // nothing (large messages are one write each anyway).
    if (corked_ && queue_.size() < kCorkedEntries) {
      std::size_t held = 0;
      for (const TxEntry& e : queue_) held += e.frame_bytes;
      if (held < kCorkedBytes) return false;
    }
    writer_active_ = true;
    return true;
  }
  std::byte* take_batch_buffer_locked();
  void write_loop();
  // Leaves the writers_inside_ count; the last one out after a teardown
  // finishes the channel.
  void leave_writers();
  // Releases dropped entries' payloads and fails their sends with kClosed
  // (outside mu_: completions are the caller's code).
  static void fail_dropped(std::deque<TxEntry>& dropped);
  void arm_write_wait();  // I/O thread
  void arm_flush_timer(); // I/O thread
  void on_flush_timer();
  void on_heartbeat_timer();
  void arm_read_wait();
  void on_readable();
  bool process_frames();  // false: stop reading (failed or finished)
  void handle_eof();
  void maybe_finish();    // I/O thread
  void destroy_io_objects();  // I/O thread
  // I/O thread, once per channel: the socket goes and the connection hears
  // that this channel finished (teardown, or the last writer after it).
  void finish_teardown();
  void post(std::function<void()> fn);

  TcpConnection* conn_;
  const std::uint32_t index_;
  asio::io_context& ctx_;
  std::unique_ptr<tcp::socket> socket_;
  const int fd_;
  const Options& options_;
  std::unique_ptr<asio::steady_timer> flush_timer_;
  std::unique_ptr<asio::steady_timer> heartbeat_timer_;

  // TX state, under mu_.
  std::mutex mu_;
  wire::BatchEncoder encoder_;
  std::byte* open_buffer_ = nullptr;
  std::uint64_t open_flow_bytes_ = 0;
  std::uint64_t open_messages_ = 0;
  std::deque<TxEntry> queue_;
  struct FreeDeleter {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  std::vector<std::unique_ptr<std::byte, FreeDeleter>> batch_storage_;
  std::vector<std::byte*> free_batches_;
  bool writer_active_ = false;
  // Under mu_: sends queue without writing until flush(), and the open batch
  // stays open until it is full or flushed (no flush timer), so a corked
  // burst of small messages leaves in full batches.
  bool corked_ = false;
  bool in_syscall_ = false;
  bool flush_timer_armed_ = false;
  bool goodbye_queued_ = false;
  bool shut_wr_done_ = false;
  bool tx_closed_ = false;        // torn down: nothing more is written
  // Threads inside write_loop(), from entry until the completions it ran
  // (user code) returned, and threads in send_small() from the copy until
  // the completion of that small message returned. A teardown that finds
  // one waits for the last to leave before it closes the socket and counts
  // the channel finished, so on_closed comes after every completion and
  // ~Transport waits for them.
  int writers_inside_ = 0;
  bool finish_pending_ = false;   // teardown waits for writers_inside_ == 0
  // What teardown dropped while a writer was in a system call: its iovecs
  // may point into these payloads, so they go back (and their senders hear
  // kClosed) only once it returned, from write_loop.
  std::deque<TxEntry> dropped_in_syscall_;
  std::atomic<std::int64_t> last_tx_ns_{0};

  // RX state, I/O thread only. bodies_ is declared before decoder_: the
  // decoder gives its partial body back to bodies_ when destroyed.
  ReceiveBodies bodies_;
  wire::DecoderOptions decoder_options_;
  wire::FrameDecoder decoder_;
  std::int64_t last_rx_ns_ = 0;
  bool goodbye_received_ = false;
  bool eof_ = false;
  bool rx_stopped_ = false;
  bool torn_down_ = false;
  bool finished_ = false;  // counted done with the connection
};

// ---------------------------------------------------------------------------
// Shared by the Transport, its Connections and Listeners. The registry
// counts live channels and acceptors (I/O objects not yet destroyed).
class Core : public TransportRegistry {
 public:
  explicit Core(Options opts) : options(std::move(opts)) {}

  Options options;
  std::unique_ptr<IoThreads> io;
  std::vector<Transport::Region> regions;
};

// ---------------------------------------------------------------------------
class TcpConnection final : public ConnectionCore {
 public:
  TcpConnection(std::shared_ptr<Core> core, PeerInfo peer, Handlers handlers)
      : ConnectionCore(std::move(peer), std::move(handlers), core->options.max_queued_bytes,
                       core->options.max_message_bytes),
        core_(std::move(core)) {}

  // Builds the channels over connected, handshaken sockets (fds, owned from
  // here). Contexts are spread over the I/O threads.
  Status init(std::vector<int> fds) {
    const Options& o = core_->options;
    std::size_t i = 0;
    for (int fd : fds) {
      auto encoder = wire::BatchEncoder::create({.batch_threshold_bytes = o.batch_threshold_bytes});
      if (!encoder) {
        for (std::size_t j = i; j < fds.size(); ++j) ::close(fds[j]);
        return tl::unexpected<Error>(std::move(encoder).error());
      }
      wire::DecoderOptions dopt;
      dopt.max_frame_bytes = static_cast<std::size_t>(
          std::min<std::uint64_t>(o.max_message_bytes + wire::kSinglePrefixBytes + 8,
                                  wire::kMaxFrameBytes));
      dopt.receive_buffer_bytes = kReceiveBufferBytes;
      // Frames larger than a batch (large messages) get their own Buffer.
      dopt.external_body_min_bytes = std::max<std::size_t>(o.batch_threshold_bytes + 1, wire::kMinFrameBytes);
      dopt.body_allocator = nullptr;  // the channel points it at its own ReceiveBodies
      asio::io_context& ctx = core_->io->pick();
      boost::system::error_code ec;
      auto socket = std::make_unique<tcp::socket>(ctx);
      // The fd is IPv4 or IPv6; ask the kernel.
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
      socket->assign(ss.ss_family == AF_INET6 ? tcp::v6() : tcp::v4(), fd, ec);
      if (ec) {
        for (std::size_t j = i; j < fds.size(); ++j) ::close(fds[j]);
        return make_error(ErrorCode::kIo, "cannot adopt socket: {}", ec.message());
      }
      socket->non_blocking(true, ec);
      channels_.push_back(std::make_unique<Channel>(this, static_cast<std::uint32_t>(i), ctx,
                                                    std::move(socket), o, std::move(*encoder),
                                                    dopt));
      core_->io_object_added();
      ++i;
    }
    return ok_status();
  }

  // Starts reading on every channel. Called after the user has the
  // Connection (connect() result, or on_accept returned).
  void start() {
    auto self = shared();
    for (auto& ch : channels_) {
      Channel* c = ch.get();
      // Refused only when the Transport is being destroyed meanwhile.
      (void)core_->io->post(c->context(), [self, c] { c->start(); });
    }
  }

  std::shared_ptr<TcpConnection> shared() {
    return std::static_pointer_cast<TcpConnection>(shared_from_this());
  }

  // --- Connection ---
  Status send(std::uint32_t channel, std::span<const std::byte> bytes,
              std::chrono::nanoseconds wait) override {
    EMBER_TRY(check_send(channel, bytes.size()));
    if (bytes.size() > encoder_payload_limit()) {
      // A message too big for a batch: copied once into a heap Buffer and
      // sent as a large message (callers with big payloads should pass a
      // pool Buffer instead, which avoids this copy).
      Buffer copy = Buffer::heap(bytes.size());
      std::memcpy(copy.data(), bytes.data(), bytes.size());
      return send(channel, std::move(copy), {}, wait);
    }
    return send_copy(channel, bytes, wait, nullptr);
  }

  Status send(std::uint32_t channel, Buffer&& payload, SendCompletion done,
              std::chrono::nanoseconds wait) override {
    Buffer owned = std::move(payload);  // released on every error path below
    EMBER_TRY(check_send(channel, owned.size()));
    if (owned.size() <= encoder_payload_limit()) {
      // Copied into the batch; the channel then releases the payload and
      // runs `done` before it can finish (on an error both are dropped here,
      // `done` not run).
      Finished after{std::move(owned), std::move(done)};
      const std::span<const std::byte> bytes(after.payload.data(), after.payload.size());
      return send_copy(channel, bytes, wait, &after);
    }
    uncork_if_full(owned.size());
    EMBER_TRY(flow().acquire(owned.size(), wait, !core_->io->on_io_thread()));
    return channels_[channel]->send_large(std::move(owned), std::move(done));
  }

  // A small message: copied into the channel's batch (see Channel::send_small
  // for `after`).
  Status send_copy(std::uint32_t channel, std::span<const std::byte> bytes,
                   std::chrono::nanoseconds wait, Finished* after) {
    uncork_if_full(bytes.size());
    EMBER_TRY(flow().acquire(bytes.size(), wait, !core_->io->on_io_thread()));
    return channels_[channel]->send_small(bytes, /*control=*/false, after);
  }

  // Before waiting for room under max_queued_bytes: corked channels hold
  // queued bytes unwritten, and the wait would be for bytes nobody writes
  // (one thread's burst could even wait on its own). Write them first.
  void uncork_if_full(std::uint64_t bytes) {
    if (flow().queued_bytes() + bytes <= flow().max_bytes()) return;
    for (auto& ch : channels_) (void)ch->flush();
  }

  Status flush(std::uint32_t channel) override {
    EMBER_TRY(check_channel(channel));
    if (is_closed()) return closed_error();
    return channels_[channel]->flush();
  }
  void cork(std::uint32_t channel) override {
    if (channel < channels_.size()) channels_[channel]->cork();
  }
  Status flush_all() override {
    if (is_closed()) return closed_error();
    for (auto& ch : channels_) EMBER_TRY(ch->flush());
    return ok_status();
  }

  void close(std::chrono::nanoseconds drain) override {
    if (!begin_close()) return;
    // A refused post: ~Transport is joining the I/O threads, after it closed
    // this Connection (on_closed ran with kCancelled); nothing is left to do.
    auto self = shared();
    for (auto& ch : channels_) {
      Channel* c = ch.get();
      (void)core_->io->post(c->context(), [self, c] { c->begin_goodbye(); });
    }
    // The drain bound: after it, whatever is still open is torn down.
    asio::io_context& ctx = channels_[0]->context();
    (void)core_->io->post(ctx, [self, &ctx, drain] { self->arm_drain_timer(ctx, drain); });
  }

  // --- internal, used by Channel ---
  // A channel finished (orderly or torn down). The last one reports.
  void channel_finished() {
    if (part_finished(channels_.size())) {
      cancel_drain_timer(channels_[0]->context());
      announce_closed();
    }
    // Last: ~Transport waits for this count before it joins the I/O
    // threads, so on_closed, and what it posts (to any context), comes
    // while every thread still runs.
    core_->io_object_removed();
  }
  Core& core() { return *core_; }
  std::size_t encoder_payload_limit() const {
    return core_->options.batch_threshold_bytes / 8 * 8 - wire::kMinFrameBytes;
  }

 private:
  std::size_t lane_count() const noexcept override { return channels_.size(); }
  // Every channel tears down on its I/O thread (first fail() only).
  void start_teardown() override {
    auto self = shared();
    for (auto& ch : channels_) {
      Channel* c = ch.get();
      // Never refused: the Transport's shutdown waits for this channel first.
      (void)core_->io->post(c->context(), [self, c] { c->teardown(); });
    }
  }

  std::shared_ptr<Core> core_;
  std::vector<std::unique_ptr<Channel>> channels_;
};

// ---------------------------------------------------------------------------
// Channel implementation.

void Channel::post(std::function<void()> fn) {
  auto self = conn_->shared();
  // Refused only once the channel has long finished (a flush timer armed by
  // a send that raced the teardown): dropped, with its reference.
  (void)conn_->core().io->post(ctx_, [self, fn = std::move(fn)] { fn(); });
}

void Channel::start() {
  if (torn_down_) return;
  last_rx_ns_ = now_ns();
  last_tx_ns_.store(last_rx_ns_, std::memory_order_relaxed);
  flush_timer_ = std::make_unique<asio::steady_timer>(ctx_);
  heartbeat_timer_ = std::make_unique<asio::steady_timer>(ctx_);
  bool armed = false;
  {
    std::lock_guard lock(mu_);
    armed = flush_timer_armed_;  // a send came before start()
  }
  // Outside mu_: with flush_interval = 0 arm_flush_timer() flushes at once,
  // which takes mu_ (holding it here deadlocked the I/O thread).
  if (armed) arm_flush_timer();
  on_heartbeat_timer();  // arms the periodic check (sends nothing yet)
  on_readable();
}

std::byte* Channel::take_batch_buffer_locked() {
  if (free_batches_.empty()) {
    // Grows to the number of batches in flight (bounded by max_queued_bytes /
    // batch_threshold) and is reused from then on.
    const std::size_t bytes = (options_.batch_threshold_bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes);
    EMBER_CHECK_MSG(p != nullptr, "out of memory for a {}-byte batch buffer", bytes);
    batch_storage_.emplace_back(static_cast<std::byte*>(p));
    return batch_storage_.back().get();
  }
  std::byte* b = free_batches_.back();
  free_batches_.pop_back();
  return b;
}

void Channel::close_batch_locked() {
  if (!encoder_.is_open()) return;
  if (encoder_.empty()) {
    encoder_.abandon();
    free_batches_.push_back(open_buffer_);
    open_buffer_ = nullptr;
    return;
  }
  std::span<std::byte> frame = encoder_.finish();
  TxEntry& e = queue_.emplace_back();
  e.segments[0] = Segment{frame.data(), -1, 0, frame.size()};
  e.num_segments = 1;
  e.batch_buffer = open_buffer_;
  e.flow_bytes = open_flow_bytes_;
  e.messages = open_messages_;
  e.frame_bytes = frame.size();
  open_buffer_ = nullptr;
  open_flow_bytes_ = 0;
  open_messages_ = 0;
}

void Channel::add_item_locked(std::span<const std::byte> bytes, std::uint32_t flags) {
  if (!encoder_.is_open()) {
    open_buffer_ = take_batch_buffer_locked();
    encoder_.begin(std::span<std::byte>(open_buffer_, options_.batch_threshold_bytes));
  }
  if (!encoder_.try_add(bytes, flags)) {
    close_batch_locked();
    open_buffer_ = take_batch_buffer_locked();
    encoder_.begin(std::span<std::byte>(open_buffer_, options_.batch_threshold_bytes));
    const bool added = encoder_.try_add(bytes, flags);
    EMBER_CHECK_MSG(added, "a {}-byte message does not fit an empty {}-byte batch", bytes.size(),
                    options_.batch_threshold_bytes);
  }
}

Status Channel::send_small(std::span<const std::byte> bytes, bool control, Finished* after) {
  std::unique_lock lock(mu_);
  if (tx_closed_ || goodbye_queued_) {
    lock.unlock();
    if (!control) conn_->flow().release(bytes.size());
    return make_error(ErrorCode::kClosed, "connection is closed; message on channel {} dropped",
                      index_);
  }
  // The one copy of the small-message path: into the channel's batch buffer.
  add_item_locked(bytes, control ? kItemFlagControl : 0);
  if (!control) {
    open_flow_bytes_ += bytes.size();
    ++open_messages_;
  }
  // Control items go at once; without batching every message is its own frame.
  if (control || !options_.batching) close_batch_locked();
  bool arm_timer = false;
  if (encoder_.is_open() && !flush_timer_armed_ && !corked_) {
    flush_timer_armed_ = true;
    arm_timer = true;
  }
  const bool must_write = claim_writer_locked();
  // Counted from here: a teardown from now on waits for `after` to be done.
  if (after != nullptr) ++writers_inside_;
  lock.unlock();
  if (arm_timer) {
    post([this] { arm_flush_timer(); });
  }
  if (must_write) write_loop();
  if (after != nullptr) {
    after->payload.reset();
    if (after->done) std::exchange(after->done, nullptr)(ok_status());
    leave_writers();
  }
  return ok_status();
}

Status Channel::send_large(Buffer&& payload, SendCompletion&& done) {
  const std::uint64_t size = payload.size();
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
  std::span<const std::byte> body(payload.data(), payload.size());
  auto single = wire::encode_single(
      e.prefix, body, 0,
      options_.payload_checksum ? wire::Checksum::kFrame : wire::Checksum::kPrefix);
  if (!single) {
    queue_.pop_back();
    lock.unlock();
    conn_->flow().release(size);
    payload.reset();
    return tl::unexpected<Error>(std::move(single).error());
  }
  e.segments[0] = Segment{e.prefix.data(), -1, 0, single->prefix.size()};
  // sendfile costs a second system call (the prefix goes with write): below
  // kSendfileMinBytes one gathered write is cheaper (measured by
  // ember-bench-transport: 4 KiB messages went at less than half the rate).
  // sendfile() returns once the kernel holds references to the memfd's
  // pages, not once it has read them (on loopback the receiver copies them
  // later): a Buffer released at completion and recycled at once (a server
  // reply from a pool block) would be sent with the next owner's bytes, which
  // the peer's checksum catches ("bad frame"). So only borrowed memory, which
  // its caller keeps unchanged until an application-level reply (a worker's
  // gradient until the server answers the push), goes by sendfile; an owned
  // Buffer goes with writev.
  const bool use_sendfile = options_.zero_copy == ZeroCopy::kSendfile &&
                            payload.location().has_fd() && !payload.owns_memory() &&
                            size >= kSendfileMinBytes;
  if (use_sendfile) {
    e.segments[1] = Segment{nullptr, payload.location().fd, payload.location().fd_offset, body.size()};
  } else {
    e.segments[1] = Segment{body.data(), -1, 0, body.size()};
  }
  e.num_segments = 2;
  if (!single->padding.empty()) {
    e.segments[2] = Segment{single->padding.data(), -1, 0, single->padding.size()};
    e.num_segments = 3;
  }
  e.flow_bytes = size;
  e.messages = 1;
  e.frame_bytes = single->frame_bytes;
  e.payload = std::move(payload);
  e.done = std::move(done);
  const bool must_write = claim_writer_locked();
  lock.unlock();
  if (must_write) write_loop();
  return ok_status();
}

void Channel::cork() {
  std::lock_guard lock(mu_);
  corked_ = true;
}

Status Channel::flush() {
  std::unique_lock lock(mu_);
  corked_ = false;
  if (tx_closed_) return make_error(ErrorCode::kClosed, "connection is closed");
  close_batch_locked();
  const bool must_write = claim_writer_locked();
  lock.unlock();
  if (must_write) write_loop();
  return ok_status();
}

void Channel::arm_flush_timer() {
  if (!flush_timer_ || torn_down_) return;  // start() arms it
  if (options_.flush_interval.count() == 0) {
    on_flush_timer();  // "as soon as the I/O thread gets to it": we are that moment
    return;
  }
  flush_timer_->expires_after(options_.flush_interval);
  auto self = conn_->shared();
  flush_timer_->async_wait([self, this](const boost::system::error_code& ec) {
    if (ec) return;
    on_flush_timer();
  });
}

void Channel::on_flush_timer() {
  std::unique_lock lock(mu_);
  flush_timer_armed_ = false;
  // Armed before a cork(): the batch now waits for the flush, or for being full.
  if (tx_closed_ || corked_) return;
  close_batch_locked();
  const bool must_write = claim_writer_locked();
  lock.unlock();
  if (must_write) write_loop();
}

void Channel::write_loop() {
  const bool on_io = conn_->core().io->on_io_thread();
  std::size_t written_here = 0;
  std::vector<Finished> finished;
  std::deque<TxEntry> dropped;  // by a teardown during our system call
  std::uint64_t flow_done = 0;
  std::unique_lock lock(mu_);
  ++writers_inside_;
  for (;;) {
    if (tx_closed_) {
      writer_active_ = false;
      dropped.swap(dropped_in_syscall_);
      break;
    }
    if (queue_.empty()) {
      writer_active_ = false;
      if (goodbye_queued_ && !shut_wr_done_ && !encoder_.is_open()) {
        ::shutdown(fd_, SHUT_WR);
        shut_wr_done_ = true;
        post([this] { maybe_finish(); });
      }
      break;
    }
    if (!on_io && written_here >= options_.inline_write_bytes) {
      // Leave the rest to the I/O thread (writer role handed over): after
      // Options::inline_write_bytes, so one send() call never writes for
      // long, or at once when the option is 0.
      post([this] { write_loop(); });
      break;
    }
    // Gather memory segments from the head; stop at a file segment.
    std::array<iovec, kMaxIov> iov;
    std::size_t niov = 0;
    const Segment* file_seg = nullptr;
    std::size_t file_offset_in_seg = 0;
    const std::size_t max_entries = options_.batching ? queue_.size() : 1;
    std::size_t entries = 0;
    for (auto it = queue_.begin(); it != queue_.end() && niov < kMaxIov && entries < max_entries;
         ++it, ++entries) {
      bool stop = false;
      for (std::uint8_t s = it->segment; s < it->num_segments && niov < kMaxIov; ++s) {
        const Segment& seg = it->segments[s];
        const std::size_t skip = (s == it->segment) ? it->segment_offset : 0;
        if (seg.fd >= 0) {
          if (niov == 0) {
            file_seg = &seg;
            file_offset_in_seg = skip;
          }
          stop = true;
          break;
        }
        if (seg.bytes - skip == 0) continue;
        iov[niov++] = iovec{const_cast<std::byte*>(seg.data) + skip, seg.bytes - skip};
      }
      if (stop || niov == kMaxIov) break;
    }
    ssize_t n = 0;
    int err = 0;
    in_syscall_ = true;
    lock.unlock();
    if (file_seg != nullptr) {
      off_t off = static_cast<off_t>(file_seg->file_offset + file_offset_in_seg);
      const std::size_t want =
          std::min<std::size_t>(file_seg->bytes - file_offset_in_seg, std::size_t{1} << 30);
      n = ::sendfile(fd_, file_seg->fd, &off, want);
    } else if (niov > 0) {
      msghdr msg{};
      msg.msg_iov = iov.data();
      msg.msg_iovlen = niov;
      n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    }
    if (n < 0) err = errno;
    conn_->write_syscalls.fetch_add(1, std::memory_order_relaxed);
    lock.lock();
    in_syscall_ = false;
    if (tx_closed_) continue;
    if (n < 0) {
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        // Writer role stays taken; the I/O thread continues when writable.
        post([this] { arm_write_wait(); });
        break;
      }
      writer_active_ = false;
      lock.unlock();
      conn_->fail(Error(ErrorCode::kIo,
                        fmt::format("write to {} failed on channel {}", conn_->peer().address, index_),
                        err));
      lock.lock();
      break;
    }
    last_tx_ns_.store(now_ns(), std::memory_order_relaxed);
    conn_->tx_progress.fetch_add(static_cast<std::uint64_t>(n), std::memory_order_relaxed);
    written_here += static_cast<std::size_t>(n);
    // Advance over what was written; retire finished entries.
    std::size_t left = static_cast<std::size_t>(n);
    while (!queue_.empty()) {
      TxEntry& e = queue_.front();
      while (e.segment < e.num_segments) {
        const std::size_t rest = e.segments[e.segment].bytes - e.segment_offset;
        if (left < rest) {
          e.segment_offset += left;
          left = 0;
          break;
        }
        left -= rest;
        ++e.segment;
        e.segment_offset = 0;
      }
      if (e.segment < e.num_segments) break;
      flow_done += e.flow_bytes;
      conn_->messages_sent.fetch_add(e.messages, std::memory_order_relaxed);
      conn_->bytes_sent.fetch_add(e.flow_bytes, std::memory_order_relaxed);
      conn_->frames_sent.fetch_add(1, std::memory_order_relaxed);
      if (e.batch_buffer != nullptr) free_batches_.push_back(e.batch_buffer);
      if (e.payload || e.done) finished.push_back(Finished{std::move(e.payload), std::move(e.done)});
      queue_.pop_front();
    }
  }
  lock.unlock();
  conn_->flow().release(flow_done);
  for (Finished& f : finished) {
    f.payload.reset();
    if (f.done) f.done(ok_status());
  }
  fail_dropped(dropped);
  leave_writers();
}

void Channel::leave_writers() {
  std::unique_lock lock(mu_);
  const bool finish = --writers_inside_ == 0 && finish_pending_;
  if (finish) finish_pending_ = false;
  lock.unlock();
  // The teardown that waited for us: the channel finishes on its I/O thread
  // (the registry still counts it, so that thread is still running).
  if (finish) post([this] { finish_teardown(); });
}

void Channel::fail_dropped(std::deque<TxEntry>& dropped) {
  Error reason(ErrorCode::kClosed, "connection closed before the message was sent");
  for (TxEntry& e : dropped) {
    e.payload.reset();
    if (e.done) std::exchange(e.done, nullptr)(tl::unexpected<Error>(reason));
  }
  dropped.clear();
}

void Channel::arm_write_wait() {
  if (torn_down_ || !socket_) return;
  auto self = conn_->shared();
  socket_->async_wait(tcp::socket::wait_write, [self, this](const boost::system::error_code& ec) {
    if (ec) return;  // cancelled by teardown
    write_loop();
  });
}

void Channel::begin_goodbye() {
  if (torn_down_) return;
  const auto payload = control_payload(ControlType::kGoodbye);
  std::unique_lock lock(mu_);
  if (tx_closed_ || goodbye_queued_) return;
  add_item_locked(payload, kItemFlagControl);
  close_batch_locked();
  goodbye_queued_ = true;  // the writer shuts down the write side once the queue is empty
  const bool must_write = claim_writer_locked();
  lock.unlock();
  if (must_write) write_loop();
}

void Channel::on_heartbeat_timer() {
  if (torn_down_ || !heartbeat_timer_) return;
  const std::int64_t now = now_ns();
  if (now - last_rx_ns_ > options_.heartbeat_timeout.count()) {
    conn_->fail(heartbeat_timeout_error(
        fmt::format("{} on channel {}", conn_->describe_peer(), index_), nanoseconds(now - last_rx_ns_)));
    return;
  }
  if (now - last_tx_ns_.load(std::memory_order_relaxed) >= options_.heartbeat_interval.count()) {
    bool send_it;
    {
      std::lock_guard lock(mu_);
      send_it = !tx_closed_ && !goodbye_queued_ && !writer_active_;
    }
    if (send_it) {
      const auto payload = control_payload(ControlType::kHeartbeat);
      if (send_small(payload, /*control=*/true)) {
        conn_->heartbeats_sent.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  // Check at least 4 times per timeout so a dead peer is found within 1.25x.
  const nanoseconds period = std::min(options_.heartbeat_interval, options_.heartbeat_timeout / 4);
  heartbeat_timer_->expires_after(period);
  auto self = conn_->shared();
  heartbeat_timer_->async_wait([self, this](const boost::system::error_code& ec) {
    if (ec) return;
    on_heartbeat_timer();
  });
}

void Channel::arm_read_wait() {
  if (torn_down_ || !socket_) return;
  auto self = conn_->shared();
  socket_->async_wait(tcp::socket::wait_read, [self, this](const boost::system::error_code& ec) {
    if (ec) return;
    on_readable();
  });
}

void Channel::on_readable() {
  if (torn_down_ || rx_stopped_) return;
  for (int i = 0; i < kReadsPerEvent; ++i) {
    std::span<std::byte> space = decoder_.prepare();
    if (space.empty()) {
      conn_->fail(decoder_.error());
      return;
    }
    const ssize_t n = ::recv(fd_, space.data(), space.size(), 0);
    conn_->read_syscalls.fetch_add(1, std::memory_order_relaxed);
    if (n > 0) {
      last_rx_ns_ = now_ns();
      if (Status s = decoder_.commit(static_cast<std::size_t>(n)); !s) {
        Error e = s.error();
        e.with_context(fmt::format("bad frame from {} on channel {}", conn_->peer().address, index_));
        conn_->fail(std::move(e));
        return;
      }
      if (!process_frames()) return;
      continue;
    }
    const int err = errno;
    (void)decoder_.commit(0);  // close the prepare() before anything else touches the decoder
    if (n == 0) {
      handle_eof();
      return;
    }
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      arm_read_wait();
      return;
    }
    conn_->fail(Error(err == ECONNRESET ? ErrorCode::kIo : ErrorCode::kIo,
                      fmt::format("read from {} failed on channel {} (connection reset or lost)",
                                  conn_->peer().address, index_),
                      err));
    return;
  }
  // Yield to other handlers on this thread, then read on.
  post([this] { on_readable(); });
}

bool Channel::process_frames() {
  for (;;) {
    auto next = decoder_.next();
    if (!next) {
      Error e = std::move(next).error();
      e.with_context(fmt::format("bad frame from {} on channel {}", conn_->peer().address, index_));
      conn_->fail(std::move(e));
      return false;
    }
    if (!next->has_value()) return true;
    const wire::Frame& frame = **next;
    conn_->frames_received.fetch_add(1, std::memory_order_relaxed);
    Buffer body;
    if (!frame.external_body().empty()) body = bodies_.take(frame.external_body());
    const bool single = frame.info().kind == wire::FrameKind::kSingle;
    auto left = static_cast<std::uint32_t>(frame.size());
    for (const wire::Item item : frame) {
      --left;
      if (conn_->failing()) return false;
      if (item.flags == kItemFlagControl) {
        auto type = parse_control(item.payload);
        if (!type) {
          conn_->fail(Error(ErrorCode::kProtocol,
                            fmt::format("malformed control item from {} on channel {}",
                                        conn_->peer().address, index_)));
          return false;
        }
        if (*type == ControlType::kHeartbeat) {
          conn_->heartbeats_received.fetch_add(1, std::memory_order_relaxed);
        } else {
          goodbye_received_ = true;
          conn_->peer_goodbye();
        }
        continue;
      }
      if (item.flags != 0) {
        conn_->fail(Error(ErrorCode::kProtocol,
                          fmt::format("item with unknown flags {:#x} from {} on channel {}",
                                      item.flags, conn_->peer().address, index_)));
        return false;
      }
      if (goodbye_received_) {
        conn_->fail(Error(ErrorCode::kProtocol,
                          fmt::format("message after goodbye from {} on channel {}",
                                      conn_->peer().address, index_)));
        return false;
      }
      Incoming msg;
      msg.channel = index_;
      msg.more_in_batch = left;
      if (single && body) {
        body.truncate(item.payload.size());
        msg.owned = std::move(body);
        msg.bytes = std::span<const std::byte>(msg.owned.data(), msg.owned.size());
      } else {
        msg.bytes = item.payload;
      }
      conn_->deliver(std::move(msg));
    }
  }
}

void Channel::handle_eof() {
  if (Status s = decoder_.end_of_stream(); !s) {
    Error e = s.error();
    e.with_context(fmt::format("{} closed channel {} mid-frame", conn_->peer().address, index_));
    conn_->fail(std::move(e));
    return;
  }
  if (!goodbye_received_) {
    conn_->fail(Error(ErrorCode::kIo,
                      fmt::format("{} {} at {} closed channel {} without goodbye (crashed or reset)",
                                  role_name(conn_->peer().role), conn_->peer().rank,
                                  conn_->peer().address, index_)));
    return;
  }
  eof_ = true;
  rx_stopped_ = true;
  maybe_finish();
}

void Channel::maybe_finish() {
  if (torn_down_ || finished_) return;
  bool done;
  {
    std::lock_guard lock(mu_);
    done = shut_wr_done_ && eof_;
  }
  if (done) teardown();
}

void Channel::teardown() {
  if (torn_down_) return;
  torn_down_ = true;
  rx_stopped_ = true;
  std::deque<TxEntry> dropped;
  std::uint64_t flow_dropped = 0;
  bool writers;
  {
    std::lock_guard lock(mu_);
    tx_closed_ = true;
    if (encoder_.is_open()) {
      encoder_.abandon();
      flow_dropped += open_flow_bytes_;
      open_flow_bytes_ = 0;
    }
    dropped.swap(queue_);
    for (TxEntry& e : dropped) flow_dropped += e.flow_bytes;
    // A writer in sendmsg/sendfile may be reading the head entries' memory:
    // they go back when its call returns (write_loop), not now.
    if (in_syscall_) dropped_in_syscall_.swap(dropped);
    // A writer (in its system call, or running the completions of what it
    // wrote or copied) finishes the channel when it leaves (leave_writers).
    writers = writers_inside_ > 0;
    finish_pending_ = writers;
  }
  conn_->flow().release(flow_dropped);
  if (flush_timer_) flush_timer_.reset();
  if (heartbeat_timer_) heartbeat_timer_.reset();
  // Release large payloads and tell their senders.
  fail_dropped(dropped);
  // Give back a partly received body now (not when the Connection object dies).
  decoder_ = make_decoder(decoder_options_);
  if (!writers) finish_teardown();
}

void Channel::finish_teardown() {
  destroy_io_objects();
  if (!finished_) {
    finished_ = true;
    conn_->channel_finished();
  }
}

void Channel::destroy_io_objects() {
  if (socket_) {
    boost::system::error_code ec;
    socket_->close(ec);
    socket_.reset();
  }
}

// ---------------------------------------------------------------------------
// Listener: accepts, handshakes, groups channel streams into Connections.

class ListenerCore : public std::enable_shared_from_this<ListenerCore> {
 public:
  ListenerCore(std::shared_ptr<Core> core, asio::io_context& ctx, LocalIdentity self,
               AcceptHandler on_accept, Handlers handlers)
      : core_(std::move(core)),
        ctx_(ctx),
        self_(self),
        on_accept_(std::move(on_accept)),
        handlers_(std::move(handlers)) {}

  Status open(const tcp::endpoint& endpoint) {
    acceptor_ = std::make_unique<tcp::acceptor>(ctx_);
    boost::system::error_code ec;
    acceptor_->open(endpoint.protocol(), ec);
    if (!ec) acceptor_->set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_->bind(endpoint, ec);
    if (!ec) acceptor_->listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      acceptor_.reset();
      return make_sys_error(ec.value(), "cannot listen on {}", endpoint_to_string(endpoint));
    }
    address_ = endpoint_to_string(acceptor_->local_endpoint());
    accept_pacer_.emplace(tcp_log(), "listener " + address_);
    refusal_log_.emplace(tcp_log(), "listener " + address_);
    core_->io_object_added();
    return ok_status();
  }

  void start() {
    auto self = shared_from_this();
    (void)core_->io->post(ctx_, [self] { self->accept_next(); });
  }

  // Any thread: stop accepting; pending handshakes are dropped. Refused when
  // the Transport is gone (or going): its shutdown closed us already.
  void close() {
    auto self = shared_from_this();
    (void)core_->io->post(ctx_, [self] { self->close_on_io(); });
  }

  const std::string& address() const { return address_; }
  std::uint64_t num_refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  struct Pending {
    std::unique_ptr<tcp::socket> socket;
    std::vector<std::byte> buf;
    std::unique_ptr<asio::steady_timer> timer;
    bool done = false;
  };
  struct Session {
    handshake::Hello hello;
    std::vector<int> fds;  // by channel index, -1 until it arrives
    std::size_t arrived = 0;
    Clock::time_point deadline;
    std::string address;
  };

  void close_on_io() {
    if (closed_) return;
    closed_ = true;
    boost::system::error_code ec;
    if (acceptor_) {
      acceptor_->close(ec);
      acceptor_.reset();
      core_->io_object_removed();
    }
    if (accept_pacer_) accept_pacer_->cancel();
    if (refusal_log_) refusal_log_->cancel();
    for (auto& p : pending_) {
      if (p->timer) p->timer->cancel();
      p->timer.reset();
      if (p->socket) p->socket->close(ec);
      p->socket.reset();
    }
    pending_.clear();
    for (auto& [id, s] : sessions_) {
      for (int fd : s.fds) {
        if (fd >= 0) ::close(fd);
      }
    }
    sessions_.clear();
  }

  void accept_next() {
    if (closed_ || !acceptor_) return;
    auto self = shared_from_this();
    acceptor_->async_accept([self](const boost::system::error_code& ec, tcp::socket socket) {
      if (self->closed_ || ec == asio::error::operation_aborted) return;
      if (ec) {
        self->accept_pacer_->failed(self->ctx_, ec.message(), [self] { self->accept_next(); });
        return;
      }
      self->accept_pacer_->succeeded();
      self->begin_handshake(std::move(socket));
      self->accept_next();
    });
  }

  void begin_handshake(tcp::socket socket) {
    boost::system::error_code ec;
    socket.non_blocking(true, ec);
    (void)set_socket_options(socket.native_handle());
    if (pending_.size() >= kMaxPendingHandshakes) {
      refuse(pending_.front(), handshake_dropped_for_room(), false);
    }
    auto p = std::make_shared<Pending>();
    p->socket = std::make_unique<tcp::socket>(std::move(socket));
    p->timer = std::make_unique<asio::steady_timer>(ctx_);
    p->timer->expires_after(core_->options.connect_timeout);
    pending_.push_back(p);
    auto self = shared_from_this();
    p->timer->async_wait([self, p](const boost::system::error_code& e) {
      if (e || p->done) return;
      self->refuse(p, Error(ErrorCode::kTimeout, "no complete hello within connect_timeout"), false);
    });
    read_hello(p);
  }

  void read_hello(const std::shared_ptr<Pending>& p) {
    auto self = shared_from_this();
    p->socket->async_wait(tcp::socket::wait_read, [self, p](const boost::system::error_code& ec) {
      if (ec || p->done || self->closed_) return;
      self->on_hello_readable(p);
    });
  }

  void on_hello_readable(const std::shared_ptr<Pending>& p) {
    for (;;) {
      auto missing = handshake::hello_bytes_missing(p->buf);
      if (!missing) {
        refuse(p, std::move(missing).error(), true);
        return;
      }
      if (*missing == 0) break;
      const std::size_t old = p->buf.size();
      p->buf.resize(old + *missing);
      const ssize_t n = ::recv(p->socket->native_handle(), p->buf.data() + old, *missing, 0);
      if (n > 0) {
        p->buf.resize(old + static_cast<std::size_t>(n));
        continue;
      }
      p->buf.resize(old);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        read_hello(p);
        return;
      }
      if (p->buf.empty() && n == 0) {
        // Connected and closed without a byte: a port probe or health check
        // (an Ember shm worker probes tcp at its server's address when it
        // finds no shm listener there). Not worth a warning.
        refuse(p,
               Error(ErrorCode::kClosed,
                     "connected and closed without sending a hello (a port probe or health "
                     "check, such as an shm worker looking for its server over tcp); harmless"),
               false, spdlog::level::info);
        return;
      }
      refuse(p, Error(ErrorCode::kClosed, "peer closed the connection during the handshake"),
             false);
      return;
    }
    auto hello = handshake::decode_hello(p->buf);
    if (!hello) {
      refuse(p, std::move(hello).error(), true);
      return;
    }
    handshake::Expectations expect;
    expect.kind = Kind::kTcp;
    expect.num_channels = core_->options.num_channels;
    expect.auth_token = core_->options.auth_token;
    expect.self_role = self_.role;
    if (Status s = handshake::check_hello(*hello, expect); !s) {
      refuse(p, s.error(), true);
      return;
    }
    accept_stream(p, std::move(*hello));
  }

  // Sends a refusal Reply (when `reply`), logs once (at `level`), closes the
  // stream.
  void refuse(const std::shared_ptr<Pending>& p, const Error& why, bool reply,
              spdlog::level::level_enum level = spdlog::level::warn) {
    if (p->done) return;
    p->done = true;
    refused_.fetch_add(1, std::memory_order_relaxed);
    boost::system::error_code ec;
    std::string peer = "unknown peer";
    if (p->socket) {
      auto ep = p->socket->remote_endpoint(ec);
      if (!ec) peer = endpoint_to_string(ep);
    }
    if (refusal_log_) refusal_log_->log(ctx_, level, fmt::format("refused {}: {}", peer, why.to_string()));
    if (reply && p->socket) {
      handshake::Reply r;
      r.status = why.code();
      r.role = self_.role;
      r.rank = self_.rank;
      r.num_channels = core_->options.num_channels;
      r.text = why.message();
      auto bytes = handshake::encode(r);
      // A fresh socket's send buffer takes a ~100-byte reply whole.
      (void)::send(p->socket->native_handle(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
      ::shutdown(p->socket->native_handle(), SHUT_WR);
    }
    drop(p);
  }

  void drop(const std::shared_ptr<Pending>& p) {
    boost::system::error_code ec;
    if (p->timer) p->timer->cancel();
    p->timer.reset();
    if (p->socket) p->socket->close(ec);
    p->socket.reset();
    const std::shared_ptr<Pending> keep = p;  // p may alias an element of pending_
    std::erase(pending_, keep);
  }

  void accept_stream(const std::shared_ptr<Pending>& p, handshake::Hello hello) {
    p->done = true;
    boost::system::error_code ec;
    auto ep = p->socket->remote_endpoint(ec);
    const std::string peer_address = ec ? std::string("?") : endpoint_to_string(ep);
    Session& s = sessions_[hello.session_id];
    if (s.fds.empty()) {
      s.fds.assign(hello.num_channels, -1);
      s.hello = hello;
      s.deadline = Clock::now() + core_->options.connect_timeout;
      s.address = peer_address;
    }
    if (s.fds[hello.channel] != -1 || s.hello.rank != hello.rank || s.hello.role != hello.role) {
      p->done = false;
      refuse(p,
             Error(ErrorCode::kProtocol,
                   fmt::format("channel {} of session {:#x} arrived twice or with another identity",
                               hello.channel, hello.session_id)),
             true);
      return;
    }
    handshake::Reply r;
    r.status = ErrorCode::kOk;
    r.role = self_.role;
    r.rank = self_.rank;
    r.num_channels = core_->options.num_channels;
    auto bytes = handshake::encode(r);
    const ssize_t n = ::send(p->socket->native_handle(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n != static_cast<ssize_t>(bytes.size())) {
      drop(p);
      return;
    }
    if (p->timer) p->timer->cancel();
    p->timer.reset();
    const int fd = p->socket->release(ec);
    p->socket.reset();
    const std::shared_ptr<Pending> keep = p;
    std::erase(pending_, keep);
    if (ec || fd < 0) return;
    s.fds[hello.channel] = fd;
    ++s.arrived;
    expire_sessions();
    if (s.arrived < s.fds.size()) return;
    // Every channel is here: make the Connection.
    Session done = std::move(s);
    sessions_.erase(hello.session_id);
    PeerInfo info;
    info.role = done.hello.role;
    info.rank = done.hello.rank;
    info.num_channels = done.hello.num_channels;
    info.address = done.address;
    auto conn = std::make_shared<TcpConnection>(core_, info, handlers_);
    if (Status st = conn->init(done.fds); !st) {
      conn->suppress_on_closed();
      conn->fail(st.error());
      tcp_log()->error("listener {}: cannot set up the connection of {}: {}", address_, info.address,
                       st.error().to_string());
      return;
    }
    core_->add_connection(conn);
    tcp_log()->info("listener {}: {} {} connected from {} with {} channel(s)", address_,
                    role_name(info.role), info.rank, info.address, info.num_channels);
    if (on_accept_) on_accept_(conn);
    conn->start();
  }

  // Sessions whose other channels never came are dropped.
  void expire_sessions() {
    const auto now = Clock::now();
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      if (it->second.deadline < now) {
        for (int fd : it->second.fds) {
          if (fd >= 0) ::close(fd);
        }
        tcp_log()->warn("listener {}: dropped an incomplete connection from {} ({} of {} channels)",
                        address_, it->second.address, it->second.arrived, it->second.fds.size());
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::shared_ptr<Core> core_;
  asio::io_context& ctx_;
  LocalIdentity self_;
  AcceptHandler on_accept_;
  Handlers handlers_;
  std::unique_ptr<tcp::acceptor> acceptor_;
  std::string address_;
  std::vector<std::shared_ptr<Pending>> pending_;
  std::map<std::uint64_t, Session> sessions_;
  std::atomic<std::uint64_t> refused_{0};
  bool closed_ = false;
  std::optional<AcceptPacer> accept_pacer_;  // set by open(); then I/O thread only
  std::optional<RefusalLog> refusal_log_;    // likewise
};

// ---------------------------------------------------------------------------
class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(std::shared_ptr<Core> core) : core_(std::move(core)) {}

  ~TcpTransport() override {
    EMBER_CHECK_MSG(!core_->io->on_io_thread(), "a Transport must not be destroyed on its I/O thread");
    core_->shut_down();
    core_->io->join_when_idle();
  }

  Kind kind() const noexcept override { return Kind::kTcp; }
  const Options& options() const noexcept override { return core_->options; }

  Result<std::uint32_t> register_memory(const Region& region) override {
    if (region.base == nullptr || region.length_bytes == 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "register_memory: region needs a base address and a non-zero length");
    }
    core_->regions.push_back(region);
    return static_cast<std::uint32_t>(core_->regions.size() - 1);
  }

  Result<std::unique_ptr<Listener>> listen(const std::string& address, LocalIdentity self,
                                           AcceptHandler on_accept, Handlers handlers) override {
    EMBER_TRY(require_handlers(handlers, "listen"));
    EMBER_ASSIGN_OR_RETURN(tcp::endpoint endpoint, resolve_endpoint(address));
    if (!endpoint.address().is_loopback() && core_->options.auth_token.empty()) {
      return make_error(ErrorCode::kConfig,
                        "listening on {} (not a loopback address) needs an auth token: set "
                        "[communication] auth_token to a shared secret on the server and the workers",
                        address);
    }
    auto lc = std::make_shared<ListenerCore>(core_, core_->io->context(0), self, std::move(on_accept),
                                             std::move(handlers));
    EMBER_TRY(lc->open(endpoint));
    core_->add_listener_closer([lc] { lc->close(); });
    lc->start();
    return std::unique_ptr<Listener>(new ListenerHandle<ListenerCore>(lc));
  }

  // Races ~TcpTransport safely once begin_connect() ran: from there on only
  // `core` is used (never this object, which ~TcpTransport may free as soon
  // as `in_progress` ends), and ~TcpTransport cancels the handshake's waits
  // and waits for the scope to end before it joins the I/O threads.
  Result<std::shared_ptr<Connection>> connect(const std::string& address, LocalIdentity self,
                                              Handlers handlers) override {
    const std::shared_ptr<Core> core = core_;
    EMBER_ASSIGN_OR_RETURN(auto in_progress, core->begin_connect());
    EMBER_TRY(require_handlers(handlers, "connect"));
    if (core->io->on_io_thread()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "connect() blocks and must not be called on an I/O thread");
    }
    EMBER_ASSIGN_OR_RETURN(tcp::endpoint endpoint, resolve_endpoint(address));
    const Options& o = core->options;
    const int cancel_fd = in_progress.cancel_fd();
    const auto deadline = Clock::now() + o.connect_timeout;
    std::random_device rd;
    const std::uint64_t session = (std::uint64_t{rd()} << 32) ^ rd() ^
                                  static_cast<std::uint64_t>(now_ns());
    std::vector<int> fds;
    auto close_all = [&] {
      for (int fd : fds) ::close(fd);
      fds.clear();
    };
    handshake::Reply last_reply;
    for (std::uint32_t c = 0; c < o.num_channels; ++c) {
      auto fd = connect_one(endpoint, deadline, cancel_fd);
      if (!fd) {
        close_all();
        Error e = std::move(fd).error();
        e.with_context(fmt::format("while connecting channel {} to {}", c, address));
        return tl::unexpected<Error>(std::move(e));
      }
      fds.push_back(*fd);
      handshake::Hello hello;
      hello.role = self.role;
      hello.kind = Kind::kTcp;
      hello.rank = self.rank;
      hello.num_channels = o.num_channels;
      hello.channel = c;
      hello.session_id = session;
      hello.max_message_bytes = o.max_message_bytes;
      hello.token = o.auth_token;
      auto reply = exchange_hello(*fd, hello, deadline, address, cancel_fd);
      if (!reply) {
        close_all();
        return tl::unexpected<Error>(std::move(reply).error());
      }
      last_reply = *reply;
    }
    PeerInfo info;
    info.role = last_reply.role;
    info.rank = last_reply.rank;
    info.num_channels = o.num_channels;
    info.address = endpoint_to_string(endpoint);
    auto conn = std::make_shared<TcpConnection>(core, info, std::move(handlers));
    if (Status st = conn->init(std::move(fds)); !st) {
      conn->suppress_on_closed();
      conn->fail(st.error());  // tears down the channels made so far
      return tl::unexpected<Error>(st.error());
    }
    // Failed at once (kCancelled) when ~TcpTransport began meanwhile.
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
  static Result<int> connect_one(const tcp::endpoint& endpoint, stream_io::Deadline deadline,
                                 int cancel_fd) {
    const int fd = ::socket(endpoint.address().is_v6() ? AF_INET6 : AF_INET,
                            SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return make_sys_error(errno, "socket()");
    if (auto s = set_socket_options(fd); !s) {
      ::close(fd);
      return tl::unexpected<Error>(s.error());
    }
    const auto* sa = static_cast<const sockaddr*>(endpoint.data());
    if (::connect(fd, sa, static_cast<socklen_t>(endpoint.size())) != 0 && errno != EINPROGRESS) {
      const int err = errno;
      ::close(fd);
      return make_sys_error(err, "connect to {}", endpoint_to_string(endpoint));
    }
    if (auto s = stream_io::wait_ready(fd, POLLOUT, deadline, "connect", cancel_fd); !s) {
      ::close(fd);
      return tl::unexpected<Error>(s.error());
    }
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      ::close(fd);
      return make_sys_error(err, "connect to {}", endpoint_to_string(endpoint));
    }
    return fd;
  }

  static Result<handshake::Reply> exchange_hello(int fd, const handshake::Hello& hello,
                                                 stream_io::Deadline deadline,
                                                 const std::string& address, int cancel_fd) {
    auto bytes = handshake::encode(hello);
    EMBER_TRY(stream_io::write_all(fd, bytes, deadline, "handshake", cancel_fd));
    auto raw = stream_io::read_message(
        fd, [](std::span<const std::byte> p) { return handshake::reply_bytes_missing(p); }, deadline,
        "handshake reply", cancel_fd);
    if (!raw) {
      Error e = std::move(raw).error();
      e.with_context(fmt::format("handshake with {}", address));
      return tl::unexpected<Error>(std::move(e));
    }
    EMBER_ASSIGN_OR_RETURN(handshake::Reply reply, handshake::decode_reply(*raw));
    if (reply.status != ErrorCode::kOk) {
      return tl::unexpected<Error>(Error(
          reply.status, fmt::format("{} refused the connection: {}", address, reply.text)));
    }
    if (reply.version != kProtocolVersion) {
      return make_error(ErrorCode::kVersionMismatch,
                        "protocol version mismatch: this side speaks version {}, {} speaks version "
                        "{}; run the same Ember release on both sides",
                        kProtocolVersion, address, reply.version);
    }
    if (reply.num_channels != hello.num_channels) {
      return make_error(ErrorCode::kProtocol, "{} accepted {} channels, we asked for {}", address,
                        reply.num_channels, hello.num_channels);
    }
    return reply;
  }

  std::shared_ptr<Core> core_;
};

}  // namespace

Result<std::unique_ptr<Transport>> create_tcp_transport(Options options) {
  EMBER_CHECK(options.kind == Kind::kTcp);
  EMBER_TRY(options.validate());
  ignore_sigpipe_once();
  auto core = std::make_shared<Core>(std::move(options));
  EMBER_ASSIGN_OR_RETURN(core->io,
                         IoThreads::start(core->options.num_io_threads, core->options.cpu_affinity,
                                                  core->options.busy_poll));
  return std::unique_ptr<Transport>(new TcpTransport(std::move(core)));
}

}  // namespace ember::transport::tcp
