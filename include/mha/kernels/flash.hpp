// The flash kernel: attention over query blocks × key blocks with an online softmax, so the
// [L, S'] scores are never stored. Extra memory is one [Bq, Bk] score tile, a [Bq, Dv]
// accumulator and two [Bq] vectors (running max and running sum), whatever L and S.
//
// For each query block, for each key block (FlashAttention-2's loop order):
//   tile  = masks (0, additive values, -inf where blocked), skipped if all -inf
//   tile += scale * q_blk k_blkᵀ
//   m'    = max(m, rowmax(tile));  p = exp(tile - m');  c = exp(m - m')
//   sum   = c * sum + rowsum(p);   acc = c * acc + p v_blk;   m = m'
// and once at the end out = acc / sum (a row that saw no visible key has sum 0 and gives 0).
// Key blocks that causal masking hides from every query of the block are never visited.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "mha/kernels/common.hpp"
#include "mha/softmax.hpp"

namespace mha {
namespace detail {

// Query and key block sizes. A [64, 256] float tile is 64 KiB: with the q, k and v blocks it
// stays in the 1 MiB L2 for D up to 128. (PyTorch's CPU flash kernel uses kv blocks of 512 and
// query blocks of 32 to 256.)
struct FlashBlocks {
  Index query = 64;
  Index key = 256;
};

// q is (B, H, L, D), k is (B, H, S', D), v is (B, H, S', Dv), out is (B, H, L, Dv), as head
// layouts. The first options.causal_cols keys are the input keys, subject to masks and causal
// masking; the rest (bias_k, zero attention) are visible to every query.
template <class T>
void attention_flash(Index batch, Index heads, const HeadLayout<const T>& q,
                     const HeadLayout<const T>& k, const HeadLayout<const T>& v,
                     const HeadLayout<T>& out, const CoreOptions<T>& options,
                     std::vector<KernelScratch<T>>& scratch, const FlashBlocks& blocks = {}) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const Index query_len = q.rows, key_len = k.rows, value_dim = v.cols;
  const Index masked_keys = options.causal_cols;  // keys [masked_keys, key_len) always visible
  const bool any_mask = options.attn_mask.kind != MaskKind::none ||
                        options.key_padding_mask.kind != MaskKind::none ||
                        options.causal != Causal::none;
  const Index query_blocks = (query_len + blocks.query - 1) / blocks.query;
  const Index tasks = batch * heads * query_blocks;

  // Threads split (batch, head, query block) tasks; each task is computed whole by one thread
  // with the same arithmetic, so results do not depend on the number of threads.
  scratch_for_threads(scratch);
  MHA_OMP_PRAGMA(omp parallel if (tasks > 1)) {
    // This thread's buffers: resized only when the shapes change, never inside the task loop.
    KernelScratch<T>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.scores.resize(blocks.query, blocks.key);
    mine.acc.resize(blocks.query, value_dim);
    mine.row_max.resize(blocks.query);
    mine.row_sum.resize(blocks.query);
    mine.exps.resize(blocks.key);
    Matrix<T>& tile = mine.scores;
    Matrix<T>& acc = mine.acc;
    Vector<T>& row_max = mine.row_max;
    Vector<T>& row_sum = mine.row_sum;
    RowVector<T>& exps = mine.exps;

    // Causal rows of later blocks see more keys: dynamic scheduling balances them.
    MHA_OMP_PRAGMA(omp for schedule(dynamic))
    for (Index task = 0; task < tasks; ++task) {
      const Index b = task / (heads * query_blocks);
      const Index h = (task / query_blocks) % heads;
      const Index i0 = (task % query_blocks) * blocks.query;
      const auto q_bh = q.at(b, h);
      const auto k_bh = k.at(b, h);
      const auto v_bh = v.at(b, h);
      auto out_bh = out.at(b, h);
      const Index rows = std::min(blocks.query, query_len - i0);
      auto acc_blk = acc.topRows(rows);
      acc_blk.setZero();
      row_max.head(rows).setConstant(kNegInf);
      row_sum.head(rows).setZero();
      // Causal masking hides every key from causal_visible_end(last row) on from this block.
      const Index visible_end =
          causal_visible_end(options.causal, masked_keys, query_len, i0 + rows - 1);

      const auto process = [&](Index j0, Index cols) {
        auto s = tile.topLeftCorner(rows, cols);
        // pass 1: masks first, so a block they hide wholly costs no GEMM
        s.setZero();
        const bool masked_tile = any_mask && j0 < masked_keys;
        if (masked_tile) {
          options.attn_mask.apply(b, h, i0, j0, s);
          options.key_padding_mask.apply(b, h, i0, j0, s);
          apply_causal(options.causal, masked_keys, query_len, i0, j0, s);
          if ((s.array() == kNegInf).all()) return;
        }
        s.noalias() +=
            options.scale * (q_bh.middleRows(i0, rows) * k_bh.middleRows(j0, cols).transpose());
        // pass 2: online softmax, one row at a time
        for (Index r = 0; r < rows; ++r) {
          auto score_row = s.row(r);
          const T block_max = score_row.maxCoeff();
          if (block_max == kNegInf) {  // nothing visible in this block for this row
            score_row.setZero();
            continue;
          }
          if (block_max > row_max(r)) {
            // exp(-inf) is 0: a row's first visible block just starts the sums.
            const T correction = row_max(r) == kNegInf ? T(0) : std::exp(row_max(r) - block_max);
            row_sum(r) *= correction;
            acc_blk.row(r) *= correction;
            row_max(r) = block_max;
          }
          if (masked_tile) {
            row_sum(r) += exp_shifted_inplace(score_row, row_max(r), exps);
          } else {
            // No -inf in an unmasked tile: exp in place, two passes instead of five.
            score_row.array() = (score_row.array() - row_max(r)).exp();
            row_sum(r) += score_row.sum();
          }
        }
        acc_blk.noalias() += s * v_bh.middleRows(j0, cols);
      };

      for (Index j0 = 0; j0 < visible_end; j0 += blocks.key) {
        process(j0, std::min(blocks.key, visible_end - j0));
      }
      for (Index j0 = masked_keys; j0 < key_len; j0 += blocks.key) {
        process(j0, std::min(blocks.key, key_len - j0));
      }

      // One division per row at the end; a row with no visible key stays 0.
      for (Index r = 0; r < rows; ++r) {
        auto out_row = out_bh.row(i0 + r);
        if (row_sum(r) > T(0)) {
          out_row.noalias() = acc_blk.row(r) / row_sum(r);
        } else {
          out_row.setZero();
        }
      }
    }
  }
}

}  // namespace detail
}  // namespace mha
