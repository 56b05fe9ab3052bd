// NaN and Inf: the exception for values that must be finite, and the checks that throw it. Used
// by the training diagnostics and by ForwardOptions::check_inputs.
#pragma once

#include <Eigen/Core>
#include <sstream>
#include <stdexcept>
#include <string>

#include "mha/errors.hpp"
#include "mha/tensor.hpp"

namespace mha {

// A NaN or Inf where finite numbers are required; a std::domain_error, since the shapes are fine
// and the values are not.
class NonFiniteError : public std::domain_error {
 public:
  explicit NonFiniteError(const std::string& what) : std::domain_error(what) {}
};

namespace detail {

// The multi-index of a row-major flat index, for messages.
inline Shape unravel_index(Index flat, const Shape& shape) {
  Shape index(shape.size(), 0);
  for (std::size_t a = shape.size(); a-- > 0;) {
    if (shape[a] == 0) continue;
    index[a] = flat % shape[a];
    flat /= shape[a];
  }
  return index;
}

// The first element of x for which bad(element) holds, or -1; then throws NonFiniteError
// "name: <what> <value> at [i, j] (n of size elements)".
template <class T, class Bad>
void throw_first(TensorView<const T> x, const std::string& name, const char* what, Bad bad) {
  Index first = -1, count = 0;
  for (Index i = 0; i < x.size(); ++i) {
    if (!bad(x.data()[i])) continue;
    if (first < 0) first = i;
    ++count;
  }
  if (first < 0) return;
  std::ostringstream message;
  message << name << ": " << what << ' ' << static_cast<double>(x.data()[first]) << " at "
          << format_shape(unravel_index(first, x.shape())) << " (" << count << " of " << x.size()
          << " elements)";
  throw NonFiniteError(message.str());
}

}  // namespace detail

// True when no element is NaN or ±Inf.
template <class T>
bool all_finite(TensorView<const T> x) {
  return Eigen::Map<const Vector<T>>(x.data(), x.size()).allFinite();
}

// Throws NonFiniteError naming the tensor, the first NaN/Inf's index and value, and how many
// there are, e.g. "in_proj_weight.grad: non-finite value nan at [3, 1] (2 of 24 elements)".
template <class T>
void check_finite(TensorView<const T> x, const std::string& name) {
  if (all_finite(x)) return;
  detail::throw_first(x, name, "non-finite value",
                      [](T value) { return !Eigen::numext::isfinite(value); });
}

// An additive mask may block with -inf; NaN and +inf have no meaning there (+inf would make the
// softmax inf / inf). Throws NonFiniteError naming the mask otherwise.
template <class T>
void check_additive_mask(TensorView<const T> mask, const std::string& name) {
  detail::throw_first(mask, name, "expected finite values or -inf, got", [](T value) {
    return Eigen::numext::isnan(value) || value == Eigen::NumTraits<T>::infinity();
  });
}

// Overloads for owning tensors and mutable views: T is not deduced through their conversion to
// TensorView<const T>.
template <class T>
bool all_finite(TensorView<T> x) {
  return all_finite(TensorView<const T>(x));
}
template <class T>
bool all_finite(const Tensor<T>& x) {
  return all_finite(x.view());
}
template <class T>
void check_finite(TensorView<T> x, const std::string& name) {
  check_finite(TensorView<const T>(x), name);
}
template <class T>
void check_finite(const Tensor<T>& x, const std::string& name) {
  check_finite(x.view(), name);
}

}  // namespace mha
