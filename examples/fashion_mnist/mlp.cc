// MLP forward/backward with Eigen (see mlp.h for shapes and contracts).
#include "examples/fashion_mnist/mlp.h"

#include <algorithm>
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
  std::uint64_t num_tensors = 0;  // W blocks and biases, all layers
  for (std::size_t l = 0; l < num_layers; ++l) {
    const std::size_t rows = sizes[l + 1];
    const std::size_t block = spec.block_rows == 0 || spec.block_rows >= rows ? rows : spec.block_rows;
    num_tensors += (rows + block - 1) / block + 1;
  }
  if (spec.first_key > std::numeric_limits<std::uint64_t>::max() - (num_tensors - 1)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "MLP: first_key {} leaves no room for {} consecutive keys", spec.first_key,
                      num_tensors);
  }

  Mlp model;
  model.max_batch_size_ = max_batch_size;
  std::size_t offset = 0;
  std::uint64_t key = spec.first_key;
  for (std::size_t l = 0; l < num_layers; ++l) {
    std::size_t weight_size = 0;
    if (__builtin_mul_overflow(sizes[l + 1], sizes[l], &weight_size) ||
        __builtin_add_overflow(offset, weight_size + sizes[l + 1], &offset)) {
      return make_error(ErrorCode::kInvalidArgument, "MLP: layer {} ({}x{}) is too large", l,
                        sizes[l + 1], sizes[l]);
    }
    const std::size_t rows = sizes[l + 1];
    const std::size_t block = spec.block_rows == 0 || spec.block_rows >= rows ? rows : spec.block_rows;
    const std::size_t num_blocks = (rows + block - 1) / block;
    model.layers_.push_back(LayerTensors{model.params_.size(), num_blocks});
    const std::size_t weight_offset = offset - weight_size - rows;
    for (std::size_t begin = 0; begin < rows; begin += block) {
      const std::size_t n = std::min(block, rows - begin);
      Parameter weight;
      weight.key = key++;
      weight.name = num_blocks == 1 ? fmt::format("W{}", l + 1)
                                    : fmt::format("W{}[{}:{}]", l + 1, begin, begin + n);
      weight.layer = l;
      weight.row_begin = begin;
      weight.rows = n;
      weight.cols = sizes[l];
      weight.offset = weight_offset + begin * sizes[l];
      model.params_.push_back(std::move(weight));
    }
    Parameter bias;
    bias.key = key++;
    bias.name = fmt::format("b{}", l + 1);
    bias.layer = l;
    bias.is_bias = true;
    bias.rows = rows;
    bias.cols = 1;
    bias.offset = weight_offset + weight_size;
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
  for (const LayerTensors& layer : layers_) {
    for (std::size_t k = 1; k < layer.num_blocks; ++k) {
      const std::size_t i = layer.first_tensor + k;
      if (values[i].data() != values[i - 1].data() + values[i - 1].size() ||
          grads[i].data() != grads[i - 1].data() + grads[i - 1].size()) {
        return make_error(ErrorCode::kInvalidArgument,
                          "MLP bind: the buffers of row block {} do not follow those of {} in "
                          "memory; a layer's weight blocks must be adjacent, in order (or use "
                          "bind with one buffer)",
                          params_[i].name, params_[i - 1].name);
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
    // One stream per weight, keyed by the key the whole weight has without
    // row blocks (first_key + 2l): the values do not depend on block_rows.
    SplitMix64 rng(derive_seed(seed, spec_.first_key + 2 * l));
    const double stddev = std::sqrt(2.0 / static_cast<double>(spec_.layer_sizes[l]));
    for (float& w : weight_values(l)) w = static_cast<float>(stddev * rng.normal());
    for (float& b : bias(l).value) b = 0.0f;
  }
}

Eigen::Ref<Eigen::MatrixXf> Mlp::input(std::size_t batch_size) {
  EMBER_CHECK_MSG(batch_size > 0 && batch_size <= max_batch_size_,
                  "batch of {} samples, model sized for 1..{}", batch_size, max_batch_size_);
  return input_.leftCols(static_cast<Eigen::Index>(batch_size));
}

ForwardStats Mlp::forward(std::size_t batch_size, std::span<const std::uint8_t> labels) {
  Result<ForwardStats> r = forward(batch_size, labels, TensorsFn());
  EMBER_CHECK(r.has_value());  // no hook, no error
  return *r;
}

Result<ForwardStats> Mlp::forward(std::size_t batch_size, std::span<const std::uint8_t> labels,
                                  const TensorsFn& before_read) {
  EMBER_CHECK_MSG(bound_, "Mlp::forward before bind");
  EMBER_CHECK_MSG(batch_size > 0 && batch_size <= max_batch_size_,
                  "batch of {} samples, model sized for 1..{}", batch_size, max_batch_size_);
  EMBER_CHECK(labels.size() == batch_size);
  const auto batch = static_cast<Eigen::Index>(batch_size);
  const std::size_t layers = num_layers();
  batch_size_ = 0;  // no backward after a failed forward

  for (std::size_t l = 0; l < layers; ++l) {
    const LayerTensors& lt = layers_[l];
    const Parameter& b_param = params_[lt.first_tensor + lt.num_blocks];
    auto in = l == 0 ? input_.leftCols(batch) : activations_[l - 1].leftCols(batch);
    auto out = activations_[l].leftCols(batch);
    // Row block by row block (the same arithmetic with or without a hook).
    for (std::size_t k = 0; k < lt.num_blocks; ++k) {
      const Parameter& w_param = params_[lt.first_tensor + k];
      if (before_read) EMBER_TRY(before_read(std::span<const Parameter>(&w_param, 1)));
      ConstMatrixMap w(w_param.value.data(), static_cast<Eigen::Index>(w_param.rows),
                       static_cast<Eigen::Index>(w_param.cols));
      auto rows = out.middleRows(static_cast<Eigen::Index>(w_param.row_begin),
                                 static_cast<Eigen::Index>(w_param.rows));
      rows.noalias() = w * in;
    }
    // The bias last: backward sends it first, so it has had the longest time
    // to come back, and the W blocks' products run while it does.
    if (before_read) EMBER_TRY(before_read(std::span<const Parameter>(&b_param, 1)));
    ConstVectorMap b(b_param.value.data(), static_cast<Eigen::Index>(b_param.rows));
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

Status Mlp::backward(const TensorsFn& on_ready) {
  EMBER_CHECK_MSG(batch_size_ > 0, "Mlp::backward without a forward since the last backward or bind");
  const auto batch = static_cast<Eigen::Index>(batch_size_);
  batch_size_ = 0;
  for (std::size_t l = num_layers(); l-- > 0;) {
    const LayerTensors& lt = layers_[l];
    const auto rows = static_cast<Eigen::Index>(spec_.layer_sizes[l + 1]);
    const auto cols = static_cast<Eigen::Index>(spec_.layer_sizes[l]);
    auto delta = deltas_[l].leftCols(batch);
    auto in = l == 0 ? input_.leftCols(batch) : activations_[l - 1].leftCols(batch);
    if (l > 0) {
      // The last read of this layer's weights in this step: after it the
      // callbacks may let new values land in place.
      ConstMatrixMap w(weight_values(l).data(), rows, cols);
      auto prev_delta = deltas_[l - 1].leftCols(batch);
      prev_delta.noalias() = w.transpose() * delta;
      // relu'(z) is 1 where the stored activation relu(z) is > 0.
      prev_delta.array() *= (activations_[l - 1].leftCols(batch).array() > 0.0f).cast<float>();
    }
    const Parameter& b_param = params_[lt.first_tensor + lt.num_blocks];
    // Summed column by column (each element in sample order), not with
    // delta.rowwise().sum(): Eigen vectorises that differently depending on
    // the destination's alignment, so a pool buffer (a worker) and a heap
    // buffer (the baseline) got different roundings in a few elements.
    VectorMap grad_b(b_param.grad.data(), rows);
    grad_b = delta.col(0);
    for (Eigen::Index j = 1; j < batch; ++j) grad_b += delta.col(j);
    EMBER_TRY(on_ready(std::span<const Parameter>(&b_param, 1)));
    // Each row block's gradient is reported as soon as it is computed, so
    // its exchange overlaps with the next blocks and the layers below.
    for (std::size_t k = 0; k < lt.num_blocks; ++k) {
      const Parameter& w_param = params_[lt.first_tensor + k];
      const auto block_rows = static_cast<Eigen::Index>(w_param.rows);
      MatrixMap grad_w(w_param.grad.data(), block_rows, cols);
      grad_w.noalias() =
          delta.middleRows(static_cast<Eigen::Index>(w_param.row_begin), block_rows) *
          in.transpose();
      EMBER_TRY(on_ready(std::span<const Parameter>(&w_param, 1)));
    }
  }
  return ok_status();
}

}  // namespace ember::fashion_mnist
