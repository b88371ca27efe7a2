// The Trainer loop and the GradientExchange contract: call order, timing,
// errors, learning on a small synthetic task, and BSP with 2 workers (an
// in-process averaging server on two threads) against one process with the
// doubled batch.
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/base/check.h"
#include "examples/fashion_mnist/trainer.h"
#include "tests/unit/examples/test_util.h"

namespace ember::fashion_mnist {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kSide = 4;  // synthetic 4x4 images: 16 features

// A model and the buffers a caller binds to it.
struct Bound {
  Mlp model;
  std::vector<float> values;
  std::vector<float> grads;
};

Bound make_bound(std::size_t max_batch) {
  auto model = Mlp::create(MlpSpec{{kSide * kSide, 12, 10}, 0}, max_batch);
  EMBER_CHECK(model.has_value());
  Bound b{std::move(*model), {}, {}};
  b.values.resize(b.model.num_parameters());
  b.grads.resize(b.model.num_parameters());
  EMBER_CHECK(b.model.bind(b.values, b.grads).has_value());
  return b;
}

TrainerOptions small_options(std::size_t batch) {
  TrainerOptions o;
  o.batch_size = batch;
  o.epochs = 2;
  o.seed = 3;
  o.eval_batch_size = 50;
  return o;
}

std::unique_ptr<Optimizer> momentum_sgd(double lr) {
  auto r = make_sgd(SgdOptions{lr, 0.9, 0.0, 0.0, false});
  EMBER_CHECK(r.has_value());
  return std::move(*r);
}

// Records every call; optionally spins (busy work, not a wait) in
// finish_step, or fails at a given step.
class RecordingExchange final : public GradientExchange {
 public:
  std::vector<std::string> calls;
  std::chrono::microseconds spin{0};
  std::int64_t fail_at_step = -1;
  std::size_t start_tensors = 0;
  bool record_awaits = false;

  Status start(std::span<const Parameter> params) override {
    calls.push_back("start");
    start_tensors = params.size();
    return ok_status();
  }
  Status gradients_ready(std::uint64_t step, std::span<const Parameter> tensors) override {
    calls.push_back(fmt::format("ready {} {}", step, tensors[0].name));
    if (static_cast<std::int64_t>(step) == fail_at_step) {
      return make_error(ErrorCode::kWorkerLost, "peer vanished");
    }
    return ok_status();
  }
  Status finish_step(std::uint64_t step) override {
    calls.push_back(fmt::format("finish {}", step));
    const auto until = std::chrono::steady_clock::now() + spin;
    while (std::chrono::steady_clock::now() < until) {
    }
    return ok_status();
  }
  Status await_parameters(std::uint64_t step, std::span<const Parameter> tensors) override {
    const std::string call = fmt::format("await {} {}", step, tensors[0].name);
    if (record_awaits) calls.push_back(call);
    arm_rewind(call);
    return ok_status();
  }
  Status sync() override {
    calls.push_back("sync");
    arm_rewind("sync");
    return ok_status();
  }
  Status finish_epoch(std::uint32_t epoch) override {
    calls.push_back(fmt::format("epoch {}", epoch));
    arm_rewind(calls.back());
    return ok_status();
  }

  // Going back: after the `rewind_at`-th call named `rewind_after` (1 for
  // the first), take_rewind returns `rewind_to` once.
  std::string rewind_after;
  int rewind_at = 1;
  std::uint64_t rewind_to = 0;
  std::optional<std::uint64_t> take_rewind() override {
    auto r = armed_;
    armed_.reset();
    if (r) calls.push_back(fmt::format("rewind to {}", *r));
    return r;
  }

 private:
  void arm_rewind(const std::string& call) {
    if (call == rewind_after && --rewind_at == 0) armed_ = rewind_to;
  }
  std::optional<std::uint64_t> armed_;
};

struct Fixture {
  Dataset train = testing::make_learnable_dataset(200, kSide, kSide, 1);
  Dataset test = testing::make_learnable_dataset(100, kSide, kSide, 2);
};

TEST(Trainer, CreateRejectsInconsistentSetups) {
  Fixture f;
  RecordingExchange ex;
  auto unbound = Mlp::create(MlpSpec{{16, 10}, 0}, 64);
  ASSERT_TRUE(unbound);
  auto r = Trainer::create(small_options(8), *unbound, f.train, f.test, ex);
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error().message(), HasSubstr("call Mlp::bind first"));

  Bound m = make_bound(64);
  TrainerOptions o = small_options(8);
  o.epochs = 0;
  r = Trainer::create(o, m.model, f.train, f.test, ex);
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error().message(), HasSubstr("epochs must be > 0"));

  o = small_options(100);  // needs max batch 100, the model has 64
  r = Trainer::create(o, m.model, f.train, f.test, ex);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(r.error().message(), HasSubstr("up to 64 samples"));

  o = small_options(8);
  o.rank = 2;
  o.num_workers = 2;
  r = Trainer::create(o, m.model, f.train, f.test, ex);
  ASSERT_FALSE(r);
  EXPECT_THAT(r.error().message(), HasSubstr("rank 2 is out of range"));

  Dataset wide = testing::make_learnable_dataset(50, 5, 5, 3);
  r = Trainer::create(small_options(8), m.model, wide, f.test, ex);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kShapeMismatch);
  EXPECT_THAT(r.error().message(), HasSubstr("training samples have 25 features"));

  auto five_classes = Mlp::create(MlpSpec{{16, 5}, 0}, 64);
  ASSERT_TRUE(five_classes);
  std::vector<float> v(five_classes->num_parameters()), g(v.size());
  ASSERT_TRUE(five_classes->bind(v, g));
  r = Trainer::create(small_options(8), *five_classes, f.train, f.test, ex);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::kShapeMismatch);
  EXPECT_THAT(r.error().message(), HasSubstr("not below the model's 5 outputs"));
}

TEST(Trainer, CallsTheExchangeInContractOrder) {
  Fixture f;
  RecordingExchange ex;
  Bound m = make_bound(50);
  TrainerOptions o = small_options(8);
  o.max_steps_per_epoch = 2;
  auto trainer = Trainer::create(o, m.model, f.train, f.test, ex);
  ASSERT_TRUE(trainer) << trainer.error().to_string();
  std::vector<StepProgress> progress;
  trainer->set_step_callback([&](const StepProgress& p) { progress.push_back(p); });
  auto epochs = trainer->run();
  ASSERT_TRUE(epochs) << epochs.error().to_string();
  EXPECT_EQ(ex.start_tensors, 4u);
  const std::vector<std::string> want = {
      "start",
      "ready 0 b2", "ready 0 W2", "ready 0 b1", "ready 0 W1", "finish 0",
      "ready 1 b2", "ready 1 W2", "ready 1 b1", "ready 1 W1", "finish 1", "sync", "epoch 1",
      "ready 2 b2", "ready 2 W2", "ready 2 b1", "ready 2 W1", "finish 2",
      "ready 3 b2", "ready 3 W2", "ready 3 b1", "ready 3 W1", "finish 3", "sync", "epoch 2"};
  EXPECT_EQ(ex.calls, want);
  ASSERT_EQ(epochs->size(), 2u);
  EXPECT_EQ((*epochs)[1].epoch, 2u);
  EXPECT_EQ((*epochs)[1].steps, 2u);
  EXPECT_EQ((*epochs)[1].samples, 16u);
  EXPECT_EQ((*epochs)[1].test.samples, 100u);
  ASSERT_EQ(progress.size(), 4u);
  EXPECT_EQ(progress[3].epoch, 2u);
  EXPECT_EQ(progress[3].step_in_epoch, 2u);
  EXPECT_EQ(progress[3].steps_in_epoch, 2u);
  EXPECT_EQ(trainer->steps_done(), 4u);
}

TEST(Trainer, AwaitsEachTensorInForwardOrderBeforeReadingIt) {
  Fixture f;
  RecordingExchange ex;
  ex.record_awaits = true;
  Bound m = make_bound(50);
  TrainerOptions o = small_options(8);
  o.epochs = 1;
  o.max_steps_per_epoch = 2;
  auto trainer = Trainer::create(o, m.model, f.train, f.test, ex);
  ASSERT_TRUE(trainer);
  ASSERT_TRUE(trainer->run());
  const std::vector<std::string> want = {
      "start",
      "await 0 W1", "await 0 b1", "await 0 W2", "await 0 b2",
      "ready 0 b2", "ready 0 W2", "ready 0 b1", "ready 0 W1", "finish 0",
      "await 1 W1", "await 1 b1", "await 1 W2", "await 1 b2",
      "ready 1 b2", "ready 1 W2", "ready 1 b1", "ready 1 W1", "finish 1", "sync", "epoch 1"};
  EXPECT_EQ(ex.calls, want);
}

TEST(Trainer, MeasuresTimeBlockedInTheExchange) {
  Fixture f;
  RecordingExchange ex;
  ex.spin = std::chrono::microseconds(2000);
  Bound m = make_bound(50);
  TrainerOptions o = small_options(8);
  o.epochs = 1;
  o.max_steps_per_epoch = 5;
  auto trainer = Trainer::create(o, m.model, f.train, f.test, ex);
  ASSERT_TRUE(trainer);
  auto epochs = trainer->run();
  ASSERT_TRUE(epochs) << epochs.error().to_string();
  const EpochStats& e = epochs->front();
  // The exchange spun 2 ms per step on the training thread: at least 10 ms
  // blocked, never more than the step time.
  EXPECT_GE(e.exchange_seconds, 0.010);
  // The spin was in finish_step, not in gradients_ready (the send part).
  EXPECT_GE(e.send_seconds, 0.0);
  EXPECT_GE(e.exchange_seconds - e.send_seconds, 0.010);
  EXPECT_LE(e.exchange_seconds, e.train_seconds);
  EXPECT_DOUBLE_EQ(e.communication_share(), e.exchange_seconds / e.train_seconds);
  EXPECT_GT(e.samples_per_second(), 0.0);
}

TEST(Trainer, AnExchangeErrorStopsTrainingWithStepContext) {
  Fixture f;
  RecordingExchange ex;
  ex.fail_at_step = 3;
  Bound m = make_bound(50);
  auto trainer = Trainer::create(small_options(8), m.model, f.train, f.test, ex);
  ASSERT_TRUE(trainer);
  auto epochs = trainer->run();
  ASSERT_FALSE(epochs);
  EXPECT_EQ(epochs.error().code(), ErrorCode::kWorkerLost);
  EXPECT_THAT(epochs.error().message(), HasSubstr("epoch 1 step 4 (global step 3): peer vanished"));
  EXPECT_EQ(ex.calls.back(), "ready 3 b2");  // nothing after the failing call
}

// Steps of 3 per epoch, 2 epochs: global steps 0..2 and 3..5.
std::vector<std::string> steps_calls(std::uint64_t from, std::uint64_t to) {
  std::vector<std::string> calls;
  for (std::uint64_t s = from; s < to; ++s) {
    for (const char* t : {"b2", "W2", "b1", "W1"}) {
      calls.push_back(fmt::format("ready {} {}", s, t));
    }
    calls.push_back(fmt::format("finish {}", s));
  }
  return calls;
}

std::vector<std::string> concat(std::initializer_list<std::vector<std::string>> parts) {
  std::vector<std::string> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

struct RewindRun {
  RecordingExchange ex;
  std::vector<EpochStats> reported;  // through on_epoch
  Result<std::vector<EpochStats>> result = std::vector<EpochStats>{};
  std::uint64_t steps_done = 0;
};

std::unique_ptr<RewindRun> run_with_rewind(const std::string& after, int at, std::uint64_t to) {
  Fixture f;
  auto run = std::make_unique<RewindRun>();
  run->ex.rewind_after = after;
  run->ex.rewind_at = at;
  run->ex.rewind_to = to;
  Bound m = make_bound(50);
  TrainerOptions o = small_options(8);
  o.max_steps_per_epoch = 3;
  auto trainer = Trainer::create(o, m.model, f.train, f.test, run->ex);
  EMBER_CHECK(trainer.has_value());
  run->result = trainer->run([&](const EpochStats& e) { run->reported.push_back(e); });
  run->steps_done = trainer->steps_done();
  return run;
}

TEST(Trainer, ARewindDuringForwardAbandonsTheStepAndRedoesFromTheTarget) {
  // Back to step 1 while step 2's forward awaits W1 (its first tensor).
  auto r = run_with_rewind("await 2 W1", 1, 1);
  ASSERT_TRUE(r->result) << r->result.error().to_string();
  EXPECT_EQ(r->ex.calls, concat({{"start"}, steps_calls(0, 2), {"rewind to 1"},
                                 steps_calls(1, 3), {"sync", "epoch 1"}, steps_calls(3, 6),
                                 {"sync", "epoch 2"}}));
  ASSERT_EQ(r->reported.size(), 2u);
  EXPECT_EQ(r->reported[0].steps, 4u);  // 0, 1, then 1 and 2
  EXPECT_EQ(r->reported[0].redone_steps, 1u);
  EXPECT_EQ(r->reported[0].samples, 32u);
  EXPECT_EQ(r->reported[1].steps, 3u);
  EXPECT_EQ(r->reported[1].redone_steps, 0u);
  EXPECT_EQ(r->steps_done, 6u);
}

TEST(Trainer, ARewindIntoAnEarlierEpochTrainsThatEpochAgainAndReportsItOnce) {
  // Back to step 1 (epoch 1) from epoch 2's end (before its barrier).
  auto r = run_with_rewind("sync", 2, 1);
  ASSERT_TRUE(r->result) << r->result.error().to_string();
  EXPECT_EQ(r->ex.calls,
            concat({{"start"}, steps_calls(0, 3), {"sync", "epoch 1"}, steps_calls(3, 6),
                    {"sync", "rewind to 1"}, steps_calls(1, 3), {"sync", "epoch 1"},
                    steps_calls(3, 6), {"sync", "epoch 2"}}));
  ASSERT_EQ(r->reported.size(), 3u);
  EXPECT_EQ(r->reported[0].epoch, 1u);
  EXPECT_EQ(r->reported[1].epoch, 1u);
  EXPECT_EQ(r->reported[1].steps, 2u);
  EXPECT_EQ(r->reported[1].redone_steps, 2u);
  EXPECT_EQ(r->reported[1].test.samples, 100u);
  EXPECT_EQ(r->reported[2].epoch, 2u);
  EXPECT_EQ(r->reported[2].redone_steps, 3u);
  EXPECT_EQ(r->result->size(), 3u);
  EXPECT_EQ(r->steps_done, 6u);
}

TEST(Trainer, ARewindAfterTheBarrierToTheEpochsEndFinishesTheEpoch) {
  // finish_epoch's pulls went back to where the epoch ends: nothing to redo,
  // and no second barrier (the other ranks may be in the next epoch).
  auto r = run_with_rewind("epoch 1", 1, 3);
  ASSERT_TRUE(r->result) << r->result.error().to_string();
  EXPECT_EQ(r->ex.calls, concat({{"start"}, steps_calls(0, 3), {"sync", "epoch 1", "rewind to 3"},
                                 steps_calls(3, 6), {"sync", "epoch 2"}}));
  EXPECT_EQ(r->reported.size(), 2u);
}

TEST(Trainer, ARewindAfterTheBarrierToAnEarlierStepRedoesTheStepsAndTheEpochsEnd) {
  auto r = run_with_rewind("epoch 1", 1, 1);
  ASSERT_TRUE(r->result) << r->result.error().to_string();
  EXPECT_EQ(r->ex.calls, concat({{"start"}, steps_calls(0, 3), {"sync", "epoch 1", "rewind to 1"},
                                 steps_calls(1, 3), {"sync", "epoch 1"}, steps_calls(3, 6),
                                 {"sync", "epoch 2"}}));
  ASSERT_EQ(r->reported.size(), 2u);
  EXPECT_EQ(r->reported[0].steps, 5u);
  EXPECT_EQ(r->reported[0].redone_steps, 2u);
}

TEST(Trainer, ARewindPastTheStepInProgressIsAnInternalError) {
  auto r = run_with_rewind("await 2 W1", 1, 4);
  ASSERT_FALSE(r->result);
  EXPECT_EQ(r->result.error().code(), ErrorCode::kInternal);
  EXPECT_THAT(r->result.error().message(), HasSubstr("went to step 4 from step 2, forward"));
}

TEST(Trainer, DivergenceIsReported) {
  Fixture f;
  auto opt = momentum_sgd(1e30);
  LocalExchange ex(*opt);
  Bound m = make_bound(50);
  auto trainer = Trainer::create(small_options(8), m.model, f.train, f.test, ex);
  ASSERT_TRUE(trainer);
  auto epochs = trainer->run();
  ASSERT_FALSE(epochs);
  EXPECT_EQ(epochs.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(epochs.error().message(), HasSubstr("training diverged"));
  EXPECT_THAT(epochs.error().message(), HasSubstr("lower the learning rate"));
}

TEST(Trainer, LearnsASmallTaskLocally) {
  Fixture f;
  auto opt = momentum_sgd(0.05);
  LocalExchange ex(*opt);
  Bound m = make_bound(50);
  TrainerOptions o = small_options(10);
  o.epochs = 6;
  auto trainer = Trainer::create(o, m.model, f.train, f.test, ex);
  ASSERT_TRUE(trainer);
  ASSERT_TRUE(trainer->start());
  const EvalStats before = trainer->evaluate();
  auto epochs = trainer->run();
  ASSERT_TRUE(epochs) << epochs.error().to_string();
  const EpochStats& last = epochs->back();
  EXPECT_LT(last.train_loss, 0.5 * epochs->front().train_loss);
  EXPECT_LT(last.test.loss, 0.5 * before.loss);
  EXPECT_GT(last.test.accuracy, 0.9) << "before training: " << before.accuracy;
  EXPECT_EQ(last.test.samples, 100u);
  o.max_eval_samples = 30;
}

TEST(Trainer, EvaluatesAtMostMaxEvalSamples) {
  Fixture f;
  RecordingExchange ex;
  Bound m = make_bound(50);
  TrainerOptions o = small_options(8);
  o.max_eval_samples = 30;
  o.eval_batch_size = 7;  // 30 = 4 * 7 + 2: a short last batch
  auto trainer = Trainer::create(o, m.model, f.train, f.test, ex);
  ASSERT_TRUE(trainer);
  ASSERT_TRUE(trainer->start());
  const EvalStats e = trainer->evaluate();
  EXPECT_EQ(e.samples, 30u);
  EXPECT_GE(e.accuracy, 0.0);
  EXPECT_LE(e.accuracy, 1.0);
}

// An in-process stand-in for a BSP parameter server: gathers every rank's
// gradients for a step, averages them in rank order, applies the optimizer
// once, and hands every rank the new parameters. Waits are bounded.
class FakeBspServer {
 public:
  FakeBspServer(std::uint32_t workers, Optimizer& optimizer)
      : workers_(workers), optimizer_(&optimizer), grads_(workers) {}

  Status start(std::uint32_t rank, std::span<const Parameter> params) {
    std::unique_lock lock(mutex_);
    if (rank == 0) {
      for (const Parameter& p : params) master_[p.key].assign(p.value.begin(), p.value.end());
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, kDeadline, [&] { return !master_.empty(); })) {
      return make_error(ErrorCode::kTimeout, "rank 0 never initialised");
    }
    copy_out(params);
    return ok_status();
  }

  void put(std::uint32_t rank, std::span<const Parameter> layer) {
    std::lock_guard lock(mutex_);
    for (const Parameter& p : layer) grads_[rank][p.key].assign(p.grad.begin(), p.grad.end());
  }

  Status finish_step(std::span<const Parameter> params) {
    std::unique_lock lock(mutex_);
    const std::uint64_t round = round_;
    if (++arrived_ == workers_) {
      for (auto& [key, value] : master_) {
        std::vector<float> mean(value.size(), 0.0f);
        for (std::uint32_t r = 0; r < workers_; ++r) {
          const auto& g = grads_[r].at(key);
          for (std::size_t i = 0; i < mean.size(); ++i) mean[i] += g[i];
        }
        for (float& x : mean) x /= static_cast<float>(workers_);
        EMBER_TRY(optimizer_->step(key, value, mean));
      }
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, kDeadline, [&] { return round_ != round; })) {
      return make_error(ErrorCode::kTimeout, "BSP round {} never completed", round);
    }
    copy_out(params);
    return ok_status();
  }

 private:
  static constexpr std::chrono::seconds kDeadline{30};

  void copy_out(std::span<const Parameter> params) {
    for (const Parameter& p : params) {
      const auto& v = master_.at(p.key);
      std::copy(v.begin(), v.end(), p.value.begin());
    }
  }

  const std::uint32_t workers_;
  Optimizer* optimizer_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::uint64_t, std::vector<float>> master_;
  std::vector<std::map<std::uint64_t, std::vector<float>>> grads_;
  std::uint32_t arrived_ = 0;
  std::uint64_t round_ = 0;
};

// What a worker's exchange does, against the fake server.
class BspExchange final : public GradientExchange {
 public:
  BspExchange(FakeBspServer& server, std::uint32_t rank, const Mlp& model)
      : server_(&server), rank_(rank), model_(&model) {}
  Status start(std::span<const Parameter> params) override { return server_->start(rank_, params); }
  Status gradients_ready(std::uint64_t, std::span<const Parameter> tensors) override {
    server_->put(rank_, tensors);
    return ok_status();
  }
  Status finish_step(std::uint64_t) override { return server_->finish_step(model_->parameters()); }

 private:
  FakeBspServer* server_;
  std::uint32_t rank_;
  const Mlp* model_;
};

TEST(Trainer, BspWithTwoWorkersMatchesOneProcessWithTheDoubledBatch) {
  Fixture f;
  constexpr std::size_t kBatch = 8;

  auto single_opt = momentum_sgd(0.05);
  LocalExchange local(*single_opt);
  Bound single = make_bound(50);
  auto single_trainer = Trainer::create(small_options(2 * kBatch), single.model, f.train, f.test, local);
  ASSERT_TRUE(single_trainer);
  auto single_epochs = single_trainer->run();
  ASSERT_TRUE(single_epochs) << single_epochs.error().to_string();

  auto server_opt = momentum_sgd(0.05);
  FakeBspServer server(2, *server_opt);
  Bound workers[2] = {make_bound(50), make_bound(50)};
  Result<std::vector<EpochStats>> results[2];
  std::vector<std::thread> threads;
  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      BspExchange exchange(server, rank, workers[rank].model);
      TrainerOptions o = small_options(kBatch);
      o.rank = rank;
      o.num_workers = 2;
      auto trainer = Trainer::create(o, workers[rank].model, f.train, f.test, exchange);
      if (!trainer) {
        results[rank] = tl::unexpected<Error>(trainer.error());
        return;
      }
      results[rank] = trainer->run();
    });
  }
  for (auto& t : threads) t.join();
  for (auto& r : results) ASSERT_TRUE(r) << r.error().to_string();

  EXPECT_EQ(workers[0].values, workers[1].values);
  ASSERT_EQ(single.values.size(), workers[0].values.size());
  double max_diff = 0.0;
  for (std::size_t i = 0; i < single.values.size(); ++i) {
    max_diff = std::max(max_diff, static_cast<double>(std::abs(single.values[i] - workers[0].values[i])));
  }
  EXPECT_LT(max_diff, 1e-4);
  // The ranks' mean batch loss is the combined batch's loss.
  for (std::size_t e = 0; e < 2; ++e) {
    EXPECT_EQ((*results[0])[e].steps, (*single_epochs)[e].steps);
    const double mean = ((*results[0])[e].train_loss + (*results[1])[e].train_loss) / 2;
    EXPECT_NEAR(mean, (*single_epochs)[e].train_loss, 1e-4);
    EXPECT_DOUBLE_EQ((*results[0])[e].test.accuracy, (*single_epochs)[e].test.accuracy);
  }
  // And training happened: the parameters moved from their initial values.
  Bound fresh = make_bound(50);
  fresh.model.init_he(3);
  EXPECT_NE(fresh.values, single.values);
}

}  // namespace
}  // namespace ember::fashion_mnist
