// fp16 products for mixed-precision training (Precision::fp16): both operands rounded to IEEE
// half precision (to nearest, ties to even; from 65520 on infinite, up to 2^-25 zero),
// the sums in fp32, as a GPU's fp16 tensor cores compute them. This CPU family has no fp16 dot
// product (AVX512-FP16 is absent), so the rounding is emulated: the operands are rounded into
// float copies and the fp32 GEMM multiplies those. It gives fp16's range and precision, which is
// what dynamic loss scaling (mha/loss_scaling.hpp) exists for, at fp32's speed, no faster.
//   projections   dst [M, N] = x [M, K] · Wᵀ,  W [N, K] as a layer stores it
//   backward      dst [M, N] = (or +=) op(lhs) · rhs, as matrix_product (gemm.hpp)
#pragma once

#include <algorithm>

#include "mha/kernels/common.hpp"
#include "mha/kernels/convert.hpp"
#include "mha/kernels/gemm.hpp"

namespace mha::detail {

// dst [rows, cols] = m rounded to half and back (exact: every half is a float); dst is resized.
inline void round_through_half(const ConstStridedMap<float>& m, Matrix<float>& dst) {
  constexpr Index kChunk = 256;
  dst.resize(m.rows(), m.cols());
  Eigen::half halves[kChunk];
  for (Index i = 0; i < m.rows(); ++i) {
    const float* row = m.data() + i * m.outerStride();
    float* out = dst.data() + i * dst.cols();
    for (Index c = 0; c < m.cols(); c += kChunk) {
      const Index count = std::min(kChunk, m.cols() - c);
      narrow(row + c, count, halves);
      widen(halves, count, out + c);
    }
  }
}

// A layer's fp16 projections in one call: its weight rounded (kept while the same weight is asked
// for again, forgotten at every call, since an optimiser changes weights in place), and the rows
// being projected.
struct Fp16Scratch {
  Matrix<float> weight, rows;
  const void* weight_of = nullptr;

  void forget() { weight_of = nullptr; }

  // dst = x · Wᵀ on the rounded operands, by the fp32 GEMM.
  void project(const StridedMap<float>& dst, const ConstStridedMap<float>& x,
               const Eigen::Map<const Matrix<float>>& w,
               std::vector<KernelScratch<float>>& scratch) {
    if (weight_of != w.data() || weight.rows() != w.rows() || weight.cols() != w.cols()) {
      round_through_half(const_strided(w), weight);
      weight_of = w.data();
    }
    round_through_half(x, rows);
    product_transposed<float>(
        dst, const_strided(rows),
        Eigen::Map<const Matrix<float>>(weight.data(), weight.rows(), weight.cols()),
        Accumulate::no, scratch);
  }
};

// The rounded operands of fp16_matrix_product; they grow to the largest call and stay.
struct Fp16ProductScratch {
  Matrix<float> lhs, rhs;
};

// dst = (or +=) op(lhs) · rhs on operands rounded to half, by the fp32 GEMM (see the top).
inline void fp16_matrix_product(const StridedMap<float>& dst, const ConstStridedMap<float>& lhs,
                                Operand lhs_op, const ConstStridedMap<float>& rhs,
                                Accumulate accumulate, Fp16ProductScratch& scratch) {
  round_through_half(lhs, scratch.lhs);
  round_through_half(rhs, scratch.rhs);
  matrix_product<float>(dst, const_strided(scratch.lhs), lhs_op, const_strided(scratch.rhs),
                        accumulate);
}

}  // namespace mha::detail
