// Job-wide barrier; see barrier_core.h.
#include "server/barrier_core.h"

#include <algorithm>

#include <fmt/format.h>

#include "common/base/check.h"

namespace ember::server {

BarrierCore::BarrierCore(std::uint32_t num_workers, proto::LossPolicy policy,
                         std::chrono::nanoseconds worker_timeout,
                         std::shared_ptr<BarrierNumbers> numbers)
    : membership_(num_workers, policy, worker_timeout),
      arrived_(num_workers),
      later_(num_workers),
      answered_(num_workers),
      numbers_(std::move(numbers)) {
  EMBER_CHECK_MSG(!numbers_ || numbers_->size() == num_workers, "{} numbers for {} workers",
                  numbers_->size(), num_workers);
}

void BarrierCore::on_barrier(const Request& request, TimePoint /*now*/, ReplySink& sink) {
  const std::uint32_t rank = request.header.worker_rank;
  EMBER_CHECK_MSG(rank < arrived_.size(), "rank {} of {}", rank, arrived_.size());
  if (answered_[rank] && answered_[rank]->number == request.header.step) {
    // Answered already; the answer went with the connection it was sent on.
    // Counted in the open generation, it would release the others one
    // barrier early and leave this rank's next barrier waiting alone.
    proto::Header reply = proto::reply_header(request.header);
    reply.step = answered_[rank]->generation;
    sink.reply(request.to, reply, {});
    return;
  }
  auto& queued = later_[rank];
  if (arrived_[rank] && request.header.step > arrived_[rank]->header.step) {
    // The rank's next barrier while its previous one waits (Worker::barrier
    // called again before the first finished): it waits for the next
    // generation, in number order. A re-send of a queued one replaces it.
    for (Request& q : queued) {
      if (q.header.step == request.header.step) {
        q = request;
        return;
      }
    }
    if (queued.size() >= kMaxQueuedPerRank) {
      sink.error(request.to, request.header,
                 Error(ErrorCode::kInvalidArgument,
                       fmt::format("worker {} has {} barriers waiting already; wait for one "
                                   "before calling barrier() again",
                                   rank, queued.size() + 1)));
      return;
    }
    const auto at = std::find_if(queued.begin(), queued.end(), [&](const Request& q) {
      return q.header.step > request.header.step;
    });
    queued.insert(at, request);
    return;
  }
  arrived_[rank] = request;  // the open generation's (a re-send replaces it)
  settle(sink);
}

void BarrierCore::settle(ReplySink& sink) {
  bool any = false;
  std::optional<std::uint32_t> failed;
  bool complete = true;
  for (std::uint32_t r = 0; r < arrived_.size(); ++r) {
    if (arrived_[r]) {
      any = true;
      continue;
    }
    if (membership_.excluded(r)) continue;
    complete = false;
    if (membership_.failed(r) && !failed) failed = r;
  }
  if (!any) return;
  if (complete) {
    for (std::uint32_t r = 0; r < arrived_.size(); ++r) {
      auto& a = arrived_[r];
      if (!a) continue;
      proto::Header reply = proto::reply_header(a->header);
      reply.step = generation_;
      sink.reply(a->to, reply, {});
      answered_[r] = Answered{a->header.step, generation_};
      if (numbers_) (*numbers_)[r].store(a->header.step + 1, std::memory_order_release);
      a.reset();
    }
    ++generation_;
    // Barriers the ranks sent ahead enter the new generation, which they
    // may complete at once.
    bool moved = false;
    for (std::uint32_t r = 0; r < arrived_.size(); ++r) {
      if (later_[r].empty()) continue;
      arrived_[r] = std::move(later_[r].front());
      later_[r].pop_front();
      moved = true;
    }
    if (moved) settle(sink);
    return;
  }
  if (failed) {
    const Error err = membership_.failure_error(*failed, fmt::format("barrier {}", generation_));
    for (std::uint32_t r = 0; r < arrived_.size(); ++r) {
      if (!arrived_[r]) continue;
      sink.error(arrived_[r]->to, arrived_[r]->header, err);
      arrived_[r].reset();
      for (const Request& q : later_[r]) sink.error(q.to, q.header, err);
      later_[r].clear();
    }
  }
}

void BarrierCore::on_worker_lost(std::uint32_t rank, TimePoint now, ReplySink& sink,
                                 Departure how) {
  if (rank >= arrived_.size()) return;
  if (membership_.lost(rank, now, how)) settle(sink);
}

void BarrierCore::on_worker_back(std::uint32_t rank) {
  if (rank >= arrived_.size()) return;
  membership_.back(rank);
}

void BarrierCore::on_tick(TimePoint now, ReplySink& sink) {
  if (membership_.tick(now)) settle(sink);
}

void BarrierCore::drop_connection(std::uint64_t connection_id) {
  for (std::uint32_t r = 0; r < arrived_.size(); ++r) {
    std::erase_if(later_[r], [&](const Request& q) { return q.to.connection_id == connection_id; });
    if (arrived_[r] && arrived_[r]->to.connection_id == connection_id) {
      arrived_[r].reset();
      // What it sent ahead on a live connection waits in its place.
      if (!later_[r].empty()) {
        arrived_[r] = std::move(later_[r].front());
        later_[r].pop_front();
      }
    }
  }
}

std::uint32_t BarrierCore::num_waiting() const noexcept {
  std::uint32_t n = 0;
  for (const auto& a : arrived_) n += a ? 1 : 0;
  return n;
}

}  // namespace ember::server
