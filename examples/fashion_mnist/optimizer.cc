// PyTorch-compatible SGD/momentum and Adam (formulas in optimizer.h).
#include "examples/fashion_mnist/optimizer.h"

#include <cmath>
#include <optional>
#include <unordered_map>
#include <vector>

#include <Eigen/Core>

#include "server/optimizer.h"

namespace ember::fashion_mnist {
namespace {

// Element-wise math through Eigen arrays, so that it is vectorised.
using ArrayMap = Eigen::Map<Eigen::ArrayXf>;
using ConstArrayMap = Eigen::Map<const Eigen::ArrayXf>;

Status check_non_negative(std::string_view what, double value) {
  if (!std::isfinite(value) || value < 0.0) {
    return make_error(ErrorCode::kInvalidArgument, "optimizer: {} must be finite and >= 0, got {}",
                      what, value);
  }
  return ok_status();
}

Status check_beta(std::string_view what, double value) {
  if (!(value >= 0.0 && value < 1.0)) {
    return make_error(ErrorCode::kInvalidArgument, "optimizer: {} must be in [0, 1), got {}", what,
                      value);
  }
  return ok_status();
}

Status check_sizes(std::uint64_t key, std::size_t param_size, std::size_t grad_size,
                   std::size_t state_size) {
  if (param_size != grad_size) {
    return make_error(ErrorCode::kShapeMismatch,
                      "optimizer: key {}: parameter has {} floats but gradient {}", key,
                      param_size, grad_size);
  }
  if (param_size != state_size) {
    return make_error(ErrorCode::kShapeMismatch,
                      "optimizer: key {}: {} floats, but its first step had {}", key, param_size,
                      state_size);
  }
  return ok_status();
}

// The server's update, the very same compiled code (server/optimizer.h),
// for the options it supports. Why not an own implementation of the same
// formulas: float arithmetic is not associative, and the compiler contracts
// a * b + c into one fused multiply-add (one rounding) differently in
// differently written loops, so an own loop drifts from the server by an ulp
// in some elements from the second step on, and training amplifies that (the
// cause of a 1-worker Ember run ending at 0.8732 test accuracy while this
// baseline ended at 0.8782 with the same seed). Returns nullopt when the
// server's rules refuse the options (lr == 0, eps == 0, dampening): those
// take the Eigen path below, which has no server counterpart to match.
std::optional<server::Optimizer> server_optimizer(const config::OptimizerConfig& c) {
  Result<server::Optimizer> r = server::Optimizer::create(c);
  if (!r) return std::nullopt;
  return std::move(*r);
}

// Per-key state in the server's layout (slots), so either path can run on it.
struct KeyState {
  server::OptimizerState state;
};

Status prepare_state(std::unordered_map<std::uint64_t, KeyState>& states, std::uint64_t key,
                     std::size_t param_size, std::size_t grad_size, std::size_t num_slots,
                     server::OptimizerState*& out) {
  auto [it, first] = states.try_emplace(key);
  server::OptimizerState& state = it->second.state;
  if (first) state.slots.assign(num_slots, std::vector<float>(param_size, 0.0f));
  const std::size_t state_size = num_slots == 0 ? param_size : state.slots[0].size();
  if (Status s = check_sizes(key, param_size, grad_size, state_size); !s) {
    if (first) states.erase(it);
    return s;
  }
  out = &state;
  return ok_status();
}

class Sgd final : public Optimizer {
 public:
  explicit Sgd(const SgdOptions& options) : options_(options) { rebuild(); }

  Status step(std::uint64_t key, std::span<float> param, std::span<const float> grad) override {
    server::OptimizerState* state = nullptr;
    // One slot always (velocity), also without momentum: sizes are checked
    // against the key's first step either way.
    EMBER_TRY(prepare_state(state_, key, param.size(), grad.size(), 1, state));
    if (server_) {
      // The server keeps no velocity for plain sgd: hand it a stateless view.
      if (options_.momentum == 0.0) {
        server::OptimizerState none;
        none.num_updates = state->num_updates;
        server_->apply(param, grad, none);
        state->num_updates = none.num_updates;
      } else {
        server_->apply(param, grad, *state);
      }
      return ok_status();
    }
    const bool first_step = state->num_updates++ == 0;
    const auto lr = static_cast<float>(options_.lr);
    const auto momentum = static_cast<float>(options_.momentum);
    const auto one_minus_dampening = static_cast<float>(1.0 - options_.dampening);
    const auto weight_decay = static_cast<float>(options_.weight_decay);
    ArrayMap p(param.data(), static_cast<Eigen::Index>(param.size()));
    ConstArrayMap raw_grad(grad.data(), static_cast<Eigen::Index>(grad.size()));
    ArrayMap b(state->slots[0].data(), static_cast<Eigen::Index>(state->slots[0].size()));
    // `g` is an unevaluated expression of p_{t-1}: b is updated before p.
    auto update = [&](const auto& g) {
      if (options_.momentum == 0.0) {
        p -= lr * g;
        return;
      }
      if (first_step) {
        b = g;
      } else {
        b = momentum * b + one_minus_dampening * g;
      }
      if (options_.nesterov) {
        p -= lr * (g + momentum * b);
      } else {
        p -= lr * b;
      }
    };
    if (options_.weight_decay != 0.0) {
      update(raw_grad + weight_decay * p);
    } else {
      update(raw_grad);
    }
    return ok_status();
  }

  Status set_learning_rate(double lr) override {
    EMBER_TRY(check_non_negative("lr", lr));
    options_.lr = lr;
    rebuild();
    return ok_status();
  }
  double learning_rate() const override { return options_.lr; }

  std::string describe() const override {
    return fmt::format("sgd lr={} momentum={} dampening={} nesterov={} weight_decay={}",
                       options_.lr, options_.momentum, options_.dampening,
                       options_.nesterov ? 1 : 0, options_.weight_decay);
  }

 private:
  void rebuild() {
    server_.reset();
    if (options_.dampening != 0.0) return;
    config::OptimizerConfig c;
    c.type = options_.momentum == 0.0 ? config::OptimizerType::kSgd
                                      : config::OptimizerType::kMomentum;
    c.learning_rate = options_.lr;
    c.momentum = options_.momentum;
    c.nesterov = options_.nesterov;
    c.weight_decay = options_.weight_decay;
    server_ = server_optimizer(c);
  }

  SgdOptions options_;
  std::optional<server::Optimizer> server_;  // nullopt: the Eigen path
  std::unordered_map<std::uint64_t, KeyState> state_;  // slot 0: velocity b
};

class Adam final : public Optimizer {
 public:
  explicit Adam(const AdamOptions& options) : options_(options) { rebuild(); }

  Status step(std::uint64_t key, std::span<float> param, std::span<const float> grad) override {
    server::OptimizerState* state = nullptr;
    EMBER_TRY(prepare_state(state_, key, param.size(), grad.size(), 2, state));
    if (server_) {
      server_->apply(param, grad, *state);
      return ok_status();
    }
    const double t = static_cast<double>(++state->num_updates);
    const double bias_correction1 = 1.0 - std::pow(options_.beta1, t);
    const double bias_correction2 = 1.0 - std::pow(options_.beta2, t);
    const auto step_size = static_cast<float>(options_.lr / bias_correction1);
    const auto bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
    const auto beta1 = static_cast<float>(options_.beta1);
    const auto beta2 = static_cast<float>(options_.beta2);
    const auto one_minus_beta1 = static_cast<float>(1.0 - options_.beta1);
    const auto one_minus_beta2 = static_cast<float>(1.0 - options_.beta2);
    const auto eps = static_cast<float>(options_.eps);
    const auto weight_decay = static_cast<float>(options_.weight_decay);
    ArrayMap p(param.data(), static_cast<Eigen::Index>(param.size()));
    ConstArrayMap raw_grad(grad.data(), static_cast<Eigen::Index>(grad.size()));
    ArrayMap m(state->slots[0].data(), static_cast<Eigen::Index>(state->slots[0].size()));
    ArrayMap v(state->slots[1].data(), static_cast<Eigen::Index>(state->slots[1].size()));
    // `g` is an unevaluated expression of p_{t-1}: m and v are updated before p.
    auto update = [&](const auto& g) {
      m = beta1 * m + one_minus_beta1 * g;
      v = beta2 * v + one_minus_beta2 * g.square();
      p -= step_size * (m / (v.sqrt() / bias_correction2_sqrt + eps));
    };
    if (options_.weight_decay != 0.0) {
      update(raw_grad + weight_decay * p);
    } else {
      update(raw_grad);
    }
    return ok_status();
  }

  Status set_learning_rate(double lr) override {
    EMBER_TRY(check_non_negative("lr", lr));
    options_.lr = lr;
    rebuild();
    return ok_status();
  }
  double learning_rate() const override { return options_.lr; }

  std::string describe() const override {
    return fmt::format("adam lr={} beta1={} beta2={} eps={} weight_decay={}", options_.lr,
                       options_.beta1, options_.beta2, options_.eps, options_.weight_decay);
  }

 private:
  void rebuild() {
    config::OptimizerConfig c;
    c.type = config::OptimizerType::kAdam;
    c.learning_rate = options_.lr;
    c.beta1 = options_.beta1;
    c.beta2 = options_.beta2;
    c.epsilon = options_.eps;
    c.weight_decay = options_.weight_decay;
    server_ = server_optimizer(c);
  }

  AdamOptions options_;
  std::optional<server::Optimizer> server_;  // nullopt: the Eigen path
  std::unordered_map<std::uint64_t, KeyState> state_;  // slots: m, v
};

}  // namespace

Result<std::unique_ptr<Optimizer>> make_sgd(const SgdOptions& options) {
  EMBER_TRY(check_non_negative("lr", options.lr));
  EMBER_TRY(check_non_negative("momentum", options.momentum));
  EMBER_TRY(check_non_negative("weight_decay", options.weight_decay));
  if (!std::isfinite(options.dampening)) {
    return make_error(ErrorCode::kInvalidArgument, "optimizer: dampening must be finite, got {}",
                      options.dampening);
  }
  if (options.nesterov && (options.momentum <= 0.0 || options.dampening != 0.0)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "optimizer: nesterov needs momentum > 0 and dampening == 0 (got momentum={} "
                      "dampening={})",
                      options.momentum, options.dampening);
  }
  return std::unique_ptr<Optimizer>(std::make_unique<Sgd>(options));
}

Result<std::unique_ptr<Optimizer>> make_adam(const AdamOptions& options) {
  EMBER_TRY(check_non_negative("lr", options.lr));
  EMBER_TRY(check_non_negative("eps", options.eps));
  EMBER_TRY(check_non_negative("weight_decay", options.weight_decay));
  EMBER_TRY(check_beta("beta1", options.beta1));
  EMBER_TRY(check_beta("beta2", options.beta2));
  return std::unique_ptr<Optimizer>(std::make_unique<Adam>(options));
}

}  // namespace ember::fashion_mnist
