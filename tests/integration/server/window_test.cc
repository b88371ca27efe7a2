// A pull over shm whose reply the server writes in place (a pool block
// destination above batch_threshold) goes through a write window: once the
// worker gave up on the pull (request_timeout), a late reply must write
// nothing into the destination, which the caller owns again.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/integration/server/harness.h"
#include "tests/integration/server/workers.h"
#include "worker/worker.h"

namespace ember::test {
namespace {

TEST(WriteWindow, ATimedOutInPlacePullIsNotWrittenByItsLateReply) {
  TempDir dir;
  ClusterSpec spec;
  spec.transport = "shm";
  spec.num_workers = 2;  // bsp: rank 0's pull of step 1 parks until rank 1 pushes step 0
  spec.learning_rate = 0.5;
  // The timeout covers every request of this test, set-up included: long
  // enough that a server descheduled for a while on a loaded machine does
  // not time out the inits (and above heartbeat_timeout, 2 s, which ends a
  // longer stall anyway).
  spec.request_timeout = "3s";
  spec.worker_timeout = "60s";
  ServerProcess server(dir, spec, 0);
  ASSERT_TRUE(server.ok());
  auto workers = make_workers(spec, {server.address()}, {"worker.resend_attempts=0"});
  ASSERT_TRUE(workers[0] && workers[1]);
  Worker& w0 = *workers[0];
  Worker& w1 = *workers[1];
  const std::uint64_t n = 256 * 1024;  // 1 MiB: far above batch_threshold, so in place
  const std::uint64_t shape[] = {n};
  std::vector<float> init(n, 1.0f), grad(n, 1.0f);
  ASSERT_TRUE(w0.init(7, shape, init).wait());
  ASSERT_TRUE(w1.init(7, shape, {}).wait());

  // Rank 0 pushes step 0 (answered when the round completes) and pulls step
  // 1 into a pool block: the pull parks (rank 1 has not pushed) and both
  // time out.
  Handle push0 = w0.push(7, grad);
  TensorBuffer dest = w0.allocate(n * sizeof(float));
  ASSERT_EQ(dest.floats().size(), n);
  auto late = w0.pull(7, dest.floats(), 1).wait();
  ASSERT_FALSE(late);
  EXPECT_EQ(late.error().code(), ErrorCode::kTimeout) << late.error().to_string();
  EXPECT_FALSE(push0.wait());
  // The caller owns the block again and fills it with its own data.
  std::fill(dest.floats().begin(), dest.floats().end(), 42.0f);

  // Rank 1 completes the round: the server answers the parked pull of rank
  // 0 now. Its in-place write must find the window closed.
  ASSERT_TRUE(w1.push(7, grad).wait());
  std::vector<float> fresh(n);
  ASSERT_TRUE(w1.pull(7, fresh, 1).wait());
  EXPECT_EQ(fresh[0], 0.5f);  // 1 - 0.5 * mean(1, 1)
  // A later request of rank 0 on the same key is handled by the same shard
  // after that answer: by then the late write was tried (and refused).
  TensorBuffer again = w0.allocate(n * sizeof(float));
  auto ok = w0.pull(7, again.floats(), 1).wait();
  ASSERT_TRUE(ok) << ok.error().to_string();
  EXPECT_EQ(again.floats()[0], 0.5f);
  for (std::uint64_t i = 0; i < n; i += 4096) {
    ASSERT_EQ(dest.floats()[i], 42.0f) << "element " << i << " was written after the timeout";
  }
  EXPECT_EQ(dest.floats()[n - 1], 42.0f);
  // And the server counted in-place replies for the good pulls only.
  const std::string text = http_get(server.metrics_address(), "/metrics");
  EXPECT_GE(metric_value(text, "ember_server_replies_in_place_total"), 1) << text;
}

}  // namespace
}  // namespace ember::test
