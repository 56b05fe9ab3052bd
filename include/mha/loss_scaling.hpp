// Dynamic loss scaling for fp16 mixed-precision training, with the rules of PyTorch's
// torch.amp.GradScaler (torch.cuda.amp.GradScaler in 1.13). fp16 holds magnitudes from 2^-24 to
// 65504: small gradients round to zero in its products unless the loss, and with it every
// gradient, is first multiplied by a large scale; a scale too large makes some overflow to
// infinity. The scaler keeps the scale near the largest that overflows nothing:
//   scale()   the factor to multiply the loss's gradient (the grad_output given to backward) by;
//   unscale() divides every parameter's gradient by it (by its reciprocal rounded to float, as
//             torch multiplies) and notes whether any is then inf or NaN (torch looks before the
//             division, so a gradient that a scale below 1 makes overflow would reach its
//             optimiser); call it before clipping;
//   step(o)   unscales if that has not been done since the last update(), then runs
//             o.step() only if every gradient was finite (a skipped step changes nothing);
//   update()  after an overflow, the scale times backoff_factor (0.5); after growth_interval
//             (2000) steps in a row without one, times growth_factor (2), unless that product is
//             not finite.
// The scale is a float, as torch's, starting at init_scale (65536). The parameters, their
// gradients and the optimiser's state stay in the layer's float: the master weights.
//
//   mha::GradScaler<float> scaler(layer.parameters());
//   options.precision = mha::Precision::fp16;
//   auto result = layer.forward_train(x, options, saved);
//   grad_output = d loss / d output, times scaler.scale();
//   layer.backward(saved, grad_output);
//   scaler.step(optimiser);   // skipped when a gradient overflowed
//   scaler.update();
//   optimiser.zero_grad();
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "mha/optim.hpp"
#include "mha/parameters.hpp"

namespace mha {

// torch.amp.GradScaler's arguments and defaults.
struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
};

template <class T>
class GradScaler {
 public:
  explicit GradScaler(ParameterList<T> parameters, const GradScalerOptions& options = {})
      : parameters_(std::move(parameters)), options_(options) {
    detail::check_optimizer_parameters(parameters_);
    const GradScalerOptions& o = options_;
    const auto largest = static_cast<double>(std::numeric_limits<float>::max());
    detail::check_option(o.init_scale > 0.0 && o.init_scale <= largest,
                         "GradScalerOptions.init_scale", "a positive finite float", o.init_scale);
    detail::check_option(o.growth_factor > 1.0 && o.growth_factor <= largest,
                         "GradScalerOptions.growth_factor", "> 1 and finite", o.growth_factor);
    detail::check_option(o.backoff_factor > 0.0 && o.backoff_factor < 1.0,
                         "GradScalerOptions.backoff_factor", "in (0, 1)", o.backoff_factor);
    detail::check_option(o.growth_interval > 0, "GradScalerOptions.growth_interval", "> 0",
                         static_cast<double>(o.growth_interval));
    scale_ = static_cast<float>(o.init_scale);
  }

  // The current scale: multiply the loss's gradient by it before backward.
  float scale() const { return scale_; }
  // Steps since the last overflow or growth (torch's _growth_tracker).
  std::int64_t growth_tracker() const { return growth_tracker_; }
  // Whether the last unscale() found an inf or NaN gradient.
  bool found_inf() const { return found_inf_; }

  // Divides every gradient by the scale, once between updates (torch refuses a second call too:
  // the gradients would be divided twice). Returns whether they are all finite.
  bool unscale() {
    if (unscaled_) {
      throw std::logic_error(
          "GradScaler::unscale: already called since the last update() (the gradients would be "
          "divided twice)");
    }
    // torch: inv_scale = scale.double().reciprocal().float(), then grad * inv_scale in T.
    const auto inverse = static_cast<T>(1.0 / static_cast<double>(scale_));
    bool finite = true;
    for (const auto& parameter : parameters_) {
      T* g = parameter.grad.data();
      for (Index i = 0; i < parameter.grad.size(); ++i) {
        g[i] = g[i] * inverse;
        finite = finite && std::isfinite(g[i]);
      }
    }
    unscaled_ = true;
    found_inf_ = !finite;
    return finite;
  }

  // Unscales (if unscale() has not been called since the last update) and steps `optimizer`
  // unless a gradient is inf or NaN. Returns whether it stepped.
  template <class Optimizer>
  bool step(Optimizer& optimizer) {
    if (!unscaled_) unscale();
    if (found_inf_) return false;
    optimizer.step();
    return true;
  }

  // The scale for the next step, from whether this one's gradients overflowed (see the top).
  // Without an unscale() since the last update there is nothing to judge: torch refuses that.
  void update() {
    if (!unscaled_) {
      throw std::logic_error(
          "GradScaler::update: no unscale() or step() since the last update(), so no gradients "
          "were checked");
    }
    if (found_inf_) {
      scale_ = static_cast<float>(static_cast<double>(scale_) * options_.backoff_factor);
      growth_tracker_ = 0;
    } else if (++growth_tracker_ == options_.growth_interval) {
      const auto grown = static_cast<float>(static_cast<double>(scale_) * options_.growth_factor);
      if (std::isfinite(grown)) scale_ = grown;
      growth_tracker_ = 0;
    }
    unscaled_ = false;
  }

 private:
  ParameterList<T> parameters_;
  GradScalerOptions options_;
  float scale_ = 65536.0F;
  std::int64_t growth_tracker_ = 0;
  bool unscaled_ = false;
  bool found_inf_ = false;
};

}  // namespace mha
