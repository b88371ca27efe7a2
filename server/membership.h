// Membership: what a shard (or the barrier) knows about each worker rank's
// liveness, and what the loss policy makes of it.
//
// A rank is present until the server reports it lost (its last connection
// closed: heartbeat timeout, reset or orderly close) and present again when
// it reconnects and its join succeeds (server.h). What a lost rank means
// depends on the policy:
//   wait    rounds keep waiting for it; once worker_timeout has passed since
//           the loss without its return, it counts as failed
//   shrink  it is excluded at once: rounds and barriers complete without it
//   fail    it counts as failed at once
// A request that can only complete with a failed rank's contribution gets
// ErrorCode::kWorkerLost. Ranks that never connected are present (waited
// for): a job starts before all its workers are up.
//
// Pure and thread-free: time comes in as arguments. One instance per shard
// thread, fed the same events.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/proto/message.h"

namespace ember::server {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;

// How a rank's last connection ended, as far as the server can tell. Only
// the wording of the kWorkerLost error depends on it; the policy treats both
// alike (a worker that finished and one that crashed are both gone).
enum class Departure : std::uint8_t {
  // An error ended it: the peer's end closed without its goodbye (a crash or
  // a kill, over tcp and shm alike), a reset, a heartbeat timeout, a protocol
  // or I/O error; or this server closed it (bad input, shutdown).
  kLost,
  // The worker closed it in order (its goodbye came, transport::Connection::
  // close): a worker that finished (Worker destroyed), or one that dropped
  // the connection to reconnect (a refused join, a reply it could not read).
  kClosed,
};

class Membership {
 public:
  Membership(std::uint32_t num_workers, proto::LossPolicy policy,
             std::chrono::nanoseconds worker_timeout);

  std::uint32_t num_workers() const noexcept { return static_cast<std::uint32_t>(states_.size()); }
  proto::LossPolicy policy() const noexcept { return policy_; }

  // Events. Both return true when the rank's state changed. pre: rank < num_workers().
  bool lost(std::uint32_t rank, TimePoint now, Departure how = Departure::kLost);
  bool back(std::uint32_t rank);

  // Marks ranks lost longer than worker_timeout (policy wait) as failed.
  // Returns true when at least one rank changed.
  bool tick(TimePoint now);
  // When tick() next has something to do; nullopt when nothing is pending.
  std::optional<TimePoint> next_deadline() const;

  // When an excluded rank (shrink) has been gone for worker_timeout: what
  // only it can give (rank 0's initial values) is given up on then; nullopt
  // when `rank` is not excluded.
  std::optional<TimePoint> excluded_deadline(std::uint32_t rank) const noexcept {
    if (states_[rank].kind != Kind::kExcluded) return std::nullopt;
    return states_[rank].lost_since + worker_timeout_;
  }
  // Rounds and barriers proceed without an excluded rank (shrink).
  bool excluded(std::uint32_t rank) const noexcept { return states_[rank].kind == Kind::kExcluded; }
  // Requests needing a failed rank get kWorkerLost.
  bool failed(std::uint32_t rank) const noexcept { return states_[rank].kind == Kind::kFailed; }
  bool present(std::uint32_t rank) const noexcept { return states_[rank].kind == Kind::kPresent; }
  // A rank lost and not excluded: waited for (wait) or failed. O(1).
  bool any_missing() const noexcept { return num_missing_ > 0; }
  // Number of ranks not excluded.
  std::uint32_t num_required() const noexcept;

  // The error handed to a request blocked by failed rank `rank` (or, under
  // shrink, by an excluded rank it needs alone: rank 0 for an init):
  // kWorkerLost, naming `what`, the rank, how it left (Departure) and the
  // policy.
  Error failure_error(std::uint32_t rank, std::string_view what) const;

 private:
  enum class Kind : std::uint8_t { kPresent, kWaiting, kExcluded, kFailed };
  struct State {
    Kind kind = Kind::kPresent;
    TimePoint lost_since{};
    Departure how = Departure::kLost;  // of the latest loss
  };
  proto::LossPolicy policy_;
  std::chrono::nanoseconds worker_timeout_;
  std::vector<State> states_;
  std::uint32_t num_missing_ = 0;  // ranks kWaiting or kFailed
};

}  // namespace ember::server
