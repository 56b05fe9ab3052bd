// Learnable attention sinks (gpt-oss; FlashAttention's learnable_sink): each query head h has a
// logit s_h that joins every row's softmax as one more column whose value vector is zero. A row
// of scores x_j then gives
//   p_j = exp(x_j) / (exp(s_h) + Σ_k exp(x_k)),   out = Σ_j p_j v_j,
// so a head can put weight on "nothing" instead of spreading it over the keys. With
// lse = log Σ_k exp(x_k) (the flash kernel's log-sum-exp) and lse' = log(exp(lse) + exp(s_h)),
// the sink only rescales what the kernel without it gives:
//   out' = out · exp(lse - lse') = out · σ(lse - s_h),   p'_j = exp(x_j - lse'),
// so the flash kernels run unchanged and their row states are corrected once at the end; the
// flash backward, given lse' and out', recomputes p' and needs nothing else. The sink's
// gradient follows from the softmax's Jacobian with the sink column's dP = 0 (its value is zero):
//   d loss / d s_h = Σ_rows p'_sink · (0 - rowdot) = -Σ_rows exp(s_h - lse') (dO · out').
// A row that sees no key gives out' = 0 (all its weight on the sink) and lse' = s_h.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "mha/kernels/common.hpp"
#include "mha/softmax.hpp"

namespace mha::detail {

// log(exp(a) + exp(b)) without overflow; -inf when both are.
template <class T>
T log_add_exp(T a, T b) {
  const T high = std::max(a, b), low = std::min(a, b);
  if (high == -std::numeric_limits<T>::infinity()) return high;
  return high + std::log1p(std::exp(low - high));
}

// Each row of scores [rows, cols] becomes its softmax with the sink logit as one more column;
// sink_probs [rows] (if not null) receives the sink column's probability p'_sink. A row of -inf
// (every key blocked) gives zeros and p'_sink = 1; a NaN row stays NaN.
template <class Scores, class T>
void softmax_rows_with_sink_inplace(Scores& scores, T sink, RowVector<T>& scratch,
                                    T* sink_probs = nullptr) {
  if (scratch.size() < scores.cols()) scratch.resize(scores.cols());
  for (Index r = 0; r < scores.rows(); ++r) {
    auto row = scores.row(r);
    const T row_max = std::max(scores.cols() > 0 ? T(row.maxCoeff()) : sink, sink);
    if (scores.cols() > 0 && row.hasNaN()) {
      row.setConstant(std::numeric_limits<T>::quiet_NaN());
      if (sink_probs != nullptr) sink_probs[r] = std::numeric_limits<T>::quiet_NaN();
      continue;
    }
    // The larger of the row's maximum and the sink contributes exp(0) = 1: the sum is >= 1.
    const T sink_exp = std::exp(sink - row_max);
    const T total =
        (scores.cols() > 0 ? exp_shifted_inplace(row, row_max, scratch) : T(0)) + sink_exp;
    row /= total;
    if (sink_probs != nullptr) sink_probs[r] = sink_exp / total;
  }
}

// A flash kernel's output, made that of attention with sinks: out (B, H, L, Dv) and logsumexp
// (B, H, L, contiguous), in place: out · σ(lse - s_h), lse -> lse' (see the top).
template <class T>
void apply_sinks(Index batch, Index heads, const HeadLayout<T>& out, T* logsumexp, const T* sinks) {
  const Index rows = out.rows;
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      auto out_bh = out.at(b, h);
      T* lse = logsumexp + (b * heads + h) * rows;
      const T sink = sinks[h];
      for (Index i = 0; i < rows; ++i) {
        const T with_sink = log_add_exp(lse[i], sink);
        // exp(-inf) = 0 for a row without a visible key, whose output is 0 already.
        if (!std::isnan(lse[i])) out_bh.row(i) *= std::exp(lse[i] - with_sink);
        lse[i] = std::isnan(lse[i]) ? lse[i] : with_sink;
      }
    }
  }
}

// grad_sinks [H] += d loss / d s_h from the rows of out' (B, H, L, Dv), their gradients
// grad_out and lse' (B, H, L): -Σ_rows exp(s_h - lse') (dO · out').
template <class T>
void accumulate_sink_gradients(Index batch, Index heads, const HeadLayout<const T>& out,
                               const HeadLayout<const T>& grad_out, const T* logsumexp,
                               const T* sinks, T* grad_sinks) {
  const Index rows = out.rows;
  for (Index h = 0; h < heads; ++h) {
    T sum = T(0);
    for (Index b = 0; b < batch; ++b) {
      const auto out_bh = out.at(b, h);
      const auto grad_bh = grad_out.at(b, h);
      const T* lse = logsumexp + (b * heads + h) * rows;
      for (Index i = 0; i < rows; ++i) {
        sum += std::exp(sinks[h] - lse[i]) * out_bh.row(i).dot(grad_bh.row(i));
      }
    }
    grad_sinks[h] -= sum;
  }
}

// A sink logit per query head, or none: each finite.
template <class T>
const T* checked_sinks(const std::vector<T>& sinks, Index heads, const char* name) {
  if (sinks.empty()) return nullptr;
  if (static_cast<Index>(sinks.size()) != heads) {
    throw_shape(name, "one sink logit per query head, [" + std::to_string(heads) + "]",
                {static_cast<Index>(sinks.size())});
  }
  for (const T sink : sinks) {
    if (!std::isfinite(sink)) {
      throw_argument(name, "must be finite, got " + std::to_string(sink));
    }
  }
  return sinks.data();
}

}  // namespace mha::detail
