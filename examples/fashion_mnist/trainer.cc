// The training loop (see trainer.h).
#include "examples/fashion_mnist/trainer.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "common/base/check.h"

namespace ember::fashion_mnist {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point begin, Clock::time_point end) {
  return std::chrono::duration<double>(end - begin).count();
}

Status check_dataset(const Mlp& model, const Dataset& data, std::string_view which) {
  if (data.num_features() != model.num_inputs()) {
    return make_error(ErrorCode::kShapeMismatch,
                      "trainer: {} samples have {} features ({}x{}) but the model takes {} inputs",
                      which, data.num_features(), data.image_rows, data.image_cols,
                      model.num_inputs());
  }
  const auto bad = std::find_if(data.labels.begin(), data.labels.end(), [&](std::uint8_t l) {
    return l >= model.num_outputs();
  });
  if (bad != data.labels.end()) {
    return make_error(ErrorCode::kShapeMismatch,
                      "trainer: {} label {} at index {} is not below the model's {} outputs", which,
                      *bad, bad - data.labels.begin(), model.num_outputs());
  }
  return ok_status();
}

}  // namespace

Status LocalExchange::start(std::span<const Parameter> params) {
  (void)params;
  return ok_status();
}

Status LocalExchange::gradients_ready(std::uint64_t step, std::span<const Parameter> tensors) {
  (void)step;
  for (const Parameter& p : tensors) EMBER_TRY(optimizer_->step(p.key, p.value, p.grad));
  return ok_status();
}

Status LocalExchange::finish_step(std::uint64_t step) {
  (void)step;
  return ok_status();
}

Result<Trainer> Trainer::create(const TrainerOptions& options, Mlp& model, const Dataset& train,
                                const Dataset& test, GradientExchange& exchange) {
  if (!model.bound()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "trainer: the model has no parameter buffers; call Mlp::bind first");
  }
  if (options.epochs == 0) {
    return make_error(ErrorCode::kInvalidArgument, "trainer: epochs must be > 0");
  }
  if (options.eval_batch_size == 0) {
    return make_error(ErrorCode::kInvalidArgument, "trainer: eval_batch_size must be > 0");
  }
  if (model.max_batch_size() < required_max_batch_size(options)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "trainer: the model was created for batches of up to {} samples; batch_size "
                      "{} and eval_batch_size {} need {} (see required_max_batch_size)",
                      model.max_batch_size(), options.batch_size, options.eval_batch_size,
                      required_max_batch_size(options));
  }
  EMBER_TRY(check_dataset(model, train, "training"));
  EMBER_TRY(check_dataset(model, test, "test"));
  ShardOptions shard;
  shard.num_samples = train.num_samples;
  shard.rank = options.rank;
  shard.num_workers = options.num_workers;
  shard.batch_size = options.batch_size;
  shard.seed = options.seed;
  EMBER_ASSIGN_OR_RETURN(ShardSampler sampler, ShardSampler::create(shard));
  return Trainer(options, model, train, test, exchange, std::move(sampler));
}

Trainer::Trainer(const TrainerOptions& options, Mlp& model, const Dataset& train,
                 const Dataset& test, GradientExchange& exchange, ShardSampler sampler)
    : options_(options),
      model_(&model),
      train_(&train),
      test_(&test),
      exchange_(&exchange),
      sampler_(std::move(sampler)),
      labels_(required_max_batch_size(options)) {}

std::size_t Trainer::steps_per_epoch() const {
  const std::size_t full = sampler_.steps_per_epoch();
  return options_.max_steps_per_epoch == 0 ? full : std::min(full, options_.max_steps_per_epoch);
}

Status Trainer::start() {
  EMBER_CHECK_MSG(!started_, "Trainer::start called twice");
  model_->init_he(options_.seed);
  if (Status s = exchange_->start(model_->parameters()); !s) {
    Error e = s.error();
    e.with_context("starting the gradient exchange");
    return tl::unexpected<Error>(std::move(e));
  }
  started_ = true;
  const std::uint64_t resume = exchange_->resume_step();
  if (resume == 0) return ok_status();
  const std::size_t n = steps_per_epoch();
  const std::uint64_t total = static_cast<std::uint64_t>(options_.epochs) * n;
  if (resume > total) {
    return make_error(ErrorCode::kInvalidArgument,
                      "trainer: the job is at step {}, past this run's {} steps ({} epoch(s) of {}); "
                      "every rank needs the job's --epochs, --batch-size and "
                      "--max-steps-per-epoch",
                      resume, total, options_.epochs, n);
  }
  const auto epochs_done = static_cast<std::uint32_t>(resume / n);
  const std::size_t in_epoch = static_cast<std::size_t>(resume % n);
  step_ = resume;
  if (in_epoch != 0 || epochs_done < options_.epochs) {
    epoch_ = epochs_done;
    first_step_ = in_epoch;
  } else {
    // Every step is done; what may be left is the last epoch's end.
    epoch_ = epochs_done - 1;
    first_step_ = n;
  }
  resumed_ = ResumePoint{resume, epoch_ + 1, first_step_, n};
  if (in_epoch == 0) {
    if (Status s = exchange_->resume_after_epoch(epochs_done); !s) {
      Error e = s.error();
      e.with_context(fmt::format("rejoining the job after epoch {}", epochs_done));
      return tl::unexpected<Error>(std::move(e));
    }
  }
  return ok_status();
}

Result<std::optional<std::size_t>> Trainer::rewind_to(std::uint64_t target, std::uint32_t epoch) {
  if (target > step_) {
    return make_error(ErrorCode::kInternal,
                      "trainer: the gradient exchange went to step {} from step {}, forward (a "
                      "rewind goes back to an earlier state of the job)",
                      target, step_);
  }
  const std::uint64_t n = steps_per_epoch();
  const std::uint64_t epoch_first = static_cast<std::uint64_t>(epoch - 1) * n;
  redo_until_ = std::max(redo_until_, step_);
  step_ = target;
  if (target >= epoch_first) return static_cast<std::size_t>(target - epoch_first);
  epoch_ = static_cast<std::uint32_t>(target / n);
  first_step_ = static_cast<std::size_t>(target % n);
  return std::optional<std::size_t>();
}

Result<EpochStats> Trainer::run_epoch() {
  EMBER_CHECK_MSG(started_, "Trainer::run_epoch before start");
  const std::uint32_t epoch = ++epoch_;
  EpochStats stats;
  stats.epoch = epoch;
  const std::size_t batch = options_.batch_size;
  const std::size_t steps = steps_per_epoch();
  // After a resume the first epoch starts at its first step not yet done.
  const std::size_t first = std::min(first_step_, steps);
  first_step_ = 0;
  sampler_.epoch_indices(epoch, indices_, permutation_);

  double exchange_seconds = 0.0;
  double send_seconds = 0.0;
  std::uint64_t current_step = 0;
  const TensorsFn on_ready = [&](std::span<const Parameter> tensors) -> Status {
    const Clock::time_point t0 = Clock::now();
    Status s = exchange_->gradients_ready(current_step, tensors);
    const double dt = seconds_between(t0, Clock::now());
    exchange_seconds += dt;
    send_seconds += dt;
    return s;
  };
  // Set when the exchange went back (take_rewind) while forward awaited a
  // tensor: the forward stops there, and the step with it.
  std::optional<std::uint64_t> rewind;
  const TensorsFn before_read = [&](std::span<const Parameter> tensors) -> Status {
    const Clock::time_point t0 = Clock::now();
    Status s = exchange_->await_parameters(current_step, tensors);
    exchange_seconds += seconds_between(t0, Clock::now());
    if (s && (rewind = exchange_->take_rewind())) {
      return make_error(ErrorCode::kCancelled, "the step is abandoned: the exchange went back");
    }
    return s;
  };
  auto step_error = [&](Error e, std::size_t step_in_epoch) {
    e.with_context(fmt::format("epoch {} step {} (global step {})", epoch, step_in_epoch + 1,
                               current_step));
    return tl::unexpected<Error>(std::move(e));
  };

  double loss_sum = 0.0;
  std::size_t correct = 0;
  std::size_t done = 0;    // steps computed, redone ones included
  std::size_t redone = 0;  // of which computed again after a rewind
  const Clock::time_point epoch_begin = Clock::now();
  std::size_t s = first;
  for (;;) {
    std::optional<std::uint64_t> back;  // a rewind to apply
    while (s < steps) {
      current_step = step_;
      const auto batch_indices = std::span<const std::uint32_t>(indices_).subspan(s * batch, batch);
      gather_batch(*train_, batch_indices, model_->input(batch), labels_);
      Result<ForwardStats> forwarded =
          model_->forward(batch, std::span<const std::uint8_t>(labels_).first(batch), before_read);
      if (!forwarded && rewind) {
        back = std::exchange(rewind, std::nullopt);
        break;
      }
      if (!forwarded) return step_error(forwarded.error(), s);
      const ForwardStats forward = *forwarded;
      if (!std::isfinite(forward.loss)) {
        return make_error(ErrorCode::kInvalidArgument,
                          "training diverged: the loss is {} at epoch {} step {}; lower the "
                          "learning rate",
                          forward.loss, epoch, s + 1);
      }
      if (Status st = model_->backward(on_ready); !st) return step_error(st.error(), s);
      const Clock::time_point t0 = Clock::now();
      Status finished = exchange_->finish_step(current_step);
      exchange_seconds += seconds_between(t0, Clock::now());
      if (!finished) return step_error(finished.error(), s);
      ++step_;
      ++done;
      if (current_step < redo_until_) ++redone;
      loss_sum += forward.loss;
      correct += forward.correct;
      ++s;
      if (step_callback_) {
        step_callback_(StepProgress{epoch, s, steps, forward.loss});
      }
    }
    if (!back) {
      const Clock::time_point t0 = Clock::now();
      Status finished = exchange_->sync();
      // Back from sync (before the barrier): the epoch's end is done again
      // too, by every rank (none can be past a barrier this rank has not
      // joined).
      if (finished) back = exchange_->take_rewind();
      if (finished && !back) {
        finished = exchange_->finish_epoch(epoch);
        // Back from finish_epoch (after the barrier) to this epoch's end:
        // the values hold its parameters and the epoch is done; the other
        // ranks may already train the next one.
        if (finished && (back = exchange_->take_rewind()) && *back == step_) back.reset();
      }
      exchange_seconds += seconds_between(t0, Clock::now());
      if (!finished) {
        Error e = finished.error();
        e.with_context(fmt::format("finishing epoch {}", epoch));
        return tl::unexpected<Error>(std::move(e));
      }
      if (!back) break;
    }
    EMBER_ASSIGN_OR_RETURN(const std::optional<std::size_t> at, rewind_to(*back, epoch));
    if (!at) {
      stats.abandoned = true;  // run_epoch trains the earlier epoch next
      break;
    }
    s = *at;  // steps to compute again, or none: then the epoch's end again
  }
  stats.train_seconds = seconds_between(epoch_begin, Clock::now());
  stats.exchange_seconds = exchange_seconds;
  stats.send_seconds = send_seconds;
  stats.steps = done;
  stats.redone_steps = redone;
  stats.samples = done * batch;
  stats.train_loss = done > 0 ? loss_sum / static_cast<double>(done) : 0.0;
  stats.train_accuracy =
      stats.samples > 0 ? static_cast<double>(correct) / static_cast<double>(stats.samples) : 0.0;
  if (!stats.abandoned) stats.test = evaluate();
  return stats;
}

Result<std::vector<EpochStats>> Trainer::run(
    const std::function<void(const EpochStats&)>& on_epoch) {
  if (!started_) EMBER_TRY(start());
  std::vector<EpochStats> all;
  while (epoch_ < options_.epochs) {
    EMBER_ASSIGN_OR_RETURN(EpochStats stats, run_epoch());
    if (stats.abandoned) continue;  // that epoch is trained again
    if (on_epoch) on_epoch(stats);
    all.push_back(stats);
  }
  return all;
}

EvalStats Trainer::evaluate() {
  const Clock::time_point begin = Clock::now();
  std::size_t total = test_->num_samples;
  if (options_.max_eval_samples != 0) total = std::min(total, options_.max_eval_samples);
  EvalStats out;
  double loss_sum = 0.0;
  std::size_t correct = 0;
  std::vector<std::uint32_t> batch_indices;
  batch_indices.reserve(options_.eval_batch_size);
  for (std::size_t first = 0; first < total; first += options_.eval_batch_size) {
    const std::size_t count = std::min(options_.eval_batch_size, total - first);
    batch_indices.resize(count);
    for (std::size_t j = 0; j < count; ++j) batch_indices[j] = static_cast<std::uint32_t>(first + j);
    gather_batch(*test_, batch_indices, model_->input(count), labels_);
    const ForwardStats f =
        model_->forward(count, std::span<const std::uint8_t>(labels_).first(count));
    loss_sum += f.loss * static_cast<double>(count);
    correct += f.correct;
  }
  out.samples = total;
  if (total > 0) {
    out.loss = loss_sum / static_cast<double>(total);
    out.accuracy = static_cast<double>(correct) / static_cast<double>(total);
  }
  out.seconds = seconds_between(begin, Clock::now());
  return out;
}

}  // namespace ember::fashion_mnist
