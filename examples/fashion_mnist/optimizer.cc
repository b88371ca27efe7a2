// PyTorch-compatible SGD/momentum and Adam (formulas in optimizer.h).
#include "examples/fashion_mnist/optimizer.h"

#include <cmath>
#include <unordered_map>
#include <vector>

#include <Eigen/Core>

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

class Sgd final : public Optimizer {
 public:
  explicit Sgd(const SgdOptions& options) : options_(options) {}

  Status step(std::uint64_t key, std::span<float> param, std::span<const float> grad) override {
    auto [it, first] = state_.try_emplace(key);
    std::vector<float>& velocity = it->second.velocity;
    if (first) velocity.assign(param.size(), 0.0f);
    if (Status s = check_sizes(key, param.size(), grad.size(), velocity.size()); !s) {
      if (first) state_.erase(it);
      return s;
    }
    const bool first_step = it->second.steps++ == 0;
    const auto lr = static_cast<float>(options_.lr);
    const auto momentum = static_cast<float>(options_.momentum);
    const auto one_minus_dampening = static_cast<float>(1.0 - options_.dampening);
    const auto weight_decay = static_cast<float>(options_.weight_decay);
    ArrayMap p(param.data(), static_cast<Eigen::Index>(param.size()));
    ConstArrayMap raw_grad(grad.data(), static_cast<Eigen::Index>(grad.size()));
    ArrayMap b(velocity.data(), static_cast<Eigen::Index>(velocity.size()));
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
    return ok_status();
  }
  double learning_rate() const override { return options_.lr; }

  std::string describe() const override {
    return fmt::format("sgd lr={} momentum={} dampening={} nesterov={} weight_decay={}",
                       options_.lr, options_.momentum, options_.dampening,
                       options_.nesterov ? 1 : 0, options_.weight_decay);
  }

 private:
  struct State {
    std::vector<float> velocity;  // b, [size] float32 (unused without momentum)
    std::uint64_t steps = 0;
  };
  SgdOptions options_;
  std::unordered_map<std::uint64_t, State> state_;
};

class Adam final : public Optimizer {
 public:
  explicit Adam(const AdamOptions& options) : options_(options) {}

  Status step(std::uint64_t key, std::span<float> param, std::span<const float> grad) override {
    auto [it, first] = state_.try_emplace(key);
    State& state = it->second;
    if (first) {
      state.exp_avg.assign(param.size(), 0.0f);
      state.exp_avg_sq.assign(param.size(), 0.0f);
    }
    if (Status s = check_sizes(key, param.size(), grad.size(), state.exp_avg.size()); !s) {
      if (first) state_.erase(it);
      return s;
    }
    const double t = static_cast<double>(++state.steps);
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
    ArrayMap m(state.exp_avg.data(), static_cast<Eigen::Index>(state.exp_avg.size()));
    ArrayMap v(state.exp_avg_sq.data(), static_cast<Eigen::Index>(state.exp_avg_sq.size()));
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
    return ok_status();
  }
  double learning_rate() const override { return options_.lr; }

  std::string describe() const override {
    return fmt::format("adam lr={} beta1={} beta2={} eps={} weight_decay={}", options_.lr,
                       options_.beta1, options_.beta2, options_.eps, options_.weight_decay);
  }

 private:
  struct State {
    std::vector<float> exp_avg;     // m, [size] float32
    std::vector<float> exp_avg_sq;  // v, [size] float32
    std::uint64_t steps = 0;        // t of the last step
  };
  AdamOptions options_;
  std::unordered_map<std::uint64_t, State> state_;
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
