// Optimisers and gradient clipping over a ParameterList, with the update rules of
// torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW and torch.nn.utils.clip_grad_norm_.
//
// Every tensor is treated as a flat vector of its elements: the updates are elementwise, so the
// shapes only need value and grad to agree. Each update is written in the order of operations of
// torch's single-tensor (foreach=False, non-fused, non-capturable) path, the default on CPU, so
// double results agree with torch's to a few units in the last place. Scalars (bias corrections,
// the clipping factor) are computed in double and rounded to T once, as torch turns Python floats
// into the tensor's type.
//
// Options are checked as torch checks them, and also refuse NaN; a bad option throws ShapeError
// (a std::invalid_argument) naming it, e.g. "AdamOptions.beta1: must be in [0, 1), got 1".
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "mha/errors.hpp"
#include "mha/parameters.hpp"
#include "mha/tensor.hpp"

namespace mha {

namespace detail {

// The shortest decimal that reads back as `value`: "0.1" and "1e-08", not 0.10000000000000001.
inline std::string format_option(double value) {
  std::string text;
  for (int digits = 1; digits <= 17; ++digits) {
    std::ostringstream out;
    out.precision(digits);
    out << value;
    text = out.str();
    if (std::isnan(value) || std::strtod(text.c_str(), nullptr) == value) break;
  }
  return text;
}

// `ok` is computed by the caller as a comparison that is false for NaN, so NaN is refused too.
inline void check_option(bool ok, const std::string& argument, const std::string& requirement,
                         double value) {
  if (!ok) throw_argument(argument, "must be " + requirement + ", got " + format_option(value));
}

// An optimiser with nothing to step is a mistake (torch: "optimizer got an empty parameter
// list"), not a no-op.
template <class T>
void check_optimizer_parameters(const ParameterList<T>& parameters) {
  if (parameters.empty()) throw_argument("parameters", "the list is empty, nothing to optimise");
  check_parameter_list(parameters);
}

}  // namespace detail

// Options of torch.optim.SGD. lr has no default, as in torch 1.13: leaving it unset (NaN) is
// refused by the constructor.
struct SgdOptions {
  double lr = std::numeric_limits<double>::quiet_NaN();
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

// torch.optim.SGD. For each element, with p the value and g the gradient, at step t:
//   d = g + weight_decay * p                          (when weight_decay != 0)
//   b = d                                             (t = 1: the buffer starts at the gradient,
//   b = momentum * b + (1 - dampening) * d             t > 1;  not a zero-initialised average)
//   d = d + momentum * b   with nesterov,   d = b   otherwise      (when momentum != 0)
//   p = p - lr * d
// The gradient tensors are only read: decay and momentum act on d, as in torch.
template <class T>
class Sgd {
 public:
  using Scalar = T;

  Sgd(ParameterList<T> parameters, const SgdOptions& options)
      : parameters_(std::move(parameters)), options_(options) {
    detail::check_optimizer_parameters(parameters_);
    check_options(options_);
    if (options_.momentum != 0.0) {
      momentum_buffers_.reserve(parameters_.size());
      for (const auto& parameter : parameters_) {
        momentum_buffers_.emplace_back(Vector<T>::Zero(parameter.value.size()));
      }
    }
  }

  void step() {
    const T lr = static_cast<T>(options_.lr);
    const T weight_decay = static_cast<T>(options_.weight_decay);
    const T momentum = static_cast<T>(options_.momentum);
    const T keep = static_cast<T>(1.0 - options_.dampening);
    const bool decay = options_.weight_decay != 0.0;
    const bool use_momentum = options_.momentum != 0.0;
    const bool first = steps_ == 0;
    for (std::size_t k = 0; k < parameters_.size(); ++k) {
      T* p = parameters_[k].value.data();
      const T* g = parameters_[k].grad.data();
      T* b = use_momentum ? momentum_buffers_[k].data() : nullptr;
      const Index n = parameters_[k].value.size();
      for (Index i = 0; i < n; ++i) {
        T d = decay ? g[i] + weight_decay * p[i] : g[i];
        if (use_momentum) {
          b[i] = first ? d : b[i] * momentum + keep * d;
          d = options_.nesterov ? d + momentum * b[i] : b[i];
        }
        p[i] = p[i] + (-lr) * d;
      }
    }
    ++steps_;
  }

  // Sets every gradient to 0 (torch's zero_grad(set_to_none=False): here gradients are views
  // into tensors someone else owns, so there is nothing to set to None).
  void zero_grad() {
    for (auto& parameter : parameters_) parameter.grad.matrix().setZero();
  }

  // For learning-rate schedules, as assigning param_groups[0]["lr"] in torch.
  void set_lr(double lr) {
    SgdOptions changed = options_;
    changed.lr = lr;
    check_options(changed);
    options_ = changed;
  }

  const SgdOptions& options() const { return options_; }
  const ParameterList<T>& parameters() const { return parameters_; }
  Index steps() const { return steps_; }

 private:
  static void check_options(const SgdOptions& o) {
    detail::check_option(o.lr >= 0.0, "SgdOptions.lr", "set and >= 0", o.lr);
    detail::check_option(o.momentum >= 0.0, "SgdOptions.momentum", ">= 0", o.momentum);
    detail::check_option(o.weight_decay >= 0.0, "SgdOptions.weight_decay", ">= 0", o.weight_decay);
    detail::check_option(!std::isnan(o.dampening), "SgdOptions.dampening", "a number", o.dampening);
    if (o.nesterov && !(o.momentum > 0.0 && o.dampening == 0.0)) {
      detail::throw_argument("SgdOptions.nesterov",
                             "Nesterov momentum needs momentum > 0 and dampening 0, got momentum " +
                                 detail::format_option(o.momentum) + " and dampening " +
                                 detail::format_option(o.dampening));
    }
  }

  ParameterList<T> parameters_;
  SgdOptions options_;
  std::vector<Vector<T>> momentum_buffers_;  // one per parameter when momentum != 0
  Index steps_ = 0;
};

// Options of torch.optim.Adam (L2 weight decay, none by default).
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
};

// Options of torch.optim.AdamW: the same fields, but decoupled weight decay 1e-2 by default.
// A separate type so that AdamW's default decay cannot silently become Adam's 0.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
};

namespace detail {

// Adam and AdamW differ only in where weight decay enters. For each element at step t:
//   p = p * (1 - lr * weight_decay)                   (AdamW: decoupled decay)
//   g = g + weight_decay * p                          (Adam: L2 decay through the gradient)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   v_max = max(v_max, v)                             (amsgrad; the denominator then uses v_max)
//   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// m and v start at 0; dividing by (1 - beta^t) undoes their bias towards 0 in the first steps.
// eps is added after the bias correction of v, as torch does (not to sqrt(v) itself).
template <class T, class Options, bool kDecoupled>
class AdamImpl {
 public:
  using Scalar = T;

  AdamImpl(ParameterList<T> parameters, const Options& options)
      : parameters_(std::move(parameters)), options_(options) {
    check_optimizer_parameters(parameters_);
    check_options(options_);
    // All state is allocated here, so that step() never allocates.
    const std::size_t count = parameters_.size();
    exp_avg_.reserve(count);
    exp_avg_sq_.reserve(count);
    if (options_.amsgrad) max_exp_avg_sq_.reserve(count);
    for (const auto& parameter : parameters_) {
      const Index n = parameter.value.size();
      exp_avg_.emplace_back(Vector<T>::Zero(n));
      exp_avg_sq_.emplace_back(Vector<T>::Zero(n));
      if (options_.amsgrad) max_exp_avg_sq_.emplace_back(Vector<T>::Zero(n));
    }
  }

  void step() {
    ++steps_;
    const Options& o = options_;
    const auto t = static_cast<double>(steps_);
    const T step_size = static_cast<T>(o.lr / (1.0 - std::pow(o.beta1, t)));
    const T bias_correction2_sqrt = static_cast<T>(std::sqrt(1.0 - std::pow(o.beta2, t)));
    const T beta1 = static_cast<T>(o.beta1);
    const T beta2 = static_cast<T>(o.beta2);
    const T one_minus_beta1 = static_cast<T>(1.0 - o.beta1);
    const T one_minus_beta2 = static_cast<T>(1.0 - o.beta2);
    const T eps = static_cast<T>(o.eps);
    const T weight_decay = static_cast<T>(o.weight_decay);
    const T decay_factor = static_cast<T>(1.0 - o.lr * o.weight_decay);
    const bool decay = o.weight_decay != 0.0;
    for (std::size_t k = 0; k < parameters_.size(); ++k) {
      T* p = parameters_[k].value.data();
      const T* grad = parameters_[k].grad.data();
      T* m = exp_avg_[k].data();
      T* v = exp_avg_sq_[k].data();
      T* v_max = o.amsgrad ? max_exp_avg_sq_[k].data() : nullptr;
      const Index n = parameters_[k].value.size();
      for (Index i = 0; i < n; ++i) {
        T g = grad[i];
        if constexpr (kDecoupled) {
          if (decay) p[i] = p[i] * decay_factor;
        } else {
          if (decay) g = g + weight_decay * p[i];
        }
        m[i] = m[i] * beta1 + one_minus_beta1 * g;
        v[i] = v[i] * beta2 + one_minus_beta2 * g * g;
        T second = v[i];
        if (o.amsgrad) {
          // torch.maximum propagates NaN; std::max would drop it.
          if (std::isnan(v[i]) || v[i] > v_max[i]) v_max[i] = v[i];
          second = v_max[i];
        }
        const T denom = std::sqrt(second) / bias_correction2_sqrt + eps;
        p[i] = p[i] + (-step_size) * (m[i] / denom);
      }
    }
  }

  // Sets every gradient to 0 (see Sgd::zero_grad).
  void zero_grad() {
    for (auto& parameter : parameters_) parameter.grad.matrix().setZero();
  }

  // For learning-rate schedules, as assigning param_groups[0]["lr"] in torch.
  void set_lr(double lr) {
    Options changed = options_;
    changed.lr = lr;
    check_options(changed);
    options_ = changed;
  }

  const Options& options() const { return options_; }
  const ParameterList<T>& parameters() const { return parameters_; }
  Index steps() const { return steps_; }

 private:
  static void check_options(const Options& o) {
    const std::string type = kDecoupled ? "AdamWOptions." : "AdamOptions.";
    check_option(o.lr >= 0.0, type + "lr", ">= 0", o.lr);
    check_option(o.eps >= 0.0, type + "eps", ">= 0", o.eps);
    check_option(o.beta1 >= 0.0 && o.beta1 < 1.0, type + "beta1", "in [0, 1)", o.beta1);
    check_option(o.beta2 >= 0.0 && o.beta2 < 1.0, type + "beta2", "in [0, 1)", o.beta2);
    check_option(o.weight_decay >= 0.0, type + "weight_decay", ">= 0", o.weight_decay);
  }

  ParameterList<T> parameters_;
  Options options_;
  std::vector<Vector<T>> exp_avg_;         // m, per parameter
  std::vector<Vector<T>> exp_avg_sq_;      // v
  std::vector<Vector<T>> max_exp_avg_sq_;  // v_max, only with amsgrad
  Index steps_ = 0;
};

}  // namespace detail

// torch.optim.Adam: weight decay is an L2 penalty added to the gradient, so it is rescaled by
// the adaptive denominator like the gradient itself. The update is given at detail::AdamImpl.
template <class T>
class Adam : public detail::AdamImpl<T, AdamOptions, false> {
 public:
  explicit Adam(ParameterList<T> parameters, const AdamOptions& options = {})
      : detail::AdamImpl<T, AdamOptions, false>(std::move(parameters), options) {}
};

// torch.optim.AdamW (Loshchilov & Hutter): weight decay shrinks the parameter directly,
// p = p * (1 - lr * weight_decay), before the Adam update, independent of the gradient's scale.
template <class T>
class AdamW : public detail::AdamImpl<T, AdamWOptions, true> {
 public:
  explicit AdamW(ParameterList<T> parameters, const AdamWOptions& options = {})
      : detail::AdamImpl<T, AdamWOptions, true>(std::move(parameters), options) {}
};

// torch.nn.utils.clip_grad_norm_: all gradients are measured together, as one vector,
//   total = (sum of |g|^norm_type over every element)^(1 / norm_type)   (max |g| for infinity)
//   g = g * max_norm / (total + 1e-6)   when that factor is below 1
// and total (before clipping) is returned.
//
// The norm is accumulated in double whatever T is, and scaled by the largest |g| first so that
// it neither overflows nor underflows for large norm_type (torch computes it in T without
// scaling; the two differ by rounding only, wherever torch's does not overflow). As in torch, a
// non-finite total is not an error unless error_if_nonfinite: the gradients are then scaled by
// max_norm / (inf + 1e-6) = 0 (or NaN), exactly as torch does. norm_type must be > 0 (infinity
// allowed): torch also takes 0 and -inf, which are not norms.
template <class T>
double clip_grad_norm(const ParameterList<T>& parameters, double max_norm, double norm_type = 2.0,
                      bool error_if_nonfinite = false) {
  detail::check_parameter_list(parameters);
  detail::check_option(norm_type > 0.0, "clip_grad_norm norm_type", "> 0 (or infinity)", norm_type);
  detail::check_option(max_norm >= 0.0, "clip_grad_norm max_norm", ">= 0", max_norm);

  // Pass 1: the largest |g|, and whether any element is NaN (max would skip it).
  double largest = 0.0;
  bool has_nan = false;
  for (const auto& parameter : parameters) {
    const T* g = parameter.grad.data();
    for (Index i = 0; i < parameter.grad.size(); ++i) {
      const double a = std::abs(static_cast<double>(g[i]));
      if (std::isnan(a)) has_nan = true;
      if (a > largest) largest = a;
    }
  }
  double total = largest;
  if (has_nan) {
    total = std::numeric_limits<double>::quiet_NaN();
  } else if (std::isfinite(norm_type) && largest > 0.0 && std::isfinite(largest)) {
    // Pass 2: sum of (|g| / largest)^p, every term in [0, 1].
    double sum = 0.0;
    for (const auto& parameter : parameters) {
      const T* g = parameter.grad.data();
      for (Index i = 0; i < parameter.grad.size(); ++i) {
        const double r = std::abs(static_cast<double>(g[i])) / largest;
        sum += norm_type == 2.0 ? r * r : (norm_type == 1.0 ? r : std::pow(r, norm_type));
      }
    }
    total = largest * (norm_type == 2.0 ? std::sqrt(sum) : std::pow(sum, 1.0 / norm_type));
  }

  if (error_if_nonfinite && !std::isfinite(total)) {
    std::string culprit;
    for (const auto& parameter : parameters) {
      const T* g = parameter.grad.data();
      for (Index i = 0; i < parameter.grad.size() && culprit.empty(); ++i) {
        if (!std::isfinite(g[i])) culprit = parameter.name;
      }
    }
    throw std::runtime_error(
        "clip_grad_norm: the total norm of order " + detail::format_option(norm_type) +
        " of the gradients is " + detail::format_option(total) + " (gradient of '" + culprit +
        "' is not finite), so they cannot be clipped; pass error_if_nonfinite = false to scale "
        "them by it anyway");
  }

  const double clip_coef = max_norm / (total + 1e-6);
  // Negated comparison: a NaN factor is applied too, as torch's clamp(max=1) keeps NaN.
  if (!(clip_coef >= 1.0)) {
    const T factor = static_cast<T>(clip_coef);
    for (const auto& parameter : parameters) {
      T* g = parameter.grad.data();
      for (Index i = 0; i < parameter.grad.size(); ++i) g[i] = g[i] * factor;
    }
  }
  return total;
}

}  // namespace mha
