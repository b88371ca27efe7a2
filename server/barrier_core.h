// BarrierCore: the job-wide barrier, held by shard 0 of server 0.
//
// Every worker sends kBarrier to server 0, numbered in the request's step
// (Worker::barrier counts them per process, from the number the join reply
// gives it); the core replies to all of them once every required rank
// (membership.h: all but the ranks excluded by the shrink policy) has
// arrived, with the barrier's generation number in the reply's step, then
// opens the next generation. A rank that arrives twice in one generation (a
// re-send after a reconnect, before the answer) replaces its earlier request
// when it came on the same or a newer connection (the server gives a rank's
// connections growing ids in the order it admits them).
// A barrier whose number the rank had answered already (a re-send whose
// answer was lost with its connection; the last 17 are kept) is answered
// again at once with its generation, and not counted in the open one. A
// rank's barriers that wait (barrier() called again before the first
// finished) enter the generations in number order, at most 16 per rank
// (more get kInvalidArgument).
// If a missing rank is failed (policy fail, or wait past worker_timeout), the
// waiting ranks get ErrorCode::kWorkerLost and the generation stays open.
// A rank's join on a new connection (on_join) supersedes its older
// connections: their waiting barriers are cancelled and their later ones
// refused (ErrorCode::kCancelled; the server has closed those connections
// before it admits the new one, so the error rarely has anyone to reach),
// so a restarted worker's predecessor cannot complete a barrier after the
// join reply has told the new process which number comes next. Server 0
// therefore answers a join from this core's shard thread, behind whatever
// that shard has queued.
//
// Pure and thread-free like ShardCore; one thread owns it.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
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
  // `rank` joined on `connection_id` (server 0's join reply carries the
  // result): its waiting barriers from older connections get
  // ErrorCode::kCancelled, and barriers that arrive later from those get it
  // too. Returns the number its next barrier carries: one past its last
  // answered one (0 before any), so that a restarted worker goes on
  // numbering where its predecessor stopped. pre: rank < num_workers.
  std::uint64_t on_join(std::uint32_t rank, std::uint64_t connection_id, ReplySink& sink);

  std::uint64_t generation() const noexcept { return generation_; }
  std::uint32_t num_waiting() const noexcept;

 private:
  void settle(ReplySink& sink);

  struct Answered {
    std::uint64_t number = 0;      // the request's step
    std::uint64_t generation = 0;  // the reply's step
  };
  static constexpr std::size_t kMaxWaitingPerRank = 16;
  static constexpr std::size_t kAnsweredKept = kMaxWaitingPerRank + 1;

  Membership membership_;
  // Per rank: its barriers waiting, in number order; the first is in the
  // open generation.
  std::vector<std::deque<Request>> waiting_;
  // Per rank: its last answered barriers (at most kAnsweredKept), oldest
  // first.
  std::vector<std::deque<Answered>> answered_;
  // Per rank: the connection of its newest join (0 before any); barriers
  // from older connections are refused.
  std::vector<std::uint64_t> joined_on_;
  std::uint64_t generation_ = 0;
};

}  // namespace ember::server
