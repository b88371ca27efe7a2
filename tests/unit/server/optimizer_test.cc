// Optimizers against values computed by hand (first steps, constants chosen so
// the arithmetic is exact or short) and against a double-precision reference
// of the PyTorch formulas over several steps.
#include "server/optimizer.h"

#include <cmath>
#include <optional>
#include <random>

#include <gtest/gtest.h>

namespace ember::server {
namespace {

using config::OptimizerConfig;
using config::OptimizerType;

OptimizerConfig make(OptimizerType type, double lr) {
  OptimizerConfig c;
  c.type = type;
  c.learning_rate = lr;
  c.weight_decay = 0.0;
  return c;
}

// Applies one update per gradient to a one-element tensor p0, and returns p
// after each. `rates`, when given, sets the learning rate before each update.
std::vector<float> run(const OptimizerConfig& c, float p0, std::vector<float> grads,
                       std::vector<double> rates = {}) {
  auto opt = Optimizer::create(c);
  EXPECT_TRUE(opt) << opt.error().to_string();
  std::vector<float> p{p0};
  OptimizerState s = opt->make_state(1);
  std::vector<float> out;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (i < rates.size()) {
      EXPECT_TRUE(opt->set_learning_rate(rates[i]));
    }
    const float gv[] = {grads[i]};
    opt->apply(p, gv, s);
    out.push_back(p[0]);
  }
  return out;
}

TEST(Optimizer, SgdByHand) {
  auto p = run(make(OptimizerType::kSgd, 0.1), 1.0f, {0.5f, -1.0f});
  EXPECT_NEAR(p[0], 0.95, 1e-7);   // 1 - 0.1 * 0.5
  EXPECT_NEAR(p[1], 1.05, 1e-7);   // 0.95 + 0.1
}

TEST(Optimizer, SgdWeightDecayByHand) {
  auto c = make(OptimizerType::kSgd, 0.1);
  c.weight_decay = 0.5;
  auto p = run(c, 2.0f, {1.0f});
  EXPECT_NEAR(p[0], 2.0 - 0.1 * (1.0 + 0.5 * 2.0), 1e-7);  // 1.8
}

TEST(Optimizer, MomentumByHand) {
  auto c = make(OptimizerType::kMomentum, 0.1);
  c.momentum = 0.9;
  auto p = run(c, 1.0f, {0.5f, 0.5f, 0.5f});
  EXPECT_NEAR(p[0], 0.95, 1e-7);    // b = 0.5
  EXPECT_NEAR(p[1], 0.855, 1e-6);   // b = 0.95
  EXPECT_NEAR(p[2], 0.7195, 1e-6);  // b = 1.355
}

TEST(Optimizer, NesterovByHand) {
  auto c = make(OptimizerType::kMomentum, 0.1);
  c.momentum = 0.9;
  c.nesterov = true;
  auto p = run(c, 1.0f, {0.5f, 0.5f});
  EXPECT_NEAR(p[0], 0.905, 1e-6);   // g + mu*b = 0.5 + 0.45
  EXPECT_NEAR(p[1], 0.7695, 1e-6);  // b = 0.95; 0.5 + 0.855
}

TEST(Optimizer, AdamMovesByLearningRateUnderConstantGradient) {
  // With a constant gradient m_hat / sqrt(v_hat) == sign(g): each step moves
  // by lr (up to eps), as worked out by hand for the first two steps.
  auto p = run(make(OptimizerType::kAdam, 0.1), 1.0f, {0.5f, 0.5f, 0.5f});
  EXPECT_NEAR(p[0], 0.9, 1e-6);
  EXPECT_NEAR(p[1], 0.8, 1e-6);
  EXPECT_NEAR(p[2], 0.7, 1e-6);
}

TEST(Optimizer, AdamWDecaysBeforeTheStep) {
  auto c = make(OptimizerType::kAdamW, 0.1);
  c.weight_decay = 0.1;
  auto p = run(c, 1.0f, {0.5f, 0.5f});
  EXPECT_NEAR(p[0], 1.0 * 0.99 - 0.1, 1e-6);           // 0.89
  EXPECT_NEAR(p[1], (1.0 * 0.99 - 0.1) * 0.99 - 0.1, 1e-6);  // 0.7811
}

TEST(Optimizer, AdagradByHand) {
  auto c = make(OptimizerType::kAdagrad, 0.1);
  c.initial_accumulator = 0.1;
  c.epsilon = 1e-10;
  auto p = run(c, 1.0f, {0.5f, 0.5f});
  const double p1 = 1.0 - 0.1 * 0.5 / std::sqrt(0.35);
  const double p2 = p1 - 0.1 * 0.5 / std::sqrt(0.6);
  EXPECT_NEAR(p[0], p1, 1e-6);
  EXPECT_NEAR(p[1], p2, 1e-6);
}

// Where eps goes is invisible with a tiny eps. With eps = 0.1 and beta2 = 0.5
// PyTorch's Adam (eps added to sqrt(v) / sqrt(1 - b2^t)) differs by > 1e-4
// from eps inside the square root (0.915485 at step 1) and from Kingma & Ba's
// eps added before the bias correction (0.922048). Step 1 by hand: m = 0.05,
// v = 0.125, step size 0.1 / 0.1 = 1, denominator sqrt(0.125) / sqrt(0.5) +
// 0.1 = 0.6, p = 1 - 0.05 / 0.6. Steps 2 and 3: the same formula in double.
TEST(Optimizer, AdamEpsilonIsAddedAfterTheBiasCorrection) {
  auto c = make(OptimizerType::kAdam, 0.1);
  c.beta1 = 0.9;
  c.beta2 = 0.5;
  c.epsilon = 0.1;
  auto p = run(c, 1.0f, {0.5f, -0.25f, 1.0f});
  EXPECT_NEAR(p[0], 0.916666667, 1e-6);
  EXPECT_NEAR(p[1], 0.893458118, 1e-6);
  EXPECT_NEAR(p[2], 0.844565315, 1e-6);
}

// As in PyTorch, a new learning rate scales the next steps only: the moments
// and t carry on (a reset of either would give other values).
TEST(Optimizer, AdamKeepsItsMomentsAcrossALearningRateChange) {
  auto c = make(OptimizerType::kAdam, 0.1);
  c.beta1 = 0.9;
  c.beta2 = 0.5;
  c.epsilon = 0.1;
  auto p = run(c, 1.0f, {0.5f, -0.25f, 1.0f}, {0.1, 0.1, 0.01});
  EXPECT_NEAR(p[1], 0.893458118, 1e-6);
  EXPECT_NEAR(p[2], 0.888568838, 1e-6);  // 0.893458118 - 0.1 * (0.893458118 - 0.844565315)
}

// Adagrad adds eps to sqrt(s), not inside: with s = 0 + 0.25 and eps = 0.5,
// p = 1 - 0.1 * 0.5 / (0.5 + 0.5) = 0.95 (inside: 1 - 0.05 / sqrt(0.75)).
TEST(Optimizer, AdagradEpsilonIsAddedToTheSquareRoot) {
  auto c = make(OptimizerType::kAdagrad, 0.1);
  c.initial_accumulator = 0.0;
  c.epsilon = 0.5;
  auto p = run(c, 1.0f, {0.5f});
  EXPECT_NEAR(p[0], 0.95, 1e-7);
}

// The defaults of torch.optim: Adagrad eps 1e-10 and initial_accumulator_value
// 0, Adam and AdamW eps 1e-8, AdamW weight_decay 0.01, the others 0.
TEST(Optimizer, UnsetHyperParametersTakePyTorchsDefaults) {
  OptimizerConfig c;
  EXPECT_EQ(c.initial_accumulator, 0.0);
  c.type = OptimizerType::kAdagrad;
  EXPECT_EQ(c.epsilon_or_default(), 1e-10);
  EXPECT_EQ(c.weight_decay_or_default(), 0.0);
  c.type = OptimizerType::kAdam;
  EXPECT_EQ(c.epsilon_or_default(), 1e-8);
  EXPECT_EQ(c.weight_decay_or_default(), 0.0);
  c.type = OptimizerType::kAdamW;
  EXPECT_EQ(c.epsilon_or_default(), 1e-8);
  EXPECT_EQ(c.weight_decay_or_default(), 0.01);
  c.weight_decay = 0.0;
  EXPECT_EQ(c.weight_decay_or_default(), 0.0);
  c.epsilon = 1e-3;
  EXPECT_EQ(c.epsilon_or_default(), 1e-3);

  // AdamW with its default decay and a zero gradient: m = v = 0, so only the
  // decay moves p: 1 * (1 - 0.1 * 0.01).
  OptimizerConfig w;
  w.type = OptimizerType::kAdamW;
  w.learning_rate = 0.1;
  auto p = run(w, 1.0f, {0.0f});
  EXPECT_FLOAT_EQ(p[0], 0.999f);
  // Adagrad with its defaults and a gradient small enough for eps to show:
  // s = 1e-16, p = 1 - 0.1 * 1e-8 / (1e-8 + 1e-10) = 1 - 0.1 / 1.01
  // (with eps 1e-8 it would be 0.95).
  OptimizerConfig a;
  a.type = OptimizerType::kAdagrad;
  a.learning_rate = 0.1;
  p = run(a, 1.0f, {1e-8f});
  EXPECT_NEAR(p[0], 1.0 - 0.1 / 1.01, 1e-6);
}

// Double-precision reference of optimizer.h's formulas.
struct Reference {
  OptimizerConfig c;
  std::vector<double> p, a, b;
  std::uint64_t t = 0;

  void step(const std::vector<float>& grad) {
    ++t;
    const double lr = c.learning_rate, wd = c.weight_decay_or_default();
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = grad[i];
      switch (c.type) {
        case OptimizerType::kSgd:
          p[i] -= lr * (g + wd * p[i]);
          break;
        case OptimizerType::kMomentum:
          g += wd * p[i];
          a[i] = t == 1 ? g : c.momentum * a[i] + g;
          p[i] -= lr * (c.nesterov ? g + c.momentum * a[i] : a[i]);
          break;
        case OptimizerType::kAdam:
        case OptimizerType::kAdamW: {
          if (c.type == OptimizerType::kAdamW) {
            p[i] *= 1 - lr * wd;
          } else {
            g += wd * p[i];
          }
          a[i] = c.beta1 * a[i] + (1 - c.beta1) * g;
          b[i] = c.beta2 * b[i] + (1 - c.beta2) * g * g;
          const double bc1 = 1 - std::pow(c.beta1, t), bc2 = 1 - std::pow(c.beta2, t);
          p[i] -= lr / bc1 * a[i] / (std::sqrt(b[i]) / std::sqrt(bc2) + c.epsilon_or_default());
          break;
        }
        case OptimizerType::kAdagrad:
          g += wd * p[i];
          a[i] += g * g;
          p[i] -= lr * g / (std::sqrt(a[i]) + c.epsilon_or_default());
          break;
      }
    }
  }
};

OptimizerConfig config_of(int which) {
  OptimizerConfig c;
  switch (which) {
    case 0: c.type = OptimizerType::kSgd; break;
    case 1: c.type = OptimizerType::kMomentum; break;
    case 2: c.type = OptimizerType::kMomentum; c.nesterov = true; break;
    case 3: c.type = OptimizerType::kAdam; break;
    case 4: c.type = OptimizerType::kAdamW; break;
    case 5: c.type = OptimizerType::kAdagrad; break;
  }
  c.learning_rate = 0.05;
  c.weight_decay = 0.01;
  c.initial_accumulator = 0.1;
  return c;
}

// One optimizer per parameter (config_of) and a seeded source of floats.
class OptimizerVsReference : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    c = config_of(GetParam());
    auto created = Optimizer::create(c);
    ASSERT_TRUE(created) << created.error().to_string();
    opt.emplace(std::move(*created));
  }
  float next() { return dist(rng); }

  OptimizerConfig c;
  std::optional<Optimizer> opt;
  const std::uint64_t seed = std::random_device{}();
  std::mt19937_64 rng{seed};
  std::normal_distribution<float> dist{0.0f, 1.0f};
};

TEST_P(OptimizerVsReference, TenStepsMatchDoubleReference) {
  const std::size_t n = 257;
  std::vector<float> p(n);
  for (auto& x : p) x = next();
  Reference ref{c, std::vector<double>(p.begin(), p.end()), std::vector<double>(n, 0.0),
                std::vector<double>(n, 0.0)};
  if (c.type == OptimizerType::kAdagrad) ref.a.assign(n, c.initial_accumulator);
  OptimizerState s = opt->make_state(n);
  for (int step = 0; step < 10; ++step) {
    std::vector<float> g(n);
    for (auto& x : g) x = next();
    opt->apply(p, g, s);
    ref.step(g);
  }
  EXPECT_EQ(s.num_updates, 10u);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(p[i], ref.p[i], 1e-4 * (1.0 + std::abs(ref.p[i]))) << "seed " << seed << " i " << i;
  }
}

// apply_mean(sum, last, count) is apply() on the buffer (sum + last) / count,
// bit for bit, parameters and state, for 2 and 3 contributions.
TEST_P(OptimizerVsReference, ApplyMeanIsApplyOnTheMeanBitForBit) {
  const std::size_t n = 1031;
  std::vector<float> p_fused(n);
  for (auto& x : p_fused) x = next();
  std::vector<float> p_plain = p_fused;
  OptimizerState s_fused = opt->make_state(n);
  OptimizerState s_plain = opt->make_state(n);
  for (std::uint32_t step = 0; step < 6; ++step) {
    const std::uint32_t count = 2 + step % 2;
    std::vector<std::vector<float>> g(count, std::vector<float>(n));
    for (auto& v : g) {
      for (auto& x : v) x = next();
    }
    std::vector<float> sum = g[0];
    for (std::uint32_t r = 1; r + 1 < count; ++r) {
      for (std::size_t i = 0; i < n; ++i) sum[i] += g[r][i];
    }
    std::vector<float> mean = sum;
    for (std::size_t i = 0; i < n; ++i) {
      mean[i] += g[count - 1][i];
      mean[i] /= static_cast<float>(count);
    }
    opt->apply_mean(p_fused, sum, g[count - 1], count, s_fused);
    opt->apply(p_plain, mean, s_plain);
    ASSERT_EQ(p_fused, p_plain) << "seed " << seed << " step " << step;
    ASSERT_EQ(s_fused, s_plain) << "seed " << seed << " step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, OptimizerVsReference, ::testing::Range(0, 6));

TEST(Optimizer, RejectsBadHyperParameters) {
  auto c = make(OptimizerType::kSgd, 0.0);
  EXPECT_FALSE(Optimizer::create(c));
  c.learning_rate = 0.1;
  c.momentum = 1.0;
  EXPECT_FALSE(Optimizer::create(c));
  c.momentum = 0.9;
  c.nesterov = true;  // not momentum
  auto r = Optimizer::create(c);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("nesterov"), std::string::npos);
  c.nesterov = false;
  c.epsilon = 0.0;
  EXPECT_FALSE(Optimizer::create(c));
}

TEST(Optimizer, SetLearningRateChangesTheStepAndRejectsBadValues) {
  auto opt = Optimizer::create(make(OptimizerType::kSgd, 0.1));
  ASSERT_TRUE(opt);
  ASSERT_TRUE(opt->set_learning_rate(0.5));
  EXPECT_FALSE(opt->set_learning_rate(-1.0));
  EXPECT_FALSE(opt->set_learning_rate(std::nan("")));
  EXPECT_EQ(opt->learning_rate(), 0.5);
  std::vector<float> p{1.0f};
  const float g[] = {1.0f};
  OptimizerState s = opt->make_state(1);
  opt->apply(p, g, s);
  EXPECT_FLOAT_EQ(p[0], 0.5f);
}

TEST(Optimizer, CheckStateRefusesStateOfAnotherType) {
  auto adam = Optimizer::create(make(OptimizerType::kAdam, 0.1));
  auto sgd = Optimizer::create(make(OptimizerType::kMomentum, 0.1));
  ASSERT_TRUE(adam && sgd);
  EXPECT_TRUE(adam->check_state(adam->make_state(4), 4));
  EXPECT_FALSE(adam->check_state(sgd->make_state(4), 4));
  EXPECT_FALSE(adam->check_state(adam->make_state(3), 4));
}

}  // namespace
}  // namespace ember::server
