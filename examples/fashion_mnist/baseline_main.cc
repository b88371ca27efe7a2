// fmnist-baseline: the Fashion-MNIST MLP trained in one process, without
// Ember. It is the reference the distributed job is compared with: the same
// data, model, initialisation, sample order (a run with --batch-size W*B sees
// at each step exactly the samples W BSP workers with batch B see together)
// and optimizer formulas as the server.
//
// Prints one line per epoch and a last line for scripts:
//   RESULT epochs=3 batch_size=128 optimizer=sgd lr=0.05 ... test_accuracy=0.8731 ...
// Exit status: 0 on success, 1 on a training or data error, 2 on a
// command-line error (an unknown or bad option).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "common/base/cli_exit.h"
#include "common/base/error.h"
#include "common/base/logging.h"
#include "examples/fashion_mnist/cli.h"
#include "examples/fashion_mnist/data.h"
#include "examples/fashion_mnist/mlp.h"
#include "examples/fashion_mnist/optimizer.h"
#include "examples/fashion_mnist/trainer.h"

namespace {

namespace fm = ember::fashion_mnist;

struct Options {
  std::string data_dir{fm::kDefaultDataDir};
  std::size_t batch_size = 256;
  std::uint32_t epochs = 3;
  std::string optimizer = "sgd";
  double lr = -1.0;  // < 0: the optimizer's default below
  double momentum = 0.9;
  double dampening = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  std::uint64_t seed = 1;
  std::size_t max_steps_per_epoch = 0;
  std::size_t eval_batch_size = 1000;
  std::size_t block_rows = fm::kDefaultBlockRows;
  std::string log_level = "info";
  std::string save_params;
};

constexpr double kDefaultSgdLr = 0.05;
constexpr double kDefaultAdamLr = 1e-3;

ember::Result<std::unique_ptr<fm::Optimizer>> make_optimizer(Options& o) {
  if (o.optimizer == "sgd") {
    if (o.lr < 0) o.lr = kDefaultSgdLr;
    fm::SgdOptions sgd;
    sgd.lr = o.lr;
    sgd.momentum = o.momentum;
    sgd.dampening = o.dampening;
    sgd.nesterov = o.nesterov;
    sgd.weight_decay = o.weight_decay;
    return fm::make_sgd(sgd);
  }
  if (o.lr < 0) o.lr = kDefaultAdamLr;
  fm::AdamOptions adam;
  adam.lr = o.lr;
  adam.beta1 = o.beta1;
  adam.beta2 = o.beta2;
  adam.eps = o.eps;
  adam.weight_decay = o.weight_decay;
  return fm::make_adam(adam);
}

int train(Options o) {
  auto log = ember::log::logger("fmnist");
  auto optimizer = make_optimizer(o);
  if (!optimizer) {
    log->error("{}", optimizer.error());
    return 1;
  }
  auto data = fm::load_fashion_mnist(o.data_dir);
  if (!data) {
    log->error("{}", data.error());
    return 1;
  }
  fm::TrainerOptions topt;
  topt.batch_size = o.batch_size;
  topt.epochs = o.epochs;
  topt.seed = o.seed;
  topt.max_steps_per_epoch = o.max_steps_per_epoch;
  topt.eval_batch_size = o.eval_batch_size;

  fm::MlpSpec spec;
  spec.block_rows = o.block_rows;
  auto model = fm::Mlp::create(spec, fm::required_max_batch_size(topt));
  if (!model) {
    log->error("{}", model.error());
    return 1;
  }
  // The caller owns the parameter storage (a worker uses pool memory here).
  std::vector<float> values(model->num_parameters());
  std::vector<float> grads(model->num_parameters());
  if (auto s = model->bind(values, grads); !s) {
    log->error("{}", s.error());
    return 1;
  }
  fm::LocalExchange exchange(**optimizer);
  auto trainer = fm::Trainer::create(topt, *model, data->train, data->test, exchange);
  if (!trainer) {
    log->error("{}", trainer.error());
    return 1;
  }
  fmt::print("fmnist-baseline: {} train / {} test samples, MLP {} ({} parameters), batch {}, "
             "{} steps/epoch, {}\n",
             data->train.num_samples, data->test.num_samples,
             fmt::join(model->spec().layer_sizes, "-"), model->num_parameters(), o.batch_size,
             trainer->steps_per_epoch(), (*optimizer)->describe());
  std::fflush(stdout);

  double train_seconds = 0.0;
  double exchange_seconds = 0.0;
  std::size_t samples = 0;
  auto epochs = trainer->run([&](const fm::EpochStats& e) {
    train_seconds += e.train_seconds;
    exchange_seconds += e.exchange_seconds;
    samples += e.samples;
    fmt::print("epoch {}/{} steps={} train_loss={:.4f} train_accuracy={:.4f} test_loss={:.4f} "
               "test_accuracy={:.4f} samples_per_s={:.0f} epoch_s={:.2f} eval_s={:.2f} "
               "exchange_share={:.4f}\n",
               e.epoch, o.epochs, e.steps, e.train_loss, e.train_accuracy, e.test.loss,
               e.test.accuracy, e.samples_per_second(), e.train_seconds, e.test.seconds,
               e.communication_share());
    std::fflush(stdout);
  });
  if (!epochs) {
    log->error("{}", epochs.error());
    return 1;
  }
  if (!o.save_params.empty()) {
    // Raw float32, key order, packed: the layout fmnist-worker --save-params writes.
    std::FILE* f = std::fopen(o.save_params.c_str(), "wb");
    const bool written = f != nullptr &&
                         std::fwrite(values.data(), sizeof(float), values.size(), f) == values.size();
    if (f != nullptr && std::fclose(f) != 0) f = nullptr;
    if (!written || f == nullptr) {
      log->error("cannot write the parameters to '{}' (--save-params): {}", o.save_params,
                 std::strerror(errno));
      return 1;
    }
  }
  const fm::EpochStats& last = epochs->back();
  fmt::print("RESULT epochs={} batch_size={} optimizer={} lr={} momentum={} nesterov={} seed={} "
             "train_loss={:.4f} test_loss={:.4f} test_accuracy={:.4f} samples_per_s={:.0f} "
             "train_s={:.2f} exchange_share={:.4f}\n",
             o.epochs, o.batch_size, o.optimizer, o.lr, o.optimizer == "sgd" ? o.momentum : 0.0,
             o.nesterov ? 1 : 0, o.seed, last.train_loss, last.test.loss, last.test.accuracy,
             train_seconds > 0 ? samples / train_seconds : 0.0, train_seconds,
             train_seconds > 0 ? exchange_seconds / train_seconds : 0.0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options o;
    CLI::App app{"Fashion-MNIST MLP (784-256-128-10) trained in one process, without Ember: the "
                 "baseline for the distributed job."};
    fm::add_training_options(app, o, "Samples per step", "Seed of initialisation and shuffle");
    app.add_option("--optimizer", o.optimizer, "sgd (momentum SGD) or adam")
        ->capture_default_str()
        ->check(CLI::IsMember({"sgd", "adam"}));
    app.add_option("--lr", o.lr,
                   fmt::format("Learning rate (default {} for sgd, {} for adam)", kDefaultSgdLr,
                               kDefaultAdamLr));
    app.add_option("--momentum", o.momentum, "SGD momentum")->capture_default_str();
    app.add_option("--dampening", o.dampening, "SGD dampening")->capture_default_str();
    app.add_flag("--nesterov", o.nesterov, "SGD with Nesterov momentum");
    app.add_option("--weight-decay", o.weight_decay, "L2 penalty added to the gradient")
        ->capture_default_str();
    app.add_option("--beta1", o.beta1, "Adam beta1")->capture_default_str();
    app.add_option("--beta2", o.beta2, "Adam beta2")->capture_default_str();
    app.add_option("--eps", o.eps, "Adam epsilon")->capture_default_str();
    app.add_option("--save-params", o.save_params,
                   "After training, write the parameters to this file (raw float32, key order, "
                   "as fmnist-worker --save-params)");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return ember::cli_exit(app, e);
    }
    ember::log::init_program_logging(o.log_level);
    return train(std::move(o));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fmnist-baseline: fatal: %s\n", e.what());
    return 1;
  }
}
