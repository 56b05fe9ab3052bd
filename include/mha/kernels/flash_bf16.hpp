// The flash kernels' tile products in bf16 with fp32 sums (Precision::bf16; bf16_gemm.hpp's
// arithmetic). The forward's, for attention_flash's FlashPath::bf16_panels:
//   scores  s [rows, cols] = (masks +) scale · q_blk [rows, D] · k_blkᵀ [D, cols]
//   values  acc [rows, Dv] += p [rows, cols] · v_blk [cols, Dv]
// and the backward's, for attention_flash_backward's: the scores again, then
//   dP [rows, cols] = dO_blk [rows, Dv] · v_blkᵀ,   dV_blk [cols, Dv] += Pᵀ · dO_blk,
//   dQ_blk [rows, D] += scale · dS · k_blk,         dK_blk [cols, D] += scale · dSᵀ · q_blk.
// The softmax between them (running max, exp, sums, dS = P ∘ (dP - rowdot)) and the
// accumulators stay fp32, as in FlashAttention's and PyTorch's bf16 kernels: only the operands of
// the products are rounded. A head's keys, values, queries and output gradients are packed once
// per thread (flash_panels.hpp), a block of queries or output gradients and each tile of P or dS
// rounded as they are used.
#pragma once

#include <algorithm>
#include <cstdint>

#include "mha/kernels/bf16_gemm.hpp"
#include "mha/kernels/flash_panels.hpp"

namespace mha::detail {

// `rows` rows of m (rows `stride` floats apart, `cols` wide) into `lanes` as rows of pairs, then
// zero rows up to the next multiple of 6 (which the micro-kernel reads and whose products it
// discards). Returns the rows' stride in lanes.
inline Index bf16_rows_of(const float* m, Index rows, Index cols, Index stride, Bf16Lanes& lanes) {
  const Index pairs = bf16_pairs(cols);
  const Index padded = (rows + Bf16GemmShape::kMr - 1) / Bf16GemmShape::kMr * Bf16GemmShape::kMr;
  if (static_cast<Index>(lanes.size()) < padded * pairs) {
    lanes.resize(static_cast<std::size_t>(padded * pairs));
  }
  round_rows_bf16(m, rows, cols, stride, lanes.data(), pairs);
  std::fill(lanes.data() + rows * pairs, lanes.data() + padded * pairs, 0U);
  return pairs;
}

// Rows j0 .. j0 + count - 1 of m transposed, as bf16 panels Bf16PanelBuffer::transposed_stride(m)
// lanes apart: from the whole matrix's panels, packed once, where j0 starts one; else packed
// apart into `block`.
inline const std::uint32_t* bf16_transposed_block(Bf16PanelBuffer& whole, Bf16PanelBuffer& block,
                                                  const ConstStridedMap<float>& m, Index j0,
                                                  Index count) {
  return j0 % Bf16GemmShape::kNr == 0
             ? whole.transposed(m) +
                   (j0 / Bf16GemmShape::kNr) * Bf16PanelBuffer::transposed_stride(m)
             : block.block_transposed(m, j0, count);
}

// Rows j0 .. j0 + count - 1 of m as bf16 panels over their pairs, and the panels' stride: from
// the whole matrix's pairs where j0 is even and the block's last pair holds no row of the next
// block (count even, or m's last row); else packed apart into `block`. A row the block does not
// hold would meet a zero in the other operand, and 0 · inf is NaN.
struct Bf16Rows {
  const std::uint32_t* lanes;
  Index panel_stride;
};
inline Bf16Rows bf16_rows_block(Bf16PanelBuffer& whole, Bf16PanelBuffer& block,
                                const ConstStridedMap<float>& m, Index j0, Index count) {
  if (j0 % 2 == 0 && (count % 2 == 0 || j0 + count == m.rows())) {
    return {whole.rows(m) + (j0 / 2) * Bf16GemmShape::kNr, Bf16PanelBuffer::rows_stride(m)};
  }
  return {block.block_rows(m, j0, count), bf16_pairs(count) * Bf16GemmShape::kNr};
}

// s [rows, count] (rows ld apart) = (first ? 0 : s) + scale · lhs · (rows j0 .. j0 + count - 1
// of m)ᵀ, lhs [rows, m.cols()] as rows of pairs (bf16_rows_of): q kᵀ (m the keys, packed into
// whole or block) and dO vᵀ (m the values).
inline void bf16_product_transposed(Bf16PanelBuffer& whole, Bf16PanelBuffer& block,
                                    const std::uint32_t* lhs, Index rows,
                                    const ConstStridedMap<float>& m, Index j0, Index count,
                                    float scale, bool first, float* s, Index ld) {
  const Index pairs = bf16_pairs(m.cols());
  const std::uint32_t* panels = bf16_transposed_block(whole, block, m, j0, count);
  // lhs and m's panels hold the same pairs: lhs's rows are `pairs` lanes long.
  // NOLINTNEXTLINE(readability-suspicious-call-argument)
  bf16_tile_product(rows, count, pairs, lhs, pairs, panels, Bf16PanelBuffer::transposed_stride(m),
                    scale, first, s, ld);
}

// The forward's scores: s [rows, cols] = (first ? 0 : s) + scale · queries · keys j0 .. j0 + cols
// - 1 of k_bh transposed, queries the block's rows of pairs.
inline void bf16_scores(FlashPanels& panels, const std::uint32_t* queries, Index rows,
                        const ConstStridedMap<float>& k_bh, Index j0, Index cols, float scale,
                        bool first, float* s, Index ld) {
  bf16_product_transposed(panels.bf16_keys, panels.bf16_block_transposed, queries, rows, k_bh, j0,
                          cols, scale, first, s, ld);
}

// acc [rows, m.cols()] (rows acc_ld apart) += scale · t [rows, count] (rows t_ld apart) · rows j0
// .. j0 + count - 1 of m (bf16_rows_block's), t's rows rounded into t_rows: p v, dS k.
inline void bf16_accumulate_product(const float* t, Index t_ld, Index rows, Index count,
                                    Bf16PanelBuffer& whole, Bf16PanelBuffer& block,
                                    const ConstStridedMap<float>& m, Index j0, float scale,
                                    Bf16Lanes& t_rows, float* acc, Index acc_ld) {
  const Index pairs = bf16_rows_of(t, rows, count, t_ld, t_rows);
  const Bf16Rows rhs = bf16_rows_block(whole, block, m, j0, count);
  // t's rows are the product's `pairs` lanes long.
  // NOLINTNEXTLINE(readability-suspicious-call-argument)
  bf16_tile_product(rows, m.cols(), pairs, t_rows.data(), pairs, rhs.lanes, rhs.panel_stride, scale,
                    false, acc, acc_ld);
}

// The forward's values: acc [rows, Dv] += p [rows, cols] · values j0 .. j0 + cols - 1 of v_bh.
inline void bf16_accumulate_values(FlashPanels& panels, const float* p, Index p_ld, Index rows,
                                   Index cols, const ConstStridedMap<float>& v_bh, Index j0,
                                   float* acc, Index acc_ld) {
  bf16_accumulate_product(p, p_ld, rows, cols, panels.bf16_values, panels.bf16_block_rows, v_bh, j0,
                          1.0F, panels.bf16_probabilities, acc, acc_ld);
}

// acc [count, m.cols()] (rows acc_ld apart) += scale · t [rows, count]ᵀ · rows i0 .. i0 + rows - 1
// of m (bf16_rows_block's): Pᵀ dO and dSᵀ q. tᵀ's rows, t's columns, are rounded into panels
// (pack_bf16_columns) and their lanes transposed into rows of pairs (panels_to_rows).
inline void bf16_accumulate_transposed_product(const float* t, Index t_ld, Index rows, Index count,
                                               Bf16PanelBuffer& whole, Bf16PanelBuffer& block,
                                               const ConstStridedMap<float>& m, Index i0,
                                               float scale, FlashPanels& panels, float* acc,
                                               Index acc_ld) {
  constexpr Index kMr = Bf16GemmShape::kMr;
  const Index pairs = bf16_pairs(rows), padded = (count + kMr - 1) / kMr * kMr;
  const auto grow = [](Bf16Lanes& lanes, Index size) {
    if (static_cast<Index>(lanes.size()) < size) lanes.resize(static_cast<std::size_t>(size));
  };
  grow(panels.bf16_tile_panels, bf16_panels(count) * pairs * Bf16GemmShape::kNr);
  grow(panels.bf16_tile_columns, padded * pairs);
  std::uint32_t* const columns = panels.bf16_tile_columns.data();
  pack_bf16_columns(t, rows, count, t_ld, panels.bf16_tile_panels.data());
  panels_to_rows(panels.bf16_tile_panels.data(), count, pairs, columns, pairs);
  // Rows up to the next multiple of 6, which the micro-kernel reads and whose products it drops.
  std::fill(columns + count * pairs, columns + padded * pairs, 0U);
  const Bf16Rows rhs = bf16_rows_block(whole, block, m, i0, rows);
  // NOLINTNEXTLINE(readability-suspicious-call-argument)
  bf16_tile_product(count, m.cols(), pairs, columns, pairs, rhs.lanes, rhs.panel_stride, scale,
                    false, acc, acc_ld);
}

}  // namespace mha::detail
