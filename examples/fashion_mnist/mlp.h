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
// Row blocks (MlpSpec::block_rows = R > 0): a weight with more than R rows is
// held as ceil(rows / R) tensors of R rows each (the last may be shorter),
// named "W1[0:32]", "W1[32:64]", ..., each with its own key; keys stay
// consecutive in packing order (the blocks of W_l, then b_l). A row block of
// a row-major matrix is a contiguous slice of it, so the packing (offsets)
// is the same as without blocks. E.g. R = 64 on the default net: W1 blocks
// keys 0-3, b1 key 4, W2 blocks keys 5-6, b2 key 7, W3 key 8, b3 key 9.
// Why: backward computes and reports each block's gradient on its own, so
// its exchange overlaps with the rest of backward (DDP's gradient buckets,
// Li et al., "PyTorch Distributed", VLDB 2020), and forward can start on a
// layer's first rows while its last rows' parameters are still arriving.
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
// Overlap contract: backward visits the layers last to first; in each layer
// it first reads the weights (for the previous layer's delta), then produces
// b_l's gradient and each row block of W_l's, first rows first. As soon as a
// tensor's gradient is final AND the model has finished reading its values
// for this step, it calls on_ready({tensor}). From then until forward asks
// for that tensor again (its before_read hook), the model neither reads the
// tensor's values nor writes its gradient, so the callback may send the
// gradient and let new parameter values land in place (a pull) while
// backward goes on. Forward with a before_read hook calls it for each tensor
// right before its first read (layer by layer: W_l's blocks in row order,
// then b_l), so a caller can wait there for exactly that tensor's new values.
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

// The row block fmnist-worker and fmnist-baseline use by default: W1 in 2
// blocks of 128 x 784 (392 KiB each), W2 and W3 whole: 7 messages a step.
// The first W1 block's round trip still overlaps the second's backward and
// the next batch's gathering. bench/train (1 worker, 2 cores, 5 reps, two
// interleaved runs each): comm share 3.5-3.7% (shm) and 3.2-3.3% (tcp) with
// 128, against 4.7-4.8% and 5.5-5.7% with 32 rows (16 messages a step: the
// per-message cost of a push_pull outweighed the finer overlap, and the
// smaller products ran slower in Eigen).
inline constexpr std::size_t kDefaultBlockRows = 128;

struct MlpSpec {
  // Widths: inputs, hidden layers..., outputs (classes). At least 2 entries,
  // all > 0.
  std::vector<std::size_t> layer_sizes{784, 256, 128, 10};
  // Key of W1; the others follow (see the table above).
  std::uint64_t first_key = 0;
  // 0: one tensor per weight. R > 0: weights with more than R rows are cut
  // into row blocks of R rows (see "Row blocks" above).
  std::size_t block_rows = 0;
};

// One parameter tensor and, once bound, its value and gradient buffers
// (caller-owned; valid for as long as the caller keeps them alive).
struct Parameter {
  std::uint64_t key = 0;
  std::string name;        // "W1", "b1", "W1[0:64]" (a row block), ...
  std::size_t layer = 0;   // 0-based layer this tensor belongs to
  bool is_bias = false;
  std::size_t row_begin = 0;  // first row of the layer's weight (0 for b)
  std::size_t rows = 0;    // rows of this tensor (outputs of the layer, or of the block)
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

// Called by backward once per tensor (see the overlap contract) with a span
// of that one tensor; by forward's before_read for each tensor before its
// first read. An error stops backward (forward) and is returned by it.
using TensorsFn = std::function<Status(std::span<const Parameter> tensors)>;

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
  // The tensors of layer l: W_l's row blocks (or W_l), then b_l.
  // pre: l < num_layers().
  std::span<const Parameter> layer_parameters(std::size_t layer) const {
    return std::span<const Parameter>(params_).subspan(layers_[layer].first_tensor,
                                                       layers_[layer].num_blocks + 1);
  }

  // Binds one contiguous buffer for all values and one for all gradients;
  // tensor i occupies [offset, offset + size) of each (key order, packed).
  // Errors: kShapeMismatch when a buffer's size is not num_parameters();
  // kInvalidArgument when the two buffers overlap.
  Status bind(std::span<float> values, std::span<float> grads);
  // Binds one buffer per tensor, in key order. Errors: kInvalidArgument when
  // the counts are not parameters().size(), two buffers overlap, or the row
  // blocks of one weight are not adjacent in order in memory (a layer's
  // weight is used as one matrix); kShapeMismatch naming the tensor when a
  // buffer's size differs from it.
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
  // The same, calling before_read({tensor}) for each tensor right before its
  // first read (overlap contract). Returns before_read's first error (the
  // forward stops there; backward must not follow).
  Result<ForwardStats> forward(std::size_t batch_size, std::span<const std::uint8_t> labels,
                               const TensorsFn& before_read);

  // Gradient of the last forward's mean loss into the bound grad buffers
  // (overwritten, not accumulated), calling on_ready({tensor}) once per
  // tensor, layers last to first, within a layer b_l then W_l's blocks in
  // row order (overlap contract above). Does not allocate. Returns the first
  // error on_ready returns (backward stops there). pre: a forward since the
  // last bind; not called twice for one forward.
  Status backward(const TensorsFn& on_ready);

 private:
  Mlp() = default;
  // Layer l's whole weight ([rows, cols] row-major, its blocks adjacent) and
  // its bias. pre: bound().
  std::span<float> weight_values(std::size_t l) const {
    const Parameter& first = params_[layers_[l].first_tensor];
    return {first.value.data(), spec_.layer_sizes[l + 1] * spec_.layer_sizes[l]};
  }
  const Parameter& bias(std::size_t l) const {
    return params_[layers_[l].first_tensor + layers_[l].num_blocks];
  }

  MlpSpec spec_;
  std::size_t max_batch_size_ = 0;
  std::size_t num_parameters_ = 0;
  std::vector<Parameter> params_;
  // Per layer: where its tensors sit in params_ (W blocks, then b).
  struct LayerTensors {
    std::size_t first_tensor = 0;
    std::size_t num_blocks = 0;  // tensors of W_l (1 without row blocks)
  };
  std::vector<LayerTensors> layers_;
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
