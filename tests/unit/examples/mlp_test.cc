// The MLP: layout and keys, binding caller buffers, He init, the loss, the
// gradient against finite differences, the per-layer callback contract, and
// that training lowers the loss.
#include <cmath>
#include <numeric>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/base/check.h"
#include "examples/fashion_mnist/mlp.h"
#include "examples/fashion_mnist/optimizer.h"
#include "examples/fashion_mnist/rng.h"
#include "tests/unit/examples/test_util.h"

namespace ember::fashion_mnist {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A model with its own buffers (as a caller would provide them).
struct Bound {
  Mlp model;
  std::vector<float> values;
  std::vector<float> grads;
};

Bound make_bound(std::vector<std::size_t> sizes, std::size_t max_batch, std::uint64_t seed = 1) {
  auto model = Mlp::create(MlpSpec{std::move(sizes), 0}, max_batch);
  EMBER_CHECK(model.has_value());
  Bound b{std::move(*model), {}, {}};
  b.values.resize(b.model.num_parameters());
  b.grads.resize(b.model.num_parameters());
  EMBER_CHECK(b.model.bind(b.values, b.grads).has_value());
  b.model.init_he(seed);
  return b;
}

void fill_random(Eigen::Ref<Eigen::MatrixXf> x, std::uint64_t seed) {
  SplitMix64 rng(seed);
  for (Eigen::Index j = 0; j < x.cols(); ++j)
    for (Eigen::Index i = 0; i < x.rows(); ++i) x(i, j) = static_cast<float>(rng.normal());
}

Status no_op(std::span<const Parameter>) { return ok_status(); }

TEST(Mlp, CreateRejectsBadSpecs) {
  auto one = Mlp::create(MlpSpec{{784}, 0}, 8);
  ASSERT_FALSE(one);
  EXPECT_EQ(one.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(one.error().message(), HasSubstr("at least 2 widths"));
  auto zero = Mlp::create(MlpSpec{{784, 0, 10}, 0}, 8);
  ASSERT_FALSE(zero);
  EXPECT_THAT(zero.error().message(), HasSubstr("layer_sizes[1] is 0"));
  auto no_batch = Mlp::create(MlpSpec{}, 0);
  ASSERT_FALSE(no_batch);
  EXPECT_THAT(no_batch.error().message(), HasSubstr("max_batch_size"));
  auto keys = Mlp::create(MlpSpec{{4, 3, 2}, ~std::uint64_t{0} - 2}, 8);
  ASSERT_FALSE(keys);
  EXPECT_THAT(keys.error().message(), HasSubstr("no room for 4 consecutive keys"));
  EXPECT_TRUE(Mlp::create(MlpSpec{{4, 3, 2}, ~std::uint64_t{0} - 3}, 8));
}

TEST(Mlp, DefaultLayoutHasStableKeysNamesAndShapes) {
  auto model = Mlp::create(MlpSpec{}, 4);
  ASSERT_TRUE(model) << model.error().to_string();
  EXPECT_EQ(model->num_layers(), 3u);
  EXPECT_EQ(model->num_parameters(), 784u * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10);
  EXPECT_EQ(model->num_parameters(), 235146u);
  struct Want {
    std::uint64_t key;
    const char* name;
    std::size_t rows, cols, offset;
  };
  const Want want[] = {{0, "W1", 256, 784, 0},           {1, "b1", 256, 1, 200704},
                       {2, "W2", 128, 256, 200960},      {3, "b2", 128, 1, 233728},
                       {4, "W3", 10, 128, 233856},       {5, "b3", 10, 1, 235136}};
  ASSERT_EQ(model->parameters().size(), 6u);
  for (std::size_t i = 0; i < 6; ++i) {
    const Parameter& p = model->parameters()[i];
    EXPECT_EQ(p.key, want[i].key);
    EXPECT_EQ(p.name, want[i].name);
    EXPECT_EQ(p.rows, want[i].rows);
    EXPECT_EQ(p.cols, want[i].cols);
    EXPECT_EQ(p.offset, want[i].offset) << p.name;
    EXPECT_TRUE(p.value.empty());
  }
  EXPECT_EQ(model->layer_parameters(1)[0].name, "W2");
  EXPECT_EQ(model->layer_parameters(1)[1].name, "b2");
  auto shifted = Mlp::create(MlpSpec{{784, 256, 128, 10}, 100}, 4);
  ASSERT_TRUE(shifted);
  EXPECT_EQ(shifted->parameters()[5].key, 105u);
}

TEST(Mlp, BindUsesCallerBuffersAndRejectsBadOnes) {
  auto model = Mlp::create(MlpSpec{{3, 2}, 0}, 4);  // W1 [2,3], b1 [2]
  ASSERT_TRUE(model);
  std::vector<float> values(8), grads(8);
  std::vector<float> small(7);
  auto s = model->bind(small, grads);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kShapeMismatch);
  EXPECT_FALSE(model->bound());
  std::vector<float> shared(16);
  s = model->bind(std::span<float>(shared).first(8), std::span<float>(shared).subspan(4, 8));
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(s.error().message(), HasSubstr("overlap"));

  ASSERT_TRUE(model->bind(values, grads));
  EXPECT_EQ(model->parameters()[0].value.data(), values.data());
  EXPECT_EQ(model->parameters()[1].value.data(), values.data() + 6);
  EXPECT_EQ(model->parameters()[1].grad.data(), grads.data() + 6);

  // Per-tensor buffers (a worker's pool blocks).
  std::vector<float> w(6), b(2), gw(6), gb(2), wrong(5);
  std::vector<std::span<float>> vals{w, b}, grs{gw, gb};
  ASSERT_TRUE(model->bind_tensors(vals, grs));
  EXPECT_EQ(model->parameters()[0].value.data(), w.data());
  EXPECT_EQ(model->parameters()[1].grad.data(), gb.data());
  std::vector<std::span<float>> bad_size{wrong, b};
  s = model->bind_tensors(bad_size, grs);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kShapeMismatch);
  EXPECT_THAT(s.error().message(), HasSubstr("W1"));
  std::vector<std::span<float>> one{w};
  s = model->bind_tensors(one, one);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kInvalidArgument);
  std::vector<std::span<float>> aliased{w, b};
  std::vector<std::span<float>> aliased_grads{gw, std::span<float>(w).first(2)};
  s = model->bind_tensors(aliased, aliased_grads);
  ASSERT_FALSE(s);
  EXPECT_THAT(s.error().message(), HasSubstr("W1 value and b1 gradient overlap"));
}

TEST(Mlp, HeInitIsDeterministicScaledAndZeroBias) {
  Bound a = make_bound({784, 256, 128, 10}, 1, 42);
  Bound b = make_bound({784, 256, 128, 10}, 1, 42);
  Bound c = make_bound({784, 256, 128, 10}, 1, 43);
  EXPECT_EQ(a.values, b.values);
  EXPECT_NE(a.values, c.values);
  for (const Parameter& p : a.model.parameters()) {
    if (p.cols == 1) {
      for (float v : p.value) ASSERT_EQ(v, 0.0f) << p.name;
      continue;
    }
    double sum = 0.0, sum_sq = 0.0;
    for (float v : p.value) {
      sum += v;
      sum_sq += double{v} * v;
    }
    const double n = static_cast<double>(p.size());
    const double mean = sum / n;
    const double stddev = std::sqrt(sum_sq / n - mean * mean);
    const double want = std::sqrt(2.0 / static_cast<double>(p.cols));
    // Four standard errors of the sample mean and standard deviation.
    EXPECT_NEAR(mean / want, 0.0, 4.0 / std::sqrt(n)) << p.name;
    EXPECT_NEAR(stddev / want, 1.0, 4.0 / std::sqrt(2.0 * n)) << p.name;
  }
}

TEST(Mlp, ForwardLossAndAccuracyMatchHandComputation) {
  // One layer, 2 inputs -> 3 classes: logits = W x + b.
  Bound m = make_bound({2, 3}, 2);
  const float w[] = {1, 0, 0, 1, 1, 1};  // rows: (1,0) (0,1) (1,1)
  const float b[] = {0, 0, -1};
  std::copy(std::begin(w), std::end(w), m.model.parameters()[0].value.begin());
  std::copy(std::begin(b), std::end(b), m.model.parameters()[1].value.begin());
  auto x = m.model.input(2);
  x << 2, 0, 1, 0;  // sample 0 = (2, 1), sample 1 = (0, 0)
  const std::uint8_t labels[] = {0, 2};
  const ForwardStats f = m.model.forward(2, labels);
  // Sample 0 logits (2, 1, 2): label 0; arg max is 0 (first of the tie).
  const double lse0 = std::log(std::exp(2.0) + std::exp(1.0) + std::exp(2.0));
  // Sample 1 logits (0, 0, -1): label 2; arg max 0, wrong.
  const double lse1 = std::log(2.0 + std::exp(-1.0));
  const double want = ((lse0 - 2.0) + (lse1 + 1.0)) / 2.0;
  EXPECT_NEAR(f.loss, want, 1e-6);
  EXPECT_EQ(f.correct, 1u);
}

// Loss of the model on the batch already in its input (recomputes forward).
double loss_at(Mlp& model, std::size_t batch, std::span<const std::uint8_t> labels) {
  return model.forward(batch, labels).loss;
}

// Compares backward with central differences on the given coordinates of
// every tensor. The model's input block must hold the batch.
void check_gradient(Mlp& model, std::size_t batch, std::span<const std::uint8_t> labels,
                    std::size_t coords_per_tensor, std::uint64_t seed) {
  model.forward(batch, labels);
  ASSERT_TRUE(model.backward(no_op));
  SplitMix64 rng(seed);
  const float eps = 3e-3f;
  std::size_t checked = 0;
  for (const Parameter& p : model.parameters()) {
    const std::size_t n = std::min(coords_per_tensor, p.size());
    for (std::size_t c = 0; c < n; ++c) {
      const std::size_t i = coords_per_tensor >= p.size() ? c : rng.below(p.size());
      const float saved = p.value[i];
      p.value[i] = saved + eps;
      const double up = loss_at(model, batch, labels);
      p.value[i] = saved - eps;
      const double down = loss_at(model, batch, labels);
      p.value[i] = saved;
      const double numeric = (up - down) / (2.0 * eps);
      const double analytic = p.grad[i];
      EXPECT_NEAR(analytic, numeric, 2e-3 + 2e-2 * std::abs(numeric))
          << p.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 0u);
}

TEST(Mlp, GradientMatchesFiniteDifferencesOnASmallNet) {
  Bound m = make_bound({6, 5, 4, 3}, 4, 3);
  // Non-zero biases so that the bias gradients are exercised off zero.
  for (std::size_t l = 0; l < 3; ++l) {
    for (float& b : m.model.layer_parameters(l)[1].value) b = 0.1f;
  }
  fill_random(m.model.input(4), 11);
  const std::uint8_t labels[] = {0, 2, 1, 2};
  check_gradient(m.model, 4, labels, /*every coordinate*/ 1000, 5);
}

TEST(Mlp, GradientMatchesFiniteDifferencesOnTheFashionMnistNet) {
  Bound m = make_bound({784, 256, 128, 10}, 3, 9);
  fill_random(m.model.input(3), 12);
  const std::uint8_t labels[] = {3, 9, 0};
  check_gradient(m.model, 3, labels, 12, 6);
}

TEST(Mlp, BackwardReportsEachTensorLastLayerFirstAfterItsLastUse) {
  // Reference gradients from an undisturbed backward (no row blocks).
  Bound ref = make_bound({8, 6, 5, 4}, 4, 21);
  fill_random(ref.model.input(4), 2);
  const std::uint8_t labels[] = {1, 3, 0, 2};
  ref.model.forward(4, labels);
  ASSERT_TRUE(ref.model.backward(no_op));

  // With row blocks of 4: W1 [6,8] is 2 blocks, W2 [5,6] 2 blocks, W3 [4,5] one.
  auto model = Mlp::create(MlpSpec{{8, 6, 5, 4}, 0, 4}, 4);
  ASSERT_TRUE(model);
  Bound m{std::move(*model), {}, {}};
  m.values.resize(m.model.num_parameters());
  m.grads.resize(m.model.num_parameters());
  ASSERT_TRUE(m.model.bind(m.values, m.grads));
  m.model.init_he(21);
  EXPECT_EQ(m.values, ref.values) << "He init must not depend on block_rows";
  fill_random(m.model.input(4), 2);
  m.model.forward(4, labels);
  std::vector<std::string> order;
  const auto status = m.model.backward([&](std::span<const Parameter> tensors) -> Status {
    EXPECT_EQ(tensors.size(), 1u);
    const Parameter& t = tensors[0];
    order.push_back(t.name);
    const std::span<const float> want_grad =
        std::span<const float>(ref.grads).subspan(t.offset, t.size());
    // Final when reported (same offsets: blocks are slices of the packing)...
    for (std::size_t i = 0; i < t.size(); ++i) EXPECT_EQ(t.grad[i], want_grad[i]) << t.name;
    // ...and no longer read: a pull may overwrite the values now.
    for (float& v : t.value) v = std::nanf("");
    return ok_status();
  });
  ASSERT_TRUE(status);
  EXPECT_THAT(order, ElementsAre("b3", "W3", "b2", "W2[0:4]", "W2[4:5]", "b1", "W1[0:4]",
                                 "W1[4:6]"));
}

TEST(Mlp, ForwardAsksForEachTensorBeforeItsFirstRead) {
  auto model = Mlp::create(MlpSpec{{8, 6, 4}, 0, 4}, 4);
  ASSERT_TRUE(model);
  Bound m{std::move(*model), {}, {}};
  m.values.resize(m.model.num_parameters());
  m.grads.resize(m.model.num_parameters());
  ASSERT_TRUE(m.model.bind(m.values, m.grads));
  m.model.init_he(5);
  const std::vector<float> good = m.values;
  fill_random(m.model.input(4), 3);
  const std::uint8_t labels[] = {1, 3, 0, 2};
  const ForwardStats want = m.model.forward(4, labels);

  // Poison every value; the hook restores each tensor when asked. A tensor
  // read before it was asked for would make the loss NaN.
  for (float& v : m.values) v = std::nanf("");
  std::vector<std::string> asked;
  auto got = m.model.forward(4, labels, [&](std::span<const Parameter> tensors) -> Status {
    for (const Parameter& t : tensors) {
      asked.push_back(t.name);
      std::copy_n(good.begin() + static_cast<std::ptrdiff_t>(t.offset), t.size(), t.value.begin());
    }
    return ok_status();
  });
  ASSERT_TRUE(got);
  EXPECT_EQ(got->loss, want.loss);
  EXPECT_EQ(got->correct, want.correct);
  EXPECT_THAT(asked, ElementsAre("W1[0:4]", "W1[4:6]", "b1", "W2", "b2"));

  // A hook error stops the forward and is returned; backward may not follow.
  auto failed = m.model.forward(4, labels, [&](std::span<const Parameter> tensors) -> Status {
    if (tensors[0].name == "W1[4:6]") return make_error(ErrorCode::kTimeout, "no reply");
    return ok_status();
  });
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().code(), ErrorCode::kTimeout);
}

TEST(Mlp, RowBlocksGetConsecutiveKeysAndMustBeBoundAdjacent) {
  auto model = Mlp::create(MlpSpec{{784, 256, 128, 10}, 0, 64}, 4);
  ASSERT_TRUE(model);
  const auto params = model->parameters();
  ASSERT_EQ(params.size(), 10u);
  EXPECT_EQ(params[0].name, "W1[0:64]");
  EXPECT_EQ(params[3].name, "W1[192:256]");
  EXPECT_EQ(params[3].offset, 192u * 784);
  EXPECT_EQ(params[3].rows, 64u);
  EXPECT_EQ(params[3].row_begin, 192u);
  EXPECT_EQ(params[4].name, "b1");
  EXPECT_EQ(params[4].offset, 200704u);
  EXPECT_EQ(params[5].name, "W2[0:64]");
  EXPECT_EQ(params[8].name, "W3");
  for (std::size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].key, i);
  EXPECT_EQ(model->layer_parameters(0).size(), 5u);
  EXPECT_EQ(model->num_parameters(), 235146u);

  // bind_tensors with W1's blocks out of order is refused.
  auto small = Mlp::create(MlpSpec{{2, 4, 2}, 0, 2}, 1);
  ASSERT_TRUE(small);
  // Tensors: W1[0:2] (4), W1[2:4] (4), b1 (4), W2 (8), b2 (2).
  std::vector<float> v(22), g(22);
  std::span<float> vs(v), gs(g);
  std::vector<std::span<float>> values{vs.subspan(4, 4), vs.subspan(0, 4), vs.subspan(8, 4),
                                       vs.subspan(12, 8), vs.subspan(20, 2)};
  std::vector<std::span<float>> grads{gs.subspan(0, 4), gs.subspan(4, 4), gs.subspan(8, 4),
                                      gs.subspan(12, 8), gs.subspan(20, 2)};
  auto s = small->bind_tensors(values, grads);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error().code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(s.error().message(), HasSubstr("W1[2:4] do not follow those of W1[0:2]"));
  std::swap(values[0], values[1]);
  EXPECT_TRUE(small->bind_tensors(values, grads));
}

TEST(Mlp, BackwardStopsAtTheFirstCallbackError) {
  Bound m = make_bound({4, 3, 3, 2}, 2);
  fill_random(m.model.input(2), 1);
  const std::uint8_t labels[] = {0, 1};
  m.model.forward(2, labels);
  std::vector<std::string> order;
  auto status = m.model.backward([&](std::span<const Parameter> tensors) -> Status {
    order.push_back(tensors[0].name);
    if (tensors[0].name == "W2") return make_error(ErrorCode::kClosed, "server went away");
    return ok_status();
  });
  ASSERT_FALSE(status);
  EXPECT_EQ(status.error().code(), ErrorCode::kClosed);
  EXPECT_THAT(order, ElementsAre("b3", "W3", "b2", "W2"));
}

TEST(Mlp, TrainingOnASmallBatchLowersTheLoss) {
  const Dataset data = testing::make_learnable_dataset(32, 4, 4, 17);
  Bound m = make_bound({16, 16, 10}, 32, 5);
  auto optimizer = make_sgd(SgdOptions{0.1, 0.9, 0.0, 0.0, false});
  ASSERT_TRUE(optimizer);
  std::vector<std::uint32_t> all(32);
  std::iota(all.begin(), all.end(), 0u);
  std::vector<std::uint8_t> labels(32);
  gather_batch(data, all, m.model.input(32), labels);
  const double first = m.model.forward(32, labels).loss;
  ASSERT_TRUE(m.model.backward(no_op));
  double last = first;
  ForwardStats f;
  for (int step = 0; step < 60; ++step) {
    for (const Parameter& p : m.model.parameters()) {
      ASSERT_TRUE((*optimizer)->step(p.key, p.value, p.grad));
    }
    f = m.model.forward(32, labels);
    last = f.loss;
    ASSERT_TRUE(m.model.backward(no_op));
  }
  EXPECT_LT(last, 0.25 * first) << "first " << first << " last " << last;
  EXPECT_GE(f.correct, 30u);
}

}  // namespace
}  // namespace ember::fashion_mnist
