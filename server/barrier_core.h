// BarrierCore: the job-wide barrier, held by shard 0 of server 0.
//
// Every worker sends kBarrier to server 0; the core replies to all of them
// once every required rank (membership.h: all but the ranks excluded by the
// shrink policy) has arrived, with the barrier's generation number in the
// reply's step, then opens the next generation. A rank that arrives twice in
// one generation (a re-send after a reconnect) replaces its earlier request.
// If a missing rank is failed (policy fail, or wait past worker_timeout), the
// waiting ranks get ErrorCode::kWorkerLost and the generation stays open.
//
// Pure and thread-free like ShardCore; one thread owns it.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "server/membership.h"
#include "server/shard_core.h"

namespace ember::server {

class BarrierCore {
 public:
  BarrierCore(std::uint32_t num_workers, proto::LossPolicy policy,
              std::chrono::nanoseconds worker_timeout);

  // pre: request.header.worker_rank < num_workers.
  void on_barrier(const Request& request, TimePoint now, ReplySink& sink);
  void on_worker_lost(std::uint32_t rank, TimePoint now, ReplySink& sink,
                      Departure how = Departure::kLost);
  void on_worker_back(std::uint32_t rank);
  void on_tick(TimePoint now, ReplySink& sink);
  std::optional<TimePoint> next_deadline() const { return membership_.next_deadline(); }
  void drop_connection(std::uint64_t connection_id);

  std::uint64_t generation() const noexcept { return generation_; }
  std::uint32_t num_waiting() const noexcept;

 private:
  void settle(ReplySink& sink);

  Membership membership_;
  std::vector<std::optional<Request>> arrived_;
  std::uint64_t generation_ = 0;
};

}  // namespace ember::server
