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
// that already holds the keys at a later step is refused at start() unless
// the exchange was made with rejoin (below): without it, this trainer
// starts from its seed at step 0. Each push_pull checks that the client's
// step for the key is the trainer's step plus the key's offset (0 until a
// resync).
//
// Rejoin (EmberExchangeOptions::rejoin; fmnist-worker --rejoin). A rank
// restarted while its job runs (kill -9, crash; the servers' on_worker_loss
// = "wait" kept the job waiting for it) finds the keys at steps > 0: init
// replies with the step to compute next, the round's version under bsp (the
// rank's own count of pushes under asp/ssp). The rank died at some step s
// during backward, after pushing some of that step's tensors: their round of
// s completed once the others pushed, so they are at s + 1, the rest at s.
// start() then takes s = the smallest step over the tensors as
// resume_step() (more than one apart is refused: not one job's rank), pulls
// every tensor at its own step (the job's current parameters) and keeps
// every offset at 0: the other ranks push trainer step t at client step t
// for every key, and so must this one (an offset of +1 would pair this
// rank's step t with their t + 1 forever, and the job would deadlock at the
// end of an epoch). A tensor already at s + 1 has this rank's push of s on
// the servers: gradients_ready(s) re-sends it at step s explicitly
// (Worker::push_pull with a step), which the servers acknowledge without
// applying (one push per worker, key and step) and answer with the
// parameters after round s; from step s + 1 on every key is pushed as
// usual. Under on_worker_loss = "shrink" a tensor at s + 1 may instead be
// one whose round s closed without this rank (left out while it was gone):
// the server refuses the re-send with kStale, and the exchange pulls that
// tensor's parameters after round s (this rank's gradient of it for step s
// is dropped, as the round already closed) and logs it once. The gradients of that one step are computed with those tensors
// already at s + 1, so it is not bit-identical to an uninterrupted run.
// When s is the start of an epoch, the others may be waiting in the end of
// the previous epoch's barrier (the rank died before it) or past it:
// resume_after_epoch(e) sends a barrier at once and does not wait for it;
// the next finish_epoch waits for it and tells the two cases apart by the
// generation it completed in (the barrier after epoch x is generation x - 1:
// one per epoch since the servers started). A rank that rejoins with
// nothing in flight on the servers (every key at 0) just starts the job.
//
// Resync after a server restart. A server killed during training (kill -9,
// crash) restores its newest checkpoint, which may be older than the job's
// step; under bsp it refuses the workers' next push_pull at once with
// kOutOfStep and the client sets Worker::step(key) to the server's step
// (worker.h, "Out of step"). When an awaited push_pull (await_parameters,
// sync, finish_epoch's pulls) fails so, the exchange waits for every other
// operation in flight (kOutOfStep or success; any other error stays fatal),
// pulls every tensor at the client's step(key) into its value buffer (the
// server's parameters) and sends training back to the servers' step s (the
// smallest over the tensors): take_rewind() returns s, and the Trainer
// computes steps s, s + 1, ... again (trainer.h, GradientExchange::
// take_rewind). It logs one warning per resync (logger "fmnist", level
// warn) naming the checkpoint's step, the tensors' steps (min..max), the
// step this rank was at and the steps computed again, ending with
// docs/troubleshooting.md#out-of-step.
// Why back to s, rather than going on from each rank's own step: under bsp
// one rank can be a step ahead of another (it has the replies of step t - 1
// and pushed step t; the other waits for its replies of t - 1, or they were
// lost with the server), so the ranks' own steps differ; s is the same on
// every rank. With each rank's own step kept, rank 0's step t would pair
// with rank 1's t - 1 for the rest of the epoch, and at its end rank 0
// would wait in the barrier while rank 1 waits for a round rank 0 never
// joins (a deadlock until request_timeout).
// Keys restored from one checkpoint can differ by a round (the checkpoint
// caught a step's rounds half done); from then on the exchange keeps per
// key
//   offset[key] = client step - trainer step  (server step(key) - s, >= 0)
// so a push of trainer step t goes out at client step t + offset[key]: the
// same pairing on every rank. A pull refused while resyncing (the server
// restarted again) is fatal.
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
#include <utility>
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

struct EmberExchangeOptions {
  // This rank is a restarted worker of a job the servers are running:
  // continue from the servers' step (file comment, "Rejoin") instead of
  // refusing servers that hold the keys at a step > 0.
  bool rejoin = false;
};

class EmberExchange final : public GradientExchange {
 public:
  // Borrows `worker` (connected: Worker::create succeeded).
  explicit EmberExchange(Worker& worker, EmberExchangeOptions options = {})
      : worker_(&worker), options_(options) {}
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
  // a key without rejoin (the message says: a restarted rank passes
  // --rejoin; else a previous job's parameters, start fresh servers), or,
  // with rejoin, when the keys' steps are more than one apart.
  Status start(std::span<const Parameter> params) override;

  // After start(): the step to continue from (file comment, "Rejoin"); 0
  // for a fresh job.
  std::uint64_t resume_step() const override { return resume_step_; }

  // Sends a barrier and returns without waiting for it; the next
  // finish_epoch waits for it (file comment, "Rejoin"). Errors: none here
  // (the barrier's are finish_epoch's).
  Status resume_after_epoch(std::uint32_t epoch) override;

  // Enqueues push_pull for each tensor and flushes. Does not wait for
  // replies. A flush that meets a lost connection (kClosed, kIo) is not an
  // error here: the operations' Handles report it (re-sent after a
  // reconnect, or failed) when awaited. Errors: other send errors; kInternal when the client's
  // step for a key is not the trainer's plus the key's offset (a bug: a
  // second push in a step), or a tensor was not passed to start().
  Status gradients_ready(std::uint64_t step, std::span<const Parameter> tensors) override;

  // Waits for the push_pull of each tensor still in flight. A kOutOfStep
  // reply resyncs (file comment) and returns OK with the server's
  // parameters in the value buffers and take_rewind() set. Errors: the
  // operation's (kWorkerLost, kStale, kTimeout, kClosed, ...) naming the
  // tensor and step (kStale: this rank was left out under shrink while its
  // connection was down; the text says to restart it with --rejoin); kInternal
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
  // Blocks. After resume_after_epoch(e), its barrier is waited for first:
  // in finish_epoch(e) it is the epoch's barrier; in finish_epoch(e + 1) it
  // is when it completed in epoch e + 1's generation (the others were past
  // epoch e's end when this rank rejoined), else a new barrier follows.
  // Errors: sync's, the barrier's and the pulls' (kWorkerLost, kTimeout,
  // kClosed), naming the epoch (and the tensor); kInternal when the rejoin
  // barrier completed in a generation that is neither (the servers
  // restarted, and their barrier count with them) in a job of several
  // workers (alone, a rank's barriers complete at once: a rank restarted
  // twice at one epoch's end has moved the count twice).
  Status finish_epoch(std::uint32_t epoch) override;

  // After a resync (file comment): the servers' step to go back to, once.
  std::optional<std::uint64_t> take_rewind() override {
    return std::exchange(rewind_, std::nullopt);
  }

  // Tensors registered by start() (2 per layer).
  std::size_t num_tensors() const { return tensors_.size(); }

 private:
  struct InFlight {
    Handle handle;
    std::uint64_t key = 0;
    std::string name;
    std::uint64_t min_reply_step = 0;  // the reply must be at least this step
    // Rejoin: the re-sent push of the resume step, for tensors_[*resent].
    std::optional<std::size_t> resent;
  };
  // Waits for one operation; its error (or a reply step below
  // min_reply_step) with `what` and the tensor named.
  static Status finish(const InFlight& op, std::string_view what);
  // finish(), except that a rejoin re-send refused with kStale (the round
  // closed without this rank: on_worker_loss = "shrink" left it out while it
  // was gone) pulls that tensor's parameters after the round instead; any
  // other kStale (left out while its connection was down, same process)
  // says to restart the rank with --rejoin.
  Status settle(const InFlight& op, std::string_view what);
  // Waits for every in-flight operation (per tensor and the list); returns
  // the first error. Clears both and ends the pipeline. With `resync`,
  // kOutOfStep errors (`already` is one failed before the call, or OK) lead
  // to resync(next_step_) instead, unless another error came too (that one
  // is returned).
  Status drain(std::string_view what, bool resync, Status already = ok_status());
  // Nothing in flight: pulls every tensor at the client's step(key), sets
  // the rewind and the offsets, and logs the warning (`next_step`: the step
  // this rank was at).
  Status resync(std::uint64_t next_step);
  // Index of `p` in tensors_, or an error when start() did not register it.
  Result<std::size_t> index_of(const Parameter& p) const;

  Worker* worker_;
  EmberExchangeOptions options_;
  std::vector<Parameter> tensors_;  // key order, as passed to start()
  std::optional<Pipeline> pipeline_;
  std::uint64_t pipeline_step_ = 0;
  // Per tensor (tensors_ order): its push_pull in flight, if any.
  std::vector<std::optional<InFlight>> pending_;
  // init / pull operations of start() and finish_epoch().
  std::vector<InFlight> in_flight_;
  // Per tensor: client step - trainer step (0 until a resync).
  std::vector<std::int64_t> offset_;
  // Set by resync until take_rewind() returns it.
  std::optional<std::uint64_t> rewind_;
  // The trainer step the next gradients_ready will carry (the last one + 1).
  std::uint64_t next_step_ = 0;
  // Rejoin: the step start() resumed at, and per tensor whether the servers
  // already hold this rank's push of that step (the key is one ahead).
  std::uint64_t resume_step_ = 0;
  std::vector<bool> pushed_at_resume_;
  // resume_after_epoch's barrier, until finish_epoch waits for it.
  struct RejoinBarrier {
    Handle handle;
    std::uint32_t epoch = 0;
  };
  std::optional<RejoinBarrier> rejoin_barrier_;
};

}  // namespace ember::fashion_mnist
