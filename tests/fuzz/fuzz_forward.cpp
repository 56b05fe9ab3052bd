// Fuzz target: MultiHeadAttention::forward with shapes, options and masks decoded from the bytes,
// for float, Eigen::half and Eigen::bfloat16 layers, on random finite parameters and inputs.
// Properties, for every call the library accepts:
//   - no crash, and no exception but mha::ShapeError (the library's refusal of a bad combination);
//   - finite output and weights (a row whose keys are all blocked gives 0, never NaN);
//   - per-head weights: each row sums to 1, or is all 0 where every key is blocked;
//   - the reference kernel without weights, and the flash kernel, agree with the reference kernel
//     with weights, within the tolerance of kernels_agree below;
//   - a call refused with weights is refused without them, and the flash kernel refuses what
//     the reference kernel refuses;
//   - with Precision::bf16, a call runs wherever fp32 ran, with a finite output; and for a float
//     layer a training step (forward_train and backward, the flash kernel) runs in bf16 wherever
//     it ran in fp32, with a finite output and finite gradients;
//   - decoding the query as a prompt through a quantized KV cache (q8 or q4) runs wherever
//     decoding it through a cache of the layer's type runs (unless the format itself is refused:
//     H_kv·D not whole blocks of 32), with a finite output;
//   - a packed batch (cu_seqlens) of the batch's sequences cut to decoded lengths runs wherever
//     every one of them runs alone (and the layer has no add_bias_kv or add_zero_attn), and
//     each sequence's rows agree with its call alone;
//   - a float layer with learnable sinks of decoded values: both kernels agree, the output is
//     finite and per-head weight rows sum to at most 1;
//   - cross-attention over the key encoded once (encode_memory, cross_attend) runs wherever
//     forward with key = value = that memory runs (kdim = vdim, no add_bias_kv or
//     add_zero_attn), with a finite output that agrees with it for a float layer, as does that
//     layer frozen;
//   - a streaming cache (KVCache::streaming) of decoded sinks, window and capacity, fed a
//     sequence twice over in decoded steps and rewound to decoded positions: a step is refused
//     exactly when it does not fit, a rewind exactly when it would need a dropped token, and a
//     float layer's step agrees with forward over the tokens the cache holds and its own;
//   - flex_attention (mha/flex.hpp) over the case's heads with a decoded mask_mod from
//     mha/mods.hpp (or two combined), block sizes and score_mod (none, ALiBi, softcap, a
//     relative-position bias table of decoded values): its
//     output and gradients agree with scaled_dot_product_attention's reference kernel given the
//     same mask evaluated densely and the score_mod's built-in option;
//   - flex_decode (mha/flex_layer.hpp) of a float self-attention layer over the query in decoded
//     steps, with such a mask_mod (alone, or as a block mask of decoded blocks) and score_mod, and
//     a KVCache of a decoded format: a float cache's outputs agree with forward over the whole
//     sequence given the mods written out as attn_mask (causal), a quantized one's are finite.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fuzz_support.hpp"
#include "mha/flex.hpp"
#include "mha/flex_layer.hpp"
#include "mha/frozen.hpp"
#include "mha/mods.hpp"
#include "mha/multihead_attention.hpp"

namespace {

using mha::Index;
using mha::Shape;
using mha::Tensor;
using mha_fuzz::Choices;
using mha_fuzz::violation;

struct Case {
  Index batch = 1, query_len = 1, key_len = 1, heads = 1, kv_heads = 1, head_dim = 1;
  Index embed = 1, kdim = 0, vdim = 0;
  bool batched = true, decoupled_head_dim = false, self_attention = false;
  bool bias = true, add_bias_kv = false, add_zero_attn = false;
  std::uint64_t seed = 0;
};

Case decode_case(Choices& choices) {
  Case c;
  c.batched = choices.in(0, 3) != 0;
  c.batch = c.batched ? choices.in(1, 3) : 1;
  c.query_len = choices.in(0, 9);
  c.key_len = choices.in(0, 9);
  c.heads = choices.in(1, 4);
  // H_kv: a divisor of H (grouped-query, multi-query at 1), or occasionally one that is not.
  const Index kv_pick = choices.in(0, 7);
  std::vector<Index> divisors;
  for (Index d = 1; d <= c.heads; ++d) {
    if (c.heads % d == 0) divisors.push_back(d);
  }
  c.kv_heads = kv_pick == 7 ? 3 : divisors[static_cast<std::size_t>(kv_pick) % divisors.size()];
  c.head_dim = choices.in(1, 4);
  c.decoupled_head_dim = choices.in(0, 5) == 0;
  c.embed = c.decoupled_head_dim ? choices.in(1, 8) : c.heads * c.head_dim;
  c.kdim = choices.in(0, 3) == 0 ? choices.in(1, 6) : 0;
  c.vdim = choices.in(0, 3) == 0 ? choices.in(1, 6) : 0;
  c.self_attention = choices.in(0, 2) == 0;
  c.bias = choices.in(0, 3) != 0;
  c.add_bias_kv = choices.in(0, 3) == 0;
  c.add_zero_attn = choices.in(0, 3) == 0;
  c.seed = choices.seed();
  return c;
}

// Scores blocked by -inf in float masks, to reach fully blocked rows; other entries are moderate.
template <class C>
C mask_value(Choices& choices, mha::Random& random) {
  if (choices.in(0, 3) == 0) return -std::numeric_limits<C>::infinity();
  return static_cast<C>(random.uniform(-3.0, 3.0));
}

// A boolean, float or absent mask of `shape`; the fuzz input picks the kind and the blocked
// entries, the generator the float values.
template <class C>
mha::Mask<C> decode_mask(Choices& choices, mha::Random& random, const Shape& shape) {
  const Index kind = choices.in(0, 3);
  if (kind == 0) return {};
  const Index size = mha::detail::shape_size(shape);
  if (kind == 3) {
    Tensor<C> values(shape);
    for (Index i = 0; i < size; ++i) values.data()[i] = mask_value<C>(choices, random);
    return mha::Mask<C>::additive(std::move(values));
  }
  Tensor<bool> bools(shape);
  for (Index i = 0; i < size; ++i) bools.data()[i] = choices.in(0, 3) == 0;
  return kind == 1 ? mha::Mask<C>::blocked_where_true(std::move(bools))
                   : mha::Mask<C>::allowed_where_true(std::move(bools));
}

mha::SparsePattern decode_pattern(Choices& choices, const Case& c, mha::Alignment alignment) {
  mha::SparsePattern pattern;
  pattern.alignment = alignment;
  if (choices.in(0, 3) != 0) return pattern;
  const Index positions = std::max(c.query_len, c.key_len);
  for (Index p = 0; p < positions; ++p) {
    if (choices.in(0, 5) == 0) pattern.global_tokens.push_back(p);
  }
  if (choices.flag()) {
    pattern.block_size = choices.in(1, 4);
    // Enough blocks for the positions, or (sometimes) one row or column short: refused.
    const Index last = alignment == mha::Alignment::bottom_right ? c.key_len - 1 : c.query_len - 1;
    const auto margin = [&] { return choices.in(0, 7) == 0 ? Index{-1} : choices.in(0, 1); };
    const Index rows = std::max<Index>(last / pattern.block_size + 1, 1) + margin();
    const Index cols = (c.key_len + pattern.block_size - 1) / pattern.block_size + margin();
    const Shape shape = choices.flag()
                            ? Shape{std::max<Index>(rows, 0), std::max<Index>(cols, 0)}
                            : Shape{c.heads, std::max<Index>(rows, 0), std::max<Index>(cols, 0)};
    pattern.block_layout = Tensor<bool>(shape);
    for (Index i = 0; i < pattern.block_layout.size(); ++i) {
      pattern.block_layout.data()[i] = choices.in(0, 2) != 0;
    }
  }
  return pattern;
}

template <class T>
mha::ForwardOptions<T> decode_options(Choices& choices, mha::Random& random, const Case& c) {
  using C = typename mha::ForwardOptions<T>::Compute;
  mha::ForwardOptions<T> options;
  const Index stacked = c.batched ? c.batch * c.heads : c.heads;
  const Shape padding_shape = c.batched ? Shape{c.batch, c.key_len} : Shape{c.key_len};
  options.key_padding_mask = decode_mask<C>(choices, random, padding_shape);
  options.attn_mask = decode_mask<C>(
      choices, random,
      choices.flag() ? Shape{c.query_len, c.key_len} : Shape{stacked, c.query_len, c.key_len});
  options.is_causal = choices.flag();
  options.causal_alignment =
      choices.flag() ? mha::Alignment::bottom_right : mha::Alignment::top_left;
  if (choices.in(0, 2) == 0) {
    options.window.left = choices.in(-1, 5);
    options.window.right = choices.in(-1, 5);
    options.window.dilation = choices.in(0, 7) == 0 ? 0 : choices.in(1, 3);  // 0 is refused
    options.window.alignment = options.causal_alignment;
  }
  options.pattern = decode_pattern(choices, c, options.causal_alignment);
  switch (choices.in(0, 3)) {
    case 1:
      options.alibi_slopes = mha::alibi_slopes<C>(c.heads);
      break;
    case 2:
      for (Index h = 0; h < c.heads; ++h) {
        options.alibi_slopes.push_back(static_cast<C>(random.uniform(0.0, 1.0)));
      }
      break;
    default:
      break;
  }
  if (choices.in(0, 3) == 0) options.softcap = static_cast<C>(choices.in(1, 50));
  if (choices.in(0, 2) == 0) {
    mha::Rope rope;
    rope.base = choices.flag() ? 10000.0 : 1.5;
    rope.layout = choices.flag() ? mha::RopeLayout::interleaved : mha::RopeLayout::rotate_half;
    // Even, up to 4 (above D: refused), or sometimes odd (refused).
    rope.rotary_dim = choices.in(0, 7) == 0 ? 3 : 2 * choices.in(0, 2);
    rope.position_offset = choices.in(0, 5);
    options.rope = rope;
  }
  if (choices.in(0, 3) == 0) {
    for (Index h = 0; h < c.heads; ++h) {
      options.head_gate.push_back(choices.in(0, 3) == 0 ? C(0)
                                                        : static_cast<C>(random.uniform(-2, 2)));
    }
  }
  options.average_attn_weights = choices.flag();
  return options;
}

template <class T>
Tensor<T> random_input(const Shape& shape, mha::Random& random) {
  Tensor<T> tensor(shape);
  for (Index i = 0; i < tensor.size(); ++i) {
    tensor.data()[i] = static_cast<T>(random.uniform(-4.0, 4.0));
  }
  return tensor;
}

template <class T>
void check_finite(const Tensor<T>& tensor, const char* what) {
  for (Index i = 0; i < tensor.size(); ++i) {
    if (!std::isfinite(static_cast<double>(tensor.data()[i]))) {
      violation(std::string(what) + " element " + std::to_string(i) + " is " +
                std::to_string(static_cast<double>(tensor.data()[i])) + " from finite input");
    }
  }
}

// Per-head weights [.., H, L, S']: every row sums to 1, or is all 0 (every key blocked). The
// tolerance is twice the bound on the rounding: at most S' = 11 float additions (1e-6), or each
// weight rounded to 16 bits with a relative error of at most 2^-11 (half) or 2^-8 (bfloat16), so
// the sum by at most that.
template <class T>
void check_weight_rows(const Tensor<T>& weights) {
  const double tolerance = std::is_same_v<T, Eigen::half>       ? 2 * 0x1p-11
                           : std::is_same_v<T, Eigen::bfloat16> ? 2 * 0x1p-8
                                                                : 2e-6;
  const Index columns = weights.shape().back();
  if (columns == 0) return;
  for (Index row = 0; row < weights.size() / columns; ++row) {
    double sum = 0, magnitude = 0;
    for (Index j = 0; j < columns; ++j) {
      const double w = static_cast<double>(weights.data()[row * columns + j]);
      if (w < 0) violation("a weight is negative: " + std::to_string(w));
      sum += w;
      magnitude = std::max(magnitude, w);
    }
    if (magnitude != 0 && std::fabs(sum - 1) > tolerance) {
      violation("a weight row sums to " + std::to_string(sum) + " (row " + std::to_string(row) +
                ")");
    }
  }
}

// How far two kernels' results may be apart: max |a - b| <= tolerance * max(max |reference|, 1).
// float: both kernels compute the same sums in another order (the flash kernel's online softmax
// rescales as it goes) over at most S' = 11 keys, D <= 4 features and E <= 16 columns, each step
// rounding by at most 2^-24 relative; 1e-5 (the repo's float tolerance) leaves a margin of ~10
// over that, relative to the largest magnitude rather than elementwise (an element near 0 is the
// difference of larger terms). The floor of 1 covers outputs that are all tiny.
// 16-bit: both kernels compute in float and round each result to 16 bits once, so the results
// may differ by one unit in the last place (2^-10 for half, 2^-7 for bfloat16) of the largest
// element's binade, as test_half_precision checks; two units for margin, as a float difference
// of 1e-6 can round different ways at two neighbouring elements' boundaries (it cannot at one
// element by more than one unit).
template <class T>
double kernel_tolerance() {
  if constexpr (std::is_same_v<T, Eigen::half>) return 2 * 0x1p-10;
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return 2 * 0x1p-7;
  return 1e-5;
}

template <class T>
void kernels_agree(const Tensor<T>& reference, const Tensor<T>& other, const char* what,
                   double widen = 1) {
  if (reference.shape() != other.shape()) {
    violation(std::string(what) + ": shape " + mha::to_string(other.shape()) +
              ", the reference kernel's is " + mha::to_string(reference.shape()));
  }
  double scale = 1, difference = 0;
  Index worst = 0;
  for (Index i = 0; i < reference.size(); ++i) {
    const double r = static_cast<double>(reference.data()[i]);
    const double d = std::fabs(r - static_cast<double>(other.data()[i]));
    scale = std::max(scale, std::fabs(r));
    if (d > difference) {
      difference = d;
      worst = i;
    }
  }
  if (!(difference <= widen * kernel_tolerance<T>() * scale)) {
    violation(std::string(what) + " differs from the reference kernel's by " +
              std::to_string(difference) + " at element " + std::to_string(worst) + " (scale " +
              std::to_string(scale) + ")");
  }
}

// Runs forward, returning nothing when the library refuses the call.
template <class T>
std::optional<mha::ForwardResult<T>> try_forward(const mha::MultiHeadAttention<T>& layer,
                                                 const Tensor<T>& query, const Tensor<T>& key,
                                                 const Tensor<T>& value,
                                                 const mha::ForwardOptions<T>& options) {
  try {
    return layer.forward(query.view(), key.view(), value.view(), options);
  } catch (const mha::ShapeError&) {
    return std::nullopt;
  }
}

// One training step of the flash kernel (forward_train, then backward of a random grad_output)
// on a copy of the layer: the output and every gradient, or nothing when the library refuses.
std::optional<std::vector<Tensor<float>>> try_training_step(
    const mha::MultiHeadAttention<float>& layer, const Tensor<float>& query,
    const Tensor<float>& key, const Tensor<float>& value, const mha::ForwardOptions<float>& options,
    const Tensor<float>& grad_output) {
  mha::MultiHeadAttention<float> trained = layer;
  mha::SavedForward<float> saved;
  try {
    std::vector<Tensor<float>> results;
    results.push_back(
        trained.forward_train(query.view(), key.view(), value.view(), options, saved).output);
    const auto grads = trained.backward(saved, grad_output.view());
    for (const Tensor<float>* grad : {&grads.query, &grads.key, &grads.value, &grads.head_gate})
      results.push_back(*grad);
    for (const std::string& name : trained.parameter_names())
      results.emplace_back(trained.gradient(name));
    return results;
  } catch (const mha::ShapeError&) {
    return std::nullopt;
  }
}

mha_fuzz::Tally tally(
    "fuzz_forward",
    {"layer refused (ShapeError)", "call refused by every kernel (ShapeError)", "ran and compared",
     "ran and compared, and ran in bf16", "ran, ran in bf16, and decoded through a quantized cache",
     "and ran a packed batch", "and ran a layer with sinks", "and attended to an encoded memory",
     "and streamed through a streaming cache", "and ran flex_attention against its dense mask",
     "and decoded with mods (flex_decode) against forward"});

// Rows [begin, begin + count) of x's batch element b ([B, L, width]) as [count, width].
template <class T>
Tensor<T> rows_of(const Tensor<T>& x, Index b, Index count) {
  Tensor<T> rows({count, x.dim(2)});
  for (Index i = 0; i < count * x.dim(2); ++i) rows.data()[i] = x[b].data()[i];
  return rows;
}

// The batch's sequences cut to decoded lengths and packed ([T, E], cu_seqlens): each sequence's
// rows of the packed call against its call alone.
template <class T>
void check_packed_batch(const mha::MultiHeadAttention<T>& layer, const Case& c, bool self,
                        Choices& choices, const Tensor<T>& query, const Tensor<T>& key,
                        const Tensor<T>& value, mha::ForwardOptions<T> options) {
  options.attn_mask = {};
  options.key_padding_mask = {};
  options.need_weights = false;
  options.precision = mha::Precision::fp32;
  std::vector<Index> queries{0}, keys{0};
  std::vector<Tensor<T>> query_parts, key_parts, value_parts;
  std::vector<std::optional<mha::ForwardResult<T>>> alone;
  bool all_ran = true;
  for (Index b = 0; b < c.batch; ++b) {
    const Index length = choices.in(0, c.query_len);
    const Index key_length = self ? length : choices.in(0, c.key_len);
    query_parts.push_back(rows_of(query, b, length));
    key_parts.push_back(self ? query_parts.back() : rows_of(key, b, key_length));
    value_parts.push_back(self ? query_parts.back() : rows_of(value, b, key_length));
    queries.push_back(queries.back() + length);
    keys.push_back(keys.back() + key_length);
    const Tensor<T>& part = query_parts.back();
    alone.push_back(try_forward(layer, part, self ? part : key_parts.back(),
                                self ? part : value_parts.back(), options));
    all_ran = all_ran && alone.back().has_value();
  }
  const auto packed_of = [](const std::vector<Tensor<T>>& parts, Index total, Index width) {
    Tensor<T> packed({total, width});
    Index row = 0;
    for (const Tensor<T>& part : parts) {
      for (Index i = 0; i < part.size(); ++i) packed.data()[row * width + i] = part.data()[i];
      row += part.dim(0);
    }
    return packed;
  };
  const Tensor<T> packed_query = packed_of(query_parts, queries.back(), query.dim(2));
  const Tensor<T> packed_key = packed_of(key_parts, keys.back(), key.dim(2));
  const Tensor<T> packed_value = packed_of(value_parts, keys.back(), value.dim(2));
  options.cu_seqlens = queries;
  if (!self) options.cu_seqlens_k = keys;
  const auto packed = try_forward(layer, packed_query, self ? packed_query : packed_key,
                                  self ? packed_query : packed_value, options);
  if (!packed) {
    if (all_ran && !c.add_bias_kv && !c.add_zero_attn) {
      violation("a packed batch was refused whose sequences each ran alone");
    }
    return;
  }
  if (!all_ran) violation("a packed batch ran where one of its sequences alone was refused");
  check_finite(packed->output, "packed output");
  for (Index b = 0; b < c.batch; ++b) {
    const auto s = static_cast<std::size_t>(b);
    const Index width = packed->output.dim(1), count = queries[s + 1] - queries[s];
    Tensor<T> rows({count, width});
    for (Index i = 0; i < count * width; ++i) {
      rows.data()[i] = packed->output.data()[queries[s] * width + i];
    }
    kernels_agree(alone[s]->output, rows, "a packed sequence's rows");
  }
  tally.count(5);
}

// Cross-attention over `memory` (the case's key) encoded once, against forward with it as key
// and value, with the options that cross-attention takes (no positions, masks or weights).
template <class T>
void check_cross_attention(const mha::MultiHeadAttention<T>& layer, const Case& c,
                           const Tensor<T>& query, const Tensor<T>& memory) {
  const auto options = mha::MultiHeadAttention<T>::cross_attention_options();
  const auto expected = try_forward(layer, query, memory, memory, options);
  std::optional<Tensor<T>> actual;
  try {
    auto encoded = layer.encode_memory(memory.view());
    actual = layer.cross_attend(query.view(), encoded, options).output;
  } catch (const mha::ShapeError&) {
  }
  const bool refusable = c.kdim != c.vdim || c.add_bias_kv || c.add_zero_attn || c.key_len == 0;
  if (expected && !actual && !refusable) {
    violation("cross-attention refused a memory that forward took as key and value");
  }
  if (!expected || !actual) return;
  check_finite(*actual, "cross-attention output");
  // A 16-bit layer's memory holds its keys and values rounded to 16 bits, which forward keeps in
  // float: their difference is that rounding through the softmax, not the kernels' (2^-7 of the
  // keys can move a score by several of its units), so only a float layer must agree.
  if constexpr (std::is_same_v<T, float>) {
    kernels_agree(expected->output, *actual, "cross-attention over an encoded memory");
    // A frozen layer's packed weights: the layer's products, up to their order (bit for bit at
    // test_cross_attention's shapes, not at every one: E = 1 with H = 4 differs in the last bit).
    const mha::FrozenMultiHeadAttention<float> frozen(layer);
    auto frozen_memory = frozen.encode_memory(memory.view());
    const auto frozen_output = frozen.cross_attend(query.view(), frozen_memory, options).output;
    kernels_agree(*actual, frozen_output, "a frozen layer's cross-attention");
  }
  tally.count(7);
}

// Feeds sequence 0 of the query, twice over, through a streaming cache in steps of decoded sizes,
// rewinding now and then to a decoded position (see the top for what is checked).
template <class T>
void check_streaming(const mha::MultiHeadAttention<T>& layer, const Case& c, Choices& choices,
                     const Tensor<T>& query, const mha::ForwardOptions<T>& decoded) {
  const bool self_attention_layer = (c.kdim == 0 || c.kdim == c.embed) &&
                                    (c.vdim == 0 || c.vdim == c.embed) && !c.add_bias_kv &&
                                    !c.add_zero_attn;
  const Index sinks = choices.in(1, 3), window = choices.in(0, 4);
  const Index capacity = sinks + window + choices.in(1, 4);
  auto options = mha::MultiHeadAttention<T>::decode_options();
  options.rope = decoded.rope;
  options.alibi_slopes = decoded.alibi_slopes;
  options.softcap = decoded.softcap;
  const Index length = c.query_len, embed = c.embed;
  Tensor<T> stream({2 * length, embed});
  for (Index t = 0; t < 2 * length; ++t) {
    for (Index e = 0; e < embed; ++e)
      stream.data()[t * embed + e] = query.data()[(t % length) * embed + e];
  }
  auto cache = layer.make_streaming_cache(1, sinks, window, capacity);
  for (int step = 0; step < 12 && cache.position(0) < 2 * length; ++step) {
    const Index first = cache.position(0), held = cache.length(0);
    if (choices.in(0, 3) == 0) {  // a rewind
      const Index to = choices.in(0, first);
      const bool possible = first == held || to == first;  // nothing dropped, or no change
      bool taken = true;
      try {
        cache.rewind(0, to);
      } catch (const mha::ShapeError&) {
        taken = false;
      }
      if (taken != possible) {
        violation(std::string("a streaming cache ") + (taken ? "took" : "refused") +
                  " a rewind from " + std::to_string(first) + " to " + std::to_string(to) +
                  " holding " + std::to_string(held));
      }
      continue;
    }
    const Index count = std::min(choices.in(1, 4), 2 * length - first);
    Tensor<T> x({count, embed});
    x.matrix() = stream.matrix().middleRows(first, count);
    std::optional<Tensor<T>> out;
    try {
      out = layer.decode(x.view(), cache, options).output;
    } catch (const mha::ShapeError&) {
    }
    const bool fits = held + count <= capacity;
    if (!out) {
      if (self_attention_layer && fits) violation("a streaming cache refused a step that fits");
      if (cache.position(0) != first || cache.length(0) != held) {
        violation("a refused streaming step changed the cache");
      }
      return;
    }
    if (!fits) violation("a streaming cache took a step that does not fit");
    check_finite(*out, "streaming output");
    if constexpr (std::is_same_v<T, float>) {
      // The tokens the cache held, then the step's: the first `sinks`, the last `window`.
      std::vector<Index> kept;
      for (Index t = 0; t < std::min(sinks, first); ++t) kept.push_back(t);
      for (Index t = std::max(std::min(sinks, first), first - window); t < first + count; ++t)
        kept.push_back(t);
      Tensor<float> gathered({static_cast<Index>(kept.size()), embed});
      for (std::size_t r = 0; r < kept.size(); ++r) {
        gathered.matrix().row(static_cast<Index>(r)) = stream.matrix().row(kept[r]);
      }
      const auto full = layer.forward(gathered.view(), options).output;
      Tensor<float> expected({count, embed});
      expected.matrix() = full.matrix().bottomRows(count);
      kernels_agree(expected, *out, "a streaming step against forward over the tokens it holds");
    }
  }
  tally.count(8);
}

// The layer with learnable sinks of decoded values in [-8, 8]: both kernels, finite outputs,
// per-head weight rows summing to at most 1 (the sink takes the rest).
void check_sinks(mha::MultiHeadAttentionConfig config, const mha::MultiHeadAttention<float>& source,
                 Choices& choices, const Tensor<float>& query, const Tensor<float>& key,
                 const Tensor<float>& value, mha::ForwardOptions<float> options) {
  config.learnable_sinks = true;
  mha::MultiHeadAttention<float> layer(config);
  for (const std::string& name : source.parameter_names()) {
    layer.set_parameter(name, source.parameter(name));
  }
  Tensor<float> sinks({config.num_heads});
  for (Index h = 0; h < config.num_heads; ++h) {
    sinks.data()[h] = static_cast<float>(choices.in(-8, 8));
  }
  layer.set_parameter("sinks", sinks.view());
  options.precision = mha::Precision::fp32;
  options.need_weights = true;
  options.average_attn_weights = false;
  options.head_gate.clear();
  options.kernel = mha::Kernel::reference;
  const auto reference = try_forward(layer, query, key, value, options);
  options.need_weights = false;
  options.kernel = mha::Kernel::flash;
  const auto flash = try_forward(layer, query, key, value, options);
  if (reference.has_value() != flash.has_value()) violation("sinks: the kernels refused unlike");
  if (!reference) return;
  check_finite(reference->output, "output with sinks");
  kernels_agree(reference->output, flash->output, "flash output with sinks");
  const Index columns = reference->attn_weights.shape().back();
  for (Index row = 0; columns > 0 && row < reference->attn_weights.size() / columns; ++row) {
    double sum = 0;
    for (Index j = 0; j < columns; ++j) {
      sum += static_cast<double>(reference->attn_weights.data()[row * columns + j]);
    }
    if (sum > 1 + 2e-6) violation("a weight row with sinks sums to " + std::to_string(sum));
  }
  tally.count(6);
}

// Decodes x (a prompt, [B, L, E] or [L, E]) through a fresh cache of `format`: the output, or the
// message of the library's refusal.
template <class T>
std::pair<std::optional<Tensor<T>>, std::string> try_decode(const mha::MultiHeadAttention<T>& layer,
                                                            const Tensor<T>& x,
                                                            mha::KVCacheFormat format) {
  try {
    const Index batch = x.rank() == 3 ? x.dim(0) : 1;
    auto cache = layer.make_kv_cache(batch, x.dim(x.rank() - 2), -1, format);
    return {layer.decode(x.view(), cache).output, ""};
  } catch (const mha::ShapeError& e) {
    return {std::nullopt, e.what()};
  }
}

// A mask_mod of mods.hpp with decoded parameters for L queries and S keys.
using MaskFunction = std::function<bool(Index, Index, Index, Index)>;

MaskFunction one_mask_mod(Choices& choices, Index query_len, Index key_len) {
  const Index offset = choices.flag() ? key_len - query_len : 0;
  const Index longest = std::max<Index>(1, std::max(query_len, key_len));
  switch (choices.in(0, 7)) {
    case 0:
      return mha::mods::Causal{offset};
    case 1:
      return mha::mods::SlidingWindow{choices.in(-1, longest), choices.in(-1, longest), offset};
    case 2:
      return mha::mods::Chunked{choices.in(1, longest), offset};
    case 3:
      return mha::mods::Dilated{choices.in(0, longest), choices.in(1, 4), offset};
    case 4:
      return mha::mods::PrefixLm{choices.in(0, key_len), offset};
    case 5: {
      // Documents: query and key lengths cut at the same number of decoded points.
      const Index documents = choices.in(1, 4);
      const auto cut = [&](Index length) {
        std::vector<Index> points{0};
        for (Index d = 1; d < documents; ++d) points.push_back(choices.in(0, length));
        points.push_back(length);
        std::sort(points.begin(), points.end());
        return points;
      };
      const std::vector<Index> queries = cut(query_len), keys = cut(key_len);
      return mha::mods::document(queries, keys);
    }
    case 6: {
      if (query_len != key_len || query_len == 0)
        return mha::mods::Strided{choices.in(1, 8), offset};
      // A grid whose rows divide the length, and a kernel that fits it.
      Index height = choices.in(1, query_len);
      while (query_len % height != 0) --height;
      const Index width = query_len / height;
      return mha::mods::neighbourhood_2d(height, width, choices.in(1, height),
                                         choices.in(1, width));
    }
    default:
      return mha::mods::Strided{choices.in(1, 8), offset};
  }
}

// flex_attention with a decoded mask and score_mod over [B, H, L, D] heads of the case's shape,
// forward and backward, against the reference kernel given the mask evaluated densely.
void check_flex(const Case& c, Choices& choices, mha::Random& random) {
  const Index batch = c.batched ? c.batch : 1, heads = c.heads, kv_heads = c.kv_heads;
  const Index query_len = c.query_len, key_len = c.key_len, head_dim = c.head_dim;
  const Tensor<float> q = random_input<float>({batch, heads, query_len, head_dim}, random);
  const Tensor<float> k = random_input<float>({batch, kv_heads, key_len, head_dim}, random);
  const Tensor<float> v = random_input<float>({batch, kv_heads, key_len, head_dim}, random);
  const Tensor<float> grad_out = random_input<float>(q.shape(), random);
  MaskFunction mask_mod = one_mask_mod(choices, query_len, key_len);
  if (choices.flag()) {
    const bool both = choices.flag();
    MaskFunction other = one_mask_mod(choices, query_len, key_len);
    mask_mod = both ? MaskFunction(mha::mods::mask_and(mask_mod, other))
                    : MaskFunction(mha::mods::mask_or(mask_mod, other));
  }
  const Index query_block = choices.in(1, 40), key_block = choices.in(1, 80);
  mha::AttentionOptions<float> options;
  options.enable_gqa = true;
  mha::AttentionOptions<float> reference = options;
  reference.kernel = mha::Kernel::reference;
  Tensor<float> mask({batch, heads, query_len, key_len});
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      for (Index i = 0; i < query_len; ++i) {
        for (Index j = 0; j < key_len; ++j) {
          mask[b][h].matrix()(i, j) =
              mask_mod(b, h, i, j) ? 0.0F : -std::numeric_limits<float>::infinity();
        }
      }
    }
  }
  reference.mask = mha::Mask<float>::additive(mask);
  const auto block_mask =
      mha::create_block_mask(mask_mod, batch, heads, query_len, key_len, query_block, key_block);
  // The largest magnitude of a visible score, its bias included (before a softcap).
  const auto largest_score = [&] {
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
    double largest = 0;
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < heads; ++h) {
        const Index g = h / (heads / kv_heads);
        const auto bias = reference.mask.values()[b][h].matrix();
        for (Index i = 0; i < query_len; ++i) {
          for (Index j = 0; j < key_len; ++j) {
            if (std::isinf(bias(i, j))) continue;
            double score =
                scale * static_cast<double>(q[b][h].matrix().row(i).dot(k[b][g].matrix().row(j)));
            score += static_cast<double>(bias(i, j));
            if (!reference.alibi_slopes.empty()) {
              score -= static_cast<double>(reference.alibi_slopes[static_cast<std::size_t>(h)]) *
                       static_cast<double>(std::abs(i - j));
            }
            largest = std::max(largest, std::fabs(score));
          }
        }
      }
    }
    return largest;
  };
  const auto compare = [&](const auto& score_mod) {
    const auto expected = mha::scaled_dot_product_attention(q, k, v, reference);
    const auto result = mha::flex_attention(q, k, v, score_mod, block_mask, options);
    check_finite(result.output, "flex_attention output");
    kernels_agree(expected.output, result.output, "flex_attention against its dense mask");
    const auto expected_grads = mha::scaled_dot_product_attention_backward(
        q.view(), k.view(), v.view(), expected, grad_out.view(), reference);
    const auto grads =
        mha::flex_attention_backward(q, k, v, result, grad_out, score_mod, block_mask, options);
    // The gradients carry the scores' absolute rounding, an ulp of the largest score, times
    // |dP - Δ|·|k| (query), |dS|·|q| (key) or |dO| (value), which their own largest element
    // does not bound: the forward's 1e-5 holds for scores up to about 4, and beyond that the
    // bound grows with them. (A case of scores near -13, ALiBi, D = 2: the query gradient 2.0e-5
    // from float64's at a scale of 1.73 in one build, 2e-7 in another; the float reference
    // kernel 9e-7.)
    const double widen = std::max(1.0, largest_score() / 4);
    kernels_agree(expected_grads.query, grads.query, "flex_attention's query gradient", widen);
    kernels_agree(expected_grads.key, grads.key, "flex_attention's key gradient", widen);
    kernels_agree(expected_grads.value, grads.value, "flex_attention's value gradient", widen);
  };
  switch (choices.in(0, 3)) {
    case 1: {
      reference.alibi_slopes = mha::alibi_slopes<float>(heads);
      compare(mha::mods::Alibi<float>{reference.alibi_slopes, 0});
      break;
    }
    case 3: {
      // A relative-position bias table of decoded reach, added to the dense mask.
      const Index reach = choices.in(0, 4), width = 2 * reach + 1;
      mha::mods::RelativeBias<float> bias{{}, reach, choices.flag() ? key_len - query_len : 0};
      for (Index e = 0; e < heads * width; ++e) {
        bias.table.push_back(static_cast<float>(random.uniform(-2.0, 2.0)));
      }
      for (Index b = 0; b < batch; ++b) {
        for (Index h = 0; h < heads; ++h) {
          for (Index i = 0; i < query_len; ++i) {
            for (Index j = 0; j < key_len; ++j) mask[b][h].matrix()(i, j) += bias(0.0F, b, h, i, j);
          }
        }
      }
      reference.mask = mha::Mask<float>::additive(mask);
      compare(bias);
      break;
    }
    case 2: {
      const float cap = static_cast<float>(choices.in(1, 40)) / 4.0F;
      reference.softcap = cap;
      compare(mha::mods::Softcap<float>{cap});
      break;
    }
    default:
      compare(mha::no_score_mod);
  }
  tally.count(9);
}

// flex_decode of the query (the sequence's tokens) in decoded steps, with a decoded mask_mod
// (alone or as a block mask) and score_mod, against forward over the whole sequence with the
// mods written out as attn_mask [B·H, L, L], causal (a float cache), or finite (a quantized one).
void check_flex_decode(const mha::MultiHeadAttention<float>& layer, const Case& c, Choices& choices,
                       mha::Random& random, const Tensor<float>& query) {
  const Index batch = c.batched ? c.batch : 1, heads = c.heads, length = c.query_len;
  const Index embed = c.embed;
  MaskFunction mask_mod = one_mask_mod(choices, length, length);
  const bool block = choices.flag();
  const Index query_block = choices.in(1, 40), key_block = choices.in(1, 80);
  const auto format = static_cast<mha::KVCacheFormat>(choices.in(0, 2));
  // The score_mod: none, ALiBi, softcap or a relative bias table, as its bias (or cap) beside.
  const Index kind = choices.in(0, 3);
  const Index reach = choices.in(0, 4);
  mha::mods::RelativeBias<float> relative{{}, reach, 0};
  for (Index e = 0; e < heads * (2 * reach + 1); ++e) {
    relative.table.push_back(static_cast<float>(random.uniform(-2.0, 2.0)));
  }
  const mha::mods::Alibi<float> alibi{mha::alibi_slopes<float>(heads), 0};
  const float cap = static_cast<float>(choices.in(1, 40)) / 4.0F;
  mha::ForwardOptions<float> forward_options;
  forward_options.need_weights = false;
  forward_options.is_causal = true;
  if (kind == 2) forward_options.softcap = cap;
  Tensor<float> mask({batch * heads, length, length});
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      for (Index i = 0; i < length; ++i) {
        for (Index j = 0; j < length; ++j) {
          float value = 0.0F;
          if (kind == 1) value = alibi(0.0F, b, h, i, j);
          if (kind == 3) value = relative(0.0F, b, h, i, j);
          mask[b * heads + h].matrix()(i, j) =
              mask_mod(b, h, i, j) ? value : -std::numeric_limits<float>::infinity();
        }
      }
    }
  }
  forward_options.attn_mask = mha::Mask<float>::additive(mask);
  Tensor<float> x({batch, length, embed});
  std::copy(query.data(), query.data() + query.size(), x.data());
  const auto expected = try_forward(layer, x, x, x, forward_options);
  std::optional<mha::KVCache<float>> cache;
  try {
    cache.emplace(layer.make_kv_cache(batch, std::max<Index>(length, 1), -1, format));
  } catch (const mha::ShapeError&) {
    return;  // a quantized format of heads that are not whole blocks of 32
  }
  const auto block_mask =
      mha::create_block_mask(mask_mod, 1, 1, length, length, query_block, key_block);
  Tensor<float> decoded(x.shape());
  try {
    for (Index first = 0; first < length;) {
      const Index count = std::min(length - first, choices.in(1, 4));
      Tensor<float> step({batch, count, embed});
      for (Index b = 0; b < batch; ++b) {
        step[b].matrix() = x[b].matrix().middleRows(first, count);
      }
      const auto run = [&](const auto& score_mod) {
        return block ? mha::flex_decode(layer, step, *cache, score_mod, block_mask).output
                     : mha::flex_decode(layer, step, *cache, score_mod, mask_mod).output;
      };
      const Tensor<float> out = kind == 1   ? run(alibi)
                                : kind == 2 ? run(mha::mods::Softcap<float>{cap})
                                : kind == 3 ? run(relative)
                                            : run(mha::no_score_mod);
      for (Index b = 0; b < batch; ++b) {
        decoded[b].matrix().middleRows(first, count) = out[b].matrix();
      }
      first += count;
    }
  } catch (const mha::ShapeError& e) {
    if (expected) violation(std::string("flex_decode refused what forward ran: ") + e.what());
    return;
  }
  check_finite(decoded, "flex_decode output");
  if (format == mha::KVCacheFormat::as_layer) {
    if (!expected) violation("flex_decode ran what forward refused");
    kernels_agree(expected->output, decoded, "flex_decode against forward with its mask");
  }
  tally.count(10);
}

template <class T>
void run_case(const Case& c, Choices& choices) {
  mha::MultiHeadAttentionConfig config(c.embed, c.heads);
  config.num_kv_heads = c.kv_heads;
  config.head_dim = c.decoupled_head_dim ? c.head_dim : 0;
  config.kdim = c.kdim;
  config.vdim = c.vdim;
  config.bias = c.bias;
  config.add_bias_kv = c.add_bias_kv;
  config.add_zero_attn = c.add_zero_attn;
  config.seed = c.seed;
  std::optional<mha::MultiHeadAttention<float>> wide;
  try {
    wide.emplace(config);
  } catch (const mha::ShapeError&) {
    tally.count(0);
    return;
  }
  // Parameters of normal(0, 0.5), biases included, as the repo's tests randomise them: logits
  // of a few units, a sharp softmax but no overflow.
  mha::Random random(c.seed);
  for (const std::string& name : wide->parameter_names()) {
    Tensor<float> values(wide->parameter(name).shape());
    for (Index i = 0; i < values.size(); ++i) {
      values.data()[i] = static_cast<float>(0.5 * random.normal());
    }
    wide->set_parameter(name, values.view());
  }
  const mha::MultiHeadAttention<float>& source = *wide;
  mha::MultiHeadAttention<T> layer(config);
  for (const std::string& name : layer.parameter_names()) {
    layer.set_parameter(name, mha::tensor_cast<T>(source.parameter(name)).view());
  }

  const Index kdim = c.kdim == 0 ? c.embed : c.kdim, vdim = c.vdim == 0 ? c.embed : c.vdim;
  const auto input_shape = [&](Index length, Index width) {
    return c.batched ? Shape{c.batch, length, width} : Shape{length, width};
  };
  const Tensor<T> query = random_input<T>(input_shape(c.query_len, c.embed), random);
  // Self-attention passes one tensor three times (the fused projection), when the shapes allow.
  const bool self =
      c.self_attention && c.query_len == c.key_len && kdim == c.embed && vdim == c.embed;
  const Tensor<T> key = self ? query : random_input<T>(input_shape(c.key_len, kdim), random);
  const Tensor<T> value = self ? query : random_input<T>(input_shape(c.key_len, vdim), random);
  const Tensor<T>& key_input = self ? query : key;
  const Tensor<T>& value_input = self ? query : value;

  mha::ForwardOptions<T> options = decode_options<T>(choices, random, c);
  options.need_weights = true;
  options.kernel = mha::Kernel::reference;
  const auto with_weights = try_forward(layer, query, key_input, value_input, options);
  options.need_weights = false;
  const auto without_weights = try_forward(layer, query, key_input, value_input, options);
  options.kernel = mha::Kernel::flash;
  const auto flash = try_forward(layer, query, key_input, value_input, options);
  if (with_weights.has_value() != without_weights.has_value() ||
      with_weights.has_value() != flash.has_value()) {
    violation(std::string("refused inconsistently: reference with weights ") +
              (with_weights ? "ran" : "refused") + ", without " +
              (without_weights ? "ran" : "refused") + ", flash " + (flash ? "ran" : "refused"));
  }
  if (!with_weights) {
    tally.count(1);
    return;
  }

  check_finite(with_weights->output, "output");
  check_finite(with_weights->attn_weights, "attn_weights");
  if (!options.average_attn_weights && options.head_gate.empty()) {
    check_weight_rows(with_weights->attn_weights);
  }
  kernels_agree(with_weights->output, without_weights->output, "reference output without weights");
  kernels_agree(with_weights->output, flash->output, "flash output");
  if (!without_weights->attn_weights.is_null() || !flash->attn_weights.is_null()) {
    violation("weights returned without need_weights");
  }
  // Precision::bf16, decided by a byte after all the others (so that the committed corpus keeps
  // its cases): it runs wherever fp32 ran, and its output is finite. How far it may be from fp32
  // depends on how sharp the softmax is (test_precision bounds it at PyTorch's initialisation);
  // with L <= 9 the projections run in bf16 and the attention in the fp32 tiles.
  if (!choices.flag()) {
    tally.count(2);
    return;
  }
  options.precision = mha::Precision::bf16;
  const auto bf16 = try_forward(layer, query, key_input, value_input, options);
  if (!bf16) violation("Precision::bf16 refused a call that fp32 ran");
  check_finite(bf16->output, "bf16 output");
  if constexpr (std::is_same_v<T, float>) {
    const Tensor<float> grad_output = random_input<float>(query.shape(), random);
    mha::ForwardOptions<float> train_options = options;
    train_options.precision = mha::Precision::fp32;
    const auto fp32_step =
        try_training_step(layer, query, key_input, value_input, train_options, grad_output);
    train_options.precision = mha::Precision::bf16;
    const auto bf16_step =
        try_training_step(layer, query, key_input, value_input, train_options, grad_output);
    if (fp32_step && !bf16_step) violation("bf16 training refused a step that fp32 ran");
    if (bf16_step) {
      for (const Tensor<float>& result : *bf16_step) check_finite(result, "bf16 training step");
    }
  }
  // A quantized cache, decided by a byte after bf16's (and its format by the next).
  if (!choices.flag()) {
    tally.count(3);
    return;
  }
  const auto format = choices.flag() ? mha::KVCacheFormat::q8 : mha::KVCacheFormat::q4;
  const auto plain = try_decode(layer, query, mha::KVCacheFormat::as_layer);
  const auto quantized = try_decode(layer, query, format);
  if (plain.first && !quantized.first && quantized.second.rfind("format: ", 0) != 0) {
    violation("a quantized cache refused a decode that the layer's type ran: " + quantized.second);
  }
  if (quantized.first) check_finite(*quantized.first, "output decoded through a quantized cache");
  tally.count(4);
  // A packed batch, then sinks, each decided by a byte after all the others'.
  if (c.batched && choices.flag()) {
    check_packed_batch(layer, c, self, choices, query, key, value, options);
  }
  if constexpr (std::is_same_v<T, float>) {
    if (choices.flag())
      check_sinks(config, source, choices, query, key_input, value_input, options);
  }
  if (choices.flag()) check_cross_attention(layer, c, query, key);
  if (choices.flag()) check_streaming(layer, c, choices, query, options);
  if constexpr (std::is_same_v<T, float>) {
    if (choices.flag()) check_flex(c, choices, random);
    // flex_decode: a self-attention layer, decided by a byte after all the others'.
    const bool self_attention_layer =
        kdim == c.embed && vdim == c.embed && !c.add_bias_kv && !c.add_zero_attn;
    if (self_attention_layer && choices.flag()) {
      check_flex_decode(layer, c, choices, random, query);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Choices choices(data, size);
  const Index type = choices.in(0, 3);
  const Case c = decode_case(choices);
  if (type == 2) {
    run_case<Eigen::half>(c, choices);
  } else if (type == 3) {
    run_case<Eigen::bfloat16>(c, choices);
  } else {
    run_case<float>(c, choices);
  }
  return 0;
}
