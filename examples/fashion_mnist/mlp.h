// A multilayer perceptron with ReLU hidden layers and a softmax
// cross-entropy loss, on the CPU with Eigen, in float32.
//
// The default shape is Fashion-MNIST's 784-256-128-10. Layer l (0-based) maps
// n_l inputs to n_{l+1} outputs and owns two parameter tensors:
//
//   name      key                 shape (float32, row-major)       init
//   W{l+1}    first_key + 2l      [n_{l+1}, n_l]  (out, in, as torch.nn.Linear)  He normal
//   b{l+1}    first_key + 2l + 1  [n_{l+1}]                         zeros
//
// so the default net has W1 [256,784] key 0, b1 [256] key 1, W2 [128,256]
// key 2, b2 [128] key 3, W3 [10,128] key 4, b3 [10] key 5: 235,146 floats.
// Keys are stable: they are the parameter server's keys.
//
// The model does not own its parameters or gradients: the caller binds
// float buffers (bind / bind_tensors), so that a worker can place them in
// page-pool memory and send them from there without a copy. The model owns
// only its activation workspace, sized once for max_batch_size samples.
//
// Batches are column-major Eigen matrices with one sample per column
// ([num_inputs, batch] float32, which is [batch, num_inputs] row-major in
// memory). Forward computes, for each layer, z = W a + b (a = the layer's
// input) and a' = relu(z) (the last layer keeps the logits); the loss is the
// mean over the batch of -log softmax(logits)[label]. Backward computes the
// gradient of that mean loss.
//
// Overlap contract: backward visits the layers last to first. As soon as
// layer l's gradients are final AND the model has finished reading layer l's
// parameters for this step, it calls on_layer_ready(l). From then until the
// next forward, the model neither reads layer l's values nor writes its
// gradients, so the callback may send the gradients and let new parameter
// values land in place (a pull) while backward goes on with layer l-1.
//
// He initialisation: W ~ N(0, 2 / fan_in) (He, Zhang, Ren, Sun, "Delving Deep
// into Rectifiers", ICCV 2015), b = 0, drawn from SplitMix64 streams derived
// from (seed, key) (rng.h), so every rank initialises identically.
//
// Thread-safety: an Mlp is used by one thread at a time (forward/backward
// mutate the workspace). It is move-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <Eigen/Core>

#include "common/base/error.h"

namespace ember::fashion_mnist {

struct MlpSpec {
  // Widths: inputs, hidden layers..., outputs (classes). At least 2 entries,
  // all > 0.
  std::vector<std::size_t> layer_sizes{784, 256, 128, 10};
  // Key of W1; the others follow (see the table above).
  std::uint64_t first_key = 0;
};

// One parameter tensor and, once bound, its value and gradient buffers
// (caller-owned; valid for as long as the caller keeps them alive).
struct Parameter {
  std::uint64_t key = 0;
  std::string name;        // "W1", "b1", ...
  std::size_t rows = 0;    // outputs of the layer
  std::size_t cols = 0;    // inputs of the layer for W, 1 for b
  std::size_t offset = 0;  // floats from the start of a contiguous packing (bind)
  std::span<float> value;  // rows*cols float32, row-major
  std::span<float> grad;   // rows*cols float32, row-major
  std::size_t size() const { return rows * cols; }
};

struct ForwardStats {
  double loss = 0.0;        // mean softmax cross-entropy over the batch (nats)
  std::size_t correct = 0;  // samples whose arg-max logit equals the label
};

// Called by backward once per layer, last layer first (see the overlap
// contract). An error stops backward and is returned by it.
using LayerReadyFn = std::function<Status(std::size_t layer)>;

class Mlp {
 public:
  // Validates the spec and allocates the workspace for up to max_batch_size
  // samples per forward. Errors: kInvalidArgument when the spec has fewer
  // than 2 widths, a zero width, max_batch_size == 0, or keys that overflow.
  static Result<Mlp> create(MlpSpec spec, std::size_t max_batch_size);

  Mlp(Mlp&&) noexcept = default;
  Mlp& operator=(Mlp&&) noexcept = default;
  Mlp(const Mlp&) = delete;
  Mlp& operator=(const Mlp&) = delete;

  const MlpSpec& spec() const { return spec_; }
  std::size_t num_layers() const { return spec_.layer_sizes.size() - 1; }
  std::size_t num_inputs() const { return spec_.layer_sizes.front(); }
  std::size_t num_outputs() const { return spec_.layer_sizes.back(); }
  std::size_t max_batch_size() const { return max_batch_size_; }
  // Total floats of all parameter tensors (also of all gradients).
  std::size_t num_parameters() const { return num_parameters_; }

  // The tensors in key order; value/grad are empty until bound.
  std::span<const Parameter> parameters() const { return params_; }
  // The two tensors (W, b) of layer l. pre: l < num_layers().
  std::span<const Parameter> layer_parameters(std::size_t layer) const {
    return std::span<const Parameter>(params_).subspan(2 * layer, 2);
  }

  // Binds one contiguous buffer for all values and one for all gradients;
  // tensor i occupies [offset, offset + size) of each (key order, packed).
  // Errors: kShapeMismatch when a buffer's size is not num_parameters();
  // kInvalidArgument when the two buffers overlap.
  Status bind(std::span<float> values, std::span<float> grads);
  // Binds one buffer per tensor, in key order. Errors: kInvalidArgument when
  // the counts are not 2 * num_layers() or two buffers overlap;
  // kShapeMismatch naming the tensor when a buffer's size differs from it.
  Status bind_tensors(std::span<const std::span<float>> values,
                      std::span<const std::span<float>> grads);
  bool bound() const { return bound_; }

  // Writes He-initialised weights and zero biases into the bound values.
  // pre: bound().
  void init_he(std::uint64_t seed);

  // The input block for a batch of batch_size samples: fill its columns,
  // then call forward(batch_size, labels). [num_inputs, batch_size] float32.
  // pre: 0 < batch_size <= max_batch_size().
  Eigen::Ref<Eigen::MatrixXf> input(std::size_t batch_size);

  // Runs the batch in input(batch_size) through the net, returns the mean
  // loss and the number correct, and keeps what backward needs. Does not
  // allocate. pre: bound(), 0 < batch_size <= max_batch_size(),
  // labels.size() == batch_size, every label < num_outputs().
  ForwardStats forward(std::size_t batch_size, std::span<const std::uint8_t> labels);

  // Gradient of the last forward's mean loss into the bound grad buffers
  // (overwritten, not accumulated), calling on_layer_ready(l) for
  // l = num_layers()-1 down to 0 (overlap contract above). Does not
  // allocate. Returns the first error on_layer_ready returns (backward stops
  // there). pre: a forward since the last bind; not called twice for one
  // forward.
  Status backward(const LayerReadyFn& on_layer_ready);

 private:
  Mlp() = default;

  MlpSpec spec_;
  std::size_t max_batch_size_ = 0;
  std::size_t num_parameters_ = 0;
  std::vector<Parameter> params_;
  bool bound_ = false;

  // Workspace, each with max_batch_size_ columns: the input batch,
  // activations_[l] = relu(z) of hidden layer l (logits for the last),
  // deltas_[l] = d loss / d z of layer l.
  Eigen::MatrixXf input_;
  std::vector<Eigen::MatrixXf> activations_;
  std::vector<Eigen::MatrixXf> deltas_;
  std::size_t batch_size_ = 0;  // of the last forward; 0 after backward
};

}  // namespace ember::fashion_mnist
