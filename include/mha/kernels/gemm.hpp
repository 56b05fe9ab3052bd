// The layer's large products (projections and weight gradients), threaded so that their results
// do not depend on the number of threads.
//
// Why not Eigen's own OpenMP GEMM: it chooses its depth blocking (kc) from the number of threads,
// and so the order in which each element's sum is accumulated, and the rounding, change with the
// thread count (measured: outputs differing by 1e-7 between 1 and 2 threads at E = 512). Here the
// result is cut into at most 8 slabs (16 in packed_column_slabs) of rows or of columns (whichever
// dimension is larger), by a rule that looks only at the shape, and each slab is one serial Eigen
// product (inside a parallel region Eigen never threads), taken by whichever thread is free first.
// Each element is then computed by the same arithmetic whatever the thread count and whichever
// thread computes it. (The slabs must not depend on the thread count: Eigen's cache blocking and
// its edge paths depend on a product's shape, and they decide the order of each element's sum.)
// Splitting the larger dimension keeps the smaller operand, packed once per slab, the one that is
// re-read; up to 8 slabs keep 2, 4 or 8 threads busy.
//
// A product with at most 16 rows whose right operand has contiguous columns (x Wᵀ for a few
// tokens, as a decoding step projects them) is computed as dot products instead, in slabs of 64
// columns: GEMM would pack the whole weight matrix for a few rows of output. Measured on a
// [8, 2048] x [2048, 2048] product: 0.40 ms against 0.81 ms, and 0.12 against 0.93 ms for 2 rows
// (with Eigen's dot products; dot_products' register blocks then made decoding steps of 8
// sequences 1.7-1.9x faster, bench/RESULTS.md 2026-12-02).
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/kernels/common.hpp"
#include "mha/kernels/convert.hpp"
#include "mha/kernels/tile_product.hpp"

namespace mha::detail {

// dst [M, N] = (or +=) lhs [M, K] · rowsᵀ, rows [N, K]: for a few rows of lhs, as dot products of
// contiguous rows rather than a GEMM that packs all of rows. Four rows of `rows` against two of
// lhs at a time (eight sums in registers, four rows' packets loaded once for both): each row of
// `rows` is read from memory once, and the four (32 KiB at K = 2048) stay in L1 or L2 while all
// of lhs passes over them. (Eigen's coefficient-based product formed each dot product alone,
// which re-read a slab's 64 weight rows from L2 or L3 for every row of lhs.)
template <class T>
void dot_products(StridedMap<T> dst, ConstStridedMap<T> lhs, ConstStridedMap<T> rows,
                  Accumulate accumulate) {
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::predux;
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  constexpr Index lanes = Eigen::internal::packet_traits<T>::size;
  constexpr Index kRows = 4, kLhsRows = 2;
  const Index depth = lhs.cols(), vector_depth = depth / lanes * lanes;
  const Index m = dst.rows(), n = dst.cols();
  const auto store = [&](Index i, Index j, T sum) {
    dst(i, j) = accumulate == Accumulate::yes ? dst(i, j) + sum : sum;
  };
  // sums[a][b] = lhs row i + a · rows row j + b, for a < count_i, b < count_j.
  const auto block = [&](Index i, Index count_i, Index j, Index count_j) {
    Packet acc[kLhsRows][kRows];
    const T* w[kRows] = {};
    const T* x[kLhsRows] = {};
    MHA_UNROLL
    for (Index b = 0; b < kRows; ++b) {
      w[b] = rows.data() + (j + std::min(b, count_j - 1)) * rows.outerStride();
    }
    MHA_UNROLL
    for (Index a = 0; a < kLhsRows; ++a) {
      x[a] = lhs.data() + (i + std::min(a, count_i - 1)) * lhs.outerStride();
      MHA_UNROLL
      for (Index b = 0; b < kRows; ++b) acc[a][b] = Eigen::internal::pzero(Packet{});
    }
    for (Index k = 0; k < vector_depth; k += lanes) {
      Packet wk[kRows];
      MHA_UNROLL
      for (Index b = 0; b < kRows; ++b) wk[b] = ploadu<Packet>(w[b] + k);
      MHA_UNROLL
      for (Index a = 0; a < kLhsRows; ++a) {
        const Packet xk = ploadu<Packet>(x[a] + k);
        MHA_UNROLL
        for (Index b = 0; b < kRows; ++b) acc[a][b] = pmadd(xk, wk[b], acc[a][b]);
      }
    }
    for (Index a = 0; a < count_i; ++a) {
      for (Index b = 0; b < count_j; ++b) {
        T sum = predux(acc[a][b]);
        for (Index k = vector_depth; k < depth; ++k) sum += x[a][k] * w[b][k];
        store(i + a, j + b, sum);
      }
    }
  };
  for (Index j = 0; j < n; j += kRows) {
    for (Index i = 0; i < m; i += kLhsRows) {
      block(i, std::min(kLhsRows, m - i), j, std::min(kRows, n - j));
    }
  }
}

// Whether threaded_product computes dst [rows, cols] = lhs · rowsᵀ as dot_products: a few rows
// (a decoding step's tokens) against many more columns.
inline bool few_rows_product(Index rows, Index cols) {
  constexpr Index kSmallRows = 16;
  return rows <= kSmallRows && cols > rows;
}

// op(rhs) [depth, cols] packed whole (multiply_packed_rhs's layout) by the threads of the
// enclosing parallel region, in tasks of eight panels of one slice (an orphaned omp for, whose
// barrier ends it: each thread's slabs then read all of it).
inline void pack_rhs_together(const PackedOperand& rhs, Index depth, Index cols, float* packed) {
  using S = PackedGemmShape;
  constexpr Index kPanelsPerTask = 8;
  const Index slices = (depth + S::kKc - 1) / S::kKc;
  const Index groups = (cols + kPanelsPerTask * S::kNr - 1) / (kPanelsPerTask * S::kNr);
  MHA_OMP_PRAGMA(omp for schedule(static))
  for (Index task = 0; task < slices * groups; ++task) {
    const Index k0 = (task / groups) * S::kKc, kc = std::min(S::kKc, depth - k0);
    const Index j0 = (task % groups) * kPanelsPerTask * S::kNr;
    pack_rhs(rhs, k0, kc, j0, std::min(kPanelsPerTask * S::kNr, cols - j0),
             packed + k0 * packed_width(cols) + j0 * kc);
  }
}

// The slabs of packed_column_slabs: up to 16, each a multiple of 48 rows of W (whole micro-tiles
// of kMr rows), which the threads take as they finish (as every threaded product's slabs). Eight
// slabs shared out in advance left one thread waiting whenever the other ran slower: on a shared
// 2-core Zen 3, one core ran the micro-kernel at 75-81 GFLOP/s and the other at 95-99 while both
// were busy, and libgomp's wait was 13 % of the forward's samples at L = 128 (bench/RESULTS.md,
// 2026-12-07, tenth session). Finer slabs of rows for packed_slabs gained nothing measurable.
inline Index packed_slab_width(Index extent) {
  constexpr Index kSlabs = 16, kUnit = 48;  // 48: kMr and kNr both divide it
  return std::max(kUnit, (extent + kSlabs * kUnit - 1) / (kSlabs * kUnit) * kUnit);
}

// threaded_product's slabs of rows on the packed GEMM (packed_gemm.hpp): op(rhs), which every slab
// multiplies, packed once and shared (its panels split between the threads), rather than once
// per slab as tile_product would; each slab then multiplies its rows by it, element for element
// as tile_product does.
inline void packed_slabs(StridedMap<float> dst, const ConstStridedMap<float>& lhs, Operand lhs_op,
                         const ConstStridedMap<float>& rhs, Operand rhs_op, Accumulate accumulate,
                         Index width, Index slabs) {
  const bool lhs_transposed = lhs_op == Operand::transposed;
  const bool rhs_transposed = rhs_op == Operand::transposed;
  const Index depth = lhs_transposed ? lhs.rows() : lhs.cols(), cols = dst.cols();
  const PackedOperand b = rhs_transposed ? PackedOperand{rhs.data(), 1, rhs.outerStride()}
                                         : PackedOperand{rhs.data(), rhs.outerStride(), 1};
  // The calling thread's buffer, which its parallel region's threads fill and read.
  thread_local std::vector<float, Eigen::aligned_allocator<float>> packed;
  const auto size = static_cast<std::size_t>(depth * packed_width(cols));
  if (packed.size() < size) packed.resize(size);
  float* const packed_rhs = packed.data();
  [[maybe_unused]] const double work =
      static_cast<double>(dst.rows()) * static_cast<double>(cols) * static_cast<double>(depth);
  MHA_OMP_PRAGMA(omp parallel if (max_threads() > 1 && work >= kMinParallelWork)) {
    pack_rhs_together(b, depth, cols, packed_rhs);
    MHA_OMP_PRAGMA(omp for schedule(dynamic))
    for (Index slab = 0; slab < slabs; ++slab) {
      const Index start = slab * width, count = std::min(width, dst.rows() - start);
      const PackedOperand a =
          lhs_transposed
              ? PackedOperand{lhs.data() + start, 1, lhs.outerStride()}
              : PackedOperand{lhs.data() + start * lhs.outerStride(), lhs.outerStride(), 1};
      multiply_packed_rhs(count, cols, depth, a, packed_rhs, 1.0F, accumulate == Accumulate::yes,
                          dst.data() + start * dst.outerStride(), dst.outerStride());
    }
  }
}

// Whether x [tokens, depth] · Wᵀ is computed by packed_column_slabs: where packing W, as each
// slab of columns of tile_product does, costs a 1/tokens part of the product and the transposes
// of the result only a 1/depth part. At L = 128 with E = 768 and 1024 it took 0.80-0.96 of the
// forward's time; at L = 512, E = 1024 (tokens = depth / 2) 1.04 and with B = 8, L = 128, E = 512
// (tokens = 2 depth) 1.06, each slab's result then outgrowing L2 (bench/RESULTS.md, 2026-12-06,
// second session).
inline bool few_tokens_for_depth(Index tokens, Index depth) {
  return tokens > 0 && 4 * tokens <= depth;
}

// dst [M, N] = (or +=) x [M, K] · Wᵀ, W [N, K], for a few tokens (few_tokens_for_depth):
// threaded_product's slabs of columns on the packed GEMM, each computed as its transpose, a slab
// of dstᵀ = W · xᵀ. xᵀ, which every slab multiplies, is packed once and shared (its panels split
// between the threads); W's rows are the micro-kernel's left operand, read in place where their
// stride allows (weight_in_place), else packed once each by multiply_packed_rhs; and each
// slab's [width, M] result is transposed into dst. Slab by slab as tile_product, x was packed
// again for every slab and W transposed into panels: at L = 128, E = 768, a seventh of the
// layer's time (bench/RESULTS.md, 2026-12-06, second session). Element for element the
// arithmetic of tile_product's packed GEMM (x_lk w_nk = w_nk x_lk exactly, in the same k order,
// the same kKc slices, the same last FMA), so that results do not change with the path.
inline void packed_column_slabs(StridedMap<float> dst, const ConstStridedMap<float>& x,
                                const ConstStridedMap<float>& weight, Accumulate accumulate,
                                Index width, Index slabs) {
  using S = PackedGemmShape;
  const Index tokens = dst.rows(), depth = x.cols(), outputs = dst.cols();
  const Index panel_tokens = packed_width(tokens);
  thread_local std::vector<float, Eigen::aligned_allocator<float>> packed;
  const auto size = static_cast<std::size_t>(depth * panel_tokens);
  if (packed.size() < size) packed.resize(size);
  float* const packed_x = packed.data();
  const PackedOperand x_transposed{x.data(), 1, x.outerStride()};  // (k, l) at x[l, k]
  // The micro-kernel reads twelve rows of W at a time, each step one float of each. Rows a
  // multiple of 2 KiB apart fall in at most two of L1's sets (which repeat every 4 KiB), six or
  // twelve lines to a set of eight ways, and thrash: there W is packed, a block of rows at a
  // time (at E = 1024 read in place it took 1.16 times as long, at E = 768 packed 1.17 times).
  const bool weight_in_place =
      (weight.outerStride() * static_cast<Index>(sizeof(float))) % 2048 != 0;
  [[maybe_unused]] const double work =
      static_cast<double>(tokens) * static_cast<double>(outputs) * static_cast<double>(depth);
  MHA_OMP_PRAGMA(omp parallel if (max_threads() > 1 && work >= kMinParallelWork)) {
    pack_rhs_together(x_transposed, depth, tokens, packed_x);
    // This thread's slab of dstᵀ, [width, M]: grown to the largest request and then kept.
    thread_local std::vector<float, Eigen::aligned_allocator<float>> slab_result;
    if (static_cast<Index>(slab_result.size()) < width * tokens) {
      slab_result.resize(static_cast<std::size_t>(width * tokens));
    }
    float* const result = slab_result.data();
    MHA_OMP_PRAGMA(omp for schedule(dynamic))
    for (Index slab = 0; slab < slabs; ++slab) {
      const Index n0 = slab * width, count = std::min(width, outputs - n0);
      if (accumulate == Accumulate::yes) {
        transpose_into(dst.data() + n0, dst.outerStride(), tokens, count, result, tokens);
      }
      const float* rows = weight.data() + n0 * weight.outerStride();
      if (weight_in_place) {
        for (Index k0 = 0; k0 < depth; k0 += S::kKc) {
          multiply_panels(count, tokens, std::min(S::kKc, depth - k0),
                          LeftOperand{rows + k0, weight.outerStride(), false},
                          packed_x + k0 * panel_tokens, std::min(S::kKc, depth - k0) * S::kNr, 1.0F,
                          k0 == 0 && accumulate == Accumulate::no, result, tokens,
                          packed_gemm_buffers().edge);
        }
      } else {
        multiply_packed_rhs(count, tokens, depth, PackedOperand{rows, weight.outerStride(), 1},
                            packed_x, 1.0F, accumulate == Accumulate::yes, result, tokens);
      }
      transpose_into(result, tokens, count, tokens, dst.data() + n0, dst.outerStride());
    }
  }
}

// dst [M, N] = (or +=) op(lhs) [M, K] · op(rhs) [K, N], dst, lhs and rhs row-major blocks. Each
// slab is one tile_product (or dot_products, for a few rows): every product of the layer then
// instantiates the same few Eigen products, compiled once in src/products.cpp.
template <class T>
void threaded_product(StridedMap<T> dst, ConstStridedMap<T> lhs, Operand lhs_op,
                      ConstStridedMap<T> rhs, Operand rhs_op, Accumulate accumulate) {
  constexpr Index kMaxSlabs = 8, kMinSlab = 32, kDotSlab = 64;
  // No element to write (a call of no rows): an empty map's data may be null, which its slabs
  // would offset (undefined behaviour).
  if (dst.rows() == 0 || dst.cols() == 0) return;
  const bool lhs_transposed = lhs_op == Operand::transposed;
  const bool rhs_transposed = rhs_op == Operand::transposed;
  [[maybe_unused]] const double work =
      static_cast<double>(dst.rows()) * static_cast<double>(dst.cols()) *
      static_cast<double>(lhs_transposed ? lhs.rows() : lhs.cols());
  // A transposed right operand has contiguous columns: its rows, as stored.
  if (!lhs_transposed && rhs_transposed && few_rows_product(dst.rows(), dst.cols())) {
    const Index slabs = (dst.cols() + kDotSlab - 1) / kDotSlab;
    MHA_OMP_PRAGMA(
        omp parallel for schedule(static) if (max_threads() > 1 && work >= kMinParallelWork))
    for (Index slab = 0; slab < slabs; ++slab) {
      const Index start = slab * kDotSlab, count = std::min(kDotSlab, dst.cols() - start);
      dot_products<T>(strided(dst.middleCols(start, count)), lhs,
                      const_strided(rhs.middleRows(start, count)), accumulate);
    }
    return;
  }
  const bool by_rows = dst.rows() >= dst.cols();
  const Index extent = by_rows ? dst.rows() : dst.cols();
  const Index width =
      std::max(kMinSlab, ((extent + kMaxSlabs - 1) / kMaxSlabs + 7) / 8 * 8);  // multiple of 8
  const Index slabs = (extent + width - 1) / width;
  if constexpr (std::is_same_v<T, float>) {
    if (by_rows && slabs > 1 && (lhs_transposed ? lhs.rows() : lhs.cols()) > 0 &&
        packed_gemm_available()) {
      return packed_slabs(dst, lhs, lhs_op, rhs, rhs_op, accumulate, width, slabs);
    }
    if (!by_rows && slabs > 1 && !lhs_transposed && rhs_transposed &&
        few_tokens_for_depth(dst.rows(), lhs.cols()) && packed_gemm_available()) {
      // The packed GEMM's sums do not depend on where a product is cut, and this path packs
      // the operand every slab multiplies once: its slabs may be finer (packed_slab_width).
      const Index columns = packed_slab_width(extent);
      return packed_column_slabs(dst, lhs, rhs, accumulate, columns,
                                 (extent + columns - 1) / columns);
    }
  }
  // With more than one thread available, always inside a parallel region, even for one slab:
  // outside one, Eigen would thread a large product itself. With one thread, or below
  // kMinParallelWork (where Eigen does not thread either), no region.
  MHA_OMP_PRAGMA(
      omp parallel for schedule(dynamic) if (max_threads() > 1 && work >= kMinParallelWork))
  for (Index slab = 0; slab < slabs; ++slab) {
    const Index start = slab * width, count = std::min(width, extent - start);
    // Rows of op(lhs) are columns of a transposed lhs as stored; columns of op(rhs), rows of a
    // transposed rhs.
    if (by_rows) {
      const ConstStridedMap<T> lhs_slab = lhs_transposed
                                              ? const_strided(lhs.middleCols(start, count))
                                              : const_strided(lhs.middleRows(start, count));
      tile_product<T>(strided(dst.middleRows(start, count)), lhs_slab, lhs_op, rhs, rhs_op,
                      accumulate);
    } else {
      const ConstStridedMap<T> rhs_slab = rhs_transposed
                                              ? const_strided(rhs.middleRows(start, count))
                                              : const_strided(rhs.middleCols(start, count));
      tile_product<T>(strided(dst.middleCols(start, count)), lhs, lhs_op, rhs_slab, rhs_op,
                      accumulate);
    }
  }
}

// dst [M, N] = (or +=) op(lhs) rhs, each a row-major block whose rows are outer-stride elements
// apart: the layer's products besides the projections (the backward's weight gradients, lhs
// transposed, and its input gradients). Blocks rather than Eigen expressions, so that one
// instantiation per scalar type (compiled once in mha::compiled) serves every call, where each
// combination of expression types would instantiate Eigen's GEMM and its dot products again
// (strided() makes the blocks). A transposed right operand is product_transposed's.
template <class T>
void matrix_product(StridedMap<T> dst, ConstStridedMap<T> lhs, Operand lhs_op,
                    ConstStridedMap<T> rhs, Accumulate accumulate) {
  threaded_product<T>(dst, lhs, lhs_op, rhs, Operand::as_stored, accumulate);
}

// Rows first .. first + count - 1 of a 16-bit weight [N, K], widened into `scratch`'s
// weight_rows, which grows to the largest request and then stays: repeated calls allocate
// nothing.
template <class T, class Stored>
const T* converted_rows(KernelScratch<T>& scratch, const Eigen::Map<const Matrix<Stored>>& weight,
                        Index first, Index count) {
  const auto needed = static_cast<std::size_t>(count * weight.cols());
  if (scratch.weight_rows.size() < needed) scratch.weight_rows.resize(needed);
  widen(weight.data() + first * weight.cols(), count * weight.cols(), scratch.weight_rows.data());
  return scratch.weight_rows.data();
}

// dst [M, N] = (or +=) lhs [M, K] * weightᵀ, weight [N, K] row-major as a layer stores it (x Wᵀ,
// a projection); dst and lhs are row-major blocks (strided(), in tile_product.hpp). With
// weights stored in a 16-bit type, by the number of tokens M:
//   M <= 16 (a decoding step): each weight row is widened in registers inside the dot products
//     (AVX-512; elsewhere as the panels below), so the weight is read once at 2 bytes an element;
//   M >= N: the whole weight is converted once into scratch and one threaded GEMM runs (its
//     float copy is then no larger than dst);
//   otherwise: panels of 128 rows converted into each thread's scratch and multiplied there.
// Each output column is computed by one thread with the same arithmetic whatever the thread
// count, as in threaded_product.
template <class T, class Stored>
void product_transposed(StridedMap<T> dst, ConstStridedMap<T> lhs,
                        const Eigen::Map<const Matrix<Stored>>& weight, Accumulate accumulate,
                        std::vector<KernelScratch<T>>& scratch) {
  if constexpr (std::is_same_v<T, Stored>) {
    threaded_product<T>(dst, lhs, Operand::as_stored, const_strided(weight), Operand::transposed,
                        accumulate);
  } else {
    // 128 rows: a [B·L, K] left operand is re-packed once per panel, which costs about 1/64 of
    // a byte per FLOP.
    constexpr Index kSmallRows = 16, kPanelRows = 128;
    const bool small = dst.rows() <= kSmallRows;
    const Index panels = (weight.rows() + kPanelRows - 1) / kPanelRows;
    [[maybe_unused]] const double work = static_cast<double>(dst.rows()) *
                                         static_cast<double>(dst.cols()) *
                                         static_cast<double>(lhs.cols());
#ifdef MHA_FUSED_16BIT_DOT
    if constexpr (std::is_same_v<T, float>) {
      // A few tokens (a decoding step) convert the weights in registers instead: converting a
      // panel into memory and reading it back made a 16-bit step no faster than a float one.
      if (small) {
        MHA_OMP_PRAGMA(
            omp parallel for schedule(static) if (max_threads() > 1 && work >= kMinParallelWork))
        for (Index p = 0; p < panels; ++p) {
          const Index start = p * kPanelRows;
          fused_dot_rows(lhs.data(), dst.rows(), lhs.outerStride(), weight.data(), weight.cols(),
                         start, std::min(kPanelRows, weight.rows() - start), dst.data() + start,
                         dst.outerStride(), accumulate == Accumulate::yes);
        }
        return;
      }
    }
#endif
    scratch_for_threads(scratch);
    if (dst.rows() >= weight.rows()) {
      // At least as many tokens as weight rows: the float copy of the whole weight is no larger
      // than dst itself, and one threaded GEMM re-packs lhs once instead of once per panel
      // (measured at L = 2048, E = 512: 12 % slower than float with panels).
      const ConstStridedMap<T> whole(converted_rows(scratch.front(), weight, 0, weight.rows()),
                                     weight.rows(), weight.cols(),
                                     Eigen::OuterStride<>(weight.cols()));
      threaded_product<T>(dst, lhs, Operand::as_stored, whole, Operand::transposed, accumulate);
      return;
    }
    MHA_OMP_PRAGMA(omp parallel if (max_threads() > 1 && work >= kMinParallelWork)) {
      KernelScratch<T>& mine = scratch[static_cast<std::size_t>(thread_index())];
      MHA_OMP_PRAGMA(omp for schedule(static))
      for (Index p = 0; p < panels; ++p) {
        const Index start = p * kPanelRows, count = std::min(kPanelRows, weight.rows() - start);
        const ConstStridedMap<T> panel(converted_rows(mine, weight, start, count), count,
                                       weight.cols(), Eigen::OuterStride<>(weight.cols()));
        const StridedMap<T> dst_panel = strided(dst.middleCols(start, count));
        if (small) {  // a few tokens: dot products, as threaded_product
          dot_products<T>(dst_panel, lhs, panel, accumulate);
        } else {
          tile_product<T>(dst_panel, lhs, Operand::as_stored, panel, Operand::transposed,
                          accumulate);
        }
      }
    }
  }
}

// The instantiations mha::compiled holds (src/products.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_PRODUCT_TEMPLATES(PREFIX, T)                                                        \
  PREFIX template void matrix_product<T>(StridedMap<T>, ConstStridedMap<T>, Operand,            \
                                         ConstStridedMap<T>, Accumulate);                       \
  PREFIX template void product_transposed<T, T>(StridedMap<T>, ConstStridedMap<T>,              \
                                                const Eigen::Map<const Matrix<T>>&, Accumulate, \
                                                std::vector<KernelScratch<T>>&);
// NOLINTEND(bugprone-macro-parentheses)
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_STORED_PRODUCT_TEMPLATES(PREFIX, Stored)                                      \
  PREFIX template void product_transposed<float, Stored>(                                 \
      StridedMap<float>, ConstStridedMap<float>, const Eigen::Map<const Matrix<Stored>>&, \
      Accumulate, std::vector<KernelScratch<float>>&);
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_COMPUTE_TYPES, MHA_PRODUCT_TEMPLATES)
MHA_EXTERN_TEMPLATES(MHA_STORED_16BIT_TYPES, MHA_STORED_PRODUCT_TEMPLATES)

}  // namespace mha::detail
