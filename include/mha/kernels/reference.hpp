// The reference kernel: for each (batch, head) it stores the [L, S'] scores, so it can return
// the attention weights. It is the oracle the flash kernel is tested against.
#pragma once

#include "mha/kernels/common.hpp"
#include "mha/softmax.hpp"

namespace mha {

namespace detail {

// q is (B, H, L, D), k is (B, H, S, D), v is (B, H, S, Dv), out is (B, H, L, Dv), all as head
// layouts; weights is null or a contiguous (B, H, L, S) buffer for the probabilities.
// Fully masked query rows give zero weights and a zero output row.
template <class T>
void attention_reference(Index batch, Index heads, const HeadLayout<const T>& q,
                         const HeadLayout<const T>& k, const HeadLayout<const T>& v,
                         const HeadLayout<T>& out, const CoreOptions<T>& options, T* weights,
                         std::vector<KernelScratch<T>>& scratch) {
  const Index query_len = q.rows, key_len = k.rows;
  const Index tasks = batch * heads;
  // One (batch, head) per task, computed whole by one thread: results do not depend on the
  // number of threads.
  scratch_for_threads(scratch);
  MHA_OMP_PRAGMA(omp parallel if (tasks > 1)) {
    // This thread's buffers: resized only when the shapes change.
    KernelScratch<T>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.scores.resize(query_len, key_len);
    mine.exps.resize(key_len);
    Matrix<T>& scores = mine.scores;
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index task = 0; task < tasks; ++task) {
      const Index b = task / heads, h = task % heads;
      // pass 1: scaled scores and masks (scale folded into the GEMM's alpha)
      scores.noalias() = options.scale * (q.at(b, h) * k.at(b, h).transpose());
      options.attn_mask.apply(b, h, 0, 0, scores);
      options.key_padding_mask.apply(b, h, 0, 0, scores);
      apply_causal(options.causal, options.causal_cols, query_len, 0, 0, scores);
      // pass 2: probabilities, then their weighted sum of values
      softmax_rows_inplace(scores, mine.exps);
      auto out_bh = out.at(b, h);
      out_bh.noalias() = scores * v.at(b, h);
      if (weights != nullptr) {
        Eigen::Map<Matrix<T>>(weights + (b * heads + h) * query_len * key_len, query_len, key_len) =
            scores;
      }
    }
  }
}

}  // namespace detail
}  // namespace mha
