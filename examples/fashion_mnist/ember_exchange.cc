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

EmberExchange::~EmberExchange() {
  if (!in_flight_.empty()) (void)drain("abandoned operation", 0);
}

Status EmberExchange::drain(std::string_view what, std::uint64_t min_reply_step) {
  Status first = ok_status();
  for (const InFlight& op : in_flight_) {
    const Result<std::uint64_t> r = op.handle.wait();
    if (!first) continue;  // keep waiting: no operation may outlive this call
    if (!r) {
      first = with_context(r.error(), fmt::format("{} of {} (key {})", what, op.name, op.key));
    } else if (*r < min_reply_step) {
      first = make_error(ErrorCode::kInternal,
                         "{} of {} (key {}): the server replied with step {}, expected at least {}",
                         what, op.name, op.key, *r, min_reply_step);
    }
  }
  in_flight_.clear();
  pipeline_.reset();
  return first;
}

Status EmberExchange::start(std::span<const Parameter> params) {
  tensors_.assign(params.begin(), params.end());
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
    in_flight_.push_back(InFlight{worker_->pull(p.key, p.value), p.key, p.name});
  }
  return drain("initial pull", 0);
}

Status EmberExchange::gradients_ready(std::uint64_t step, std::size_t layer,
                                      std::span<const Parameter> layer_params) {
  if (!pipeline_) pipeline_.emplace(worker_->pipeline());
  for (const Parameter& p : layer_params) {
    const std::uint64_t client_step = worker_->step(p.key);
    if (client_step != step) {
      return make_error(ErrorCode::kInternal,
                        "push of {} (key {}) for trainer step {}: the worker client is at step {} "
                        "for this key (one push per key and step is expected)",
                        p.name, p.key, step, client_step);
    }
    in_flight_.push_back(
        InFlight{pipeline_->enqueue_push_pull(p.key, p.grad, p.value), p.key, p.name});
  }
  if (Status s = pipeline_->flush(); !s) {
    return with_context(s.error(),
                        fmt::format("sending the gradients of layer {} at step {}", layer + 1, step));
  }
  return ok_status();
}

Status EmberExchange::finish_step(std::uint64_t step) {
  // The reply to a push_pull of step s carries the step to compute next:
  // s + 1 once the push is in.
  return drain(fmt::format("push_pull for step {}", step), step + 1);
}

Status EmberExchange::finish_epoch(std::uint32_t epoch) {
  const Result<std::uint64_t> r = worker_->barrier().wait();
  if (!r) return with_context(r.error(), fmt::format("barrier after epoch {}", epoch));
  // Every worker's pushes of the epoch are in: fetch the parameters that
  // include them all, so that every worker evaluates the same model (under
  // asp and ssp a worker's last reply predates the others' last pushes;
  // under bsp this returns the bytes already here).
  for (const Parameter& p : tensors_) {
    in_flight_.push_back(InFlight{worker_->pull(p.key, p.value), p.key, p.name});
  }
  return drain(fmt::format("pull after epoch {}", epoch), 0);
}

}  // namespace ember::fashion_mnist
