// Rotary position embeddings (RoPE, Su et al. 2021; Llama, Mistral, GPT-NeoX, GPT-J).
//
// A query or key row at position p has each pair of its first R features (R = rotary_dim, all D
// by default) rotated by the angle p * θ_k, θ_k = base^(-2k / R) for pair k = 0 .. R/2 - 1:
//   (x_a, x_b) -> (x_a cos - x_b sin, x_b cos + x_a sin)
// so that q·k depends on the positions only through their difference. The two layouts differ in
// which features pair up:
//   rotate_half  pair k = (k, k + R/2)      Llama and GPT-NeoX in Hugging Face, FlashAttention's
//                                          default (interleaved=False), CTranslate2's default
//   interleaved  pair k = (2k, 2k + 1)     GPT-J, RoFormer, Meta's Llama (complex numbers)
// Features R .. D - 1 pass through unrotated (partial rotary, GPT-NeoX's rotary_pct).
//
// Angles are computed in double and rounded to T once, so float results are as accurate as
// the rotation allows at any position.
#pragma once

#include <cmath>
#include <string>

#include "mha/errors.hpp"
#include "mha/tensor.hpp"

namespace mha {

enum class RopeLayout { rotate_half, interleaved };

struct Rope {
  double base = 10000;
  RopeLayout layout = RopeLayout::rotate_half;
  // R, the leading features of each head that rotate; 0 = all D. Must be even and at most D.
  Index rotary_dim = 0;
  // Added to every position: the first token of a chunk that continues an earlier sequence.
  Index position_offset = 0;
};

namespace detail {

inline Index checked_rotary_dim(const Rope& rope, Index head_dim) {
  if (!(rope.base > 0) || !std::isfinite(rope.base)) {
    throw_argument("rope.base", "must be finite and positive, got " + std::to_string(rope.base));
  }
  const Index rotary_dim = rope.rotary_dim == 0 ? head_dim : rope.rotary_dim;
  if (rotary_dim < 0 || rotary_dim > head_dim || rotary_dim % 2 != 0) {
    throw_argument("rope.rotary_dim", "must be even and in [0, D = " + std::to_string(head_dim) +
                                          "] (0 = D), got " + std::to_string(rope.rotary_dim));
  }
  return rotary_dim;
}

// The cosines and sines of rows at positions first .. first + rows - 1 (plus the offset), each
// [rows, R/2]: computed once per call and shared by every batch and head.
template <class T>
struct RopeTable {
  Matrix<T> cos, sin;
  RopeLayout layout = RopeLayout::rotate_half;

  // Positions position_offset + first + r for r = 0 .. rows - 1.
  void fill(const Rope& rope, Index rotary_dim, Index first, Index rows) {
    layout = rope.layout;
    const Index pairs = rotary_dim / 2;
    cos.resize(rows, pairs);
    sin.resize(rows, pairs);
    for (Index k = 0; k < pairs; ++k) {
      const double frequency =
          std::pow(rope.base, -2.0 * static_cast<double>(k) / static_cast<double>(rotary_dim));
      for (Index r = 0; r < rows; ++r) {
        const double angle = static_cast<double>(rope.position_offset + first + r) * frequency;
        cos(r, k) = static_cast<T>(std::cos(angle));
        sin(r, k) = static_cast<T>(std::sin(angle));
      }
    }
  }
  Index rows() const { return cos.rows(); }
};

// Rotates, in place, the heads of `rows` rows of data whose rows are row_stride apart: head h is
// columns h*D .. h*D + D - 1, for `heads` heads; row r uses table row r. inverse rotates by the
// negative angle: the gradient of a rotation is its transpose.
template <class T>
void rotate_heads(T* data, Index rows, Index row_stride, Index heads, Index head_dim,
                  const RopeTable<T>& table, bool inverse) {
  MHA_ASSERT(rows <= table.rows());
  const Index pairs = table.cos.cols();
  const bool interleaved = table.layout == RopeLayout::interleaved;
  const Index partner = interleaved ? 1 : pairs;  // where x_b is, relative to x_a
  const T sign = inverse ? T(-1) : T(1);
  for (Index r = 0; r < rows; ++r) {
    const T* cos_row = table.cos.data() + r * pairs;
    const T* sin_row = table.sin.data() + r * pairs;
    for (Index h = 0; h < heads; ++h) {
      T* x = data + r * row_stride + h * head_dim;
      for (Index k = 0; k < pairs; ++k) {
        const Index a = interleaved ? 2 * k : k;
        const T c = cos_row[k], s = sign * sin_row[k];
        const T x_a = x[a], x_b = x[a + partner];
        x[a] = x_a * c - x_b * s;
        x[a + partner] = x_b * c + x_a * s;
      }
    }
  }
}

// x [..., L, D], row l at position first_position + l (plus the offset), every leading index
// (batch, head) alike.
template <class T>
void rope_tensor(TensorView<T> x, const Rope& rope, Index first_position, bool inverse) {
  if (x.rank() < 2) throw_shape("x", "[..., L, D]", x.shape());
  const Index rows = x.dim(x.rank() - 2), head_dim = x.dim(x.rank() - 1);
  const Index rotary_dim = checked_rotary_dim(rope, head_dim);
  if (rows == 0 || x.size() == 0) return;
  RopeTable<T> table;
  table.fill(rope, rotary_dim, first_position, rows);
  const Index matrices = x.size() / (rows * head_dim);
  for (Index m = 0; m < matrices; ++m) {
    rotate_heads(x.data() + m * rows * head_dim, rows, head_dim, 1, head_dim, table, inverse);
  }
}

}  // namespace detail

// Rotates x [..., L, D] in place (queries or keys with their heads split off, as
// scaled_dot_product_attention takes them): row l is at position first_position + l +
// rope.position_offset.
template <class T>
void apply_rope(TensorView<T> x, const Rope& rope, Index first_position = 0) {
  detail::rope_tensor(x, rope, first_position, false);
}

// The backward of apply_rope: turns the gradient with respect to its output, in place, into the
// gradient with respect to its input (the inverse rotation).
template <class T>
void apply_rope_backward(TensorView<T> grad, const Rope& rope, Index first_position = 0) {
  detail::rope_tensor(grad, rope, first_position, true);
}

}  // namespace mha
