// Server-side optimizers: the update a shard applies to a parameter chunk
// once it has the (averaged, under BSP) gradient of a step.
//
// Formulas are PyTorch's torch.optim single-tensor algorithms (the
// "Algorithm" boxes of the torch.optim.SGD / Adam / AdamW / Adagrad
// documentation, PyTorch 2.x), with dampening = 0, maximize = false,
// amsgrad = false and lr_decay = 0. The algorithms are those of
//   momentum   Polyak, "Some methods of speeding up the convergence of
//              iteration methods", USSR Comput. Math. 1964 (heavy ball);
//              nesterov = true is Nesterov (1983) in the form of Sutskever et
//              al., "On the importance of initialization and momentum in
//              deep learning", ICML 2013, as PyTorch implements it;
//   adam       Kingma & Ba, "Adam: A Method for Stochastic Optimization",
//              ICLR 2015 (Algorithm 1, with eps outside the corrected sqrt);
//   adamw      Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
//              ICLR 2019 (decay scaled by lr, as PyTorch's AdamW);
//   adagrad    Duchi, Hazan & Singer, "Adaptive Subgradient Methods for
//              Online Learning and Stochastic Optimization", JMLR 2011.
//
//   sgd       g = grad + wd * p;                       p -= lr * g
//   momentum  g = grad + wd * p;  b = (t == 1) ? g : mu * b + g
//             g = nesterov ? g + mu * b : b;           p -= lr * g
//   adam      g = grad + wd * p;  m = b1 * m + (1 - b1) * g
//             v = b2 * v + (1 - b2) * g * g
//             p -= (lr / (1 - b1^t)) * (m / (sqrt(v) / sqrt(1 - b2^t) + eps))
//   adamw     p *= 1 - lr * wd;   then adam with wd = 0
//   adagrad   g = grad + wd * p;  s += g * g;          p -= lr * (g / (sqrt(s) + eps))
//
// t counts updates applied to the chunk, starting at 1 for the first. As in
// PyTorch, tensor arithmetic is float32 with the hyper-parameters rounded to
// float32, while the bias corrections (1 - b^t), the Adam step size and
// AdamW's decay factor (1 - lr * wd) are computed in double and rounded once. Adagrad's accumulator starts at
// `initial_accumulator` (PyTorch's initial_accumulator_value), Adam's moments
// at 0. Defaults are PyTorch's per type: eps 1e-10 for adagrad and 1e-8 for
// adam/adamw, weight decay 0.01 for adamw and 0 otherwise, initial_accumulator
// 0 (config::OptimizerConfig::epsilon_or_default, weight_decay_or_default).
// Under asp and ssp every push is an update of its own, so t counts pushes.
// The operations are done in the order written, without fused multiply-adds
// (-ffp-contract=off, server/CMakeLists.txt): Debug and Release servers give
// the same bits. The order of Adam's last line differs from PyTorch's
// (addcdiv of -step * m by the denominator), so after t = 1 the results may
// differ from PyTorch's in the last bits, not in accuracy.
//
// Thread-safety: an Optimizer is immutable except set_learning_rate(); each
// shard thread owns its own copy. apply() does not allocate.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "common/base/error.h"
#include "common/config/config.h"

namespace ember::server {

// Which [optimizer] numbers an optimizer type reads (learning_rate and
// weight_decay: all of them). Servers compare only these (the join's
// optimizer_check, a restore against its checkpoint): two sgd servers that
// differ in an unused beta2 update alike.
struct OptimizerUses {
  bool momentum = false;  // momentum and nesterov
  bool betas = false;     // beta1, beta2
  bool epsilon = false;
  bool initial_accumulator = false;
};
constexpr OptimizerUses optimizer_uses(config::OptimizerType t) noexcept {
  using T = config::OptimizerType;
  const bool adam = t == T::kAdam || t == T::kAdamW;
  return {t == T::kMomentum, adam, adam || t == T::kAdagrad, t == T::kAdagrad};
}

// Per-chunk optimizer state, owned by the chunk's entry and checkpointed.
struct OptimizerState {
  std::uint64_t num_updates = 0;  // t of the last update applied (0: none yet)
  // sgd: none. momentum: [buffer]. adam/adamw: [m, v]. adagrad: [sum].
  std::vector<std::vector<float>> slots;

  bool operator==(const OptimizerState&) const = default;
};

class Optimizer {
 public:
  // Validates ranges the config loader also checks (so Optimizers built in
  // code are safe): learning_rate > 0 and finite, 0 <= momentum < 1,
  // 0 <= beta < 1, epsilon > 0, weight_decay >= 0, initial_accumulator >= 0,
  // nesterov only with momentum. Errors: kInvalidArgument naming the field.
  static Result<Optimizer> create(const config::OptimizerConfig& config);

  config::OptimizerType type() const noexcept { return config_.type; }
  const config::OptimizerConfig& config() const noexcept { return config_; }
  double learning_rate() const noexcept { return config_.learning_rate; }

  // Errors: kInvalidArgument unless lr > 0 and finite; the rate is unchanged then.
  Status set_learning_rate(double lr);

  // Number of state vectors per chunk (see OptimizerState::slots).
  std::size_t num_slots() const noexcept;

  // Fresh state for a chunk of `num_elements` (allocates the slots).
  OptimizerState make_state(std::size_t num_elements) const;

  // Checks that `state` fits this optimizer and a chunk of `num_elements`
  // (slot count and sizes): a restored checkpoint may come from another
  // optimizer type. Errors: kCorrupt naming what differs.
  Status check_state(const OptimizerState& state, std::size_t num_elements) const;

  // One update: params and state move from step t-1 to t. `grad` is read
  // only. pre: params.size() == grad.size(), state fits (make_state or
  // check_state). No allocation.
  void apply(std::span<float> params, std::span<const float> grad, OptimizerState& state) const;

  // The same update with the gradient (sum[i] + last[i]) / count, each
  // element formed in float32 as written: bit for bit what apply() gives on a
  // buffer holding those values, without writing that buffer (one pass over
  // memory instead of three). For a bsp round: `sum` holds the first
  // count - 1 contributions added in rank order, `last` the last one.
  // pre: the three spans have one size, count >= 2, state fits. No allocation.
  void apply_mean(std::span<float> params, std::span<const float> sum,
                  std::span<const float> last, std::uint32_t count, OptimizerState& state) const;

 private:
  explicit Optimizer(const config::OptimizerConfig& config) : config_(config) {}
  config::OptimizerConfig config_;
};

}  // namespace ember::server
