// Worker liveness under the loss policies; see membership.h.
#include "server/membership.h"

#include <fmt/chrono.h>

#include "common/base/check.h"

namespace ember::server {

Membership::Membership(std::uint32_t num_workers, proto::LossPolicy policy,
                       std::chrono::nanoseconds worker_timeout)
    : policy_(policy), worker_timeout_(worker_timeout), states_(num_workers) {
  EMBER_CHECK(num_workers > 0);
}

bool Membership::lost(std::uint32_t rank, TimePoint now, Departure how) {
  EMBER_CHECK_MSG(rank < states_.size(), "rank {} of {}", rank, states_.size());
  State& s = states_[rank];
  if (s.kind != Kind::kPresent) return false;
  s.lost_since = now;
  s.how = how;
  switch (policy_) {
    case proto::LossPolicy::kWait: s.kind = Kind::kWaiting; break;
    case proto::LossPolicy::kShrink: s.kind = Kind::kExcluded; break;
    case proto::LossPolicy::kFail: s.kind = Kind::kFailed; break;
  }
  if (s.kind != Kind::kExcluded) ++num_missing_;
  return true;
}

bool Membership::back(std::uint32_t rank) {
  EMBER_CHECK_MSG(rank < states_.size(), "rank {} of {}", rank, states_.size());
  State& s = states_[rank];
  if (s.kind == Kind::kPresent) return false;
  if (s.kind != Kind::kExcluded) --num_missing_;
  s.kind = Kind::kPresent;
  return true;
}

bool Membership::tick(TimePoint now) {
  bool changed = false;
  for (State& s : states_) {
    if (s.kind == Kind::kWaiting && now - s.lost_since >= worker_timeout_) {
      s.kind = Kind::kFailed;
      changed = true;
    }
  }
  return changed;
}

std::optional<TimePoint> Membership::next_deadline() const {
  std::optional<TimePoint> out;
  for (const State& s : states_) {
    if (s.kind != Kind::kWaiting) continue;
    const TimePoint d = s.lost_since + worker_timeout_;
    if (!out || d < *out) out = d;
  }
  return out;
}

std::uint32_t Membership::num_required() const noexcept {
  std::uint32_t n = 0;
  for (const State& s : states_) n += s.kind == Kind::kExcluded ? 0 : 1;
  return n;
}

Error Membership::failure_error(std::uint32_t rank, std::string_view what) const {
  const bool closed = rank < states_.size() && states_[rank].how == Departure::kClosed;
  if (policy_ == proto::LossPolicy::kShrink) {
    // Only what the rank alone provides (the initial values of rank 0).
    return Error(ErrorCode::kWorkerLost,
                 fmt::format("{} needs worker {}, which {} and is left out (on_worker_loss = "
                             "\"shrink\"); restart it with the same rank to continue",
                             what, rank,
                             closed ? "closed its connection in order (it finished, or dropped "
                                      "the connection to reconnect)"
                                    : "was lost"));
  }
  if (closed && policy_ == proto::LossPolicy::kWait) {
    return Error(ErrorCode::kWorkerLost,
                 fmt::format("{} needs worker {}, which closed its connection in order (it "
                             "finished, or dropped the connection to reconnect) and was not "
                             "back within worker_timeout ({}) "
                             "(on_worker_loss = \"wait\")",
                             what, rank,
                             std::chrono::duration_cast<std::chrono::milliseconds>(worker_timeout_)));
  }
  if (closed) {
    return Error(ErrorCode::kWorkerLost,
                 fmt::format("{} needs worker {}, which closed its connection in order (it "
                             "finished, or dropped the connection to reconnect) "
                             "(on_worker_loss = \"fail\"); restart it with the same rank to "
                             "continue",
                             what, rank));
  }
  if (policy_ == proto::LossPolicy::kWait) {
    return Error(ErrorCode::kWorkerLost,
                 fmt::format("{} needs worker {}, lost and not back within worker_timeout ({}) "
                             "(on_worker_loss = \"wait\")",
                             what, rank,
                             std::chrono::duration_cast<std::chrono::milliseconds>(worker_timeout_)));
  }
  return Error(ErrorCode::kWorkerLost,
               fmt::format("{} needs worker {}, which was lost (on_worker_loss = \"fail\"); "
                           "restart it with the same rank to continue",
                           what, rank));
}

}  // namespace ember::server
