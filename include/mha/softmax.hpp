// Numerically stable softmax over the last axis (the keys) of a row-major score matrix.
//
// Each row has its maximum subtracted before exp, so no exp overflows whatever the scale of
// the scores, and adding a constant to a row does not change its result.
// A row whose every entry is -inf (every key blocked) becomes all zeros, not NaN: the
// convention of SDPA (PyTorch 2.5+), FlashAttention and ggml, and of this library.
#pragma once

#include <cmath>
#include <limits>

#include "mha/tensor.hpp"

namespace mha {

namespace detail {

// row <- exp(row - row_max), exactly 0 where row is -inf (a blocked key); returns the new sum.
// The exp is Eigen's vectorised one. It clamps its argument, so exp(-inf) comes out ~1e-39,
// not 0: blocked entries are zeroed afterwards by a select, which Eigen 3.4 does not
// vectorise but which costs a compare where a scalar exp would cost ~20 cycles. `scratch`
// must hold at least row.size() elements.
template <class Row, class T>
T exp_shifted_inplace(Row&& row, T row_max, RowVector<T>& scratch) {
  auto exps = scratch.head(row.size());
  exps.array() = (row.array() - row_max).exp();
  if (row.minCoeff() == -std::numeric_limits<T>::infinity()) {
    exps = (row.array() == -std::numeric_limits<T>::infinity()).select(T(0), exps.array()).matrix();
  }
  row = exps;
  return exps.sum();
}

}  // namespace detail

// scores is [rows, cols], softmax taken along each row, in place. Accepts any writable Eigen
// expression (a matrix, a block, a strided map). scratch holds at least cols elements.
template <class Derived>
void softmax_rows_inplace(const Eigen::MatrixBase<Derived>& scores_expression,
                          RowVector<typename Derived::Scalar>& scratch) {
  using T = typename Derived::Scalar;
  // Eigen's documented idiom for writing through an expression passed by const reference.
  auto& scores = const_cast<Eigen::MatrixBase<Derived>&>(scores_expression);
  if (scores.cols() == 0) return;
  if (scratch.size() < scores.cols()) scratch.resize(scores.cols());
  for (Index r = 0; r < scores.rows(); ++r) {
    auto row = scores.row(r);
    const T row_max = row.maxCoeff();
    if (row_max == -std::numeric_limits<T>::infinity()) {
      // Every key blocked gives 0; but Eigen's maximum may skip a NaN, and a row of NaN and -inf
      // scores must give NaN, not read as fully blocked.
      row.setConstant(row.hasNaN() ? std::numeric_limits<T>::quiet_NaN() : T(0));
      continue;
    }
    // The maximum entry contributed exp(0) = 1, so the sum is at least 1: no division by zero.
    row /= detail::exp_shifted_inplace(row, row_max, scratch);
  }
}

template <class Derived>
void softmax_rows_inplace(const Eigen::MatrixBase<Derived>& scores) {
  RowVector<typename Derived::Scalar> scratch(scores.cols());
  softmax_rows_inplace(scores, scratch);
}

// Returns the row softmax of scores [rows, cols].
template <class Derived>
Matrix<typename Derived::Scalar> softmax_rows(const Eigen::MatrixBase<Derived>& scores) {
  Matrix<typename Derived::Scalar> result = scores;
  softmax_rows_inplace(result);
  return result;
}

}  // namespace mha
