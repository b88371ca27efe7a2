// The shard state machine; semantics in shard_core.h.
#include "server/shard_core.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/base/check.h"
#include "common/placement/placement.h"

namespace ember::server {

std::size_t ShardCore::EntryIdHash::operator()(const EntryId& id) const noexcept {
  return static_cast<std::size_t>(placement::chunk_hash(id.key, id.chunk));
}

ShardCore::ShardCore(CoreOptions options, Optimizer optimizer)
    : options_(std::move(options)),
      optimizer_(std::move(optimizer)),
      membership_(options_.num_workers, options_.loss_policy, options_.worker_timeout) {}

std::string ShardCore::entry_name(const EntryId& id) const {
  return fmt::format("key {} chunk {} on {}", id.key, id.chunk, options_.name);
}

ShardCore::Entry* ShardCore::find(const Request& request, ReplySink& sink) {
  const proto::Header& h = request.header;
  auto it = entries_.find(EntryId{h.key, h.chunk_index});
  if (it == entries_.end()) {
    sink.error(request.to, h,
               Error(ErrorCode::kNotFound,
                     fmt::format("{} is not registered; call init for the key first (a worker "
                                 "that did: this server restarted and lost the key, having no "
                                 "checkpoint to restore ([server] checkpoint_dir) or only one "
                                 "written before the key's init; init it again, then pull)",
                                 entry_name(EntryId{h.key, h.chunk_index}))));
    return nullptr;
  }
  if (Status s = check_layout(*it->second, h); !s) {
    sink.error(request.to, h, s.error());
    return nullptr;
  }
  return it->second.get();
}

Status ShardCore::check_layout(const Entry& e, const proto::Header& h) const {
  if (h.dtype != e.dtype || h.num_chunks != e.num_chunks || h.offset_elements != e.offset_elements ||
      h.num_elements != e.params.size()) {
    return make_error(ErrorCode::kShapeMismatch,
                      "{} holds {} elements of {} at offset {} of {} chunk(s); the {} carries {} "
                      "elements of {} at offset {} of {} chunk(s)",
                      entry_name(e.id), e.params.size(), proto::dtype_name(e.dtype),
                      e.offset_elements, e.num_chunks, proto::msg_type_name(h.type),
                      h.num_elements, proto::dtype_name(h.dtype), h.offset_elements, h.num_chunks);
  }
  return ok_status();
}

std::uint64_t ShardCore::resume_step(const Entry& e, std::uint32_t rank) const {
  return options_.consistency == proto::Consistency::kBsp ? e.version : e.clocks[rank];
}

std::uint64_t ShardCore::expected_step(const Entry& e, std::uint32_t rank) const {
  if (options_.consistency == proto::Consistency::kBsp) return std::max(e.clocks[rank], e.version);
  return e.clocks[rank];
}

bool ShardCore::waits_on_itself(const Entry& e, std::uint32_t rank, std::uint64_t want) const {
  if (membership_.excluded(rank)) return false;  // rounds do not wait for it
  switch (options_.consistency) {
    case proto::Consistency::kBsp:
      // Served when version >= want, i.e. after rounds version .. want-1,
      // each needing this rank's push; it has pushed those below clock.
      return want > e.version && want > e.clocks[rank];
    case proto::Consistency::kSsp:
      return e.clocks[rank] + options_.staleness < want;
    case proto::Consistency::kAsp:
      return false;
  }
  return false;
}

void ShardCore::refuse_out_of_step(Entry& e, const Request& request, std::uint64_t asked,
                                   ReplySink& sink) {
  const proto::Header& h = request.header;
  const std::uint64_t at = expected_step(e, h.worker_rank);
  // The reply's step tells the worker where to continue.
  sink.error(request.to, h,
             Error(ErrorCode::kOutOfStep,
                   fmt::format("{} of step {} for {} from rank {} does not follow the "
                               "server, which is at step {} for that rank (it restarted from an "
                               "older checkpoint, or the worker lost track): the steps between "
                               "were never received and the round would wait forever; pull key "
                               "{} at step {} and continue from there; Worker::step(key) now "
                               "returns {}; see docs/troubleshooting.md#out-of-step",
                               proto::msg_type_name(h.type), asked, entry_name(e.id),
                               h.worker_rank, at, e.id.key, at, at)),
             at);
}

void ShardCore::reply_params(Entry& e, const Request& request, ReplySink& sink) {
  proto::Header r = proto::reply_header(request.header);
  r.dtype = e.dtype;
  r.num_elements = e.params.size();
  r.step = resume_step(e, request.header.worker_rank);
  if (!options_.lend_params || e.params.empty()) {
    sink.reply(request.to, r, e.params);
    return;
  }
  if (!e.lent) e.lent = std::make_shared<LentParams>();
  ++replies_lent_;
  sink.reply_lent(request.to, r, e.params, e.lent);
}

void ShardCore::unlend(Entry& e) {
  if (!e.lent) return;
  // Only this thread hands out the lease, so a count of 1 (ours) means every
  // lent reply has dropped it. Their drop is a release decrement (in
  // ~shared_ptr), after their last read of the bytes; use_count() loads
  // relaxed, and the acquire fence orders the writes that follow after those
  // reads.
  if (e.lent.use_count() == 1) {
    std::atomic_thread_fence(std::memory_order_acquire);
    return;
  }
  e.lent->parked = std::move(e.params);
  // Moving a vector keeps its heap buffer: the lent replies still read it.
  e.params.assign(e.lent->parked.begin(), e.lent->parked.end());
  e.lent.reset();
  ++lent_copies_;
}

ShardCore::Entry::~Entry() {
  if (lent && lent.use_count() > 1) lent->parked = std::move(params);
}

void ShardCore::reply_init(const Entry& e, const Request& request,
                           std::span<const std::uint64_t> shape, ReplySink& sink) {
  const proto::Header& h = request.header;
  const Status layout = check_layout(e, h);
  std::string mismatch;  // what differs, "" when the init fits the entry
  if (!layout) {
    // Another element count (or dtype, or chunking): name the shapes too.
    mismatch = fmt::format("{}; it was registered with shape [{}] and this init asks for [{}]",
                           layout.error().message(), fmt::join(e.shape, ", "),
                           fmt::join(shape, ", "));
  } else if (!std::equal(shape.begin(), shape.end(), e.shape.begin(), e.shape.end())) {
    mismatch = fmt::format("{} was registered with shape [{}]; this init asks for [{}]",
                           entry_name(e.id), fmt::join(e.shape, ", "), fmt::join(shape, ", "));
  }
  if (!mismatch.empty()) {
    sink.error(request.to, h,
               Error(ErrorCode::kShapeMismatch,
                     fmt::format("{}: init a key with the shape it has (given by rank 0's first "
                                 "init, or restored from a checkpoint), or use another key",
                                 mismatch)));
    return;
  }
  proto::Header r = proto::reply_header(h);
  r.step = resume_step(e, h.worker_rank);
  sink.reply(request.to, r, {});
}

void ShardCore::on_init(const Request& request, std::span<const std::uint64_t> shape,
                        Payload values, TimePoint now, ReplySink& sink) {
  const proto::Header& h = request.header;
  EMBER_CHECK_MSG(h.worker_rank < options_.num_workers, "rank {} of {}", h.worker_rank,
                  options_.num_workers);
  const EntryId id{h.key, h.chunk_index};
  if (h.dtype != proto::DType::kFloat32) {
    sink.error(request.to, h,
               Error(ErrorCode::kInvalidArgument,
                     fmt::format("{}: dtype {} is not supported by the store yet; use float32",
                                 entry_name(id), proto::dtype_name(h.dtype))));
    return;
  }
  if (auto it = entries_.find(id); it != entries_.end()) {
    reply_init(*it->second, request, shape, sink);
    return;
  }
  if (h.worker_rank != 0) {
    if (rank0_gone(now)) {
      sink.error(request.to, h, membership_.failure_error(0, "init of " + entry_name(id)));
      return;
    }
    Parked p{request, 0, WaitKind::kInit};
    auto& pending = pending_inits_[id];
    pending.waiting.push_back(std::move(p));
    pending.shapes.emplace_back(shape.begin(), shape.end());
    return;
  }
  if (values.empty() && h.num_elements != 0) {
    sink.error(request.to, h,
               Error(ErrorCode::kInvalidArgument,
                     fmt::format("init of {} from rank 0 carries no values; rank 0 provides the "
                                 "initial values, other ranks wait for them",
                                 entry_name(id))));
    return;
  }
  auto e = std::make_unique<Entry>();
  e->id = id;
  e->num_chunks = h.num_chunks;
  e->offset_elements = h.offset_elements;
  e->dtype = h.dtype;
  e->shape.assign(shape.begin(), shape.end());
  // The one copy of init: the store owns its parameters.
  e->params.assign(values.values().begin(), values.values().end());
  e->optimizer = optimizer_.make_state(e->params.size());
  e->clocks.assign(options_.num_workers, 0);
  Entry& entry = *e;
  entries_.emplace(id, std::move(e));
  reply_init(entry, request, shape, sink);
  if (auto it = pending_inits_.find(id); it != pending_inits_.end()) {
    PendingInit pending = std::move(it->second);
    pending_inits_.erase(it);
    for (std::size_t i = 0; i < pending.waiting.size(); ++i) {
      reply_init(entry, pending.waiting[i].request, pending.shapes[i], sink);
    }
  }
}

ShardCore::PushOutcome ShardCore::record_push(Entry& e, const Request& request, Payload gradient,
                                              ReplySink& sink) {
  const proto::Header& h = request.header;
  const std::uint32_t rank = h.worker_rank;
  EMBER_CHECK_MSG(rank < options_.num_workers, "rank {} of {}", rank, options_.num_workers);
  const std::uint64_t t = h.step;
  if (t < e.clocks[rank]) {
    if (rank < e.raised_from.size() && t >= e.raised_from[rank]) {
      // A step it skipped when it came back (on_worker_back): not a re-send
      // of a push already applied, which would be acknowledged. The reply's
      // step is where it continues (the worker moves step(key) there).
      sink.error(request.to, h,
                 Error(ErrorCode::kStale,
                       fmt::format("push of step {} for {} from rank {} is of a step it skipped "
                                   "when it came back (the others went on without it: "
                                   "on_worker_loss = \"shrink\"); its gradient is not applied; "
                                   "Worker::step(key) now returns at least {}: pull to catch up "
                                   "and push from there",
                                   t, entry_name(e.id), rank, e.clocks[rank])),
                 e.clocks[rank]);
      return PushOutcome::kRefused;
    }
    ++pushes_duplicate_;
    return PushOutcome::kDuplicate;
  }
  if (t >= proto::kLargestStep) {
    // Under asp and ssp a step far ahead is applied and moves the clock to
    // t + 1: at 2^64 - 1 it wrapped to 0 and every push was applied again.
    sink.error(request.to, h,
               Error(ErrorCode::kInvalidArgument,
                     fmt::format("push of step {} for {} from rank {}: steps stay below {}; the "
                                 "worker's step counter is corrupt",
                                 t, entry_name(e.id), rank, proto::kLargestStep)));
    return PushOutcome::kRefused;
  }
  if (rank < e.raised_from.size()) e.raised_from[rank] = Entry::kNotRaised;  // caught up
  if (options_.consistency != proto::Consistency::kBsp) {
    unlend(e);
    optimizer_.apply(e.params, gradient.values(), e.optimizer);
    gradient.reset();
    ++e.version;
    e.clocks[rank] = t + 1;
    ++pushes_applied_;
    ++rounds_completed_;
    return PushOutcome::kRecorded;
  }
  if (t < e.version) {
    // The round closed without this rank (shrink left it out meanwhile).
    // The reply's step is where it continues: the worker moves the key's
    // step there (never back).
    sink.error(request.to, h,
               Error(ErrorCode::kStale,
                     fmt::format("push of step {} for {} from rank {} arrived after that round "
                                 "closed without it (now at step {}); its gradient is not "
                                 "applied; Worker::step(key) now returns at least {}: pull to "
                                 "catch up and push from there; see "
                                 "docs/troubleshooting.md#reordered-messages",
                                 t, entry_name(e.id), rank, e.version, e.version)),
               e.version);
    return PushOutcome::kRefused;
  }
  if (t > expected_step(e, rank)) {
    refuse_out_of_step(e, request, t, sink);
    return PushOutcome::kRefused;
  }
  if (t - e.version > options_.max_steps_ahead) {
    sink.error(request.to, h,
               Error(ErrorCode::kInvalidArgument,
                     fmt::format("push of step {} for {} from rank {} is more than {} steps past "
                                 "the open round {}; pull before pushing further steps; see "
                                 "docs/troubleshooting.md#reordered-messages",
                                 t, entry_name(e.id), rank, options_.max_steps_ahead, e.version)));
    return PushOutcome::kRefused;
  }
  Round& round = e.rounds[t];
  if (round.pushed.empty()) {
    round.pushed.assign(options_.num_workers, 0);
    round.held.resize(options_.num_workers);
  }
  round.held[rank] = std::move(gradient);
  round.pushed[rank] = 1;
  ++round.num_contributions;
  e.clocks[rank] = t + 1;
  if (t == e.version) fold_ready(e);
  detach_blocked_rounds(e);  // a push into a round a lost rank blocks
  return PushOutcome::kRecorded;
}

void ShardCore::fold(Entry& e, Round& round, std::uint32_t rank) {
  EMBER_DCHECK(e.num_folded > 0);
  const float* v = round.held[rank].values().data();
  float* s = e.sum.data();
  const std::size_t n = e.params.size();
  for (std::size_t i = 0; i < n; ++i) s[i] += v[i];
  round.held[rank].reset();
  ++e.num_folded;
}

void ShardCore::fold_pair(Entry& e, Round& round, std::uint32_t first, std::uint32_t second) {
  EMBER_DCHECK(e.num_folded == 0);
  const float* a = round.held[first].values().data();
  const float* b = round.held[second].values().data();
  const std::size_t n = e.params.size();
  // Allocated on first use: with two workers no round needs it (apply_mean
  // reads both contributions), only three or more, or a rank excluded.
  if (e.sum.size() != n) e.sum.resize(n);
  float* s = e.sum.data();
  for (std::size_t i = 0; i < n; ++i) s[i] = a[i] + b[i];
  round.held[first].reset();
  round.held[second].reset();
  e.num_folded = 2;
}

void ShardCore::fold_ready(Entry& e) {
  // One worker: the single contribution is applied straight from its buffer.
  if (options_.num_workers == 1 || e.rounds.empty()) return;
  auto it = e.rounds.begin();
  if (it->first != e.version) return;
  // A complete round is folded by complete_rounds, whose optimizer pass adds
  // the last contribution itself.
  if (round_complete(e)) return;
  Round& round = it->second;
  while (e.next_fold < options_.num_workers && round.pushed[e.next_fold]) {
    if (e.num_folded == 0) {
      // The first contribution waits for the second: one pass adds both.
      const std::uint32_t second = e.next_fold + 1;
      if (second >= options_.num_workers || !round.pushed[second]) return;
      fold_pair(e, round, e.next_fold, second);
      e.next_fold += 2;
      continue;
    }
    fold(e, round, e.next_fold);
    ++e.next_fold;
  }
}

bool ShardCore::round_complete(const Entry& e) const {
  if (e.rounds.empty()) return false;
  auto it = e.rounds.begin();
  if (it->first != e.version) return false;
  const Round& round = it->second;
  if (round.num_contributions == 0) return false;
  for (std::uint32_t r = 0; r < options_.num_workers; ++r) {
    if (!round.pushed[r] && !membership_.excluded(r)) return false;
  }
  return true;
}

void ShardCore::complete_rounds(Entry& e) {
  while (round_complete(e)) {
    auto it = e.rounds.begin();
    Round& round = it->second;
    const std::size_t n = e.params.size();
    unlend(e);
    if (e.num_folded == 0 && round.num_contributions == 1) {
      for (std::uint32_t r = 0; r < options_.num_workers; ++r) {
        if (round.pushed[r]) optimizer_.apply(e.params, round.held[r].values(), e.optimizer);
      }
    } else {
      // Rank order: ranks below next_fold are in `sum`; the rest are added
      // ascending, the last one by apply_mean in its pass (and, when nothing
      // was folded yet, the first two in one pass). The mean is
      // (((g0 + g1) + g2) + ...) / count in float32 whichever path runs.
      std::uint32_t last = options_.num_workers;
      for (std::uint32_t r = e.next_fold; r < options_.num_workers; ++r) {
        if (round.pushed[r]) last = r;
      }
      std::optional<std::uint32_t> first;  // unfolded while num_folded == 0
      for (std::uint32_t r = e.next_fold; r < last; ++r) {
        if (!round.pushed[r]) continue;
        if (e.num_folded > 0) {
          fold(e, round, r);
        } else if (first) {
          fold_pair(e, round, *first, r);
          first.reset();
        } else {
          first = r;
        }
      }
      if (first) {
        optimizer_.apply_mean(e.params, round.held[*first].values(), round.held[last].values(), 2,
                              e.optimizer);
      } else if (last < options_.num_workers) {
        // num_folded > 0 here: a round with one contribution in all took
        // the branch above.
        optimizer_.apply_mean(e.params, e.sum, round.held[last].values(), e.num_folded + 1,
                              e.optimizer);
      } else {
        // Everything was folded before the round completed (a rank it
        // waited for was excluded since).
        if (e.num_folded > 1) {
          const float count = static_cast<float>(e.num_folded);
          float* s = e.sum.data();
          for (std::size_t i = 0; i < n; ++i) s[i] /= count;
        }
        optimizer_.apply(e.params, e.sum, e.optimizer);
      }
    }
    pushes_applied_ += round.num_contributions;
    ++rounds_completed_;
    ++e.version;
    e.rounds.erase(it);
    e.next_fold = 0;
    e.num_folded = 0;
    fold_ready(e);
  }
}

bool ShardCore::ready(const Entry& e, const Parked& p) const {
  switch (options_.consistency) {
    case proto::Consistency::kBsp:
      return p.want <= e.version;
    case proto::Consistency::kAsp:
      return true;
    case proto::Consistency::kSsp:
      for (std::uint32_t r = 0; r < options_.num_workers; ++r) {
        if (membership_.excluded(r)) continue;
        if (e.clocks[r] + options_.staleness < p.want) return false;
      }
      return true;
  }
  return true;
}

std::optional<std::uint32_t> ShardCore::blocking_failed_rank(const Entry& e, const Parked& p) const {
  switch (options_.consistency) {
    case proto::Consistency::kBsp: {
      const Round* round = nullptr;
      if (!e.rounds.empty() && e.rounds.begin()->first == e.version) round = &e.rounds.begin()->second;
      for (std::uint32_t r = 0; r < options_.num_workers; ++r) {
        const bool pushed = round != nullptr && round->pushed[r];
        if (!pushed && membership_.failed(r)) return r;
      }
      return std::nullopt;
    }
    case proto::Consistency::kAsp:
      return std::nullopt;
    case proto::Consistency::kSsp:
      for (std::uint32_t r = 0; r < options_.num_workers; ++r) {
        if (membership_.failed(r) && e.clocks[r] + options_.staleness < p.want) return r;
      }
      return std::nullopt;
  }
  return std::nullopt;
}

void ShardCore::park_or_answer(Entry& e, Parked parked, ReplySink& sink) {
  if (ready(e, parked)) {
    reply_params(e, parked.request, sink);
  } else if (auto r = blocking_failed_rank(e, parked)) {
    sink.error(parked.request.to, parked.request.header,
               membership_.failure_error(*r, fmt::format("{} of step {} for {}",
                                                         proto::msg_type_name(parked.request.header.type),
                                                         parked.request.header.step,
                                                         entry_name(e.id))));
  } else {
    e.parked.push_back(std::move(parked));
  }
}

void ShardCore::serve_parked(Entry& e, ReplySink& sink) {
  if (e.parked.empty()) return;
  std::vector<Parked> keep;
  for (Parked& p : e.parked) {
    if (ready(e, p)) {
      reply_params(e, p.request, sink);
    } else if (auto r = blocking_failed_rank(e, p)) {
      sink.error(p.request.to, p.request.header,
                 membership_.failure_error(*r, fmt::format("{} of step {} for {}",
                                                           proto::msg_type_name(p.request.header.type),
                                                           p.request.header.step,
                                                           entry_name(e.id))));
    } else {
      keep.push_back(std::move(p));
    }
  }
  e.parked = std::move(keep);
}

ShardCore::PushOutcome ShardCore::record_and_report(Entry& e, const Request& request,
                                                    Payload gradient, ReplySink& sink) {
  const PushOutcome outcome = record_push(e, request, std::move(gradient), sink);
  if (outcome == PushOutcome::kRecorded) {
    sink.push_recorded(request.header.worker_rank, request.header.step);
    complete_rounds(e);
  }
  return outcome;
}

void ShardCore::on_push(const Request& request, Payload gradient, TimePoint /*now*/,
                        ReplySink& sink) {
  Entry* e = find(request, sink);
  if (e == nullptr) return;
  const PushOutcome outcome = record_and_report(*e, request, std::move(gradient), sink);
  if (outcome == PushOutcome::kRefused) return;
  proto::Header r = proto::reply_header(request.header);
  sink.reply(request.to, r, {});
  if (outcome == PushOutcome::kRecorded) serve_parked(*e, sink);
}

void ShardCore::on_pull(const Request& request, TimePoint /*now*/, ReplySink& sink) {
  Entry* e = find(request, sink);
  if (e == nullptr) return;
  if (waits_on_itself(*e, request.header.worker_rank, request.header.step)) {
    refuse_out_of_step(*e, request, request.header.step, sink);
    return;
  }
  park_or_answer(*e, Parked{request, request.header.step, WaitKind::kPull}, sink);
}

void ShardCore::on_push_pull(const Request& request, Payload gradient, TimePoint /*now*/,
                             ReplySink& sink) {
  Entry* e = find(request, sink);
  if (e == nullptr) return;
  const PushOutcome outcome = record_and_report(*e, request, std::move(gradient), sink);
  if (outcome == PushOutcome::kRefused) return;
  serve_parked(*e, sink);
  park_or_answer(*e, Parked{request, request.header.step + 1, WaitKind::kPushPull}, sink);
}

void ShardCore::detach_blocked_rounds(Entry& e) {
  if (!membership_.any_missing()) return;  // the normal path: nothing to scan
  for (auto& [step, round] : e.rounds) {
    bool blocked = false;
    for (std::uint32_t r = 0; r < options_.num_workers && !blocked; ++r) {
      // Failed, or lost and waited for (policy wait): not excluded (shrink).
      blocked = !round.pushed[r] && !membership_.present(r) && !membership_.excluded(r);
    }
    if (!blocked) continue;
    for (Payload& held : round.held) held.detach();
  }
}

std::optional<TimePoint> ShardCore::next_deadline() const {
  std::optional<TimePoint> d = membership_.next_deadline();
  if (!pending_inits_.empty()) {
    if (const auto rank0 = membership_.excluded_deadline(0); rank0 && (!d || *rank0 < *d)) {
      d = rank0;
    }
  }
  return d;
}

void ShardCore::serve_all(TimePoint now, ReplySink& sink) {
  for (auto& [id, e] : entries_) {
    complete_rounds(*e);
    serve_parked(*e, sink);
    detach_blocked_rounds(*e);
  }
  if (rank0_gone(now)) {
    for (auto& [id, pending] : pending_inits_) {
      for (const Parked& p : pending.waiting) {
        sink.error(p.request.to, p.request.header,
                   membership_.failure_error(0, "init of " + entry_name(id)));
      }
    }
    pending_inits_.clear();
  }
}

void ShardCore::on_worker_lost(std::uint32_t rank, TimePoint now, ReplySink& sink,
                               Departure how) {
  if (rank >= options_.num_workers) return;
  if (membership_.lost(rank, now, how)) serve_all(now, sink);
}

void ShardCore::on_worker_back(std::uint32_t rank, TimePoint /*now*/, ReplySink& /*sink*/) {
  if (rank >= options_.num_workers) return;
  const bool was_left_out = membership_.excluded(rank);
  if (!membership_.back(rank) || !was_left_out ||
      options_.consistency != proto::Consistency::kSsp) {
    return;
  }
  // SSP, shrink: the others went on without it. Back at its old clock, it
  // would hold every pull of theirs until it had replayed the steps it
  // missed (ready() counts it again). It resumes with the slowest of the
  // others counted (init and pull replies say where), or, when all of them
  // are left out too, with the furthest of them (they count again when they
  // come back): its steps between are forfeited, as shrink drops a lost
  // rank's rounds, and its pushes of them are refused as stale.
  for (auto& [id, e] : entries_) {
    std::optional<std::uint64_t> slowest_counted;
    std::optional<std::uint64_t> furthest;
    for (std::uint32_t r = 0; r < options_.num_workers; ++r) {
      if (r == rank) continue;
      furthest = std::max(furthest.value_or(e->clocks[r]), e->clocks[r]);
      if (membership_.excluded(r)) continue;
      slowest_counted = std::min(slowest_counted.value_or(e->clocks[r]), e->clocks[r]);
    }
    const std::optional<std::uint64_t> to = slowest_counted ? slowest_counted : furthest;
    if (!to || e->clocks[rank] >= *to) continue;
    if (e->raised_from.size() != options_.num_workers) {
      e->raised_from.assign(options_.num_workers, Entry::kNotRaised);
    }
    if (e->raised_from[rank] == Entry::kNotRaised) e->raised_from[rank] = e->clocks[rank];
    e->clocks[rank] = *to;
  }
}

void ShardCore::on_tick(TimePoint now, ReplySink& sink) {
  // A left-out rank 0's worker_timeout changes no membership state but ends
  // the inits waiting for it.
  const bool rank0_due = !pending_inits_.empty() && rank0_gone(now);
  if (membership_.tick(now) || rank0_due) serve_all(now, sink);
}

void ShardCore::drop_connection(std::uint64_t connection_id) {
  auto gone = [&](const Parked& p) { return p.request.to.connection_id == connection_id; };
  for (auto& [id, e] : entries_) std::erase_if(e->parked, gone);
  for (auto it = pending_inits_.begin(); it != pending_inits_.end();) {
    PendingInit& pending = it->second;
    for (std::size_t i = pending.waiting.size(); i-- > 0;) {
      if (gone(pending.waiting[i])) {
        pending.waiting.erase(pending.waiting.begin() + static_cast<std::ptrdiff_t>(i));
        pending.shapes.erase(pending.shapes.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    it = pending.waiting.empty() ? pending_inits_.erase(it) : std::next(it);
  }
}

std::vector<EntrySnapshot> ShardCore::snapshot() const {
  std::vector<const Entry*> sorted;
  sorted.reserve(entries_.size());
  for (const auto& [id, e] : entries_) sorted.push_back(e.get());
  std::sort(sorted.begin(), sorted.end(), [](const Entry* a, const Entry* b) { return a->id < b->id; });
  std::vector<EntrySnapshot> out;
  out.reserve(sorted.size());
  for (const Entry* e : sorted) {
    EntrySnapshot s;
    s.key = e->id.key;
    s.chunk_index = e->id.chunk;
    s.num_chunks = e->num_chunks;
    s.offset_elements = e->offset_elements;
    s.dtype = e->dtype;
    s.shape = e->shape;
    s.version = e->version;
    s.clocks = e->clocks;
    if (options_.consistency == proto::Consistency::kBsp) {
      for (auto& c : s.clocks) c = std::min(c, e->version);
    }
    s.params = e->params;
    s.optimizer = e->optimizer;
    out.push_back(std::move(s));
  }
  return out;
}

Status ShardCore::restore(EntrySnapshot s) {
  const EntryId id{s.key, s.chunk_index};
  if (entries_.contains(id)) {
    return make_error(ErrorCode::kInvalidArgument, "restore: {} exists already", entry_name(id));
  }
  if (s.dtype != proto::DType::kFloat32) {
    return make_error(ErrorCode::kCorrupt, "restore: {} has dtype {}; the store holds float32",
                      entry_name(id), proto::dtype_name(s.dtype));
  }
  std::uint64_t total = 1;
  for (std::uint64_t d : s.shape) {
    if (d != 0 && total > proto::kMaxElements / d) {
      return make_error(ErrorCode::kCorrupt, "restore: {} has an oversized shape", entry_name(id));
    }
    total *= d;
  }
  if (s.num_chunks == 0 || s.chunk_index >= s.num_chunks || s.offset_elements > total ||
      s.params.size() > total - s.offset_elements) {
    return make_error(ErrorCode::kCorrupt,
                      "restore: {} chunk [{}, +{}) does not fit its shape of {} elements",
                      entry_name(id), s.offset_elements, s.params.size(), total);
  }
  if (Status st = optimizer_.check_state(s.optimizer, s.params.size()); !st) {
    Error err = st.error();
    err.with_context(fmt::format("restore: {}", entry_name(id)));
    return tl::unexpected(err);
  }
  auto e = std::make_unique<Entry>();
  e->id = id;
  e->num_chunks = s.num_chunks;
  e->offset_elements = s.offset_elements;
  e->dtype = s.dtype;
  e->shape = std::move(s.shape);
  e->params = std::move(s.params);
  e->optimizer = std::move(s.optimizer);
  e->version = s.version;
  e->clocks = std::move(s.clocks);
  // A job restarted with another worker count: new ranks start at the version.
  e->clocks.resize(options_.num_workers,
                   options_.consistency == proto::Consistency::kBsp ? s.version : 0);
  entries_.emplace(id, std::move(e));
  return ok_status();
}

CoreStats ShardCore::stats() const {
  CoreStats s;
  s.num_entries = entries_.size();
  for (const auto& [id, e] : entries_) {
    s.param_bytes += e->params.size() * sizeof(float);
    s.parked_requests += e->parked.size();
  }
  for (const auto& [id, pending] : pending_inits_) s.parked_requests += pending.waiting.size();
  s.pushes_applied = pushes_applied_;
  s.pushes_duplicate = pushes_duplicate_;
  s.rounds_completed = rounds_completed_;
  s.replies_lent = replies_lent_;
  s.lent_copies = lent_copies_;
  return s;
}

}  // namespace ember::server
