// Reduced precision (docs/precision.md). Precision::bf16 (ForwardOptions::precision): the
// projections' and the flash kernel's products with operands rounded to bf16 and sums in fp32,
// against a float64 layer holding the same weights and reading the same inputs: at most 1e-2 of
// the float64 output's largest magnitude (issue 18's bound), on the cases that reach each of the
// bf16 code's branches (key blocks that start off a panel or a pair, odd head widths and key
// counts, the extra key rows, grouped heads, the fp32 paths bf16 leaves alone); the same bits
// frozen and unfrozen and on any number of threads; fp32 where the CPU lacks AVX512_BF16; and
// the calls that refuse it. FrozenWeights::int8: the quantization, the int8 products against
// double, and the frozen layer's forward and decode within 2e-2 of the unquantized float64 layer.
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "helpers.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

using mha::ForwardOptions;
using mha::Index;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::Precision;
using mha::Shape;
using mha::Tensor;

using mha_test::converted;

namespace {

struct Case {
  std::string name;
  MultiHeadAttentionConfig config;
  Shape query_shape, key_shape;  // key_shape empty: self-attention
  std::function<void(ForwardOptions<double>&)> options;
  // What the flash kernel runs for these heads under bf16 (where the CPU has it).
  mha::detail::FlashPath flash_path = mha::detail::FlashPath::bf16_panels;
};

std::vector<Case> cases() {
  using mha::detail::FlashPath;
  std::vector<Case> all;
  const auto config = [](Index embed, Index heads) {
    MultiHeadAttentionConfig c(embed, heads);
    c.seed = static_cast<std::uint64_t>(embed + heads);
    return c;
  };
  all.push_back({"self-attention, D = 32, L = 300 (several query and key blocks)",
                 config(128, 4),
                 {2, 300, 128},
                 {},
                 [](auto&) {}});
  all.push_back({"causal with a key padding mask, D = 48",
                 config(96, 2),
                 {2, 100, 96},
                 {},
                 [](auto& options) {
                   options.is_causal = true;
                   Tensor<bool> padding({2, 100});
                   for (Index j = 0; j < 100; ++j) {
                     padding.data()[j] = j >= 90;
                     padding.data()[100 + j] = j % 7 == 3;
                   }
                   options.key_padding_mask = mha::Mask<double>::blocked_where_true(padding);
                 }});
  all.push_back({"a window whose key blocks start off the panels and pairs",
                 config(64, 2),
                 {1, 300, 64},
                 {},
                 [](auto& options) {
                   options.window = {37, 5};
                 }});
  {
    MultiHeadAttentionConfig c = config(64, 2);
    c.head_dim = 33;  // odd: the products' depth ends in half a pair
    all.push_back({"D = 33", c, {2, 40, 64}, {}, [](auto&) {}});
  }
  {
    MultiHeadAttentionConfig c = config(64, 2);
    c.kdim = 40;
    c.vdim = 24;
    c.add_bias_kv = true;
    c.add_zero_attn = true;
    all.push_back({"cross-attention over 77 keys with bias_k and the zero key",
                   c,
                   {2, 33, 64},
                   {2, 77, 0},
                   [](auto&) {}});
  }
  {
    MultiHeadAttentionConfig c = config(256, 8);
    c.num_kv_heads = 2;
    all.push_back({"grouped-query heads", c, {1, 64, 256}, {}, [](auto& options) {
                     options.is_causal = true;
                   }});
  }
  all.push_back({"D = 16: the small-head kernel, in fp32",
                 config(64, 4),
                 {2, 64, 64},
                 {},
                 [](auto&) {},
                 FlashPath::small_head});
  all.push_back(
      {"L = 8: the fp32 tiles", config(64, 2), {3, 8, 64}, {}, [](auto&) {}, FlashPath::tiles});
  all.push_back({"weights returned: the reference kernel, in fp32",
                 config(64, 2),
                 {2, 30, 64},
                 {},
                 [](auto& options) {
                   options.need_weights = true;
                   options.average_attn_weights = false;
                 }});
  return all;
}

// The case's options in float (its masks converted), with `precision`.
ForwardOptions<float> float_options(const ForwardOptions<double>& wide, Precision precision) {
  ForwardOptions<float> options;
  if (!wide.key_padding_mask.empty()) {
    options.key_padding_mask =
        mha::Mask<float>::blocked_where_true(wide.key_padding_mask.booleans());
  }
  options.need_weights = wide.need_weights;
  options.average_attn_weights = wide.average_attn_weights;
  options.is_causal = wide.is_causal;
  options.window = wide.window;
  options.precision = precision;
  return options;
}

}  // namespace

TEST_CASE("bf16 arithmetic stays within 1e-2 of float64, on every branch of its code",
          "[precision]") {
  const bool available = mha::bf16_arithmetic_available();
  if (!available) WARN("this CPU lacks AVX512_BF16: Precision::bf16 computes in fp32 here");
  for (const Case& c : cases()) {
    INFO(c.name);
    // PyTorch's initialisation: logits of order 1. (With normal(0, 0.5) weights, logits of order
    // 100, a score's rounding error of |s| · 2^-8 moves the softmax itself: 1.3-6.4e-2 measured,
    // as the Precision comment says.)
    MultiHeadAttention<double> wide(c.config);
    const MultiHeadAttention<float> layer = converted<float>(wide);
    wide = converted<double>(layer);  // the same numbers in both
    const Shape key_shape = c.key_shape.empty()
                                ? c.query_shape
                                : Shape{c.key_shape[0], c.key_shape[1], layer.config().kdim};
    const Shape value_shape{key_shape[0], key_shape[1], layer.config().vdim};
    const auto query = mha_test::random_tensor<float>(c.query_shape, 11);
    const auto key = c.key_shape.empty() ? query : mha_test::random_tensor<float>(key_shape, 12);
    const auto value =
        c.key_shape.empty() ? query : mha_test::random_tensor<float>(value_shape, 13);
    ForwardOptions<double> wide_options;
    wide_options.need_weights = false;
    c.options(wide_options);
    const auto expected =
        wide.forward(mha::tensor_cast<double>(query), mha::tensor_cast<double>(key),
                     mha::tensor_cast<double>(value), wide_options);
    const auto fp32 =
        layer.forward(query, key, value, float_options(wide_options, Precision::fp32));
    const auto bf16 =
        layer.forward(query, key, value, float_options(wide_options, Precision::bf16));
    const double fp32_error = mha_test::error_of_largest(fp32.output, expected.output);
    const double bf16_error = mha_test::error_of_largest(bf16.output, expected.output);
    INFO("fp32 error " << fp32_error << ", bf16 error " << bf16_error);
    CHECK(bf16_error <= 1e-2);
    if (available) {
      // bf16 ran: its rounding (a relative 2^-8 per operand at most) is far above fp32's.
      CHECK(bf16_error > 100 * fp32_error);
      if (wide_options.need_weights) {
        // The weights come from the reference kernel's fp32 products of bf16 projections.
        CHECK(mha_test::error_of_largest(bf16.attn_weights, expected.attn_weights) <= 1e-2);
      }
    } else {
      CHECK(bf16.output.flat() == fp32.output.flat());
    }
    // The path the case is meant to reach.
    mha::detail::CoreOptions<float> core;
    core.bf16_products = available;
    const Index query_len = c.query_shape[1];
    const auto path =
        mha::detail::flash_path<float>(layer.head_dim(), layer.head_dim(), query_len, core, {});
    if (available && !wide_options.need_weights) CHECK(path == c.flash_path);
  }
}

TEST_CASE("bf16 arithmetic gives the same bits frozen and unfrozen, on any number of threads",
          "[precision]") {
  MultiHeadAttentionConfig config(128, 4);
  config.seed = 21;
  MultiHeadAttention<float> layer(config);
  mha_test::randomise(layer, 21);
  const auto x = mha_test::random_tensor<float>({2, 200, 128}, 22);
  const auto key = mha_test::random_tensor<float>({2, 150, 128}, 23);
  ForwardOptions<float> options;
  options.need_weights = false;
  options.is_causal = true;
  options.precision = Precision::bf16;
  const mha::FrozenMultiHeadAttention<float> frozen(layer);
  for (const bool self_attention : {true, false}) {
    INFO((self_attention ? "self-attention (one fused projection)" : "cross-attention"));
    const auto& k = self_attention ? x : key;
    const auto unfrozen = layer.forward(x, k, k, options);
    CHECK(frozen.forward(x, k, k, options).output.flat() == unfrozen.output.flat());
#ifdef _OPENMP
    const int threads_before = omp_get_max_threads();
    omp_set_num_threads(1);
    const auto one = layer.forward(x, k, k, options);
    omp_set_num_threads(3);
    const auto three = layer.forward(x, k, k, options);
    omp_set_num_threads(threads_before);
    CHECK(one.output.flat() == unfrozen.output.flat());
    CHECK(three.output.flat() == unfrozen.output.flat());
#endif
  }
}

TEST_CASE("16-bit layers compute in bf16 too, within 1e-2 of float64", "[precision]") {
  MultiHeadAttentionConfig config(128, 2);
  config.seed = 31;
  const MultiHeadAttention<double> wide(config);
  const auto check = [&](auto zero) {
    using T16 = decltype(zero);
    const MultiHeadAttention<T16> narrow = converted<T16>(wide);
    const MultiHeadAttention<double> same = converted<double>(narrow);
    const auto x = mha::tensor_cast<T16>(mha_test::random_tensor<double>({2, 96, 128}, 32));
    ForwardOptions<double> wide_options;
    wide_options.need_weights = false;
    ForwardOptions<T16> options;
    options.need_weights = false;
    options.precision = Precision::bf16;
    const auto expected = same.forward(mha::tensor_cast<double>(x), wide_options);
    CHECK(mha_test::error_of_largest(narrow.forward(x, options).output, expected.output) <= 1e-2);
    const mha::FrozenMultiHeadAttention<T16> frozen(narrow);
    CHECK(frozen.forward(x, options).output.flat() == narrow.forward(x, options).output.flat());
  };
  SECTION("bfloat16") {
    check(Eigen::bfloat16(0));
  }
  SECTION("half") {
    check(Eigen::half(0));
  }
}

TEST_CASE("scaled_dot_product_attention in bf16 stays within 1e-2 of float64", "[precision]") {
  // Causal, grouped heads, D = 40 (20 pairs), 333 keys (an odd last block): q kᵀ and P v as bf16
  // tiles; the backward refuses bf16.
  const auto q = mha_test::random_tensor<double>({2, 4, 333, 40}, 51);
  const auto k = mha_test::random_tensor<double>({2, 2, 333, 40}, 52);
  const auto v = mha_test::random_tensor<double>({2, 2, 333, 40}, 53);
  mha::AttentionOptions<double> wide;
  wide.causal = mha::Causal::top_left;
  wide.enable_gqa = true;
  mha::AttentionOptions<float> options;
  options.causal = mha::Causal::top_left;
  options.enable_gqa = true;
  options.precision = Precision::bf16;
  const auto expected = mha::scaled_dot_product_attention(q, k, v, wide);
  const auto qf = mha::tensor_cast<float>(q), kf = mha::tensor_cast<float>(k),
             vf = mha::tensor_cast<float>(v);
  const auto actual = mha::scaled_dot_product_attention(qf, kf, vf, options);
  const double error = mha_test::error_of_largest(actual.output, expected.output);
  INFO("bf16 error " << error);
  CHECK(error <= 1e-2);
  if (mha::bf16_arithmetic_available()) CHECK(error > 1e-5);
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>([&] {
                             mha::scaled_dot_product_attention_backward(
                                 qf.view(), kf.view(), vf.view(), actual, actual.output.view(),
                                 options);
                           }),
                           "precision"));
}

TEST_CASE("bf16 tiles read no value outside their key block", "[precision]") {
  // A window of 4 keys to the left and 1 to the right over 300 keys: the second query block
  // (queries 96-191) reads keys 92-192, an odd count starting at an even key, so its last pair of
  // values would hold key 193, which only queries 192-197 see. Key 193's value is infinite: the
  // outputs of the query blocks whose keys stop before it (queries 0-191) must stay finite, as
  // the fp32 tiles keep them. (Later blocks hold key 193 in their tiles, where a weight of 0
  // times the infinite value is NaN in either precision, as ForwardOptions::check_inputs says.)
  auto q = mha_test::random_tensor<float>({1, 1, 300, 32}, 55);
  auto k = mha_test::random_tensor<float>({1, 1, 300, 32}, 56);
  auto v = mha_test::random_tensor<float>({1, 1, 300, 32}, 57);
  for (Index d = 0; d < 32; ++d) v.data()[193 * 32 + d] = std::numeric_limits<float>::infinity();
  mha::AttentionOptions<float> options;
  options.window = {4, 1};
  options.precision = Precision::bf16;
  const auto out = mha::scaled_dot_product_attention(q, k, v, options);
  bool finite = true;
  for (Index i = 0; i < 192; ++i) {
    for (Index d = 0; d < 32; ++d) finite = finite && std::isfinite(out.output.data()[i * 32 + d]);
  }
  CHECK(finite);
}

TEST_CASE("a frozen layer decodes with bf16 projections within 1e-2 of float64", "[precision]") {
  // B = 3 sequences, grouped heads: a prompt of 40 tokens, then steps of 1 and 2, against one
  // causal float64 forward over the whole sequences.
  MultiHeadAttentionConfig config(128, 4);
  config.num_kv_heads = 2;
  config.seed = 61;
  const MultiHeadAttention<float> layer(config);
  const MultiHeadAttention<double> wide = converted<double>(layer);
  const mha::FrozenMultiHeadAttention<float> frozen(layer);
  const auto x = mha_test::random_tensor<float>({3, 43, 128}, 62);
  ForwardOptions<double> causal;
  causal.need_weights = false;
  causal.is_causal = true;
  const auto expected = wide.forward(mha::tensor_cast<double>(x), causal);
  for (const Precision precision : {Precision::fp32, Precision::bf16}) {
    INFO(mha::precision_name(precision));
    auto options = MultiHeadAttention<float>::decode_options();
    options.precision = precision;
    auto cache = layer.make_kv_cache(3, 43);
    Tensor<float> decoded(x.shape());
    Index first = 0;
    for (const Index count : {40, 1, 2}) {
      Tensor<float> step({3, count, 128});
      for (Index b = 0; b < 3; ++b) step[b].matrix() = x[b].matrix().middleRows(first, count);
      const auto out = frozen.decode(step, cache, options);
      for (Index b = 0; b < 3; ++b) {
        decoded[b].matrix().middleRows(first, count) = out.output[b].matrix();
      }
      first += count;
    }
    const double error = mha_test::error_of_largest(decoded, expected.output);
    INFO("error " << error);
    if (precision == Precision::fp32) {
      CHECK(error <= 1e-5);
    } else {
      CHECK(error <= 1e-2);
      if (mha::bf16_arithmetic_available()) CHECK(error > 1e-4);
    }
  }
}

TEST_CASE("a layer's decode, double computations and training refuse what they do not compute",
          "[precision]") {
  const MultiHeadAttention<float> layer(MultiHeadAttentionConfig(32, 2));
  const auto x = mha_test::random_tensor<float>({1, 4, 32}, 41);
  ForwardOptions<float> options;
  options.need_weights = false;
  options.precision = Precision::int8;
  mha::SavedForward<float> saved;
  MultiHeadAttention<float> trained = layer;
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>(
                               [&] { trained.forward_train(x, options, saved); }),
                           "precision"));
  CHECK_FALSE(saved.filled());
  options.precision = Precision::bf16;
  auto cache = layer.make_kv_cache(1, 8);
  CHECK(mha_test::contains(
      mha_test::message_of<std::invalid_argument>([&] { layer.decode(x, cache, options); }),
      "FrozenMultiHeadAttention"));
  CHECK(cache.length(0) == 0);  // nothing changed
  const MultiHeadAttention<double> wide(MultiHeadAttentionConfig(32, 2));
  ForwardOptions<double> wide_options;
  wide_options.precision = Precision::bf16;
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>(
                               [&] { wide.forward(mha::tensor_cast<double>(x), wide_options); }),
                           "precision"));
  MultiHeadAttention<double> wide_trained = wide;
  mha::SavedForward<double> wide_saved;
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>([&] {
                             wide_trained.forward_train(mha::tensor_cast<double>(x), wide_options,
                                                        wide_saved);
                           }),
                           "bf16 on a double layer"));
}

TEST_CASE("int8 weights: per-row scales, levels within half a step, products as double's",
          "[precision][int8]") {
  for (const Index depth : {1, 16, 37, 2050}) {
    for (const Index outputs : {1, 5, 70}) {
      INFO("depth " << depth << ", outputs " << outputs);
      const Index stride = depth + 3;
      auto weight = mha_test::random_tensor<float>({outputs, stride}, 71);
      for (Index k = 0; k < stride; ++k) weight.data()[k] = 0.0F;  // a row of zeros
      mha::detail::Int8Weight q;
      mha::detail::quantize_int8_weight(weight.data(), outputs, depth, stride, q);
      bool levels = true, within = true, extreme = true;
      for (Index n = 0; n < outputs; ++n) {
        const float scale = q.scales[static_cast<std::size_t>(n)];
        int largest = 0;
        for (Index k = 0; k < depth; ++k) {
          const int level = q.values[static_cast<std::size_t>(n * depth + k)];
          levels = levels && level >= -127 && level <= 127;
          largest = std::max(largest, std::abs(level));
          within = within && std::abs(static_cast<double>(weight.data()[n * stride + k]) -
                                      static_cast<double>(q.dequantized(n, k))) <=
                                 0.5001 * static_cast<double>(scale);
        }
        extreme = extreme && (n == 0 ? scale == 0.0F && largest == 0 : largest == 127);
      }
      CHECK(levels);
      CHECK(within);
      CHECK(extreme);
      for (const Index rows : {1, 3, 4, 9}) {
        INFO(rows << " rows");
        const Index x_stride = depth + 1, ld = outputs + 2;
        const auto x = mha_test::random_tensor<float>({rows, x_stride}, 72);
        std::vector<float> dst(static_cast<std::size_t>(rows * ld), -7.0F);
        mha::detail::int8_product(x.data(), rows, x_stride, q, dst.data(), ld);
        bool close = true, untouched = true;
        for (Index m = 0; m < rows; ++m) {
          for (Index n = 0; n < ld; ++n) {
            const double actual = dst[static_cast<std::size_t>(m * ld + n)];
            if (n >= outputs) {
              untouched = untouched && actual == -7.0;
              continue;
            }
            double sum = 0, magnitude = 0;
            for (Index k = 0; k < depth; ++k) {
              const double term = static_cast<double>(q.dequantized(n, k)) *
                                  static_cast<double>(x.data()[m * x_stride + k]);
              sum += term;
              magnitude += std::abs(term);
            }
            // A depth-term fp32 sum, then the scale: within γ(depth + 2) of the magnitudes.
            const double terms = static_cast<double>(depth + 2), u = std::ldexp(1.0, -24);
            close = close && std::abs(actual - sum) <= terms * u / (1 - terms * u) * magnitude;
          }
        }
        CHECK(close);
        CHECK(untouched);
#ifdef _OPENMP
        const int threads_before = omp_get_max_threads();
        std::vector<float> three(dst.size(), -7.0F);
        omp_set_num_threads(3);
        mha::detail::int8_product(x.data(), rows, x_stride, q, three.data(), ld);
        omp_set_num_threads(threads_before);
        CHECK(three == dst);
#endif
      }
    }
  }
}

TEST_CASE("int8 weights of rows at float's extremes: finite scales, levels within a step",
          "[precision][int8]") {
  // Rows whose largest magnitude is a few subnormal steps (its scale / 127 would round to 0),
  // a row of the largest floats, and one of ordinary values.
  const float tiny = std::numeric_limits<float>::denorm_min();
  const float huge = std::numeric_limits<float>::max();
  const std::vector<std::vector<float>> rows = {{tiny, 0.0F, -tiny, 0.0F},
                                                {10 * tiny, -3 * tiny, 0.0F, tiny},
                                                {200 * tiny, -199 * tiny, 5 * tiny, 0.0F},
                                                {huge, -huge, huge / 3, 0.0F},
                                                {0.5F, -0.25F, 0.0F, 1.0F}};
  const Index outputs = static_cast<Index>(rows.size()), depth = 4;
  std::vector<float> weight;
  for (const auto& row : rows) weight.insert(weight.end(), row.begin(), row.end());
  mha::detail::Int8Weight q;
  mha::detail::quantize_int8_weight(weight.data(), outputs, depth, depth, q);
  for (Index n = 0; n < outputs; ++n) {
    INFO("row " << n);
    const float scale = q.scales[static_cast<std::size_t>(n)];
    CHECK(std::isfinite(scale));
    CHECK(scale > 0.0F);
    for (Index k = 0; k < depth; ++k) {
      const double w = weight[static_cast<std::size_t>(n * depth + k)];
      // Half a step, plus what a subnormal scale's rounding adds at level 127.
      CHECK(std::abs(w - static_cast<double>(q.dequantized(n, k))) <=
            0.5 * static_cast<double>(scale) + 127.0 * static_cast<double>(tiny));
    }
  }
  // A row under 127 subnormal steps is held exactly.
  for (Index n = 0; n < 2; ++n) {
    for (Index k = 0; k < depth; ++k)
      CHECK(q.dequantized(n, k) == weight[static_cast<std::size_t>(n * depth + k)]);
  }
  // The products are finite where the float products are: FLT_MAX · 1 included.
  const std::vector<float> x = {1.0F, 0.0F, 0.0F, 0.0F};
  std::vector<float> dst(static_cast<std::size_t>(outputs));
  mha::detail::int8_product(x.data(), 1, depth, q, dst.data(), outputs);
  for (const float value : dst) CHECK(std::isfinite(value));
}

TEST_CASE("a frozen layer with int8 weights stays within 2e-2 of float64, forward and decode",
          "[precision][int8]") {
  for (const bool packed_projection : {true, false}) {
    INFO((packed_projection ? "in_proj_weight" : "q/k/v_proj_weight (grouped heads)"));
    MultiHeadAttentionConfig config(128, 4);
    if (!packed_projection) config.num_kv_heads = 2;
    config.seed = 81;
    const MultiHeadAttention<float> layer(config);
    const MultiHeadAttention<double> wide = converted<double>(layer);
    const mha::FrozenMultiHeadAttention<float> frozen(layer, mha::FrozenWeights::int8);
    CHECK(frozen.weights_int8());
    // Its weights are the quantized ones: a layer holding them forwards to the same bits.
    const MultiHeadAttention<float>& quantized = frozen.layer();
    const auto x = mha_test::random_tensor<float>({3, 43, 128}, 82);
    ForwardOptions<float> options;
    options.need_weights = false;
    options.is_causal = true;
    ForwardOptions<double> wide_options;
    wide_options.need_weights = false;
    wide_options.is_causal = true;
    const auto expected = wide.forward(mha::tensor_cast<double>(x), wide_options);
    const auto forward = frozen.forward(x, options);
    CHECK(forward.output.flat() == quantized.forward(x, options).output.flat());
    const double forward_error = mha_test::error_of_largest(forward.output, expected.output);
    INFO("forward error " << forward_error);
    CHECK(forward_error <= 2e-2);
    CHECK(forward_error > 1e-4);  // the weights did change
    // Decoding: a prompt of 40, then steps of 1 and 2, the steps' projections on int8 values.
    auto cache = layer.make_kv_cache(3, 43);
    auto reference_cache = layer.make_kv_cache(3, 43);
    const auto step_options = MultiHeadAttention<float>::decode_options();
    Tensor<float> decoded(x.shape());
    Index first = 0;
    for (const Index count : {40, 1, 2}) {
      Tensor<float> step({3, count, 128});
      for (Index b = 0; b < 3; ++b) step[b].matrix() = x[b].matrix().middleRows(first, count);
      const auto out = frozen.decode(step, cache, step_options);
      // The same step by the quantized weights in float: rounding apart, the same.
      const auto same = quantized.decode(step, reference_cache, step_options);
      CHECK(mha_test::error_of_largest(out.output, mha::tensor_cast<double>(same.output)) <= 1e-5);
      for (Index b = 0; b < 3; ++b) {
        decoded[b].matrix().middleRows(first, count) = out.output[b].matrix();
      }
      first += count;
    }
    const double decode_error = mha_test::error_of_largest(decoded, expected.output);
    INFO("decode error " << decode_error);
    CHECK(decode_error <= 2e-2);
  }
}

TEST_CASE("int8 weights are refused for 16-bit layers and non-finite weights",
          "[precision][int8]") {
  const MultiHeadAttention<Eigen::half> half_layer(MultiHeadAttentionConfig(32, 2));
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>([&] {
                             mha::FrozenMultiHeadAttention<Eigen::half> frozen(
                                 half_layer, mha::FrozenWeights::int8);
                           }),
                           "weights"));
  MultiHeadAttention<float> layer(MultiHeadAttentionConfig(32, 2));
  layer.parameter("out_proj.weight").data()[5] = std::numeric_limits<float>::infinity();
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>([&] {
                             mha::FrozenMultiHeadAttention<float> frozen(layer,
                                                                         mha::FrozenWeights::int8);
                           }),
                           "out_proj.weight is not finite"));
}

TEST_CASE("int8 x int8 products: rows quantized alike by both forms, products as double's",
          "[precision][int8]") {
  // quantize_row_int8 (scalar) against the AVX-512 form, bytes and scales, with tails, a row of
  // zeros, one too small to scale and one holding an infinity.
  for (const Index cols : {1, 5, 16, 37, 1031}) {
    INFO(cols << " columns");
    auto rows = mha_test::random_tensor<float>({4, cols}, 91);
    for (Index k = 0; k < cols; ++k) {
      rows.data()[cols + k] = 0.0F;
      rows.data()[2 * cols + k] = 1e-38F;
    }
    rows.data()[3 * cols + cols / 2] = std::numeric_limits<float>::infinity();
    for (Index i = 0; i < 4; ++i) {
      const Index bytes = 4 * mha::detail::int8_quads(cols);
      std::vector<std::uint8_t> scalar(static_cast<std::size_t>(bytes), 7);
      const float scale =
          mha::detail::quantize_row_int8(rows.data() + i * cols, cols, scalar.data());
      if (i == 1 || i == 2) CHECK(scale == 0.0F);
      if (i == 3) CHECK(std::isnan(scale));
#ifdef MHA_PACKED_GEMM_X86
      if (mha::detail::cpu_has_avx512f()) {
        std::vector<std::uint8_t> vector(scalar.size(), 7);
        const float vector_scale =
            mha::detail::quantize_row_int8_avx512(rows.data() + i * cols, cols, vector.data());
        CHECK(vector == scalar);
        CHECK((vector_scale == scale || (std::isnan(vector_scale) && std::isnan(scale))));
      }
#endif
    }
  }
  if (!mha::detail::int8_dot_available()) {
    WARN("this CPU lacks AVX512_VNNI: the int8 x int8 products are not run");
    return;
  }
  for (const Index rows : {1, 7, 64}) {
    for (const Index outputs : {16, 45, 300}) {
      for (const Index depth : {7, 512, 1031}) {
        INFO(rows << " rows, " << outputs << " outputs, depth " << depth);
        const Index x_stride = depth + 3, ld = outputs + 2;
        const auto x = mha_test::random_tensor<float>({rows, x_stride}, 92);
        const auto w = mha_test::random_tensor<float>({outputs, depth}, 93);
        mha::detail::Int8Weight q;
        mha::detail::quantize_int8_weight(w.data(), outputs, depth, depth, q);
        mha::detail::Int8PackedWeight packed;
        mha::detail::pack_int8_weight(q, packed);
        mha::detail::Int8Scratch scratch;
        std::vector<float> dst(static_cast<std::size_t>(rows * ld), -7.0F);
        mha::detail::int8_gemm(x.data(), rows, x_stride, packed, dst.data(), ld, scratch);
        bool close = true, untouched = true;
        std::vector<std::uint8_t> levels(
            static_cast<std::size_t>(4 * mha::detail::int8_quads(depth)));
        for (Index i = 0; i < rows; ++i) {
          const double row_scale =
              mha::detail::quantize_row_int8(x.data() + i * x_stride, depth, levels.data());
          for (Index j = 0; j < ld; ++j) {
            const double actual = dst[static_cast<std::size_t>(i * ld + j)];
            if (j >= outputs) {
              untouched = untouched && actual == -7.0;
              continue;
            }
            double sum = 0;
            for (Index k = 0; k < depth; ++k) {
              sum += (static_cast<double>(levels[static_cast<std::size_t>(k)]) - 128) *
                     static_cast<double>(q.values[static_cast<std::size_t>(j * depth + k)]);
            }
            const double expected =
                sum * static_cast<double>(q.scales[static_cast<std::size_t>(j)]) * row_scale;
            // The int32 sum exact, then its conversion and two fp32 multiplications.
            close =
                close && std::abs(actual - expected) <= 4 * 0x1p-24 * std::abs(expected) + 1e-30;
          }
        }
        CHECK(close);
        CHECK(untouched);
#ifdef _OPENMP
        const int threads_before = omp_get_max_threads();
        std::vector<float> three(dst.size(), -7.0F);
        omp_set_num_threads(3);
        mha::detail::int8_gemm(x.data(), rows, x_stride, packed, three.data(), ld, scratch);
        omp_set_num_threads(threads_before);
        CHECK(three == dst);
#endif
      }
    }
  }
}

TEST_CASE("Precision::int8 on a frozen layer with int8 weights stays within 2e-2 of float64",
          "[precision][int8]") {
  MultiHeadAttentionConfig config(256, 4);
  config.seed = 95;
  const MultiHeadAttention<float> layer(config);
  const MultiHeadAttention<double> wide = converted<double>(layer);
  const mha::FrozenMultiHeadAttention<float> frozen(layer, mha::FrozenWeights::int8);
  const auto x = mha_test::random_tensor<float>({2, 100, 256}, 96);
  ForwardOptions<double> wide_options;
  wide_options.need_weights = false;
  wide_options.is_causal = true;
  const auto expected = wide.forward(mha::tensor_cast<double>(x), wide_options);
  ForwardOptions<float> options;
  options.need_weights = false;
  options.is_causal = true;
  const auto weight_only = frozen.forward(x, options);
  options.precision = Precision::int8;
  const auto int8 = frozen.forward(x, options);
  const double error = mha_test::error_of_largest(int8.output, expected.output);
  INFO("int8 error " << error << ", weight-only "
                     << mha_test::error_of_largest(weight_only.output, expected.output));
  CHECK(error <= 2e-2);
  if (mha::detail::int8_dot_available()) {
    CHECK(int8.output.flat() != weight_only.output.flat());
  } else {
    CHECK(int8.output.flat() == weight_only.output.flat());
  }
  // Decoding a prompt of 100 rows (int8 x int8), then one token (the int8 values).
  auto cache = layer.make_kv_cache(2, 101);
  auto step_options = MultiHeadAttention<float>::decode_options();
  step_options.precision = Precision::int8;
  const auto prompt = frozen.decode(x, cache, step_options);
  CHECK(mha_test::error_of_largest(prompt.output, expected.output) <= 2e-2);
  // Refused: a layer without int8 weights, attention alone.
  CHECK(mha_test::contains(
      mha_test::message_of<std::invalid_argument>([&] { layer.forward(x, options); }),
      "FrozenWeights::int8"));
  const mha::FrozenMultiHeadAttention<float> plain(layer);
  CHECK(mha_test::contains(
      mha_test::message_of<std::invalid_argument>([&] { plain.forward(x, options); }),
      "FrozenWeights::int8"));
  mha::AttentionOptions<float> attention_options;
  attention_options.precision = Precision::int8;
  const auto q = mha_test::random_tensor<float>({2, 8, 16}, 97);
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>([&] {
                             mha::scaled_dot_product_attention(q, q, q, attention_options);
                           }),
                           "precision"));
}
