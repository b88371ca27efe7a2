// Optimizers against references written out by hand from the PyTorch
// formulas (optimizer.h), over several steps, plus option and shape errors.
#include <cmath>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "examples/fashion_mnist/optimizer.h"

namespace ember::fashion_mnist {
namespace {

using ::testing::HasSubstr;

// The gradients fed at steps 1..4 for a 3-element tensor.
const std::vector<std::vector<float>> kGrads = {
    {0.5f, -1.0f, 0.0f}, {0.25f, 2.0f, -0.5f}, {-1.5f, 0.125f, 1.0f}, {0.75f, -0.25f, 0.5f}};
const std::vector<float> kStart = {1.0f, -2.0f, 0.5f};

std::unique_ptr<Optimizer> sgd(SgdOptions o) {
  auto r = make_sgd(o);
  EXPECT_TRUE(r) << r.error().to_string();
  return std::move(*r);
}
std::unique_ptr<Optimizer> adam(AdamOptions o) {
  auto r = make_adam(o);
  EXPECT_TRUE(r) << r.error().to_string();
  return std::move(*r);
}

// torch.optim.SGD's algorithm, element by element, in double.
std::vector<std::vector<double>> sgd_reference(const SgdOptions& o) {
  std::vector<double> p(kStart.begin(), kStart.end()), b(p.size(), 0.0);
  std::vector<std::vector<double>> trajectory;
  for (std::size_t t = 1; t <= kGrads.size(); ++t) {
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = kGrads[t - 1][i];
      if (o.weight_decay != 0) g += o.weight_decay * p[i];
      if (o.momentum != 0) {
        b[i] = t > 1 ? o.momentum * b[i] + (1 - o.dampening) * g : g;
        g = o.nesterov ? g + o.momentum * b[i] : b[i];
      }
      p[i] -= o.lr * g;
    }
    trajectory.push_back(p);
  }
  return trajectory;
}

// torch.optim.Adam's algorithm (amsgrad=False), in double.
std::vector<std::vector<double>> adam_reference(const AdamOptions& o) {
  std::vector<double> p(kStart.begin(), kStart.end()), m(p.size(), 0.0), v(p.size(), 0.0);
  std::vector<std::vector<double>> trajectory;
  for (std::size_t t = 1; t <= kGrads.size(); ++t) {
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = kGrads[t - 1][i];
      if (o.weight_decay != 0) g += o.weight_decay * p[i];
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      const double m_hat = m[i] / (1 - std::pow(o.beta1, t));
      const double v_hat = v[i] / (1 - std::pow(o.beta2, t));
      p[i] -= o.lr * m_hat / (std::sqrt(v_hat) + o.eps);
    }
    trajectory.push_back(p);
  }
  return trajectory;
}

void expect_follows(Optimizer& opt, const std::vector<std::vector<double>>& want) {
  std::vector<float> p = kStart;
  for (std::size_t t = 0; t < kGrads.size(); ++t) {
    ASSERT_TRUE(opt.step(7, p, kGrads[t]));
    for (std::size_t i = 0; i < p.size(); ++i) {
      EXPECT_NEAR(p[i], want[t][i], 1e-5 * (1 + std::abs(want[t][i])))
          << opt.describe() << " step " << t + 1 << " element " << i;
    }
  }
}

TEST(Sgd, PlainMomentumMatchesHandValues) {
  // p0 = 1, g = 1 every step, lr 0.1, momentum 0.9:
  // b = 1, 1.9, 2.71 -> p = 0.9, 0.71, 0.439.
  auto opt = sgd({0.1, 0.9, 0.0, 0.0, false});
  std::vector<float> p{1.0f};
  const std::vector<float> g{1.0f};
  const double want[] = {0.9, 0.71, 0.439};
  for (double w : want) {
    ASSERT_TRUE(opt->step(0, p, g));
    EXPECT_NEAR(p[0], w, 1e-6);
  }
}

TEST(Sgd, FollowsPyTorchFormulasInEveryVariant) {
  const SgdOptions variants[] = {
      {0.1, 0.0, 0.0, 0.0, false},   // plain SGD
      {0.05, 0.9, 0.0, 0.0, false},  // momentum
      {0.05, 0.9, 0.1, 0.0, false},  // momentum with dampening
      {0.05, 0.9, 0.0, 0.0, true},   // Nesterov
      {0.05, 0.9, 0.0, 0.01, true},  // Nesterov with weight decay
      {0.1, 0.0, 0.0, 0.1, false},   // weight decay only
  };
  for (const SgdOptions& o : variants) {
    auto opt = sgd(o);
    expect_follows(*opt, sgd_reference(o));
  }
}

TEST(Adam, FirstStepMovesByLearningRate) {
  // m_hat = g and v_hat = g^2 at t = 1, so p moves by lr * g / (|g| + eps).
  auto opt = adam({0.01, 0.9, 0.999, 1e-8, 0.0});
  std::vector<float> p{1.0f, 1.0f};
  const std::vector<float> g{0.5f, -3.0f};
  ASSERT_TRUE(opt->step(0, p, g));
  EXPECT_NEAR(p[0], 0.99, 1e-6);
  EXPECT_NEAR(p[1], 1.01, 1e-6);
}

TEST(Adam, FollowsPyTorchFormulas) {
  const AdamOptions variants[] = {
      {1e-3, 0.9, 0.999, 1e-8, 0.0},
      {0.1, 0.8, 0.99, 1e-3, 0.0},
      {0.01, 0.9, 0.999, 1e-8, 0.05},
  };
  for (const AdamOptions& o : variants) {
    auto opt = adam(o);
    expect_follows(*opt, adam_reference(o));
  }
}

TEST(Optimizer, StateIsPerKey) {
  const SgdOptions o{0.05, 0.9, 0.0, 0.0, false};
  auto together = sgd(o);
  auto alone = sgd(o);
  std::vector<float> a = kStart, b = kStart, a_alone = kStart;
  for (const auto& g : kGrads) {
    ASSERT_TRUE(together->step(1, a, g));
    ASSERT_TRUE(together->step(2, b, kGrads[0]));  // another key interleaved
    ASSERT_TRUE(alone->step(1, a_alone, g));
  }
  EXPECT_EQ(a, a_alone);
}

TEST(Optimizer, SetLearningRateAppliesToLaterSteps) {
  auto opt = sgd({0.1, 0.0, 0.0, 0.0, false});
  std::vector<float> p{1.0f};
  const std::vector<float> g{1.0f};
  ASSERT_TRUE(opt->step(0, p, g));
  ASSERT_TRUE(opt->set_learning_rate(0.5));
  EXPECT_EQ(opt->learning_rate(), 0.5);
  ASSERT_TRUE(opt->step(0, p, g));
  EXPECT_NEAR(p[0], 0.4, 1e-6);
  auto bad = opt->set_learning_rate(-1.0);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(opt->learning_rate(), 0.5);
}

TEST(Optimizer, ShapeMismatchesAreErrorsAndLeaveStateAlone) {
  for (auto& opt : {sgd({0.1, 0.9, 0.0, 0.0, false}), adam({})}) {
    std::vector<float> p3(3, 1.0f), p4(4, 1.0f), g3(3, 1.0f), g2(2, 1.0f);
    auto s = opt->step(9, p3, g2);
    ASSERT_FALSE(s);
    EXPECT_EQ(s.error().code(), ErrorCode::kShapeMismatch);
    EXPECT_THAT(s.error().message(), HasSubstr("key 9"));
    EXPECT_EQ(p3, std::vector<float>(3, 1.0f));
    ASSERT_TRUE(opt->step(9, p3, g3));  // still a first step: sizes the state
    std::vector<float> g4(4, 1.0f);
    s = opt->step(9, p4, g4);
    ASSERT_FALSE(s);
    EXPECT_THAT(s.error().message(), HasSubstr("its first step had 3"));
  }
}

TEST(Optimizer, RejectsBadOptions) {
  struct Case {
    Result<std::unique_ptr<Optimizer>> result;
    const char* what;
  };
  Case cases[] = {
      {make_sgd({-0.1, 0.0, 0.0, 0.0, false}), "lr"},
      {make_sgd({NAN, 0.0, 0.0, 0.0, false}), "lr"},
      {make_sgd({0.1, -0.5, 0.0, 0.0, false}), "momentum"},
      {make_sgd({0.1, 0.0, 0.0, -1.0, false}), "weight_decay"},
      {make_sgd({0.1, 0.0, 0.0, 0.0, true}), "nesterov"},
      {make_sgd({0.1, 0.9, 0.5, 0.0, true}), "nesterov"},
      {make_adam({0.001, 1.0, 0.999, 1e-8, 0.0}), "beta1"},
      {make_adam({0.001, 0.9, -0.1, 1e-8, 0.0}), "beta2"},
      {make_adam({0.001, 0.9, 0.999, -1.0, 0.0}), "eps"},
      {make_adam({INFINITY, 0.9, 0.999, 1e-8, 0.0}), "lr"},
  };
  for (const Case& c : cases) {
    ASSERT_FALSE(c.result) << c.what;
    EXPECT_EQ(c.result.error().code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(c.result.error().message(), HasSubstr(c.what));
  }
}

}  // namespace
}  // namespace ember::fashion_mnist
