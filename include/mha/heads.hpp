// Splitting the feature axis into heads and merging it back.
//
// Head h owns feature columns [h*D, (h+1)*D) of every row, as in PyTorch. Two ways to get at
// a head:
//   - head_view: a zero-copy [L, D] Eigen map into the (B, L, E) tensor with outer stride E;
//   - split_heads / merge_heads: (B, L, E) <-> (B, H, L, D) copies into contiguous buffers,
//     for kernels that want each head's rows adjacent.
// merge_heads(split_heads(x, H)) == x exactly: both only move elements.
#pragma once

#include <string>

#include "mha/tensor.hpp"

namespace mha {

namespace detail {

inline Index checked_head_dim(Index embed_dim, Index num_heads, const char* argument) {
  if (num_heads <= 0) {
    throw_argument(argument, "num_heads must be positive, got " + std::to_string(num_heads));
  }
  if (embed_dim % num_heads != 0) {
    throw_argument(argument, "embed_dim " + std::to_string(embed_dim) +
                                 " is not divisible by num_heads " + std::to_string(num_heads));
  }
  return embed_dim / num_heads;
}

}  // namespace detail

// x is (B, L, E); returns head h of batch b as an [L, D] map with outer stride E.
template <class T>
ConstStridedMap<T> head_view(TensorView<const T> x, Index num_heads, Index b, Index h) {
  if (x.rank() != 3) detail::throw_shape("x", "rank 3 [B, L, E]", x.shape());
  const Index head_dim = detail::checked_head_dim(x.dim(2), num_heads, "x");
  if (b < 0 || b >= x.dim(0) || h < 0 || h >= num_heads) {
    detail::throw_argument("head_view", "batch " + std::to_string(b) + ", head " +
                                            std::to_string(h) + " out of range for " +
                                            detail::format_shape(x.shape()));
  }
  const Index seq = x.dim(1), embed = x.dim(2);
  return ConstStridedMap<T>(detail::offset_pointer(x.data(), b * seq * embed + h * head_dim), seq,
                            head_dim, Eigen::OuterStride<>(embed));
}

template <class T>
StridedMap<T> head_view(TensorView<T> x, Index num_heads, Index b, Index h) {
  const ConstStridedMap<T> view = head_view(TensorView<const T>(x), num_heads, b, h);
  return StridedMap<T>(const_cast<T*>(view.data()), view.rows(), view.cols(),
                       Eigen::OuterStride<>(view.outerStride()));
}

// x is (B, L, E); returns (B, H, L, D) with out(b, h, l, d) = x(b, l, h*D + d).
template <class T>
Tensor<T> split_heads(TensorView<const T> x, Index num_heads) {
  if (x.rank() != 3) detail::throw_shape("x", "rank 3 [B, L, E]", x.shape());
  const Index head_dim = detail::checked_head_dim(x.dim(2), num_heads, "x");
  const Index batch = x.dim(0), seq = x.dim(1);
  Tensor<T> out({batch, num_heads, seq, head_dim});
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < num_heads; ++h) {
      Eigen::Map<Matrix<T>>(out.data() + (b * num_heads + h) * seq * head_dim, seq, head_dim) =
          head_view(x, num_heads, b, h);
    }
  }
  return out;
}

// x is (B, H, L, D); returns (B, L, E = H*D), the inverse of split_heads.
template <class T>
Tensor<T> merge_heads(TensorView<const T> x) {
  if (x.rank() != 4) detail::throw_shape("x", "rank 4 [B, H, L, D]", x.shape());
  const Index batch = x.dim(0), num_heads = x.dim(1), seq = x.dim(2), head_dim = x.dim(3);
  Tensor<T> out({batch, seq, num_heads * head_dim});
  if (num_heads == 0) return out;
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < num_heads; ++h) {
      head_view(out.view(), num_heads, b, h) = Eigen::Map<const Matrix<T>>(
          x.data() + (b * num_heads + h) * seq * head_dim, seq, head_dim);
    }
  }
  return out;
}

template <class T>
Tensor<T> split_heads(const Tensor<T>& x, Index num_heads) {
  return split_heads(x.view(), num_heads);
}
template <class T>
Tensor<T> merge_heads(const Tensor<T>& x) {
  return merge_heads(x.view());
}

}  // namespace mha
