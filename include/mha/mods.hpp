// A library of score_mods and mask_mods for flex_attention (flex.hpp): the attention variants
// the built-in options have, and others, each a small copyable functor. Combine masks with
// mask_and / mask_or, score_mods with score_chain.
//
// Positions: query q_idx is at c = q_idx + offset, where offset is 0 (top-left alignment) or
// S - L (bottom-right: the last query at the last key, as decoding with cached keys needs);
// aligned_offset() computes it. Key kv_idx is at kv_idx.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mha/errors.hpp"
#include "mha/kernels/flex_tile.hpp"
#include "mha/mask.hpp"
#include "mha/tensor.hpp"

namespace mha::mods {

inline Index aligned_offset(Alignment alignment, Index query_len, Index key_len) {
  return alignment == Alignment::bottom_right ? key_len - query_len : 0;
}

// A divisor of zero (a chunk, a dilation, a stride) is refused where the mask_mod is first
// called, which create_block_mask does for every pair before any kernel runs.
[[noreturn]] inline void throw_not_positive(const char* argument, Index value) {
  detail::throw_argument(argument, "must be at least 1, got " + std::to_string(value));
}

// --- mask_mods: (b, h, q_idx, kv_idx) -> visible ---------------------------------------------

// Causal: key kv_idx visible to the query at c when kv_idx <= c.
struct Causal {
  Index offset = 0;
  bool operator()(Index /*b*/, Index /*h*/, Index q_idx, Index kv_idx) const {
    return kv_idx <= q_idx + offset;
  }
};
inline Causal causal(Alignment alignment = Alignment::top_left, Index query_len = 0,
                     Index key_len = 0) {
  return {aligned_offset(alignment, query_len, key_len)};
}

// Sliding window, FlashAttention's inclusive convention (as Window in mask.hpp): visible when
// c - left <= kv_idx <= c + right; a negative size is unbounded on its side. left = w - 1,
// right = 0 is Mistral's causal window of w keys.
struct SlidingWindow {
  Index left = -1;
  Index right = -1;
  Index offset = 0;
  bool operator()(Index /*b*/, Index /*h*/, Index q_idx, Index kv_idx) const {
    const Index c = q_idx + offset;
    return (left < 0 || kv_idx >= c - left) && (right < 0 || kv_idx <= c + right);
  }
};

// Chunked attention (Llama 4's local layers): a query sees the keys of its own chunk of `size`
// positions. Combine with causal for the causal version.
struct Chunked {
  Index size = 1;
  Index offset = 0;
  bool operator()(Index /*b*/, Index /*h*/, Index q_idx, Index kv_idx) const {
    if (size < 1) throw_not_positive("Chunked::size", size);
    return floor_div(q_idx + offset) == floor_div(kv_idx);
  }
  Index floor_div(Index position) const {
    return position >= 0 ? position / size : -((-position + size - 1) / size);
  }
};

// Dilated window (Longformer's dilated heads): |c - kv_idx| <= reach and a multiple of dilation.
struct Dilated {
  Index reach = 0;
  Index dilation = 1;
  Index offset = 0;
  bool operator()(Index /*b*/, Index /*h*/, Index q_idx, Index kv_idx) const {
    if (dilation < 1) throw_not_positive("Dilated::dilation", dilation);
    const Index distance = q_idx + offset - kv_idx;
    return std::abs(distance) <= reach && distance % dilation == 0;
  }
};

// Prefix-LM (T5's and UniLM's): the first `prefix` keys are visible to every query, the rest
// causally.
struct PrefixLm {
  Index prefix = 0;
  Index offset = 0;
  bool operator()(Index /*b*/, Index /*h*/, Index q_idx, Index kv_idx) const {
    return kv_idx < prefix || kv_idx <= q_idx + offset;
  }
};

// Document masking over packed sequences: queries see only the keys of their own document. The
// document of each query and key position, shared between copies.
struct Document {
  std::shared_ptr<const std::vector<Index>> query_document, key_document;
  bool operator()(Index /*b*/, Index /*h*/, Index q_idx, Index kv_idx) const {
    return (*query_document)[static_cast<std::size_t>(q_idx)] ==
           (*key_document)[static_cast<std::size_t>(kv_idx)];
  }
};
// From cumulative lengths 0, L_0, L_0 + L_1, ..., T (as ForwardOptions::cu_seqlens), the same
// for queries and keys, or cu_seqlens_k for the keys.
inline std::vector<Index> documents_of(const std::vector<Index>& cu_seqlens, const char* argument) {
  if (cu_seqlens.empty() || cu_seqlens.front() != 0) {
    detail::throw_argument(argument, "must start with 0");
  }
  std::vector<Index> documents;
  for (std::size_t d = 1; d < cu_seqlens.size(); ++d) {
    if (cu_seqlens[d] < cu_seqlens[d - 1]) {
      detail::throw_argument(argument, "must not decrease; entry " + std::to_string(d) + " is " +
                                           std::to_string(cu_seqlens[d]) + " after " +
                                           std::to_string(cu_seqlens[d - 1]));
    }
    documents.insert(documents.end(), static_cast<std::size_t>(cu_seqlens[d] - cu_seqlens[d - 1]),
                     static_cast<Index>(d - 1));
  }
  return documents;
}
inline Document document(const std::vector<Index>& cu_seqlens,
                         const std::vector<Index>& cu_seqlens_k = {}) {
  auto queries = std::make_shared<const std::vector<Index>>(documents_of(cu_seqlens, "cu_seqlens"));
  if (cu_seqlens_k.empty()) return {queries, queries};
  if (cu_seqlens_k.size() != cu_seqlens.size()) {
    detail::throw_argument("cu_seqlens_k", "must have as many entries as cu_seqlens (" +
                                               std::to_string(cu_seqlens.size()) + "), got " +
                                               std::to_string(cu_seqlens_k.size()));
  }
  return {queries,
          std::make_shared<const std::vector<Index>>(documents_of(cu_seqlens_k, "cu_seqlens_k"))};
}

// 2D neighbourhood attention (NATTEN) over a height × width grid of tokens in row-major order:
// each query sees the kernel_height × kernel_width window around it, shifted inward at the
// grid's edges so that every query sees the same number of keys.
struct Neighbourhood2d {
  Index height = 1, width = 1, kernel_height = 1, kernel_width = 1;
  bool operator()(Index /*b*/, Index /*h*/, Index q_idx, Index kv_idx) const {
    const Index row = q_idx / width, col = q_idx % width;
    const Index key_row = kv_idx / width, key_col = kv_idx % width;
    const Index first_row = window_start(row, kernel_height, height);
    const Index first_col = window_start(col, kernel_width, width);
    return key_row >= first_row && key_row < first_row + kernel_height && key_col >= first_col &&
           key_col < first_col + kernel_width;
  }
  static Index window_start(Index position, Index kernel, Index extent) {
    const Index start = position - kernel / 2;
    return start < 0 ? 0 : (start + kernel > extent ? extent - kernel : start);
  }
};
inline Neighbourhood2d neighbourhood_2d(Index height, Index width, Index kernel_height,
                                        Index kernel_width) {
  if (height < 1 || width < 1 || kernel_height < 1 || kernel_width < 1 || kernel_height > height ||
      kernel_width > width) {
    detail::throw_argument("kernel_height, kernel_width",
                           "must be between 1 and the grid's " + std::to_string(height) + " x " +
                               std::to_string(width) + ", got " + std::to_string(kernel_height) +
                               " x " + std::to_string(kernel_width));
  }
  return {height, width, kernel_height, kernel_width};
}

// The Sparse Transformer's strided ("transpose", column) pattern: keys a multiple of stride
// positions away; with a width-`stride` local window it gives the paper's two heads.
struct Strided {
  Index stride = 1;
  Index offset = 0;
  bool operator()(Index /*b*/, Index /*h*/, Index q_idx, Index kv_idx) const {
    if (stride < 1) throw_not_positive("Strided::stride", stride);
    return (q_idx + offset - kv_idx) % stride == 0;
  }
};

template <class A, class B>
struct MaskAnd {
  A first;
  B second;
  bool operator()(Index b, Index h, Index q_idx, Index kv_idx) const {
    return first(b, h, q_idx, kv_idx) && second(b, h, q_idx, kv_idx);
  }
};
template <class A, class B>
struct MaskOr {
  A first;
  B second;
  bool operator()(Index b, Index h, Index q_idx, Index kv_idx) const {
    return first(b, h, q_idx, kv_idx) || second(b, h, q_idx, kv_idx);
  }
};
template <class A, class B>
MaskAnd<A, B> mask_and(A first, B second) {
  return {std::move(first), std::move(second)};
}
template <class A, class B>
MaskOr<A, B> mask_or(A first, B second) {
  return {std::move(first), std::move(second)};
}

// --- score_mods: (score, b, h, q_idx, kv_idx) -> score, generic in the score's type ------------

// ALiBi: score - slope_h |c - kv_idx|, one slope per query head (alibi_slopes<T>(H) in
// attention.hpp gives the paper's).
template <class T>
struct Alibi {
  std::vector<T> slopes;
  Index offset = 0;
  template <class Score>
  Score operator()(Score score, Index /*b*/, Index h, Index q_idx, Index kv_idx) const {
    return score -
           slopes[static_cast<std::size_t>(h)] * static_cast<T>(std::abs(q_idx + offset - kv_idx));
  }
  // A row's integer distances converted as it goes, a loop the compiler vectorises (Eigen's
  // LinSpaced took 1.12x the built-in ALiBi's time on a Zen 4, bench/RESULTS.md).
  template <class S>
  void modify_row(ScoreRow<S> scores, Index /*b*/, Index h, Index q_idx, Index kv_first) const {
    const auto slope = static_cast<S>(slopes[static_cast<std::size_t>(h)]);
    const Index centre = q_idx + offset - kv_first;
    S* row = scores.data();
    for (Index j = 0; j < scores.size(); ++j) {
      row[j] -= slope * static_cast<S>(std::abs(centre - j));
    }
  }
};

// ALiBi with learned slopes: Alibi's score, and the slopes' gradient from the backward
// (AttentionGradients::score_mod, [H]).
template <class T>
struct LearnedAlibi : Alibi<T> {
  std::size_t parameter_count() const { return this->slopes.size(); }
  void accumulate_gradient(T* gradient, T grad_score, T /*score*/, Index /*b*/, Index h,
                           Index q_idx, Index kv_idx) const {
    gradient[h] -= grad_score * static_cast<T>(std::abs(q_idx + this->offset - kv_idx));
  }
};

// A learned bias per head and clipped relative position (Shaw et al. 2018; T5's table without
// its buckets): score + table[h, clamp(kv_idx - c, -reach, reach) + reach], table [H, 2 reach + 1]
// row-major. Its gradient from the backward is the table's (AttentionGradients::score_mod).
template <class T>
struct RelativeBias {
  std::vector<T> table;
  Index reach = 0;
  Index offset = 0;
  Index column(Index q_idx, Index kv_idx) const {
    return std::clamp(kv_idx - q_idx - offset, -reach, reach) + reach;
  }
  template <class Score>
  Score operator()(Score score, Index /*b*/, Index h, Index q_idx, Index kv_idx) const {
    return score + table[static_cast<std::size_t>(h * (2 * reach + 1) + column(q_idx, kv_idx))];
  }
  std::size_t parameter_count() const { return table.size(); }
  void accumulate_gradient(T* gradient, T grad_score, T /*score*/, Index /*b*/, Index h,
                           Index q_idx, Index kv_idx) const {
    gradient[h * (2 * reach + 1) + column(q_idx, kv_idx)] += grad_score;
  }
};

// T5's bucket of a relative position (Raffel et al. 2020), relative = kv_idx - c: of
// num_buckets, bidirectional (T5's encoder) gives half to keys before the query and half to keys
// after it; unidirectional (its decoder) counts only keys before it, later ones sharing bucket
// 0. Within a direction, distances below half its buckets have one each, and the rest are
// log-spaced up to max_distance, beyond which all share the last. Computed in float32, as T5's
// implementations in PyTorch compute it, so that the boundaries fall where theirs do
// (tests/reference/generate_t5.py holds torch's buckets).
inline Index t5_bucket(Index relative, Index num_buckets, Index max_distance, bool bidirectional) {
  Index bucket = 0, distance = -relative;  // how far before the query the key is
  if (bidirectional) {
    num_buckets /= 2;
    if (distance < 0) bucket += num_buckets;
    distance = std::abs(distance);
  } else {
    distance = std::max<Index>(distance, 0);
  }
  const Index max_exact = num_buckets / 2;
  if (distance < max_exact) return bucket + distance;
  const float logs = std::log(static_cast<float>(distance) / static_cast<float>(max_exact)) /
                     static_cast<float>(std::log(static_cast<double>(max_distance) /
                                                 static_cast<double>(max_exact))) *
                     static_cast<float>(num_buckets - max_exact);
  return bucket + std::min(max_exact + static_cast<Index>(logs), num_buckets - 1);
}

// T5's relative-position bias: score + table[h, t5_bucket(kv_idx - c, ...)], table [H,
// num_buckets] row-major, learned (its gradient from the backward is the table's). Make it with
// t5_bias, which computes the buckets of every relative position once.
template <class T>
struct T5Bias {
  std::vector<T> table;
  Index num_buckets = 32, max_distance = 128, offset = 0;
  // The bucket of relative position r at r + max_distance, r clamped to [-max_distance,
  // max_distance] (farther positions share the bucket of the nearest end).
  std::shared_ptr<const std::vector<Index>> buckets;

  Index column(Index q_idx, Index kv_idx) const {
    const Index relative = std::clamp(kv_idx - q_idx - offset, -max_distance, max_distance);
    return (*buckets)[static_cast<std::size_t>(relative + max_distance)];
  }
  template <class Score>
  Score operator()(Score score, Index /*b*/, Index h, Index q_idx, Index kv_idx) const {
    return score + table[static_cast<std::size_t>(h * num_buckets + column(q_idx, kv_idx))];
  }
  std::size_t parameter_count() const { return table.size(); }
  void accumulate_gradient(T* gradient, T grad_score, T /*score*/, Index /*b*/, Index h,
                           Index q_idx, Index kv_idx) const {
    gradient[h * num_buckets + column(q_idx, kv_idx)] += grad_score;
  }
};
// table [H · num_buckets] (T5's relative_attention_bias weight [num_buckets, H] transposed);
// num_buckets of at least 2 (4 bidirectional) and max_distance above the exact distances.
template <class T>
T5Bias<T> t5_bias(std::vector<T> table, Index num_buckets = 32, Index max_distance = 128,
                  bool bidirectional = true, Index offset = 0) {
  const Index exact = (bidirectional ? num_buckets / 2 : num_buckets) / 2;
  if (exact < 1) {
    detail::throw_argument("num_buckets", "must be at least " +
                                              std::string(bidirectional ? "4" : "2") + ", got " +
                                              std::to_string(num_buckets));
  }
  if (max_distance <= exact) {
    detail::throw_argument("max_distance", "must exceed the " + std::to_string(exact) +
                                               " exact distances, got " +
                                               std::to_string(max_distance));
  }
  if (table.empty() || table.size() % static_cast<std::size_t>(num_buckets) != 0) {
    detail::throw_argument("table", "expected H · num_buckets = H · " +
                                        std::to_string(num_buckets) + " values, got " +
                                        std::to_string(table.size()));
  }
  std::vector<Index> buckets;
  for (Index relative = -max_distance; relative <= max_distance; ++relative) {
    buckets.push_back(t5_bucket(relative, num_buckets, max_distance, bidirectional));
  }
  return {std::move(table), num_buckets, max_distance, offset,
          std::make_shared<const std::vector<Index>>(std::move(buckets))};
}

// Logit soft-capping (Gemma 2): cap tanh(score / cap).
template <class T>
struct Softcap {
  T cap = T(1);
  template <class Score>
  Score operator()(Score score, Index /*b*/, Index /*h*/, Index /*q_idx*/, Index /*kv_idx*/) const {
    using std::tanh;
    return cap * tanh(score / cap);
  }
  template <class S>
  void modify_row(ScoreRow<S> scores, Index /*b*/, Index /*h*/, Index /*q_idx*/,
                  Index /*kv_first*/) const {
    scores = static_cast<S>(cap) * (scores / static_cast<S>(cap)).tanh();
  }
};

// second(first(score)).
template <class A, class B>
struct ScoreChain {
  A first;
  B second;
  template <class Score>
  Score operator()(Score score, Index b, Index h, Index q_idx, Index kv_idx) const {
    return second(first(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx);
  }
};
template <class A, class B>
ScoreChain<A, B> score_chain(A first, B second) {
  return {std::move(first), std::move(second)};
}

}  // namespace mha::mods
