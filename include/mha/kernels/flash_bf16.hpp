// The flash kernel's tile products in bf16 with fp32 sums (Precision::bf16; bf16_gemm.hpp's
// arithmetic), for attention_flash's FlashPath::bf16_panels:
//   scores  s [rows, cols] = (masks +) scale · q_blk [rows, D] · k_blkᵀ [D, cols]
//   values  acc [rows, Dv] += p [rows, cols] · v_blk [cols, Dv]
// The softmax between them (running max, exp, sums) and the accumulator stay fp32, as in
// FlashAttention's and PyTorch's bf16 kernels: only the operands of the two products are
// rounded. A head's keys and values are packed once per thread (flash_panels.hpp), a query
// block's rows and each tile of probabilities rounded into rows of pairs as they are used.
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

// s [rows, cols] (rows ld apart) = (first ? 0 : s) + scale · queries · keys j0 .. j0 + cols - 1
// of k_bh transposed, queries the block's rows of pairs (bf16_rows_of). The keys' panels come
// from the head's, packed once, where j0 starts one; else the block is packed apart.
inline void bf16_scores(FlashPanels& panels, const std::uint32_t* queries, Index rows,
                        const ConstStridedMap<float>& k_bh, Index j0, Index cols, float scale,
                        bool first, float* s, Index ld) {
  const Index pairs = bf16_pairs(k_bh.cols()), stride = Bf16PanelBuffer::transposed_stride(k_bh);
  const std::uint32_t* keys =
      j0 % Bf16GemmShape::kNr == 0
          ? panels.bf16_keys.transposed(k_bh) + (j0 / Bf16GemmShape::kNr) * stride
          : panels.bf16_block_keys.block_transposed(k_bh, j0, cols);
  // Queries and keys hold the same pairs: the queries' rows are `pairs` lanes long.
  // NOLINTNEXTLINE(readability-suspicious-call-argument)
  bf16_tile_product(rows, cols, pairs, queries, pairs, keys, stride, scale, first, s, ld);
}

// acc [rows, Dv] (rows acc_ld apart) += p [rows, cols] (rows p_ld apart) · values j0 .. j0 +
// cols - 1 of v_bh. The values' pairs come from the head's, packed once, where j0 is even and the
// block's last pair holds none of the next block's values (cols even, or the head's last key); a
// value the block does not hold would meet a zero probability, and 0 · inf is NaN. Else the
// block is packed apart.
inline void bf16_accumulate_values(FlashPanels& panels, const float* p, Index p_ld, Index rows,
                                   Index cols, const ConstStridedMap<float>& v_bh, Index j0,
                                   float* acc, Index acc_ld) {
  const Index pairs = bf16_rows_of(p, rows, cols, p_ld, panels.bf16_probabilities);
  const bool whole = j0 % 2 == 0 && (cols % 2 == 0 || j0 + cols == v_bh.rows());
  const std::uint32_t* values = whole
                                    ? panels.bf16_values.rows(v_bh) + (j0 / 2) * Bf16GemmShape::kNr
                                    : panels.bf16_block_values.block_rows(v_bh, j0, cols);
  const Index stride = whole ? Bf16PanelBuffer::rows_stride(v_bh) : pairs * Bf16GemmShape::kNr;
  // The probabilities' rows are the product's `pairs` lanes long.
  // NOLINTNEXTLINE(readability-suspicious-call-argument)
  bf16_tile_product(rows, v_bh.cols(), pairs, panels.bf16_probabilities.data(), pairs, values,
                    stride, 1.0F, false, acc, acc_ld);
}

}  // namespace mha::detail
