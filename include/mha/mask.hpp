// Attention masks whose polarity is part of their name.
//
// PyTorch has two opposite conventions for boolean masks, and mixing them up silently gives
// wrong attention (pytorch#170400, #120668):
//   nn.MultiheadAttention:                 true = BLOCKED (the key is ignored)
//   F.scaled_dot_product_attention (SDPA): true = ALLOWED (the key is attended to)
// Here a boolean mask cannot be made without saying which one it is:
//   Mask<T>::blocked_where_true(m)   PyTorch MHA's convention (attn_mask, key_padding_mask)
//   Mask<T>::allowed_where_true(m)   SDPA's convention
//   Mask<T>::additive(m)             float mask added to the scores; -inf blocks a key
// Every entry point accepts all three kinds, so a mask exported from either PyTorch API keeps
// its meaning as long as it is wrapped with the matching name.
//
// Causal masking has two alignments, which differ when L != S:
//   Causal::top_left      query i sees keys j <= i             (PyTorch SDPA is_causal)
//   Causal::bottom_right  query i sees keys j <= i + S - L     (FlashAttention >= 2.1; what a
//                                                                KV-cache decode step needs)
#pragma once

#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "mha/tensor.hpp"

namespace mha {

enum class MaskKind { none, blocked_where_true, allowed_where_true, additive };

enum class Causal { none, top_left, bottom_right };

// Which corner of the [L, S] score matrix the diagonal of a causal mask or window starts from:
// top_left aligns query i with key i, bottom_right with key i + S - L (see Causal above).
enum class Alignment { top_left, bottom_right };

// Local (sliding-window) attention with FlashAttention's inclusive convention: query i sees
// keys j with  c - left <= j <= c + right,  c = i (top_left) or i + S - L (bottom_right);
// a negative size is unbounded on that side (FlashAttention's -1). left = w - 1, right = 0 is a
// causal sliding window of w keys (Mistral). It combines with causal masking and masks: a key
// is visible only where all of them allow it. Keys from bias_k and zero attention stay visible.
// dilation d > 1 makes it dilated (strided, as Longformer's dilated windows): within those bounds
// only keys at a distance |c - j| that is a multiple of d are visible (the diagonal always is).
struct Window {
  Index left = -1;
  Index right = -1;
  Alignment alignment = Alignment::top_left;
  Index dilation = 1;

  bool active() const { return left >= 0 || right >= 0 || dilation > 1; }
};

// Sparse attention patterns over positions (a query's position is i, or i + S - L with
// alignment bottom_right; input key j is at j). Both parts are optional and combine with the
// window:
//   global_tokens  positions that see every key and that every query sees (Longformer's and
//                  BigBird's global attention, or StreamingLLM's attention sinks next to a
//                  window): they override the window and the block layout.
//   block_layout   block-sparse attention (Sparse Transformer, DeepSpeed's and Triton's
//                  block-sparse kernels): [R, C] or [H, R, C] booleans, true = computed, over
//                  block_size x block_size blocks; the query at position c sees key j only where
//                  layout[(h,) c / block_size, j / block_size] is true (and the window allows).
//                  It must cover every position: R * block_size > the last query's position and
//                  C * block_size >= S, so one layout made for the longest sequence serves every
//                  shorter one, and decoding. (Refused with bottom_right when L > S: the first
//                  queries would be at negative positions.)
// Causal masking and masks still apply to global tokens: a key the causal mask hides stays
// hidden. Keys from bias_k and zero attention stay visible. The flash kernel never computes a
// block of scores that the pattern hides from all of its queries.
struct SparsePattern {
  std::vector<Index> global_tokens;
  Index block_size = 0;
  Tensor<bool> block_layout;
  Alignment alignment = Alignment::top_left;

  bool active() const { return !global_tokens.empty() || !block_layout.is_null(); }
};

namespace detail {

inline void check_window(const Window& window) {
  if (window.dilation < 1) {
    throw_argument("window.dilation",
                   "must be at least 1 (1 = every key), got " + std::to_string(window.dilation));
  }
}

}  // namespace detail

inline const char* mask_kind_name(MaskKind kind) {
  switch (kind) {
    case MaskKind::none:
      return "none";
    case MaskKind::blocked_where_true:
      return "boolean, true = blocked";
    case MaskKind::allowed_where_true:
      return "boolean, true = allowed";
    case MaskKind::additive:
      return "additive";
  }
  return "unknown";
}

// An owning mask of one of the kinds above. A default-constructed Mask means "no mask".
template <class T>
class Mask {
 public:
  Mask() = default;

  static Mask blocked_where_true(Tensor<bool> mask) {
    return Mask(MaskKind::blocked_where_true, std::move(mask), Tensor<T>());
  }
  static Mask blocked_where_true(const TensorView<const bool>& mask) {
    return blocked_where_true(Tensor<bool>(mask));
  }
  static Mask allowed_where_true(Tensor<bool> mask) {
    return Mask(MaskKind::allowed_where_true, std::move(mask), Tensor<T>());
  }
  static Mask allowed_where_true(const TensorView<const bool>& mask) {
    return allowed_where_true(Tensor<bool>(mask));
  }
  static Mask additive(Tensor<T> mask) {
    return Mask(MaskKind::additive, Tensor<bool>(), std::move(mask));
  }
  static Mask additive(TensorView<const T> mask) { return additive(Tensor<T>(mask)); }

  MaskKind kind() const { return kind_; }
  bool empty() const { return kind_ == MaskKind::none; }
  const Shape& shape() const {
    return kind_ == MaskKind::additive ? values_.shape() : bools_.shape();
  }
  Index rank() const { return static_cast<Index>(shape().size()); }
  const Tensor<bool>& booleans() const { return bools_; }
  const Tensor<T>& values() const { return values_; }

 private:
  Mask(MaskKind kind, Tensor<bool> bools, Tensor<T> values)
      : kind_(kind), bools_(std::move(bools)), values_(std::move(values)) {}

  MaskKind kind_ = MaskKind::none;
  Tensor<bool> bools_;
  Tensor<T> values_;
};

namespace detail {

// Where one (b, h) slice of a mask lives, with broadcast axes given stride 0. A mask covers
// the first `cols` key columns; later columns (bias_k, zero attention) are never masked by it.
template <class T>
struct MaskLayout {
  MaskKind kind = MaskKind::none;
  const bool* bools = nullptr;
  const T* values = nullptr;
  Index batch_stride = 0;
  Index head_stride = 0;
  Index row_stride = 0;
  Index cols = 0;

  // tile holds the scores of queries row0.. and keys col0.. of head (b, h); adds the mask to it:
  // -inf where blocked. Keys from `cols` on are not covered by the mask.
  template <class Tile>
  void apply(Index b, Index h, Index row0, Index col0, Tile& tile) const {
    if (kind == MaskKind::none || col0 >= cols) return;
    constexpr T kBlocked = -std::numeric_limits<T>::infinity();
    const Index width = std::min(cols - col0, tile.cols());
    const Index offset = b * batch_stride + h * head_stride + col0;
    for (Index i = 0; i < tile.rows(); ++i) {
      const Index row = offset + (row0 + i) * row_stride;
      if (kind == MaskKind::additive) {
        tile.row(i).head(width) += Eigen::Map<const RowVector<T>>(values + row, width);
        continue;
      }
      const bool blocked_value = kind == MaskKind::blocked_where_true;
      for (Index j = 0; j < width; ++j) {
        if (bools[row + j] == blocked_value) tile(i, j) = kBlocked;
      }
    }
  }
};

template <class T>
MaskLayout<T> make_mask_layout(const Mask<T>& mask, Index batch_stride, Index head_stride,
                               Index row_stride, Index cols) {
  MaskLayout<T> layout;
  layout.kind = mask.kind();
  layout.bools = mask.kind() == MaskKind::additive ? nullptr : mask.booleans().data();
  layout.values = mask.kind() == MaskKind::additive ? mask.values().data() : nullptr;
  layout.batch_stride = batch_stride;
  layout.head_stride = head_stride;
  layout.row_stride = row_stride;
  layout.cols = cols;
  return layout;
}

// The layout of `mask` as an [L = rows, S = cols] mask broadcast over (B, H) by PyTorch's rules:
// its shape is [L, S], [H, L, S] or [B, H, L, S], where a leading axis may also be 1. Throws a
// ShapeError naming `argument` and listing the `accepted` shapes otherwise.
template <class T>
MaskLayout<T> broadcast_mask_layout(const Mask<T>& mask, const char* argument, Index batch,
                                    Index heads, Index rows, Index cols,
                                    const std::string& accepted) {
  if (mask.empty()) return MaskLayout<T>();
  const Shape& shape = mask.shape();
  const std::size_t rank = shape.size();
  if (rank < 2 || rank > 4 || shape[rank - 2] != rows || shape[rank - 1] != cols) {
    throw_shape(argument, accepted, shape);
  }
  const Index mask_batch = rank == 4 ? shape[0] : 1;
  const Index mask_heads = rank >= 3 ? shape[rank - 3] : 1;
  if ((mask_batch != 1 && mask_batch != batch) || (mask_heads != 1 && mask_heads != heads)) {
    throw_shape(argument, accepted, shape);
  }
  return make_mask_layout(mask, mask_batch == 1 ? 0 : mask_heads * rows * cols,
                          mask_heads == 1 ? 0 : rows * cols, cols, cols);
}

}  // namespace detail
}  // namespace mha
