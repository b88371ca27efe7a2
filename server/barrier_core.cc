// Job-wide barrier; see barrier_core.h.
#include "server/barrier_core.h"

#include <algorithm>

#include <fmt/format.h>

#include "common/base/check.h"

namespace ember::server {

namespace {

Error superseded(std::uint32_t rank) {
  return Error(ErrorCode::kCancelled,
               fmt::format("barrier of worker {} came on a connection that a newer join of that "
                           "rank replaced (the worker reconnected or was restarted); only the "
                           "newest connection's barriers count",
                           rank));
}

}  // namespace

BarrierCore::BarrierCore(std::uint32_t num_workers, proto::LossPolicy policy,
                         std::chrono::nanoseconds worker_timeout)
    : membership_(num_workers, policy, worker_timeout),
      waiting_(num_workers),
      answered_(num_workers),
      joined_on_(num_workers, 0) {}

void BarrierCore::on_barrier(const Request& request, TimePoint /*now*/, ReplySink& sink) {
  const std::uint32_t rank = request.header.worker_rank;
  EMBER_CHECK_MSG(rank < waiting_.size(), "rank {} of {}", rank, waiting_.size());
  const std::uint64_t number = request.header.step;
  if (request.to.connection_id < joined_on_[rank]) {
    sink.error(request.to, request.header, superseded(rank));
    return;
  }
  if (number >= proto::kLargestStep) {
    // Kept, it would be the rank's newest answered number: every later join
    // of the rank would get number + 1 (refused by the worker as beyond any
    // run), and at 2^64 - 1 the next number wrapped to 0.
    sink.error(request.to, request.header,
               Error(ErrorCode::kInvalidArgument,
                     fmt::format("barrier number {} of worker {}: barrier numbers stay below {}; "
                                 "the worker's barrier counter is corrupt",
                                 number, rank, proto::kLargestStep)));
    return;
  }
  const auto& answered = answered_[rank];
  if (!answered.empty() && number <= answered.back().number) {
    // Answered already; the answer went with the connection it was sent on.
    // Counted in the open generation, it would release the others one
    // barrier early and leave this rank's next barrier waiting alone.
    const auto it = std::find_if(answered.begin(), answered.end(),
                                 [&](const Answered& a) { return a.number == number; });
    if (it == answered.end()) {
      sink.error(request.to, request.header,
                 Error(ErrorCode::kInvalidArgument,
                       fmt::format("barrier number {} of worker {} is older than the {} it "
                                   "answered last that are kept (the newest is number {}); a "
                                   "barrier is re-sent only while it is recent",
                                   number, rank, answered.size(), answered.back().number)));
      return;
    }
    proto::Header reply = proto::reply_header(request.header);
    reply.step = it->generation;
    sink.reply(request.to, reply, {});
    return;
  }
  // Its barriers waiting, in number order: the first is in the open
  // generation, the others (barrier() called again before one finished)
  // wait for the next ones. A re-send of a waiting one replaces it.
  auto& waiting = waiting_[rank];
  const auto at = std::find_if(waiting.begin(), waiting.end(), [&](const Request& q) {
    return q.header.step >= number;
  });
  if (at != waiting.end() && at->header.step == number) {
    // A re-send of a waiting barrier. Between joined connections the
    // newest join already refused the older ones above; the same or a newer
    // connection replaces it (a rank's connection ids grow in the order they
    // are admitted), an older one is dropped with that connection.
    if (request.to.connection_id >= at->to.connection_id) *at = request;
    return;
  }
  if (waiting.size() >= kMaxWaitingPerRank) {
    sink.error(request.to, request.header,
               Error(ErrorCode::kInvalidArgument,
                     fmt::format("worker {} has {} barriers waiting already; wait for one "
                                 "before calling barrier() again",
                                 rank, waiting.size())));
    return;
  }
  waiting.insert(at, request);
  settle(sink);
}

void BarrierCore::settle(ReplySink& sink) {
  for (;;) {
    bool any = false;
    std::optional<std::uint32_t> failed;
    bool complete = true;
    for (std::uint32_t r = 0; r < waiting_.size(); ++r) {
      if (!waiting_[r].empty()) {
        any = true;
        continue;
      }
      if (membership_.excluded(r)) continue;
      complete = false;
      if (membership_.failed(r) && !failed) failed = r;
    }
    if (!any) return;
    if (complete) {
      for (std::uint32_t r = 0; r < waiting_.size(); ++r) {
        if (waiting_[r].empty()) continue;
        const Request& a = waiting_[r].front();
        proto::Header reply = proto::reply_header(a.header);
        reply.step = generation_;
        sink.reply(a.to, reply, {});
        answered_[r].push_back(Answered{a.header.step, generation_});
        if (answered_[r].size() > kAnsweredKept) answered_[r].pop_front();
        waiting_[r].pop_front();
      }
      ++generation_;
      continue;  // barriers sent ahead may complete the next generation at once
    }
    if (failed) {
      const Error err = membership_.failure_error(*failed, fmt::format("barrier {}", generation_));
      for (auto& waiting : waiting_) {
        for (const Request& q : waiting) sink.error(q.to, q.header, err);
        waiting.clear();
      }
    }
    return;
  }
}

void BarrierCore::on_worker_lost(std::uint32_t rank, TimePoint now, ReplySink& sink,
                                 Departure how) {
  if (rank >= waiting_.size()) return;
  if (membership_.lost(rank, now, how)) settle(sink);
}

void BarrierCore::on_worker_back(std::uint32_t rank) {
  if (rank >= waiting_.size()) return;
  membership_.back(rank);
}

void BarrierCore::on_tick(TimePoint now, ReplySink& sink) {
  if (membership_.tick(now)) settle(sink);
}

void BarrierCore::drop_connection(std::uint64_t connection_id) {
  for (auto& waiting : waiting_) {
    std::erase_if(waiting, [&](const Request& q) { return q.to.connection_id == connection_id; });
  }
}

std::uint64_t BarrierCore::on_join(std::uint32_t rank, std::uint64_t connection_id,
                                   ReplySink& sink) {
  EMBER_CHECK_MSG(rank < waiting_.size(), "rank {} of {}", rank, waiting_.size());
  joined_on_[rank] = std::max(joined_on_[rank], connection_id);
  // Removing waiting barriers completes no generation: nothing to settle.
  std::erase_if(waiting_[rank], [&](const Request& q) {
    if (q.to.connection_id >= joined_on_[rank]) return false;
    sink.error(q.to, q.header, superseded(rank));
    return true;
  });
  const auto& answered = answered_[rank];
  return answered.empty() ? 0 : answered.back().number + 1;
}

std::uint32_t BarrierCore::num_waiting() const noexcept {
  std::uint32_t n = 0;
  for (const auto& w : waiting_) n += w.empty() ? 0 : 1;
  return n;
}

}  // namespace ember::server
