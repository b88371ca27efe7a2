// Helpers for the transport tests: a memfd-backed region that hands out
// Buffers with a MemoryLocation (for sendfile and shm), a deterministic
// payload pattern (so 64 MiB messages are checked without keeping a copy),
// and an Inbox that records what arrived and lets a test wait for it with a
// deadline (never a sleep).
#pragma once

#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/base/check.h"
#include "common/transport/transport.h"
#include "common/wire/wire_format.h"

namespace ember::transport::testing {

using namespace std::chrono_literals;

// The sender's stats before and after a corked burst of `messages` small
// messages of `bytes` each (ACorkedBurstOfSmallMessagesLeavesInFullBatches,
// tcp/shm and rdma): the burst must have left in full 4 KiB batches. One
// early close is allowed per heartbeat sent meanwhile, plus the flush's.
inline void expect_full_batches(const ConnectionStats& before, const ConnectionStats& after,
                                std::uint64_t messages, std::size_t bytes, int round) {
  const std::uint64_t per_batch = (4096 - wire::kHeaderBytes) / (bytes + wire::kItemEntryBytes);
  const std::uint64_t heartbeats = after.heartbeats_sent - before.heartbeats_sent;
  const std::uint64_t frames = after.frames_sent - before.frames_sent - heartbeats;
  EXPECT_LE(frames, messages / per_batch + 1 + heartbeats)
      << "round " << round << ": " << frames << " frames for " << messages << " messages";
}

// Message `index` on `channel` is a sequence of 64-bit words (word k =
// seed * golden + k, little-endian), truncated to its size: cheap to generate
// and check even at 64 MiB in a debug build, and different for every message,
// channel and position.
inline std::uint64_t pattern_word(std::uint32_t channel, std::uint64_t index, std::size_t k) {
  const std::uint64_t seed = (std::uint64_t{channel} << 48) ^ (index << 8) ^ 0x5bd1e995u;
  return seed * 0x9E3779B97F4A7C15ull + k * 0xD6E8FEB86659FD93ull;
}
inline void fill_pattern(std::span<std::byte> out, std::uint32_t channel, std::uint64_t index) {
  const std::size_t words = out.size() / 8;
  std::byte* p = out.data();
  for (std::size_t k = 0; k < words; ++k) {
    const std::uint64_t w = pattern_word(channel, index, k);
    std::memcpy(p + 8 * k, &w, 8);
  }
  const std::uint64_t tail = pattern_word(channel, index, words);
  std::memcpy(p + 8 * words, &tail, out.size() - 8 * words);
}
// Byte offset of the first wrong 8-byte word, or nullopt when all match.
inline std::optional<std::size_t> check_pattern(std::span<const std::byte> in,
                                                std::uint32_t channel, std::uint64_t index) {
  const std::size_t words = in.size() / 8;
  const std::byte* p = in.data();
  for (std::size_t k = 0; k < words; ++k) {
    std::uint64_t w;
    std::memcpy(&w, p + 8 * k, 8);
    if (w != pattern_word(channel, index, k)) return 8 * k;
  }
  const std::uint64_t tail = pattern_word(channel, index, words);
  if (std::memcmp(p + 8 * words, &tail, in.size() - 8 * words) != 0) return 8 * words;
  return std::nullopt;
}

// A memfd mapped at base; Buffers are carved with a bump pointer (4 KiB
// aligned) and counted while alive. The count lives apart from the region
// (shared with each Buffer's owner): a transport's I/O thread may release a
// Buffer after the region is gone (a test that declares the region after
// its transports destroys it first).
class MemfdRegion {
 public:
  explicit MemfdRegion(std::size_t bytes) : bytes_(bytes) {
    fd_ = ::memfd_create("ember-transport-test", MFD_CLOEXEC);
    EMBER_CHECK(fd_ >= 0);
    EMBER_CHECK(::ftruncate(fd_, static_cast<off_t>(bytes)) == 0);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EMBER_CHECK(p != MAP_FAILED);
    base_ = static_cast<std::byte*>(p);
  }
  ~MemfdRegion() {
    ::munmap(base_, bytes_);
    ::close(fd_);
  }
  MemfdRegion(const MemfdRegion&) = delete;
  MemfdRegion& operator=(const MemfdRegion&) = delete;

  Transport::Region region() const { return {base_, bytes_, fd_}; }
  void set_region_id(std::uint32_t id) { region_id_ = id; }

  // A Buffer of `size` bytes; wraps around to the start when the end is
  // reached (tests keep few buffers alive at once).
  Buffer make(std::size_t size) {
    std::lock_guard lock(mu_);
    std::size_t aligned = (size + 4095) / 4096 * 4096;
    if (aligned == 0) aligned = 4096;
    EMBER_CHECK(aligned <= bytes_);
    if (next_ + aligned > bytes_) next_ = 0;
    const std::size_t off = next_;
    next_ += aligned;
    live_->count.fetch_add(1);
    struct Owner {
      std::shared_ptr<Live> live;
      explicit Owner(std::shared_ptr<Live> l) : live(std::move(l)) {}
      Owner(Owner&& o) noexcept = default;
      ~Owner() {
        if (live == nullptr) return;
        std::lock_guard lock(live->mu);
        live->count.fetch_sub(1);
        live->cv.notify_all();
      }
    };
    return Buffer::adopt(std::span<std::byte>(base_ + off, size),
                         MemoryLocation{fd_, off, region_id_}, Owner(live_));
  }
  int live() const { return live_->count.load(); }
  // Waits until every Buffer made here was released.
  bool wait_all_released(std::chrono::milliseconds timeout = 10s) {
    std::unique_lock lock(live_->mu);
    return live_->cv.wait_for(lock, timeout, [&] { return live_->count.load() == 0; });
  }

 private:
  std::size_t bytes_;
  int fd_ = -1;
  std::byte* base_ = nullptr;
  std::uint32_t region_id_ = MemoryLocation::kNoRegion;
  std::mutex mu_;
  std::size_t next_ = 0;
  struct Live {
    std::atomic<int> count{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  std::shared_ptr<Live> live_ = std::make_shared<Live>();
};

// Waits for `pred` (evaluated under `mu`) with a deadline.
template <typename Pred>
bool wait_until(std::mutex& mu, std::condition_variable& cv, std::chrono::milliseconds timeout,
                Pred pred) {
  std::unique_lock lock(mu);
  return cv.wait_for(lock, timeout, pred);
}

// Records what arrives on one side: per channel, the sizes and whether each
// matched the pattern for its index; the close reason.
struct Inbox {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::uint32_t, std::vector<std::size_t>> sizes;   // per channel
  std::map<std::uint32_t, std::vector<bool>> intact;         // per channel
  std::map<std::uint32_t, std::vector<bool>> large;          // per channel
  std::vector<std::shared_ptr<Connection>> accepted;
  std::optional<Error> closed;
  int closed_count = 0;
  bool check_pattern_bytes = true;
  // Called for each message (on the I/O thread) before it is recorded, if set.
  std::function<void(Connection&, Incoming&)> also;

  Handlers handlers() {
    Handlers h;
    h.on_message = [this](Connection& c, Incoming&& m) {
      bool ok = true;
      std::uint64_t index;
      {
        std::lock_guard lock(mu);
        index = sizes[m.channel].size();
      }
      if (check_pattern_bytes) ok = !check_pattern(m.bytes, m.channel, index).has_value();
      const std::size_t size = m.bytes.size();
      const bool is_large = m.is_large();
      // Before recording: a test that saw the count also sees what `also` did.
      if (also) also(c, m);
      {
        std::lock_guard lock(mu);
        sizes[m.channel].push_back(size);
        intact[m.channel].push_back(ok);
        large[m.channel].push_back(is_large);
      }
      cv.notify_all();
    };
    h.on_closed = [this](Connection&, const Error& e) {
      std::lock_guard lock(mu);
      closed = e;
      ++closed_count;
      cv.notify_all();
    };
    return h;
  }
  AcceptHandler acceptor() {
    return [this](std::shared_ptr<Connection> c) {
      std::lock_guard lock(mu);
      accepted.push_back(std::move(c));
      cv.notify_all();
    };
  }
  std::size_t count(std::uint32_t channel) {
    std::lock_guard lock(mu);
    return sizes[channel].size();
  }
  bool wait_count(std::uint32_t channel, std::size_t n, std::chrono::milliseconds timeout = 20s) {
    return wait_until(mu, cv, timeout, [&] { return sizes[channel].size() >= n; });
  }
  bool wait_closed(std::chrono::milliseconds timeout = 20s) {
    return wait_until(mu, cv, timeout, [&] { return closed.has_value(); });
  }
  bool wait_accepted(std::size_t n, std::chrono::milliseconds timeout = 20s) {
    return wait_until(mu, cv, timeout, [&] { return accepted.size() >= n; });
  }
  std::shared_ptr<Connection> accepted_at(std::size_t i) {
    std::lock_guard lock(mu);
    return accepted.at(i);
  }
  std::optional<Error> closed_reason() {
    std::lock_guard lock(mu);
    return closed;
  }
};

}  // namespace ember::transport::testing
