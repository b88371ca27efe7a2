// fmnist-worker: one data-parallel worker of the Fashion-MNIST job. It trains
// the MLP of mlp.h on its shard of the training set (sampler.h) and exchanges
// gradients for parameters through ember-server (EmberExchange): the servers
// named in the config's [cluster] table average the workers' gradients and
// apply the [optimizer] of their config.
//
//   fmnist-worker --config run.toml --rank 0 [--epochs 3] [--batch-size 128] ...
//
// Every worker of a job loads the same config (the [cluster] and
// [communication] tables must agree); only the rank differs (--rank, else
// $EMBER_WORKER_RANK as set by scripts/launch_workers.sh, else worker.rank).
// Every worker needs the same --epochs, --batch-size, --seed, --hidden and
// --max-steps-per-epoch: they fix the steps and the samples of each step.
//
// A worker that died (kill -9, crash) while the job runs with [server]
// on_worker_loss = "wait" or "shrink" is restarted with the same command plus --rejoin:
// it takes the servers' parameters and continues from their step (the epoch
// and the step in it follow; the epoch's sample order is the usual one), and
// the run still ends after --epochs epochs in all (ember_exchange.h,
// "Rejoin"). Without --rejoin a worker refuses servers that are past step 0.
//
// Output (stdout), for people and for scripts/demo.sh:
//   fmnist-worker rank 0/2: ... (one header line)
//   rank 1 rejoins the job at step 57 (epoch 2, step 17 of 40)   with --rejoin,
//                          when the job is past step 0 (17 of the epoch's 40
//                          steps were done: the first one run is its 18th)
//   progress epoch=1 step=40/234 loss=0.6121         every --progress-every steps
//   epoch 1/3 steps=234 train_loss=... test_accuracy=... samples_per_s=... comm_share=...
//   RESULT rank=0 workers=2 ... test_accuracy=0.8712 samples_per_s=... comm_share=...
// comm_share is the time the training thread was blocked in Ember calls over
// the training time (trainer.h); the epoch line also gives its two parts,
// comm_send_s (inside gradients_ready: handing gradients over) and
// comm_wait_s (waiting for parameters and at the end of the epoch). After a
// server restarted from an older checkpoint the epoch line ends with
// redone_steps=<n> (steps computed again: ember_exchange.h, "Resync"), and an
// epoch gone back into is printed again when it ends. Errors go to stderr as one line
//   fmnist-worker rank R: error: <code>: <what failed, with context>
// Exit status: 0 on success; 1 on any error (data, config, Ember: server
// absent, timeout, worker lost, ...); 2 on a command-line error (an unknown or
// bad option).
#include <pthread.h>
#include <sched.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/base/cli_exit.h"
#include "common/base/error.h"
#include "common/base/logging.h"
#include "common/config/config.h"
#include "examples/fashion_mnist/cli.h"
#include "examples/fashion_mnist/data.h"
#include "examples/fashion_mnist/ember_exchange.h"
#include "examples/fashion_mnist/mlp.h"
#include "examples/fashion_mnist/trainer.h"
#include "worker/worker.h"

namespace {

namespace fm = ember::fashion_mnist;

struct Options {
  std::string config_path;
  std::vector<std::string> overrides;
  std::int64_t rank = -1;  // < 0: $EMBER_WORKER_RANK, else the config's worker.rank
  std::string data_dir{fm::kDefaultDataDir};
  std::vector<std::size_t> hidden{256, 128};
  std::size_t batch_size = 128;
  std::uint32_t epochs = 3;
  std::uint64_t seed = 1;
  std::size_t max_steps_per_epoch = 0;
  std::size_t eval_batch_size = 1000;
  std::size_t block_rows = fm::kDefaultBlockRows;
  std::size_t max_eval_samples = 0;
  std::size_t progress_every = 10;
  bool initial_eval = false;
  bool rejoin = false;
  std::string save_params;
  std::string log_level = "info";
  // >= 0: the training thread (this one) is pinned to that CPU once the
  // Worker (and its I/O threads, which keep their own affinity) exists.
  int compute_cpu = -1;
};

// Checks that `cpu` is in the process's affinity mask (before connecting).
ember::Status check_compute_cpu(int cpu) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) {
    return ember::make_sys_error(errno, "--compute-cpu {}: sched_getaffinity", cpu);
  }
  if (cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed)) {
    std::vector<int> ids;
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &allowed)) ids.push_back(c);
    }
    return ember::make_error(ember::ErrorCode::kInvalidArgument,
                             "--compute-cpu {}: CPU {} is not in this process's allowed CPUs "
                             "({}: taskset or the cgroup cpuset); give one of them",
                             cpu, cpu, fmt::join(ids, ", "));
  }
  return ember::ok_status();
}

// Pins the calling thread to `cpu` (check_compute_cpu first).
ember::Status pin_training_thread(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  if (int rc = pthread_setaffinity_np(pthread_self(), sizeof one, &one); rc != 0) {
    return ember::make_sys_error(rc, "--compute-cpu {}: pthread_setaffinity_np", cpu);
  }
  return ember::ok_status();
}

// The server-side optimizer as configured, for the header line.
std::string describe_optimizer(const ember::config::OptimizerConfig& o) {
  using ember::config::OptimizerType;
  std::string s = fmt::format("{} lr={}", ember::config::to_string(o.type), o.learning_rate);
  switch (o.type) {
    case OptimizerType::kMomentum:
      s += fmt::format(" momentum={} nesterov={}", o.momentum, o.nesterov ? 1 : 0);
      break;
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      s += fmt::format(" beta1={} beta2={} eps={}", o.beta1, o.beta2, o.epsilon_or_default());
      break;
    case OptimizerType::kAdagrad:
      s += fmt::format(" eps={} initial_accumulator={}", o.epsilon_or_default(),
                       o.initial_accumulator);
      break;
    default:
      break;
  }
  if (const double wd = o.weight_decay_or_default(); wd != 0.0) {
    s += fmt::format(" weight_decay={}", wd);
  }
  return s;
}

// Raw float32 in the host's byte order, every tensor in key order, packed
// (the model's contiguous binding; see mlp.h for the tensor table).
ember::Status save_parameters(const std::string& path, std::span<const float> values) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return ember::make_sys_error(errno, "cannot create '{}' (--save-params)", path);
  f.write(reinterpret_cast<const char*>(values.data()),
          static_cast<std::streamsize>(values.size_bytes()));
  f.close();
  if (!f) return ember::make_sys_error(errno, "writing the parameters to '{}'", path);
  return ember::ok_status();
}

class Run {
 public:
  explicit Run(Options o) : o_(std::move(o)) {}

  int main() {
    if (ember::Status s = train(); !s) {
      fmt::print(stderr, "fmnist-worker rank {}: error: {}\n", rank_text(), s.error().to_string());
      return 1;
    }
    return 0;
  }

 private:
  std::string rank_text() const { return rank_ < 0 ? "?" : std::to_string(rank_); }

  ember::Result<ember::config::Config> load_config() {
    EMBER_ASSIGN_OR_RETURN(ember::config::Config config,
                           ember::config::load_config_file(o_.config_path));
    if (o_.rank < 0) {
      if (const char* env = std::getenv("EMBER_WORKER_RANK"); env != nullptr && *env != '\0') {
        char* end = nullptr;
        const long v = std::strtol(env, &end, 10);
        if (*end != '\0' || v < 0 || v > 0xffffffffL) {
          return ember::make_error(ember::ErrorCode::kInvalidArgument,
                                   "EMBER_WORKER_RANK='{}' is not a rank; give --rank N", env);
        }
        o_.rank = v;
      }
    }
    if (o_.rank >= 0) ember::config::set_worker_rank(config, static_cast<std::uint32_t>(o_.rank));
    rank_ = config.worker.rank;
    // --set last: a job's shape given on the command line is checked
    // together with the rank (apply_overrides validates the result).
    if (o_.overrides.empty()) {
      EMBER_TRY(ember::config::validate(config, o_.config_path));
    } else {
      EMBER_TRY(ember::config::apply_overrides(config, o_.overrides));
    }
    rank_ = config.worker.rank;
    return config;
  }

  ember::Status train() {
    EMBER_ASSIGN_OR_RETURN(ember::config::Config config, load_config());
    if (o_.compute_cpu >= 0) EMBER_TRY(check_compute_cpu(o_.compute_cpu));
    // A wrong --data-dir is reported at once, not after the connect retries.
    EMBER_TRY(fm::check_fashion_mnist_files(o_.data_dir));
    // Connect first: an absent server is reported before the data is read.
    // Declaration order is destruction order reversed: the exchange (which
    // waits for in-flight operations) goes before the buffers, the buffers
    // before the Worker that owns their pool.
    EMBER_ASSIGN_OR_RETURN(std::unique_ptr<ember::Worker> worker, ember::Worker::create(config));
    // After the Worker: its I/O threads inherit this thread's mask before
    // applying [communication] cpu_affinity, which is checked against it.
    if (o_.compute_cpu >= 0) EMBER_TRY(pin_training_thread(o_.compute_cpu));
    EMBER_ASSIGN_OR_RETURN(fm::FashionMnist data, fm::load_fashion_mnist(o_.data_dir));

    fm::TrainerOptions topt;
    topt.rank = config.worker.rank;
    topt.num_workers = config.cluster.num_workers;
    topt.batch_size = o_.batch_size;
    topt.epochs = o_.epochs;
    topt.seed = o_.seed;
    topt.max_steps_per_epoch = o_.max_steps_per_epoch;
    topt.eval_batch_size = o_.eval_batch_size;
    topt.max_eval_samples = o_.max_eval_samples;

    fm::MlpSpec spec;
    spec.layer_sizes.assign({data.train.num_features()});
    spec.layer_sizes.insert(spec.layer_sizes.end(), o_.hidden.begin(), o_.hidden.end());
    spec.layer_sizes.push_back(fm::kNumClasses);
    spec.block_rows = o_.block_rows;

    EMBER_ASSIGN_OR_RETURN(fm::Mlp model, fm::Mlp::create(spec, fm::required_max_batch_size(topt)));
    EMBER_ASSIGN_OR_RETURN(fm::PoolModelBuffers buffers, fm::bind_pool_buffers(*worker, model));
    fm::EmberExchange exchange(*worker, fm::EmberExchangeOptions{.rejoin = o_.rejoin});
    EMBER_ASSIGN_OR_RETURN(fm::Trainer trainer,
                           fm::Trainer::create(topt, model, data.train, data.test, exchange));

    const auto& cfg = worker->config();
    fmt::print("fmnist-worker rank {}/{}: {} train / {} test samples, MLP {} ({} parameters), "
               "batch {} per worker ({} combined), {} steps/epoch, {} server(s), transport {}, "
               "consistency {}, server optimizer {}, parameters in {}; training thread on {}, I/O "
               "threads on {}, inline_write {} bytes\n",
               worker->rank(), worker->num_workers(), data.train.num_samples,
               data.test.num_samples, fmt::join(spec.layer_sizes, "-"), model.num_parameters(),
               o_.batch_size, o_.batch_size * worker->num_workers(), trainer.steps_per_epoch(),
               worker->num_servers(), ember::config::to_string(cfg.communication.transport),
               ember::config::to_string(cfg.server.consistency), describe_optimizer(cfg.optimizer),
               buffers.values.in_pool() && buffers.grads.in_pool() ? "pool" : "heap",
               o_.compute_cpu >= 0 ? fmt::format("CPU {}", o_.compute_cpu) : "any allowed CPU",
               cfg.communication.cpu_affinity.empty()
                   ? std::string("any allowed CPU")
                   : fmt::format("CPU [{}]", fmt::join(cfg.communication.cpu_affinity, ", ")),
               cfg.communication.inline_write_bytes);
    std::fflush(stdout);

    if (o_.progress_every > 0) {
      trainer.set_step_callback([this](const fm::StepProgress& p) {
        if (p.step_in_epoch % o_.progress_every == 0 || p.step_in_epoch == p.steps_in_epoch) {
          fmt::print("progress epoch={} step={}/{} loss={:.4f}\n", p.epoch, p.step_in_epoch,
                     p.steps_in_epoch, p.loss);
          std::fflush(stdout);
        }
      });
    }

    EMBER_TRY(trainer.start());
    if (const auto& r = trainer.resumed()) {
      fmt::print("rank {} rejoins the job at step {} (epoch {}, step {} of {})\n", worker->rank(),
                 r->step, r->epoch, r->step_in_epoch, r->steps_in_epoch);
      std::fflush(stdout);
    }
    if (o_.initial_eval) {
      const fm::EvalStats e = trainer.evaluate();
      fmt::print("initial test_loss={:.4f} test_accuracy={:.4f}\n", e.loss, e.accuracy);
      std::fflush(stdout);
    }

    double train_seconds = 0.0;
    double exchange_seconds = 0.0;
    std::size_t samples = 0;
    EMBER_ASSIGN_OR_RETURN(std::vector<fm::EpochStats> epochs,
                           trainer.run([&](const fm::EpochStats& e) {
                             train_seconds += e.train_seconds;
                             exchange_seconds += e.exchange_seconds;
                             samples += e.samples;
                             fmt::print("epoch {}/{} steps={} train_loss={:.4f} "
                                        "train_accuracy={:.4f} test_loss={:.4f} "
                                        "test_accuracy={:.4f} samples_per_s={:.0f} epoch_s={:.2f} "
                                        "eval_s={:.2f} comm_share={:.4f} comm_send_s={:.3f} "
                                        "comm_wait_s={:.3f}{}\n",
                                        e.epoch, o_.epochs, e.steps, e.train_loss,
                                        e.train_accuracy, e.test.loss, e.test.accuracy,
                                        e.samples_per_second(), e.train_seconds, e.test.seconds,
                                        e.communication_share(), e.send_seconds,
                                        e.exchange_seconds - e.send_seconds,
                                        e.redone_steps > 0
                                            ? fmt::format(" redone_steps={}", e.redone_steps)
                                            : std::string());
                             std::fflush(stdout);
                           }));

    if (!o_.save_params.empty()) EMBER_TRY(save_parameters(o_.save_params, buffers.values.floats()));

    const fm::EpochStats& last = epochs.back();
    fmt::print("RESULT rank={} workers={} servers={} transport={} consistency={} epochs={} "
               "batch_size={} seed={} steps={} train_loss={:.4f} test_loss={:.4f} "
               "test_accuracy={:.4f} samples_per_s={:.0f} train_s={:.2f} comm_share={:.4f}\n",
               worker->rank(), worker->num_workers(), worker->num_servers(),
               ember::config::to_string(cfg.communication.transport),
               ember::config::to_string(cfg.server.consistency), o_.epochs, o_.batch_size, o_.seed,
               trainer.steps_done(), last.train_loss, last.test.loss, last.test.accuracy,
               train_seconds > 0 ? static_cast<double>(samples) / train_seconds : 0.0,
               train_seconds, train_seconds > 0 ? exchange_seconds / train_seconds : 0.0);
    std::fflush(stdout);
    return ember::ok_status();
  }

  Options o_;
  std::int64_t rank_ = -1;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    Options o;
    CLI::App app{"One data-parallel worker of the Fashion-MNIST MLP job: trains on its shard and "
                 "exchanges gradients for parameters through ember-server."};
    app.add_option("-c,--config", o.config_path,
                   "TOML config shared by the job's servers and workers (see config/ember.toml)")
        ->required()
        ->check(CLI::ExistingFile);
    app.add_option("--set", o.overrides, "Override one config key: table.key=value (repeatable)");
    app.add_option("--rank", o.rank,
                   "This worker's rank (default: $EMBER_WORKER_RANK, else worker.rank)")
        ->check(CLI::Range(std::int64_t{0}, std::int64_t{0xffffffff}));
    fm::add_training_options(app, o, "Samples per step on this worker",
                             "Seed of initialisation and shuffle (same on every worker)");
    app.add_option("--hidden", o.hidden, "Hidden layer widths (same on every worker)")
        ->delimiter(',')
        ->capture_default_str()
        ->check(CLI::Range(std::size_t{1}, std::size_t{65536}));
    app.add_option("--max-eval-samples", o.max_eval_samples,
                   "Evaluate on the first this many test samples (0: all 10,000)")
        ->capture_default_str();
    app.add_option("--progress-every", o.progress_every,
                   "Print a progress line every this many steps (0: none)")
        ->capture_default_str();
    app.add_flag("--initial-eval", o.initial_eval,
                 "Evaluate the initial parameters before training");
    app.add_flag("--rejoin", o.rejoin,
                 "This rank is a restarted worker of a job the servers are running: continue "
                 "from the servers' step (their parameters; the epoch and step follow from it) "
                 "instead of refusing servers past step 0. Same command otherwise; the job's "
                 "[server] on_worker_loss must be \"wait\" or \"shrink\" (under \"fail\" the others "
                 "failed already)");
    app.add_option("--save-params", o.save_params,
                   "After training, write the parameters to this file (raw float32, key order)");
    app.add_option("--compute-cpu", o.compute_cpu,
                   "Pin the training thread to this CPU (it must be in the taskset mask); the "
                   "I/O threads follow [communication] cpu_affinity, e.g. a spare core")
        ->check(CLI::Range(0, CPU_SETSIZE - 1));
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return ember::cli_exit(app, e);
    }
    ember::log::init_program_logging(o.log_level);
    return Run(std::move(o)).main();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fmnist-worker: fatal: %s\n", e.what());
    return 1;
  }
}
