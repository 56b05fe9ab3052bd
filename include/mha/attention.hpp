// Scaled dot-product attention, the per-head kernel: out = softmax(scale * q kᵀ + mask) v.
//
// This is the reference kernel: for each (batch, head) it stores the [L, S] scores, so it can
// return the attention weights. The layer class composes it with the projections.
#pragma once

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include "mha/mask.hpp"
#include "mha/softmax.hpp"
#include "mha/tensor.hpp"

namespace mha {

namespace detail {

// A (B, H) family of [rows, cols] matrices inside one buffer, each row-major with its rows
// row_stride elements apart. It describes both a contiguous (B, H, L, D) tensor
// (batch_stride H*L*D, head_stride L*D, row_stride D) and the heads of a (B, L, E) tensor
// without copying them (batch_stride L*E, head_stride D, row_stride E). T may be const.
template <class T>
struct HeadLayout {
  using Map = std::conditional_t<std::is_const_v<T>, ConstStridedMap<T>, StridedMap<T>>;
  T* data = nullptr;
  Index batch_stride = 0;
  Index head_stride = 0;
  Index row_stride = 0;
  Index rows = 0;
  Index cols = 0;

  Map at(Index b, Index h) const {
    return Map(offset_pointer(data, b * batch_stride + h * head_stride), rows, cols,
               Eigen::OuterStride<>(row_stride));
  }
};

template <class T>
HeadLayout<T> contiguous_heads(T* data, Index heads, Index rows, Index cols) {
  return {data, heads * rows * cols, rows * cols, cols, rows, cols};
}

// Blocks scores(i, j) for the keys j < causal_cols that query i may not see (see Causal in
// mask.hpp); columns from causal_cols on (bias_k, zero attention) stay visible.
template <class Scores>
void apply_causal(Causal causal, Index causal_cols, Scores& scores) {
  if (causal == Causal::none) return;
  using T = typename Scores::Scalar;
  const Index shift = causal == Causal::bottom_right ? causal_cols - scores.rows() : 0;
  for (Index i = 0; i < scores.rows(); ++i) {
    const Index first_blocked = std::max<Index>(0, i + shift + 1);
    for (Index j = first_blocked; j < causal_cols; ++j) {
      scores(i, j) = -std::numeric_limits<T>::infinity();
    }
  }
}

// What the reference kernel computes besides q, k, v: the masks (each may be kind none),
// causal masking over the first causal_cols keys, and the scale.
template <class T>
struct CoreOptions {
  MaskLayout<T> attn_mask;
  MaskLayout<T> key_padding_mask;
  Causal causal = Causal::none;
  Index causal_cols = 0;
  T scale = T(1);
};

// q is (B, H, L, D), k is (B, H, S, D), v is (B, H, S, Dv), out is (B, H, L, Dv), all as head
// layouts; weights is null or a contiguous (B, H, L, S) buffer for the probabilities.
// Fully masked query rows give zero weights and a zero output row.
template <class T>
void attention_reference(Index batch, Index heads, const HeadLayout<const T>& q,
                         const HeadLayout<const T>& k, const HeadLayout<const T>& v,
                         const HeadLayout<T>& out, const CoreOptions<T>& options, T* weights) {
  const Index query_len = q.rows, key_len = k.rows;
  Matrix<T> scores(query_len, key_len);
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      // pass 1: scaled scores and masks (scale folded into the GEMM's alpha)
      scores.noalias() = options.scale * (q.at(b, h) * k.at(b, h).transpose());
      options.attn_mask.apply(b, h, scores);
      options.key_padding_mask.apply(b, h, scores);
      apply_causal(options.causal, options.causal_cols, scores);
      // pass 2: probabilities, then their weighted sum of values
      softmax_rows_inplace(scores);
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

template <class T>
struct AttentionOptions {
  // [L, S], [H, L, S] or [B, H, L, S] (a leading axis may be 1 to broadcast); any MaskKind.
  Mask<T> mask;
  Causal causal = Causal::none;
  // Multiplies q kᵀ; 1/sqrt(D) when not given.
  std::optional<T> scale;
  bool need_weights = false;
};

template <class T>
struct AttentionResult {
  Tensor<T> output;   // [..., L, Dv], the leading axes of query
  Tensor<T> weights;  // [..., L, S] when need_weights, else empty
};

// query is [..., L, D], key [..., S, D], value [..., S, Dv], where "..." is the same zero, one
// (H) or two (B, H) leading axes for all three. Every head is computed independently.
template <class T>
AttentionResult<T> scaled_dot_product_attention(TensorView<const T> query, TensorView<const T> key,
                                                TensorView<const T> value,
                                                const AttentionOptions<T>& options = {}) {
  const Index rank = query.rank();
  if (rank < 2 || rank > 4)
    detail::throw_shape("query", "[L, D], [H, L, D] or [B, H, L, D]", query.shape());
  const Shape leading(query.shape().begin(), query.shape().end() - 2);
  const Index query_len = query.dim(rank - 2), head_dim = query.dim(rank - 1);
  if (head_dim == 0) detail::throw_shape("query", "a head dimension D >= 1", query.shape());
  Shape expected_key = leading;
  expected_key.push_back(detail::kAnyDim);
  expected_key.push_back(head_dim);
  detail::check_shape("key", expected_key, key.shape());
  const Index key_len = key.dim(rank - 2);
  Shape expected_value = leading;
  expected_value.push_back(key_len);
  expected_value.push_back(detail::kAnyDim);
  detail::check_shape("value", expected_value, value.shape());
  const Index value_dim = value.dim(rank - 1);
  const Index batch = rank == 4 ? query.dim(0) : 1;
  const Index heads = rank >= 3 ? query.dim(rank - 3) : 1;

  detail::CoreOptions<T> core;
  core.scale = options.scale ? *options.scale : T(1) / std::sqrt(static_cast<T>(head_dim));
  if (!std::isfinite(core.scale)) {
    detail::throw_argument("scale", "must be finite, got " + std::to_string(core.scale));
  }
  const std::string accepted =
      "[L, S], [H, L, S] or [B, H, L, S] with L = " + std::to_string(query_len) +
      ", S = " + std::to_string(key_len);
  core.attn_mask = detail::broadcast_mask_layout(options.mask, "mask", batch, heads, query_len,
                                                 key_len, accepted);
  core.causal = options.causal;
  core.causal_cols = key_len;

  Shape output_shape = leading;
  output_shape.push_back(query_len);
  output_shape.push_back(value_dim);
  AttentionResult<T> result;
  result.output = Tensor<T>(output_shape);
  if (options.need_weights) {
    Shape weights_shape = leading;
    weights_shape.push_back(query_len);
    weights_shape.push_back(key_len);
    result.weights = Tensor<T>(weights_shape);
  }
  detail::attention_reference<T>(
      batch, heads, detail::contiguous_heads(query.data(), heads, query_len, head_dim),
      detail::contiguous_heads(key.data(), heads, key_len, head_dim),
      detail::contiguous_heads(value.data(), heads, key_len, value_dim),
      detail::contiguous_heads(result.output.data(), heads, query_len, value_dim), core,
      options.need_weights ? result.weights.data() : nullptr);
  return result;
}

template <class T>
AttentionResult<T> scaled_dot_product_attention(const Tensor<T>& query, const Tensor<T>& key,
                                                const Tensor<T>& value,
                                                const AttentionOptions<T>& options = {}) {
  return scaled_dot_product_attention(query.view(), key.view(), value.view(), options);
}

}  // namespace mha
