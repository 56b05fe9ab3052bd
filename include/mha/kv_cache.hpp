// KVCache<T>: the projected (and rotated) keys and values of the tokens a self-attention layer
// has decoded so far, per sequence, so that each decoding step projects only its new tokens and
// attends to the cache (MultiHeadAttention::decode).
//
// Each of the B sequences has its own length: sequences of a batch may hold prompts of different
// lengths and advance together without padding. Storage is fixed at construction, [B, capacity,
// H_kv·D] for keys and for values, and a step that would overflow it is refused before anything
// changes.
//
// The cache stores T: a MultiHeadAttention<Eigen::half> or <Eigen::bfloat16> keeps its keys and
// values in 16 bits, half the memory and bandwidth of float, and converts each block to float
// as the flash kernel reads it.
//
// A sliding-window cache (window = w >= 0) keeps only the last w keys of each sequence: enough for
// attention whose window looks back w keys (ForwardOptions::window.left <= w), as Mistral decodes.
// A step of n tokens needs w + n rows; capacity 2w makes the rare compaction (moving the kept rows
// to the front of the buffer) cost one row per decoded token on average.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "mha/errors.hpp"
#include "mha/kernels/bf16_projection.hpp"
#include "mha/kernels/common.hpp"
#include "mha/kernels/decode.hpp"
#include "mha/kernels/int8_gemm.hpp"
#include "mha/rotary.hpp"
#include "mha/tensor.hpp"

namespace mha {

namespace detail {
template <class T>
struct Decoding;
}  // namespace detail

template <class T>
class KVCache {
 public:
  KVCache() = default;
  // batch sequences of at most `capacity` cached tokens each, for H_kv key/value heads of D
  // features; window >= 0 makes it a sliding-window cache keeping the last `window` keys.
  KVCache(Index batch, Index num_kv_heads, Index head_dim, Index capacity, Index window = -1)
      : num_kv_heads_(num_kv_heads), head_dim_(head_dim), window_(window) {
    if (batch < 1)
      detail::throw_argument("batch", "expected at least 1, got " + std::to_string(batch));
    if (num_kv_heads < 1 || head_dim < 1) {
      detail::throw_argument("num_kv_heads, head_dim", "expected positive, got " +
                                                           std::to_string(num_kv_heads) + ", " +
                                                           std::to_string(head_dim));
    }
    if (window < -1) {
      detail::throw_argument(
          "window", "expected -1 (keep every token) or >= 0, got " + std::to_string(window));
    }
    if (capacity < 1 || (window >= 0 && capacity <= window)) {
      detail::throw_argument(
          "capacity",
          "expected at least " + std::to_string(window >= 0 ? window + 1 : 1) +
              (window >= 0 ? " (the window, " + std::to_string(window) + ", plus one new token)"
                           : "") +
              ", got " + std::to_string(capacity));
    }
    // On huge pages: every decoding step reads the whole cache (see Paging).
    keys_.resize({batch, capacity, num_kv_heads * head_dim}, Paging::huge);
    values_.resize({batch, capacity, num_kv_heads * head_dim}, Paging::huge);
    start_.assign(static_cast<std::size_t>(batch), 0);
    length_.assign(static_cast<std::size_t>(batch), 0);
    position_.assign(static_cast<std::size_t>(batch), 0);
  }

  Index batch() const { return static_cast<Index>(length_.size()); }
  Index capacity() const { return keys_.rank() == 3 ? keys_.dim(1) : 0; }
  Index num_kv_heads() const { return num_kv_heads_; }
  Index head_dim() const { return head_dim_; }
  // The sliding window (keys kept), or -1 for a cache that keeps every token.
  Index window() const { return window_; }
  bool sliding() const { return window_ >= 0; }

  // Tokens sequence b has decoded: the position of its next token.
  Index position(Index b) const { return position_[checked(b)]; }
  // Keys sequence b holds now: position(b), or at most the window for a sliding cache.
  Index length(Index b) const { return length_[checked(b)]; }
  // The cached keys and values of sequence b, oldest first: [length(b), H_kv·D], head h in
  // columns h·D .. h·D + D - 1, rotated when the steps used rotary embeddings.
  TensorView<const T> keys(Index b) const { return rows(keys_, b); }
  TensorView<const T> values(Index b) const { return rows(values_, b); }

  // Forgets sequence b's tokens from `position` on (a rejected speculative draft, a beam that is
  // dropped): its next step continues there. A sliding cache can go back only as far as it still
  // holds the window before that position.
  void rewind(Index b, Index position) {
    const auto i = checked(b);
    const Index first = position_[i] - length_[i];  // the position of the oldest key held
    const Index needed = sliding() ? std::max<Index>(0, position - window_) : 0;
    if (position < 0 || position > position_[i] || first > needed) {
      detail::throw_argument(
          "position", "sequence " + std::to_string(b) + " can rewind to a position in [" +
                          std::to_string(sliding() && first > 0 ? first + window_ : 0) + ", " +
                          std::to_string(position_[i]) + "], got " + std::to_string(position));
    }
    length_[i] = position - first;
    position_[i] = position;
  }

  // Forgets every sequence (or one): the next step starts at position 0.
  void clear() {
    for (Index b = 0; b < batch(); ++b) clear(b);
  }
  void clear(Index b) {
    const auto i = checked(b);
    start_[i] = length_[i] = position_[i] = 0;
  }

 private:
  friend struct detail::Decoding<T>;  // a decoding step writes the rows and uses the buffers

  std::size_t checked(Index b) const {
    if (b < 0 || b >= batch()) {
      detail::throw_argument("b", "expected a sequence in [0, " + std::to_string(batch()) +
                                      "), got " + std::to_string(b));
    }
    return static_cast<std::size_t>(b);
  }
  TensorView<const T> rows(const Tensor<T>& storage, Index b) const {
    const auto i = checked(b);
    const Index width = storage.dim(2);
    return make_view(storage.data() + (b * capacity() + start_[i]) * width,
                     Shape{length_[i], width});
  }
  // The rows where sequence b's next `count` keys go, making room first: a sliding cache moves
  // the keys it keeps to the front when the free rows after them run out. (Checked by the caller:
  // count fits.)
  Index reserve(Index b, Index count) {
    const auto i = static_cast<std::size_t>(b);
    if (start_[i] + length_[i] + count > capacity()) {
      const Index width = keys_.dim(2);
      for (Tensor<T>* storage : {&keys_, &values_}) {
        T* base = storage->data() + b * capacity() * width;
        std::copy(base + start_[i] * width, base + (start_[i] + length_[i]) * width, base);
      }
      start_[i] = 0;
    }
    return start_[i] + length_[i];
  }
  // After a step appended `count` keys to sequence b: a sliding cache drops all but the last
  // window of them.
  void advance(Index b, Index count) {
    const auto i = static_cast<std::size_t>(b);
    length_[i] += count;
    position_[i] += count;
    if (sliding() && length_[i] > window_) {
      start_[i] += length_[i] - window_;
      length_[i] = window_;
    }
  }
  T* key_row(Index b, Index row) { return keys_.data() + (b * capacity() + row) * keys_.dim(2); }
  T* value_row(Index b, Index row) {
    return values_.data() + (b * capacity() + row) * values_.dim(2);
  }

  Index num_kv_heads_ = 0, head_dim_ = 0, window_ = -1;
  Tensor<T> keys_, values_;  // [B, capacity, H_kv·D]
  std::vector<Index> start_, length_, position_;
  // The step's buffers, reused while shapes repeat: a cache belongs to one decoding thread. They
  // are in the layer's compute type (float for a 16-bit cache, whose keys_ and values_ alone
  // are 16-bit); input_ and output_ hold a 16-bit layer's step in float.
  using Compute = detail::compute_t<T>;
  Matrix<Compute> queries_, new_keys_, new_values_, attended_, input_, output_;
  detail::RopeTable<Compute> rope_table_;
  std::vector<detail::KernelScratch<Compute>> kernel_;
  // The decoding kernel's sequences and buffers (kernels/decode.hpp).
  std::vector<detail::DecodeSequence<T>> decode_sequences_;
  detail::DecodeScratch decode_;
  // Precision::bf16's and int8's projections of a step (layer/projections.hpp).
  detail::Bf16Scratch bf16_;
  detail::Int8Scratch int8_;
};

}  // namespace mha
