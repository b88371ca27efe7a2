// proto::effective_busy_poll and transport_options' busy_poll: polling only
// when every polling thread can have a CPU of its own.
#include <gtest/gtest.h>

#include <chrono>

#include "common/proto/runtime.h"

namespace ember::proto {
namespace {

using namespace std::chrono_literals;

TEST(EffectiveBusyPollTest, KeptWhenTheCpusSufficeForIoAndComputingThreads) {
  // 2 CPUs: 1 I/O thread + 1 shard thread (an unpinned server on 2 cores).
  EXPECT_EQ(effective_busy_poll(1ms, 1, false, 1, 2), 1ms);
  EXPECT_EQ(effective_busy_poll(200us, 2, false, 2, 8), 200us);
}

TEST(EffectiveBusyPollTest, OffWhenAPollingThreadWouldShareACpuWithWork) {
  // A worker pinned to one core (taskset -c 0): its I/O thread and its
  // training thread share it.
  EXPECT_EQ(effective_busy_poll(1ms, 1, false, 1, 1), 0ns);
  // 2 CPUs, 2 I/O threads and a training thread.
  EXPECT_EQ(effective_busy_poll(1ms, 2, false, 1, 2), 0ns);
}

TEST(EffectiveBusyPollTest, PinnedIoThreadsOrUnknownMasksKeepTheConfiguredValue) {
  EXPECT_EQ(effective_busy_poll(1ms, 1, true, 1, 1), 1ms);   // the operator chose the CPUs
  EXPECT_EQ(effective_busy_poll(1ms, 1, false, 1, 0), 1ms);  // mask unknown: no limit
  EXPECT_EQ(effective_busy_poll(0ns, 1, false, 1, 64), 0ns);  // off stays off
}

TEST(TransportOptionsBusyPoll, FollowsThisProcessAffinityMask) {
  config::Config cfg;
  cfg.communication.busy_poll = 1ms;
  const std::uint32_t cpus = allowed_cpu_count();
  ASSERT_GT(cpus, 0u);
  // Computing threads that fit beside the I/O thread: kept.
  auto fits = transport_options(cfg, cpus - 1);
  ASSERT_TRUE(fits) << fits.error().to_string();
  EXPECT_EQ(fits->busy_poll, 1ms);
  // One more than the CPUs allow: off.
  auto over = transport_options(cfg, cpus);
  ASSERT_TRUE(over) << over.error().to_string();
  EXPECT_EQ(over->busy_poll, 0ns);
  // Pinned I/O threads keep polling whatever the count.
  cfg.communication.cpu_affinity = {0};
  auto pinned = transport_options(cfg, cpus + 4);
  ASSERT_TRUE(pinned) << pinned.error().to_string();
  EXPECT_EQ(pinned->busy_poll, 1ms);
}

}  // namespace
}  // namespace ember::proto
