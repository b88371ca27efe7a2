// Attacks on the shm write windows (commit 02b3f55) in one process: writer
// threads on the server side hammer write_peer_memory through window ids
// while owner threads on the worker side open, close and reopen windows on
// the same entries. Once close_write_window returned, nothing may land in the
// destination, whatever id a stalled writer still holds (the old id, or the
// entry reopened under a new generation). Run under TSan too: the writers'
// copies and the owner's reuse of the memory must be ordered by the window.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/transport/transport.h"
#include "tests/unit/transport/transport_test_util.h"

namespace ember::transport {
namespace {

using namespace std::chrono_literals;
using testing::Inbox;
using testing::MemfdRegion;

Options shm_options() {
  Options o;
  o.kind = Kind::kShm;
  o.num_channels = 2;
  o.num_io_threads = 2;
  // Liveness is not under test: 60 s, so that spinning writers beside a
  // TSan build on 2 loaded cores cannot starve a heartbeat into a close.
  o.heartbeat_interval = 200ms;
  o.heartbeat_timeout = 60s;
  return o;
}

TEST(ShmWriteWindowRace, NoWriteLandsAfterCloseReturnsWhileWritersRace) {
  Inbox server_in, client_in;  // before the transports
  auto server_tx = Transport::create(shm_options());
  ASSERT_TRUE(server_tx) << server_tx.error().to_string();
  auto client_tx = Transport::create(shm_options());
  ASSERT_TRUE(client_tx) << client_tx.error().to_string();
  constexpr std::size_t kSlots = 8, kSlotBytes = 4096;
  MemfdRegion client_mem(kSlots * kSlotBytes);
  auto cid = client_tx.value()->register_memory(client_mem.region());
  ASSERT_TRUE(cid);
  const std::string addr = "@ember-window-race-" + std::to_string(::getpid());
  auto listener =
      server_tx.value()->listen(addr, {Role::kServer, 0}, server_in.acceptor(), server_in.handlers());
  ASSERT_TRUE(listener) << listener.error().to_string();
  auto conn =
      client_tx.value()->connect((*listener)->address(), {Role::kWorker, 1}, client_in.handlers());
  ASSERT_TRUE(conn) << conn.error().to_string();
  ASSERT_TRUE(server_in.wait_accepted(1));
  auto server_conn = server_in.accepted_at(0);
  auto* base = static_cast<std::byte*>(client_mem.region().base);

  // Per slot: the id writers use (a stale one after a close, on purpose),
  // and how many writes through it succeeded.
  struct Slot {
    std::atomic<std::uint32_t> id{0};
    std::atomic<std::uint64_t> written{0};
    std::atomic<std::uint64_t> tries{0};
  };
  std::vector<Slot> slots(kSlots);
  std::atomic<bool> stop{false};
  std::atomic<int> late_writes{0};
  std::atomic<int> bad_results{0};

  std::vector<std::thread> writers;
  for (int t = 0; t < 3; ++t) {
    writers.emplace_back([&, t] {
      std::vector<std::byte> data(kSlotBytes, std::byte{0xAB});
      // Each slot has one writer thread (two pulls into one destination at
      // once would be the caller's race, and TSan's report).
      std::size_t s = static_cast<std::size_t>(t);
      while (!stop.load()) {
        s += 3;
        if (s >= kSlots) s = static_cast<std::size_t>(t);
        const std::uint32_t id = slots[s].id.load();
        if (id == 0) continue;
        Status st = server_conn->write_peer_memory(*cid, s * kSlotBytes, data,
                                                   Connection::PeerCopy::kCached, id);
        slots[s].tries.fetch_add(1);
        if (st) {
          slots[s].written.fetch_add(1);
        } else if (st.error().code() != ErrorCode::kClosed) {
          bad_results.fetch_add(1);
        }
      }
    });
  }

  // Owners: two threads, four slots each, open → publish → wait for a
  // successful write → close → reuse the memory (fill 0) → check that the
  // writers, still holding the closed id, write nothing → reopen.
  constexpr int kRounds = 300;
  std::vector<std::thread> owners;
  std::atomic<int> stuck{0};
  for (int o = 0; o < 2; ++o) {
    owners.emplace_back([&, o] {
      for (int round = 0; round < kRounds; ++round) {
        for (std::size_t s = static_cast<std::size_t>(o) * 4; s < static_cast<std::size_t>(o) * 4 + 4;
             ++s) {
          auto id = (*conn)->open_write_window();
          if (!id) {
            stuck.fetch_add(1);
            return;
          }
          const std::uint64_t before = slots[s].written.load();
          slots[s].id.store(*id);
          // "Stuck" only well past any scheduling delay (TSan, 2 loaded cores).
          const auto deadline = std::chrono::steady_clock::now() + 20s;
          while (slots[s].written.load() == before) {
            if (std::chrono::steady_clock::now() > deadline) {
              stuck.fetch_add(1);
              return;
            }
            std::this_thread::yield();
          }
          (*conn)->close_write_window(*id);  // the id stays published: stale writes follow
          std::memset(base + s * kSlotBytes, 0, kSlotBytes);
          const std::uint64_t tries = slots[s].tries.load();
          const auto until = std::chrono::steady_clock::now() + 5s;
          while (slots[s].tries.load() < tries + 20 && std::chrono::steady_clock::now() < until) {
            std::this_thread::yield();
          }
          for (std::size_t i = 0; i < kSlotBytes; i += 512) {
            if (base[s * kSlotBytes + i] != std::byte{0}) {
              late_writes.fetch_add(1);
              break;
            }
          }
        }
      }
    });
  }
  for (auto& t : owners) t.join();
  stop.store(true);
  for (auto& t : writers) t.join();
  EXPECT_EQ(stuck.load(), 0) << "an owner found no window free, or no write went through";
  EXPECT_EQ(late_writes.load(), 0) << "a write landed after close_write_window returned";
  EXPECT_EQ(bad_results.load(), 0) << "a write failed with another code than kClosed";
  std::uint64_t total = 0;
  for (auto& s : slots) total += s.written.load();
  EXPECT_GE(total, std::uint64_t{2} * kRounds * 4);
  // Every window was closed: all 4096 can be opened again.
  std::vector<std::uint32_t> open;
  for (;;) {
    auto w = (*conn)->open_write_window();
    if (!w) break;
    open.push_back(*w);
  }
  EXPECT_EQ(open.size(), 4096u);
  for (std::uint32_t id : open) (*conn)->close_write_window(id);
}

}  // namespace
}  // namespace ember::transport
