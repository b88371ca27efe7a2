// The command-line options fmnist-worker and fmnist-baseline share (CLI11):
// the data, the sample order and the model's exchange granularity must be
// given the same way to both, since comparing the two is the point of the
// baseline.
#pragma once

#include <cstddef>
#include <string>

#include <CLI/CLI.hpp>

namespace ember::fashion_mnist {

// Adds --data-dir, --batch-size, --epochs, --seed, --max-steps-per-epoch,
// --block-rows, --eval-batch-size and --log-level to `app`, bound to the
// members of the same names of `o` (any struct that has them: data_dir,
// batch_size, epochs, seed, max_steps_per_epoch, block_rows,
// eval_batch_size, log_level), whose values are the defaults shown.
// `batch_help` and `seed_help` say what a step and the seed are to that
// program.
template <class Options>
void add_training_options(CLI::App& app, Options& o, const std::string& batch_help,
                          const std::string& seed_help) {
  app.add_option("--data-dir", o.data_dir,
                 "Directory of the gzipped IDX files (Debian package dataset-fashion-mnist)")
      ->capture_default_str();
  app.add_option("--batch-size", o.batch_size, batch_help)
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{60000}));
  app.add_option("--epochs", o.epochs, "Epochs to train")
      ->capture_default_str()
      ->check(CLI::Range(1u, 10000u));
  app.add_option("--seed", o.seed, seed_help)->capture_default_str();
  app.add_option("--max-steps-per-epoch", o.max_steps_per_epoch,
                 "Stop each epoch after this many steps (0: full epochs)")
      ->capture_default_str();
  app.add_option("--block-rows", o.block_rows,
                 "Rows per weight block exchanged on its own (0: whole tensors; the worker and "
                 "the baseline must agree for identical arithmetic)")
      ->capture_default_str();
  app.add_option("--eval-batch-size", o.eval_batch_size, "Samples per forward when evaluating")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{10000}));
  app.add_option("--log-level", o.log_level, "trace, debug, info, warn, error, critical, off")
      ->capture_default_str()
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));
}

}  // namespace ember::fashion_mnist
