// Shared test helpers: random tensors, and a comparison that checks the shape first, then the
// values, and reports the worst element's index and the largest difference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "mha/mha.hpp"

// The tests of results across thread counts are compiled where the kernels run on OpenMP's
// threads (#ifdef _OPENMP); a build whose library has OpenMP must compile them.
#if defined(MHA_TEST_OPENMP) && MHA_TEST_OPENMP && !defined(_OPENMP)
#error \
    "mha was built with OpenMP but this test is compiled without it: its thread tests would vanish"
#endif

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

// |actual - expected| <= atol_at(i) + rtol * |expected| for every flat index i.
template <class T, class U, class Atol>
Comparison compare_elements(mha::TensorView<const T> actual, mha::TensorView<const U> expected,
                            double rtol, Atol&& atol_at) {
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
    const double allowed = atol_at(i) + rtol * std::abs(e);
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
        << ", atol " << atol_at(worst) << " there); worst at "
        << flat_index_to_string(worst, actual.shape()) << ": got " << actual.data()[worst]
        << ", expected " << expected.data()[worst] << ", difference " << worst_diff;
  }
  result.ok = failures == 0;
  result.message = out.str();
  return result;
}

template <class T, class U>
Comparison compare(mha::TensorView<const T> actual, mha::TensorView<const U> expected,
                   double rtol = Tolerance<T>::rtol, double atol = Tolerance<T>::atol) {
  return compare_elements(actual, expected, rtol, [atol](Index) { return atol; });
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
// row_blocks, when given, splits the first dimension into consecutive blocks of those many rows,
// each measured against its own largest element: a packed parameter (in_proj_weight's W_q, W_k
// and W_v, see gradient_row_blocks) holds gradients of different scales (up to 10 times apart
// in the reference fixtures, W_v's the largest), and the largest one's would let the others be
// that much more wrong.
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
                             double rtol = GradientTolerance<T>::rtol,
                             const std::vector<Index>& row_blocks = {}) {
  const Index rows = expected.shape().empty() ? 1 : expected.shape()[0];
  const Index per_row = rows > 0 ? expected.size() / rows : 0;
  std::vector<Index> blocks = row_blocks.empty() ? std::vector<Index>{rows} : row_blocks;
  Index covered = 0;
  for (const Index block : blocks) covered += block;
  if (covered != rows) {
    return {false,
            "row blocks cover " + std::to_string(covered) + " rows of " + std::to_string(rows)};
  }
  // The first flat index past each block, and each block's absolute tolerance.
  std::vector<Index> ends;
  std::vector<double> atols;
  Index begin = 0;
  for (const Index block : blocks) {
    const Index end = begin + block * per_row;
    double scale = 0.0;
    for (Index i = begin; i < end; ++i) {
      scale = std::max(scale, std::abs(static_cast<double>(expected.data()[i])));
    }
    ends.push_back(end);
    atols.push_back(rtol * scale);
    begin = end;
  }
  return compare_elements(actual, expected, rtol, [&](Index i) {
    return atols[static_cast<std::size_t>(std::upper_bound(ends.begin(), ends.end(), i) -
                                          ends.begin())];
  });
}

template <class T, class U>
Comparison compare_gradients(const mha::Tensor<T>& actual, const mha::Tensor<U>& expected,
                             double rtol = GradientTolerance<T>::rtol,
                             const std::vector<Index>& row_blocks = {}) {
  return compare_gradients<T, U>(actual.view(), expected.view(), rtol, row_blocks);
}

// The blocks of rows to compare a parameter's gradient in (compare_gradients): in_proj_weight
// [E + 2·kv_dim, E] packs W_q, W_k and W_v; other parameters are one block. (Not in_proj_bias:
// its b_k part is zero in exact arithmetic unless bias_k or zero attention adds keys without
// b_k, since adding q·b_k to every score of a row leaves the softmax unchanged; what torch and
// the library give there is the rounding of a cancelling sum whose terms are of the size of the
// other parts.) rows is the parameter's first dimension, embed_dim E.
inline std::vector<Index> gradient_row_blocks(const std::string& name, Index rows,
                                              Index embed_dim) {
  if (name != "in_proj_weight" || rows <= embed_dim || (rows - embed_dim) % 2 != 0) return {};
  const Index kv_dim = (rows - embed_dim) / 2;
  return {embed_dim, kv_dim, kv_dim};
}

// A float result of the library against the same inputs computed in double, the truth for the
// library's own rounding (library against library: both sides are ours, so torch's rounding,
// which Tolerance<float> absorbs, is not in it). Two bounds relative to a scale, by default the
// exact tensor's: each element within max_of_scale of its largest magnitude, and the
// root-mean-square error within rms_of_scale of its root mean square. The RMS bound is the sharp
// one: a kernel that rounds a little worse everywhere (an exp with a term dropped) multiplies it,
// where the largest element's error is set by a few long sums whatever the kernel. The bounds
// come from measurement where they are used (tests/test_flash.cpp).
struct RoundingTolerance {
  double max_of_scale;
  double rms_of_scale;
};

// A tensor's largest magnitude and root mean square.
struct RoundingScale {
  double largest = 0.0;
  double rms = 0.0;
};

inline RoundingScale rounding_scale(mha::TensorView<const double> exact) {
  RoundingScale scale;
  double squares = 0.0;
  for (Index i = 0; i < exact.size(); ++i) {
    scale.largest = std::max(scale.largest, std::abs(exact.data()[i]));
    squares += exact.data()[i] * exact.data()[i];
  }
  scale.rms = exact.size() > 0 ? std::sqrt(squares / static_cast<double>(exact.size())) : 0.0;
  return scale;
}

template <class T>
Comparison compare_rounding(mha::TensorView<const T> actual, mha::TensorView<const double> exact,
                            RoundingTolerance tolerance, RoundingScale scale) {
  static_assert(std::is_same_v<T, float>, "the rounding of float results, against double");
  Comparison result =
      compare<T, double>(actual, exact, 0.0, tolerance.max_of_scale * scale.largest);
  if (!result.ok) return result;
  double squares = 0.0;
  for (Index i = 0; i < exact.size(); ++i) {
    const double error = static_cast<double>(actual.data()[i]) - exact.data()[i];
    squares += error * error;
  }
  const double rms = exact.size() > 0 ? std::sqrt(squares / static_cast<double>(exact.size())) : 0;
  if (!(rms <= tolerance.rms_of_scale * scale.rms)) {
    std::ostringstream out;
    out.precision(4);
    out << "root-mean-square error " << rms << " is " << rms / scale.rms
        << " of the scale's root mean square " << scale.rms << ", allowed "
        << tolerance.rms_of_scale;
    result = {false, out.str()};
  }
  return result;
}

template <class T>
Comparison compare_rounding(const mha::Tensor<T>& actual, const mha::Tensor<double>& exact,
                            RoundingTolerance tolerance) {
  return compare_rounding<T>(actual.view(), exact.view(), tolerance, rounding_scale(exact.view()));
}

template <class T>
Comparison compare_rounding(const mha::Tensor<T>& actual, const mha::Tensor<double>& exact,
                            RoundingTolerance tolerance, RoundingScale scale) {
  return compare_rounding<T>(actual.view(), exact.view(), tolerance, scale);
}

// max |actual - expected| / max |expected|: how far a reduced-precision result (16-bit storage,
// bf16 arithmetic, int8 weights) is from float64, at the scale of the result (elementwise
// relative error is meaningless for outputs near 0).
template <class T>
double error_of_largest(const mha::Tensor<T>& actual, const mha::Tensor<double>& expected) {
  REQUIRE(actual.shape() == expected.shape());
  const mha::Tensor<double> widened = mha::tensor_cast<double>(actual);
  REQUIRE(widened.flat().allFinite());
  const double scale = expected.flat().cwiseAbs().maxCoeff();
  REQUIRE(scale > 0);
  return (widened.flat() - expected.flat()).cwiseAbs().maxCoeff() / scale;
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

// The central differences (loss(at + step e_i) - loss(at - step e_i)) / (2 step) for each element
// i of `at`, which is restored after each: the numeric gradient that analytic ones are checked
// against. A step of 1e-5 in double leaves rounding noise of ~1e-16 |loss| / step and a
// truncation error of ~step².
template <class Loss>
mha::Tensor<double> central_differences(mha::Tensor<double>& at, const Loss& loss,
                                        double step = 1e-5) {
  mha::Tensor<double> result(at.shape());
  for (Index i = 0; i < at.size(); ++i) {
    double& element = at.data()[i];
    const double kept = element;
    element = kept + step;
    const double up = loss();
    element = kept - step;
    const double down = loss();
    element = kept;
    result.data()[i] = (up - down) / (2 * step);
  }
  return result;
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The layer with the same parameters in another scalar type (a float64 reference of a float or
// 16-bit layer, or the reverse).
template <class To, class From>
mha::MultiHeadAttention<To> converted(const mha::MultiHeadAttention<From>& layer) {
  mha::MultiHeadAttention<To> result(layer.config());
  for (const auto& entry : layer.state_dict()) {
    result.set_parameter(entry.first, mha::tensor_cast<To>(entry.second).view());
  }
  return result;
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

// CHECK a float tensor's rounding against the same computation in double (compare_rounding;
// the scale, when given, is a RoundingScale).
#define CHECK_ROUNDING(actual, exact, ...)                                                  \
  do {                                                                                      \
    const auto mha_comparison = mha_test::compare_rounding((actual), (exact), __VA_ARGS__); \
    INFO(mha_comparison.message);                                                           \
    CHECK(mha_comparison.ok);                                                               \
  } while (false)

#define CHECK_GRADIENTS_CLOSE(actual, expected)                                    \
  do {                                                                             \
    const auto mha_comparison = mha_test::compare_gradients((actual), (expected)); \
    INFO(mha_comparison.message);                                                  \
    CHECK(mha_comparison.ok);                                                      \
  } while (false)

// A parameter's gradient, in_proj_weight's packed blocks apart (gradient_row_blocks).
#define CHECK_PARAMETER_GRADIENTS_CLOSE(name, actual, expected, embed_dim, rtol)               \
  do {                                                                                         \
    const auto& mha_expected = (expected);                                                     \
    const auto mha_comparison = mha_test::compare_gradients(                                   \
        (actual), mha_expected, (rtol),                                                        \
        mha_test::gradient_row_blocks(                                                         \
            (name), mha_expected.shape().empty() ? 1 : mha_expected.shape()[0], (embed_dim))); \
    INFO(mha_comparison.message);                                                              \
    CHECK(mha_comparison.ok);                                                                  \
  } while (false)

#define CHECK_GRADIENTS_CLOSE_TOL(actual, expected, rtol)                                  \
  do {                                                                                     \
    const auto mha_comparison = mha_test::compare_gradients((actual), (expected), (rtol)); \
    INFO(mha_comparison.message);                                                          \
    CHECK(mha_comparison.ok);                                                              \
  } while (false)
