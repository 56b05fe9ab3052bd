// Shared test helpers: random tensors, and a comparison that checks the shape first, then the
// values, and reports the worst element's index and the largest difference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <sstream>
#include <string>

#include "catch.hpp"
#include "mha/mha.hpp"

namespace mha_test {

using mha::Index;
using mha::Shape;

// Tolerances per scalar type: |actual - expected| <= atol + rtol * |expected|.
template <class T>
struct Tolerance;
// float: torch.testing.assert_close's defaults for float32. Fixtures hold torch's float32
// results, rounding included: on one random case torch was 2.2e-6 from the exact value where this
// library was 3.3e-7 (tests/reference/check_mha_run.py, seed 2026), so an atol of 1e-6 would
// measure torch's rounding. double: far tighter than torch's 1e-7, as both sides are exact to
// ~1e-15.
template <>
struct Tolerance<float> {
  static constexpr double rtol = 1.3e-6;
  static constexpr double atol = 1e-5;
};
template <>
struct Tolerance<double> {
  static constexpr double rtol = 1e-11;
  static constexpr double atol = 1e-12;
};

template <class T>
mha::Tensor<T> random_tensor(const Shape& shape, std::uint64_t seed, double scale = 1.0) {
  mha::Random random(seed);
  mha::Tensor<T> tensor(shape);
  for (Index i = 0; i < tensor.size(); ++i) {
    tensor.data()[i] = static_cast<T>(scale * random.normal());
  }
  return tensor;
}

// Random parameters for a layer, biases included (PyTorch initialises them to 0, which would
// hide them): normal(0, 0.5), one seed per parameter in PyTorch's order from `seed` on.
template <class T>
void randomise(mha::MultiHeadAttention<T>& layer, std::uint64_t seed) {
  for (const auto& name : layer.parameter_names()) {
    const auto view = layer.parameter(name);
    layer.set_parameter(name, random_tensor<T>(view.shape(), seed++, 0.5));
  }
}

inline std::string flat_index_to_string(Index flat, const Shape& shape) {
  Shape index(shape.size());
  for (std::size_t a = shape.size(); a-- > 0;) {
    index[a] = shape[a] == 0 ? 0 : flat % shape[a];
    flat = shape[a] == 0 ? 0 : flat / shape[a];
  }
  return mha::detail::format_shape(index);
}

struct Comparison {
  bool ok = true;
  std::string message;
};

template <class T, class U>
Comparison compare(mha::TensorView<const T> actual, mha::TensorView<const U> expected,
                   double rtol = Tolerance<T>::rtol, double atol = Tolerance<T>::atol) {
  Comparison result;
  if (actual.shape() != expected.shape()) {
    result.ok = false;
    result.message = "shape " + mha::detail::format_shape(actual.shape()) + " != expected " +
                     mha::detail::format_shape(expected.shape());
    return result;
  }
  double worst_excess = -1.0, worst_diff = 0.0;
  Index worst = -1;
  Index failures = 0;
  for (Index i = 0; i < actual.size(); ++i) {
    const double a = static_cast<double>(actual.data()[i]);
    const double e = static_cast<double>(expected.data()[i]);
    const double diff = std::abs(a - e);
    const double allowed = atol + rtol * std::abs(e);
    const bool bad = !(diff <= allowed) || std::isnan(a) != std::isnan(e);
    if (bad) ++failures;
    const double excess = std::isnan(diff) ? 1e300 : diff - allowed;
    if (excess > worst_excess || worst < 0) {
      worst_excess = excess;
      worst = i;
      worst_diff = diff;
    }
  }
  std::ostringstream out;
  out.precision(10);
  if (worst >= 0) {
    out << failures << " of " << actual.size() << " elements out of tolerance (rtol " << rtol
        << ", atol " << atol << "); worst at " << flat_index_to_string(worst, actual.shape())
        << ": got " << actual.data()[worst] << ", expected " << expected.data()[worst]
        << ", difference " << worst_diff;
  }
  result.ok = failures == 0;
  result.message = out.str();
  return result;
}

template <class T, class U>
Comparison compare(const mha::Tensor<T>& actual, const mha::Tensor<U>& expected,
                   double rtol = Tolerance<T>::rtol, double atol = Tolerance<T>::atol) {
  return compare<T, U>(actual.view(), expected.view(), rtol, atol);
}

// Gradients: |actual - expected| <= rtol * (max|expected| over the tensor + |expected|), rtol
// 1e-5 in float and 1e-10 in double (the training issue's bounds). Measured against the tensor's
// scale because a gradient element is a sum over batch, rows and keys whose terms often cancel:
// its rounding is of the size of the terms, not of the (possibly tiny) element.
template <class T>
struct GradientTolerance;
template <>
struct GradientTolerance<float> {
  static constexpr double rtol = 1e-5;
};
template <>
struct GradientTolerance<double> {
  static constexpr double rtol = 1e-10;
};

template <class T, class U>
Comparison compare_gradients(mha::TensorView<const T> actual, mha::TensorView<const U> expected,
                             double rtol = GradientTolerance<T>::rtol) {
  double scale = 0.0;
  for (Index i = 0; i < expected.size(); ++i) {
    scale = std::max(scale, std::abs(static_cast<double>(expected.data()[i])));
  }
  return compare<T, U>(actual, expected, rtol, rtol * scale);
}

template <class T, class U>
Comparison compare_gradients(const mha::Tensor<T>& actual, const mha::Tensor<U>& expected,
                             double rtol = GradientTolerance<T>::rtol) {
  return compare_gradients<T, U>(actual.view(), expected.view(), rtol);
}

// The message of the Exception that f throws, or "(nothing thrown)": for checks on a part of a
// message with the macros common to Catch2 v2 and v3.
template <class Exception, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const Exception& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace mha_test

// CHECK that two tensors agree, printing the shape mismatch or the worst element.
#define CHECK_TENSORS_CLOSE(actual, expected)                            \
  do {                                                                   \
    const auto mha_comparison = mha_test::compare((actual), (expected)); \
    INFO(mha_comparison.message);                                        \
    CHECK(mha_comparison.ok);                                            \
  } while (false)

#define CHECK_TENSORS_CLOSE_TOL(actual, expected, rtol, atol)                            \
  do {                                                                                   \
    const auto mha_comparison = mha_test::compare((actual), (expected), (rtol), (atol)); \
    INFO(mha_comparison.message);                                                        \
    CHECK(mha_comparison.ok);                                                            \
  } while (false)

#define CHECK_GRADIENTS_CLOSE(actual, expected)                                    \
  do {                                                                             \
    const auto mha_comparison = mha_test::compare_gradients((actual), (expected)); \
    INFO(mha_comparison.message);                                                  \
    CHECK(mha_comparison.ok);                                                      \
  } while (false)

#define CHECK_GRADIENTS_CLOSE_TOL(actual, expected, rtol)                                  \
  do {                                                                                     \
    const auto mha_comparison = mha_test::compare_gradients((actual), (expected), (rtol)); \
    INFO(mha_comparison.message);                                                          \
    CHECK(mha_comparison.ok);                                                              \
  } while (false)
