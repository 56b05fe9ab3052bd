// Seedable parameter initialisation with PyTorch's formulas.
//
// The standard library's distributions are implementation-defined, so the same seed would give
// different weights under libstdc++ and libc++. Random draws here come from splitmix64 with
// fixed transforms instead: one seed gives the same parameters with every compiler.
// (Bit-equality with torch's own generator is not a goal: weights to match come from files.)
#pragma once

#include <cmath>
#include <cstdint>

#include "mha/tensor.hpp"

namespace mha {

class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next_u64() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) from the top 53 bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  double uniform(double low, double high) { return low + (high - low) * uniform(); }
  // Standard normal by Box-Muller; 1 - uniform() is in (0, 1], so log never sees 0.
  double normal() {
    const double radius = std::sqrt(-2.0 * std::log(1.0 - uniform()));
    return radius * std::cos(2.0 * 3.14159265358979323846 * uniform());
  }

 private:
  std::uint64_t state_;
};

// torch.nn.init.xavier_uniform_ for a [fan_out, fan_in] weight: U(-a, a), a = sqrt(6 / (in + out)).
template <class T>
void xavier_uniform(Tensor<T>& weight, Index fan_in, Index fan_out, Random& random) {
  const double bound = std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  for (Index i = 0; i < weight.size(); ++i) {
    weight.data()[i] = static_cast<T>(random.uniform(-bound, bound));
  }
}

// torch.nn.init.xavier_normal_: N(0, sqrt(2 / (in + out))).
template <class T>
void xavier_normal(Tensor<T>& weight, Index fan_in, Index fan_out, Random& random) {
  const double std_dev = std::sqrt(2.0 / static_cast<double>(fan_in + fan_out));
  for (Index i = 0; i < weight.size(); ++i) {
    weight.data()[i] = static_cast<T>(std_dev * random.normal());
  }
}

// nn.Linear's default weight init, kaiming_uniform_(a = sqrt(5)), which reduces to
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
template <class T>
void linear_default_uniform(Tensor<T>& weight, Index fan_in, Random& random) {
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  for (Index i = 0; i < weight.size(); ++i) {
    weight.data()[i] = static_cast<T>(random.uniform(-bound, bound));
  }
}

}  // namespace mha
