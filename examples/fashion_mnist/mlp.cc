// MLP forward/backward with Eigen (see mlp.h for shapes and contracts).
#include "examples/fashion_mnist/mlp.h"

#include <cmath>
#include <functional>
#include <limits>
#include <utility>

#include "common/base/check.h"
#include "examples/fashion_mnist/rng.h"

namespace ember::fashion_mnist {
namespace {

using RowMajorMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<RowMajorMatrix>;
using ConstMatrixMap = Eigen::Map<const RowMajorMatrix>;
using VectorMap = Eigen::Map<Eigen::VectorXf>;
using ConstVectorMap = Eigen::Map<const Eigen::VectorXf>;

bool overlap(std::span<float> a, std::span<float> b) {
  if (a.empty() || b.empty()) return false;
  const std::less<const float*> before;
  return before(a.data(), b.data() + b.size()) && before(b.data(), a.data() + a.size());
}

}  // namespace

Result<Mlp> Mlp::create(MlpSpec spec, std::size_t max_batch_size) {
  const auto& sizes = spec.layer_sizes;
  if (sizes.size() < 2) {
    return make_error(ErrorCode::kInvalidArgument,
                      "MLP: layer_sizes needs at least 2 widths (inputs, outputs), got {}",
                      sizes.size());
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) {
      return make_error(ErrorCode::kInvalidArgument, "MLP: layer_sizes[{}] is 0; widths must be > 0", i);
    }
  }
  if (max_batch_size == 0) {
    return make_error(ErrorCode::kInvalidArgument, "MLP: max_batch_size must be > 0");
  }
  const std::size_t num_layers = sizes.size() - 1;
  const std::uint64_t num_tensors = 2 * std::uint64_t{num_layers};
  if (spec.first_key > std::numeric_limits<std::uint64_t>::max() - (num_tensors - 1)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "MLP: first_key {} leaves no room for {} consecutive keys", spec.first_key,
                      num_tensors);
  }

  Mlp model;
  model.max_batch_size_ = max_batch_size;
  std::size_t offset = 0;
  for (std::size_t l = 0; l < num_layers; ++l) {
    std::size_t weight_size = 0;
    if (__builtin_mul_overflow(sizes[l + 1], sizes[l], &weight_size) ||
        __builtin_add_overflow(offset, weight_size + sizes[l + 1], &offset)) {
      return make_error(ErrorCode::kInvalidArgument, "MLP: layer {} ({}x{}) is too large", l,
                        sizes[l + 1], sizes[l]);
    }
    Parameter weight;
    weight.key = spec.first_key + 2 * l;
    weight.name = fmt::format("W{}", l + 1);
    weight.rows = sizes[l + 1];
    weight.cols = sizes[l];
    weight.offset = offset - weight_size - sizes[l + 1];
    Parameter bias;
    bias.key = weight.key + 1;
    bias.name = fmt::format("b{}", l + 1);
    bias.rows = sizes[l + 1];
    bias.cols = 1;
    bias.offset = weight.offset + weight_size;
    model.params_.push_back(std::move(weight));
    model.params_.push_back(std::move(bias));
  }
  model.num_parameters_ = offset;

  const auto batch = static_cast<Eigen::Index>(max_batch_size);
  model.input_.resize(static_cast<Eigen::Index>(sizes[0]), batch);
  model.activations_.resize(num_layers);
  model.deltas_.resize(num_layers);
  for (std::size_t l = 0; l < num_layers; ++l) {
    model.activations_[l].resize(static_cast<Eigen::Index>(sizes[l + 1]), batch);
    model.deltas_[l].resize(static_cast<Eigen::Index>(sizes[l + 1]), batch);
  }
  model.spec_ = std::move(spec);
  return model;
}

Status Mlp::bind(std::span<float> values, std::span<float> grads) {
  if (values.size() != num_parameters_ || grads.size() != num_parameters_) {
    return make_error(ErrorCode::kShapeMismatch,
                      "MLP bind: value buffer has {} floats and gradient buffer {}, the model "
                      "needs {} each",
                      values.size(), grads.size(), num_parameters_);
  }
  std::vector<std::span<float>> value_spans;
  std::vector<std::span<float>> grad_spans;
  for (const Parameter& p : params_) {
    value_spans.push_back(values.subspan(p.offset, p.size()));
    grad_spans.push_back(grads.subspan(p.offset, p.size()));
  }
  if (overlap(values, grads)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "MLP bind: the value and gradient buffers overlap; give each its own memory");
  }
  return bind_tensors(value_spans, grad_spans);
}

Status Mlp::bind_tensors(std::span<const std::span<float>> values,
                         std::span<const std::span<float>> grads) {
  if (values.size() != params_.size() || grads.size() != params_.size()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "MLP bind: got {} value and {} gradient buffers, the model has {} tensors",
                      values.size(), grads.size(), params_.size());
  }
  std::vector<std::pair<std::span<float>, std::string>> all;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = params_[i];
    if (values[i].size() != p.size() || grads[i].size() != p.size()) {
      return make_error(ErrorCode::kShapeMismatch,
                        "MLP bind: tensor {} (key {}, [{}, {}]) needs {} floats; got {} for the "
                        "value and {} for the gradient",
                        p.name, p.key, p.rows, p.cols, p.size(), values[i].size(), grads[i].size());
    }
    all.emplace_back(values[i], p.name + " value");
    all.emplace_back(grads[i], p.name + " gradient");
  }
  for (std::size_t i = 0; i < all.size(); ++i) {
    for (std::size_t j = i + 1; j < all.size(); ++j) {
      if (overlap(all[i].first, all[j].first)) {
        return make_error(ErrorCode::kInvalidArgument,
                          "MLP bind: buffers of {} and {} overlap; give each its own memory",
                          all[i].second, all[j].second);
      }
    }
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    params_[i].value = values[i];
    params_[i].grad = grads[i];
  }
  bound_ = true;
  batch_size_ = 0;
  return ok_status();
}

void Mlp::init_he(std::uint64_t seed) {
  EMBER_CHECK_MSG(bound_, "Mlp::init_he before bind");
  for (std::size_t l = 0; l < num_layers(); ++l) {
    Parameter& weight = params_[2 * l];
    SplitMix64 rng(derive_seed(seed, weight.key));
    const double stddev = std::sqrt(2.0 / static_cast<double>(weight.cols));
    for (float& w : weight.value) w = static_cast<float>(stddev * rng.normal());
    for (float& b : params_[2 * l + 1].value) b = 0.0f;
  }
}

Eigen::Ref<Eigen::MatrixXf> Mlp::input(std::size_t batch_size) {
  EMBER_CHECK_MSG(batch_size > 0 && batch_size <= max_batch_size_,
                  "batch of {} samples, model sized for 1..{}", batch_size, max_batch_size_);
  return input_.leftCols(static_cast<Eigen::Index>(batch_size));
}

ForwardStats Mlp::forward(std::size_t batch_size, std::span<const std::uint8_t> labels) {
  EMBER_CHECK_MSG(bound_, "Mlp::forward before bind");
  EMBER_CHECK_MSG(batch_size > 0 && batch_size <= max_batch_size_,
                  "batch of {} samples, model sized for 1..{}", batch_size, max_batch_size_);
  EMBER_CHECK(labels.size() == batch_size);
  const auto batch = static_cast<Eigen::Index>(batch_size);
  const std::size_t layers = num_layers();

  for (std::size_t l = 0; l < layers; ++l) {
    const Parameter& weight = params_[2 * l];
    const Parameter& bias = params_[2 * l + 1];
    ConstMatrixMap w(weight.value.data(), static_cast<Eigen::Index>(weight.rows),
                     static_cast<Eigen::Index>(weight.cols));
    ConstVectorMap b(bias.value.data(), static_cast<Eigen::Index>(bias.rows));
    auto in = l == 0 ? input_.leftCols(batch) : activations_[l - 1].leftCols(batch);
    auto out = activations_[l].leftCols(batch);
    out.noalias() = w * in;
    out.colwise() += b;
    if (l + 1 < layers) out = out.cwiseMax(0.0f);
  }

  // Softmax cross-entropy, one column (sample) at a time, with the
  // max-subtraction that keeps exp() finite. deltas = (softmax - onehot) / B,
  // the gradient of the mean loss with respect to the logits.
  auto logits = activations_[layers - 1].leftCols(batch);
  auto delta = deltas_[layers - 1].leftCols(batch);
  const auto classes = logits.rows();
  const float inv_batch = 1.0f / static_cast<float>(batch_size);
  ForwardStats stats;
  double loss_sum = 0.0;
  for (Eigen::Index j = 0; j < batch; ++j) {
    const float* z = logits.col(j).data();
    float* d = delta.col(j).data();
    const auto label = static_cast<Eigen::Index>(labels[static_cast<std::size_t>(j)]);
    EMBER_DCHECK(label < classes);
    Eigen::Index arg_max = 0;
    for (Eigen::Index k = 1; k < classes; ++k) {
      if (z[k] > z[arg_max]) arg_max = k;
    }
    const float max_logit = z[arg_max];
    float sum = 0.0f;
    for (Eigen::Index k = 0; k < classes; ++k) {
      d[k] = std::exp(z[k] - max_logit);
      sum += d[k];
    }
    loss_sum += static_cast<double>(std::log(sum) + (max_logit - z[label]));
    const float scale = inv_batch / sum;
    for (Eigen::Index k = 0; k < classes; ++k) d[k] *= scale;
    d[label] -= inv_batch;
    if (arg_max == label) ++stats.correct;
  }
  stats.loss = loss_sum / static_cast<double>(batch_size);
  batch_size_ = batch_size;
  return stats;
}

Status Mlp::backward(const LayerReadyFn& on_layer_ready) {
  EMBER_CHECK_MSG(batch_size_ > 0, "Mlp::backward without a forward since the last backward or bind");
  const auto batch = static_cast<Eigen::Index>(batch_size_);
  batch_size_ = 0;
  for (std::size_t l = num_layers(); l-- > 0;) {
    const Parameter& weight = params_[2 * l];
    const Parameter& bias = params_[2 * l + 1];
    const auto rows = static_cast<Eigen::Index>(weight.rows);
    const auto cols = static_cast<Eigen::Index>(weight.cols);
    auto delta = deltas_[l].leftCols(batch);
    auto in = l == 0 ? input_.leftCols(batch) : activations_[l - 1].leftCols(batch);
    MatrixMap grad_w(weight.grad.data(), rows, cols);
    VectorMap grad_b(bias.grad.data(), rows);
    grad_w.noalias() = delta * in.transpose();
    grad_b.noalias() = delta.rowwise().sum();
    if (l > 0) {
      // The last read of this layer's weights in this step: after it the
      // callback may let new values land in place.
      ConstMatrixMap w(weight.value.data(), rows, cols);
      auto prev_delta = deltas_[l - 1].leftCols(batch);
      prev_delta.noalias() = w.transpose() * delta;
      // relu'(z) is 1 where the stored activation relu(z) is > 0.
      prev_delta.array() *= (activations_[l - 1].leftCols(batch).array() > 0.0f).cast<float>();
    }
    EMBER_TRY(on_layer_ready(l));
  }
  return ok_status();
}

}  // namespace ember::fashion_mnist
