// Optimizer updates; formulas and their source in optimizer.h.
#include "server/optimizer.h"

#include <cmath>

#include "common/base/check.h"

namespace ember::server {
namespace {

bool finite_nonneg(double v) { return std::isfinite(v) && v >= 0.0; }

// The TOML spelling (as config::to_string; kept here so the store does not
// link the config loader).
const char* optimizer_type_name(config::OptimizerType t) {
  switch (t) {
    case config::OptimizerType::kSgd: return "sgd";
    case config::OptimizerType::kMomentum: return "momentum";
    case config::OptimizerType::kAdam: return "adam";
    case config::OptimizerType::kAdamW: return "adamw";
    case config::OptimizerType::kAdagrad: return "adagrad";
  }
  return "unknown";
}

}  // namespace

Result<Optimizer> Optimizer::create(const config::OptimizerConfig& c) {
  if (!std::isfinite(c.learning_rate) || c.learning_rate <= 0.0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "optimizer.learning_rate must be > 0 and finite (got {})", c.learning_rate);
  }
  if (!finite_nonneg(c.momentum) || c.momentum >= 1.0) {
    return make_error(ErrorCode::kInvalidArgument, "optimizer.momentum must be in [0, 1) (got {})",
                      c.momentum);
  }
  if (!finite_nonneg(c.beta1) || c.beta1 >= 1.0 || !finite_nonneg(c.beta2) || c.beta2 >= 1.0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "optimizer.beta1 and beta2 must be in [0, 1) (got {} and {})", c.beta1,
                      c.beta2);
  }
  if (const double eps = c.epsilon_or_default(); !std::isfinite(eps) || eps <= 0.0) {
    return make_error(ErrorCode::kInvalidArgument, "optimizer.epsilon must be > 0 (got {})", eps);
  }
  if (!finite_nonneg(c.weight_decay_or_default())) {
    return make_error(ErrorCode::kInvalidArgument, "optimizer.weight_decay must be >= 0 (got {})",
                      c.weight_decay_or_default());
  }
  if (!finite_nonneg(c.initial_accumulator)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "optimizer.initial_accumulator must be >= 0 (got {})",
                      c.initial_accumulator);
  }
  if (c.nesterov && c.type != config::OptimizerType::kMomentum) {
    return make_error(ErrorCode::kInvalidArgument,
                      "optimizer.nesterov = true needs type = \"momentum\" (type is \"{}\")",
                      optimizer_type_name(c.type));
  }
  return Optimizer(c);
}

Status Optimizer::set_learning_rate(double lr) {
  if (!std::isfinite(lr) || lr <= 0.0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "learning rate must be > 0 and finite (got {}); kept {}", lr,
                      config_.learning_rate);
  }
  config_.learning_rate = lr;
  return ok_status();
}

std::size_t Optimizer::num_slots() const noexcept {
  switch (config_.type) {
    case config::OptimizerType::kSgd: return 0;
    case config::OptimizerType::kMomentum: return 1;
    case config::OptimizerType::kAdam: return 2;
    case config::OptimizerType::kAdamW: return 2;
    case config::OptimizerType::kAdagrad: return 1;
  }
  return 0;
}

OptimizerState Optimizer::make_state(std::size_t num_elements) const {
  OptimizerState s;
  const float init = config_.type == config::OptimizerType::kAdagrad
                         ? static_cast<float>(config_.initial_accumulator)
                         : 0.0f;
  s.slots.assign(num_slots(), std::vector<float>(num_elements, init));
  return s;
}

Status Optimizer::check_state(const OptimizerState& state, std::size_t num_elements) const {
  if (state.slots.size() != num_slots()) {
    return make_error(ErrorCode::kCorrupt,
                      "optimizer state has {} slot(s) but optimizer \"{}\" uses {}; the "
                      "checkpoint was written with another optimizer type",
                      state.slots.size(), optimizer_type_name(config_.type), num_slots());
  }
  for (const auto& slot : state.slots) {
    if (slot.size() != num_elements) {
      return make_error(ErrorCode::kCorrupt,
                        "optimizer state slot has {} elements, the parameters {}", slot.size(),
                        num_elements);
    }
  }
  return ok_status();
}

namespace {

// The gradient as read by update(): element i of one buffer, or the bsp
// round's mean (sum[i] + last[i]) / count, formed in float as written.
struct PlainGradient {
  const float* g;
  float operator[](std::size_t i) const { return g[i]; }
};
struct MeanGradient {
  const float* sum;
  const float* last;
  float count;
  float operator[](std::size_t i) const { return (sum[i] + last[i]) / count; }
};

// One update of `p` (n elements) with gradient `g` (formulas: optimizer.h).
template <typename Gradient>
void update(const config::OptimizerConfig& opt, float* p, std::size_t n, Gradient g,
            OptimizerState& state) {
  const std::uint64_t t = ++state.num_updates;
  const float lr = static_cast<float>(opt.learning_rate);
  const float wd = static_cast<float>(opt.weight_decay_or_default());

  switch (opt.type) {
    case config::OptimizerType::kSgd:
      if (opt.weight_decay_or_default() == 0.0) {
        // Same result as below (g + 0 * p == g for finite p), one load less.
        for (std::size_t i = 0; i < n; ++i) p[i] -= lr * g[i];
        return;
      }
      for (std::size_t i = 0; i < n; ++i) {
        const float gi = g[i] + wd * p[i];
        p[i] -= lr * gi;
      }
      return;

    case config::OptimizerType::kMomentum: {
      const float mu = static_cast<float>(opt.momentum);
      float* b = state.slots[0].data();
      const bool first = t == 1;
      const bool nesterov = opt.nesterov;
      for (std::size_t i = 0; i < n; ++i) {
        float gi = g[i] + wd * p[i];
        b[i] = first ? gi : mu * b[i] + gi;
        gi = nesterov ? gi + mu * b[i] : b[i];
        p[i] -= lr * gi;
      }
      return;
    }

    case config::OptimizerType::kAdam:
    case config::OptimizerType::kAdamW: {
      const bool decoupled = opt.type == config::OptimizerType::kAdamW;
      const float b1 = static_cast<float>(opt.beta1);
      const float b2 = static_cast<float>(opt.beta2);
      const float one_minus_b1 = static_cast<float>(1.0 - opt.beta1);
      const float one_minus_b2 = static_cast<float>(1.0 - opt.beta2);
      const double bc1 = 1.0 - std::pow(opt.beta1, static_cast<double>(t));
      const double bc2 = 1.0 - std::pow(opt.beta2, static_cast<double>(t));
      const float step_size = static_cast<float>(opt.learning_rate / bc1);
      const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
      const float eps = static_cast<float>(opt.epsilon_or_default());
      const float decay = static_cast<float>(1.0 - opt.learning_rate * opt.weight_decay_or_default());
      float* m = state.slots[0].data();
      float* v = state.slots[1].data();
      for (std::size_t i = 0; i < n; ++i) {
        float gi = g[i];
        if (decoupled) {
          p[i] *= decay;
        } else {
          gi += wd * p[i];
        }
        m[i] = b1 * m[i] + one_minus_b1 * gi;
        v[i] = b2 * v[i] + one_minus_b2 * gi * gi;
        const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
        p[i] -= step_size * (m[i] / denom);
      }
      return;
    }

    case config::OptimizerType::kAdagrad: {
      const float eps = static_cast<float>(opt.epsilon_or_default());
      float* s = state.slots[0].data();
      for (std::size_t i = 0; i < n; ++i) {
        const float gi = g[i] + wd * p[i];
        s[i] += gi * gi;
        p[i] -= lr * (gi / (std::sqrt(s[i]) + eps));
      }
      return;
    }
  }
}

}  // namespace

void Optimizer::apply(std::span<float> params, std::span<const float> grad,
                      OptimizerState& state) const {
  EMBER_DCHECK(params.size() == grad.size());
  EMBER_DCHECK(state.slots.size() == num_slots());
  update(config_, params.data(), params.size(), PlainGradient{grad.data()}, state);
}

void Optimizer::apply_mean(std::span<float> params, std::span<const float> sum,
                           std::span<const float> last, std::uint32_t count,
                           OptimizerState& state) const {
  EMBER_DCHECK(params.size() == sum.size() && params.size() == last.size());
  EMBER_DCHECK(state.slots.size() == num_slots());
  EMBER_DCHECK(count >= 2);
  update(config_, params.data(), params.size(),
         MeanGradient{sum.data(), last.data(), static_cast<float>(count)}, state);
}

}  // namespace ember::server
