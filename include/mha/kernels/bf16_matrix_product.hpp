// Training's products in bf16 with fp32 sums (bf16_gemm.hpp's arithmetic), for a float layer's
// backward under Precision::bf16, as matrix_product (gemm.hpp) computes them in fp32:
//   dst [M, N] = (or +=) op(lhs) · rhs,  op(lhs) [M, K],  rhs [K, N]
// an input's gradient grad_y · W (lhs as stored) and a weight's gradient grad_yᵀ · x (lhs
// transposed, its depth the tokens). Both operands are rounded at every call, since the weights
// and the gradients change at every step: rhs's columns into panels of pairs; lhs's rows, or for
// lhsᵀ its columns, into rows of pairs, the columns through the same panels, each 16 × 16 block
// of lanes then transposed in registers.
#pragma once

#include <algorithm>
#include <cstdint>

#include "mha/kernels/bf16_gemm.hpp"
#include "mha/kernels/bf16_projection.hpp"
#include "mha/kernels/common.hpp"
#include "mha/kernels/tile_product.hpp"

namespace mha::detail {

// The rounded operands of bf16_matrix_product; they grow to the largest call and stay.
struct Bf16ProductScratch {
  Bf16Lanes lhs_rows, lhs_panels, rhs_panels;
};

// dst [M, N] = (or +=) op(lhs) · rhs (see the top), in bf16 with fp32 sums; dst, lhs and rhs are
// row-major blocks. The threads round the operands together (lhs by blocks of rows or columns,
// rhs by panels), then each computes a range of dst's columns; results do not depend on the
// thread count. Only where bf16_dot_available().
inline void bf16_matrix_product(StridedMap<float> dst, const ConstStridedMap<float>& lhs,
                                Operand lhs_op, const ConstStridedMap<float>& rhs,
                                Accumulate accumulate, Bf16ProductScratch& scratch) {
  constexpr Index kMr = Bf16GemmShape::kMr, kNr = Bf16GemmShape::kNr;
  const bool transposed = lhs_op == Operand::transposed;
  const Index rows = dst.rows(), cols = dst.cols(), depth = rhs.rows();
  const Index pairs = bf16_pairs(depth), panels = bf16_panels(cols);
  const Index padded_rows = (rows + kMr - 1) / kMr * kMr;
  const auto grow = [](Bf16Lanes& lanes, Index size) {
    if (static_cast<Index>(lanes.size()) < size) lanes.resize(static_cast<std::size_t>(size));
  };
  grow(scratch.lhs_rows, padded_rows * pairs);
  grow(scratch.rhs_panels, panels * pairs * kNr);
  if (transposed) grow(scratch.lhs_panels, bf16_panels(rows) * pairs * kNr);
  std::uint32_t* const a = scratch.lhs_rows.data();
  std::uint32_t* const b = scratch.rhs_panels.data();
  std::uint32_t* const a_panels = scratch.lhs_panels.data();
  std::fill(a + rows * pairs, a + padded_rows * pairs, 0U);
  if (rows == 0 || cols == 0) return;
  if (depth == 0) {
    if (accumulate == Accumulate::no) dst.setZero();
    return;
  }
  [[maybe_unused]] const double work =
      static_cast<double>(rows) * static_cast<double>(cols) * static_cast<double>(depth);
  MHA_OMP_PRAGMA(omp parallel if (max_threads() > 1 && work >= kMinParallelWork)) {
    MHA_OMP_PRAGMA(omp for schedule(static) nowait)
    for (Index q = 0; q < panels; ++q) {
      pack_bf16_columns(rhs.data() + q * kNr, depth, std::min(kNr, cols - q * kNr),
                        rhs.outerStride(), b + q * pairs * kNr);
    }
    if (transposed) {
      // lhs [K, M]: its columns are A's rows.
      MHA_OMP_PRAGMA(omp for schedule(static))
      for (Index q = 0; q < bf16_panels(rows); ++q) {
        const Index count = std::min(kNr, rows - q * kNr);
        pack_bf16_columns(lhs.data() + q * kNr, depth, count, lhs.outerStride(),
                          a_panels + q * pairs * kNr);
        panels_to_rows(a_panels + q * pairs * kNr, count, pairs, a + q * kNr * pairs, pairs);
      }
    } else {
      MHA_OMP_PRAGMA(omp for schedule(static))
      for (Index i0 = 0; i0 < rows; i0 += kMr) {
        round_rows_bf16(lhs.data() + i0 * lhs.outerStride(), std::min(kMr, rows - i0), depth,
                        lhs.outerStride(), a + i0 * pairs, pairs);
      }
    }
    bf16_team_columns(rows, cols, pairs, a, pairs, b, pairs * kNr, accumulate == Accumulate::yes,
                      dst.data(), dst.outerStride());
  }
}

}  // namespace mha::detail
