// EmberExchange (see ember_exchange.h).
#include "examples/fashion_mnist/ember_exchange.h"

#include <algorithm>
#include <array>
#include <utility>

#include <fmt/format.h>

#include "common/base/logging.h"

namespace ember::fashion_mnist {
namespace {

tl::unexpected<Error> with_context(Error e, std::string_view context) {
  e.with_context(context);
  return tl::unexpected<Error>(std::move(e));
}

}  // namespace

Result<PoolModelBuffers> bind_pool_buffers(Worker& worker, Mlp& model) {
  const std::size_t bytes = model.num_parameters() * sizeof(float);
  PoolModelBuffers buffers{worker.allocate(bytes), worker.allocate(bytes)};
  EMBER_TRY(model.bind(buffers.values.floats(), buffers.grads.floats()));
  return buffers;
}

EmberExchange::~EmberExchange() { (void)drain("abandoned operation", /*resync=*/false); }

Status EmberExchange::finish(const InFlight& op, std::string_view what) {
  const Result<std::uint64_t> r = op.handle.wait();
  if (!r) return with_context(r.error(), fmt::format("{} of {} (key {})", what, op.name, op.key));
  if (*r < op.min_reply_step) {
    return make_error(ErrorCode::kInternal,
                      "{} of {} (key {}): the server replied with step {}, expected at least {}",
                      what, op.name, op.key, *r, op.min_reply_step);
  }
  return ok_status();
}

Status EmberExchange::settle(const InFlight& op, std::string_view what) {
  Status st = finish(op, what);
  if (st || st.error().code() != ErrorCode::kStale) return st;
  if (!op.resent) {
    // Left out while its connection was down (shrink), this process lost
    // its place in the job: the others' step is ahead of this trainer's, and
    // going forward would also put its epoch barriers out of step with
    // theirs. A restart with --rejoin takes the servers' step and parameters.
    return with_context(
        st.error(),
        fmt::format("rank {} was left out of the job while its connection was down "
                    "(on_worker_loss = \"shrink\") and the other workers went on; this trainer "
                    "goes only back, not ahead: restart this rank with its usual command plus "
                    "--rejoin to continue from the servers' step (see "
                    "docs/troubleshooting.md#worker-loss)",
                    worker_->rank()));
  }
  const Parameter& p = tensors_[*op.resent];
  log::logger("fmnist")->info(
      "rank {}: the round of step {} for {} (key {}) closed without this rank while it was "
      "gone (on_worker_loss = \"shrink\"); its gradient of that step is dropped and the "
      "parameters after the round are pulled",
      worker_->rank(), op.min_reply_step - 1, p.name, p.key);
  return finish(InFlight{worker_->pull(p.key, p.value), p.key, p.name, op.min_reply_step, {}},
                "pull after a closed round");
}

Status EmberExchange::drain(std::string_view what, bool resync, Status already) {
  // The first kOutOfStep error and the first other error, kept apart: only
  // the latter is fatal when resyncing.
  Status out_of_step = ok_status();
  Status other = ok_status();
  auto note = [&](Status s) {
    if (s) return;
    if (s.error().code() == ErrorCode::kOutOfStep) {
      if (out_of_step) out_of_step = std::move(s);
    } else if (other) {
      other = std::move(s);
    }
  };
  note(std::move(already));
  for (std::optional<InFlight>& op : pending_) {
    if (!op) continue;
    note(settle(*op, what));  // keep waiting after an error: nothing may outlive this
    op.reset();
  }
  for (const InFlight& op : in_flight_) note(finish(op, what));
  in_flight_.clear();
  pipeline_.reset();
  if (!other) return other;
  if (!out_of_step && resync) return this->resync(next_step_);
  return out_of_step;
}

Status EmberExchange::resync(std::uint64_t next_step) {
  // Nothing is in flight. A refused key's client step(key) is the server's
  // step; a key whose push_pull was answered before the server died is at
  // the job's step, which the restored server refuses in turn (setting
  // step(key) to its own): pull that key again at the step it named. A
  // second refusal for one key (the server restarted once more) is fatal.
  std::vector<std::uint64_t> server_steps(tensors_.size());
  std::vector<std::size_t> to_pull(tensors_.size());
  for (std::size_t i = 0; i < to_pull.size(); ++i) to_pull[i] = i;
  for (int attempt = 0; !to_pull.empty(); ++attempt) {
    std::vector<Handle> pulls;
    pulls.reserve(to_pull.size());
    for (const std::size_t i : to_pull) {
      const Parameter& p = tensors_[i];
      server_steps[i] = worker_->step(p.key);
      pulls.push_back(worker_->pull(p.key, p.value, server_steps[i]));
    }
    std::vector<std::size_t> again;
    Status first = ok_status();
    for (std::size_t j = 0; j < pulls.size(); ++j) {
      const Result<std::uint64_t> r = pulls[j].wait();  // every pull is waited for
      if (r || !first) continue;
      const Parameter& p = tensors_[to_pull[j]];
      if (r.error().code() == ErrorCode::kOutOfStep && attempt == 0) {
        again.push_back(to_pull[j]);
      } else {
        first = with_context(r.error(), fmt::format("resync pull after a server restart of {} "
                                                    "(key {}, step {})",
                                                    p.name, p.key, server_steps[to_pull[j]]));
      }
    }
    EMBER_TRY(first);
    to_pull = std::move(again);
  }
  // The job goes back to the servers' step: the same on every rank,
  // whatever step each rank was at (ember_exchange.h, "Resync").
  const auto [min_it, max_it] = std::minmax_element(server_steps.begin(), server_steps.end());
  const std::uint64_t back_to = *min_it;
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    offset_[i] = static_cast<std::int64_t>(server_steps[i] - back_to);
  }
  std::fill(pushed_at_resume_.begin(), pushed_at_resume_.end(), false);
  log::logger("fmnist")->warn(
      "rank {}: the servers restarted from a checkpoint of step {} (tensors at steps {}..{}) "
      "while this rank was at step {}: training goes back to step {} and computes the {} "
      "step(s) since again; see docs/troubleshooting.md#out-of-step",
      worker_->rank(), back_to, back_to, *max_it, next_step, back_to,
      next_step > back_to ? next_step - back_to : 0);
  next_step_ = back_to;
  rewind_ = back_to;
  return ok_status();
}

Result<std::size_t> EmberExchange::index_of(const Parameter& p) const {
  if (!tensors_.empty() && p.key >= tensors_.front().key) {
    const std::size_t i = p.key - tensors_.front().key;
    if (i < tensors_.size() && tensors_[i].key == p.key) return i;
  }
  return make_error(ErrorCode::kInternal,
                    "tensor {} (key {}) was not registered by EmberExchange::start", p.name, p.key);
}

Status EmberExchange::start(std::span<const Parameter> params) {
  tensors_.assign(params.begin(), params.end());
  for (std::size_t i = 1; i < tensors_.size(); ++i) {
    if (tensors_[i].key != tensors_[0].key + i) {
      return make_error(ErrorCode::kInvalidArgument,
                        "EmberExchange: tensor {} has key {}, expected {} (keys must be "
                        "consecutive, in order, as Mlp::parameters() gives them)",
                        tensors_[i].name, tensors_[i].key, tensors_[0].key + i);
    }
  }
  pending_.clear();
  pending_.resize(tensors_.size());
  offset_.assign(tensors_.size(), 0);
  next_step_ = 0;
  const bool rank0 = worker_->rank() == 0;
  std::vector<std::array<std::uint64_t, 2>> shapes(tensors_.size());
  std::vector<Handle> inits;
  inits.reserve(tensors_.size());
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const Parameter& p = tensors_[i];
    shapes[i] = {p.rows, p.cols};
    // Rank 0's values are the job's initial parameters; the other ranks
    // register the shape and wait for them.
    inits.push_back(worker_->init(p.key, shapes[i],
                                  rank0 ? std::span<const float>(p.value) : std::span<const float>()));
  }
  Status first = ok_status();
  std::vector<std::uint64_t> steps(tensors_.size(), 0);
  for (std::size_t i = 0; i < inits.size(); ++i) {
    const Result<std::uint64_t> r = inits[i].wait();
    if (!first) continue;
    const Parameter& p = tensors_[i];
    if (!r) {
      first = with_context(r.error(), fmt::format("init of {} (key {}, shape [{}, {}])", p.name,
                                                  p.key, p.rows, p.cols));
    } else if (*r != 0 && !options_.rejoin) {
      first = make_error(
          ErrorCode::kInvalidArgument,
          "init of {} (key {}): the servers already hold this tensor at step {}. If this worker "
          "is a restarted rank of the job they are running, pass --rejoin to continue from "
          "their step (see docs/troubleshooting.md#worker-loss). Otherwise these are the "
          "parameters of an earlier job (or restored from a checkpoint), and this trainer starts "
          "from its seed at step 0: start fresh servers (or give them an empty "
          "server.checkpoint_dir)",
          p.name, p.key, *r);
    } else {
      steps[i] = *r;
    }
  }
  EMBER_TRY(first);

  // Rejoin (ember_exchange.h): continue from the smallest step; a key one
  // ahead already has this rank's push of that step.
  const auto [min_it, max_it] = std::minmax_element(steps.begin(), steps.end());
  const std::uint64_t min_step = steps.empty() ? 0 : *min_it;
  const std::uint64_t max_step = steps.empty() ? 0 : *max_it;
  if (max_step - min_step > 1) {
    const std::size_t lo = static_cast<std::size_t>(min_it - steps.begin());
    const std::size_t hi = static_cast<std::size_t>(max_it - steps.begin());
    return make_error(ErrorCode::kInvalidArgument,
                      "rejoin: the servers hold {} (key {}) at step {} but {} (key {}) at step "
                      "{}; a rank restarted during a step finds its tensors at most one step "
                      "apart, so these are not one running job's (start fresh servers, without "
                      "--rejoin)",
                      tensors_[lo].name, tensors_[lo].key, min_step, tensors_[hi].name,
                      tensors_[hi].key, max_step);
  }
  resume_step_ = max_step > 0 ? min_step : 0;
  next_step_ = resume_step_;
  pushed_at_resume_.assign(tensors_.size(), false);
  for (std::size_t i = 0; i < steps.size(); ++i) pushed_at_resume_[i] = steps[i] > min_step;
  if (const auto ahead = std::count(pushed_at_resume_.begin(), pushed_at_resume_.end(), true);
      ahead > 0) {
    log::logger("fmnist")->info(
        "rank {} rejoins at step {}: {} of {} tensor(s) are at step {} already (this rank pushed "
        "them before it stopped; re-sent, they are acknowledged without effect), so step {} "
        "uses their parameters after it",
        worker_->rank(), min_step, ahead, tensors_.size(), min_step + 1, min_step);
  }

  // Every rank (rank 0 included, for uniformity) starts from the servers'
  // copy: for a rank that rejoins, each tensor at the step init reported
  // (the client's step(key)).
  for (const Parameter& p : tensors_) {
    in_flight_.push_back(InFlight{worker_->pull(p.key, p.value), p.key, p.name, 0, {}});
  }
  return drain("initial pull", /*resync=*/false);
}

Status EmberExchange::resume_after_epoch(std::uint32_t epoch) {
  rejoin_barrier_ = RejoinBarrier{worker_->barrier(), epoch};
  return ok_status();
}

Status EmberExchange::gradients_ready(std::uint64_t step, std::span<const Parameter> tensors) {
  if (!pipeline_ || pipeline_step_ != step) {
    pipeline_.reset();  // the previous step's scope: flushed, its handles stay valid
    pipeline_.emplace(worker_->pipeline());
    pipeline_step_ = step;
  }
  for (const Parameter& p : tensors) {
    EMBER_ASSIGN_OR_RETURN(const std::size_t i, index_of(p));
    const std::uint64_t client_step = worker_->step(p.key);
    // Rejoin: at the resume step, a key one ahead already has this rank's
    // push of it on the servers (ember_exchange.h).
    const bool pushed = pushed_at_resume_[i] && step == resume_step_;
    const auto expected = static_cast<std::int64_t>(step) + offset_[i] + (pushed ? 1 : 0);
    if (static_cast<std::int64_t>(client_step) != expected || pending_[i]) {
      return make_error(ErrorCode::kInternal,
                        "push of {} (key {}) for trainer step {}: the worker client is at step {} "
                        "for this key, expected {} (offset {}){} (one push per key and step is "
                        "expected)",
                        p.name, p.key, step, client_step, expected, offset_[i],
                        pending_[i] ? " and its previous push_pull was not awaited" : "");
    }
    if (pushed) {
      // Re-sent at its own step: acknowledged without effect, answered with
      // the parameters after that step's round (client_step is step + 1).
      pushed_at_resume_[i] = false;
      pending_[i] = InFlight{worker_->push_pull(p.key, p.grad, p.value, step), p.key, p.name,
                             client_step, i};
      continue;
    }
    // The reply to a push_pull of client step c carries the step to compute
    // next: c + 1 once the push is in.
    pending_[i] = InFlight{pipeline_->enqueue_push_pull(p.key, p.grad, p.value), p.key, p.name,
                           client_step + 1, {}};
  }
  next_step_ = step + 1;
  // A connection lost while flushing (kClosed, kIo: a server killed) is not
  // this step's error: the client re-sends the enqueued requests after a
  // reconnect ([worker] resend_attempts) or fails their Handles, and
  // await_parameters / sync report that outcome (a restarted server's
  // kOutOfStep included). Other flush errors are returned.
  if (Status s = pipeline_->flush();
      !s && s.error().code() != ErrorCode::kClosed && s.error().code() != ErrorCode::kIo) {
    return with_context(s.error(), fmt::format("sending the gradient of {} at step {}",
                                               tensors.empty() ? "?" : tensors[0].name, step));
  }
  return ok_status();
}

Status EmberExchange::await_parameters(std::uint64_t step, std::span<const Parameter> tensors) {
  for (const Parameter& p : tensors) {
    EMBER_ASSIGN_OR_RETURN(const std::size_t i, index_of(p));
    if (!pending_[i]) continue;
    std::optional<InFlight> op = std::move(pending_[i]);
    pending_[i].reset();
    Status st = settle(*op, "push_pull");
    if (!st && st.error().code() == ErrorCode::kOutOfStep) {
      // The server restarted from an older checkpoint: wait for the rest,
      // then continue from the server's parameters (ember_exchange.h).
      st = drain("push_pull", /*resync=*/true, std::move(st));
    }
    if (!st) return with_context(st.error(), fmt::format("step {}", step > 0 ? step - 1 : 0));
  }
  return ok_status();
}

Status EmberExchange::finish_step(std::uint64_t step) {
  (void)step;
  pipeline_.reset();  // flushes; the replies are awaited per tensor
  return ok_status();
}

Status EmberExchange::sync() { return drain("push_pull", /*resync=*/true); }

Status EmberExchange::finish_epoch(std::uint32_t epoch) {
  if (Status s = sync(); !s) {
    return with_context(s.error(), fmt::format("end of epoch {}", epoch));
  }
  bool barrier_done = false;
  if (rejoin_barrier_) {
    // Sent when this rank rejoined after epoch e = rejoin_barrier_->epoch
    // (ember_exchange.h): the barrier after epoch x completes in generation
    // x - 1.
    const RejoinBarrier sent = std::move(*rejoin_barrier_);
    rejoin_barrier_.reset();
    const Result<std::uint64_t> g = sent.handle.wait();
    if (!g) {
      return with_context(g.error(), fmt::format("barrier sent on rejoining after epoch {}",
                                                 sent.epoch));
    }
    if (epoch == sent.epoch || *g + 1 == epoch) {
      barrier_done = true;  // it was this epoch's barrier
    } else if (*g + 1 > epoch && worker_->num_workers() == 1) {
      // Alone, every barrier completes at once, the rejoin barriers of
      // earlier attempts (killed after sending theirs) included, so the
      // generation runs ahead of the epochs; there is nobody to wait for.
      barrier_done = true;
    } else if (*g + 1 != sent.epoch) {
      return make_error(ErrorCode::kInternal,
                        "barrier after epoch {}: the barrier this rank sent on rejoining after "
                        "epoch {} completed in generation {}, neither epoch {}'s ({}) nor epoch "
                        "{}'s ({}): the servers' barrier count does not follow the epochs (were "
                        "they restarted?); restart the job",
                        epoch, sent.epoch, *g, sent.epoch, sent.epoch - 1, epoch, epoch - 1);
    }
  }
  if (!barrier_done) {
    const Result<std::uint64_t> r = worker_->barrier().wait();
    if (!r) return with_context(r.error(), fmt::format("barrier after epoch {}", epoch));
  }
  // Every worker's pushes of the epoch are in: fetch the parameters that
  // include them all, so that every worker evaluates the same model (under
  // asp and ssp a worker's last reply predates the others' last pushes;
  // under bsp this returns the bytes already here).
  for (const Parameter& p : tensors_) {
    in_flight_.push_back(InFlight{worker_->pull(p.key, p.value), p.key, p.name, 0, {}});
  }
  return drain(fmt::format("pull after epoch {}", epoch), /*resync=*/true);
}

}  // namespace ember::fashion_mnist
