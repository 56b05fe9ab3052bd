// Scaled dot-product attention, per head: out = softmax(scale * q kᵀ + mask) v, and the choice
// between the two kernels that compute it:
//   Kernel::reference  stores each head's [L, S] scores; the only one that returns weights
//   Kernel::flash      tiles queries × keys with an online softmax; memory O(block² + block·D)
//   Kernel::automatic  flash unless weights are requested
// Both give the same results within float rounding. The layer class composes them with the
// projections.
#pragma once

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include "mha/kernels/flash.hpp"
#include "mha/kernels/reference.hpp"
#include "mha/mask.hpp"
#include "mha/tensor.hpp"

namespace mha {

enum class Kernel { automatic, reference, flash };

inline const char* kernel_name(Kernel kernel) {
  switch (kernel) {
    case Kernel::automatic:
      return "auto";
    case Kernel::reference:
      return "reference";
    case Kernel::flash:
      return "flash";
  }
  return "unknown";
}

namespace detail {

// The kernel that runs: the flash kernel cannot return weights, so asking for both is refused.
inline Kernel resolve_kernel(Kernel requested, bool need_weights) {
  if (requested == Kernel::flash && need_weights) {
    throw_argument("kernel",
                   "flash does not return attention weights: use Kernel::reference or "
                   "Kernel::automatic with need_weights, or need_weights = false");
  }
  if (requested == Kernel::automatic) return need_weights ? Kernel::reference : Kernel::flash;
  return requested;
}

// Runs the chosen kernel over (B, H) heads; weights as in attention_reference.
template <class T>
void attention(Kernel kernel, Index batch, Index heads, const HeadLayout<const T>& q,
               const HeadLayout<const T>& k, const HeadLayout<const T>& v, const HeadLayout<T>& out,
               const CoreOptions<T>& options, T* weights, std::vector<KernelScratch<T>>& scratch) {
  if (kernel == Kernel::flash) {
    attention_flash<T>(batch, heads, q, k, v, out, options, scratch);
  } else {
    attention_reference<T>(batch, heads, q, k, v, out, options, weights, scratch);
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
  Kernel kernel = Kernel::automatic;
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

  const Kernel kernel = detail::resolve_kernel(options.kernel, options.need_weights);
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
  std::vector<detail::KernelScratch<T>> scratch;
  detail::attention<T>(kernel, batch, heads,
                       detail::contiguous_heads(query.data(), heads, query_len, head_dim),
                       detail::contiguous_heads(key.data(), heads, key_len, head_dim),
                       detail::contiguous_heads(value.data(), heads, key_len, value_dim),
                       detail::contiguous_heads(result.output.data(), heads, query_len, value_dim),
                       core, options.need_weights ? result.weights.data() : nullptr, scratch);
  return result;
}

template <class T>
AttentionResult<T> scaled_dot_product_attention(const Tensor<T>& query, const Tensor<T>& key,
                                                const Tensor<T>& value,
                                                const AttentionOptions<T>& options = {}) {
  return scaled_dot_product_attention(query.view(), key.view(), value.view(), options);
}

}  // namespace mha
