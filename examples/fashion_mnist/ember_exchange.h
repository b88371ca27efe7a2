// EmberExchange: the Trainer's GradientExchange (trainer.h) over Ember's
// worker client (worker/worker.h) — what turns the single-process training
// loop into data-parallel training through ember-server.
//
// Per job, start():
//   every rank registers the 2 * num_layers tensors with init(key, shape);
//   rank 0 passes its He-initialised values (the initial parameters), the
//   other ranks wait inside init until rank 0's values are on the servers.
//   Then every rank pulls all tensors into its value buffers, so all ranks
//   start from the same bytes.
// Per step s (overlap of communication with backward and the next forward):
//   gradients_ready(s, {tensor}) runs inside Mlp::backward as soon as the
//   tensor's gradient is final (b_l, then each row block of W_l; last layer
//   first). It enqueues push_pull(key, grad, value) in the step's Pipeline
//   and flushes, and returns without waiting: the gradient leaves from its
//   page-pool block while backward goes on, and the server's reply — the
//   parameters for step s+1, after the optimizer ran on the averaged
//   gradients under bsp — lands in the value buffer in place (the model does
//   not read it before asking: mlp.h's overlap contract).
//   finish_step(s) returns at once: nothing waits at the end of a step.
//   await_parameters(s+1, {tensor}) runs inside the next Mlp::forward right
//   before the tensor is read and waits for that tensor's reply only, so the
//   round trip of W1's last row block overlaps with the next batch's
//   gathering and the forward of W1's first blocks.
//   sync() (end of epoch) waits for every reply.
// Per epoch, finish_epoch(): a barrier, so that every worker has finished
// the epoch's pushes before anyone evaluates or leaves, then a pull of every
// tensor, so that every worker evaluates the same parameters (matters under
// asp and ssp, where workers drift apart; cheap under bsp: once per epoch).
//
// Steps. The Trainer counts steps from 0; the worker client counts pushes per
// key from the step the servers report at init (0 for a fresh job). A server
// that already holds the keys at a later step (a previous job's state, e.g.
// restored from a checkpoint) is refused at start(): this trainer always
// starts from its seed at step 0. Each push_pull checks that the client's
// step for the key is the trainer's step plus the key's offset (0 until a
// resync).
//
// Resync after a server restart. A server killed during training (kill -9,
// crash) restores its newest checkpoint, which may be older than the job's
// step; under bsp it refuses the workers' next push_pull at once with
// kOutOfStep and the client sets Worker::step(key) to the server's step
// (worker.h, "Out of step"). When an awaited push_pull (await_parameters,
// sync, finish_epoch's pulls) fails so, the exchange waits for every other
// operation in flight (kOutOfStep or success; any other error stays fatal),
// pulls every tensor at the client's step(key) into its value buffer (the
// server's parameters), and from then on keeps per key
//   offset[key] = client step - trainer step
// (signed; keys restored from one checkpoint can differ by a round), so a
// push of trainer step s goes out at client step s + offset[key]. It logs
// one warning per resync (logger "fmnist", level warn) naming the trainer
// step, the servers' steps (min..max), the steps of gradients lost and the
// cause, ending with docs/troubleshooting.md#out-of-step. The Trainer's
// epoch and step counts are untouched: the epoch still ends after its
// steps; the gradients of the lost steps are simply not in the model. Every
// worker of a bsp job gets the same refusal and resumes at the same server
// steps. A pull refused while resyncing (the server restarted again) is
// fatal.
//
// Buffers. Bind the model to page-pool memory (bind_pool_buffers) so that
// gradients leave without a copy (tcp: gathered write; shm: by reference).
// From gradients_ready(s, l) until finish_step(s) returns, the worker's I/O
// threads read layer l's gradient buffers and write its value buffers.
//
// Thread-safety: one training thread calls every method (as trainer.h
// requires). The Worker is borrowed and must outlive the exchange; the
// exchange must outlive every buffer it was handed (the destructor waits for
// operations still in flight, each bounded by [worker] request_timeout).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/error.h"
#include "examples/fashion_mnist/mlp.h"
#include "examples/fashion_mnist/trainer.h"
#include "worker/worker.h"

namespace ember::fashion_mnist {

// The model's value and gradient storage in the worker's page pool (one
// block each, num_parameters() float32). Move-only; the Worker must outlive
// it, and it must outlive the model's use of the buffers.
struct PoolModelBuffers {
  TensorBuffer values;
  TensorBuffer grads;
};

// Allocates the two blocks from `worker` and binds `model` to them
// (Mlp::bind). Never blocks. Errors: those of Mlp::bind (none for a
// well-formed model). The blocks fall back to heap memory when the pool is
// exhausted (TensorBuffer::in_pool() says which; gradients then cost a copy
// over shm).
Result<PoolModelBuffers> bind_pool_buffers(Worker& worker, Mlp& model);

class EmberExchange final : public GradientExchange {
 public:
  // Borrows `worker` (connected: Worker::create succeeded).
  explicit EmberExchange(Worker& worker) : worker_(&worker) {}
  // Waits for operations still in flight (after an error) so that no I/O
  // thread touches the model's buffers afterwards.
  ~EmberExchange() override;
  EmberExchange(const EmberExchange&) = delete;
  EmberExchange& operator=(const EmberExchange&) = delete;

  // init every tensor (shape [rows, cols]), then pull every tensor into its
  // value buffer. Blocks until done. Errors: the worker's (kShapeMismatch:
  // the servers hold a key with another shape — another model; kWorkerLost:
  // rank 0 lost before it registered the keys; kTimeout, kClosed), each
  // naming the tensor; kInvalidArgument when the servers are at step > 0 for
  // a key (a previous job's parameters: start fresh servers) or disagree
  // between keys.
  Status start(std::span<const Parameter> params) override;

  // Enqueues push_pull for each tensor and flushes. Does not wait for
  // replies. A flush that meets a lost connection (kClosed, kIo) is not an
  // error here: the operations' Handles report it (re-sent after a
  // reconnect, or failed) when awaited. Errors: other send errors; kInternal when the client's
  // step for a key is not the trainer's plus the key's offset (a bug: a
  // second push in a step), or a tensor was not passed to start().
  Status gradients_ready(std::uint64_t step, std::span<const Parameter> tensors) override;

  // Waits for the push_pull of each tensor still in flight. A kOutOfStep
  // reply resyncs (file comment) and returns OK with the server's
  // parameters in the value buffers. Errors: the operation's (kWorkerLost,
  // kStale, kTimeout, kClosed, ...) naming the tensor and step; kInternal
  // when the reply says the server is behind `step`; the resync pulls'
  // errors (kOutOfStep included), naming the tensor.
  Status await_parameters(std::uint64_t step, std::span<const Parameter> tensors) override;

  // Nothing to wait for (see the file comment); ends the step's Pipeline
  // scope (which flushes).
  Status finish_step(std::uint64_t step) override;

  // Waits for every operation in flight; the first error, as
  // await_parameters (kOutOfStep resyncs). Every operation is waited for
  // either way.
  Status sync() override;

  // sync(), a barrier, then a pull of every tensor into its value buffer.
  // Blocks. Errors: sync's, the barrier's and the pulls' (kWorkerLost,
  // kTimeout, kClosed), naming the epoch (and the tensor).
  Status finish_epoch(std::uint32_t epoch) override;

  // Tensors registered by start() (2 per layer).
  std::size_t num_tensors() const { return tensors_.size(); }

 private:
  struct InFlight {
    Handle handle;
    std::uint64_t key = 0;
    std::string name;
    std::uint64_t min_reply_step = 0;  // the reply must be at least this step
  };
  // Waits for one operation; its error (or a reply step below
  // min_reply_step) with `what` and the tensor named.
  static Status finish(const InFlight& op, std::string_view what);
  // Waits for every in-flight operation (per tensor and the list); returns
  // the first error. Clears both and ends the pipeline. With `resync`,
  // kOutOfStep errors (`already` is one failed before the call, or OK) lead
  // to resync(next_step_) instead, unless another error came too (that one
  // is returned).
  Status drain(std::string_view what, bool resync, Status already = ok_status());
  // Nothing in flight: pulls every tensor at the client's step(key), sets
  // the offsets for trainer step `next_step` and logs the warning.
  Status resync(std::uint64_t next_step);
  // Index of `p` in tensors_, or an error when start() did not register it.
  Result<std::size_t> index_of(const Parameter& p) const;

  Worker* worker_;
  std::vector<Parameter> tensors_;  // key order, as passed to start()
  std::optional<Pipeline> pipeline_;
  std::uint64_t pipeline_step_ = 0;
  // Per tensor (tensors_ order): its push_pull in flight, if any.
  std::vector<std::optional<InFlight>> pending_;
  // init / pull operations of start() and finish_epoch().
  std::vector<InFlight> in_flight_;
  // Per tensor: client step - trainer step (0 until a resync).
  std::vector<std::int64_t> offset_;
  // The trainer step the next gradients_ready will carry (the last one + 1).
  std::uint64_t next_step_ = 0;
};

}  // namespace ember::fashion_mnist
