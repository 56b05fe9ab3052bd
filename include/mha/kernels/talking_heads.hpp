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
// Since every mixed head reads every head of its batch row, a task is one batch row, and its
// thread keeps the row's H [L, S'] blocks of logits, probabilities and weights at once.
#pragma once

#include <vector>

#include "mha/kernels/common.hpp"
#include "mha/softmax.hpp"

namespace mha {

namespace detail {

// An [H * L, S'] buffer whose head h is the [L, S'] block at rows h * L, seen as [H, L * S']:
// head h is then row h, and mixing the heads with an [H, H] matrix is one product.
template <class T>
Eigen::Map<Matrix<T>> heads_as_rows(Matrix<T>& blocks, Index heads) {
  return Eigen::Map<Matrix<T>>(blocks.data(), heads, heads == 0 ? 0 : blocks.size() / heads);
}

template <class T>
Eigen::Map<const Matrix<T>> head_mix(const T* mix, Index heads) {
  return Eigen::Map<const Matrix<T>>(mix, heads, heads);
}

// Batch row b's probabilities P, [H * L, S'], into mine.head_probs. q is (B, H, L, D), k is
// (B, H, S', D) as head layouts. mine.head_logits receives the logits [H * L, S'] (capped when
// softcap) when pre is active, and also with keep_capped under softcap (for its derivative).
// mine.head_probs, mine.exps, and as needed head_logits, capped and scores ([L, S']) are sized.
template <class T>
void talking_heads_probs(Index b, Index heads, const HeadLayout<const T>& q,
                         const HeadLayout<const T>& k, const CoreOptions<T>& options,
                         const TalkingHeads<T>& mix, bool keep_capped, KernelScratch<T>& mine) {
  const Index query_len = q.rows, key_len = k.rows;
  if (mix.pre != nullptr) {
    // pass 1: every head's logits, as each mixed head reads all of them
    for (Index h = 0; h < heads; ++h) {
      auto logits_h = mine.head_logits.middleRows(h * query_len, query_len);
      logits_h.setZero();
      options.add_scores(logits_h, q.at(b, h), k.at(b, h), mine.capped);
    }
    // pass 2: the mixed logits, then each mixed head's masks on top
    heads_as_rows(mine.head_probs, heads).noalias() =
        head_mix(mix.pre, heads) * heads_as_rows(mine.head_logits, heads);
    if (options.any_mask()) {
      for (Index g = 0; g < heads; ++g) {
        options.masks(b, g, query_len, 0, 0, mine.scores);
        mine.head_probs.middleRows(g * query_len, query_len) += mine.scores;
      }
    }
  } else {
    // Without pre, the scores are built by the same operations as attention_reference's (masks,
    // then the scaled scores added by one product), so that a null pre reproduces it bit for bit.
    for (Index g = 0; g < heads; ++g) {
      auto mixed_g = mine.head_probs.middleRows(g * query_len, query_len);
      options.masks(b, g, query_len, 0, 0, mixed_g);
      options.add_scores(mixed_g, q.at(b, g), k.at(b, g), mine.capped);
      if (keep_capped && options.softcap > T(0)) {
        mine.head_logits.middleRows(g * query_len, query_len) =
            mine.capped.topLeftCorner(query_len, key_len);
      }
    }
  }
  // pass 3: the softmax, row by row (fully masked rows become zero)
  softmax_rows_inplace(mine.head_probs, mine.exps);
}

// Forward. q is (B, H, L, D), k is (B, H, S', D), v is (B, H, S', Dv), out is (B, H, L, Dv), all
// as head layouts (k and v may be grouped: k.group query heads per stored head); weights is null
// or a contiguous (B, H, L, S') buffer for Wd. options.dropout numbers positions over (B, H, L,
// S'). pre and post of `mix` are [H, H].
template <class T>
void attention_talking_heads(Index batch, Index heads, const HeadLayout<const T>& q,
                             const HeadLayout<const T>& k, const HeadLayout<const T>& v,
                             const HeadLayout<T>& out, const CoreOptions<T>& options,
                             const TalkingHeads<T>& mix, T* weights,
                             std::vector<KernelScratch<T>>& scratch) {
  const Index query_len = q.rows, key_len = k.rows;
  const Index mixing = (mix.pre != nullptr ? heads : 0) + (mix.post != nullptr ? heads : 0);
  [[maybe_unused]] const double work =
      static_cast<double>(batch * heads) * static_cast<double>(query_len) *
      static_cast<double>(key_len) * static_cast<double>(q.cols + v.cols + mixing);
  // A region even for a single batch row (where worth_threads says no): outside one, Eigen would
  // thread the large products itself, with a depth blocking, and so a rounding, that depends on
  // the thread count. One batch row per task, computed whole by one thread: results do not
  // depend on the number of threads.
  [[maybe_unused]] const bool parallel =
      worth_threads(batch, work) || (max_threads() > 1 && work >= kMinParallelWork);
  scratch_for_threads(scratch);
  MHA_OMP_PRAGMA(omp parallel if (parallel)) {
    // This thread's buffers: resized only when the shapes change.
    KernelScratch<T>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.head_probs.resize(heads * query_len, key_len);
    if (mix.pre != nullptr) {
      mine.head_logits.resize(heads * query_len, key_len);
      if (options.any_mask()) mine.scores.resize(query_len, key_len);
    }
    if (mix.post != nullptr) mine.head_weights.resize(heads * query_len, key_len);
    if (options.softcap > T(0)) mine.capped.resize(query_len, key_len);
    mine.exps.resize(key_len);
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index b = 0; b < batch; ++b) {
      talking_heads_probs(b, heads, q, k, options, mix, false, mine);
      // W = post P; without post W is P itself, dropped out in place (P is not needed again)
      Matrix<T>& mixed = mix.post != nullptr ? mine.head_weights : mine.head_probs;
      if (mix.post != nullptr) {
        heads_as_rows(mine.head_weights, heads).noalias() =
            head_mix(mix.post, heads) * heads_as_rows(mine.head_probs, heads);
      }
      for (Index g = 0; g < heads; ++g) {
        auto weights_g = mixed.middleRows(g * query_len, query_len);
        if (options.dropout.active()) options.dropout.apply(b, g, 0, 0, weights_g);
        auto out_g = out.at(b, g);
        out_g.noalias() = weights_g * v.at(b, g);
      }
      if (weights != nullptr) {
        Eigen::Map<Matrix<T>>(weights + b * heads * query_len * key_len, heads * query_len,
                              key_len) = mixed;
      }
    }
  }
}

// Backward of attention_talking_heads. grad_out is (B, H, L, Dv); grad_q, grad_k, grad_v have
// the layouts of q, k, v (grad_k.group == k.group) and are overwritten: a stored key/value head
// receives the sum over its query heads. grad_pre, grad_post: null or [H, H], overwritten with
// dLoss/dpre and dLoss/dpost (ignored when that mix is null). Per batch row, recomputing the
// forward instead of storing it:
//   forward                              backward
//   out_g  = Wd[g] v_g                   dWd[g] = dO_g v_gᵀ,  grad_v_g += Wd[g]ᵀ dO_g
//   Wd[g]  = W[g] ∘ Z                    dW[g] = dWd[g] ∘ Z
//   W[g]   = Σ_h post[g, h] P[h]         dP[h] = Σ_g post[g, h] dW[g],  dpost[g, h] = <dW[g], P[h]>
//   P[g]   = softmax(mixed[g])           dmixed[g] = P[g] ∘ (dP[g] - rowsum(P[g] ∘ dP[g]))
//   mixed[g] = Σ_h pre[g, h] logits[h]   dlogits[h] = Σ_g pre[g, h] dmixed[g],
//              + masks                   dpre[g, h] = <dmixed[g], logits[h]>
//   logits[h] = c tanh(s / c)            ds = dlogits ∘ (1 - (logits / c)²)
//   s = scale q_h k_hᵀ                   grad_q_h = scale ds k_h,  grad_k_h += scale dsᵀ q_h
// dpre and dpost are summed over batch rows in batch order after the parallel region, so they do
// not depend on the thread count either.
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
    mine.head_probs.resize(heads * query_len, key_len);
    mine.head_weights.resize(heads * query_len, key_len);
    if (mix.pre != nullptr || softcap) mine.head_logits.resize(heads * query_len, key_len);
    if (mix.pre != nullptr && options.any_mask()) mine.scores.resize(query_len, key_len);
    if (mix.post != nullptr) mine.grad_scores.resize(query_len, key_len);
    if (softcap) mine.capped.resize(query_len, key_len);
    mine.exps.resize(key_len);
    mine.row_dot.resize(query_len);
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index b = 0; b < batch; ++b) {
      talking_heads_probs(b, heads, q, k, options, mix, true, mine);
      const auto probs = heads_as_rows(mine.head_probs, heads);
      auto mixed = heads_as_rows(mine.head_weights, heads);
      if (mix.post != nullptr) {
        mixed.noalias() = head_mix(mix.post, heads) * probs;
      } else {
        mixed = probs;
      }
      // grad_v from Wd; then, in Wd's place, dW
      for (Index g = 0; g < heads; ++g) {
        auto weights_g = mine.head_weights.middleRows(g * query_len, query_len);
        const auto grad_out_g = grad_out.at(b, g);
        if (options.dropout.active()) options.dropout.apply(b, g, 0, 0, weights_g);
        // the group's first query head assigns its stored head's gradients, the others add
        auto grad_v_g = grad_v.at(b, g);
        if (g % group != 0) {
          grad_v_g.noalias() += weights_g.transpose() * grad_out_g;
        } else {
          grad_v_g.noalias() = weights_g.transpose() * grad_out_g;
        }
        weights_g.noalias() = grad_out_g * v.at(b, g).transpose();
        if (options.dropout.active()) options.dropout.apply(b, g, 0, 0, weights_g);
      }
      T* const partial_b = want_pre || want_post ? partial.data() + b * 2 * mix_size : nullptr;
      if (want_post) {
        Eigen::Map<Matrix<T>>(partial_b + mix_size, heads, heads).noalias() =
            mixed * probs.transpose();
      }
      // dmixed, head by head in place of P (read only by its own head from here on)
      const auto softmax_backward = [&](auto&& probs_h, const auto& grad_probs_h) {
        mine.row_dot = (probs_h.array() * grad_probs_h.array()).rowwise().sum().matrix();
        probs_h.array() = probs_h.array() * (grad_probs_h.array().colwise() - mine.row_dot.array());
      };
      for (Index h = 0; h < heads; ++h) {
        auto probs_h = mine.head_probs.middleRows(h * query_len, query_len);
        if (mix.post != nullptr) {
          // dP[h] = Σ_g post[g, h] dW[g]: all of dW is still needed by the other heads
          Eigen::Map<RowVector<T>>(mine.grad_scores.data(), query_len * key_len).noalias() =
              head_mix(mix.post, heads).col(h).transpose() * mixed;
          softmax_backward(probs_h, mine.grad_scores);
        } else {
          softmax_backward(probs_h, mine.head_weights.middleRows(h * query_len, query_len));
        }
      }
      // dlogits = preᵀ dmixed, in dW's place (dW is spent); without pre, dlogits is dmixed
      Matrix<T>* grad_logits = &mine.head_probs;
      if (mix.pre != nullptr) {
        const auto grad_mixed = heads_as_rows(mine.head_probs, heads);
        if (want_pre) {
          Eigen::Map<Matrix<T>>(partial_b, heads, heads).noalias() =
              grad_mixed * heads_as_rows(mine.head_logits, heads).transpose();
        }
        mixed.noalias() = head_mix(mix.pre, heads).transpose() * grad_mixed;
        grad_logits = &mine.head_weights;
      }
      // softcap: d/ds c tanh(s / c) = 1 - (capped / c)², as CoreOptions::softcap_backward, from
      // the capped logits of every head at once
      if (softcap) {
        grad_logits->array() *= T(1) - (mine.head_logits.array() / options.softcap).square();
      }
      for (Index h = 0; h < heads; ++h) {
        const auto grad_scores_h = grad_logits->middleRows(h * query_len, query_len);
        const auto q_h = q.at(b, h);
        auto grad_q_h = grad_q.at(b, h);
        grad_q_h.noalias() = options.scale * (grad_scores_h * k.at(b, h));
        auto grad_k_h = grad_k.at(b, h);
        if (h % group != 0) {
          grad_k_h.noalias() += options.scale * (grad_scores_h.transpose() * q_h);
        } else {
          grad_k_h.noalias() = options.scale * (grad_scores_h.transpose() * q_h);
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

}  // namespace detail
}  // namespace mha
