// The reference kernel: for each (batch, head) it stores the [L, S'] scores, so it can return
// the attention weights. It is the oracle the flash kernel is tested against, forward and
// backward.
#pragma once

#include "mha/compiled.hpp"
#include "mha/kernels/common.hpp"
#include "mha/kernels/sinks.hpp"
#include "mha/softmax.hpp"

namespace mha::detail {

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
  [[maybe_unused]] const double work = static_cast<double>(tasks) * static_cast<double>(query_len) *
                                       static_cast<double>(key_len) *
                                       static_cast<double>(q.cols + v.cols);
  // One (batch, head) per task, computed whole by one thread: results do not depend on the
  // number of threads.
  scratch_for_threads(scratch);
  MHA_OMP_PRAGMA(omp parallel if (worth_threads(tasks, work))) {
    // This thread's buffers: resized only when the shapes change.
    KernelScratch<T>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.scores.resize(query_len, key_len);
    if (options.softcap > T(0)) mine.capped.resize(query_len, key_len);
    mine.exps.resize(key_len);
    Matrix<T>& scores = mine.scores;
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index task = 0; task < tasks; ++task) {
      const Index b = task / heads, h = task % heads;
      // pass 1: masks and position biases, plus the scaled scores (scale folded into the GEMM's
      // alpha)
      options.masks(b, h, query_len, 0, 0, scores);
      options.add_scores(scores, q.at(b, h), k.at(b, h), mine.capped);
      // pass 2: probabilities (dropped out in training), then their weighted sum of values
      if (options.sinks != nullptr) {
        softmax_rows_with_sink_inplace(scores, options.sinks[h], mine.exps);
      } else {
        softmax_rows_inplace(scores, mine.exps);
      }
      if (options.dropout.active()) options.dropout.apply(b, h, 0, 0, scores);
      tile_product<T>(out.at(b, h), const_strided(scores), Operand::as_stored, v.at(b, h),
                      Operand::as_stored, Accumulate::no);
      if (weights != nullptr) {
        Eigen::Map<Matrix<T>>(weights + (b * heads + h) * query_len * key_len, query_len, key_len) =
            scores;
      }
    }
  }
}

// The backward of attention_reference. grad_out is (B, H, L, Dv); grad_q, grad_k, grad_v have
// the layouts of q, k, v and are overwritten. Per head, recomputing P instead of storing it:
//   forward                          backward
//   S  = scale q kᵀ + masks          grad_q = scale dS k,  grad_k = scale dSᵀ q
//   P  = softmax(S)                  dS = P ∘ (dP - rowsum(P ∘ dP))    (softmax's Jacobian)
//   Pd = P ∘ Z  (dropout, Z=keep/(1-p))  dP = dPd ∘ Z
//   out = Pd v                       dPd = grad_out vᵀ,  grad_v = Pdᵀ grad_out
// A fully masked row has P = 0 and so gives no gradient to anything. Under grouped-query
// attention (k.group > 1) a task is one stored key/value head: its query heads' contributions to
// grad_k and grad_v are summed in one thread, so no two threads write the same rows.
// With sinks (kernels/sinks.hpp), P has the sink column, whose dP is 0: its gradient is
// -Σ_rows P_sink · rowsum(P ∘ dP), which sink_grads [B, H] (null without sinks) receives per task.
template <class T>
void attention_reference_backward(Index batch, Index heads, const HeadLayout<const T>& q,
                                  const HeadLayout<const T>& k, const HeadLayout<const T>& v,
                                  const HeadLayout<const T>& grad_out, const HeadLayout<T>& grad_q,
                                  const HeadLayout<T>& grad_k, const HeadLayout<T>& grad_v,
                                  const CoreOptions<T>& options,
                                  std::vector<KernelScratch<T>>& scratch, T* sink_grads = nullptr) {
  const Index query_len = q.rows, key_len = k.rows;
  const Index group = k.group;
  const Index tasks = batch * (heads / group);
  [[maybe_unused]] const double work =
      2.0 * static_cast<double>(batch * heads) * static_cast<double>(query_len) *
      static_cast<double>(key_len) * static_cast<double>(q.cols + v.cols);
  scratch_for_threads(scratch);
  MHA_OMP_PRAGMA(omp parallel if (worth_threads(tasks, work))) {
    KernelScratch<T>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.scores.resize(query_len, key_len);
    mine.grad_scores.resize(query_len, key_len);
    if (options.softcap > T(0)) mine.capped.resize(query_len, key_len);
    mine.exps.resize(key_len);
    mine.row_dot.resize(query_len);
    mine.row_sum.resize(query_len);  // each row's P_sink, with sinks
    Matrix<T>& probs = mine.scores;
    Matrix<T>& grad_scores = mine.grad_scores;
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index task = 0; task < tasks; ++task) {
      const Index b = task / (heads / group), first_head = (task % (heads / group)) * group;
      const auto k_bh = k.at(b, first_head);
      const auto v_bh = v.at(b, first_head);
      auto grad_k_bh = grad_k.at(b, first_head);
      auto grad_v_bh = grad_v.at(b, first_head);
      for (Index h = first_head; h < first_head + group; ++h) {
        const auto q_bh = q.at(b, h);
        const auto grad_out_bh = grad_out.at(b, h);
        // the group's first head assigns the key/value gradients, the others add to them
        const bool add = h > first_head;
        // P, recomputed as the forward pass computed it
        options.masks(b, h, query_len, 0, 0, probs);
        options.add_scores(probs, q_bh, k_bh, mine.capped);
        if (options.sinks != nullptr) {
          softmax_rows_with_sink_inplace(probs, options.sinks[h], mine.exps, mine.row_sum.data());
        } else {
          softmax_rows_inplace(probs, mine.exps);
        }
        // grad_v from the dropped-out weights Pd = P ∘ Z, built in the dS buffer; then dP = dPd ∘ Z
        const Matrix<T>* dropped = &probs;
        if (options.dropout.active()) {
          grad_scores = probs;
          options.dropout.apply(b, h, 0, 0, grad_scores);
          dropped = &grad_scores;
        }
        const Accumulate onto_group = add ? Accumulate::yes : Accumulate::no;
        tile_product<T>(grad_v_bh, const_strided(*dropped), Operand::transposed, grad_out_bh,
                        Operand::as_stored, onto_group);
        tile_product<T>(strided(grad_scores), grad_out_bh, Operand::as_stored, v_bh,
                        Operand::transposed, Accumulate::no);
        if (options.dropout.active()) options.dropout.apply(b, h, 0, 0, grad_scores);
        // dS = P ∘ (dP - rowsum(P ∘ dP)), in place of dP
        mine.row_dot = (probs.array() * grad_scores.array()).rowwise().sum().matrix();
        if (sink_grads != nullptr) sink_grads[b * heads + h] = -mine.row_sum.dot(mine.row_dot);
        grad_scores.array() =
            probs.array() * (grad_scores.array().colwise() - mine.row_dot.array());
        options.softcap_backward(grad_scores, mine.capped);
        tile_product<T>(grad_q.at(b, h), const_strided(grad_scores), Operand::as_stored, k_bh,
                        Operand::as_stored, Accumulate::no, options.scale);
        tile_product<T>(grad_k_bh, const_strided(grad_scores), Operand::transposed, q_bh,
                        Operand::as_stored, onto_group, options.scale);
      }
    }
  }
}

// The instantiations mha::compiled holds (src/kernels_reference.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_REFERENCE_KERNEL_TEMPLATES(PREFIX, T)                                   \
  PREFIX template void attention_reference<T>(                                      \
      Index, Index, const HeadLayout<const T>&, const HeadLayout<const T>&,         \
      const HeadLayout<const T>&, const HeadLayout<T>&, const CoreOptions<T>&, T*,  \
      std::vector<KernelScratch<T>>&);                                              \
  PREFIX template void attention_reference_backward<T>(                             \
      Index, Index, const HeadLayout<const T>&, const HeadLayout<const T>&,         \
      const HeadLayout<const T>&, const HeadLayout<const T>&, const HeadLayout<T>&, \
      const HeadLayout<T>&, const HeadLayout<T>&, const CoreOptions<T>&,            \
      std::vector<KernelScratch<T>>&, T*);
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_COMPUTE_TYPES, MHA_REFERENCE_KERNEL_TEMPLATES)

}  // namespace mha::detail
