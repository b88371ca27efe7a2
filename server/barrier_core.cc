// Job-wide barrier; see barrier_core.h.
#include "server/barrier_core.h"

#include <fmt/format.h>

#include "common/base/check.h"

namespace ember::server {

BarrierCore::BarrierCore(std::uint32_t num_workers, proto::LossPolicy policy,
                         std::chrono::nanoseconds worker_timeout)
    : membership_(num_workers, policy, worker_timeout), arrived_(num_workers) {}

void BarrierCore::on_barrier(const Request& request, TimePoint /*now*/, ReplySink& sink) {
  const std::uint32_t rank = request.header.worker_rank;
  EMBER_CHECK_MSG(rank < arrived_.size(), "rank {} of {}", rank, arrived_.size());
  arrived_[rank] = request;
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
    for (auto& a : arrived_) {
      if (!a) continue;
      proto::Header reply = proto::reply_header(a->header);
      reply.step = generation_;
      sink.reply(a->to, reply, {});
      a.reset();
    }
    ++generation_;
    return;
  }
  if (failed) {
    const Error err = membership_.failure_error(*failed, fmt::format("barrier {}", generation_));
    for (auto& a : arrived_) {
      if (!a) continue;
      sink.error(a->to, a->header, err);
      a.reset();
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
  for (auto& a : arrived_) {
    if (a && a->to.connection_id == connection_id) a.reset();
  }
}

std::uint32_t BarrierCore::num_waiting() const noexcept {
  std::uint32_t n = 0;
  for (const auto& a : arrived_) n += a ? 1 : 0;
  return n;
}

}  // namespace ember::server
