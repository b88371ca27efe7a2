// EmberExchange (see ember_exchange.h).
#include "examples/fashion_mnist/ember_exchange.h"

#include <array>
#include <utility>

#include <fmt/format.h>

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

EmberExchange::~EmberExchange() { (void)drain("abandoned operation"); }

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

Status EmberExchange::drain(std::string_view what) {
  Status first = ok_status();
  for (std::optional<InFlight>& op : pending_) {
    if (!op) continue;
    Status s = finish(*op, what);  // keep waiting after an error: nothing may outlive this
    if (first && !s) first = std::move(s);
    op.reset();
  }
  for (const InFlight& op : in_flight_) {
    Status s = finish(op, what);
    if (first && !s) first = std::move(s);
  }
  in_flight_.clear();
  pipeline_.reset();
  return first;
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
  for (std::size_t i = 0; i < inits.size(); ++i) {
    const Result<std::uint64_t> r = inits[i].wait();
    if (!first) continue;
    const Parameter& p = tensors_[i];
    if (!r) {
      first = with_context(r.error(), fmt::format("init of {} (key {}, shape [{}, {}])", p.name,
                                                  p.key, p.rows, p.cols));
    } else if (*r != 0) {
      first = make_error(
          ErrorCode::kInvalidArgument,
          "init of {} (key {}): the servers already hold this tensor at step {}, the parameters "
          "of an earlier job (or restored from a checkpoint). This trainer starts from its seed "
          "at step 0: start fresh servers (or give them an empty server.checkpoint_dir)",
          p.name, p.key, *r);
    }
  }
  EMBER_TRY(first);

  // Every rank (rank 0 included, for uniformity) starts from the servers'
  // copy.
  for (const Parameter& p : tensors_) {
    in_flight_.push_back(InFlight{worker_->pull(p.key, p.value), p.key, p.name, 0});
  }
  return drain("initial pull");
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
    if (client_step != step || pending_[i]) {
      return make_error(ErrorCode::kInternal,
                        "push of {} (key {}) for trainer step {}: the worker client is at step {} "
                        "for this key{} (one push per key and step is expected)",
                        p.name, p.key, step, client_step,
                        pending_[i] ? " and its previous push_pull was not awaited" : "");
    }
    // The reply to a push_pull of step s carries the step to compute next:
    // s + 1 once the push is in.
    pending_[i] =
        InFlight{pipeline_->enqueue_push_pull(p.key, p.grad, p.value), p.key, p.name, step + 1};
  }
  if (Status s = pipeline_->flush(); !s) {
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
    Status st = finish(*op, "push_pull");
    if (!st) return with_context(st.error(), fmt::format("step {}", step > 0 ? step - 1 : 0));
  }
  return ok_status();
}

Status EmberExchange::finish_step(std::uint64_t step) {
  (void)step;
  pipeline_.reset();  // flushes; the replies are awaited per tensor
  return ok_status();
}

Status EmberExchange::sync() { return drain("push_pull"); }

Status EmberExchange::finish_epoch(std::uint32_t epoch) {
  if (Status s = sync(); !s) {
    return with_context(s.error(), fmt::format("end of epoch {}", epoch));
  }
  const Result<std::uint64_t> r = worker_->barrier().wait();
  if (!r) return with_context(r.error(), fmt::format("barrier after epoch {}", epoch));
  // Every worker's pushes of the epoch are in: fetch the parameters that
  // include them all, so that every worker evaluates the same model (under
  // asp and ssp a worker's last reply predates the others' last pushes;
  // under bsp this returns the bytes already here).
  for (const Parameter& p : tensors_) {
    in_flight_.push_back(InFlight{worker_->pull(p.key, p.value), p.key, p.name, 0});
  }
  return drain(fmt::format("pull after epoch {}", epoch));
}

}  // namespace ember::fashion_mnist
