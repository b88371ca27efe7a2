// shm transport implementation. See shm_transport.h for the design and
// lane.h for the shared-memory layout and its memory ordering.
//
// Objects: ShmTransport ──▶ Core (options, I/O threads, regions, live
// connections). ShmConnection owns its Channels and the control link (the
// Unix socket, served on channel 0's I/O thread). Handlers capture a
// shared_ptr<ShmConnection>. I/O objects (descriptors, timers) are destroyed
// on their I/O thread by teardown, before the Core joins its threads.
//
// Locking: per channel, mu_ guards the TX side (open batch, head, tokens,
// the lane mappings against unmapping); RX state is touched only by the
// channel's I/O thread. The ReleaseSink has its own mutex because Incoming
// Buffers are destroyed on any thread.
#include "common/transport/shm/shm_transport.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include "common/base/check.h"
#include "common/base/logging.h"
#include "common/base/units.h"
#include "common/memory/mapped_region.h"
#include "common/memory/stream_copy.h"
#include "common/transport/accept_pacer.h"
#include "common/transport/refusal_log.h"
#include "common/transport/connection_core.h"
#include "common/transport/flow_control.h"
#include "common/transport/handshake.h"
#include "common/transport/io_threads.h"
#include "common/transport/shm/lane.h"
#include "common/transport/shm/uds.h"
#include "common/wire/batch_encoder.h"
#include "common/wire/frame_decoder.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ember::transport::shm {
namespace {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;
using std::chrono::nanoseconds;
using Descriptor = asio::posix::stream_descriptor;

constexpr std::uint32_t kSetupMagic = 0x53424D45u;    // "EMBS"
constexpr std::uint32_t kControlMagic = 0x43424D45u;  // "EMBC"
constexpr std::size_t kSetupFixedBytes = 32;
constexpr std::size_t kSetupRegionBytes = 16;
constexpr int kSlotsPerRound = 64;         // slots consumed before yielding the thread
constexpr int kSpinPolls = 200;            // polls before sleeping on the doorbell
constexpr std::uint8_t kControlHeartbeat = 1;
constexpr std::uint8_t kControlGoodbye = 2;
// How often a quarantine (below) looks for returned tokens and exited peers
// (at most; heartbeat_interval when that is shorter).
constexpr nanoseconds kQuarantinePoll = std::chrono::milliseconds(20);
// How often a closing connection looks whether the peer's write into our
// memory, in progress when we revoked it, has finished.
constexpr nanoseconds kRevokePoll = std::chrono::milliseconds(1);

std::shared_ptr<spdlog::logger> shm_log() {
  static std::shared_ptr<spdlog::logger> l = log::logger("shm");
  return l;
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<nanoseconds>(Clock::now().time_since_epoch()).count();
}

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// `syscalls` counts doorbell writes (the shm data path's only system calls).
void ring_doorbell(int fd, std::atomic<std::uint64_t>* syscalls) {
  const std::uint64_t one = 1;
  syscalls->fetch_add(1, std::memory_order_relaxed);
  // EAGAIN only when the counter is near overflow: the peer is awake anyway.
  [[maybe_unused]] ssize_t n = ::write(fd, &one, sizeof one);
}

// Wakes the consumer of `lane` if it sleeps (Dekker with its re-check).
void notify_consumer(LaneControl& ctrl, int doorbell_fd, std::atomic<std::uint64_t>* syscalls) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (ctrl.consumer_sleeping.value.load(std::memory_order_relaxed) != 0 &&
      ctrl.consumer_sleeping.value.exchange(0) != 0) {
    ring_doorbell(doorbell_fd, syscalls);
  }
}
void notify_producer(LaneControl& ctrl, int doorbell_fd, std::atomic<std::uint64_t>* syscalls) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (ctrl.producer_waiting.value.load(std::memory_order_relaxed) != 0 &&
      ctrl.producer_waiting.value.exchange(0) != 0) {
    ring_doorbell(doorbell_fd, syscalls);
  }
}

LaneGeometry geometry_for(const Options& o) {
  LaneGeometry g;
  const std::uint64_t slot = (o.batch_threshold_bytes / 8 * 8) + kSlotHeaderBytes;
  g.slot_bytes = static_cast<std::uint32_t>((slot + 63) / 64 * 64);
  g.num_slots = o.ring_slots;
  g.credits = o.ring_slots;
  return g;
}

// ---------------------------------------------------------------------------
// Setup message (after the handshake), little-endian:
//   0 u32 magic "EMBS"   4 u32 num_channels   8 u32 slot_bytes   12 u32 num_slots
//  16 u32 credits       20 u32 num_regions   24 u64 reserved (0)
//  32 num_regions x { u32 region_id, u32 reserved, u64 length_bytes }
// Descriptors: num_channels lane memfds, num_channels doorbell eventfds,
// num_regions region memfds, in that order.
struct SetupInfo {
  std::uint32_t num_channels = 0;
  LaneGeometry geometry;
  struct RegionInfo {
    std::uint32_t id = 0;
    std::uint64_t length_bytes = 0;
  };
  std::vector<RegionInfo> regions;
};

std::vector<std::byte> encode_setup(const SetupInfo& s) {
  std::vector<std::byte> out(kSetupFixedBytes + kSetupRegionBytes * s.regions.size());
  auto put32 = [&](std::size_t off, std::uint32_t v) { std::memcpy(out.data() + off, &v, 4); };
  auto put64 = [&](std::size_t off, std::uint64_t v) { std::memcpy(out.data() + off, &v, 8); };
  put32(0, kSetupMagic);
  put32(4, s.num_channels);
  put32(8, s.geometry.slot_bytes);
  put32(12, s.geometry.num_slots);
  put32(16, s.geometry.credits);
  put32(20, static_cast<std::uint32_t>(s.regions.size()));
  put64(24, 0);
  for (std::size_t i = 0; i < s.regions.size(); ++i) {
    put32(kSetupFixedBytes + kSetupRegionBytes * i, s.regions[i].id);
    put32(kSetupFixedBytes + kSetupRegionBytes * i + 4, 0);
    put64(kSetupFixedBytes + kSetupRegionBytes * i + 8, s.regions[i].length_bytes);
  }
  return out;
}

Result<SetupInfo> decode_setup(std::span<const std::byte> in, std::size_t num_fds,
                               std::uint32_t expect_channels) {
  auto get32 = [&](std::size_t off) {
    std::uint32_t v;
    std::memcpy(&v, in.data() + off, 4);
    return v;
  };
  auto get64 = [&](std::size_t off) {
    std::uint64_t v;
    std::memcpy(&v, in.data() + off, 8);
    return v;
  };
  if (in.size() < kSetupFixedBytes || get32(0) != kSetupMagic) {
    return make_error(ErrorCode::kProtocol, "shm setup: not a setup message ({} bytes)", in.size());
  }
  SetupInfo s;
  s.num_channels = get32(4);
  s.geometry.slot_bytes = get32(8);
  s.geometry.num_slots = get32(12);
  s.geometry.credits = get32(16);
  const std::uint32_t num_regions = get32(20);
  auto pow2 = [](std::uint32_t v) { return v != 0 && (v & (v - 1)) == 0; };
  if (s.num_channels != expect_channels) {
    return make_error(ErrorCode::kProtocol, "shm setup: {} channels, expected {}", s.num_channels,
                      expect_channels);
  }
  if (s.geometry.slot_bytes < kSlotHeaderBytes + wire::kMinFrameBytes ||
      s.geometry.slot_bytes > (std::uint32_t{64} << 20) || s.geometry.slot_bytes % 64 != 0 ||
      !pow2(s.geometry.num_slots) || s.geometry.num_slots > (1u << 24) ||
      !pow2(s.geometry.credits) || s.geometry.credits > (1u << 24)) {
    return make_error(ErrorCode::kProtocol, "shm setup: bad lane geometry {} slots x {} B, {} credits",
                      s.geometry.num_slots, s.geometry.slot_bytes, s.geometry.credits);
  }
  if (in.size() != kSetupFixedBytes + kSetupRegionBytes * std::size_t{num_regions} ||
      num_fds != 2 * std::size_t{s.num_channels} + num_regions) {
    return make_error(ErrorCode::kProtocol,
                      "shm setup: {} bytes and {} descriptors do not match {} channels and {} regions",
                      in.size(), num_fds, s.num_channels, num_regions);
  }
  for (std::uint32_t i = 0; i < num_regions; ++i) {
    s.regions.push_back({get32(kSetupFixedBytes + kSetupRegionBytes * i),
                         get64(kSetupFixedBytes + kSetupRegionBytes * i + 8)});
  }
  return s;
}

std::array<std::byte, 8> control_record(std::uint8_t type) {
  std::array<std::byte, 8> r{};
  std::memcpy(r.data(), &kControlMagic, 4);
  r[4] = static_cast<std::byte>(type);
  return r;
}

// Our side of a channel before the connection exists: the lane we produce
// into and the doorbell we sleep on.
struct LocalChannelResources {
  Lane tx;
  int tx_fd = -1;        // sent to the peer, then closed
  int doorbell_fd = -1;  // we wait on it
};

struct PeerResources {
  std::vector<Lane> rx;               // the peer's lanes, mapped
  std::vector<int> doorbells;         // the peer's doorbells (we write them)
  std::map<std::uint32_t, std::shared_ptr<memory::MappedRegion>> regions;
};

class Core;
class ShmConnection;

// ---------------------------------------------------------------------------
// Puts tokens on the release ring of the lane we consume (the peer's lane),
// from any thread, also after the channel closed: the peer quarantines what
// it lent us until the token comes back (or until we exit), so a view that
// outlives the connection still gives its payload back when it goes. The
// sink keeps that lane mapped for as long as a view holds the sink.
class ReleaseSink {
 public:
  ReleaseSink(std::shared_ptr<const Lane> rx, LaneControl* wake_flag_lane, int peer_doorbell,
              std::atomic<std::uint64_t>* syscalls)
      : rx_(std::move(rx)), wake_flag_lane_(wake_flag_lane), peer_doorbell_(peer_doorbell), syscalls_(syscalls) {}
  void release(std::uint64_t token) {
    std::lock_guard lock(mu_);
    LaneControl& c = rx_->control();
    const std::uint64_t pos = c.release_head.value.load(std::memory_order_relaxed);
    rx_->release_slot(pos).store(token, std::memory_order_relaxed);
    // Pairs with the producer's acquire load of release_head.
    c.release_head.value.store(pos + 1, std::memory_order_release);
    // The peer's channel thread sleeps with its flag in the lane it consumes
    // (our outgoing lane). Once closed, that lane and the doorbell are gone
    // and the peer's quarantine polls instead.
    if (!closed_) notify_consumer(*wake_flag_lane_, peer_doorbell_, syscalls_);
  }
  // The channel is torn down: stop waking the peer (the doorbell fd and our
  // lane are about to go); tokens are still written.
  void close() {
    std::lock_guard lock(mu_);
    closed_ = true;
  }

 private:
  std::mutex mu_;
  std::shared_ptr<const Lane> rx_;
  LaneControl* wake_flag_lane_;
  int peer_doorbell_;
  std::atomic<std::uint64_t>* syscalls_;  // the connection's; used only while open
  bool closed_ = false;
};

// Owner of an Incoming Buffer that views the peer's memory.
struct LentPayload {
  std::shared_ptr<ReleaseSink> sink;
  std::shared_ptr<memory::MappedRegion> region;  // keeps the mapping alive
  std::uint64_t token = 0;
  LentPayload(std::shared_ptr<ReleaseSink> s, std::shared_ptr<memory::MappedRegion> r,
              std::uint64_t t)
      : sink(std::move(s)), region(std::move(r)), token(t) {}
  LentPayload(LentPayload&& o) noexcept
      : sink(std::move(o.sink)), region(std::move(o.region)), token(o.token) {}
  LentPayload(const LentPayload&) = delete;
  LentPayload& operator=(const LentPayload&) = delete;
  LentPayload& operator=(LentPayload&&) = delete;
  ~LentPayload() {
    if (sink) sink->release(token);
  }
};

// ---------------------------------------------------------------------------
// The peer's process, for telling "it is gone" from "it is stalled": its pid
// from SO_PEERCRED on the control socket, held as a pidfd (opened while the
// peer is certainly alive, at connection setup, so the pid cannot have been
// reused). Without a pidfd (pid not visible in this pid namespace, or a
// kernel before 5.3) exited() is always false and a quarantine waits for the
// peer's tokens alone.
class PeerProcess {
 public:
  explicit PeerProcess(int control_fd) {
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(control_fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid > 0) {
      pid_ = cred.pid;
      fd_ = static_cast<int>(::syscall(SYS_pidfd_open, cred.pid, 0));
    }
  }
  ~PeerProcess() {
    if (fd_ >= 0) ::close(fd_);
  }
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  // The process has exited (its mappings of our memory are gone). Never
  // blocks; thread-safe.
  bool exited() const {
    if (fd_ < 0) return false;
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = 0;
  int fd_ = -1;
};

// Payloads we lent to a peer (shm large messages: the peer reads them in
// place) whose connection ended before the peer gave them back. A stalled
// peer that wakes up still maps our memory and may still read them, so a
// payload goes back to its owner (the page pool; the caller, for memory it
// lent us by reference) only when
//  * the peer puts its token on the release ring (its Incoming Buffer went,
//    whenever that is: the ReleaseSink outlives the connection), or
//  * the peer's side is torn down (lane.h: consumer_detached) and it never
//    consumed the slot, or
//  * the peer's process exits (pidfd).
// The send's completion waits for the same, but at most heartbeat_timeout
// after the close: a caller is never held forever by a stalled peer. Past
// that the completion runs (logged as an error) while the payload itself
// stays held. Polled on I/O context 0; thread-safe.
class Quarantine : public std::enable_shared_from_this<Quarantine> {
 public:
  struct Held {
    Buffer payload;
    SendCompletion done;         // runs once, at release or at the deadline
    std::uint64_t slot_position = 0;
  };
  struct Entry {
    std::shared_ptr<Lane> tx;   // our lane: the peer's releases, tail and detach flag
    std::uint64_t release_tail = 0;
    std::map<std::uint64_t, Held> held;  // by token
    std::shared_ptr<PeerProcess> peer;
    std::string peer_name;
    Error reason{ErrorCode::kClosed, "connection closed"};  // for a never-consumed payload
    std::uint64_t consumed = 0;  // slots the peer had consumed at the close
    Clock::time_point completions_due{};
    bool reported = false;  // the overdue warning went out
  };

  Quarantine(asio::io_context& ctx, nanoseconds poll_every) : ctx_(ctx), poll_every_(poll_every) {}
  ~Quarantine() { release_all(); }

  // The Transport is being destroyed: stop polling (the timer must not keep
  // I/O context 0 busy, or IoThreads::join_when_idle would wait for the
  // peers), so that release_all() can follow once the threads are idle.
  void stop() { stopping_.store(true, std::memory_order_release); }

  // Gives everything back now, completions with the close's error: nobody
  // polls any more. Says so, since a stalled peer may still read it.
  void release_all() {
    std::vector<Entry> entries;
    {
      std::lock_guard lock(mu_);
      entries.swap(entries_);
      held_bytes_ = 0;
    }
    std::uint64_t bytes = 0;
    for (auto& e : entries) {
      for (auto& [t, h] : e.held) {
        bytes += h.payload.size();
        h.payload.reset();
        if (h.done) std::exchange(h.done, nullptr)(tl::unexpected<Error>(e.reason));
      }
    }
    if (bytes > 0) {
      shm_log()->warn(
          "shm transport destroyed while {} bytes lent to peers were not given back yet; they "
          "return to their owner now, and a stalled peer that wakes up may read reused memory",
          bytes);
    }
  }

  void add(Entry e) {
    if (e.held.empty()) return;
    std::uint64_t bytes = 0;
    for (auto& [t, h] : e.held) bytes += h.payload.size();
    // Usually the peer gives them back a moment later (it is only slower
    // than our close); a stalled one is reported when completions are due.
    shm_log()->debug("{}: {} lent payload(s), {} bytes, not given back at the close; held",
                     e.peer_name, e.held.size(), bytes);
    bool arm = false;
    {
      std::lock_guard lock(mu_);
      held_bytes_ += bytes;
      entries_.push_back(std::move(e));
      arm = !armed_;
      armed_ = true;
    }
    if (arm && !stopping_.load(std::memory_order_acquire)) {
      std::weak_ptr<Quarantine> weak = weak_from_this();
      asio::post(ctx_, [weak] {
        if (auto q = weak.lock()) q->arm();
      });
    }
    poll();  // what came back meanwhile goes at once
  }

  std::uint64_t held_bytes() const {
    std::lock_guard lock(mu_);
    return held_bytes_;
  }

  // Gives back what came back; true while anything is still held.
  bool poll() {
    struct Finished {
      Held held;
      Status status;
    };
    std::vector<Finished> done;  // run outside the lock (completions and deleters are user code)
    std::vector<std::string> overdue;
    bool any = false;
    const auto now = Clock::now();
    {
      std::lock_guard lock(mu_);
      for (auto it = entries_.begin(); it != entries_.end();) {
        Entry& e = *it;
        const LaneControl& c = e.tx->control();
        auto finish = [&](auto h, Status st) {
          held_bytes_ -= h->second.payload.size();
          done.push_back(Finished{std::move(h->second), std::move(st)});
          return e.held.erase(h);
        };
        auto status_of = [&](const Held& h) -> Status {
          if (h.slot_position < e.consumed) return ok_status();
          return tl::unexpected<Error>(e.reason);
        };
        const std::uint64_t head = c.release_head.value.load(std::memory_order_acquire);
        // A peer that wrote garbage positions gets nothing back early.
        if (head - e.release_tail <= e.tx->geometry().credits) {
          for (; e.release_tail != head; ++e.release_tail) {
            const std::uint64_t token =
                e.tx->release_slot(e.release_tail).load(std::memory_order_relaxed);
            if (auto h = e.held.find(token); h != e.held.end()) finish(h, ok_status());
          }
        }
        const bool exited = !e.held.empty() && e.peer && e.peer->exited();
        const bool detached =
            !e.held.empty() && c.consumer_detached.value.load(std::memory_order_acquire) != 0;
        const std::uint64_t peer_tail = c.tail.value.load(std::memory_order_acquire);
        for (auto h = e.held.begin(); h != e.held.end();) {
          if (exited) {
            h = finish(h, status_of(h->second));
          } else if (detached && h->second.slot_position >= peer_tail) {
            h = finish(h, tl::unexpected<Error>(e.reason));  // never read, never will be
          } else {
            ++h;
          }
        }
        if (!e.held.empty() && now >= e.completions_due && !e.reported) {
          e.reported = true;
          std::size_t n = 0;
          std::uint64_t bytes = 0;
          for (auto& [t, h] : e.held) {
            bytes += h.payload.size();
            if (!h.done) continue;
            done.push_back(Finished{Held{Buffer(), std::move(h.done), 0}, status_of(h)});
            h.done = nullptr;
            ++n;
          }
          overdue.push_back(fmt::format(
              "{}: {} lent payload(s), {} bytes, still not given back heartbeat_timeout after the "
              "close; they stay held until that peer gives them back, is torn down or exits, but "
              "{} send(s) complete now, and the peer may still read that memory if it wakes up: "
              "kill or restart it",
              e.peer_name, e.held.size(), bytes, n));
        }
        if (e.held.empty()) {
          it = entries_.erase(it);
        } else {
          ++it;
        }
      }
      any = !entries_.empty();
      if (!any) armed_ = false;
    }
    for (const std::string& o : overdue) shm_log()->warn("{}", o);
    for (Finished& f : done) {
      f.held.payload.reset();
      if (f.held.done) f.held.done(std::move(f.status));
    }
    return any;
  }

 private:
  void arm() {  // I/O context 0's thread only
    if (stopping_.load(std::memory_order_acquire)) return;
    if (!timer_) timer_ = std::make_unique<asio::steady_timer>(ctx_);
    timer_->expires_after(poll_every_);
    std::weak_ptr<Quarantine> weak = weak_from_this();
    timer_->async_wait([weak](const boost::system::error_code& ec) {
      if (ec) return;
      auto q = weak.lock();
      if (q && q->poll()) q->arm();
    });
  }

  asio::io_context& ctx_;
  const nanoseconds poll_every_;
  mutable std::mutex mu_;
  std::vector<Entry> entries_;
  std::uint64_t held_bytes_ = 0;
  bool armed_ = false;
  std::atomic<bool> stopping_{false};
  std::unique_ptr<asio::steady_timer> timer_;  // context 0's thread; destroyed after it stopped
};

// ---------------------------------------------------------------------------
// The registry counts live channels, control links and acceptors.
class Core : public TransportRegistry {
 public:
  explicit Core(Options opts) : options(std::move(opts)) {}
  Options options;
  std::unique_ptr<IoThreads> io;
  std::vector<Transport::Region> regions;
  // After io: destroyed first, with its timer, once the threads have stopped.
  std::shared_ptr<Quarantine> quarantine;

  // Creates our lanes and doorbells for `num_channels` channels.
  Result<std::vector<LocalChannelResources>> make_local(std::uint32_t num_channels) {
    std::vector<LocalChannelResources> out;
    auto cleanup = [&] {
      for (auto& r : out) {
        if (r.tx_fd >= 0) ::close(r.tx_fd);
        if (r.doorbell_fd >= 0) ::close(r.doorbell_fd);
      }
    };
    for (std::uint32_t c = 0; c < num_channels; ++c) {
      LocalChannelResources r;
      auto lane = Lane::create(geometry_for(options), &r.tx_fd);
      if (!lane) {
        cleanup();
        return tl::unexpected<Error>(std::move(lane).error());
      }
      r.tx = std::move(*lane);
      r.doorbell_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
      if (r.doorbell_fd < 0) {
        const int err = errno;
        ::close(r.tx_fd);
        cleanup();
        return make_sys_error(err, "eventfd for an shm doorbell");
      }
      out.push_back(std::move(r));
    }
    return out;
  }

  SetupInfo local_setup_info(std::uint32_t num_channels) const {
    SetupInfo s;
    s.num_channels = num_channels;
    s.geometry = geometry_for(options);
    for (std::size_t i = 0; i < regions.size(); ++i) {
      s.regions.push_back({static_cast<std::uint32_t>(i), regions[i].length_bytes});
    }
    return s;
  }
  std::vector<int> local_setup_fds(const std::vector<LocalChannelResources>& local) const {
    std::vector<int> fds;
    for (auto& r : local) fds.push_back(r.tx_fd);
    for (auto& r : local) fds.push_back(r.doorbell_fd);
    for (auto& r : regions) fds.push_back(r.fd);
    return fds;
  }
};

// Maps what the peer sent; takes ownership of `fds` (closes them all).
Result<PeerResources> attach_peer(const SetupInfo& s, std::vector<int> fds) {
  PeerResources p;
  const std::size_t c = s.num_channels;
  Status status = ok_status();
  for (std::size_t i = 0; i < c && status; ++i) {
    auto lane = Lane::attach(fds[i], s.geometry);
    if (!lane) {
      status = tl::unexpected<Error>(std::move(lane).error());
      break;
    }
    p.rx.push_back(std::move(*lane));
  }
  for (std::size_t i = 0; i < c && status; ++i) {
    p.doorbells.push_back(fds[c + i]);
    fds[c + i] = -1;  // kept
  }
  for (std::size_t i = 0; i < s.regions.size() && status; ++i) {
    auto region = memory::MappedRegion::map(fds[2 * c + i], s.regions[i].length_bytes, false);
    if (!region) {
      status = tl::unexpected<Error>(std::move(region).error());
      break;
    }
    p.regions[s.regions[i].id] = std::make_shared<memory::MappedRegion>(std::move(*region));
  }
  close_fds(fds);
  if (!status) {
    close_fds(p.doorbells);
    return tl::unexpected<Error>(status.error());
  }
  return p;
}

// ---------------------------------------------------------------------------
struct Inflight {
  Buffer payload;
  SendCompletion done;
  std::uint64_t bytes = 0;
  std::uint64_t slot_position = 0;
  std::uint64_t token = 0;
  bool active = false;
};

class Channel {
 public:
  Channel(ShmConnection* conn, std::uint32_t index, asio::io_context& ctx, const Options& options,
          LocalChannelResources local, Lane rx, int peer_doorbell, wire::BatchEncoder encoder)
      : conn_(conn),
        index_(index),
        ctx_(ctx),
        options_(options),
        tx_(std::make_shared<Lane>(std::move(local.tx))),
        rx_(std::make_shared<Lane>(std::move(rx))),
        doorbell_fd_(local.doorbell_fd),
        peer_doorbell_fd_(peer_doorbell),
        encoder_(std::move(encoder)),
        inflight_(tx_->geometry().credits) {
    for (std::uint32_t t = tx_->geometry().credits; t > 0; --t) free_tokens_.push_back(t - 1);
    sink_ = std::make_shared<ReleaseSink>(rx_, &tx_->control(), peer_doorbell_fd_,
                                          syscall_counter());
  }

  void start();  // I/O thread
  // Any thread (ShmConnection::poll): consumes what has arrived, unless
  // another thread is consuming now. True when anything was delivered or
  // reclaimed.
  bool poll_from_caller();
  std::atomic<std::uint64_t>* syscall_counter();
  Status send_small(std::span<const std::byte> bytes, nanoseconds wait);
  Status send_large(Buffer&& payload, SendCompletion&& done, nanoseconds wait, bool lend);
  Status flush();  // publishes the open batch and ends a cork()
  // Until flush(): the open batch is published only once full (no flush
  // timer), so a burst of small messages leaves in full batches.
  void cork();
  // Publishes the open batch and refuses further sends (any thread).
  void stop_sending();
  void final_drain();  // I/O thread: consume what the peer published before its goodbye
  void teardown(const Error& reason);  // I/O thread
  asio::io_context& context() { return ctx_; }
  // The lanes, for the connection-wide words of channel 0 (lane.h:
  // memory_revoked, memory_writers). Before teardown only.
  const std::shared_ptr<Lane>& tx_lane() const { return tx_; }
  const std::shared_ptr<Lane>& rx_lane() const { return rx_; }

 private:
  bool slot_free_locked() const {
    return next_head_ - tx_->control().tail.value.load(std::memory_order_acquire) <
           tx_->geometry().num_slots;
  }
  // For a message that takes a slot of its own (send_large): true when the
  // slot at next_head_ may be written. A batch that another sender opened
  // there while this one waited (wait_locked releases mu_) is published
  // first: it is older than this message, and its slot is not ours to
  // overwrite (the batch would go on writing into a published slot).
  bool claim_slot_locked() {
    publish_batch_locked();
    return slot_free_locked();
  }
  // Waits (releasing `lock`) until `ready()`; errors when closed or timed out.
  template <typename Ready>
  Status wait_locked(std::unique_lock<std::mutex>& lock, nanoseconds wait, const char* what,
                     Ready ready);
  void open_batch_locked();
  void publish_batch_locked();
  void publish_slot_locked();
  void arm_flush_timer();
  void run();            // I/O thread: consume, reclaim, then sleep
  void wait_doorbell();  // I/O thread
  bool has_work() const;
  // Consumer ownership (rx_owned_): poll_rx, poll_releases and the park
  // state run only while owning it.
  bool try_own_rx() { return !rx_owned_.exchange(true, std::memory_order_acquire); }
  void own_rx() {  // I/O thread: waits out a poll_from_caller (microseconds)
    while (!try_own_rx()) sched_yield();
  }
  void release_rx() { rx_owned_.store(false, std::memory_order_release); }
  bool poll_rx();
  bool poll_releases();
  bool fail_protocol(std::string message);
  void post(std::function<void()> fn);

  ShmConnection* conn_;
  const std::uint32_t index_;
  asio::io_context& ctx_;
  const Options& options_;
  // Shared: the ReleaseSink keeps rx_ mapped for as long as an Incoming
  // Buffer views a lent payload, and a quarantine keeps tx_ mapped until the
  // peer gives back what we lent (Quarantine below).
  std::shared_ptr<Lane> tx_;
  std::shared_ptr<Lane> rx_;
  int doorbell_fd_;       // owned through doorbell_ once start() ran
  int peer_doorbell_fd_;  // owned
  std::unique_ptr<Descriptor> doorbell_;
  std::unique_ptr<asio::steady_timer> flush_timer_;
  std::shared_ptr<ReleaseSink> sink_;

  // TX, under mu_.
  std::mutex mu_;
  std::condition_variable space_cv_;
  int waiters_ = 0;
  wire::BatchEncoder encoder_;
  bool open_ = false;
  std::uint64_t open_messages_ = 0;
  std::uint64_t open_bytes_ = 0;
  std::uint64_t next_head_ = 0;  // slots published (plus the open one at this position)
  std::vector<Inflight> inflight_;
  std::vector<std::uint32_t> free_tokens_;
  bool flush_timer_armed_ = false;
  bool corked_ = false;   // cork() until flush()
  bool stopped_ = false;  // no new sends (closing)
  bool tx_closed_ = false;
  bool fragmenting_ = false;  // a sender is mid-way through a fragmented message (send_large)

  // RX: the consumer, i.e. the I/O thread or a thread in poll_from_caller,
  // whichever owns rx_owned_ (acquire/release: one owner's writes are seen
  // by the next). The I/O thread also reads torn_down_ and started_ without
  // owning: only it writes them (under ownership).
  std::atomic<bool> rx_owned_{false};
  std::uint64_t rx_tail_ = 0;
  Buffer reassembly_;
  std::uint64_t reassembly_filled_ = 0;
  bool torn_down_ = false;
  // The I/O thread waits on the doorbell (set when it parks, cleared when
  // the doorbell wakes it); a caller that consumes meanwhile keeps the
  // peer from ringing and hands back what it leaves (poll_from_caller).
  bool parked_ = false;
  // Last time run() moved data (busy polling only).
  std::chrono::steady_clock::time_point last_progress_{};
  bool started_ = false;
};

// ---------------------------------------------------------------------------
class ShmConnection final : public ConnectionCore {
 public:
  ShmConnection(std::shared_ptr<Core> core, PeerInfo peer, Handlers handlers, int control_fd)
      : ConnectionCore(std::move(peer), std::move(handlers), core->options.max_queued_bytes,
                       core->options.max_message_bytes),
        core_(std::move(core)),
        control_fd_(control_fd),
        peer_process_(std::make_shared<PeerProcess>(control_fd)) {}

  Status init(std::vector<LocalChannelResources> local, PeerResources peer) {
    peer_regions_ = std::move(peer.regions);
    shared_regions_ = core_->regions.size();
    for (std::uint32_t c = 0; c < local.size(); ++c) {
      auto encoder = wire::BatchEncoder::create(
          {.batch_threshold_bytes = local[c].tx.body_bytes() / 8 * 8});
      if (!encoder) return tl::unexpected<Error>(std::move(encoder).error());
      asio::io_context& ctx = core_->io->pick();
      if (c == 0) control_ctx_ = &ctx;
      ::close(local[c].tx_fd);  // the peer has its copy; our mapping stays
      local[c].tx_fd = -1;
      channels_.push_back(std::make_unique<Channel>(this, c, ctx, core_->options,
                                                    std::move(local[c]), std::move(peer.rx[c]),
                                                    peer.doorbells[c], std::move(*encoder)));
      core_->io_object_added();
    }
    core_->io_object_added();  // the control link
    // Channel 0's lanes carry the connection's memory_revoked and
    // memory_writers words; kept mapped while this object lives.
    own_access_ = channels_[0]->tx_lane();
    peer_access_ = channels_[0]->rx_lane();
    return ok_status();
  }

  std::shared_ptr<ShmConnection> shared() {
    return std::static_pointer_cast<ShmConnection>(shared_from_this());
  }

  void start() {
    auto self = shared();
    // Refused only when the Transport is being destroyed meanwhile.
    for (auto& ch : channels_) {
      Channel* c = ch.get();
      (void)core_->io->post(c->context(), [self, c] { c->start(); });
    }
    (void)core_->io->post(*control_ctx_, [self] { self->start_control(); });
  }

  bool poll() override {
    bool any = false;
    for (auto& ch : channels_) any = ch->poll_from_caller() || any;
    return any;
  }

  Status send(std::uint32_t channel, std::span<const std::byte> bytes, nanoseconds wait) override {
    EMBER_TRY(check_send(channel, bytes.size()));
    if (bytes.size() > payload_limit()) {
      // Unregistered large message: copied through the ring in fragments.
      Buffer view = Buffer::borrow(std::span<std::byte>(const_cast<std::byte*>(bytes.data()), bytes.size()));
      return channels_[channel]->send_large(std::move(view), {}, wait, /*lend=*/false);
    }
    return channels_[channel]->send_small(bytes, wait);
  }

  Status send(std::uint32_t channel, Buffer&& payload, SendCompletion done, nanoseconds wait) override {
    Buffer owned = std::move(payload);
    EMBER_TRY(check_send(channel, owned.size()));
    const bool lend = owned.size() > payload_limit() && is_shared_region(owned);
    if (!lend) {
      // Copied (into a ring slot, or in fragments): `done` runs here, on the
      // caller thread. Counted, so that on_closed waits for it (see
      // callers_completing_).
      CallerCompletion counted(callers_completing_);
      if (owned.size() <= payload_limit()) {
        Status s = channels_[channel]->send_small(owned.bytes(), wait);
        owned.reset();
        if (s && done) done(ok_status());
        return s;
      }
      return channels_[channel]->send_large(std::move(owned), std::move(done), wait, /*lend=*/false);
    }
    EMBER_TRY(flow().acquire(owned.size(), wait, !core_->io->on_io_thread()));
    return channels_[channel]->send_large(std::move(owned), std::move(done), wait, /*lend=*/true);
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
    for (auto& c : channels_) EMBER_TRY(c->flush());
    return ok_status();
  }

  void close(nanoseconds drain) override {
    if (!begin_close()) return;
    // Everything published before the goodbye is seen by the peer after it.
    for (auto& c : channels_) c->stop_sending();
    auto rec = control_record(kControlGoodbye);
    {
      std::lock_guard lock(mu_);
      if (control_fd_ >= 0) {
        (void)::send(control_fd_, rec.data(), rec.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        goodbye_sent_ = true;
      }
    }
    // Refused when ~Transport is joining the I/O threads, after it closed
    // this Connection (on_closed ran with kCancelled): nothing left to do.
    auto self = shared();
    (void)core_->io->post(*control_ctx_, [self, drain] {
      if (self->control_done_) return;
      self->drain_timer_ = std::make_unique<asio::steady_timer>(*self->control_ctx_);
      self->drain_timer_->expires_after(drain);
      self->drain_timer_->async_wait([self](const boost::system::error_code& ec) {
        if (ec) return;
        self->fail(Error(ErrorCode::kClosed,
                         "orderly close did not finish within the drain time; connection torn down"));
      });
      self->maybe_finish_orderly();
    });
  }

  // --- internal ---
  // A channel's (or the control link's) I/O objects are gone; the last of
  // the channels + 1 parts reports.
  void io_part_finished() {
    if (!part_finished(channels_.size() + 1)) {
      core_->io_object_removed();
      return;
    }
    // The last part: on_closed waits until no write of the peer into our
    // memory is in progress (one that started before revoke_peer_writes()),
    // so a caller who reuses a pull's destination after the error cannot
    // have it overwritten by a peer that stalled mid-copy and woke up.
    // It also waits for the completions that callers run inside send()
    // (callers_completing_): transport.h promises no callback after on_closed.
    const bool peer_done = peer_writes_finished();
    if (peer_done && callers_completing_.load(std::memory_order_seq_cst) == 0) {
      release_access();
      announce_closed();
      // After on_closed: ~Transport joins the I/O threads once the count is
      // zero, and what on_closed posts (to any context) must find them.
      core_->io_object_removed();
      return;
    }
    revoke_deadline_ = Clock::now() + core_->options.heartbeat_timeout;
    if (!peer_done) {
      shm_log()->warn("{} {} stalled while writing into this process's memory; on_closed waits up "
                      "to heartbeat_timeout for that write to end",
                      role_name(peer().role), peer().rank);
    }
    auto self = shared();
    asio::post(*control_ctx_, [self] { self->wait_before_on_closed(); });
  }
  std::shared_ptr<PeerProcess> peer_process() const { return std::atomic_load(&peer_process_); }
  // A channel finished its final drain after the peer's goodbye.
  void channel_drained() {
    if (++channels_drained_ == channels_.size()) {
      auto self = shared();
      asio::post(*control_ctx_, [self] {
        self->all_drained_ = true;
        self->maybe_finish_orderly();
      });
    }
  }
  Core& core() { return *core_; }
  const std::shared_ptr<memory::MappedRegion>* peer_region(std::uint32_t id) const {
    auto it = peer_regions_.find(id);
    return it == peer_regions_.end() ? nullptr : &it->second;
  }
  Status write_peer_memory(std::uint32_t region_id, std::uint64_t offset_bytes,
                           std::span<const std::byte> data, PeerCopy copy,
                           std::uint32_t window) override {
    const auto* region = peer_region(region_id);
    if (region == nullptr) {
      return make_error(ErrorCode::kInvalidArgument,
                        "peer memory: the peer registered no region {} ({} regions)", region_id,
                        peer_regions_.size());
    }
    EMBER_ASSIGN_OR_RETURN(std::span<std::byte> view, (*region)->view(offset_bytes, data.size()));
    const std::shared_ptr<Lane> lane = std::atomic_load(&peer_access_);
    if (!lane || failing()) return closed_error();
    // lane.h: count the write, then look at memory_revoked and the window
    // (all seq_cst); the peer revokes or closes, then waits for the counts
    // to drop.
    auto& writers = lane->control().memory_writers.value;
    writers.fetch_add(1, std::memory_order_seq_cst);
    WriteWindow* w = window != 0 ? &lane->window(window) : nullptr;
    if (w != nullptr) w->writers.fetch_add(1, std::memory_order_seq_cst);
    auto done = [&] {
      if (w != nullptr) w->writers.fetch_sub(1, std::memory_order_seq_cst);
      writers.fetch_sub(1, std::memory_order_seq_cst);
    };
    if (lane->control().memory_revoked.value.load(std::memory_order_seq_cst) != 0) {
      done();
      return make_error(ErrorCode::kClosed,
                        "{} {} ended this connection; its memory is no longer written",
                        role_name(peer().role), peer().rank);
    }
    if (w != nullptr && w->armed.load(std::memory_order_seq_cst) != window) {
      done();
      return make_error(ErrorCode::kClosed,
                        "{} {} closed write window {:#x} (it gave up on that request); nothing "
                        "written",
                        role_name(peer().role), peer().rank, window);
    }
    if (copy == PeerCopy::kStream) {
      memory::stream_copy(view.data(), data.data(), data.size());
    } else {
      std::memcpy(view.data(), data.data(), data.size());
    }
    done();
    return ok_status();
  }

  Result<std::uint32_t> open_write_window() override {
    const std::shared_ptr<Lane> lane = std::atomic_load(&own_access_);
    if (!lane || failing()) return closed_error();
    std::uint32_t id = 0;
    {
      std::lock_guard lock(windows_mu_);
      if (window_gen_.empty()) {
        window_gen_.assign(kWriteWindows, 0);
        for (std::uint32_t i = kWriteWindows; i > 0; --i) free_windows_.push_back(i - 1);
      }
      if (free_windows_.empty()) {
        return make_error(ErrorCode::kTooLarge,
                          "all {} write windows of the connection to {} {} are open",
                          kWriteWindows, role_name(peer().role), peer().rank);
      }
      const std::uint32_t index = free_windows_.back();
      free_windows_.pop_back();
      std::uint32_t gen = (window_gen_[index] + 1) & ((1u << (32 - kWriteWindowIndexBits)) - 1);
      if (gen == 0) gen = 1;
      window_gen_[index] = gen;
      id = gen << kWriteWindowIndexBits | index;
    }
    lane->window(id).armed.store(id, std::memory_order_seq_cst);
    return id;
  }

  void close_write_window(std::uint32_t window) override {
    const std::shared_ptr<Lane> lane = std::atomic_load(&own_access_);
    if (!lane || window == 0) return;  // closed: the peer's writes went with the connection
    WriteWindow& w = lane->window(window);
    std::uint32_t expected = window;
    if (!w.armed.compare_exchange_strong(expected, 0, std::memory_order_seq_cst)) return;
    if (w.writers.load(std::memory_order_seq_cst) != 0) {
      // The peer is copying into it right now (or stalled mid-copy).
      const auto deadline = Clock::now() + core_->options.heartbeat_timeout;
      while (w.writers.load(std::memory_order_seq_cst) != 0) {
        const std::shared_ptr<PeerProcess> proc = std::atomic_load(&peer_process_);
        const bool gone = proc && proc->exited();
        if (gone || Clock::now() >= deadline) {
          if (!gone) {
            shm_log()->error("{} {} did not finish its write through window {:#x} within "
                             "heartbeat_timeout; that memory may still change if it wakes up",
                             role_name(peer().role), peer().rank, window);
          }
          break;
        }
        std::this_thread::yield();
      }
    }
    std::lock_guard lock(windows_mu_);
    free_windows_.push_back(window & (kWriteWindows - 1));
  }

  std::size_t payload_limit() const {
    return core_->options.batch_threshold_bytes / 8 * 8 - wire::kMinFrameBytes;
  }

 private:
  std::size_t lane_count() const noexcept override { return channels_.size(); }
  // Every channel and the control link tear down on their I/O threads
  // (first fail() only).
  void start_teardown() override {
    revoke_peer_writes();
    auto self = shared();
    // Never refused: the Transport's shutdown waits for these parts first.
    for (auto& ch : channels_) {
      Channel* c = ch.get();
      (void)core_->io->post(c->context(), [self, c] { c->teardown(self->failure_reason()); });
    }
    (void)core_->io->post(*control_ctx_, [self] { self->teardown_control(); });
  }

  bool is_shared_region(const Buffer& b) const {
    const MemoryLocation& loc = b.location();
    if (loc.region_id >= shared_regions_) return false;
    const Transport::Region& r = core_->regions[loc.region_id];
    return loc.fd == r.fd && loc.fd_offset + b.size() <= r.length_bytes &&
           static_cast<const std::byte*>(r.base) + loc.fd_offset == b.data();
  }

  // --- control link (channel 0's I/O thread) ---
  void start_control() {
    if (control_done_) return;
    last_rx_ns_ = now_ns();
    control_ = std::make_unique<Descriptor>(*control_ctx_, control_fd_);
    heartbeat_timer_ = std::make_unique<asio::steady_timer>(*control_ctx_);
    on_heartbeat_timer();
    on_control_readable();
  }
  void arm_control_read() {
    if (control_done_ || !control_) return;
    auto self = shared();
    control_->async_wait(Descriptor::wait_read, [self](const boost::system::error_code& ec) {
      if (ec) return;
      self->on_control_readable();
    });
  }
  void on_control_readable() {
    for (;;) {
      if (control_done_) return;
      auto r = try_receive(control_fd_);
      read_syscalls.fetch_add(1, std::memory_order_relaxed);
      if (!r) {
        if (r.error().code() == ErrorCode::kTimeout) {
          arm_control_read();
          return;
        }
        fail(r.error());
        return;
      }
      close_fds(r->fds);
      if (r->closed) {
        if (goodbye_received_) {
          peer_eof_ = true;
          maybe_finish_orderly();
        } else {
          fail(Error(ErrorCode::kIo,
                     fmt::format("{} {} closed the shm control socket without goodbye (crashed or "
                                 "killed)",
                                 role_name(peer().role), peer().rank)));
        }
        return;
      }
      last_rx_ns_ = now_ns();
      std::uint32_t magic = 0;
      if (r->bytes.size() != 8 || (std::memcpy(&magic, r->bytes.data(), 4), magic != kControlMagic)) {
        fail(Error(ErrorCode::kProtocol, "malformed shm control record"));
        return;
      }
      const auto type = static_cast<std::uint8_t>(r->bytes[4]);
      if (type == kControlHeartbeat) {
        heartbeats_received.fetch_add(1, std::memory_order_relaxed);
      } else if (type == kControlGoodbye) {
        if (!goodbye_received_) {
          goodbye_received_ = true;
          peer_goodbye();
          auto self = shared();
          for (auto& ch : channels_) {
            Channel* c = ch.get();
            asio::post(c->context(), [self, c] { c->final_drain(); });
          }
        }
      } else {
        fail(Error(ErrorCode::kProtocol, fmt::format("unknown shm control record type {}", type)));
        return;
      }
    }
  }
  void on_heartbeat_timer() {
    if (control_done_ || !heartbeat_timer_) return;
    const std::int64_t now = now_ns();
    const Options& o = core_->options;
    if (now - last_rx_ns_ > o.heartbeat_timeout.count()) {
      fail(heartbeat_timeout_error(
          fmt::format("{} {} on the shm control socket", role_name(peer().role), peer().rank),
          nanoseconds(now - last_rx_ns_)));
      return;
    }
    if (now - last_tx_ns_ >= o.heartbeat_interval.count()) {
      auto rec = control_record(kControlHeartbeat);
      std::lock_guard lock(mu_);
      if (!goodbye_sent_ &&
          ::send(control_fd_, rec.data(), rec.size(), MSG_NOSIGNAL | MSG_DONTWAIT) == 8) {
        heartbeats_sent.fetch_add(1, std::memory_order_relaxed);
        write_syscalls.fetch_add(1, std::memory_order_relaxed);
        last_tx_ns_ = now;
      }
    }
    heartbeat_timer_->expires_after(std::min(o.heartbeat_interval, o.heartbeat_timeout / 4));
    auto self = shared();
    heartbeat_timer_->async_wait([self](const boost::system::error_code& ec) {
      if (ec) return;
      self->on_heartbeat_timer();
    });
  }
  void maybe_finish_orderly() {
    if (control_done_) return;
    // Done when we said goodbye, heard the peer's, and consumed everything
    // it published before it.
    if (goodbye_sent_ && goodbye_received_ && all_drained_) {
      revoke_peer_writes();
      auto self = shared();
      for (auto& ch : channels_) {
        Channel* c = ch.get();
        asio::post(c->context(), [self, c] {
          c->teardown(Error(ErrorCode::kClosed, "orderly close"));
        });
      }
      teardown_control();
    }
  }
  void teardown_control() {
    if (control_done_) return;
    control_done_ = true;
    if (heartbeat_timer_) heartbeat_timer_.reset();
    if (drain_timer_) drain_timer_.reset();
    {
      std::lock_guard lock(mu_);
      if (control_) {
        boost::system::error_code ec;
        control_->close(ec);  // closes control_fd_
        control_.reset();
      } else if (control_fd_ >= 0) {
        ::close(control_fd_);
      }
      control_fd_ = -1;
    }
    io_part_finished();
  }

  // Closed for good: unmap channel 0's lanes and close the pidfd (a
  // quarantine holds its own references).
  void release_access() {
    std::atomic_store(&peer_access_, std::shared_ptr<Lane>());
    std::atomic_store(&own_access_, std::shared_ptr<Lane>());
    std::atomic_store(&peer_process_, std::shared_ptr<PeerProcess>());
  }
  // Tells the peer to write no more into our memory (lane.h: memory_revoked).
  void revoke_peer_writes() {
    const std::shared_ptr<Lane> lane = std::atomic_load(&own_access_);
    if (lane) lane->control().memory_revoked.value.store(1, std::memory_order_seq_cst);
  }
  bool peer_writes_finished() const {
    const std::shared_ptr<Lane> lane = std::atomic_load(&own_access_);
    const std::shared_ptr<PeerProcess> peer = std::atomic_load(&peer_process_);
    return !lane || lane->control().memory_writers.value.load(std::memory_order_seq_cst) == 0 ||
           (peer && peer->exited());
  }
  // On the control link's context, after the last part finished (that part
  // stays counted as an I/O object until on_closed): polls until the peer's
  // writes have ended (or heartbeat_timeout passed) and no caller is running
  // a send's completion (no deadline: that completion is the caller's own
  // code, and it runs the moment its copy is done).
  void wait_before_on_closed() {
    const bool callers_done = callers_completing_.load(std::memory_order_seq_cst) == 0;
    if (callers_done && (peer_writes_finished() || Clock::now() >= revoke_deadline_)) {
      if (!peer_writes_finished()) {
        shm_log()->error("{} {} did not finish its write into this process's memory within "
                         "heartbeat_timeout; the destination of a pull that failed with this "
                         "connection may still change if that process wakes up",
                         role_name(peer().role), peer().rank);
      }
      revoke_timer_.reset();
      release_access();
      announce_closed();
      core_->io_object_removed();  // after on_closed, as in io_part_finished
      return;
    }
    if (!revoke_timer_) revoke_timer_ = std::make_unique<asio::steady_timer>(*control_ctx_);
    revoke_timer_->expires_after(kRevokePoll);
    auto self = shared();
    revoke_timer_->async_wait([self](const boost::system::error_code& ec) {
      if (ec) return;
      self->wait_before_on_closed();
    });
  }

  std::shared_ptr<Core> core_;
  std::vector<std::unique_ptr<Channel>> channels_;
  std::map<std::uint32_t, std::shared_ptr<memory::MappedRegion>> peer_regions_;
  std::size_t shared_regions_ = 0;
  asio::io_context* control_ctx_ = nullptr;

  std::mutex mu_;  // control_fd_ (sends and close)
  int control_fd_;
  std::atomic<bool> goodbye_sent_{false};

  std::atomic<std::size_t> channels_drained_{0};

  // Control link state, channel 0's I/O thread only.
  std::unique_ptr<Descriptor> control_;
  std::unique_ptr<asio::steady_timer> heartbeat_timer_;
  std::unique_ptr<asio::steady_timer> drain_timer_;
  std::int64_t last_rx_ns_ = 0;
  std::int64_t last_tx_ns_ = 0;
  bool goodbye_received_ = false;
  bool peer_eof_ = false;
  std::shared_ptr<PeerProcess> peer_process_;
  // Both until on_closed. own_access_: our channel-0 lane (we revoke in it);
  // peer_access_: the peer's (we count our writes in it; atomic_load/store,
  // write_peer_memory runs on any thread).
  std::shared_ptr<Lane> own_access_;
  std::shared_ptr<Lane> peer_access_;
  // Write windows we opened (lane.h WriteWindow, in own_access_).
  std::mutex windows_mu_;
  std::vector<std::uint32_t> free_windows_;  // entry indices
  std::vector<std::uint32_t> window_gen_;    // per entry: generation of its last id
  Clock::time_point revoke_deadline_{};
  // Callers inside send() whose completion runs on their own thread (a
  // copied payload). The last part waits for zero before on_closed. Order
  // (seq_cst): a caller counts itself before its channel's lock, where it
  // sees tx_closed_; teardown sets tx_closed_ under that lock before the
  // last part reads the count. So either the read sees the caller, or the
  // caller sees the channel closed and runs no completion.
  std::atomic<int> callers_completing_{0};
  struct CallerCompletion {
    explicit CallerCompletion(std::atomic<int>& n) : n_(n) { n_.fetch_add(1, std::memory_order_seq_cst); }
    ~CallerCompletion() { n_.fetch_sub(1, std::memory_order_seq_cst); }
    CallerCompletion(const CallerCompletion&) = delete;
    CallerCompletion& operator=(const CallerCompletion&) = delete;
    std::atomic<int>& n_;
  };
  std::unique_ptr<asio::steady_timer> revoke_timer_;
  bool all_drained_ = false;
  bool control_done_ = false;
};

// ---------------------------------------------------------------------------
// Channel implementation.

void Channel::post(std::function<void()> fn) {
  auto self = conn_->shared();
  // Refused only once the channel has long finished (a flush timer armed by
  // a send that raced the teardown): dropped, with its reference.
  (void)conn_->core().io->post(ctx_, [self, fn = std::move(fn)] { fn(); });
}

std::atomic<std::uint64_t>* Channel::syscall_counter() { return &conn_->write_syscalls; }

void Channel::start() {
  if (torn_down_) return;
  own_rx();
  started_ = true;
  release_rx();
  doorbell_ = std::make_unique<Descriptor>(ctx_, doorbell_fd_);
  flush_timer_ = std::make_unique<asio::steady_timer>(ctx_);
  bool armed = false;
  {
    std::lock_guard lock(mu_);
    armed = flush_timer_armed_;  // a send came before start()
  }
  // Outside mu_: with flush_interval = 0 arm_flush_timer() publishes at once,
  // which takes mu_ (holding it here deadlocked the I/O thread).
  if (armed) arm_flush_timer();
  run();
}

template <typename Ready>
Status Channel::wait_locked(std::unique_lock<std::mutex>& lock, nanoseconds wait, const char* what,
                            Ready ready) {
  if (ready()) return ok_status();
  if (wait.count() <= 0 || conn_->core().io->on_io_thread()) {
    return make_error(ErrorCode::kTimeout,
                      "shm channel {}: {} (the receiver is slow); retry later or raise "
                      "[communication] ring_buffer_size",
                      index_, what);
  }
  const auto deadline = Clock::now() + wait;
  ++waiters_;
  Status result = ok_status();
  for (;;) {
    if (tx_closed_ || stopped_) {
      result = make_error(ErrorCode::kClosed, "shm connection closed while waiting: {}", what);
      break;
    }
    // Ask the consumer to ring our doorbell when it frees something; our
    // channel thread then notifies space_cv_.
    tx_->control().producer_waiting.value.store(1);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (ready()) break;
    if (space_cv_.wait_until(lock, deadline) == std::cv_status::timeout && !ready()) {
      result = make_error(ErrorCode::kTimeout,
                          "shm channel {}: {} after waiting {} ms (the receiver is slow); retry "
                          "later or raise [communication] ring_buffer_size",
                          index_, what,
                          std::chrono::duration_cast<std::chrono::milliseconds>(wait).count());
      break;
    }
  }
  --waiters_;
  return result;
}

void Channel::open_batch_locked() {
  std::byte* slot = tx_->slot(next_head_);
  encoder_.begin(std::span<std::byte>(slot + kSlotHeaderBytes, tx_->body_bytes()));
  open_ = true;
}

void Channel::publish_slot_locked() {
  // Pairs with the consumer's acquire load of head.
  tx_->control().head.value.store(++next_head_, std::memory_order_release);
  conn_->tx_progress.fetch_add(1, std::memory_order_relaxed);
  notify_consumer(tx_->control(), peer_doorbell_fd_, &conn_->write_syscalls);
}

void Channel::publish_batch_locked() {
  if (!open_) return;
  open_ = false;
  if (encoder_.empty()) {
    encoder_.abandon();
    return;
  }
  std::byte* slot = tx_->slot(next_head_);
  std::span<std::byte> frame = encoder_.finish();
  SlotHeader h{};
  h.kind = static_cast<std::uint32_t>(SlotKind::kBatch);
  h.frame_offset = static_cast<std::uint32_t>(frame.data() - (slot + kSlotHeaderBytes));
  h.frame_bytes = static_cast<std::uint32_t>(frame.size());
  std::memcpy(slot, &h, sizeof h);
  conn_->messages_sent.fetch_add(open_messages_, std::memory_order_relaxed);
  conn_->bytes_sent.fetch_add(open_bytes_, std::memory_order_relaxed);
  conn_->frames_sent.fetch_add(1, std::memory_order_relaxed);
  open_messages_ = 0;
  open_bytes_ = 0;
  publish_slot_locked();
}

Status Channel::send_small(std::span<const std::byte> bytes, nanoseconds wait) {
  std::unique_lock lock(mu_);
  for (;;) {
    if (tx_closed_ || stopped_) {
      return make_error(ErrorCode::kClosed, "shm connection is closed; message on channel {} dropped",
                        index_);
    }
    // The one copy of the small-message path: into the slot's batch.
    if (open_ && encoder_.try_add(bytes, 0)) break;
    if (open_) publish_batch_locked();
    EMBER_TRY(wait_locked(lock, wait, "ring full", [&] { return open_ || slot_free_locked(); }));
    if (!open_) open_batch_locked();
  }
  ++open_messages_;
  open_bytes_ += bytes.size();
  if (!options_.batching) publish_batch_locked();
  bool arm = false;
  if (open_ && !flush_timer_armed_ && !corked_) {
    flush_timer_armed_ = true;
    arm = true;
  }
  lock.unlock();
  if (arm) post([this] { arm_flush_timer(); });
  return ok_status();
}

Status Channel::send_large(Buffer&& payload, SendCompletion&& done, nanoseconds wait, bool lend) {
  const std::uint64_t size = payload.size();
  std::unique_lock lock(mu_);
  auto fail_with = [&](Error e) -> Status {
    lock.unlock();
    if (lend) conn_->flow().release(size);
    payload.reset();
    return tl::unexpected<Error>(std::move(e));
  };
  if (tx_closed_ || stopped_) {
    return fail_with(Error(ErrorCode::kClosed, "shm connection is closed; message dropped"));
  }
  publish_batch_locked();  // order: earlier small messages first
  if (lend) {
    if (Status s = wait_locked(lock, wait, "ring full or all large-message tokens lent",
                               [&] { return claim_slot_locked() && !free_tokens_.empty(); });
        !s) {
      return fail_with(s.error());
    }
    const std::uint32_t token = free_tokens_.back();
    free_tokens_.pop_back();
    std::byte* slot = tx_->slot(next_head_);
    SlotHeader h{};
    h.kind = static_cast<std::uint32_t>(SlotKind::kLarge);
    h.region_id = payload.location().region_id;
    h.offset = payload.location().fd_offset;
    h.length = size;
    h.token = token;
    std::memcpy(slot, &h, sizeof h);
    Inflight& f = inflight_[token];
    f.payload = std::move(payload);
    f.done = std::move(done);
    f.bytes = size;
    f.slot_position = next_head_;
    f.token = token;
    f.active = true;
    conn_->messages_sent.fetch_add(1, std::memory_order_relaxed);
    conn_->bytes_sent.fetch_add(size, std::memory_order_relaxed);
    conn_->frames_sent.fetch_add(1, std::memory_order_relaxed);
    publish_slot_locked();
    return ok_status();
  }
  // Fragments: copied through the ring (memory the peer cannot map).
  // One fragmented message at a time per channel: a sender waiting for ring
  // space releases mu_, and another sender's fragments written meanwhile
  // would land inside this message (the receiver would take them as a new
  // message and fail the connection with "fragment out of order", or, with
  // equal lengths, splice two messages). Small and by-reference messages
  // may still go between fragments: the receiver delivers them on their own.
  const std::size_t per_slot = tx_->body_bytes();
  const bool can_wait = wait.count() > 0 && !conn_->core().io->on_io_thread();
  if (can_wait) {
    if (Status s = wait_locked(lock, wait, "another message from unregistered memory is being copied",
                               [&] { return !fragmenting_; });
        !s) {
      return fail_with(s.error());  // nothing of this message was written
    }
  } else {
    // A caller that cannot wait gets all of the message in or none of it.
    if (fragmenting_) {
      return fail_with(Error(
          ErrorCode::kTimeout,
          fmt::format("shm channel {}: another message from unregistered memory is being copied "
                      "through the ring, and this caller cannot wait (I/O thread or zero wait); "
                      "send it from a registered region or from another thread",
                      index_)));
    }
    const std::uint64_t needed = (size + per_slot - 1) / per_slot;
    const std::uint64_t free_slots =
        tx_->geometry().num_slots -
        (next_head_ - tx_->control().tail.value.load(std::memory_order_acquire));
    if (needed > free_slots) {
      return fail_with(Error(
          ErrorCode::kTimeout,
          fmt::format("shm channel {}: a {}-byte message from unregistered memory needs {} free "
                      "ring slots, {} are free, and this caller cannot wait (I/O thread or zero "
                      "wait); send it from a registered region, from another thread, or raise "
                      "[communication] ring_buffer_size",
                      index_, size, needed, free_slots)));
    }
  }
  fragmenting_ = true;
  auto end_fragments = [&] {  // under mu_
    fragmenting_ = false;
    if (waiters_ > 0) space_cv_.notify_all();
  };
  std::uint64_t off = 0;
  while (off < size) {
    if (Status s = wait_locked(lock, wait, "ring full", [&] { return claim_slot_locked(); }); !s) {
      // The message is cut short: the peer would wait forever for the rest.
      end_fragments();
      lock.unlock();
      payload.reset();
      conn_->fail(Error(ErrorCode::kTimeout, "large message could not be completed: " +
                                                 s.error().message()));
      return tl::unexpected<Error>(s.error());
    }
    if (tx_closed_) {
      end_fragments();
      return fail_with(Error(ErrorCode::kClosed, "shm connection is closed"));
    }
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(per_slot, size - off));
    std::byte* slot = tx_->slot(next_head_);
    SlotHeader h{};
    h.kind = static_cast<std::uint32_t>(SlotKind::kFragment);
    h.frame_bytes = static_cast<std::uint32_t>(n);
    h.offset = off;
    h.length = size;
    std::memcpy(slot, &h, sizeof h);
    std::memcpy(slot + kSlotHeaderBytes, payload.data() + off, n);
    publish_slot_locked();
    off += n;
  }
  end_fragments();
  conn_->messages_sent.fetch_add(1, std::memory_order_relaxed);
  conn_->bytes_sent.fetch_add(size, std::memory_order_relaxed);
  conn_->frames_sent.fetch_add(1, std::memory_order_relaxed);
  lock.unlock();
  payload.reset();
  if (done) done(ok_status());
  return ok_status();
}

Status Channel::flush() {
  std::lock_guard lock(mu_);
  corked_ = false;
  if (tx_closed_) return make_error(ErrorCode::kClosed, "shm connection is closed");
  publish_batch_locked();
  return ok_status();
}

void Channel::cork() {
  std::lock_guard lock(mu_);
  corked_ = true;
}

void Channel::stop_sending() {
  std::lock_guard lock(mu_);
  if (tx_closed_) return;
  publish_batch_locked();
  stopped_ = true;
  space_cv_.notify_all();
}

void Channel::arm_flush_timer() {
  if (!flush_timer_ || torn_down_) return;
  auto fire = [this] {
    std::lock_guard lock(mu_);
    flush_timer_armed_ = false;
    // Armed before a cork(): the batch now waits for the flush, or for being full.
    if (!tx_closed_ && !corked_) publish_batch_locked();
  };
  if (options_.flush_interval.count() == 0) {
    fire();
    return;
  }
  flush_timer_->expires_after(options_.flush_interval);
  auto self = conn_->shared();
  flush_timer_->async_wait([self, fire](const boost::system::error_code& ec) {
    if (!ec) fire();
  });
}

// The lane's words, not rx_tail_: callable without owning the consumer side
// (poll_rx publishes its tail after each slot). A failing connection has
// none: poll_rx consumes nothing more (what is left in the lane stays there)
// and its teardown, posted to this thread, must get to run.
bool Channel::has_work() const {
  if (conn_->failing()) return false;
  const LaneControl& rc = rx_->control();
  return rc.head.value.load(std::memory_order_acquire) != rc.tail.value.load(std::memory_order_relaxed) ||
         tx_->control().release_head.value.load(std::memory_order_acquire) !=
             tx_->control().release_tail.value.load(std::memory_order_relaxed);
}

void Channel::run() {
  for (int round = 0;; ++round) {
    if (torn_down_) return;
    if (!try_own_rx()) {
      // A thread in poll_from_caller is consuming: look again after it (not
      // parked: it may leave work behind).
      sched_yield();
      post([this] { run(); });
      return;
    }
    bool progress = poll_releases();
    if (!torn_down_) progress = poll_rx() || progress;
    release_rx();
    if (torn_down_) return;
    if (progress) {
      if (options_.busy_poll.count() > 0) last_progress_ = std::chrono::steady_clock::now();
      if (round >= 64) {
        post([this] { run(); });  // let other handlers on this thread run
        return;
      }
      continue;
    }
    bool work = false;
    for (int i = 0; i < kSpinPolls && !work; ++i) {
      cpu_relax();
      work = has_work();
    }
    if (work) continue;
    if (options_.busy_poll.count() > 0 &&
        std::chrono::steady_clock::now() - last_progress_ < options_.busy_poll) {
      // Busy polling (Options::busy_poll): look again after the other
      // handlers of this thread ran, without the doorbell's wake-up cost.
      sched_yield();
      post([this] { run(); });
      return;
    }
    // Park: flag, fence, re-check (pairs with notify_consumer's fence).
    // Owning, so that a caller's poll sees parked_ and the flag together.
    if (!try_own_rx()) continue;  // a caller is consuming: not idle
    rx_->control().consumer_sleeping.value.store(1);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (has_work()) {
      rx_->control().consumer_sleeping.value.store(0);
      release_rx();
      continue;
    }
    parked_ = true;
    release_rx();
    wait_doorbell();
    return;
  }
}

void Channel::wait_doorbell() {
  if (torn_down_ || !doorbell_) return;
  auto self = conn_->shared();
  doorbell_->async_wait(Descriptor::wait_read, [self, this](const boost::system::error_code& ec) {
    if (ec || torn_down_) return;
    std::uint64_t count;
    [[maybe_unused]] ssize_t n = ::read(doorbell_fd_, &count, sizeof count);
    conn_->read_syscalls.fetch_add(1, std::memory_order_relaxed);
    own_rx();
    parked_ = false;
    rx_->control().consumer_sleeping.value.store(0);
    release_rx();
    {
      // A sender may be waiting for a slot or a token the peer just freed.
      std::lock_guard lock(mu_);
      if (waiters_ > 0) space_cv_.notify_all();
    }
    run();
  });
}

bool Channel::fail_protocol(std::string message) {
  conn_->fail(Error(ErrorCode::kProtocol, fmt::format("shm channel {}: {}", index_, message)));
  return false;
}

bool Channel::poll_releases() {
  LaneControl& c = tx_->control();
  const std::uint64_t head = c.release_head.value.load(std::memory_order_acquire);
  std::uint64_t tail = c.release_tail.value.load(std::memory_order_relaxed);
  if (head == tail) return false;
  if (head - tail > tx_->geometry().credits) return fail_protocol("release ring overrun");
  std::vector<Inflight> finished;
  std::uint64_t bytes = 0;
  {
    std::lock_guard lock(mu_);
    for (; tail != head; ++tail) {
      const std::uint64_t token = tx_->release_slot(tail).load(std::memory_order_relaxed);
      if (token >= inflight_.size() || !inflight_[token].active) {
        return fail_protocol(fmt::format("peer released unknown token {}", token));
      }
      Inflight& f = inflight_[token];
      f.active = false;
      bytes += f.bytes;
      finished.push_back(std::move(f));
      f = Inflight();
      free_tokens_.push_back(static_cast<std::uint32_t>(token));
    }
    // Pairs with the releaser's... (it only reads our tail to bound the
    // ring; a release store keeps our reads of the slots before it).
    c.release_tail.value.store(tail, std::memory_order_release);
    if (waiters_ > 0) space_cv_.notify_all();
  }
  conn_->flow().release(bytes);
  for (Inflight& f : finished) {
    f.payload.reset();
    if (f.done) f.done(ok_status());
  }
  return true;
}

bool Channel::poll_rx() {
  LaneControl& c = rx_->control();
  const std::uint64_t head = c.head.value.load(std::memory_order_acquire);
  if (head == rx_tail_) return false;
  if (head - rx_tail_ > rx_->geometry().num_slots) {
    return fail_protocol(fmt::format("lane head {} is more than a ring ahead of tail {}", head,
                                     rx_tail_));
  }
  const std::size_t body_bytes = rx_->body_bytes();
  wire::DecoderOptions dopt;
  dopt.max_frame_bytes = body_bytes;
  int n = 0;
  while (rx_tail_ != head && n < kSlotsPerRound && !conn_->failing()) {
    const std::byte* slot = rx_->slot(rx_tail_);
    SlotHeader h;
    std::memcpy(&h, slot, sizeof h);
    const std::byte* body = slot + kSlotHeaderBytes;
    switch (static_cast<SlotKind>(h.kind)) {
      case SlotKind::kBatch: {
        if (std::uint64_t{h.frame_offset} + h.frame_bytes > body_bytes) {
          return fail_protocol("batch frame outside its slot");
        }
        auto frame = wire::decode_frame(
            std::span<const std::byte>(body + h.frame_offset, h.frame_bytes), dopt);
        if (!frame) {
          Error e = std::move(frame).error();
          e.with_context(fmt::format("bad frame from shm peer on channel {}", index_));
          conn_->fail(std::move(e));
          return false;
        }
        conn_->frames_received.fetch_add(1, std::memory_order_relaxed);
        auto left = static_cast<std::uint32_t>(frame->size());
        for (const wire::Item item : *frame) {
          if (conn_->failing()) return false;
          if (item.flags != 0) return fail_protocol(fmt::format("item flags {:#x}", item.flags));
          Incoming m;
          m.channel = index_;
          m.bytes = item.payload;
          m.more_in_batch = --left;
          conn_->deliver(std::move(m));
        }
        break;
      }
      case SlotKind::kLarge: {
        const auto* region = conn_->peer_region(h.region_id);
        if (region == nullptr) return fail_protocol(fmt::format("unknown region {}", h.region_id));
        if (h.length > options_.max_message_bytes) {
          return fail_protocol(fmt::format("large message of {} bytes over max_message_size", h.length));
        }
        auto view = (*region)->view(h.offset, h.length);
        if (!view) return fail_protocol(view.error().message());
        if (h.token >= rx_->geometry().credits) return fail_protocol("token out of range");
        conn_->frames_received.fetch_add(1, std::memory_order_relaxed);
        Incoming m;
        m.channel = index_;
        m.owned = Buffer::adopt(*view, MemoryLocation{}, LentPayload(sink_, *region, h.token));
        m.bytes = std::span<const std::byte>(m.owned.data(), m.owned.size());
        conn_->deliver(std::move(m));
        break;
      }
      case SlotKind::kFragment: {
        if (h.frame_bytes == 0 || h.frame_bytes > body_bytes || h.length > options_.max_message_bytes ||
            h.offset + h.frame_bytes > h.length) {
          return fail_protocol("bad fragment header");
        }
        if (h.offset == 0) {
          Result<Buffer> b = options_.receive_allocator ? options_.receive_allocator(h.length)
                                                        : Result<Buffer>(Buffer::heap_lazy(h.length));
          if (!b) {
            conn_->fail(b.error());
            return false;
          }
          if (b->size() < h.length) return fail_protocol("receive allocator returned a short buffer");
          reassembly_ = std::move(*b);
          reassembly_.truncate(h.length);
          reassembly_filled_ = 0;
        }
        if (!reassembly_ || reassembly_.size() != h.length || h.offset != reassembly_filled_) {
          return fail_protocol("fragment out of order");
        }
        std::memcpy(reassembly_.data() + h.offset, body, h.frame_bytes);
        reassembly_filled_ += h.frame_bytes;
        if (reassembly_filled_ == h.length) {
          conn_->frames_received.fetch_add(1, std::memory_order_relaxed);
          Incoming m;
          m.channel = index_;
          m.owned = std::move(reassembly_);
          m.bytes = std::span<const std::byte>(m.owned.data(), m.owned.size());
          conn_->deliver(std::move(m));
        }
        break;
      }
      default:
        return fail_protocol(fmt::format("unknown slot kind {}", h.kind));
    }
    ++rx_tail_;
    ++n;
    // Pairs with the producer's acquire load of tail before reusing the slot.
    c.tail.value.store(rx_tail_, std::memory_order_release);
  }
  notify_producer(c, peer_doorbell_fd_, &conn_->write_syscalls);
  return n > 0;
}

void Channel::final_drain() {
  if (torn_down_) return;
  own_rx();
  while (!torn_down_ && poll_rx()) {
  }
  (void)poll_releases();
  release_rx();
  conn_->channel_drained();
}

bool Channel::poll_from_caller() {
  if (!try_own_rx()) return false;
  if (torn_down_ || !started_) {
    release_rx();
    return false;
  }
  LaneControl& ctrl = rx_->control();
  // A parked I/O thread stays parked: while we consume, the peer need not
  // ring its doorbell (a system call per message on its side).
  const bool parked = parked_;
  if (parked) ctrl.consumer_sleeping.value.store(0);
  bool progress = poll_releases();
  if (!conn_->failing()) progress = poll_rx() || progress;
  if (parked) {
    // Hand back: flag, fence, re-check (as the I/O thread parks). What
    // arrived after our last look is the I/O thread's: wake it.
    ctrl.consumer_sleeping.value.store(1);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (has_work() && ctrl.consumer_sleeping.value.exchange(0) != 0) {
      ring_doorbell(doorbell_fd_, &conn_->write_syscalls);
    }
  }
  release_rx();
  return progress;
}

void Channel::teardown(const Error& reason) {
  if (torn_down_) return;
  own_rx();  // no caller is consuming from here on (poll_from_caller checks)
  torn_down_ = true;
  release_rx();
  sink_->close();
  sink_.reset();  // live Incoming Buffers hold it (and the peer's lane) on their own
  // We consume no more: a large message the peer published past our tail
  // will never be read (its quarantine gives it back; lane.h).
  rx_->control().consumer_detached.value.store(1, std::memory_order_release);
  std::vector<Inflight> dropped;
  Quarantine::Entry held;
  std::uint64_t bytes = 0;
  std::uint64_t consumed;
  {
    std::lock_guard lock(mu_);
    tx_closed_ = true;
    if (open_) {
      encoder_.abandon();
      open_ = false;
    }
    consumed = tx_->control().tail.value.load(std::memory_order_acquire);
    held.release_tail = tx_->control().release_tail.value.load(std::memory_order_relaxed);
    for (std::size_t token = 0; token < inflight_.size(); ++token) {
      Inflight& f = inflight_[token];
      if (f.active) {
        bytes += f.bytes;
        dropped.push_back(std::move(f));
        f = Inflight();
      }
    }
    space_cv_.notify_all();
    // Unmap under the lock: no sender writes into a lane after this (a
    // quarantine keeps tx_ mapped to read the peer's late releases, the
    // ReleaseSink keeps rx_ mapped for Incoming Buffers still alive).
    held.tx = tx_;
    tx_.reset();
    rx_.reset();
  }
  if (flush_timer_) flush_timer_.reset();
  boost::system::error_code ec;
  if (doorbell_) {
    doorbell_->close(ec);  // closes doorbell_fd_
    doorbell_.reset();
  } else if (doorbell_fd_ >= 0) {
    ::close(doorbell_fd_);
  }
  doorbell_fd_ = -1;
  if (peer_doorbell_fd_ >= 0) ::close(peer_doorbell_fd_);
  peer_doorbell_fd_ = -1;
  reassembly_.reset();
  conn_->flow().release(bytes);
  // Not given back yet: the peer may still read them (a stalled peer wakes
  // up with our memory mapped), unless its process is gone.
  const std::shared_ptr<PeerProcess> peer = conn_->peer_process();
  if (!dropped.empty() && !(peer && peer->exited())) {
    held.peer = peer;
    held.peer_name = fmt::format("shm channel {} to {} {} (pid {})", index_,
                                 role_name(conn_->peer().role), conn_->peer().rank,
                                 peer ? peer->pid() : 0);
    held.reason = reason;
    held.consumed = consumed;
    held.completions_due = Clock::now() + options_.heartbeat_timeout;
    for (std::size_t i = 0; i < dropped.size(); ++i) {
      Inflight& f = dropped[i];
      const std::uint64_t token = f.token;
      held.held.emplace(token, Quarantine::Held{std::move(f.payload), std::move(f.done),
                                                f.slot_position});
    }
    dropped.clear();
    conn_->core().quarantine->add(std::move(held));
  }
  held.tx.reset();
  for (Inflight& f : dropped) {
    f.payload.reset();
    if (f.done) {
      // Delivered when the peer consumed its descriptor; only the release
      // never came.
      if (f.slot_position < consumed) {
        f.done(ok_status());
      } else {
        f.done(tl::unexpected<Error>(reason));
      }
    }
  }
  conn_->io_part_finished();
}

// ---------------------------------------------------------------------------
// Listener.

class ListenerCore : public std::enable_shared_from_this<ListenerCore> {
 public:
  ListenerCore(std::shared_ptr<Core> core, asio::io_context& ctx, LocalIdentity self,
               AcceptHandler on_accept, Handlers handlers)
      : core_(std::move(core)),
        ctx_(ctx),
        self_(self),
        on_accept_(std::move(on_accept)),
        handlers_(std::move(handlers)) {}

  Status open(const std::string& address) {
    EMBER_ASSIGN_OR_RETURN(auto sa, make_address(address));
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return make_sys_error(errno, "socket(AF_UNIX) for shm listener {}", address);
    if (address[0] != '@') ::unlink(address.c_str());  // a stale socket file from a dead server
    if (::bind(fd, reinterpret_cast<sockaddr*>(&sa.first), sa.second) != 0 || ::listen(fd, 128) != 0) {
      const int err = errno;
      ::close(fd);
      return make_sys_error(err, "cannot listen on shm address {}", address);
    }
    address_ = address;
    accept_pacer_.emplace(shm_log(), "listener " + address_);
    refusal_log_.emplace(shm_log(), "shm listener " + address_);
    acceptor_ = std::make_unique<Descriptor>(ctx_, fd);
    core_->io_object_added();
    return ok_status();
  }
  void start() {
    auto self = shared_from_this();
    (void)core_->io->post(ctx_, [self] { self->accept_ready(); });
  }
  // Any thread. Refused when the Transport is gone (or going): its shutdown
  // closed us already.
  void close() {
    auto self = shared_from_this();
    (void)core_->io->post(ctx_, [self] { self->close_on_io(); });
  }
  const std::string& address() const { return address_; }
  std::uint64_t num_refused() const { return refused_.load(); }

 private:
  struct Pending {
    std::unique_ptr<Descriptor> sock;
    std::unique_ptr<asio::steady_timer> timer;
    handshake::Hello hello;
    std::vector<LocalChannelResources> local;
    bool got_hello = false;
    bool done = false;
  };

  void close_on_io() {
    if (closed_) return;
    closed_ = true;
    boost::system::error_code ec;
    if (acceptor_) {
      acceptor_->close(ec);
      acceptor_.reset();
      core_->io_object_removed();
      if (!address_.empty() && address_[0] != '@') ::unlink(address_.c_str());
    }
    if (accept_pacer_) accept_pacer_->cancel();
    if (refusal_log_) refusal_log_->cancel();
    auto pending = pending_;
    for (auto& p : pending) drop(p);
  }

  void arm_accept() {
    if (closed_ || !acceptor_) return;
    auto self = shared_from_this();
    acceptor_->async_wait(Descriptor::wait_read, [self](const boost::system::error_code& ec) {
      if (ec || self->closed_) return;
      self->accept_ready();
    });
  }

  void accept_ready() {
    for (;;) {
      if (closed_ || !acceptor_) return;
      const int fd = ::accept4(acceptor_->native_handle(), nullptr, nullptr,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        const int err = errno;
        if (err == EINTR || err == ECONNABORTED) continue;
        if (err == EAGAIN || err == EWOULDBLOCK) {
          arm_accept();
          return;
        }
        auto self = shared_from_this();
        accept_pacer_->failed(ctx_, std::strerror(err), [self] {
          if (!self->closed_) self->accept_ready();
        });
        return;
      }
      accept_pacer_->succeeded();
      begin(fd);
    }
  }

  void begin(int fd) {
    if (pending_.size() >= kMaxPendingHandshakes) {
      refuse(pending_.front(), handshake_dropped_for_room(), false);
    }
    auto p = std::make_shared<Pending>();
    p->sock = std::make_unique<Descriptor>(ctx_, fd);
    p->timer = std::make_unique<asio::steady_timer>(ctx_);
    p->timer->expires_after(core_->options.connect_timeout);
    pending_.push_back(p);
    auto self = shared_from_this();
    p->timer->async_wait([self, p](const boost::system::error_code& e) {
      if (e || p->done) return;
      self->refuse(p, Error(ErrorCode::kTimeout, "shm handshake not completed within connect_timeout"),
                   false);
    });
    // Same user only: the peer gets to read and write our memory.
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.uid != ::getuid()) {
      refuse(p,
             Error(ErrorCode::kAuth, fmt::format("shm peer pid {} runs as uid {}, this process as "
                                                 "uid {}: shared memory is only for the same user",
                                                 cred.pid, cred.uid, ::getuid())),
             true);
      return;
    }
    on_readable(p);
  }

  void arm_read(const std::shared_ptr<Pending>& p) {
    auto self = shared_from_this();
    p->sock->async_wait(Descriptor::wait_read, [self, p](const boost::system::error_code& ec) {
      if (ec || p->done || self->closed_) return;
      self->on_readable(p);
    });
  }

  void on_readable(const std::shared_ptr<Pending>& p) {
    auto r = try_receive(p->sock->native_handle());
    if (!r) {
      if (r.error().code() == ErrorCode::kTimeout) {
        arm_read(p);
        return;
      }
      refuse(p, r.error(), false);
      return;
    }
    if (r->closed) {
      close_fds(r->fds);
      refuse(p, Error(ErrorCode::kClosed, "peer closed the shm socket during the handshake"), false);
      return;
    }
    if (!p->got_hello) {
      close_fds(r->fds);
      auto hello = handshake::decode_hello(r->bytes);
      if (!hello) {
        refuse(p, hello.error(), true);
        return;
      }
      handshake::Expectations expect;
      expect.kind = Kind::kShm;
      expect.num_channels = core_->options.num_channels;
      expect.auth_token = core_->options.auth_token;
      expect.self_role = self_.role;
      if (Status s = handshake::check_hello(*hello, expect); !s) {
        refuse(p, s.error(), true);
        return;
      }
      auto local = core_->make_local(core_->options.num_channels);
      if (!local) {
        refuse(p, local.error(), true);
        return;
      }
      p->local = std::move(*local);
      p->hello = std::move(*hello);
      p->got_hello = true;
      handshake::Reply reply;
      reply.role = self_.role;
      reply.rank = self_.rank;
      reply.num_channels = core_->options.num_channels;
      const auto deadline = Clock::now() + core_->options.connect_timeout;
      const int fd = p->sock->native_handle();
      Status s = send_message(fd, handshake::encode(reply), {}, deadline);
      if (s) {
        s = send_message(fd, encode_setup(core_->local_setup_info(core_->options.num_channels)),
                         core_->local_setup_fds(p->local), deadline);
      }
      if (!s) {
        refuse(p, s.error(), false);
        return;
      }
      arm_read(p);
      return;
    }
    // The peer's setup.
    auto setup = decode_setup(r->bytes, r->fds.size(), core_->options.num_channels);
    if (!setup) {
      close_fds(r->fds);
      refuse(p, setup.error(), false);
      return;
    }
    auto peer = attach_peer(*setup, std::move(r->fds));
    if (!peer) {
      refuse(p, peer.error(), false);
      return;
    }
    p->done = true;
    if (p->timer) p->timer->cancel();
    p->timer.reset();
    const int fd = p->sock->release();
    p->sock.reset();
    const std::shared_ptr<Pending> keep = p;
    std::erase(pending_, keep);
    PeerInfo info;
    info.role = p->hello.role;
    info.rank = p->hello.rank;
    info.num_channels = p->hello.num_channels;
    info.address = address_;
    auto conn = std::make_shared<ShmConnection>(core_, info, handlers_, fd);
    if (Status st = conn->init(std::move(p->local), std::move(*peer)); !st) {
      conn->suppress_on_closed();
      conn->fail(st.error());
      return;
    }
    core_->add_connection(conn);
    shm_log()->info("shm listener {}: {} {} connected with {} channel(s)", address_,
                    role_name(info.role), info.rank, info.num_channels);
    if (on_accept_) on_accept_(conn);
    conn->start();
  }

  void refuse(const std::shared_ptr<Pending>& p, const Error& why, bool reply) {
    if (p->done) return;
    refused_.fetch_add(1);
    if (refusal_log_) {
      refusal_log_->log(ctx_, spdlog::level::warn, fmt::format("refused a peer: {}", why.to_string()));
    }
    if (reply && p->sock) {
      handshake::Reply r;
      r.status = why.code();
      r.role = self_.role;
      r.rank = self_.rank;
      r.num_channels = core_->options.num_channels;
      r.text = why.message();
      auto bytes = handshake::encode(r);
      (void)::send(p->sock->native_handle(), bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    drop(p);
  }

  void drop(const std::shared_ptr<Pending>& p) {
    p->done = true;
    boost::system::error_code ec;
    if (p->timer) p->timer->cancel();
    p->timer.reset();
    if (p->sock) p->sock->close(ec);
    p->sock.reset();
    for (auto& r : p->local) {
      if (r.tx_fd >= 0) ::close(r.tx_fd);
      if (r.doorbell_fd >= 0) ::close(r.doorbell_fd);
    }
    p->local.clear();
    const std::shared_ptr<Pending> keep = p;
    std::erase(pending_, keep);
  }

  std::shared_ptr<Core> core_;
  asio::io_context& ctx_;
  LocalIdentity self_;
  AcceptHandler on_accept_;
  Handlers handlers_;
  std::unique_ptr<Descriptor> acceptor_;
  std::string address_;
  std::vector<std::shared_ptr<Pending>> pending_;
  std::atomic<std::uint64_t> refused_{0};
  bool closed_ = false;
  std::optional<AcceptPacer> accept_pacer_;  // set by open(); then I/O thread only
  std::optional<RefusalLog> refusal_log_;    // likewise
};

// ---------------------------------------------------------------------------
class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(std::shared_ptr<Core> core) : core_(std::move(core)) {}
  ~ShmTransport() override {
    EMBER_CHECK_MSG(!core_->io->on_io_thread(), "a Transport must not be destroyed on its I/O thread");
    core_->quarantine->stop();
    core_->shut_down();
    core_->io->join_when_idle();
    // No I/O thread runs any more: what peers still hold goes back now.
    core_->quarantine->release_all();
  }

  Kind kind() const noexcept override { return Kind::kShm; }
  const Options& options() const noexcept override { return core_->options; }

  Result<std::uint32_t> register_memory(const Region& region) override {
    if (region.base == nullptr || region.length_bytes == 0 || region.fd < 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "register_memory: an shm region needs a base, a non-zero length and the "
                        "memfd that is mapped at base");
    }
    if (region.length_bytes % kSmallPageBytes != 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "register_memory: region length {} is not a multiple of 4 KiB",
                        region.length_bytes);
    }
    core_->regions.push_back(region);
    return static_cast<std::uint32_t>(core_->regions.size() - 1);
  }

  Result<std::unique_ptr<Listener>> listen(const std::string& address, LocalIdentity self,
                                           AcceptHandler on_accept, Handlers handlers) override {
    EMBER_TRY(require_handlers(handlers, "listen"));
    auto lc = std::make_shared<ListenerCore>(core_, core_->io->context(0), self,
                                             std::move(on_accept), std::move(handlers));
    EMBER_TRY(lc->open(address));
    core_->add_listener_closer([lc] { lc->close(); });
    lc->start();
    return std::unique_ptr<Listener>(new ListenerHandle<ListenerCore>(lc));
  }

  // Races ~ShmTransport safely once begin_connect() ran: from there on only
  // `core` is used (never this object, which ~ShmTransport may free as soon
  // as `in_progress` ends), and ~ShmTransport cancels the handshake's waits
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
    EMBER_ASSIGN_OR_RETURN(auto sa, make_address(address));
    const Options& o = core->options;
    const int cancel_fd = in_progress.cancel_fd();
    const auto deadline = Clock::now() + o.connect_timeout;
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return make_sys_error(errno, "socket(AF_UNIX)");
    auto fail = [&](Error e) -> Result<std::shared_ptr<Connection>> {
      ::close(fd);
      e.with_context(fmt::format("while connecting to shm listener {}", address));
      return tl::unexpected<Error>(std::move(e));
    };
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa.first), sa.second) != 0 && errno != EINPROGRESS) {
      return fail(Error(ErrorCode::kIo, "connect failed (is the server running on this host? shm finds a "
                                            "server by the exact host:port text it listens on: "
                                            "'localhost:7000' and '127.0.0.1:7000' are two names)", errno));
    }
    if (auto s = stream_io::wait_ready(fd, POLLOUT, deadline, "shm connect", cancel_fd); !s) return fail(s.error());
    handshake::Hello hello;
    hello.role = self.role;
    hello.kind = Kind::kShm;
    hello.rank = self.rank;
    hello.num_channels = o.num_channels;
    hello.max_message_bytes = o.max_message_bytes;
    hello.token = o.auth_token;
    if (auto s = send_message(fd, handshake::encode(hello), {}, deadline, cancel_fd); !s) return fail(s.error());
    auto raw = receive_message(fd, deadline, cancel_fd);
    if (!raw) return fail(raw.error());
    close_fds(raw->fds);
    if (raw->closed) return fail(Error(ErrorCode::kClosed, "the listener closed the socket"));
    auto reply = handshake::decode_reply(raw->bytes);
    if (!reply) return fail(reply.error());
    if (reply->status != ErrorCode::kOk) {
      ::close(fd);
      return tl::unexpected<Error>(
          Error(reply->status, fmt::format("{} refused the connection: {}", address, reply->text)));
    }
    if (reply->version != kProtocolVersion) {
      return fail(Error(ErrorCode::kVersionMismatch,
                        fmt::format("protocol version mismatch: this side speaks version {}, {} "
                                    "speaks version {}; run the same Ember release on both sides",
                                    kProtocolVersion, address, reply->version)));
    }
    auto setup_msg = receive_message(fd, deadline, cancel_fd);
    if (!setup_msg) return fail(setup_msg.error());
    if (setup_msg->closed) return fail(Error(ErrorCode::kClosed, "the listener closed the socket"));
    auto setup = decode_setup(setup_msg->bytes, setup_msg->fds.size(), o.num_channels);
    if (!setup) {
      close_fds(setup_msg->fds);
      return fail(setup.error());
    }
    auto peer = attach_peer(*setup, std::move(setup_msg->fds));
    if (!peer) return fail(peer.error());
    auto local = core->make_local(o.num_channels);
    if (!local) {
      close_fds(peer->doorbells);
      return fail(local.error());
    }
    if (auto s = send_message(fd, encode_setup(core->local_setup_info(o.num_channels)),
                              core->local_setup_fds(*local), deadline, cancel_fd);
        !s) {
      close_fds(peer->doorbells);
      for (auto& r : *local) {
        ::close(r.tx_fd);
        ::close(r.doorbell_fd);
      }
      return fail(s.error());
    }
    PeerInfo info;
    info.role = reply->role;
    info.rank = reply->rank;
    info.num_channels = o.num_channels;
    info.address = address;
    auto conn = std::make_shared<ShmConnection>(core, info, std::move(handlers), fd);
    if (Status st = conn->init(std::move(*local), std::move(*peer)); !st) {
      conn->suppress_on_closed();
      conn->fail(st.error());
      return tl::unexpected<Error>(st.error());
    }
    // Failed at once (kCancelled) when ~ShmTransport began meanwhile.
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

Result<std::unique_ptr<Transport>> create_shm_transport(Options options) {
  EMBER_CHECK(options.kind == Kind::kShm);
  EMBER_TRY(options.validate());
  auto core = std::make_shared<Core>(std::move(options));
  EMBER_ASSIGN_OR_RETURN(core->io,
                         IoThreads::start(core->options.num_io_threads, core->options.cpu_affinity,
                                                  core->options.busy_poll));
  core->quarantine = std::make_shared<Quarantine>(
      core->io->context(0), std::min<nanoseconds>(core->options.heartbeat_interval, kQuarantinePoll));
  return std::unique_ptr<Transport>(new ShmTransport(std::move(core)));
}

}  // namespace ember::transport::shm
