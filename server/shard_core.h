// ShardCore: the parameter store and consistency engine of one shard, as a
// pure, thread-free state machine. The shard thread (server/shard.h) feeds it
// decoded requests and worker events and forwards what it emits to the
// transport; tests drive it directly.
//
// Store. An entry is one chunk of a tensor, named (key, chunk_index), with
// the tensor's shape and dtype, its place in the tensor (offset and count of
// elements), float32 parameters, optimizer state and a version. `init`
// creates an entry from worker rank 0's values; other ranks' inits wait for
// it. A second init with the same shape, dtype and chunk layout is a no-op;
// with a different one it is ErrorCode::kShapeMismatch.
//
// Consistency (per server, from config):
//  bsp  Pushes of step t are collected per rank. When every required rank
//       (all ranks but those excluded by the shrink policy) has pushed step
//       t, their sum in ascending rank order, divided by the number of
//       contributions, goes to the optimizer once, and the version becomes
//       t + 1. A pull for step t waits until version >= t. The fixed order
//       makes a run bit-for-bit deterministic whatever the arrival order.
//       Contributions are folded into the running sum as soon as every lower
//       rank's is in, so memory is held only for out-of-order arrivals.
//  asp  Every push is applied on arrival, as is (not averaged); pulls never wait.
//  ssp  Pushes are applied on arrival; a pull for step t waits until every
//       required rank has pushed step t - s - 1 (its clock, the number of
//       steps it pushed, is >= t - s): no worker runs more than s steps
//       ahead of the slowest (Ho et al., "More Effective Distributed ML via a
//       Stale Synchronous Parallel Parameter Server", NIPS 2013).
//
// Exactly once. Each entry remembers, per rank, the next step it expects
// (its clock). A push whose step is below it was received before (a re-send
// after a reconnect): it is acknowledged and not applied again. Steps must
// therefore increase per rank and key. A bsp push for a step whose round is
// over that was never received is ErrorCode::kStale.
//
// Resume step. Replies to init, pull and push_pull carry the step the worker
// should compute next: the version under bsp, the rank's own clock under
// asp/ssp. A restarted worker uses it to rejoin.
//
// Out of step (ErrorCode::kOutOfStep). A rank's requests for one entry reach
// the core in the order the worker issued them: one (key, chunk) always
// travels on one server channel (common/placement), a channel delivers in
// send order (transport.h), the I/O thread of a channel posts to this shard
// through its own FIFO lane, and a reconnecting worker re-sends what was in
// flight, in issue order, before anything newer (worker.h). Workers count
// steps per key (push advances by one), so a rank's next push is exactly the
// step this entry expects from it, and its pull of step t comes after its
// pushes of the steps below t. Hence, for a required (not excluded) rank r
// whose expected step is e = max(clock[r], version) under bsp:
//  - a bsp push of step t > e skipped steps the server never saw (it
//    restored an older checkpoint after a crash, or the worker lost track):
//    round e needs r's push of e, which will never come, so every later round
//    and every pull would wait until the worker's request_timeout;
//  - a bsp pull of step t > e can only be served by r's own pushes of steps
//    e .. t-1, which, given the order, were never sent: it would wait on
//    itself;
//  - an ssp pull of step t with clock[r] + staleness < t waits on r's own
//    clock the same way (e = clock[r]).
// All three are refused at once with kOutOfStep. The error reply's step is
// e, the step the worker must continue from (the worker sets its step(key)
// to it); the message names key, chunk, rank, the step asked and e, and says
// to pull at e (after a restore e is the version: clocks are saved capped at
// it). The server logs the first refusal per (rank, key, chunk), with the
// peer (server.cc, ReplySink::error). A pull that a caller issues, with an
// explicit step, before its own pushes of the steps below is therefore
// refused too (worker.h says so); a pull never overtakes an earlier push of
// its key. An excluded rank (shrink) is never refused: rounds do not wait
// for it, and on its return its pushes are measured from the version.
// asp and ssp pushes are never refused for a gap: they are applied on
// arrival and move the rank's clock to t + 1, so nothing waits on the
// skipped steps (asp pulls never wait; ssp pulls wait on clocks, which a gap
// only advances). Under asp and ssp a restored server thus simply continues
// from the workers' steps, without the updates the checkpoint lost.
//
// Worker loss: see membership.h. Requests waiting on a failed rank are
// answered with kWorkerLost; under shrink, rounds complete without the lost
// rank.
//
// Replies are emitted synchronously through a ReplySink while the core is
// inside the call that made them, so a pull's parameters are the ones of
// that moment.
//
// Thread-safety: none; one thread owns a ShardCore. Allocation: entry
// creation and round bookkeeping allocate; the steady-state push/pull path
// allocates only when a contribution arrives out of rank order (a vector
// slot is reused otherwise).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/base/error.h"
#include "common/proto/message.h"
#include "server/membership.h"
#include "server/optimizer.h"
#include "server/payload.h"

namespace ember::server {

// Where a reply goes: the connection and channel the request came on.
// Opaque to the core.
struct ReplyTo {
  std::uint64_t connection_id = 0;
  std::uint32_t channel = 0;
  // The request's proto::ReplyPlacement (kFlagInPlace), if any: where in
  // the worker's memory the reply's values may be written.
  std::optional<proto::ReplyPlacement> placement = std::nullopt;
  bool operator==(const ReplyTo&) const = default;
};

struct Request {
  ReplyTo to;
  proto::Header header;  // as decoded; rank already checked < num_workers
};

// Receives the core's replies. Called synchronously from inside ShardCore
// calls; `values` is valid only during the call (the sender copies it into
// its send buffer), except in reply_lent.
class ReplySink {
 public:
  virtual ~ReplySink() = default;
  // A successful reply; `reply` is complete (type, ids, step, dtype and
  // num_elements set when values flow).
  virtual void reply(const ReplyTo& to, const proto::Header& reply,
                     std::span<const float> values) = 0;
  // The same reply, with `values` lent (CoreOptions::lend_params): they stay
  // valid and unchanged for as long as the sink keeps a copy of `lease`, from
  // any thread, so the sender may send them without copying and drop the
  // lease when the send completes. Dropping it is thread-safe. The default
  // copies, like reply().
  virtual void reply_lent(const ReplyTo& to, const proto::Header& reply,
                          std::span<const float> values, std::shared_ptr<const void> lease) {
    (void)lease;
    this->reply(to, reply, values);
  }
  // An error reply to `request`, whose header the reply echoes with its step
  // set to `reply_step`. For kOutOfStep and kStale that is the step where the
  // worker continues (Worker::step(key) moves there); `request` keeps the
  // step asked, which is what a log line about the request names.
  virtual void error(const ReplyTo& to, const proto::Header& request, const Error& error,
                     std::uint64_t reply_step) = 0;
  // The same with the reply's step the request's own. A derived class that
  // overrides the one above writes `using ReplySink::error;` to keep this.
  void error(const ReplyTo& to, const proto::Header& request, const Error& error) {
    this->error(to, request, error, request.step);
  }
  // A push (or a push_pull's push) of `step` from `rank` was recorded: it
  // counts in its round (bsp) or was applied (asp, ssp). Not called for a
  // refused push, nor for a re-send acknowledged without effect. Called by
  // the thread that handles the push, before its reply. Default: nothing.
  virtual void push_recorded(std::uint32_t rank, std::uint64_t step) {
    (void)rank;
    (void)step;
  }
};

struct CoreOptions {
  std::uint32_t num_workers = 1;
  proto::Consistency consistency = proto::Consistency::kBsp;
  std::uint64_t staleness = 0;  // ssp bound s
  proto::LossPolicy loss_policy = proto::LossPolicy::kWait;
  std::chrono::nanoseconds worker_timeout = std::chrono::seconds(30);
  // bsp: a push may be for a step at most this far past the open round.
  std::uint64_t max_steps_ahead = 64;
  // For messages: "server 0 shard 1".
  std::string name = "shard";
  // Parameter replies go out through ReplySink::reply_lent: the sender reads
  // the parameter store itself, without a copy. When the parameters must
  // change while a lent reply is still in flight, the core moves the lent
  // bytes aside for that reply and updates a copy (copy on write; counted in
  // CoreStats::lent_copies). Worth it when such overlaps are rare: under bsp
  // a round completes only after every worker's next push, which normally
  // follows its reply. The server sets it for tcp under bsp.
  bool lend_params = false;
};

// One entry as saved in and restored from a checkpoint.
struct EntrySnapshot {
  std::uint64_t key = 0;
  std::uint32_t chunk_index = 0;
  std::uint32_t num_chunks = 1;
  std::uint64_t offset_elements = 0;
  proto::DType dtype = proto::DType::kFloat32;
  std::vector<std::uint64_t> shape;
  std::uint64_t version = 0;
  std::vector<std::uint64_t> clocks;  // per rank: next step expected
  std::vector<float> params;
  OptimizerState optimizer;

  bool operator==(const EntrySnapshot&) const = default;
};

struct CoreStats {
  std::uint64_t num_entries = 0;
  std::uint64_t param_bytes = 0;
  std::uint64_t pushes_applied = 0;     // contributions that reached the optimizer
  std::uint64_t pushes_duplicate = 0;   // re-sent pushes acknowledged without effect
  std::uint64_t rounds_completed = 0;   // optimizer applications
  std::uint64_t parked_requests = 0;    // requests waiting now
  std::uint64_t replies_lent = 0;       // parameter replies sent without a copy (lend_params)
  std::uint64_t lent_copies = 0;        // updates that found a lent reply in flight and copied
};

class ShardCore {
 public:
  ShardCore(CoreOptions options, Optimizer optimizer);
  ShardCore(const ShardCore&) = delete;
  ShardCore& operator=(const ShardCore&) = delete;

  // kInit. `shape` is the tensor's; `values` holds the chunk's initial values
  // (rank 0) or is empty (kFlagNoData). Replies: ok with the resume step, at
  // once or when rank 0's init arrives. Errors: kShapeMismatch (existing
  // entry differs), kInvalidArgument (dtype other than float32, rank 0 init
  // without values), kWorkerLost (waiting for a rank 0 failed or, under
  // shrink, left out).
  void on_init(const Request& request, std::span<const std::uint64_t> shape, Payload values,
               TimePoint now, ReplySink& sink);

  // kPush: ok at once (recorded or duplicate). Errors: kNotFound (no such
  // entry), kShapeMismatch (layout or dtype differs), kStale (bsp: the
  // round is over; ssp: a step the rank skipped when it came back after a
  // shrink, see on_worker_back), kOutOfStep (bsp: the rank skipped steps;
  // see "Out of step"), kInvalidArgument (step too far ahead of the open
  // round, or a step of 2^53 or more: proto::kLargestStep).
  void on_push(const Request& request, Payload gradient, TimePoint now, ReplySink& sink);

  // kPull: the parameters, at once or when the step's condition holds.
  // Errors: kNotFound, kShapeMismatch, kWorkerLost, kOutOfStep (bsp/ssp: the
  // pull would wait on this rank's own pushes that never came).
  void on_pull(const Request& request, TimePoint now, ReplySink& sink);

  // kPushPull: a push of step t, then the parameters for step t + 1 (one
  // reply). Errors: those of on_push and on_pull.
  void on_push_pull(const Request& request, Payload gradient, TimePoint now, ReplySink& sink);

  // Worker events and time. May complete or fail waiting requests. Under
  // ssp, a rank back after shrink left it out resumes, per entry, at the
  // slowest clock of the other ranks counted (the furthest, when all are
  // left out): what init and pull replies then say; its pushes of the steps
  // between are refused with kStale and that clock in the reply's step.
  void on_worker_lost(std::uint32_t rank, TimePoint now, ReplySink& sink,
                      Departure how = Departure::kLost);
  void on_worker_back(std::uint32_t rank, TimePoint now, ReplySink& sink);
  void on_tick(TimePoint now, ReplySink& sink);
  // When on_tick next has something to do: a lost rank's worker_timeout
  // (wait), or, while inits wait for a left-out rank 0 (shrink), its.
  std::optional<TimePoint> next_deadline() const;

  // Forgets requests waiting on behalf of a closed connection.
  void drop_connection(std::uint64_t connection_id);

  // Errors: kInvalidArgument (see Optimizer::set_learning_rate).
  Status set_learning_rate(double lr) { return optimizer_.set_learning_rate(lr); }
  double learning_rate() const noexcept { return optimizer_.learning_rate(); }

  // Copies every entry (sorted by key, chunk) for a checkpoint. Under bsp a
  // rank's clock is capped at the version: contributions to an open round
  // are not saved, so their re-sends must be accepted after a restore.
  std::vector<EntrySnapshot> snapshot() const;
  // Adds a restored entry. A snapshot of another worker count is taken:
  // clocks of ranks it lacks start at its version (bsp) or 0. Errors:
  // kCorrupt (dtype other than float32, sizes that do not fit the shape,
  // optimizer state of another type or size), kInvalidArgument (entry exists).
  Status restore(EntrySnapshot snapshot);

  // O(entries): walks the store for param_bytes and parked requests.
  CoreStats stats() const;
  // Entries (tensor chunks) stored; O(1), for per-batch metrics.
  std::size_t num_entries() const noexcept { return entries_.size(); }
  // CoreStats::lent_copies, in O(1).
  std::uint64_t lent_copies() const noexcept { return lent_copies_; }
  const CoreOptions& options() const noexcept { return options_; }

 private:
  struct EntryId {
    std::uint64_t key;
    std::uint32_t chunk;
    bool operator==(const EntryId&) const = default;
    bool operator<(const EntryId& o) const { return key != o.key ? key < o.key : chunk < o.chunk; }
  };
  struct EntryIdHash {
    std::size_t operator()(const EntryId& id) const noexcept;
  };
  enum class WaitKind : std::uint8_t { kPull, kPushPull, kInit };
  struct Parked {
    Request request;
    std::uint64_t want = 0;  // step the reply must reach
    WaitKind kind = WaitKind::kPull;
  };
  struct Round {
    std::vector<Payload> held;          // per rank, until folded
    std::vector<std::uint8_t> pushed;   // per rank
    std::uint32_t num_contributions = 0;
  };
  // What lent replies hold: `parked` receives the entry's parameter storage
  // when it must change (or the entry goes) while they are in flight, and is
  // freed with the last of them.
  struct LentParams {
    std::vector<float> parked;
  };
  struct Entry {
    EntryId id{};
    std::uint32_t num_chunks = 1;
    std::uint64_t offset_elements = 0;
    proto::DType dtype = proto::DType::kFloat32;
    std::vector<std::uint64_t> shape;
    std::vector<float> params;
    // lend_params: held by every reply that lent `params`; while another
    // holder exists, `params` must not change (see unlend).
    std::shared_ptr<LentParams> lent;
    OptimizerState optimizer;
    std::uint64_t version = 0;
    std::vector<std::uint64_t> clocks;
    // ssp: per rank, its clock before on_worker_back raised it (kNotRaised
    // when not raised since its last push). Its pushes of the steps between
    // are refused as stale (with the clock), not taken for re-sends.
    std::vector<std::uint64_t> raised_from;
    static constexpr std::uint64_t kNotRaised = ~std::uint64_t{0};

    Entry() = default;
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    // Leaves `params` to the replies still reading them.
    ~Entry();
    // bsp
    std::map<std::uint64_t, Round> rounds;  // by step; begin() is `version` when present
    std::vector<float> sum;                 // running sum of the open round (fold_pair sizes it)
    std::uint32_t next_fold = 0;            // ranks below it are folded into `sum`
    std::uint32_t num_folded = 0;
    std::vector<Parked> parked;
  };
  struct PendingInit {
    std::vector<Parked> waiting;
    std::vector<std::vector<std::uint64_t>> shapes;  // per waiting init
  };

  // The entry a push, pull or push_pull names, whose layout (dtype, chunks,
  // offset, elements) matches the request's; otherwise null, and `sink` has
  // the error (kNotFound, kShapeMismatch).
  Entry* find(const Request& request, ReplySink& sink);
  Status check_layout(const Entry& e, const proto::Header& h) const;
  std::uint64_t resume_step(const Entry& e, std::uint32_t rank) const;
  void reply_params(Entry& e, const Request& request, ReplySink& sink);
  // Call before `e.params` change. When a lent reply may still be reading
  // them, moves their storage to the replies' lease and leaves a copy in
  // `e.params` (allocates); otherwise does nothing.
  void unlend(Entry& e);
  void reply_init(const Entry& e, const Request& request, std::span<const std::uint64_t> shape,
                  ReplySink& sink);
  // Records a push; kRefused when refused (and replied with an error).
  enum class PushOutcome : std::uint8_t { kRecorded, kDuplicate, kRefused };
  PushOutcome record_push(Entry& e, const Request& request, Payload gradient, ReplySink& sink);
  // record_push, and for a recorded push: tells the sink (push_recorded)
  // and completes the rounds it closes.
  PushOutcome record_and_report(Entry& e, const Request& request, Payload gradient,
                                ReplySink& sink);
  // Adds rank's held contribution to `sum` and releases its buffer.
  // pre: num_folded > 0.
  void fold(Entry& e, Round& round, std::uint32_t rank);
  // sum = first + second (the round's first two contributions in rank
  // order), releasing both buffers. pre: num_folded == 0.
  void fold_pair(Entry& e, Round& round, std::uint32_t first, std::uint32_t second);
  // Folds the open round's contributions that are next in rank order (the
  // first one only together with the second), unless the round is complete
  // (complete_rounds folds those).
  void fold_ready(Entry& e);
  bool round_complete(const Entry& e) const;
  void complete_rounds(Entry& e);
  bool ready(const Entry& e, const Parked& p) const;
  std::optional<std::uint32_t> blocking_failed_rank(const Entry& e, const Parked& p) const;
  void park_or_answer(Entry& e, Parked parked, ReplySink& sink);
  void serve_parked(Entry& e, ReplySink& sink);
  void serve_all(TimePoint now, ReplySink& sink);
  // bsp: the held contributions of e's rounds that wait for a lost rank
  // (failed, or waited for under policy wait) move to heap copies
  // (Payload::detach), giving their pushers' buffers back. Such a round
  // completes only if that rank comes back, which may be never; over shm the
  // buffer is the pusher's pool block, and its push stays undone (even past
  // request_timeout) until the block is given back. The contributions are
  // kept: a returning rank completes the round as usual.
  void detach_blocked_rounds(Entry& e);
  std::string entry_name(const EntryId& id) const;
  // The step this entry expects next from `rank`: its clock, under bsp at
  // least the version (a rank excluded from past rounds resumes there).
  std::uint64_t expected_step(const Entry& e, std::uint32_t rank) const;
  // Whether a pull for `want` from `rank` can only be served by pushes of
  // that rank which, given the request order, were never sent.
  bool waits_on_itself(const Entry& e, std::uint32_t rank, std::uint64_t want) const;
  // Rank 0, which gives every key's initial values, cannot give them: failed,
  // or left out (shrink) for worker_timeout already (a rank 0 restarted
  // within it still gives them). Inits of other ranks then fail with
  // kWorkerLost rather than wait for nobody.
  bool rank0_gone(TimePoint now) const noexcept {
    const auto excluded_until = membership_.excluded_deadline(0);
    return membership_.failed(0) || (excluded_until && now >= *excluded_until);
  }
  // Replies kOutOfStep (reply step: expected_step) to `request`, asking for `asked`.
  void refuse_out_of_step(Entry& e, const Request& request, std::uint64_t asked, ReplySink& sink);

  CoreOptions options_;
  Optimizer optimizer_;
  Membership membership_;
  std::unordered_map<EntryId, std::unique_ptr<Entry>, EntryIdHash> entries_;
  std::map<EntryId, PendingInit> pending_inits_;
  std::uint64_t pushes_applied_ = 0;
  std::uint64_t pushes_duplicate_ = 0;
  std::uint64_t rounds_completed_ = 0;
  std::uint64_t replies_lent_ = 0;
  std::uint64_t lent_copies_ = 0;
};

}  // namespace ember::server
