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
// Per step s (overlap of communication with backward):
//   gradients_ready(s, l, {W_l, b_l}) runs inside Mlp::backward as soon as
//   layer l is done (last layer first). It enqueues push_pull(key, grad,
//   value) for both tensors in a per-step Pipeline and flushes, and returns
//   without waiting: the gradient leaves from its page-pool block while
//   backward goes on with layer l-1, and the server's reply — the parameters
//   for step s+1, after the optimizer ran on the averaged gradients under
//   bsp — lands in the value buffer in place (the model does not read it
//   again before the next forward: mlp.h's overlap contract).
//   finish_step(s) waits for every reply of the step.
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
// step for the key is the trainer's step.
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

  // Enqueues push_pull for each tensor of the layer and flushes. Does not
  // wait for replies. Errors: the send's (kClosed, kIo); kInternal when the
  // client's step for a key is not the trainer's (a bug: a second push in a
  // step).
  Status gradients_ready(std::uint64_t step, std::size_t layer,
                         std::span<const Parameter> layer_params) override;

  // Waits for every push_pull of the step. Errors: the first failed
  // operation's (kWorkerLost, kStale, kTimeout, kClosed, ...) naming the
  // tensor and step; every operation is waited for either way. kInternal
  // when a reply says the server is behind the step just pushed.
  Status finish_step(std::uint64_t step) override;

  // Barrier, then a pull of every tensor into its value buffer. Blocks.
  // Errors: the barrier's and the pulls' (kWorkerLost, kTimeout, kClosed),
  // naming the epoch (and the tensor).
  Status finish_epoch(std::uint32_t epoch) override;

  // Tensors registered by start() (2 per layer).
  std::size_t num_tensors() const { return tensors_.size(); }

 private:
  struct InFlight {
    Handle handle;
    std::uint64_t key = 0;
    std::string name;
  };
  // Waits for every in-flight operation; returns the first error with
  // `what` and the tensor named. Clears the list and ends the pipeline.
  Status drain(std::string_view what, std::uint64_t min_reply_step);

  Worker* worker_;
  std::vector<Parameter> tensors_;  // key order, as passed to start()
  std::optional<Pipeline> pipeline_;
  std::vector<InFlight> in_flight_;
};

}  // namespace ember::fashion_mnist
