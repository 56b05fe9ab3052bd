// Decoding with a KV cache: each step projects only the new tokens x [B, n, E] (or [n, E] for a
// cache of one sequence), appends their keys and values [n, H_kv·D] (rotated at their absolute
// positions) to each sequence's cache (kv_cache.hpp), and attends to that sequence's cached
// [length, H_kv·D] keys and values, bottom-right aligned: the output is that of one causal
// forward over the whole sequence, for the new tokens.
#pragma once

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/finite.hpp"
#include "mha/kernels/decode.hpp"
#include "mha/kv_cache.hpp"
#include "mha/layer/forward.hpp"
#include "mha/layer/parameters.hpp"
#include "mha/layer/projections.hpp"
#include "mha/rotary.hpp"

namespace mha::detail {

// The decoding room: a struct rather than free functions because it reads the cache's own rows
// and buffers (KVCache befriends it).
template <class T>
struct Decoding {
  using Compute = compute_t<T>;

  // One step; new_tokens (empty, or one count per sequence) as MultiHeadAttention::decode;
  // packed: null, or a frozen layer's packed weights: its bf16 panels under Precision::bf16 (which
  // the layer, whose weights would be packed at every step, refuses) and its int8 weights.
  static ForwardResult<T> step(const LayerParameters<T>& parameters, const TensorView<const T>& x,
                               KVCache<T>& cache, const ForwardOptions<T>& options,
                               const std::vector<Index>& new_tokens,
                               const PackedProjections* packed = nullptr);

  // A step's `count` new rows of keys and values [count, H_kv·D] into sequence b's cache from row
  // `first`: narrowed to the layer's type, or quantized.
  static void store_rows(KVCache<T>& cache, Index b, Index first, Index count, const Compute* keys,
                         const Compute* values) {
    const Index width = cache.width();
    if constexpr (std::is_same_v<Compute, float>) {
      if (cache.format() == KVCacheFormat::q8) {
        quantize_rows(keys, count, width, cache.template block_row<Q8Block>(false, b, first));
        quantize_rows(values, count, width, cache.template block_row<Q8Block>(true, b, first));
        return;
      }
      if (cache.format() == KVCacheFormat::q4) {
        quantize_rows(keys, count, width, cache.template block_row<Q4Block>(false, b, first));
        quantize_rows(values, count, width, cache.template block_row<Q4Block>(true, b, first));
        return;
      }
    }
    narrow(keys, count * width, cache.key_row(b, first));
    narrow(values, count * width, cache.value_row(b, first));
  }

  // A quantized cache's rows [start, start + rows) of sequence b, widened into its float buffers.
  static void widen_cached(KVCache<T>& cache, Index b, Index start, Index rows) {
    const Index width = cache.width(), blocks = width / kQuantBlock;
    cache.widened_keys_.resize(rows, width);
    cache.widened_values_.resize(rows, width);
    if (cache.format() == KVCacheFormat::q8) {
      dequantize_rows(cache.template block_row<Q8Block>(false, b, start), rows, width, blocks,
                      cache.widened_keys_);
      dequantize_rows(cache.template block_row<Q8Block>(true, b, start), rows, width, blocks,
                      cache.widened_values_);
    } else {
      dequantize_rows(cache.template block_row<Q4Block>(false, b, start), rows, width, blocks,
                      cache.widened_keys_);
      dequantize_rows(cache.template block_row<Q4Block>(true, b, start), rows, width, blocks,
                      cache.widened_values_);
    }
  }

  // Every check of a step, before anything changes; returns n.
  static Index check(const LayerParameters<T>& parameters, const TensorView<const T>& x,
                     const KVCache<T>& cache, const ForwardOptions<T>& options,
                     const std::vector<Index>& new_tokens);
};

template <class T>
ForwardResult<T> Decoding<T>::step(const LayerParameters<T>& parameters,
                                   const TensorView<const T>& x, KVCache<T>& cache,
                                   const ForwardOptions<T>& options,
                                   const std::vector<Index>& new_tokens,
                                   const PackedProjections* packed) {
  const Index heads = parameters.num_heads(), head_dim = parameters.head_dim();
  const Index width = parameters.kv_dim(), inner = parameters.inner_dim();
  const Index batch = cache.batch();
  const Index steps = check(parameters, x, cache, options, new_tokens);
  if (options.precision != Precision::fp32 && packed == nullptr) {
    throw_argument("precision",
                   std::string("decode computes in ") + precision_name(options.precision) +
                       " on weights packed once, which a layer does not keep (it would pack them "
                       "at every step): decode through a FrozenMultiHeadAttention, or with "
                       "Precision::fp32");
  }
  // A frozen layer's projections by its packings: in bf16 by its bf16 panels (where the CPU has
  // AVX512_BF16), in int8 by its int8 panels, or by its int8 values for a few rows
  // (FrozenWeights::int8); the attention over the cache stays fp32, bound by reading the cache
  // rather than by products.
  const ProjectionArithmetic arithmetic = projection_arithmetic(options.precision, packed);
  cache.bf16_.forget();
  const auto route = [&](int which) {
    return projection_route(packed, arithmetic, cache.bf16_, cache.int8_, which);
  };
  const Kernel kernel = layer_kernel(parameters, options.kernel, false);
  const Index rotary_dim = options.rope ? checked_rotary_dim(*options.rope, head_dim) : 0;
  CoreOptions<Compute> core;
  core.scale = Compute(1) / std::sqrt(static_cast<Compute>(head_dim));
  core.causal = options.is_causal ? Causal::bottom_right : Causal::none;
  core.window = options.window;
  core.window.alignment = Alignment::bottom_right;
  core.alibi_slopes = checked_alibi_slopes(options.alibi_slopes, heads);
  core.alibi_alignment = Alignment::bottom_right;
  core.softcap = checked_softcap(options.softcap);
  core.talking_heads = parameters.talking_heads();

  // Every sequence's n rows projected at once; padding rows too (cheaper than gathering).
  const auto input = as_compute(x, cache.input_);  // [B*n, E]
  Matrix<Compute>* projected[] = {&cache.queries_, &cache.new_keys_, &cache.new_values_};
  for (int which = 0; which < 3; ++which) {
    projected[which]->resize(input.rows(), parameters.projection_width(which));
    project_rows<Compute>(strided(*projected[which]), const_strided(input),
                          parameters.weight_rows(which), route(which), cache.kernel_);
    add_bias(parameters, *projected[which], which);
  }
  cache.attended_.resize(input.rows(), inner);
  cache.attended_.setZero();

  // Sequences of a few new tokens go to the decoding kernel together, in one parallel pass
  // (kernels/decode.hpp); longer steps (a prompt) and what that kernel does not compute go to
  // attention() one sequence at a time.
  bool batched = false;
  if constexpr (std::is_same_v<Compute, float>) {
    batched = kernel == Kernel::flash && !options.pattern.active() && decode_kernel_applies(core);
  }
  cache.decode_sequences_.clear();
  cache.q8_sequences_.clear();
  cache.q4_sequences_.clear();
  for (Index b = 0; b < batch; ++b) {
    const Index count = new_tokens.empty() ? steps : new_tokens[static_cast<std::size_t>(b)];
    if (count == 0) continue;
    Compute* queries = cache.queries_.data() + b * steps * inner;
    Compute* keys = cache.new_keys_.data() + b * steps * width;
    Compute* values = cache.new_values_.data() + b * steps * width;
    if (options.rope) {
      cache.rope_table_.fill(*options.rope, rotary_dim, cache.position(b), count);
      rotate_heads(queries, count, inner, heads, head_dim, cache.rope_table_, false);
      rotate_heads(keys, count, width, parameters.num_kv_heads(), head_dim, cache.rope_table_,
                   false);
    }
    const Index first = cache.reserve(b, count);
    store_rows(cache, b, first, count, keys, values);
    const Index start = cache.start_[static_cast<std::size_t>(b)];
    const Index total_keys = first + count - start;
    Compute* attended = cache.attended_.data() + b * steps * inner;
    if constexpr (std::is_same_v<Compute, float>) {
      if (batched && count < kPanelsMinQueries) {
        // (advance() below moves no rows: these stay where they are until the kernel has run.)
        if (cache.format() == KVCacheFormat::q8) {
          cache.q8_sequences_.push_back(
              {queries, attended, cache.template block_row<Q8Block>(false, b, start),
               cache.template block_row<Q8Block>(true, b, start), count, total_keys});
        } else if (cache.format() == KVCacheFormat::q4) {
          cache.q4_sequences_.push_back(
              {queries, attended, cache.template block_row<Q4Block>(false, b, start),
               cache.template block_row<Q4Block>(true, b, start), count, total_keys});
        } else {
          cache.decode_sequences_.push_back({queries, attended, cache.key_row(b, start),
                                             cache.value_row(b, start), count, total_keys});
        }
        cache.advance(b, count);
        continue;
      }
    }
    core.causal_cols = total_keys;
    core.pattern =
        checked_pattern(options.pattern, heads, count, total_keys, Alignment::bottom_right);
    const auto queries_layout =
        parameters.template head_layout<const Compute>(queries, count, inner);
    const auto attended_layout = parameters.head_layout(attended, count, inner);
    bool widened = false;  // (only a cache of a layer computing in float is quantized)
    if constexpr (std::is_same_v<Compute, float>) {
      if (cache.quantized()) {
        // A step of many tokens: the sequence's cache widened once, then the flash kernel.
        widen_cached(cache, b, start, total_keys);
        attention<Compute>(kernel, 1, heads, queries_layout,
                           parameters.template kv_head_layout<const float>(
                               cache.widened_keys_.data(), total_keys, width),
                           parameters.template kv_head_layout<const float>(
                               cache.widened_values_.data(), total_keys, width),
                           attended_layout, core, nullptr, cache.kernel_);
        widened = true;
      }
    }
    if (!widened) {
      attention<Compute>(
          kernel, 1, heads, queries_layout,
          parameters.template kv_head_layout<const T>(cache.key_row(b, start), total_keys, width),
          parameters.template kv_head_layout<const T>(cache.value_row(b, start), total_keys, width),
          attended_layout, core, nullptr, cache.kernel_);
    }
    cache.advance(b, count);
  }
  if constexpr (std::is_same_v<Compute, float>) {
    // kv_stride counts the cache's elements, or its blocks for a quantized cache.
    const DecodeShape shape{heads, parameters.num_kv_heads(), head_dim, head_dim, inner, inner,
                            width};
    DecodeShape block_shape = shape;
    block_shape.kv_stride = width / kQuantBlock;
    if (!cache.decode_sequences_.empty()) {
      decode_attention(cache.decode_sequences_, shape, core, cache.kernel_, cache.decode_);
    }
    if (!cache.q8_sequences_.empty()) {
      decode_attention(cache.q8_sequences_, block_shape, core, cache.kernel_, cache.decode_);
    }
    if (!cache.q4_sequences_.empty()) {
      decode_attention(cache.q4_sequences_, block_shape, core, cache.kernel_, cache.decode_);
    }
  }

  scale_heads(cache.attended_, options.head_gate, head_dim);
  ForwardResult<T> result;
  result.output.resize(x.shape());
  project_output(parameters, cache.attended_, result.output, cache.output_, cache.kernel_,
                 route(3));
  auto output = result.output.matrix();
  for (Index b = 0; b < batch && !new_tokens.empty(); ++b) {
    const Index count = new_tokens[static_cast<std::size_t>(b)];
    output.middleRows(b * steps + count, steps - count).setZero();
  }
  return result;
}

template <class T>
Index Decoding<T>::check(const LayerParameters<T>& parameters, const TensorView<const T>& x,
                         const KVCache<T>& cache, const ForwardOptions<T>& options,
                         const std::vector<Index>& new_tokens) {
  const MultiHeadAttentionConfig& config = parameters.config();
  const Index embed = config.embed_dim, batch = cache.batch();
  if (config.add_bias_kv || config.add_zero_attn) {
    throw_argument("decode",
                   "a layer with add_bias_kv or add_zero_attn cannot decode with a KV cache: its "
                   "extra key would follow every step's keys");
  }
  if (config.kdim != embed || config.vdim != embed) {
    throw_argument("decode", "decodes self-attention only, so kdim and vdim must be E = " +
                                 std::to_string(embed) + ", got " + std::to_string(config.kdim) +
                                 " and " + std::to_string(config.vdim));
  }
  if (cache.num_kv_heads() != parameters.num_kv_heads() ||
      cache.head_dim() != parameters.head_dim()) {
    throw_argument("cache", "holds " + std::to_string(cache.num_kv_heads()) +
                                " key/value heads of D = " + std::to_string(cache.head_dim()) +
                                ", the layer has " + std::to_string(parameters.num_kv_heads()) +
                                " of D = " + std::to_string(parameters.head_dim()) +
                                " (make it with make_kv_cache)");
  }
  const std::string row_shape = "[" + std::to_string(batch) + ", n, " + std::to_string(embed) +
                                "] (one row per cached sequence)";
  if (x.rank() == 2 && batch == 1) {
    check_shape("x", {kAnyDim, embed}, x.shape());
  } else if (x.rank() != 3 || x.dim(0) != batch || x.dim(2) != embed) {
    throw_shape("x", row_shape + (batch == 1 ? " or [n, E]" : ""), x.shape());
  }
  const Index steps = x.dim(x.rank() - 2);
  if (!new_tokens.empty() && static_cast<Index>(new_tokens.size()) != batch) {
    throw_argument("new_tokens", "expected one count per sequence (" + std::to_string(batch) +
                                     "), got " + std::to_string(new_tokens.size()));
  }
  for (Index b = 0; b < batch; ++b) {
    const Index count = new_tokens.empty() ? steps : new_tokens[static_cast<std::size_t>(b)];
    if (count < 0 || count > steps) {
      throw_argument("new_tokens", "sequence " + std::to_string(b) +
                                       ": expected a count in [0, n = " + std::to_string(steps) +
                                       "], got " + std::to_string(count));
    }
    if (cache.length(b) + count > cache.capacity()) {
      throw_argument("cache", "sequence " + std::to_string(b) + " holds " +
                                  std::to_string(cache.length(b)) + " keys of its capacity " +
                                  std::to_string(cache.capacity()) + "; " + std::to_string(count) +
                                  " more do not fit");
    }
  }
  check_head_gate(options.head_gate, config.num_heads);
  check_window(options.window);
  check_precision<Compute>(options.precision);
  check_inference_precision(options.precision);
  if (!options.attn_mask.empty() || !options.key_padding_mask.empty()) {
    throw_argument("decode",
                   "takes no attn_mask or key_padding_mask: the cache decides which keys a token "
                   "sees (new_tokens gives each sequence's length)");
  }
  if (options.need_weights) {
    throw_argument("need_weights",
                   "decode returns no attention weights: set it false (decode_options() does), "
                   "or run forward");
  }
  if (cache.sliding() && (options.window.left < 0 || options.window.left > cache.window())) {
    throw_argument("window.left",
                   "a sliding-window cache keeping the last " + std::to_string(cache.window()) +
                       " keys serves windows of at most that many keys to the left, got " +
                       std::to_string(options.window.left) +
                       (options.window.left < 0 ? " (unbounded)" : ""));
  }
  if (cache.sliding() && options.pattern.active()) {
    throw_argument("pattern",
                   "global tokens and block layouts are over absolute positions, which a "
                   "sliding-window cache drops: use a cache that keeps every token");
  }
  // Here rather than where each sequence's keys are known: a layout too small for a later
  // sequence must throw before earlier sequences have advanced.
  for (Index b = 0; b < batch && options.pattern.active(); ++b) {
    const Index count = new_tokens.empty() ? steps : new_tokens[static_cast<std::size_t>(b)];
    if (count == 0) continue;
    checked_pattern(options.pattern, config.num_heads, count, cache.length(b) + count,
                    Alignment::bottom_right);
  }
  if (options.check_inputs) check_finite(x, "x");
  return steps;
}

// The instantiations mha::compiled holds (src/layer_decode.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_LAYER_DECODE_TEMPLATES(PREFIX, T) PREFIX template struct Decoding<T>;
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_LAYER_TYPES, MHA_LAYER_DECODE_TEMPLATES)

}  // namespace mha::detail
