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
// KVCacheFormat::q8 and q4 store them quantized instead, in blocks of 32 values with a scale each
// (kernels/quantized_cache.hpp): about a half (q8) and a quarter (q4) of a 16-bit cache's memory,
// and of the bytes each decoding step reads, which is what bounds a step over a long context.
// The decoding kernel widens them in its registers as it reads them (into a float tile a
// sub-block at a time where AVX-512 is absent); a step of many tokens (a prompt) widens its
// sequence's whole cache into a float buffer first. Every value read back is within half its
// block's scale of the value stored (about max |block| / 254 for q8, / 14 for q4).
//
// A sliding-window cache (window = w >= 0) keeps only the last w keys of each sequence: enough for
// attention whose window looks back w keys (ForwardOptions::window.left <= w), as Mistral decodes.
// A step of n tokens needs w + n rows; capacity 2w makes the rare compaction (moving the kept rows
// to the front of the buffer) cost one row per decoded token on average.
//
// A streaming cache (KVCache::streaming, StreamingLLM) keeps each sequence's first n tokens, the
// attention sinks, and its last w: a step attends to those and its own tokens, and then the
// oldest of the w are dropped. Positions are those inside the cache, as the paper assigns them:
// with tokens 0-3 kept and 6-8 after them, the next token is 7 positions from token 0, not 9.
// Rotary embeddings measure only the distance between a query and a key, and the kept recent
// tokens are contiguous with the new ones, so they keep their rotation at their own positions;
// only the n sink keys must look nearer, and they are rotated again (from an unrotated copy) at
// positions dropped .. dropped + n - 1 each time tokens are dropped: n rows per step, against
// rotating the whole cache at every step. ALiBi and causal masking already count distances in
// the cache's rows.
#pragma once

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mha/errors.hpp"
#include "mha/kernels/bf16_projection.hpp"
#include "mha/kernels/common.hpp"
#include "mha/kernels/decode.hpp"
#include "mha/kernels/int8_gemm.hpp"
#include "mha/kernels/quantized_cache.hpp"
#include "mha/rotary.hpp"
#include "mha/tensor.hpp"

namespace mha {

namespace detail {
template <class T>
struct Decoding;

// A decoding step's buffers, kept by its cache (KVCache, PagedKVCache) and reused while shapes
// repeat, so that steps of the same shapes allocate nothing. They are in the layer's compute
// type (float for a 16-bit cache, whose rows alone are 16-bit); input and output hold a 16-bit
// layer's step in float.
template <class T>
struct DecodeStepBuffers {
  using Compute = compute_t<T>;
  Matrix<Compute> queries, new_keys, new_values, attended, input, output;
  // A streaming cache's sink keys, rotated at the positions a step's eviction gives them.
  Matrix<Compute> sink_keys;
  RopeTable<Compute> rope_table;
  std::vector<KernelScratch<Compute>> kernel;
  // The decoding kernel's sequences and buffers (kernels/decode.hpp).
  std::vector<DecodeSequence<T>> sequences;
  std::vector<DecodeSequence<Q8Block>> q8_sequences;
  std::vector<DecodeSequence<Q4Block>> q4_sequences;
  DecodeScratch decode;
  // A quantized (or paged) cache's rows of one sequence, gathered (and widened) for a step of
  // many tokens.
  Matrix<float> widened_keys, widened_values;
  Matrix<T> gathered_keys, gathered_values;
  // Precision::bf16's and int8's projections of a step (layer/projections.hpp).
  Bf16Scratch bf16;
  Int8Scratch int8;
};
}  // namespace detail

// How a KV cache stores its keys and values (see the top): as the layer's type, or quantized in
// blocks of 32 values with a bfloat16 scale each, as 8-bit codes (34 bytes a block) or 4-bit ones
// (18 bytes a block).
enum class KVCacheFormat { as_layer, q8, q4 };

inline const char* kv_cache_format_name(KVCacheFormat format) {
  switch (format) {
    case KVCacheFormat::q8:
      return "q8";
    case KVCacheFormat::q4:
      return "q4";
    case KVCacheFormat::as_layer:
      break;
  }
  return "as_layer";
}

namespace detail {
// A quantized cache's needs: a layer that computes in float and rows of whole blocks.
template <class T>
void check_quantizable_cache(KVCacheFormat format, Index num_kv_heads, Index head_dim) {
  if (!std::is_same_v<compute_t<T>, float>) {
    throw_argument("format", std::string(kv_cache_format_name(format)) +
                                 " caches are for layers that compute in float");
  }
  if (num_kv_heads * head_dim % kQuantBlock != 0) {
    throw_argument("format", std::string(kv_cache_format_name(format)) +
                                 " quantizes blocks of 32 values of a row: expected H_kv·D a "
                                 "multiple of 32, got " +
                                 std::to_string(num_kv_heads) + "·" + std::to_string(head_dim) +
                                 " = " + std::to_string(num_kv_heads * head_dim));
  }
}

// The rows of keys and of values a cache stores, [rows, H_kv·D] each: in the layer's type, or in
// a quantized format's blocks ([rows, H_kv·D / 32]); only the format's pair is allocated, on huge
// pages (every decoding step reads the whole cache: see Paging).
template <class T>
struct StoredRows {
  Tensor<T> keys, values;
  AlignedBuffer<Q8Block> q8_keys, q8_values;
  AlignedBuffer<Q4Block> q4_keys, q4_values;

  void allocate(KVCacheFormat format, Index rows, Index width) {
    if (format == KVCacheFormat::q8) {
      q8_keys.resize(rows * (width / kQuantBlock), Paging::huge);
      q8_values.resize(rows * (width / kQuantBlock), Paging::huge);
    } else if (format == KVCacheFormat::q4) {
      q4_keys.resize(rows * (width / kQuantBlock), Paging::huge);
      q4_values.resize(rows * (width / kQuantBlock), Paging::huge);
    } else {
      keys.resize({rows, width}, Paging::huge);
      values.resize({rows, width}, Paging::huge);
    }
  }
  // Calls f(buffer, elements per row) for each of the format's two buffers.
  template <class F>
  void for_each(KVCacheFormat format, Index width, F&& f) {
    if (format == KVCacheFormat::q8) {
      f(q8_keys.data(), width / kQuantBlock);
      f(q8_values.data(), width / kQuantBlock);
    } else if (format == KVCacheFormat::q4) {
      f(q4_keys.data(), width / kQuantBlock);
      f(q4_values.data(), width / kQuantBlock);
    } else {
      f(keys.data(), width);
      f(values.data(), width);
    }
  }
  std::size_t bytes() const {
    const auto bytes_of = [](const auto& buffer) {
      return static_cast<std::size_t>(buffer.size()) * sizeof(*buffer.data());
    };
    return bytes_of(keys) + bytes_of(values) + bytes_of(q8_keys) + bytes_of(q8_values) +
           bytes_of(q4_keys) + bytes_of(q4_values);
  }
};
}  // namespace detail

template <class T>
class KVCache {
 public:
  KVCache() = default;
  // batch sequences of at most `capacity` cached tokens each, for H_kv key/value heads of D
  // features; window >= 0 makes it a sliding-window cache keeping the last `window` keys. A
  // quantized format needs H_kv·D to be a multiple of 32 and a layer that computes in float.
  KVCache(Index batch, Index num_kv_heads, Index head_dim, Index capacity, Index window = -1,
          KVCacheFormat format = KVCacheFormat::as_layer)
      : num_kv_heads_(num_kv_heads), head_dim_(head_dim), window_(window), format_(format) {
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
    const Index width = num_kv_heads * head_dim;
    if (quantized()) detail::check_quantizable_cache<T>(format, num_kv_heads, head_dim);
    stored_.allocate(format, batch * capacity, width);
    capacity_ = capacity;
    start_.assign(static_cast<std::size_t>(batch), 0);
    length_.assign(static_cast<std::size_t>(batch), 0);
    position_.assign(static_cast<std::size_t>(batch), 0);
  }

  // A streaming cache (StreamingLLM, see the top): each sequence keeps its first sink_tokens
  // tokens and its last `window`; a step of n tokens needs sink_tokens + window + n rows, and a
  // capacity of sink_tokens + 2·window makes compaction cost about a row per decoded token.
  static KVCache streaming(Index batch, Index num_kv_heads, Index head_dim, Index sink_tokens,
                           Index window, Index capacity,
                           KVCacheFormat format = KVCacheFormat::as_layer) {
    if (sink_tokens < 1) {
      detail::throw_argument("sink_tokens",
                             "expected at least 1 (a cache without sinks is a sliding-window "
                             "cache: pass window to the constructor), got " +
                                 std::to_string(sink_tokens));
    }
    if (window < 0) {
      detail::throw_argument("window",
                             "expected >= 0 recent tokens, got " + std::to_string(window));
    }
    if (capacity <= sink_tokens + window) {
      detail::throw_argument("capacity", "expected at least " +
                                             std::to_string(sink_tokens + window + 1) +
                                             " (sink_tokens + window + one new token), got " +
                                             std::to_string(capacity));
    }
    KVCache cache(batch, num_kv_heads, head_dim, capacity, -1, format);
    cache.window_ = window;
    cache.sink_tokens_ = sink_tokens;
    const auto sink_elements = static_cast<std::size_t>(batch * sink_tokens * cache.width());
    cache.sink_keys_.assign(sink_elements, 0);
    cache.sink_values_.assign(sink_elements, 0);
    cache.sinks_moved_.assign(static_cast<std::size_t>(batch), false);
    return cache;
  }

  Index batch() const { return static_cast<Index>(length_.size()); }
  Index capacity() const { return capacity_; }
  Index num_kv_heads() const { return num_kv_heads_; }
  Index head_dim() const { return head_dim_; }
  // The sliding window (keys kept; a streaming cache's recent tokens), or -1 for a cache that
  // keeps every token.
  Index window() const { return window_; }
  bool sliding() const { return window_ >= 0 && !streaming(); }
  // A streaming cache's first tokens kept (its attention sinks), 0 for any other cache.
  Index sink_tokens() const { return sink_tokens_; }
  bool streaming() const { return sink_tokens_ > 0; }

  // Tokens sequence b has decoded: the position of its next token.
  Index position(Index b) const { return position_[checked(b)]; }
  // Keys sequence b holds now: position(b), or at most the window for a sliding cache (the sinks
  // and the window for a streaming cache).
  Index length(Index b) const { return length_[checked(b)]; }
  KVCacheFormat format() const { return format_; }
  bool quantized() const { return format_ != KVCacheFormat::as_layer; }
  // The bytes that hold the cached keys and values (capacity × H_kv·D of each, in the format's
  // elements or blocks): what a step over a full cache reads.
  std::size_t storage_bytes() const { return stored_.bytes(); }

  // The cached keys and values of sequence b, oldest first: [length(b), H_kv·D], head h in
  // columns h·D .. h·D + D - 1, rotated when the steps used rotary embeddings (a streaming cache's
  // sinks at the positions inside the cache that the next step sees). A quantized cache
  // holds no such rows: read it with dequantized_keys and dequantized_values.
  TensorView<const T> keys(Index b) const { return rows(stored_.keys, b); }
  TensorView<const T> values(Index b) const { return rows(stored_.values, b); }
  // The same rows as float, in any format: a quantized cache's as its codes stand for them.
  Tensor<float> dequantized_keys(Index b) const { return dequantized(b, false); }
  Tensor<float> dequantized_values(Index b) const { return dequantized(b, true); }

  // Forgets sequence b's tokens from `position` on (a rejected speculative draft, a beam that is
  // dropped): its next step continues there. A sliding (streaming) cache can go back only as far
  // as it still holds the window (and the sinks) before that position, as if the later tokens had
  // never been decoded.
  void rewind(Index b, Index position) {
    const auto i = checked(b);
    const Index dropped = position_[i] - length_[i];  // tokens no longer held
    const Index kept = window_ >= 0 ? sink_tokens_ + window_ : 0;
    const Index needed = window_ >= 0 ? std::max<Index>(0, position - kept) : 0;
    if (position < 0 || position > position_[i] || dropped > needed) {
      detail::throw_argument(
          "position", "sequence " + std::to_string(b) + " can rewind to a position in [" +
                          std::to_string(dropped > 0 ? dropped + kept : 0) + ", " +
                          std::to_string(position_[i]) + "], got " + std::to_string(position));
    }
    length_[i] = position - dropped;
    position_[i] = position;
  }

  // Forgets every sequence (or one): the next step starts at position 0.
  void clear() {
    for (Index b = 0; b < batch(); ++b) clear(b);
  }
  void clear(Index b) {
    const auto i = checked(b);
    start_[i] = length_[i] = position_[i] = 0;
    if (streaming()) sinks_moved_[i] = false;
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
  Index width() const { return num_kv_heads_ * head_dim_; }
  TensorView<const T> rows(const Tensor<T>& storage, Index b) const {
    const auto i = checked(b);
    if (quantized()) {
      detail::throw_argument("keys, values",
                             std::string("they view the rows of a cache that "
                                         "stores the layer's type; this one is ") +
                                 kv_cache_format_name(format_) +
                                 ": read it with dequantized_keys() and dequantized_values()");
    }
    return make_view(storage.data() + (b * capacity() + start_[i]) * width(),
                     Shape{length_[i], width()});
  }
  Tensor<float> dequantized(Index b, bool values) const {
    const auto i = checked(b);
    Tensor<float> out({length_[i], width()});
    if (out.size() == 0) return out;
    Matrix<float> tile(length_[i], width());
    if (format_ == KVCacheFormat::q8) {
      detail::dequantize_rows(block_row<detail::Q8Block>(values, b, start_[i]), length_[i], width(),
                              width() / detail::kQuantBlock, tile);
    } else if (format_ == KVCacheFormat::q4) {
      detail::dequantize_rows(block_row<detail::Q4Block>(values, b, start_[i]), length_[i], width(),
                              width() / detail::kQuantBlock, tile);
    } else {
      const T* first =
          (values ? stored_.values : stored_.keys).data() + (b * capacity() + start_[i]) * width();
      for (Index e = 0; e < out.size(); ++e) tile.data()[e] = static_cast<float>(first[e]);
    }
    std::copy(tile.data(), tile.data() + out.size(), out.data());
    return out;
  }
  // Sequence b's row `row` of keys (or values) in a quantized format's blocks.
  template <class Block>
  Block* block_row(bool values, Index b, Index row) {
    return const_cast<Block*>(std::as_const(*this).template block_row<Block>(values, b, row));
  }
  template <class Block>
  const Block* block_row(bool values, Index b, Index row) const {
    const Index blocks = width() / detail::kQuantBlock;
    if constexpr (std::is_same_v<Block, detail::Q8Block>) {
      return (values ? stored_.q8_values : stored_.q8_keys).data() +
             (b * capacity() + row) * blocks;
    } else {
      return (values ? stored_.q4_values : stored_.q4_keys).data() +
             (b * capacity() + row) * blocks;
    }
  }
  // The rows where sequence b's next `count` keys go, making room first: a sliding cache moves
  // the keys it keeps to the front when the free rows after them run out. (Checked by the caller:
  // count fits.)
  Index reserve(Index b, Index count) {
    const auto i = static_cast<std::size_t>(b);
    if (start_[i] + length_[i] + count > capacity()) {
      const auto compact = [&](auto* storage, Index row_elements) {
        auto* base = storage + b * capacity() * row_elements;
        std::copy(base + start_[i] * row_elements, base + (start_[i] + length_[i]) * row_elements,
                  base);
      };
      stored_.for_each(format_, width(), compact);
      start_[i] = 0;
    }
    return start_[i] + length_[i];
  }
  // After a step appended `count` keys to sequence b: a sliding cache drops all but the last
  // window of them; a streaming cache drops the oldest after its sinks, whose rows then begin
  // where the kept ones did. No row moves (a step's kernel may not have read them yet):
  // Decoding's settle writes the sinks there after the step.
  void advance(Index b, Index count) {
    const auto i = static_cast<std::size_t>(b);
    length_[i] += count;
    position_[i] += count;
    const Index kept = sink_tokens_ + window_;
    if (window_ >= 0 && length_[i] > kept) {
      start_[i] += length_[i] - kept;
      length_[i] = kept;
      if (streaming()) sinks_moved_[i] = true;
    }
  }
  // A streaming cache's unrotated sink rows of sequence b, [sink_tokens, H_kv·D].
  detail::compute_t<T>* sink_rows(bool values, Index b) {
    return (values ? sink_values_ : sink_keys_).data() + b * sink_tokens_ * width();
  }
  T* key_row(Index b, Index row) { return stored_.keys.data() + (b * capacity() + row) * width(); }
  T* value_row(Index b, Index row) {
    return stored_.values.data() + (b * capacity() + row) * width();
  }

  Index num_kv_heads_ = 0, head_dim_ = 0, window_ = -1, capacity_ = 0, sink_tokens_ = 0;
  KVCacheFormat format_ = KVCacheFormat::as_layer;
  detail::StoredRows<T> stored_;  // [B · capacity, H_kv·D] rows
  std::vector<Index> start_, length_, position_;
  // A streaming cache's first tokens' keys before rotation and their values, [B, sink_tokens,
  // H_kv·D], in the compute type; and which sequences dropped tokens in the last step, whose
  // sinks settle must write (rotated) before the rows that are kept.
  std::vector<detail::compute_t<T>> sink_keys_, sink_values_;
  std::vector<bool> sinks_moved_;
  // The step's buffers, reused while shapes repeat: a cache belongs to one decoding thread.
  detail::DecodeStepBuffers<T> step_;
};

}  // namespace mha
