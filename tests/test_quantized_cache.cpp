// Quantized KV caches (KVCacheFormat::q8 and q4, kernels/quantized_cache.hpp): every value read
// back is within half its block's scale of the value stored, and a block's scale is its largest
// magnitude over 127 (7) rounded up to bfloat16; the vector and scalar widenings agree bit for
// bit; decoding through a quantized cache, token by token and with prompts that take the flash
// kernel, stays within issue 18's bound of the float64 forward (1e-2 of its largest output for
// q8; q4's bound is docs/precision.md's statement); sliding windows and rewinding work on blocks;
// and what a quantized cache cannot hold is refused. (tests/test_decode.cpp checks that the
// decoding kernel reads the blocks as the float cache their codes stand for.)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "helpers.hpp"
#include "mha/kernels/decode_q4.hpp"
#include "mha/kernels/quantized_cache.hpp"

using mha::Index;
using mha::KVCache;
using mha::KVCacheFormat;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::Tensor;
using mha::detail::kQuantBlock;
using mha::detail::Q4Block;
using mha::detail::Q8Block;

using mha_test::converted;

namespace {

// Blocks of every kind a cache meets: ordinary, zeros, one large value among small ones,
// values too small for a scale, huge finite ones, and mixed signs at the range's ends.
std::vector<std::vector<float>> blocks_to_quantize() {
  std::vector<std::vector<float>> all;
  mha::Random random(3);
  for (int i = 0; i < 20; ++i) {
    std::vector<float> block(kQuantBlock);
    const float magnitude = std::pow(10.0F, static_cast<float>(i % 7) - 3.0F);
    for (float& x : block) x = magnitude * static_cast<float>(random.normal());
    all.push_back(block);
  }
  all.emplace_back(kQuantBlock, 0.0F);
  std::vector<float> spike(kQuantBlock, 1e-3F);
  spike[7] = -250.0F;
  all.push_back(spike);
  all.emplace_back(kQuantBlock, std::numeric_limits<float>::denorm_min());
  all.emplace_back(kQuantBlock, 3e38F);
  std::vector<float> ends(kQuantBlock);
  for (Index i = 0; i < kQuantBlock; ++i) ends[static_cast<std::size_t>(i)] = i % 2 ? 1.0F : -1.0F;
  all.push_back(ends);
  return all;
}

template <class Block>
void check_round_trip() {
  const float levels = mha::detail::largest_code<Block>();
  for (const auto& values : blocks_to_quantize()) {
    Block block{};
    mha::detail::quantize_block(values.data(), block);
    float largest = 0.0F;
    for (const float x : values) largest = std::max(largest, std::abs(x));
    const float scale = mha::detail::bf16_bits_to_float(block.scale);
    INFO("largest " << largest << ", scale " << scale);
    // The scale: largest / levels rounded up to the next bfloat16 (at most 2^-7 above it where
    // that is a normal float; a positive one where it underflows).
    CHECK(scale >= largest / levels);
    if (largest / levels >= std::numeric_limits<float>::min()) {
      CHECK(scale <= largest / levels * (1.0F + 1.0F / 128));
    } else {
      CHECK(scale <= std::numeric_limits<float>::min());
      CHECK((scale > 0.0F) == (largest > 0.0F));
    }
    // Each value within half a scale; the widenings (AVX-512 where it runs) the same bits as the
    // scalar one.
    mha::Matrix<float> tile(1, kQuantBlock);
    mha::detail::dequantize_rows(&block, 1, kQuantBlock, 1, tile);
    for (Index i = 0; i < kQuantBlock; ++i) {
      const float x = values[static_cast<std::size_t>(i)];
      const float read = mha::detail::dequantized(block, i);
      CHECK(std::abs(read - x) <= scale / 2);
      CHECK(tile(0, i) == read);
    }
  }
  // A block holding infinity or NaN reads as NaN.
  for (const float bad :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> values(kQuantBlock, 1.0F);
    values[3] = bad;
    Block block{};
    mha::detail::quantize_block(values.data(), block);
    for (Index i = 0; i < kQuantBlock; ++i) CHECK(std::isnan(mha::detail::dequantized(block, i)));
  }
}

// x [B, L, E] decoded in steps of the given sizes through `cache`; the outputs [B, L, E].
template <class T>
Tensor<T> decode_steps(const MultiHeadAttention<T>& layer, KVCache<T>& cache, const Tensor<T>& x,
                       const mha::ForwardOptions<T>& options, const std::vector<Index>& steps) {
  Tensor<T> outputs(x.shape());
  Index first = 0;
  for (const Index count : steps) {
    Tensor<T> rows({x.dim(0), count, x.dim(2)});
    for (Index b = 0; b < x.dim(0); ++b) {
      rows[b].matrix() = x[b].matrix().middleRows(first, count);
    }
    const auto out = layer.decode(rows, cache, options);
    for (Index b = 0; b < x.dim(0); ++b) {
      outputs[b].matrix().middleRows(first, count) = out.output[b].matrix();
    }
    first += count;
  }
  REQUIRE(first == x.dim(1));
  return outputs;
}

struct LayerCase {
  std::string name;
  MultiHeadAttentionConfig config;
  bool rope = false;
};

std::vector<LayerCase> layer_cases() {
  MultiHeadAttentionConfig plain(64, 4);
  plain.seed = 5;
  MultiHeadAttentionConfig grouped(128, 8);  // GQA 8/2, D = 16: blocks span two heads
  grouped.num_kv_heads = 2;
  grouped.seed = 6;
  MultiHeadAttentionConfig wide(256, 2);  // D = 128, one query head per key/value head
  wide.seed = 7;
  return {{"E = 64, H = 4", plain, false},
          {"GQA 8/2 + RoPE, D = 16", grouped, true},
          {"E = 256, H = 2, D = 128", wide, false}};
}

// The float64 layer's causal forward over x, and decoding it through a cache of `format` (a
// prompt of 40 tokens, which takes the flash kernel, then tokens one by one, then 3): the error
// relative to the float64 output's largest magnitude.
template <class T>
double decode_error(const LayerCase& c, KVCacheFormat format) {
  MultiHeadAttention<T> layer(c.config);
  const auto exact_layer = converted<double>(layer);
  const Index B = 2, L = 50;
  const auto x = mha_test::random_tensor<T>({B, L, layer.embed_dim()}, 17);
  auto options = MultiHeadAttention<T>::decode_options();
  auto exact_options = MultiHeadAttention<double>::decode_options();
  if (c.rope) options.rope = exact_options.rope = mha::Rope{};
  const auto exact = exact_layer.forward(mha::tensor_cast<double>(x), exact_options).output;
  auto cache = layer.make_kv_cache(B, L, -1, format);
  CHECK(cache.format() == format);
  const auto decoded = decode_steps(layer, cache, x, options, {40, 1, 1, 1, 1, 1, 1, 1, 3});
  return mha_test::error_of_largest(decoded, exact);
}

}  // namespace

TEST_CASE("q8 and q4 blocks: scales rounded up, values within half a scale, NaN stays NaN",
          "[quantized]") {
  SECTION("q8") {
    check_round_trip<Q8Block>();
  }
  SECTION("q4") {
    check_round_trip<Q4Block>();
  }
}

TEMPLATE_TEST_CASE("decoding through a quantized cache stays within its bound of float64",
                   "[quantized][decode]", float, Eigen::half) {
  using T = TestType;
  for (const auto& c : layer_cases()) {
    INFO(c.name);
    const double full = decode_error<T>(c, KVCacheFormat::as_layer);
    const double q8 = decode_error<T>(c, KVCacheFormat::q8);
    const double q4 = decode_error<T>(c, KVCacheFormat::q4);
    INFO("errors: as the layer " << full << ", q8 " << q8 << ", q4 " << q4);
    CHECK(q8 <= 1e-2);  // issue 18's bound
    // docs/precision.md's statement: the output averages values each within a fourteenth of
    // their block's largest magnitude (7 %), and the keys' errors move the weights a little.
    CHECK(q4 <= 1e-1);
    CHECK(q8 < q4);
    CHECK(full <= q8);  // (each format did quantize)
  }
}

TEST_CASE("int8 query rows for the q4 products: within half a scale, as laid out, NaN kept",
          "[quantized]") {
  // Rows of five blocks (a group of four, then one) of every magnitude, a row of zeros, and rows
  // holding infinity or NaN.
  const Index depth = 5 * kQuantBlock;
  std::vector<std::vector<float>> rows;
  for (const auto& block : blocks_to_quantize()) {
    std::vector<float> row;
    for (Index i = 0; i < depth; ++i) {
      row.push_back(block[static_cast<std::size_t>((7 * i) % kQuantBlock)] *
                    (i < kQuantBlock ? 1.0F : 0.5F));
    }
    rows.push_back(row);
  }
  for (const float bad :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    rows.emplace_back(depth, 1.0F);
    rows.back()[100] = bad;
  }
  for (const auto& row : rows) {
    float inverse = 0.0F;
    const float scale = mha::detail::query_row_scale(row.data(), depth, inverse);
    std::vector<std::int8_t> codes(static_cast<std::size_t>(depth));
    mha::detail::quantize_query_values(row.data(), depth, inverse, codes.data());
    float largest = 0.0F;
    bool finite = true;
    for (const float x : row) {
      largest = std::max(largest, std::abs(x));
      finite = finite && std::isfinite(x);
    }
    INFO("largest " << largest << ", scale " << scale);
    // (Rows below float's smallest normal magnitude read as zeros.)
    if (!finite) {
      CHECK(std::isnan(scale));
    } else if (largest < std::numeric_limits<float>::min()) {
      CHECK(scale == 0.0F);
    } else {
      CHECK(scale == largest / 127.0F);
    }
    for (Index i = 0; i < depth; ++i) {
      const auto code = codes[static_cast<std::size_t>(i)];
      CHECK(std::abs(code) <= 127);
      if (!finite || scale == 0.0F) {
        CHECK(code == 0);
      } else {
        // Within half a scale, but for the float rounding of x · (127 / largest) and of the
        // scale: a level of up to 127 moved by a few units of its last place (2^-17 each).
        const double error =
            std::abs(static_cast<double>(scale) * code - row[static_cast<std::size_t>(i)]);
        CHECK(error <= (0.5 + 1e-4) * scale);
      }
    }
#ifdef MHA_PACKED_GEMM_X86
    if (mha::detail::q4_products_available(depth, depth)) {
      // What the q4 products read: per group of four blocks, each block's codes of values 0-15
      // and then 16-31, -8 times each lane's sum of codes, and after the groups the scale.
      std::vector<std::int8_t> prepared(
          static_cast<std::size_t>(mha::detail::q4_query_row_bytes(depth)));
      mha::detail::prepare_q4_query(row.data(), depth, prepared.data());
      for (Index block = 0; block < 8; ++block) {
        const std::int8_t* group = prepared.data() + block / 4 * mha::detail::kQ4QueryGroupBytes;
        for (Index i = 0; i < kQuantBlock; ++i) {
          const auto laid_out = group[(i / 16) * 64 + (block % 4) * 16 + i % 16];
          const Index d = block * kQuantBlock + i;
          CHECK(laid_out == (d < depth ? codes[static_cast<std::size_t>(d)] : 0));
        }
        for (Index lane = 0; lane < 4; ++lane) {
          std::int32_t start = 0;
          std::memcpy(&start, group + 128 + 4 * (4 * (block % 4) + lane), sizeof(start));
          std::int32_t sum = 0;
          for (const Index half : {0, 16}) {
            for (Index i = 0; i < 4; ++i) {
              const Index d = block * kQuantBlock + half + 4 * lane + i;
              if (d < depth) sum += codes[static_cast<std::size_t>(d)];
            }
          }
          CHECK(start == -8 * sum);
        }
      }
      const float read = mha::detail::q4_query_scale(prepared.data(), depth);
      CHECK((read == scale || (std::isnan(read) && std::isnan(scale))));
    }
#endif
  }
}

TEST_CASE("a quantized cache holds the rows it was given within half a block's scale",
          "[quantized]") {
  MultiHeadAttentionConfig config(64, 2);
  config.seed = 8;
  const MultiHeadAttention<float> layer(config);
  const auto x = mha_test::random_tensor<float>({2, 9, 64}, 3);
  auto exact = layer.make_kv_cache(2, 9);
  layer.decode(x, exact);
  for (const auto format : {KVCacheFormat::q8, KVCacheFormat::q4}) {
    INFO(mha::kv_cache_format_name(format));
    auto cache = layer.make_kv_cache(2, 9, -1, format);
    layer.decode(x, cache);
    const float levels = format == KVCacheFormat::q8 ? 127.0F : 7.0F;
    for (Index b = 0; b < 2; ++b) {
      for (const bool values : {false, true}) {
        const auto stored = values ? exact.values(b) : exact.keys(b);
        const auto read = values ? cache.dequantized_values(b) : cache.dequantized_keys(b);
        REQUIRE(read.shape() == stored.shape());
        for (Index row = 0; row < 9; ++row) {
          for (Index block = 0; block < 64 / kQuantBlock; ++block) {
            const auto original =
                stored.matrix().row(row).segment(block * kQuantBlock, kQuantBlock);
            const auto widened = read.matrix().row(row).segment(block * kQuantBlock, kQuantBlock);
            const float bound = original.cwiseAbs().maxCoeff() / levels * (1.0F + 1.0F / 128) / 2;
            CHECK((widened - original).cwiseAbs().maxCoeff() <= bound);
          }
        }
      }
    }
  }
  // Memory: 34 and 18 bytes per 32 values, against 64 in 16 bits and 128 in float.
  const Index values = 2 * 2 * 9 * 64;  // keys and values, B = 2, 9 tokens, H_kv·D = 64
  CHECK(exact.storage_bytes() == static_cast<std::size_t>(values) * 4);
  CHECK(layer.make_kv_cache(2, 9, -1, KVCacheFormat::q8).storage_bytes() ==
        static_cast<std::size_t>(values / 32 * 34));
  CHECK(layer.make_kv_cache(2, 9, -1, KVCacheFormat::q4).storage_bytes() ==
        static_cast<std::size_t>(values / 32 * 18));
}

TEST_CASE("a sliding quantized cache and a rewound one decode as the full quantized cache",
          "[quantized][decode]") {
  MultiHeadAttentionConfig config(64, 4);
  config.num_kv_heads = 2;
  config.seed = 9;
  const MultiHeadAttention<float> layer(config);
  const Index L = 30, w = 6;
  const auto x = mha_test::random_tensor<float>({1, L, 64}, 4);
  auto options = MultiHeadAttention<float>::decode_options();
  options.window = mha::Window{w, 0};
  for (const auto format : {KVCacheFormat::q8, KVCacheFormat::q4}) {
    INFO(mha::kv_cache_format_name(format));
    std::vector<Index> ones(L, 1);
    auto full = layer.make_kv_cache(1, L, -1, format);
    const auto expected = decode_steps(layer, full, x, options, ones);
    // capacity 2w: the kept blocks move to the front every w steps.
    auto sliding = layer.make_kv_cache(1, 2 * w, w, format);
    const auto decoded = decode_steps(layer, sliding, x, options, ones);
    const double largest = static_cast<double>(expected.flat().cwiseAbs().maxCoeff());
    CHECK_TENSORS_CLOSE_TOL(decoded, expected, 0.0, 1e-5 * largest);
    CHECK(sliding.length(0) == w);
    // Rewound by 5 tokens and decoded again: the same outputs for them.
    full.rewind(0, L - 5);
    Tensor<float> last({1, 5, 64});
    last[0].matrix() = x[0].matrix().bottomRows(5);
    const auto again = layer.decode(last, full, options).output;
    Tensor<float> expected_last({1, 5, 64});
    expected_last[0].matrix() = expected[0].matrix().bottomRows(5);
    CHECK_TENSORS_CLOSE_TOL(again, expected_last, 0.0, 1e-5 * largest);
  }
}

TEST_CASE("what a quantized cache cannot hold is refused, naming why", "[quantized][errors]") {
  const auto message = [](auto&& f) { return mha_test::message_of<mha::ShapeError>(f); };
  MultiHeadAttentionConfig odd(40, 2);  // H_kv·D = 40: not whole blocks of 32
  CHECK(
      message([&] { MultiHeadAttention<float>(odd).make_kv_cache(1, 8, -1, KVCacheFormat::q8); }) ==
      "format: q8 quantizes blocks of 32 values of a row: expected H_kv·D a multiple of "
      "32, got 2·20 = 40");
  CHECK(message([&] {
          MultiHeadAttention<double>(MultiHeadAttentionConfig(64, 2))
              .make_kv_cache(1, 8, -1, KVCacheFormat::q4);
        }) == "format: q4 caches are for layers that compute in float");
  const MultiHeadAttention<float> layer(MultiHeadAttentionConfig(64, 2));
  const auto cache = layer.make_kv_cache(1, 8, -1, KVCacheFormat::q8);
  CHECK(mha_test::contains(message([&] { cache.keys(0); }),
                           "read it with dequantized_keys() and dequantized_values()"));
}
