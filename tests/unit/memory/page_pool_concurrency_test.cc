// Concurrent allocate/free, cross-thread frees, thread exit and pool lifetime
// against the per-thread caches. Run under the tsan preset as well.
#include <atomic>
#include <barrier>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/memory/page_pool.h"

namespace ember::memory {
namespace {

std::uint64_t test_seed() {
  if (const char* env = std::getenv("EMBER_TEST_SEED")) return std::strtoull(env, nullptr, 10);
  return std::random_device{}();
}

struct Mailbox {
  std::mutex mu;
  std::vector<Block> blocks;
};

// Each block carries the same 8-byte token at its first and last 8 bytes of
// capacity; a block handed out twice, or overlapping another, breaks a pair.
void stamp(const Block& b, std::uint64_t token) {
  std::memcpy(b.data(), &token, 8);
  std::memcpy(b.data() + b.capacity_bytes() - 8, &token, 8);
}
bool stamp_intact(const Block& b) {
  std::uint64_t head = 0, tail = 0;
  std::memcpy(&head, b.data(), 8);
  std::memcpy(&tail, b.data() + b.capacity_bytes() - 8, 8);
  return head == tail && head != 0;
}

class ConcurrentPool : public ::testing::TestWithParam<bool> {};

TEST_P(ConcurrentPool, AllocFreeAcrossThreadsKeepsBlocksDisjoint) {
  const bool thread_cache = GetParam();
  const std::uint64_t seed = test_seed();
  std::cout << "seed " << seed << " (replay with EMBER_TEST_SEED=" << seed << ")\n";
  PoolOptions o;
  o.prealloc_pages = 24;  // 48 MiB: small enough that exhaustion happens now and then
  o.thread_cache = thread_cache;
  o.name = thread_cache ? "concurrent-cached" : "concurrent-uncached";
  auto created = PagePool::create(o);
  ASSERT_TRUE(created.has_value()) << created.error().to_string();
  PagePool& pool = **created;

  constexpr int kThreads = 4;
  constexpr int kOpsPerThread = 40000;
  std::vector<Mailbox> mailboxes(kThreads);
  const std::size_t num_slots = pool.length_bytes() / kMinBlockBytes;
  std::unique_ptr<std::atomic<std::uint8_t>[]> owned(new std::atomic<std::uint8_t>[num_slots]());
  std::atomic<std::uint64_t> failures{0};
  std::atomic<std::uint64_t> exhausted{0};
  std::atomic<std::uint64_t> cross_frees{0};
  std::atomic<bool> running{true};
  std::barrier phase(kThreads);

  auto fail = [&](const std::string& what) {
    if (failures.fetch_add(1) < 5) ADD_FAILURE() << what;
  };
  auto check_out = [&](const Block& b) {
    if (reinterpret_cast<std::uintptr_t>(b.data()) % kBlockAlignBytes != 0 ||
        b.data() != pool.base() + b.offset_bytes() ||
        b.offset_bytes() + b.capacity_bytes() > pool.length_bytes()) {
      fail("misplaced block at offset " + std::to_string(b.offset_bytes()));
      return false;
    }
    if (owned[b.offset_bytes() / kMinBlockBytes].exchange(1) != 0) {
      fail("block at offset " + std::to_string(b.offset_bytes()) + " handed out twice");
      return false;
    }
    return true;
  };
  auto give_back = [&](const Block& b) {
    if (!stamp_intact(b)) fail("block at offset " + std::to_string(b.offset_bytes()) +
                               " was overwritten while in use");
    if (owned[b.offset_bytes() / kMinBlockBytes].exchange(0) != 1) {
      fail("block at offset " + std::to_string(b.offset_bytes()) + " freed but not owned");
    }
    pool.free(b);
  };

  auto worker = [&](int me) {
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(me));
    std::vector<Block> local;
    std::uint64_t counter = 0;
    for (int op = 0; op < kOpsPerThread; ++op) {
      const auto r = rng();
      if ((r & 1) == 0 && local.size() < 32) {
        // Mostly small classes; 1 MiB and 4 MiB now and then.
        const unsigned pick = static_cast<unsigned>((r >> 8) % 100);
        const std::size_t size_class = pick < 40 ? 0 : pick < 65 ? 1 : pick < 80 ? 2
                                     : pick < 92 ? 3 : pick < 98 ? 4 : 5;
        const std::size_t lo = size_class == 0 ? 16 : size_class_bytes(size_class - 1) + 1;
        const std::size_t bytes = lo + (r >> 20) % (size_class_bytes(size_class) - lo + 1);
        auto b = pool.allocate(bytes);
        if (!b) {
          if (b.error().code() != ErrorCode::kPoolExhausted) fail(b.error().to_string());
          exhausted.fetch_add(1, std::memory_order_relaxed);
          if (!local.empty()) {
            give_back(local.back());
            local.pop_back();
          }
          continue;
        }
        if (b->size_class() != size_class || b->size_bytes() != bytes) {
          fail("wrong class for " + std::to_string(bytes));
        }
        if (!check_out(*b)) continue;
        stamp(*b, (static_cast<std::uint64_t>(me + 1) << 48) | ++counter);
        bool sent = false;
        if ((r >> 40) % 2 == 0) {
          // Bounded mailboxes: a descheduled receiver must not make the
          // others pile up blocks (that would only test exhaustion).
          const int to = static_cast<int>((r >> 44) % kThreads);
          std::lock_guard<std::mutex> lock(mailboxes[to].mu);
          if (mailboxes[to].blocks.size() < 32) {
            mailboxes[to].blocks.push_back(*b);
            sent = true;
          }
        }
        if (!sent) local.push_back(*b);
      } else {
        std::vector<Block> received;
        {
          std::lock_guard<std::mutex> lock(mailboxes[me].mu);
          received.swap(mailboxes[me].blocks);
        }
        cross_frees.fetch_add(received.size(), std::memory_order_relaxed);
        for (const Block& b : received) give_back(b);
        if (!local.empty()) {
          give_back(local.back());
          local.pop_back();
        }
      }
    }
    phase.arrive_and_wait();  // nobody sends after this point
    for (const Block& b : local) give_back(b);
    std::lock_guard<std::mutex> lock(mailboxes[me].mu);
    for (const Block& b : mailboxes[me].blocks) give_back(b);
    mailboxes[me].blocks.clear();
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  std::thread observer([&] {  // stats() while the pool is busy
    while (running.load()) {
      const PoolStats s = pool.stats();
      if (s.carved_bytes > pool.length_bytes()) fail("carved past the region");
      std::this_thread::yield();
    }
  });
  for (auto& t : threads) t.join();
  running.store(false);
  observer.join();

  EXPECT_EQ(failures.load(), 0u);
  EXPECT_GT(cross_frees.load(), 0u) << "the test must free blocks on other threads";
  const PoolStats s = pool.stats();
  for (std::size_t c = 0; c < kNumSizeClasses; ++c) {
    const auto& cls = s.classes[c];
    EXPECT_EQ(cls.blocks_in_use, 0u) << "class " << c;
    EXPECT_EQ(cls.blocks_cached, 0u) << "class " << c << ": exited threads keep no cache";
    EXPECT_EQ(cls.blocks_free, cls.blocks_carved) << "class " << c;
  }
  std::cout << "exhausted " << exhausted.load() << " times, " << cross_frees.load()
            << " cross-thread frees, carved " << s.carved_bytes << " bytes\n";
}

INSTANTIATE_TEST_SUITE_P(PagePool, ConcurrentPool, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "Cached" : "Uncached"; });

// A worker thread that runs closures on request, so a test can interleave
// what it does with what the main thread does.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    run([this] { stop_ = true; });
    thread_.join();
  }
  void run(std::function<void()> fn) {
    std::unique_lock<std::mutex> lock(mu_);
    job_ = std::move(fn);
    cv_.notify_all();
    ASSERT_TRUE(cv_.wait_for(lock, std::chrono::seconds(20), [&] { return !job_; }));
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait(lock, [&] { return static_cast<bool>(job_); });
      job_();
      job_ = nullptr;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool stop_ = false;
  std::thread thread_;
};

TEST(PagePool, ThreadOutlivesThePoolsItUsed) {
  Worker worker;
  for (int round = 0; round < 5; ++round) {
    PoolOptions o;
    o.prealloc_pages = 1;
    o.name = "short-lived";
    auto pool = PagePool::create(o);
    ASSERT_TRUE(pool.has_value());
    PagePool* p = pool->get();
    worker.run([p] {
      for (int i = 0; i < 100; ++i) {
        auto b = p->allocate(4096);
        ASSERT_TRUE(b.has_value());
        p->free(*b);
      }
    });
    EXPECT_EQ((*pool)->stats().classes[0].blocks_in_use, 0u);
    EXPECT_GT((*pool)->stats().classes[0].blocks_cached, 0u) << "the worker's cache holds some";
    pool->reset();  // the worker's cache for it is deleted; its TLS entry goes stale
  }
  // The worker exits in ~Worker with stale entries only: nothing to flush.
}

TEST(PagePool, ThreadUsingManyPoolsFallsBackToUncachedCalls) {
  std::vector<std::unique_ptr<PagePool>> pools;
  for (int i = 0; i < 40; ++i) {
    PoolOptions o;
    o.prealloc_pages = 1;
    o.prefault = false;
    o.name = "many-" + std::to_string(i);
    auto p = PagePool::create(o);
    ASSERT_TRUE(p.has_value()) << p.error().to_string();
    pools.push_back(std::move(*p));
  }
  std::thread t([&] {
    for (int round = 0; round < 3; ++round) {
      for (auto& p : pools) {
        auto b = p->allocate(5000);
        ASSERT_TRUE(b.has_value()) << b.error().to_string();
        p->free(*b);
      }
    }
  });
  t.join();
  for (auto& p : pools) {
    const auto s = p->stats();
    EXPECT_EQ(s.classes[1].blocks_in_use, 0u) << p->name();
    EXPECT_EQ(s.classes[1].blocks_cached, 0u) << p->name();
    EXPECT_EQ(s.classes[1].blocks_free, s.classes[1].blocks_carved) << p->name();
  }
}

}  // namespace
}  // namespace ember::memory
