// A projection's weight packed once, for layers whose weights no longer change (the frozen
// layer, mha/frozen.hpp): W [N, K] kept as op(rhs) = Wᵀ [K, N] in the packed GEMM's panels
// (packed_gemm.hpp), so that a call multiplies by it without packing it again.
//
// Why: at L = 128 the product with W_in is [128, 768] x [768, 2304], and packing the 6.75 MiB
// of W_in at every call took a tenth of the layer's time on a Zen 4 (bench/RESULTS.md,
// 2026-12-04 evening); ONNX Runtime packs its weights once, when its session is made.
//
// Rounding: the same as product_transposed's for float weights (gemm.hpp), element for element.
// The packed GEMM's sums do not depend on where rows or columns are cut (packed_gemm.hpp), and
// products of a few rows, which product_transposed computes as dot products, are left to it.
#pragma once

#include <algorithm>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/kernels/common.hpp"
#include "mha/kernels/gemm.hpp"
#include "mha/kernels/packed_gemm.hpp"

namespace mha::detail {

// Wᵀ [K, N] as slices of kKc rows, each as panels of kNr columns (multiply_packed_rhs's
// layout); empty where the packed GEMM does not run on this CPU.
struct PackedWeight {
  Index rows = 0;   // N, the outputs
  Index depth = 0;  // K, the inputs
  std::vector<float, Eigen::aligned_allocator<float>> panels;

  bool empty() const { return panels.empty(); }

  // weight [N, K], row-major as a layer stores it.
  static PackedWeight pack(const Eigen::Map<const Matrix<float>>& weight) {
    using S = PackedGemmShape;
    PackedWeight packed;
    packed.rows = weight.rows();
    packed.depth = weight.cols();
    if (!packed_gemm_available() || packed.rows == 0 || packed.depth == 0) return packed;
    const Index width = packed_width(packed.rows);
    packed.panels.resize(static_cast<std::size_t>(packed.depth * width));
    const PackedOperand transposed{weight.data(), 1, packed.depth};  // (k, n) at W[n, k]
    for (Index k0 = 0; k0 < packed.depth; k0 += S::kKc) {
      pack_rhs(transposed, k0, std::min(S::kKc, packed.depth - k0), 0, packed.rows,
               packed.panels.data() + k0 * width);
    }
    return packed;
  }
};

// Whether dst [rows, cols] = lhs · Wᵀ runs on the packed weight: not for the few rows that
// product_transposed computes as dot products (their arithmetic differs), nor where nothing
// was packed.
inline bool runs_prepacked(const PackedWeight& weight, Index rows) {
  return !weight.empty() && !few_rows_product(rows, weight.rows);
}

// dst [M, N] = lhs [M, K] · Wᵀ, W packed once (runs_prepacked must hold). The rows are cut into
// one slab of whole micro-tiles per thread: the panels are shared, and each thread packs only
// its own rows. (8 slabs of 18 rows at M = 128 gave one of two threads 72 rows, which cost what
// the packing saved: bench/RESULTS.md, 2026-12-04 evening.)
inline void multiply_prepacked(StridedMap<float> dst, const ConstStridedMap<float>& lhs,
                               const PackedWeight& weight) {
  using S = PackedGemmShape;
  const Index rows = dst.rows();
  const Index tiles = (rows + S::kMr - 1) / S::kMr;
  const Index slabs = std::max<Index>(1, std::min<Index>(max_threads(), tiles));
  [[maybe_unused]] const double work = static_cast<double>(rows) *
                                       static_cast<double>(weight.rows) *
                                       static_cast<double>(weight.depth);
  MHA_OMP_PRAGMA(
      omp parallel for schedule(static) if (max_threads() > 1 && work >= kMinParallelWork))
  for (Index slab = 0; slab < slabs; ++slab) {
    const Index first = tiles * slab / slabs * S::kMr;
    const Index count = std::min(rows, tiles * (slab + 1) / slabs * S::kMr) - first;
    if (count <= 0) continue;
    multiply_packed_rhs(count, weight.rows, weight.depth,
                        PackedOperand{lhs.data() + first * lhs.outerStride(), lhs.outerStride(), 1},
                        weight.panels.data(), 1.0F, false, dst.data() + first * dst.outerStride(),
                        dst.outerStride());
  }
}

}  // namespace mha::detail
