// The training loop shared by the single-process baseline (fmnist-baseline)
// and the distributed worker: data, model and the gradient exchange are kept
// apart, so that a worker only implements GradientExchange with Ember's
// client (push each layer's gradient as backward produces it, pull the next
// parameters) and reuses everything else.
//
// One step, on the training thread:
//   gather this rank's batch (sampler.h) -> Mlp::forward, which calls
//   exchange.await_parameters(step, {tensor}) right before it first reads
//   each tensor -> Mlp::backward, which calls
//   exchange.gradients_ready(step, {tensor}) for each tensor as soon as its
//   gradient is final (last layer first, row blocks in order) ->
//   exchange.finish_step(step).
// So the round trip of a tensor's push_pull overlaps with the rest of
// backward, and with the next step's data gathering and the forward of every
// tensor before it: the training thread waits only for values that have not
// arrived when it needs them (no per-step barrier). After an epoch's last
// step: exchange.sync() (every operation in), then finish_epoch.
// The time spent inside the exchange calls is the time the training thread
// is blocked on communication; EpochStats::communication_share() divides it
// by the step time (the "communication share").
//
// Thread-safety: a Trainer and the model, datasets and exchange it borrows
// are used from one thread (the training thread) only.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "common/base/error.h"
#include "examples/fashion_mnist/data.h"
#include "examples/fashion_mnist/mlp.h"
#include "examples/fashion_mnist/optimizer.h"
#include "examples/fashion_mnist/sampler.h"

namespace ember::fashion_mnist {

// How a training process exchanges gradients for parameters. Every method is
// called on the training thread, in this order: start once; then per step
// await_parameters once per tensor (forward order, from step 1 on; a step's
// first forward finds the values start() left), gradients_ready once per
// tensor (backward order) and finish_step once; after an epoch's last step
// sync, then finish_epoch. `step` counts from 0 across epochs and is the same
// on every rank (a rank that rejoined a running job starts at
// resume_step()). An exchange may send training back to an earlier step
// (take_rewind): the step in progress is abandoned and the calls go on from
// that step.
//
// Buffer ownership: the Parameter spans are the model's bound buffers,
// owned by whoever bound them (for a worker: page-pool blocks it allocated).
class GradientExchange {
 public:
  virtual ~GradientExchange() = default;

  // Called once before the first step. `params` (key order) hold the
  // parameters initialised from the job seed, identical on every rank. On
  // return the value buffers must hold the parameters this rank starts from
  // (a worker: rank 0 registers the keys with these values, every rank
  // pulls). May block. An error stops training.
  virtual Status start(std::span<const Parameter> params) = 0;

  // Step `step` is about to read `tensors`' values (forward): blocks until
  // they hold the parameters for `step` (those after the gradients of
  // step - 1) and their grad buffers are no longer in use (the next backward
  // overwrites them). Default: nothing (an exchange that completes
  // everything in gradients_ready or finish_step). An error stops training.
  virtual Status await_parameters(std::uint64_t step, std::span<const Parameter> tensors) {
    (void)step;
    (void)tensors;
    return ok_status();
  }

  // `tensors`' gradients for `step` are final (mean over this rank's batch)
  // and the model has finished reading their values: from now until
  // await_parameters(step + 1, them) or sync() returns, the exchange may read
  // these grad buffers and overwrite these value buffers (a pull landing in
  // place), e.g. from an I/O thread. Should enqueue and return rather than
  // wait: backward of the other tensors runs after it returns. An error stops
  // the step and training.
  virtual Status gradients_ready(std::uint64_t step, std::span<const Parameter> tensors) = 0;

  // After backward. May return before the values for step + 1 are in (they
  // are awaited tensor by tensor); an exchange that blocks here instead is
  // correct too, just with less overlap. An error stops training.
  virtual Status finish_step(std::uint64_t step) = 0;

  // After the last finish_step of an epoch (and before evaluation): blocks
  // until every operation is complete and every value buffer holds the
  // latest parameters. Default: nothing. An error stops training.
  virtual Status sync() { return ok_status(); }

  // After the last finish_step of epoch `epoch` (1-based), before the
  // evaluation (e.g. a barrier). Default: nothing.
  virtual Status finish_epoch(std::uint32_t epoch) {
    (void)epoch;
    return ok_status();
  }

  // Rejoining a running job. After start(): the global step this rank
  // continues from (the first step it computes). 0 (the default) for a job
  // that starts now; > 0 when start() joined a job already running (a
  // restarted rank: EmberExchange with rejoin) and left the job's current
  // parameters in the value buffers. The Trainer then skips the steps
  // before it (trainer.h, Trainer::start).
  virtual std::uint64_t resume_step() const { return 0; }

  // Called by Trainer::start, once, when resume_step() is a positive
  // multiple of the steps per epoch: every step of epochs 1..`epoch` is
  // done, but the other ranks may not yet have passed finish_epoch(epoch)
  // (the rank died between its last push and the end of the epoch) or may
  // have (it died later). The next finish_epoch call is finish_epoch(epoch)
  // when `epoch` is the run's last, else finish_epoch(epoch + 1); an
  // exchange with a barrier must pair its ranks either way. Default:
  // nothing. An error stops training.
  virtual Status resume_after_epoch(std::uint32_t epoch) {
    (void)epoch;
    return ok_status();
  }

  // Going back. Asked after each await_parameters, sync and finish_epoch
  // that returned OK: a value s means the exchange replaced the parameters
  // with an older state of the job, that of global step s (for a worker:
  // the servers restarted from a checkpoint of step s), and the value
  // buffers now hold them. s is at most the step in progress, and every
  // rank of a job gets the same s, whatever step each was at. The Trainer
  // abandons the step in progress (or the epoch's end) and continues from
  // step s: the next calls are step s's (await_parameters(s, ...) in its
  // forward, then gradients_ready(s, ...)); steps s .. the abandoned one are
  // computed again, an earlier epoch's end included. Clears what it
  // returns. Default: never.
  virtual std::optional<std::uint64_t> take_rewind() { return std::nullopt; }
};

// The exchange of a single process: applies `optimizer` to each tensor as
// soon as its gradient is ready, in place (the overlap contract
// allows that), exactly as a BSP server with one worker would. Its "blocked"
// time is the optimizer's compute. The optimizer is borrowed.
class LocalExchange final : public GradientExchange {
 public:
  explicit LocalExchange(Optimizer& optimizer) : optimizer_(&optimizer) {}
  Status start(std::span<const Parameter> params) override;
  Status gradients_ready(std::uint64_t step, std::span<const Parameter> tensors) override;
  Status finish_step(std::uint64_t step) override;

 private:
  Optimizer* optimizer_;
};

struct TrainerOptions {
  std::uint32_t rank = 0;
  std::uint32_t num_workers = 1;
  std::size_t batch_size = 64;          // samples per step on this worker
  std::uint32_t epochs = 3;             // run() trains epochs 1..epochs
  std::uint64_t seed = 1;               // shared by all ranks: init and shuffle
  std::size_t max_steps_per_epoch = 0;  // 0: every full step; else at most this many
  std::size_t eval_batch_size = 1000;   // samples per forward when evaluating
  std::size_t max_eval_samples = 0;     // 0: the whole test set; else its first this many
};

// The model must be created with at least this max_batch_size.
inline std::size_t required_max_batch_size(const TrainerOptions& options) {
  return options.batch_size > options.eval_batch_size ? options.batch_size
                                                      : options.eval_batch_size;
}

struct EvalStats {
  std::size_t samples = 0;
  double loss = 0.0;      // mean cross-entropy
  double accuracy = 0.0;  // fraction correct, in [0, 1]
  double seconds = 0.0;
};

struct EpochStats {
  std::uint32_t epoch = 0;        // 1-based
  std::size_t steps = 0;
  std::size_t samples = 0;        // trained on by this worker
  double train_loss = 0.0;        // mean of the steps' batch losses (before each update)
  double train_accuracy = 0.0;    // fraction of this epoch's batches classified right
  double train_seconds = 0.0;     // wall time of the steps and finish_epoch (no evaluation)
  double exchange_seconds = 0.0;  // of which inside exchange calls (blocked)
  double send_seconds = 0.0;      // of which inside gradients_ready (handing off gradients)
  EvalStats test;                 // after the epoch, on the test set
  // Steps computed again after the exchange went back (take_rewind); they
  // are in `steps` and `samples` too (the work done).
  std::size_t redone_steps = 0;
  // The exchange went back to a step before this epoch: the epoch was left
  // unfinished (no evaluation) and the next run_epoch trains that earlier
  // epoch again. Trainer::run skips such stats.
  bool abandoned = false;

  double samples_per_second() const { return train_seconds > 0 ? samples / train_seconds : 0.0; }
  // Blocked time over step time, in [0, 1].
  double communication_share() const {
    return train_seconds > 0 ? exchange_seconds / train_seconds : 0.0;
  }
};

// Where a rank that rejoined a running job continues (Trainer::resumed).
struct ResumePoint {
  std::uint64_t step = 0;            // global step, from 0
  std::uint32_t epoch = 0;           // 1-based: the first epoch run_epoch trains
  std::size_t step_in_epoch = 0;     // steps of that epoch already done (its first step's index)
  std::size_t steps_in_epoch = 0;    // steps_per_epoch()
};

struct StepProgress {
  std::uint32_t epoch = 0;          // 1-based
  std::size_t step_in_epoch = 0;    // steps done in this epoch, 1..steps_in_epoch
  std::size_t steps_in_epoch = 0;
  double loss = 0.0;                // of this step's batch
};

class Trainer {
 public:
  // Borrows model, datasets and exchange: they must outlive the Trainer.
  // Errors: kInvalidArgument when the model is not bound, epochs or
  // eval_batch_size is 0, the model's max_batch_size is below
  // required_max_batch_size(options), or the sampler rejects the options
  // (rank, num_workers, batch_size; see ShardSampler::create);
  // kShapeMismatch when the model's inputs differ from a dataset's features,
  // or a label is not below the model's outputs.
  static Result<Trainer> create(const TrainerOptions& options, Mlp& model, const Dataset& train,
                                const Dataset& test, GradientExchange& exchange);

  // Called after every step (progress bars). Optional.
  void set_step_callback(std::function<void(const StepProgress&)> callback) {
    step_callback_ = std::move(callback);
  }

  // He-initialises the parameters from the seed and calls exchange.start.
  // Once, before run_epoch. When the exchange then reports a resume step
  // s > 0 (GradientExchange::resume_step: this rank rejoined a running
  // job), training continues from global step s: the next run_epoch trains
  // epoch s / n + 1 (n = steps_per_epoch()) from its step s % n, with the
  // epoch's usual sample order (the steps before are skipped, not redone).
  // When s % n == 0 the exchange is told (resume_after_epoch(s / n)); when
  // s is the run's last step (epochs * n) the next run_epoch is epoch
  // `epochs` with no step left: it only finishes the epoch (finish_epoch)
  // and evaluates. Errors: the exchange's; kInvalidArgument when s >
  // epochs * n (the servers ran more steps than this run has: every rank
  // needs the same --epochs, --batch-size and --max-steps-per-epoch).
  Status start();

  // Set when start() resumed a running job (resume step > 0).
  const std::optional<ResumePoint>& resumed() const { return resumed_; }

  // Trains the next epoch (1, 2, ...) and evaluates on the test set. After
  // a resume, the first epoch trains only its remaining steps, and its
  // stats (steps, samples, train loss and accuracy) cover those. When the
  // exchange goes back (GradientExchange::take_rewind) to a step s of this
  // epoch, training continues from s (EpochStats::redone_steps); to an
  // earlier epoch, it returns stats with `abandoned` set, and the next
  // run_epoch trains that epoch from s. Errors: the exchange's (with epoch
  // and step as context); kInvalidArgument when the loss becomes NaN or
  // infinite (training diverged: lower the learning rate); kInternal when
  // the exchange goes forward (a rewind past the step in progress).
  // pre: start() succeeded.
  Result<EpochStats> run_epoch();

  // start() if not yet started, then run_epoch() until options.epochs,
  // calling on_epoch after each that was not abandoned (an epoch trained
  // again after a rewind is reported once, when it finishes). Stops at the
  // first error.
  Result<std::vector<EpochStats>> run(const std::function<void(const EpochStats&)>& on_epoch = {});

  // Loss and accuracy of the current parameters on the test set (the first
  // max_eval_samples samples when set). Does not touch gradients.
  EvalStats evaluate();

  const ShardSampler& sampler() const { return sampler_; }
  std::size_t steps_per_epoch() const;
  std::uint64_t steps_done() const { return step_; }

 private:
  Trainer(const TrainerOptions& options, Mlp& model, const Dataset& train, const Dataset& test,
          GradientExchange& exchange, ShardSampler sampler);
  // Goes back to global step `target` (take_rewind) from step_ during
  // `epoch`: the step of `epoch` to continue from, or nullopt when `target`
  // is in an earlier epoch (epoch_ and first_step_ then point at it).
  // Errors: kInternal when target > step_.
  Result<std::optional<std::size_t>> rewind_to(std::uint64_t target, std::uint32_t epoch);

  TrainerOptions options_;
  Mlp* model_;
  const Dataset* train_;
  const Dataset* test_;
  GradientExchange* exchange_;
  ShardSampler sampler_;
  std::function<void(const StepProgress&)> step_callback_;
  bool started_ = false;
  std::uint32_t epoch_ = 0;  // last epoch trained
  std::uint64_t step_ = 0;   // steps done, all epochs
  std::size_t first_step_ = 0;  // index of the next epoch's first step (> 0 after a resume)
  std::uint64_t redo_until_ = 0;  // steps before this were computed once already (rewinds)
  std::optional<ResumePoint> resumed_;
  std::vector<std::uint32_t> indices_;
  std::vector<std::uint32_t> permutation_;
  std::vector<std::uint8_t> labels_;
};

}  // namespace ember::fashion_mnist
