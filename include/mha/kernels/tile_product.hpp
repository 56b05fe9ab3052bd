// The products inside the attention kernels: one serial function, tile_product, on row-major
// blocks (StridedMap, made by strided()), for the scores of a tile (q kᵀ), its weighted values
// (P v) and the backward's gradients (dS k, dSᵀ q, Pᵀ dO, dO vᵀ), and the talking-heads mixes;
// and each slab of the layer's threaded products (gemm.hpp: projections, weight gradients).
//
// Why one function on blocks rather than Eigen expressions where each product is written: every
// combination of expression types (a block of a matrix, a block of a map, a transposed block, a
// scaled product) instantiates Eigen's product dispatch, its GEMV and coefficient-based paths
// and their packet code again, which is most of a kernel's compile time. With blocks, one
// instantiation per scalar type serves every kernel and the layer (compiled once in mha::compiled:
// src/products.cpp compiled in 19 s instead of 38 once the layer's slabs came here too). The
// arithmetic is Eigen's GEMM as before, and the same operands give the same result whichever
// kernel asks.
#pragma once

#include <type_traits>

#include "mha/compiled.hpp"
#include "mha/kernels/packed_gemm.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {

enum class Accumulate { no, yes };

// How an operand enters a product: as stored, or transposed.
enum class Operand { as_stored, transposed };

// A row-major dense block (a matrix, a map, a block of either) as the StridedMap the products
// take; const blocks give a ConstStridedMap.
template <class Dense>
auto strided(Dense&& block) {
  using Plain = std::decay_t<Dense>;
  static_assert(
      Plain::IsRowMajor || Plain::RowsAtCompileTime == 1,
      "strided() takes row-major blocks; pass the stored operand with Operand::transposed");
  using Scalar = typename Plain::Scalar;
  if constexpr (std::is_const_v<std::remove_pointer_t<decltype(block.data())>>) {
    return ConstStridedMap<Scalar>(block.data(), block.rows(), block.cols(),
                                   Eigen::OuterStride<>(block.outerStride()));
  } else {
    return StridedMap<Scalar>(block.data(), block.rows(), block.cols(),
                              Eigen::OuterStride<>(block.outerStride()));
  }
}
// The same, read-only.
template <class Dense>
ConstStridedMap<typename std::decay_t<Dense>::Scalar> const_strided(const Dense& block) {
  return {block.data(), block.rows(), block.cols(), Eigen::OuterStride<>(block.outerStride())};
}

// dst [M, N] = (or +=) alpha · op(lhs) · op(rhs), op(lhs) [M, K] and op(rhs) [K, N]. It opens no
// parallel region of its own: the kernels call it from inside theirs, where they wrote the same
// Eigen products before. alpha is Eigen's GEMM scale (alpha · (A B), not (alpha A) B); with
// alpha = 1 the result is the unscaled product's, bit for bit.
template <class T>
void tile_product(StridedMap<T> dst, ConstStridedMap<T> lhs, Operand lhs_op, ConstStridedMap<T> rhs,
                  Operand rhs_op, Accumulate accumulate, T alpha = T(1)) {
  const auto product = [&](const auto& left, const auto& right) {
    if (accumulate == Accumulate::yes) {
      dst.noalias() += alpha * (left * right);
    } else {
      dst.noalias() = alpha * (left * right);
    }
  };
  const bool left_t = lhs_op == Operand::transposed, right_t = rhs_op == Operand::transposed;
  if constexpr (std::is_same_v<T, float>) {
    // The library's own GEMM where the CPU runs it (packed_gemm.hpp); one row (a query of a
    // decoding step) is Eigen's matrix-vector product, which reads rhs once without packing it.
    if (dst.rows() > 1 && packed_gemm_available()) {
      const PackedOperand a = left_t ? PackedOperand{lhs.data(), 1, lhs.outerStride()}
                                     : PackedOperand{lhs.data(), lhs.outerStride(), 1};
      const PackedOperand b = right_t ? PackedOperand{rhs.data(), 1, rhs.outerStride()}
                                      : PackedOperand{rhs.data(), rhs.outerStride(), 1};
      packed_gemm(dst.rows(), dst.cols(), left_t ? lhs.rows() : lhs.cols(), a, b, alpha,
                  accumulate == Accumulate::yes, dst.data(), dst.outerStride());
      return;
    }
  }
  if (!left_t && !right_t) return product(lhs, rhs);
  if (!left_t) return product(lhs, rhs.transpose());
  if (!right_t) return product(lhs.transpose(), rhs);
  product(lhs.transpose(), rhs.transpose());
}

// The instantiations mha::compiled holds (src/products.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_TILE_PRODUCT_TEMPLATES(PREFIX, T)                                      \
  PREFIX template void tile_product<T>(StridedMap<T>, ConstStridedMap<T>, Operand, \
                                       ConstStridedMap<T>, Operand, Accumulate, T);
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_COMPUTE_TYPES, MHA_TILE_PRODUCT_TEMPLATES)

}  // namespace mha::detail
