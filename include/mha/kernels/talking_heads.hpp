// Talking-heads attention (Shazeer et al. 2020, arXiv:2003.02436): learned [H, H] matrices mix
// the heads' logits before the softmax (pre) and their weights after it (post). For one batch
// row b, query heads h, g in 0..H-1, and pre, post row-major [H, H] (null = identity):
//   logits[h] = scale q_h k_hᵀ                  (capped first when softcap)
//   mixed[g]  = Σ_h pre[g, h] logits[h] + masks(b, g)
//   P[g]      = softmax(mixed[g])               (a fully masked row gives a zero row)
//   W[g]      = Σ_h post[g, h] P[h]
//   Wd[g]     = W[g] ∘ Z[b, g]                  (dropout, training only)
//   out_g     = Wd[g] v_g
// A head's masks, causal masking, window and ALiBi are those of the mixed head g, added after
// the mixing, so that -inf (a blocked key) is never multiplied by a mixing weight.
// The mixing is per (query, key) position and the softmax per query row, so the kernels work on
// query blocks: a tile holds a block of `rows` queries of every head against all S' keys,
// [H * rows, S'], small enough that the passes over it stay in cache (talking_heads_block_rows).
#pragma once

#include <algorithm>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/kernels/common.hpp"
#include "mha/softmax.hpp"

namespace mha::detail {

// Queries per block: at most 64, the blocks of one problem balanced (L = 65 gives 33 + 32), so
// that a last block of one row does not become a matrix-vector product with its own rounding.
// The tile must be small enough that the passes over it (logits, mixes, softmax, the product with
// v; more backward) stop going to DRAM, which a whole [H * L, S'] batch row did (134 MB per
// buffer at L = S' = 2048, H = 8), but each block's products re-pack k_h and v_h, [S', D] each,
// for only rows * S' * D multiply-adds. Sizing the three [H * rows, S'] tiles to one core's 1 MiB
// L2 gives 5 rows at H = 8, S' = 2048, where the packing dominates. Measured with
// `mha_bench --benchmark_filter=talking_heads` (B = 4, H = 8, D = 64, float, both mixes) and this
// limit edited by hand: at L = 2048, 384 ms with blocks of at least 8 rows, 323 ms with 32 or 64,
// 351 ms with 128; at L = 512, 26.1 ms with the L2 size (21 rows), 25.1 with 64, 34.5 with 128. The
// tiles then live in L2 and L3 (12 MiB per thread at that largest shape). Depends only on the
// shapes, never on the thread count, so results do not either.
inline Index talking_heads_block_rows(Index query_len) {
  constexpr Index kMostRows = 64;
  if (query_len <= kMostRows) return query_len;
  const Index blocks = (query_len + kMostRows - 1) / kMostRows;
  return (query_len + blocks - 1) / blocks;
}

// The first `rows` rows of a buffer sized for the largest block, as a matrix of its own: a
// smaller last block then still has its heads' [rows, S'] blocks back to back.
template <class T>
Eigen::Map<Matrix<T>> leading_rows(Matrix<T>& buffer, Index rows) {
  return Eigen::Map<Matrix<T>>(buffer.data(), rows, buffer.cols());
}

// An [H * rows, S'] tile whose head h is the [rows, S'] block at rows h * rows, seen as
// [H, rows * S']: head h is then row h, and mixing the heads with an [H, H] matrix is one product.
template <class T>
Eigen::Map<Matrix<T>> heads_as_rows(Eigen::Map<Matrix<T>> tile, Index heads) {
  return Eigen::Map<Matrix<T>>(tile.data(), heads, heads == 0 ? 0 : tile.size() / heads);
}

template <class T>
ConstStridedMap<T> head_mix(const T* mix, Index heads) {
  return ConstStridedMap<T>(mix, heads, heads, Eigen::OuterStride<>(heads));
}

// A batch row's dpre or dpost [H, H] in `partial`.
template <class T>
StridedMap<T> square_block(T* data, Index heads) {
  return StridedMap<T>(data, heads, heads, Eigen::OuterStride<>(heads));
}

// The probabilities P of batch row b's queries row0 .. row0 + rows - 1, [H * rows, S'], into the
// leading rows of mine.head_probs. q is (B, H, L, D), k is (B, H, S', D) as head layouts.
// mine.head_logits receives the logits [H * rows, S'] (capped when softcap) when pre is active,
// and also with keep_capped under softcap (for its derivative). The caller sized mine's buffers
// for `rows` (head_probs, exps, and as needed head_logits, and capped and scores, [rows, S']).
template <class T>
void talking_heads_probs(Index b, Index row0, Index rows, Index heads, const HeadLayout<const T>& q,
                         const HeadLayout<const T>& k, const CoreOptions<T>& options,
                         const TalkingHeads<T>& mix, bool keep_capped, KernelScratch<T>& mine) {
  const Index query_len = q.rows, key_len = k.rows;
  auto probs = leading_rows(mine.head_probs, heads * rows);
  if (mix.pre != nullptr) {
    // pass 1: every head's logits, as each mixed head reads all of them
    auto logits = leading_rows(mine.head_logits, heads * rows);
    for (Index h = 0; h < heads; ++h) {
      auto logits_h = logits.middleRows(h * rows, rows);
      logits_h.setZero();
      options.add_scores(logits_h, q.at(b, h).middleRows(row0, rows), k.at(b, h), mine.capped);
    }
    // pass 2: the mixed logits, then each mixed head's masks on top
    tile_product<T>(strided(heads_as_rows(probs, heads)), head_mix(mix.pre, heads),
                    Operand::as_stored, const_strided(heads_as_rows(logits, heads)),
                    Operand::as_stored, Accumulate::no);
    if (options.any_mask()) {
      auto masks_g = mine.scores.topRows(rows);
      for (Index g = 0; g < heads; ++g) {
        options.masks(b, g, query_len, row0, 0, masks_g);
        probs.middleRows(g * rows, rows) += masks_g;
      }
    }
  } else {
    // Without pre, the scores are built by the same operations as attention_reference's (masks,
    // then the scaled scores added by one product), so that a null pre reproduces its weights and
    // output bit for bit while one block covers L. With several blocks the products are per block,
    // and Eigen may round a row of a block's product an ulp apart from the same row of the whole
    // head's.
    for (Index g = 0; g < heads; ++g) {
      auto mixed_g = probs.middleRows(g * rows, rows);
      options.masks(b, g, query_len, row0, 0, mixed_g);
      options.add_scores(mixed_g, q.at(b, g).middleRows(row0, rows), k.at(b, g), mine.capped);
      if (keep_capped && options.softcap > T(0)) {
        mine.head_logits.middleRows(g * rows, rows) = mine.capped.topLeftCorner(rows, key_len);
      }
    }
  }
  // pass 3: the softmax, row by row (fully masked rows become zero)
  softmax_rows_inplace(probs, mine.exps);
}

// Forward. q is (B, H, L, D), k is (B, H, S', D), v is (B, H, S', Dv), out is (B, H, L, Dv), all
// as head layouts (k and v may be grouped: k.group query heads per stored head); weights is null
// or a contiguous (B, H, L, S') buffer for Wd. options.dropout numbers positions over (B, H, L,
// S'). pre and post of `mix` are [H, H]. A task is one query block of one batch row, its tiles
// [H * rows, S'].
template <class T>
void attention_talking_heads(Index batch, Index heads, const HeadLayout<const T>& q,
                             const HeadLayout<const T>& k, const HeadLayout<const T>& v,
                             const HeadLayout<T>& out, const CoreOptions<T>& options,
                             const TalkingHeads<T>& mix, T* weights,
                             std::vector<KernelScratch<T>>& scratch) {
  const Index query_len = q.rows, key_len = k.rows;
  const Index block_rows = talking_heads_block_rows(query_len);
  const Index blocks = block_rows == 0 ? 0 : (query_len + block_rows - 1) / block_rows;
  const Index tasks = batch * blocks;
  const Index mixing = (mix.pre != nullptr ? heads : 0) + (mix.post != nullptr ? heads : 0);
  [[maybe_unused]] const double work =
      static_cast<double>(batch * heads) * static_cast<double>(query_len) *
      static_cast<double>(key_len) * static_cast<double>(q.cols + v.cols + mixing);
  // A region even for a single task (where worth_threads says no): outside one, Eigen would
  // thread the large products itself, with a depth blocking, and so a rounding, that depends on
  // the thread count. Each task is computed whole by one thread, and the blocks depend only on
  // the shapes: results do not depend on the number of threads.
  [[maybe_unused]] const bool parallel =
      worth_threads(tasks, work) || (max_threads() > 1 && work >= kMinParallelWork);
  scratch_for_threads(scratch);
  MHA_OMP_PRAGMA(omp parallel if (parallel)) {
    // This thread's buffers: resized only when the shapes change.
    KernelScratch<T>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.head_probs.resize(heads * block_rows, key_len);
    if (mix.pre != nullptr) {
      mine.head_logits.resize(heads * block_rows, key_len);
      if (options.any_mask()) mine.scores.resize(block_rows, key_len);
    }
    if (mix.post != nullptr) mine.head_weights.resize(heads * block_rows, key_len);
    if (options.softcap > T(0)) mine.capped.resize(block_rows, key_len);
    mine.exps.resize(key_len);
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index task = 0; task < tasks; ++task) {
      const Index b = task / blocks, row0 = (task % blocks) * block_rows;
      const Index rows = std::min(block_rows, query_len - row0);
      talking_heads_probs(b, row0, rows, heads, q, k, options, mix, false, mine);
      // W = post P; without post W is P itself, dropped out in place (P is not needed again)
      auto mixed =
          leading_rows(mix.post != nullptr ? mine.head_weights : mine.head_probs, heads * rows);
      if (mix.post != nullptr) {
        tile_product<T>(
            strided(heads_as_rows(mixed, heads)), head_mix(mix.post, heads), Operand::as_stored,
            const_strided(heads_as_rows(leading_rows(mine.head_probs, heads * rows), heads)),
            Operand::as_stored, Accumulate::no);
      }
      for (Index g = 0; g < heads; ++g) {
        auto weights_g = mixed.middleRows(g * rows, rows);
        if (options.dropout.active()) options.dropout.apply(b, g, row0, 0, weights_g);
        tile_product<T>(strided(out.at(b, g).middleRows(row0, rows)), const_strided(weights_g),
                        Operand::as_stored, v.at(b, g), Operand::as_stored, Accumulate::no);
        if (weights != nullptr) {
          Eigen::Map<Matrix<T>>(weights + ((b * heads + g) * query_len + row0) * key_len, rows,
                                key_len) = weights_g;
        }
      }
    }
  }
}

// Backward of attention_talking_heads. grad_out is (B, H, L, Dv); grad_q, grad_k, grad_v have
// the layouts of q, k, v (grad_k.group == k.group) and are overwritten: a stored key/value head
// receives the sum over its query heads. grad_pre, grad_post: null or [H, H], overwritten with
// dLoss/dpre and dLoss/dpost (ignored when that mix is null). Per query block of a batch row,
// recomputing the forward instead of storing it:
//   forward                              backward
//   out_g  = Wd[g] v_g                   dWd[g] = dO_g v_gᵀ,  grad_v_g += Wd[g]ᵀ dO_g
//   Wd[g]  = W[g] ∘ Z                    dW[g] = dWd[g] ∘ Z
//   W[g]   = Σ_h post[g, h] P[h]         dP[h] = Σ_g post[g, h] dW[g], dpost[g, h] += <dW[g], P[h]>
//   P[g]   = softmax(mixed[g])           dmixed[g] = P[g] ∘ (dP[g] - rowsum(P[g] ∘ dP[g]))
//   mixed[g] = Σ_h pre[g, h] logits[h]   dlogits[h] = Σ_g pre[g, h] dmixed[g],
//              + masks                   dpre[g, h] += <dmixed[g], logits[h]>
//   logits[h] = c tanh(s / c)            ds = dlogits ∘ (1 - (logits / c)²)
//   s = scale q_h k_hᵀ                   grad_q_h = scale ds k_h,  grad_k_h += scale dsᵀ q_h
// grad_k and grad_v sum over every query block of the batch row, so a task is one batch row,
// walking its blocks in order (for B = 1 the backward pass runs on one thread). dpre and dpost
// are summed over batch rows in batch order after the parallel region, so they do not depend on
// the thread count either.
template <class T>
void attention_talking_heads_backward(Index batch, Index heads, const HeadLayout<const T>& q,
                                      const HeadLayout<const T>& k, const HeadLayout<const T>& v,
                                      const HeadLayout<const T>& grad_out,
                                      const HeadLayout<T>& grad_q, const HeadLayout<T>& grad_k,
                                      const HeadLayout<T>& grad_v, const CoreOptions<T>& options,
                                      const TalkingHeads<T>& mix, T* grad_pre, T* grad_post,
                                      std::vector<KernelScratch<T>>& scratch) {
  MHA_ASSERT(grad_k.group == k.group && grad_v.group == v.group);
  const Index query_len = q.rows, key_len = k.rows;
  const Index group = k.group;
  const Index block_rows = talking_heads_block_rows(query_len);
  const bool want_pre = mix.pre != nullptr && grad_pre != nullptr;
  const bool want_post = mix.post != nullptr && grad_post != nullptr;
  const bool softcap = options.softcap > T(0);
  const Index mixing = (mix.pre != nullptr ? 2 * heads : 0) + (mix.post != nullptr ? 2 * heads : 0);
  [[maybe_unused]] const double work =
      static_cast<double>(batch * heads) * static_cast<double>(query_len) *
      static_cast<double>(key_len) * static_cast<double>(2 * (q.cols + v.cols) + mixing);
  [[maybe_unused]] const bool parallel =
      worth_threads(batch, work) || (max_threads() > 1 && work >= kMinParallelWork);
  // Each batch row's dpre and dpost: [B, 2, H, H].
  const Index mix_size = heads * heads;
  std::vector<T> partial(want_pre || want_post ? static_cast<std::size_t>(batch * 2 * mix_size)
                                               : 0);
  scratch_for_threads(scratch);
  MHA_OMP_PRAGMA(omp parallel if (parallel)) {
    KernelScratch<T>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.head_probs.resize(heads * block_rows, key_len);
    mine.head_weights.resize(heads * block_rows, key_len);
    if (mix.pre != nullptr || softcap) mine.head_logits.resize(heads * block_rows, key_len);
    if (mix.pre != nullptr && options.any_mask()) mine.scores.resize(block_rows, key_len);
    if (mix.post != nullptr) mine.grad_scores.resize(block_rows, key_len);
    if (softcap) mine.capped.resize(block_rows, key_len);
    mine.exps.resize(key_len);
    mine.row_dot.resize(block_rows);
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index b = 0; b < batch; ++b) {
      // Every block adds to the stored heads' gradients and to this row's dpre and dpost.
      for (Index h = 0; h < heads; h += group) {
        grad_k.at(b, h).setZero();
        grad_v.at(b, h).setZero();
      }
      T* const partial_b = want_pre || want_post ? partial.data() + b * 2 * mix_size : nullptr;
      if (partial_b != nullptr) std::fill(partial_b, partial_b + 2 * mix_size, T(0));
      for (Index row0 = 0; row0 < query_len; row0 += block_rows) {
        const Index rows = std::min(block_rows, query_len - row0);
        talking_heads_probs(b, row0, rows, heads, q, k, options, mix, true, mine);
        auto probs_tile = leading_rows(mine.head_probs, heads * rows);
        auto weights_tile = leading_rows(mine.head_weights, heads * rows);
        const auto probs = heads_as_rows(probs_tile, heads);
        auto mixed = heads_as_rows(weights_tile, heads);
        if (mix.post != nullptr) {
          tile_product<T>(strided(mixed), head_mix(mix.post, heads), Operand::as_stored,
                          const_strided(probs), Operand::as_stored, Accumulate::no);
        } else {
          mixed = probs;
        }
        // grad_v from Wd; then, in Wd's place, dW
        for (Index g = 0; g < heads; ++g) {
          auto weights_g = weights_tile.middleRows(g * rows, rows);
          const auto grad_out_g = grad_out.at(b, g).middleRows(row0, rows);
          if (options.dropout.active()) options.dropout.apply(b, g, row0, 0, weights_g);
          tile_product<T>(grad_v.at(b, g), const_strided(weights_g), Operand::transposed,
                          const_strided(grad_out_g), Operand::as_stored, Accumulate::yes);
          tile_product<T>(strided(weights_g), const_strided(grad_out_g), Operand::as_stored,
                          v.at(b, g), Operand::transposed, Accumulate::no);
          if (options.dropout.active()) options.dropout.apply(b, g, row0, 0, weights_g);
        }
        if (want_post) {
          tile_product<T>(square_block(partial_b + mix_size, heads), const_strided(mixed),
                          Operand::as_stored, const_strided(probs), Operand::transposed,
                          Accumulate::yes);
        }
        // dmixed, head by head in place of P (read only by its own head from here on)
        const auto softmax_backward = [&](auto&& probs_h, const auto& grad_probs_h) {
          auto row_dot = mine.row_dot.head(rows);
          row_dot = (probs_h.array() * grad_probs_h.array()).rowwise().sum().matrix();
          probs_h.array() = probs_h.array() * (grad_probs_h.array().colwise() - row_dot.array());
        };
        for (Index h = 0; h < heads; ++h) {
          auto probs_h = probs_tile.middleRows(h * rows, rows);
          if (mix.post != nullptr) {
            // dP[h] = Σ_g post[g, h] dW[g]: all of dW is still needed by the other heads
            auto grad_probs_h = leading_rows(mine.grad_scores, rows);
            // as one row [1, rows · S'] = post[:, h]ᵀ [1, H] times dW [H, rows · S']
            const ConstStridedMap<T> post_column(mix.post + h, heads, 1,
                                                 Eigen::OuterStride<>(heads));
            tile_product<T>(StridedMap<T>(grad_probs_h.data(), 1, grad_probs_h.size(),
                                          Eigen::OuterStride<>(grad_probs_h.size())),
                            post_column, Operand::transposed, const_strided(mixed),
                            Operand::as_stored, Accumulate::no);
            softmax_backward(probs_h, grad_probs_h);
          } else {
            softmax_backward(probs_h, weights_tile.middleRows(h * rows, rows));
          }
        }
        // dlogits = preᵀ dmixed, in dW's place (dW is spent); without pre, dlogits is dmixed
        if (mix.pre != nullptr) {
          if (want_pre) {
            tile_product<T>(
                square_block(partial_b, heads), const_strided(probs), Operand::as_stored,
                const_strided(heads_as_rows(leading_rows(mine.head_logits, heads * rows), heads)),
                Operand::transposed, Accumulate::yes);
          }
          tile_product<T>(strided(mixed), head_mix(mix.pre, heads), Operand::transposed,
                          const_strided(probs), Operand::as_stored, Accumulate::no);
        }
        auto grad_logits = mix.pre != nullptr ? weights_tile : probs_tile;
        // softcap: d/ds c tanh(s / c) = 1 - (capped / c)², as CoreOptions::softcap_backward, from
        // the capped logits of every head at once
        if (softcap) {
          grad_logits.array() *=
              T(1) -
              (leading_rows(mine.head_logits, heads * rows).array() / options.softcap).square();
        }
        for (Index h = 0; h < heads; ++h) {
          const auto grad_scores_h = grad_logits.middleRows(h * rows, rows);
          const auto q_h = q.at(b, h).middleRows(row0, rows);
          tile_product<T>(strided(grad_q.at(b, h).middleRows(row0, rows)),
                          const_strided(grad_scores_h), Operand::as_stored, k.at(b, h),
                          Operand::as_stored, Accumulate::no, options.scale);
          tile_product<T>(grad_k.at(b, h), const_strided(grad_scores_h), Operand::transposed,
                          const_strided(q_h), Operand::as_stored, Accumulate::yes, options.scale);
        }
      }
    }
  }
  // The batch rows' contributions, summed in batch order.
  const auto sum_rows = [&](T* grad, Index which) {
    Eigen::Map<Matrix<T>> total(grad, heads, heads);
    total.setZero();
    for (Index b = 0; b < batch; ++b) {
      total +=
          Eigen::Map<const Matrix<T>>(partial.data() + (b * 2 + which) * mix_size, heads, heads);
    }
  };
  if (want_pre) sum_rows(grad_pre, 0);
  if (want_post) sum_rows(grad_post, 1);
}

// The instantiations mha::compiled holds (src/kernels_talking_heads.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_TALKING_HEADS_KERNEL_TEMPLATES(PREFIX, T)                                            \
  PREFIX template void attention_talking_heads<T>(                                               \
      Index, Index, const HeadLayout<const T>&, const HeadLayout<const T>&,                      \
      const HeadLayout<const T>&, const HeadLayout<T>&, const CoreOptions<T>&,                   \
      const TalkingHeads<T>&, T*, std::vector<KernelScratch<T>>&);                               \
  PREFIX template void attention_talking_heads_backward<T>(                                      \
      Index, Index, const HeadLayout<const T>&, const HeadLayout<const T>&,                      \
      const HeadLayout<const T>&, const HeadLayout<const T>&, const HeadLayout<T>&,              \
      const HeadLayout<T>&, const HeadLayout<T>&, const CoreOptions<T>&, const TalkingHeads<T>&, \
      T*, T*, std::vector<KernelScratch<T>>&);
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_COMPUTE_TYPES, MHA_TALKING_HEADS_KERNEL_TEMPLATES)

}  // namespace mha::detail
