// Optimizers for the single-process baseline: SGD with (Nesterov) momentum
// and Adam, with exactly PyTorch's update rules, so that the baseline and
// Ember's server (which applies the optimizer in a distributed job and
// follows the same formulas) train the same model.
//
// SGD — torch.optim.SGD (https://pytorch.org/docs/stable/generated/torch.optim.SGD.html),
// for each tensor at step t = 1, 2, ... with gradient g_t:
//   g_t <- g_t + weight_decay * p_{t-1}                 (if weight_decay != 0)
//   if momentum != 0:
//     b_t <- g_t                                        (t == 1)
//     b_t <- momentum * b_{t-1} + (1 - dampening) * g_t (t > 1)
//     g_t <- g_t + momentum * b_t                       (nesterov)
//     g_t <- b_t                                        (otherwise)
//   p_t <- p_{t-1} - lr * g_t
// Note lr multiplies the velocity, not the gradient inside it (PyTorch's
// form, unlike Sutskever et al.), which matters when lr changes.
//
// Adam — torch.optim.Adam, amsgrad=False
// (https://pytorch.org/docs/stable/generated/torch.optim.Adam.html; Kingma
// and Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015):
//   g_t <- g_t + weight_decay * p_{t-1}                 (if weight_decay != 0; L2, not AdamW)
//   m_t <- beta1 * m_{t-1} + (1 - beta1) * g_t
//   v_t <- beta2 * v_{t-1} + (1 - beta2) * g_t^2
//   p_t <- p_{t-1} - (lr / (1 - beta1^t)) * m_t / (sqrt(v_t) / sqrt(1 - beta2^t) + eps)
// with m_0 = v_0 = 0. The last line is how PyTorch's single-tensor path
// evaluates m_hat / (sqrt(v_hat) + eps), eps added after the bias correction.
// (PyTorch >= 2.0 updates m with lerp, m + (1 - beta1) * (g - m): the same
// value up to float rounding.)
//
// Precision (as PyTorch on float32 tensors): state and element-wise
// arithmetic in float32; the scalars lr / (1 - beta1^t) and
// sqrt(1 - beta2^t) are computed in double and rounded to float once per step.
//
// Same bits as the server: where Ember's server supports the options (sgd
// and momentum without dampening, Adam, lr > 0, eps > 0), step() runs the
// server's own update (server/optimizer.h, linked from ember_server_core),
// so a one-process run and a 1-worker Ember job compute identical parameters
// (a separately written loop differs in how the compiler fuses a * b + c into
// FMAs, an ulp here and there that training amplifies). Other options
// (dampening, lr == 0, eps == 0) use an Eigen implementation of the same
// formulas.
//
// State is per key: created (zero, step 0) on the first step() for a key,
// sized from that call. Each key counts its own steps t.
//
// Thread-safety: not thread-safe; one thread at a time. step() allocates on
// the first call for a key only.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/base/error.h"

namespace ember::fashion_mnist {

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // Applies one update to the tensor `key`: reads grad, updates param and
  // the key's state in place. Errors: kShapeMismatch when param and grad
  // differ in size, or the size differs from the key's first step.
  virtual Status step(std::uint64_t key, std::span<float> param, std::span<const float> grad) = 0;

  // Learning rate used by later steps (state is kept). Errors:
  // kInvalidArgument unless lr is finite and >= 0.
  virtual Status set_learning_rate(double lr) = 0;
  virtual double learning_rate() const = 0;

  // "sgd lr=0.05 momentum=0.9 ..." for logs and result lines.
  virtual std::string describe() const = 0;
};

struct SgdOptions {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

// Errors: kInvalidArgument (naming the option) when lr, momentum or
// weight_decay is negative or not finite, dampening is not finite, or
// nesterov is set without momentum > 0 and dampening == 0 (PyTorch's rule).
Result<std::unique_ptr<Optimizer>> make_sgd(const SgdOptions& options);

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// Errors: kInvalidArgument (naming the option) when lr, eps or weight_decay
// is negative or not finite, or a beta is outside [0, 1).
Result<std::unique_ptr<Optimizer>> make_adam(const AdamOptions& options);

}  // namespace ember::fashion_mnist
