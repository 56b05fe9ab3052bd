// The decoding kernel (kernels/decode.hpp), which attends a whole batch of cached sequences in one
// parallel pass, against the flash kernel run one sequence at a time (the path decode took
// before it, still taken for prompts) and against the reference kernel in double on the same
// inputs: sequences of different lengths over several chunks, grouped-query attention on each of
// its paths (AVX-512 register blocks of every row count, the rows as lanes, the packed
// micro-kernel, dot products; the products of the first two also alone against double), a few
// queries per sequence, windows, ALiBi and softcap, keys and values stored in float, half,
// bfloat16 or q8 and q4 blocks (a q4 cache's own products, int8 queries and bf16 weights, against
// double within their bound); and the same results on any number of threads.
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "helpers.hpp"
#include "mha/kernels/decode.hpp"
#include "mha/kernels/decode_products.hpp"
#include "mha/kernels/decode_q4.hpp"
#include "mha/kernels/quantized_cache.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

using mha::Index;
using mha::Tensor;
using mha::detail::CoreOptions;
using mha::detail::DecodeSequence;
using mha::detail::DecodeShape;
using mha::detail::HeadLayout;
using mha::detail::KernelScratch;

namespace {

struct DecodeCase {
  std::string name;
  Index heads, kv_heads, head_dim;
  std::vector<Index> key_counts;  // per sequence, the new queries' keys included
  std::vector<Index> query_counts;
  bool window = false, alibi = false, softcap = false;
};

std::vector<DecodeCase> cases() {
  // Key counts around the chunk (240) and sub-block (24) sizes, and a sequence that sits out.
  const std::vector<Index> lengths{1, 23, 240, 241, 700};
  return {
      {"one query head per key/value head, D = 16", 4, 4, 16, lengths, {1, 1, 1, 1, 1}},
      {"GQA 8/1 (micro-kernel), D = 32, a few queries", 8, 1, 32, lengths, {1, 3, 15, 0, 2}},
      {"GQA 6/2 (dot products), D = 12, window, ALiBi",
       6,
       2,
       12,
       lengths,
       {1, 2, 1, 1, 3},
       true,
       true},
      {"GQA 16/2 (micro-kernel), D = 64, softcap, window",
       16,
       2,
       64,
       {3, 500, 260},
       {1, 1, 4},
       true,
       false,
       true},
      {"multi-query 4/1, D = 20 (value rows not whole panels)", 4, 1, 20, {300, 17}, {2, 1}},
      // Groups whose rows end in a block of 3, 2 or 1 (register blocks), D = 48 (P·V's blocks of
      // 64 columns, then one of 16).
      {"GQA 6/2 (groups of 3 rows), D = 48, ALiBi",
       6,
       2,
       48,
       lengths,
       {1, 1, 0, 1, 1},
       false,
       true},
      {"GQA 4/2, D = 32, 1 to 3 queries (2, 4 and 6 rows), window",
       4,
       2,
       32,
       {250, 241, 30},
       {1, 2, 3},
       true},
      {"GQA 5/1, D = 16, 1 and 2 queries (5 and 10 rows)", 5, 1, 16, {490, 7}, {1, 2}},
      // 16 query heads on one key/value head (the rows as lanes): groups of 16, 32 and 48 rows,
      // chunks that end in every tail of key blocks (16, 8, 4, 2, 1).
      {"GQA 16/1 (lanes), D = 128, 1 to 3 queries", 16, 1, 128, {255, 31, 1, 497}, {1, 2, 1, 3}},
      {"GQA 12/1 (lanes, 12 rows), D = 32, ALiBi", 12, 1, 32, {241, 19}, {1, 1}, false, true},
      // Heads of three blocks and of five (a q4 cache's groups of four blocks, then one).
      {"GQA 6/2 (groups of 3 rows), D = 96", 6, 2, 96, {250, 33}, {1, 2}},
      {"one query head per key/value head, D = 160, ALiBi",
       2,
       2,
       160,
       {260, 5},
       {1, 1},
       false,
       true},
  };
}

// Values float holds exactly (quarters, as tests/test_flash.cpp's cases), so the double
// reference runs on exactly the float inputs.
template <class T>
std::vector<T> quarters(Index count, std::uint64_t seed) {
  mha::Random random(seed);
  std::vector<T> values(static_cast<std::size_t>(count));
  for (auto& value : values) value = static_cast<T>(std::round(4 * random.normal()) / 4);
  return values;
}

template <class T>
CoreOptions<T> options_for(const DecodeCase& c, const std::vector<T>& slopes) {
  CoreOptions<T> options;
  options.scale = static_cast<T>(0.5);
  options.causal = mha::Causal::bottom_right;
  if (c.window) {
    options.window = mha::Window{37, 0};
    options.window.alignment = mha::Alignment::bottom_right;
  }
  if (c.alibi) {
    options.alibi_slopes = slopes.data();
    options.alibi_alignment = mha::Alignment::bottom_right;
  }
  if (c.softcap) options.softcap = T(2.5);
  return options;
}

// The inputs of one case: per sequence, queries [n, H·D] and keys and values [S, H_kv·D].
struct Inputs {
  std::vector<std::vector<float>> queries, keys, values;
};

Inputs inputs_of(const DecodeCase& c, std::uint64_t seed) {
  Inputs inputs;
  for (std::size_t b = 0; b < c.key_counts.size(); ++b) {
    const Index width = c.kv_heads * c.head_dim, keys = c.key_counts[b];
    inputs.queries.push_back(quarters<float>(c.query_counts[b] * c.heads * c.head_dim, seed + b));
    inputs.keys.push_back(quarters<float>(keys * width, seed + 100 + b));
    inputs.values.push_back(quarters<float>(keys * width, seed + 200 + b));
  }
  return inputs;
}

// The decoding kernel's outputs, one [n, H·D] vector per sequence, keys and values stored as
// Stored.
template <class Stored>
std::vector<std::vector<float>> decode_outputs(const DecodeCase& c, const Inputs& inputs,
                                               const CoreOptions<float>& options) {
  std::vector<std::vector<Stored>> keys, values;
  std::vector<std::vector<float>> outputs;
  std::vector<DecodeSequence<Stored>> sequences;
  const Index inner = c.heads * c.head_dim, width = c.kv_heads * c.head_dim;
  for (std::size_t b = 0; b < c.key_counts.size(); ++b) {
    if constexpr (mha::detail::is_quantized_block_v<Stored>) {
      for (auto* stored : {&keys, &values}) {
        const auto& source = stored == &keys ? inputs.keys[b] : inputs.values[b];
        stored->emplace_back(source.size() / mha::detail::kQuantBlock);
        mha::detail::quantize_rows(source.data(), c.key_counts[b], width, stored->back().data());
      }
    } else {
      keys.emplace_back(inputs.keys[b].begin(), inputs.keys[b].end());
      values.emplace_back(inputs.values[b].begin(), inputs.values[b].end());
    }
    outputs.emplace_back(inputs.queries[b].size(), -1.0F);
  }
  for (std::size_t b = 0; b < c.key_counts.size(); ++b) {
    sequences.push_back({inputs.queries[b].data(), outputs[b].data(), keys[b].data(),
                         values[b].data(), c.query_counts[b], c.key_counts[b]});
  }
  const Index kv_stride =
      mha::detail::is_quantized_block_v<Stored> ? width / mha::detail::kQuantBlock : width;
  const DecodeShape shape{c.heads, c.kv_heads, c.head_dim, c.head_dim, inner, inner, kv_stride};
  std::vector<KernelScratch<float>> scratch;
  mha::detail::DecodeScratch buffers;
  mha::detail::decode_attention(sequences, shape, options, scratch, buffers);
  return outputs;
}

// Sequence b through attention() alone, in T: the flash kernel (float), or the reference kernel
// (double, the exact result).
template <class T>
std::vector<T> per_sequence(const DecodeCase& c, const Inputs& inputs, std::size_t b,
                            CoreOptions<T> options) {
  const Index n = c.query_counts[b], keys = c.key_counts[b], depth = c.head_dim;
  const Index inner = c.heads * depth, width = c.kv_heads * depth;
  const std::vector<T> q(inputs.queries[b].begin(), inputs.queries[b].end());
  const std::vector<T> k(inputs.keys[b].begin(), inputs.keys[b].end());
  const std::vector<T> v(inputs.values[b].begin(), inputs.values[b].end());
  std::vector<T> out(static_cast<std::size_t>(n * inner));
  const Index group = c.heads / c.kv_heads;
  options.causal_cols = keys;
  std::vector<KernelScratch<T>> scratch;
  const auto kernel = std::is_same_v<T, double> ? mha::Kernel::reference : mha::Kernel::flash;
  mha::detail::attention<T>(
      kernel, 1, c.heads, HeadLayout<const T>{q.data(), 0, depth, inner, n, depth},
      HeadLayout<const T>{k.data(), 0, depth, width, keys, depth, group},
      HeadLayout<const T>{v.data(), 0, depth, width, keys, depth, group},
      HeadLayout<T>{out.data(), 0, depth, inner, n, depth}, options, nullptr, scratch);
  return out;
}

template <class T>
Tensor<T> as_tensor(const std::vector<T>& values) {
  Tensor<T> tensor({static_cast<Index>(values.size())});
  std::copy(values.begin(), values.end(), tensor.data());
  return tensor;
}

// The bounds of tests/test_flash.cpp's float kernels against double (measured there).
constexpr mha_test::RoundingTolerance kOutputRounding{1.2e-6, 5e-7};

// The q4 products (decode_q4.hpp) round each weight p · scale of P·V to bfloat16 (8 significant
// bits: a relative error of at most 2^-8) and sum their scores exactly: against double on the
// values and queries the codes stand for, each output element within 2^-8 of Σ_j p_j |v_j| / Σ_j
// p_j (double again, on the values' magnitudes), beside the float kernels' rounding.
void check_bf16_weights(const DecodeCase& c, const Inputs& dequantized, std::size_t b,
                        const CoreOptions<double>& options, const Tensor<float>& actual,
                        const Tensor<double>& exact) {
  Inputs magnitudes = dequantized;
  for (float& value : magnitudes.values[b]) value = std::abs(value);
  const auto weighted = as_tensor(per_sequence<double>(c, magnitudes, b, options));
  const double rounding = kOutputRounding.max_of_scale * exact.flat().cwiseAbs().maxCoeff();
  double worst = 0.0;  // the largest error over its bound
  for (Index i = 0; i < exact.size(); ++i) {
    const double error = std::abs(static_cast<double>(actual.flat()(i)) - exact.flat()(i));
    worst = std::max(worst, error / (std::ldexp(weighted.flat()(i), -8) + rounding));
  }
  INFO("largest error over its bound: " << worst);
  CHECK(worst <= 1.0);
}

}  // namespace

TEST_CASE("the decoding kernel equals the flash kernel one sequence at a time, and double",
          "[decode]") {
  std::uint64_t seed = 11;
  for (const auto& c : cases()) {
    INFO(c.name);
    const auto inputs = inputs_of(c, seed += 1000);
    const auto slopes = mha::alibi_slopes<float>(c.heads);
    const auto slopes_double = mha::alibi_slopes<double>(c.heads);
    const auto options = options_for<float>(c, slopes);
    const DecodeShape shape{c.heads, c.kv_heads, c.head_dim, c.head_dim, 0, 0, 0};
    // Each case runs the path it was written for on this CPU: the register blocks for two or more
    // rows per key/value head where D is a multiple of 16 (with AVX-512; from 12 rows, the
    // scores with the rows as lanes), else the micro-kernel from 8 rows (with AVX2 and FMA), else
    // the AVX2 register blocks for two or more rows where D is a multiple of 32, else dot
    // products.
    const Index group = c.heads / c.kv_heads;
    const bool whole_packets = c.head_dim % 16 == 0;
    for (const Index n : c.query_counts) {
      if (n == 0) continue;
      using mha::detail::DecodePath;
      auto expected = DecodePath::dots;
      if (group * n > 1 && whole_packets && mha::detail::value_blocks_available(16, 16)) {
        expected =
            group * n >= mha::detail::kDecodeLanesMinRows ? DecodePath::lanes : DecodePath::blocks;
      } else if (group * n >= 8 && whole_packets && mha::detail::packed_gemm_available()) {
        expected = DecodePath::panels;
      } else if (group * n > 1 && c.head_dim % 32 == 0 &&
                 mha::detail::decode_blocks_avx2_available(32, 32)) {
        expected = DecodePath::blocks;
      }
      CHECK(mha::detail::decode_path(shape, n) == expected);
    }
    const auto decoded = decode_outputs<float>(c, inputs, options);
    for (std::size_t b = 0; b < c.key_counts.size(); ++b) {
      INFO("sequence " << b << ": " << c.query_counts[b] << " queries, " << c.key_counts[b]
                       << " keys");
      if (c.query_counts[b] == 0) {
        CHECK(std::all_of(decoded[b].begin(), decoded[b].end(), [](float x) { return x == -1; }));
        continue;
      }
      const auto exact =
          as_tensor(per_sequence<double>(c, inputs, b, options_for<double>(c, slopes_double)));
      const auto flash = as_tensor(per_sequence<float>(c, inputs, b, options));
      const auto actual = as_tensor(decoded[b]);
      CHECK_ROUNDING(actual, exact, kOutputRounding);
      // The bound against the path decode took before: 1e-6 of the output's largest
      // element.
      const double largest = static_cast<double>(flash.flat().cwiseAbs().maxCoeff());
      CHECK_TENSORS_CLOSE_TOL(actual, flash, 0.0, 1e-6 * largest);
    }
  }
}

TEMPLATE_TEST_CASE("the decoding kernel reads a 16-bit cache as the flash kernel does",
                   "[decode][half]", Eigen::half, Eigen::bfloat16) {
  using Stored = TestType;
  std::uint64_t seed = 77;
  for (const auto& c : cases()) {
    INFO(c.name);
    auto inputs = inputs_of(c, seed += 1000);
    // Keys and values as a 16-bit cache holds them, so that the float cache holds the same.
    for (auto* stored : {&inputs.keys, &inputs.values}) {
      for (auto& rows : *stored) {
        for (float& x : rows) x = static_cast<float>(static_cast<Stored>(x));
      }
    }
    const auto slopes = mha::alibi_slopes<float>(c.heads);
    const auto options = options_for<float>(c, slopes);
    const auto narrow = decode_outputs<Stored>(c, inputs, options);
    const auto wide = decode_outputs<float>(c, inputs, options);
    for (std::size_t b = 0; b < c.key_counts.size(); ++b) {
      INFO("sequence " << b);
      CHECK(narrow[b] == wide[b]);  // the same float arithmetic on the same widened values
    }
  }
}

TEMPLATE_TEST_CASE(
    "the decoding kernel reads a quantized cache as the float one its codes stand for",
    "[decode][quantized]", mha::detail::Q8Block, mha::detail::Q4Block) {
  using Block = TestType;
  std::uint64_t seed = 91;
  Index quantizable = 0, q4_products = 0, avx2_blocks = 0;
  for (const auto& c : cases()) {
    const Index width = c.kv_heads * c.head_dim;
    if (width % mha::detail::kQuantBlock != 0) continue;  // (a quantized cache refuses them)
    ++quantizable;
    INFO(c.name);
    auto inputs = inputs_of(c, seed += 1000);
    // A float cache holding what the codes stand for.
    Inputs dequantized = inputs;
    for (auto* stored : {&dequantized.keys, &dequantized.values}) {
      for (auto& rows : *stored) {
        std::vector<Block> blocks(rows.size() / mha::detail::kQuantBlock);
        mha::detail::quantize_rows(rows.data(), 1, static_cast<Index>(rows.size()), blocks.data());
        for (std::size_t i = 0; i < rows.size(); ++i) {
          rows[i] = mha::detail::dequantized(blocks[i / mha::detail::kQuantBlock],
                                             static_cast<Index>(i) % mha::detail::kQuantBlock);
        }
      }
    }
    // A q4 cache's products (decode_q4.hpp with AVX-512, decode_avx2.hpp with AVX2)
    // round each query row of a head to int8 codes: the float cache then gets the queries those
    // codes stand for.
    const bool int8_queries = std::is_same_v<Block, mha::detail::Q4Block> &&
                              mha::detail::q4_queries_rounded(c.head_dim, c.head_dim);
    if (mha::detail::decode_blocks_avx2_available(c.head_dim, c.head_dim)) ++avx2_blocks;
    if (int8_queries) {
      ++q4_products;
      for (auto& rows : dequantized.queries) {
        std::vector<std::int8_t> codes(static_cast<std::size_t>(c.head_dim));
        for (std::size_t head = 0; head < rows.size(); head += codes.size()) {
          float inverse = 0.0F;
          const float scale = mha::detail::query_row_scale(&rows[head], c.head_dim, inverse);
          mha::detail::quantize_query_values(&rows[head], c.head_dim, inverse, codes.data());
          for (std::size_t d = 0; d < codes.size(); ++d) {
            rows[head + d] = scale * static_cast<float>(codes[d]);
          }
        }
      }
    }
    const auto slopes = mha::alibi_slopes<float>(c.heads);
    const auto slopes_double = mha::alibi_slopes<double>(c.heads);
    const auto options = options_for<float>(c, slopes);
    const auto quantized = decode_outputs<Block>(c, inputs, options);
    const auto wide = decode_outputs<float>(c, dequantized, options);
    bool rounded = false;  // (some code did round: quarters of a short range may not)
    for (std::size_t b = 0; b < c.key_counts.size(); ++b) {
      INFO("sequence " << b);
      rounded = rounded || dequantized.keys[b] != inputs.keys[b];
      if (c.query_counts[b] == 0) continue;
      // Against double and the float kernel on the values the codes stand for: with AVX-512 the
      // register blocks take every row count here, where the float cache may take another path
      // (dot products, the rows as lanes), whose sums round in another order.
      const auto exact =
          as_tensor(per_sequence<double>(c, dequantized, b, options_for<double>(c, slopes_double)));
      const auto actual = as_tensor(quantized[b]), float_cache = as_tensor(wide[b]);
      if (int8_queries) {
        check_bf16_weights(c, dequantized, b, options_for<double>(c, slopes_double), actual, exact);
        continue;
      }
      CHECK_ROUNDING(actual, exact, kOutputRounding);
      const double largest = static_cast<double>(float_cache.flat().cwiseAbs().maxCoeff());
      CHECK_TENSORS_CLOSE_TOL(actual, float_cache, 0.0, 1e-6 * largest);
    }
    CHECK(rounded);
  }
  CHECK(quantizable >= 6);
  // Heads of one to five blocks took the q4 products, or the AVX2 blocks, where this CPU has them.
  if (std::is_same_v<Block, mha::detail::Q4Block> && mha::detail::q4_queries_rounded(32, 32)) {
    CHECK(q4_products >= 6);
  }
  if (mha::detail::decode_blocks_avx2_available(32, 32)) CHECK(avx2_blocks >= 6);
}

#ifdef _OPENMP
TEST_CASE("the decoding kernel's results do not depend on the number of threads",
          "[decode][threads]") {
  const int threads_before = omp_get_max_threads();
  for (const auto& c : cases()) {
    INFO(c.name);
    const auto inputs = inputs_of(c, 5);
    const auto slopes = mha::alibi_slopes<float>(c.heads);
    const auto options = options_for<float>(c, slopes);
    omp_set_num_threads(1);
    const auto one = decode_outputs<float>(c, inputs, options);
    omp_set_num_threads(3);
    const auto three = decode_outputs<float>(c, inputs, options);
    CHECK(one == three);
    // A q4 cache too (its own products where decode_q4.hpp's run).
    if (c.kv_heads * c.head_dim % mha::detail::kQuantBlock == 0) {
      omp_set_num_threads(1);
      const auto q4_one = decode_outputs<mha::detail::Q4Block>(c, inputs, options);
      omp_set_num_threads(3);
      CHECK(q4_one == decode_outputs<mha::detail::Q4Block>(c, inputs, options));
    }
  }
  omp_set_num_threads(threads_before);
}
#endif

TEST_CASE("a decoding step takes the decoding kernel and gives the full forward's outputs",
          "[decode]") {
  // Through the layer: B = 3 sequences, 300 cached tokens, then steps of 1 and of 2 tokens,
  // against one causal forward over the whole sequences (test_kv_cache.cpp covers the options).
  mha::MultiHeadAttentionConfig config(64, 8);
  config.num_kv_heads = 1;
  config.seed = 4;
  const mha::MultiHeadAttention<float> layer(config);
  const auto x = mha_test::random_tensor<float>({3, 303, 64}, 9);
  auto cache = layer.make_kv_cache(3, 303);
  const auto options = mha::MultiHeadAttention<float>::decode_options();
  Tensor<float> decoded(x.shape());
  Index first = 0;
  for (const Index count : {300, 1, 2}) {
    Tensor<float> step({3, count, 64});
    for (Index b = 0; b < 3; ++b) step[b].matrix() = x[b].matrix().middleRows(first, count);
    const auto out = layer.decode(step, cache, options);
    for (Index b = 0; b < 3; ++b)
      decoded[b].matrix().middleRows(first, count) = out.output[b].matrix();
    first += count;
  }
  mha::ForwardOptions<float> full_options;
  full_options.is_causal = true;
  full_options.need_weights = false;
  const auto full = layer.forward(x, full_options);
  const double largest = static_cast<double>(full.output.flat().cwiseAbs().maxCoeff());
  CHECK_TENSORS_CLOSE_TOL(decoded, full.output, 0.0, 1e-5 * largest);
}

TEST_CASE("the decoding kernel's products equal double for every block and tail", "[decode]") {
  // scaled_dot_rows and accumulate_value_rows alone, on rows that end in blocks of 4, 3, 2 and 1,
  // counts that end in partial key blocks, widths that end in single packets, and rows a stride
  // apart with columns beyond the product's, on values whose products float holds exactly.
  using mha::detail::accumulate_value_rows;
  using mha::detail::prepare_query_rows;
  using mha::detail::scaled_dot_rows;
  for (const Index depth : {16, 48, 80, 128}) {
    for (const Index rows : {1, 2, 3, 4, 5, 7, 9, 16, 17, 33}) {
      for (const Index count : {1, 3, 4, 9, 24, 31}) {
        INFO("D = " << depth << ", " << rows << " rows, " << count << " keys");
        const Index stride = depth + 16, score_stride = count + 5;
        const auto q = quarters<float>(rows * stride, 1 + static_cast<std::uint64_t>(depth));
        const auto keys = quarters<float>(count * stride, 2 + static_cast<std::uint64_t>(rows));
        // The rows as the register blocks take them and as lanes (where AVX-512 runs), each
        // into its own scores.
        std::vector<float> prepared(static_cast<std::size_t>(rows * depth));
        prepare_query_rows(q.data(), stride, rows, depth, prepared.data());
        std::vector<float> scores(static_cast<std::size_t>(rows * score_stride), -7.0F);
        // The keys after the first `count` are the next call's (requested, not read).
        scaled_dot_rows(prepared.data(), rows, keys.data(), stride, count, depth, 0.5F,
                        scores.data(), score_stride,
                        mha::detail::RowsAhead{keys.data() + stride, count - 1});
        std::vector<std::vector<float>> all_scores{scores};
        if (mha::detail::query_lanes_available()) {
          std::vector<float> lanes(static_cast<std::size_t>((rows + 15) / 16 * 16 * depth));
          mha::detail::prepare_query_lanes(q.data(), stride, rows, depth, lanes.data());
          std::fill(scores.begin(), scores.end(), -7.0F);
          mha::detail::scaled_dot_lanes(lanes.data(), rows, keys.data(), stride, count, depth, 0.5F,
                                        scores.data(), score_stride);
          all_scores.push_back(scores);
        }
        for (const auto& computed : all_scores) {
          bool exact = true, untouched = true;
          for (Index r = 0; r < rows; ++r) {
            for (Index j = 0; j < score_stride; ++j) {
              const float actual = computed[static_cast<std::size_t>(r * score_stride + j)];
              if (j >= count) {
                untouched = untouched && actual == -7.0F;
                continue;
              }
              double expected = 0;
              for (Index d = 0; d < depth; ++d) {
                expected += static_cast<double>(q[static_cast<std::size_t>(r * stride + d)]) *
                            static_cast<double>(keys[static_cast<std::size_t>(j * stride + d)]);
              }
              exact = exact && static_cast<double>(actual) == 0.5 * expected;
            }
          }
          CHECK(exact);
          CHECK(untouched);
        }

        // P · V twice, the second accumulating: weights are quarters too.
        const auto p = quarters<float>(rows * score_stride, 3 + static_cast<std::uint64_t>(count));
        const auto values = quarters<float>(count * stride, 4);
        const Index acc_stride = depth + 32;
        std::vector<float> acc(static_cast<std::size_t>(rows * acc_stride), -7.0F);
        for (const bool first : {true, false}) {
          accumulate_value_rows(p.data(), score_stride, rows, values.data(), stride, count, depth,
                                first, acc.data(), acc_stride);
        }
        bool exact = true, untouched = true;
        for (Index r = 0; r < rows; ++r) {
          for (Index c = 0; c < acc_stride; ++c) {
            const float actual = acc[static_cast<std::size_t>(r * acc_stride + c)];
            if (c >= depth) {
              untouched = untouched && actual == -7.0F;
              continue;
            }
            double expected = 0;
            for (Index j = 0; j < count; ++j) {
              expected += static_cast<double>(p[static_cast<std::size_t>(r * score_stride + j)]) *
                          static_cast<double>(values[static_cast<std::size_t>(j * stride + c)]);
            }
            exact = exact && static_cast<double>(actual) == 2 * expected;
          }
        }
        CHECK(exact);
        CHECK(untouched);
      }
    }
  }
}

TEST_CASE("a step with one query per key/value head reads whole rows and gives the same bits",
          "[decode]") {
  // scaled_dots_by_rows and accumulate_by_rows, which read the cache's rows whole, head after
  // head, against the products a head at a time (scaled_dots, accumulate_weighted_rows) on the
  // same rows: the same operations in the same order, so equal bit for bit, with depths that end
  // in partial packets and rows with columns beyond the heads'.
  for (const Index depth : {12, 16, 40, 128}) {
    for (const Index heads : {1, 3, 16}) {
      for (const Index count : {1, 5, 24}) {
        INFO("D = " << depth << ", " << heads << " heads, " << count << " keys");
        const Index stride = heads * depth + 8, score_stride = count + 3;
        const auto q =
            mha_test::random_tensor<float>({heads, depth}, static_cast<std::uint64_t>(10 + depth));
        const auto keys =
            mha_test::random_tensor<float>({count, stride}, static_cast<std::uint64_t>(20 + heads));
        const auto values =
            mha_test::random_tensor<float>({count, stride}, static_cast<std::uint64_t>(30 + count));
        std::vector<float> by_rows(static_cast<std::size_t>(heads * score_stride), -7.0F);
        auto by_head = by_rows;
        mha::detail::scaled_dots_by_rows(q.data(), heads, keys.data(), stride, count, depth, 0.3F,
                                         by_rows.data(), score_stride);
        for (Index g = 0; g < heads; ++g) {
          mha::detail::scaled_dots(q.data() + g * depth, keys.data() + g * depth, stride, count,
                                   depth, 0.3F, by_head.data() + g * score_stride);
        }
        CHECK(by_rows == by_head);

        // P · V over the scores as weights, twice (the second call accumulating).
        const Index acc_stride = depth + 4;
        std::vector<float> acc_rows(static_cast<std::size_t>(heads * acc_stride), 0.0F);
        for (Index g = 0; g < heads; ++g)
          acc_rows[static_cast<std::size_t>(g * acc_stride + depth)] = -7.0F;
        auto acc_heads = acc_rows;
        for (int call = 0; call < 2; ++call) {
          mha::detail::accumulate_by_rows(by_rows.data(), score_stride, heads, values.data(),
                                          stride, count, depth, acc_rows.data(), acc_stride);
          for (Index g = 0; g < heads; ++g) {
            mha::detail::accumulate_weighted_rows(acc_heads.data() + g * acc_stride, depth,
                                                  by_head.data() + g * score_stride,
                                                  values.data() + g * depth, stride, count);
          }
        }
        CHECK(acc_rows == acc_heads);
        CHECK(acc_rows[static_cast<std::size_t>(depth)] == -7.0F);
      }
    }
  }
}
