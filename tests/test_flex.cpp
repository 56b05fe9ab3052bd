// flex_attention (flex.hpp) and the mods of mods.hpp: every provided mask_mod against its mask
// written out densely (each by its definition, not by calling the mod) and run through
// scaled_dot_product_attention's reference kernel in float64, forward and backward; score_mods
// against the built-in options they re-express and a user's score_mod against finite
// differences; block masks against a brute-force evaluation, the blocks the kernel skips, and
// the refusals; T5's bucketed bias against PyTorch (tests/reference/generate_t5.py).
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "helpers.hpp"
#include "mha/flex.hpp"
#include "mha/io/safetensors.hpp"
#include "mha/mods.hpp"

using mha::Index;
using mha::Tensor;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Sizes that span several of the flash kernel's tiles (96 queries × 256 keys forward, 96 × 192
// backward) and several block-mask blocks, with tiles cut short at the ends (by default).
struct Shape4 {
  Index batch = 2, heads = 3, query_len = 300, key_len = 300, head_dim = 16;
};

template <class T>
struct Inputs {
  Tensor<T> q, k, v, grad_out;
  Inputs(const Shape4& s, std::uint64_t seed)
      : q(mha_test::random_tensor<T>({s.batch, s.heads, s.query_len, s.head_dim}, seed)),
        k(mha_test::random_tensor<T>({s.batch, s.heads, s.key_len, s.head_dim}, seed + 1)),
        v(mha_test::random_tensor<T>({s.batch, s.heads, s.key_len, s.head_dim}, seed + 2)),
        grad_out(
            mha_test::random_tensor<T>({s.batch, s.heads, s.query_len, s.head_dim}, seed + 3)) {}
};

// visible(b, h, i, j) written out as an additive [B, H, L, S] mask: 0 or -inf.
Tensor<double> dense_mask(const Shape4& s,
                          const std::function<bool(Index, Index, Index, Index)>& visible) {
  Tensor<double> mask({s.batch, s.heads, s.query_len, s.key_len});
  for (Index b = 0; b < s.batch; ++b) {
    for (Index h = 0; h < s.heads; ++h) {
      auto m = mask[b][h].matrix();
      for (Index i = 0; i < s.query_len; ++i) {
        for (Index j = 0; j < s.key_len; ++j) m(i, j) = visible(b, h, i, j) ? 0.0 : -kInf;
      }
    }
  }
  return mask;
}

// The float64 truth: the reference kernel with the written-out mask, and its backward.
struct Truth {
  mha::AttentionResult<double> forward;
  mha::AttentionGradients<double> grads;
};
Truth truth(const Inputs<double>& in, mha::AttentionOptions<double> options) {
  options.kernel = mha::Kernel::reference;
  Truth t;
  t.forward = mha::scaled_dot_product_attention(in.q, in.k, in.v, options);
  t.grads = mha::scaled_dot_product_attention_backward(in.q.view(), in.k.view(), in.v.view(),
                                                       t.forward, in.grad_out.view(), options);
  return t;
}

// flex_attention and its backward, in T, against the truth.
template <class T, class ScoreMod, class MaskMod>
void check_against(const Shape4& s, const Inputs<double>& in, const Truth& t,
                   const ScoreMod& score_mod, const mha::BlockMask<MaskMod>& block_mask,
                   const mha::AttentionOptions<T>& options = {}) {
  const auto q = mha::tensor_cast<T>(in.q), k = mha::tensor_cast<T>(in.k),
             v = mha::tensor_cast<T>(in.v), grad_out = mha::tensor_cast<T>(in.grad_out);
  const auto result = mha::flex_attention(q, k, v, score_mod, block_mask, options);
  CHECK_TENSORS_CLOSE(result.output, t.forward.output);
  const auto grads =
      mha::flex_attention_backward(q, k, v, result, grad_out, score_mod, block_mask, options);
  CHECK(mha_test::compare_gradients(grads.query, t.grads.query).ok);
  CHECK(mha_test::compare_gradients(grads.key, t.grads.key).ok);
  CHECK(mha_test::compare_gradients(grads.value, t.grads.value).ok);
  (void)s;
}

// A mask_mod against its written-out mask, in float and double.
template <class MaskMod>
void check_mask(const std::string& name, const Shape4& s, const MaskMod& mask_mod,
                const std::function<bool(Index, Index, Index, Index)>& visible,
                std::uint64_t seed) {
  INFO(name);
  const Inputs<double> in(s, seed);
  mha::AttentionOptions<double> reference_options;
  reference_options.mask = mha::Mask<double>::additive(dense_mask(s, visible));
  const Truth t = truth(in, reference_options);
  // float (packed panels) with the default blocks, double (tiles) with small blocks, which leave
  // more partial and empty blocks.
  const auto block_mask = mha::create_block_mask(mask_mod, s.batch, 1, s.query_len, s.key_len);
  check_against<float>(s, in, t, mha::no_score_mod, block_mask);
  const auto small_blocks =
      mha::create_block_mask(mask_mod, s.batch, 1, s.query_len, s.key_len, 8, 16);
  check_against<double>(s, in, t, mha::no_score_mod, small_blocks);
}

Index floor_div(Index a, Index d) {
  return a >= 0 ? a / d : -((-a + d - 1) / d);
}

}  // namespace

TEST_CASE("flex: each provided mask_mod equals its written-out mask, forward and backward",
          "[flex][mods]") {
  Shape4 s;
  check_mask(
      "causal, top-left", s, mha::mods::causal(),
      [](Index, Index, Index i, Index j) { return j <= i; }, 1);
  Shape4 wide = s;
  wide.query_len = 200;
  check_mask(
      "causal, bottom-right", wide,
      mha::mods::causal(mha::Alignment::bottom_right, wide.query_len, wide.key_len),
      [](Index, Index, Index i, Index j) { return j <= i + 100; }, 2);
  check_mask(
      "sliding window of 21, causal", s, mha::mods::SlidingWindow{20, 0, 0},
      [](Index, Index, Index i, Index j) { return j <= i && i - j <= 20; }, 3);
  check_mask(
      "window 7 left, 5 right", s, mha::mods::SlidingWindow{7, 5, 0},
      [](Index, Index, Index i, Index j) { return j - i <= 5 && i - j <= 7; }, 4);
  check_mask(
      "causal chunks of 64", s, mha::mods::mask_and(mha::mods::Chunked{64, 0}, mha::mods::causal()),
      [](Index, Index, Index i, Index j) { return j <= i && i / 64 == j / 64; }, 5);
  check_mask(
      "chunks of 50, bottom-right", wide, mha::mods::Chunked{50, 100},
      [](Index, Index, Index i, Index j) { return floor_div(i + 100, 50) == floor_div(j, 50); }, 6);
  check_mask(
      "dilated, reach 40, dilation 3", s, mha::mods::Dilated{40, 3, 0},
      [](Index, Index, Index i, Index j) { return std::abs(i - j) <= 40 && (i - j) % 3 == 0; }, 7);
  check_mask(
      "prefix-LM, prefix 50", s, mha::mods::PrefixLm{50, 0},
      [](Index, Index, Index i, Index j) { return j < 50 || j <= i; }, 8);
  const std::vector<Index> cu_seqlens{0, 37, 150, 151, 300};
  const auto document_of = [&](Index position) {
    Index d = 0;
    while (cu_seqlens[static_cast<std::size_t>(d + 1)] <= position) ++d;
    return d;
  };
  check_mask(
      "causal documents", s,
      mha::mods::mask_and(mha::mods::document(cu_seqlens), mha::mods::causal()),
      [&](Index, Index, Index i, Index j) { return j <= i && document_of(i) == document_of(j); },
      9);
  // NATTEN on a 15 x 20 grid with a 5 x 7 kernel: the window is the run of kernel rows (columns)
  // containing the query whose middle is nearest to it, which at the edges is the first or last.
  const Index grid_height = 15, grid_width = 20;
  const auto window_contains = [](Index query, Index key, Index kernel, Index extent) {
    Index best_start = 0;
    for (Index start = 0; start + kernel <= extent; ++start) {
      if (std::abs(start + kernel / 2 - query) < std::abs(best_start + kernel / 2 - query)) {
        best_start = start;
      }
    }
    return key >= best_start && key < best_start + kernel;
  };
  check_mask(
      "2D neighbourhood 5 x 7 on 15 x 20", s,
      mha::mods::neighbourhood_2d(grid_height, grid_width, 5, 7),
      [&](Index, Index, Index i, Index j) {
        return window_contains(i / grid_width, j / grid_width, 5, grid_height) &&
               window_contains(i % grid_width, j % grid_width, 7, grid_width);
      },
      10);
  check_mask(
      "Sparse Transformer: causal, local 16 or strided 16", s,
      mha::mods::mask_and(
          mha::mods::causal(),
          mha::mods::mask_or(mha::mods::SlidingWindow{15, 0, 0}, mha::mods::Strided{16, 0})),
      [](Index, Index, Index i, Index j) { return j <= i && (i - j < 16 || (i - j) % 16 == 0); },
      11);
}

TEST_CASE("flex: a mask_mod may read b and h (built per batch element and head)", "[flex]") {
  const Shape4 s{2, 3, 130, 270};
  const std::vector<Index> lengths{270, 101};  // key padding per batch element
  const auto mask_mod = [lengths](Index b, Index h, Index i, Index j) {
    return j < lengths[static_cast<std::size_t>(b)] && (h != 1 || j <= i);
  };
  const Inputs<double> in(s, 21);
  mha::AttentionOptions<double> reference_options;
  reference_options.mask = mha::Mask<double>::additive(dense_mask(s, mask_mod));
  const Truth t = truth(in, reference_options);
  const auto block_mask =
      mha::create_block_mask(mask_mod, s.batch, s.heads, s.query_len, s.key_len);
  check_against<double>(s, in, t, mha::no_score_mod, block_mask);
  check_against<float>(s, in, t, mha::no_score_mod, block_mask);
}

TEST_CASE("flex: score_mods equal the built-in options they re-express", "[flex][mods]") {
  Shape4 s;
  const Inputs<double> in(s, 31);
  const auto slopes = mha::alibi_slopes<double>(s.heads);
  SECTION("ALiBi, causal, top-left and bottom-right") {
    for (const auto alignment : {mha::Alignment::top_left, mha::Alignment::bottom_right}) {
      Shape4 shape = s;
      if (alignment == mha::Alignment::bottom_right) shape.query_len = 200;
      const Inputs<double> inputs(shape, 32);
      mha::AttentionOptions<double> builtin;
      builtin.causal =
          alignment == mha::Alignment::top_left ? mha::Causal::top_left : mha::Causal::bottom_right;
      builtin.alibi_slopes = slopes;
      builtin.alibi_alignment = alignment;
      const Truth t = truth(inputs, builtin);
      const Index offset = mha::mods::aligned_offset(alignment, shape.query_len, shape.key_len);
      const auto block_mask =
          mha::create_block_mask(mha::mods::Causal{offset}, 1, 1, shape.query_len, shape.key_len);
      check_against<double>(shape, inputs, t, mha::mods::Alibi<double>{slopes, offset}, block_mask);
      check_against<float>(shape, inputs, t,
                           mha::mods::Alibi<float>{{slopes.begin(), slopes.end()}, offset},
                           block_mask);
    }
  }
  SECTION("softcap with a sliding window") {
    mha::AttentionOptions<double> builtin;
    builtin.softcap = 0.7;
    builtin.window = mha::Window{30, 30};
    const Truth t = truth(in, builtin);
    const auto block_mask =
        mha::create_block_mask(mha::mods::SlidingWindow{30, 30, 0}, 1, 1, s.query_len, s.key_len);
    check_against<double>(s, in, t, mha::mods::Softcap<double>{0.7}, block_mask);
    check_against<float>(s, in, t, mha::mods::Softcap<float>{0.7F}, block_mask);
  }
  SECTION("a score_mod sees scale q kᵀ: halving it is half the scale, plus a bias") {
    mha::AttentionOptions<double> builtin;
    builtin.scale = 0.5 / std::sqrt(static_cast<double>(s.head_dim));
    Tensor<double> bias({s.query_len, s.key_len});
    for (Index i = 0; i < s.query_len; ++i) {
      for (Index j = 0; j < s.key_len; ++j) bias.matrix()(i, j) = i == j ? 1.0 : 0.0;
    }
    builtin.mask = mha::Mask<double>::additive(bias);
    const Truth t = truth(in, builtin);
    const auto halved = [](auto score, Index, Index, Index q_idx, Index kv_idx) {
      return score * 0.5 + (q_idx == kv_idx ? 1.0 : 0.0);
    };
    const auto everything = mha::create_block_mask(mha::AllVisible{}, 1, 1, s.query_len, s.key_len);
    check_against<double>(s, in, t, halved, everything);
    const auto halved_float = [](auto score, Index, Index, Index q_idx, Index kv_idx) {
      return score * 0.5F + (q_idx == kv_idx ? 1.0F : 0.0F);
    };
    check_against<float>(s, in, t, halved_float, everything);
  }
  SECTION("built-in options and mods combine: a built-in causal mask, a mod's ALiBi") {
    mha::AttentionOptions<double> builtin;
    builtin.causal = mha::Causal::top_left;
    builtin.alibi_slopes = slopes;
    const Truth t = truth(in, builtin);
    mha::AttentionOptions<double> causal_only;
    causal_only.causal = mha::Causal::top_left;
    const auto r =
        mha::flex_attention(in.q, in.k, in.v, mha::mods::Alibi<double>{slopes, 0}, causal_only);
    CHECK_TENSORS_CLOSE(r.output, t.forward.output);
  }
}

TEST_CASE("flex: a user's score_mod differentiates by Dual numbers: finite differences",
          "[flex][backward]") {
  const Shape4 s{1, 2, 9, 11, 4};
  Inputs<double> in(s, 41);
  // Nonlinear in the score, and reading every index.
  const auto score_mod = [](auto score, Index b, Index h, Index q_idx, Index kv_idx) {
    using std::tanh;
    return score + 0.3 * tanh(score) * static_cast<double>(1 + h + b) -
           0.05 * static_cast<double>(q_idx - kv_idx);
  };
  const auto block_mask =
      mha::create_block_mask(mha::mods::Dilated{6, 2, 0}, 1, 1, s.query_len, s.key_len, 4, 4);
  const auto loss = [&](const Inputs<double>& at) {
    return mha::flex_attention(at.q, at.k, at.v, score_mod, block_mask)
        .output.flat()
        .dot(at.grad_out.flat());
  };
  const auto result = mha::flex_attention(in.q, in.k, in.v, score_mod, block_mask);
  const auto grads =
      mha::flex_attention_backward(in.q, in.k, in.v, result, in.grad_out, score_mod, block_mask);
  const auto check_tensor = [&](Tensor<double>& at, const Tensor<double>& analytic) {
    const auto expected = mha_test::central_differences(at, [&] { return loss(in); });
    CHECK_TENSORS_CLOSE_TOL(analytic, expected, 1e-6, 1e-7);
  };
  check_tensor(in.q, grads.query);
  check_tensor(in.k, grads.key);
  check_tensor(in.v, grads.value);
}

TEST_CASE("flex: learned parameters of a score_mod get their gradient", "[flex][backward]") {
  // A relative-position bias table and learned ALiBi slopes: forward and input gradients against
  // the bias written out densely; the parameters' gradients against central differences.
  const Shape4 s{2, 2, 130, 150};
  const Index reach = 12, width = 2 * reach + 1;  // clipped for most pairs
  Inputs<double> in(s, 91);
  mha::mods::RelativeBias<double> bias{
      std::vector<double>(static_cast<std::size_t>(s.heads * width)), reach,
      s.key_len - s.query_len};
  mha::Random random(92);
  for (double& entry : bias.table) entry = random.normal();
  const auto causal = mha::create_block_mask(
      mha::mods::causal(mha::Alignment::bottom_right, s.query_len, s.key_len), 1, 1, s.query_len,
      s.key_len);
  Tensor<double> dense({s.heads, s.query_len, s.key_len});
  for (Index h = 0; h < s.heads; ++h) {
    for (Index i = 0; i < s.query_len; ++i) {
      for (Index j = 0; j < s.key_len; ++j) {
        const Index distance = std::min(reach, std::max(-reach, j - i - 20));  // S - L = 20
        dense[h].matrix()(i, j) =
            j <= i + 20 ? bias.table[static_cast<std::size_t>(h * width + distance + reach)]
                        : -kInf;
      }
    }
  }
  mha::AttentionOptions<double> written_out;
  written_out.mask = mha::Mask<double>::additive(dense);
  const Truth t = truth(in, written_out);
  check_against<double>(s, in, t, bias, causal);
  const auto result = mha::flex_attention(in.q, in.k, in.v, bias, causal);
  const auto grads =
      mha::flex_attention_backward(in.q, in.k, in.v, result, in.grad_out, bias, causal);
  REQUIRE(grads.score_mod.shape() == mha::Shape{s.heads * width});
  Tensor<double> table({s.heads * width});
  std::copy(bias.table.begin(), bias.table.end(), table.data());
  const auto numeric = mha_test::central_differences(table, [&] {
    auto at = bias;
    at.table.assign(table.data(), table.data() + table.size());
    return mha::flex_attention(in.q, in.k, in.v, at, causal).output.flat().dot(in.grad_out.flat());
  });
  CHECK_TENSORS_CLOSE_TOL(grads.score_mod, numeric, 1e-6, 1e-7);

  mha::mods::LearnedAlibi<double> alibi{{mha::alibi_slopes<double>(s.heads), 0}};
  const auto alibi_result = mha::flex_attention(in.q, in.k, in.v, alibi, causal);
  const auto alibi_grads =
      mha::flex_attention_backward(in.q, in.k, in.v, alibi_result, in.grad_out, alibi, causal);
  Tensor<double> slopes({s.heads});
  std::copy(alibi.slopes.begin(), alibi.slopes.end(), slopes.data());
  const auto numeric_slopes = mha_test::central_differences(slopes, [&] {
    auto at = alibi;
    at.slopes.assign(slopes.data(), slopes.data() + slopes.size());
    return mha::flex_attention(in.q, in.k, in.v, at, causal).output.flat().dot(in.grad_out.flat());
  });
  CHECK_TENSORS_CLOSE_TOL(alibi_grads.score_mod, numeric_slopes, 1e-6, 1e-7);
  // A score_mod without learned parameters returns no such gradient.
  CHECK(
      mha::flex_attention_backward(in.q, in.k, in.v, result, in.grad_out, mha::no_score_mod, causal)
          .score_mod.is_null());
}

TEST_CASE("flex: T5's bucketed relative bias against PyTorch", "[flex][t5][reference]") {
  // tests/reference/generate_t5.py: torch's buckets of every relative position in [-300, 300],
  // and attention with a T5 bias in float32, its output and the table's gradient by autograd.
  // The forward against float64 with the bias written out, and the table's gradient against
  // central differences, in double.
  for (const char* name : {"t5_encoder", "t5_decoder", "t5_short"}) {
    INFO(name);
    const auto file =
        mha::io::read_safetensors(std::string(MHA_REFERENCE_DIR) + "/" + name + ".safetensors");
    const Index num_buckets = std::stoi(file.metadata.at("num_buckets"));
    const Index max_distance = std::stoi(file.metadata.at("max_distance"));
    const bool bidirectional = file.metadata.at("bidirectional") == "1";
    const auto buckets = mha::io::to_tensor<double>(file.at("buckets"), "buckets");
    const Index reach = (buckets.size() - 1) / 2;
    Index mismatches = 0;
    for (Index relative = -reach; relative <= reach; ++relative) {
      const auto expected = static_cast<Index>(buckets.data()[relative + reach]);
      if (mha::mods::t5_bucket(relative, num_buckets, max_distance, bidirectional) != expected) {
        ++mismatches;
        UNSCOPED_INFO("relative " << relative << ": torch's bucket " << expected);
      }
    }
    CHECK(mismatches == 0);

    const auto q = mha::io::to_tensor<float>(file.at("q"), "q");
    const auto k = mha::io::to_tensor<float>(file.at("k"), "k");
    const auto v = mha::io::to_tensor<float>(file.at("v"), "v");
    const auto grad_out = mha::io::to_tensor<float>(file.at("grad_output"), "grad_output");
    const auto table = mha::io::to_tensor<float>(file.at("table"), "table");
    const auto bias =
        mha::mods::t5_bias(std::vector<float>(table.data(), table.data() + table.size()),
                           num_buckets, max_distance, bidirectional);
    const auto result = mha::flex_attention(q, k, v, bias);
    CHECK_TENSORS_CLOSE(result.output, mha::io::to_tensor<float>(file.at("output"), "output"));
    const auto grads = mha::flex_attention_backward(q, k, v, result, grad_out, bias);
    const auto torch_grad = mha::io::to_tensor<float>(file.at("grad.table"), "grad.table");
    REQUIRE(grads.score_mod.size() == torch_grad.size());
    CHECK(mha_test::compare_gradients(
              grads.score_mod.view(),
              mha::TensorView<const float>(torch_grad.data(), grads.score_mod.shape()))
              .ok);

    // In double: the bias written out densely, and central differences for the table.
    const auto qd = mha::tensor_cast<double>(q), kd = mha::tensor_cast<double>(k),
               vd = mha::tensor_cast<double>(v), gd = mha::tensor_cast<double>(grad_out);
    const auto bias_d =
        mha::mods::t5_bias(std::vector<double>(table.data(), table.data() + table.size()),
                           num_buckets, max_distance, bidirectional);
    const Index heads = q.dim(0), length = q.dim(1);
    Tensor<double> dense({heads, length, length});
    for (Index h = 0; h < heads; ++h) {
      for (Index i = 0; i < length; ++i) {
        for (Index j = 0; j < length; ++j) {
          const auto bucket = static_cast<Index>(buckets.data()[j - i + reach]);
          dense[h].matrix()(i, j) = static_cast<double>(table.data()[h * num_buckets + bucket]);
        }
      }
    }
    mha::AttentionOptions<double> written_out;
    written_out.kernel = mha::Kernel::reference;
    written_out.mask = mha::Mask<double>::additive(dense);
    const auto result_d = mha::flex_attention(qd, kd, vd, bias_d);
    CHECK_TENSORS_CLOSE(result_d.output,
                        mha::scaled_dot_product_attention(qd, kd, vd, written_out).output);
    const auto grads_d = mha::flex_attention_backward(qd, kd, vd, result_d, gd, bias_d);
    Tensor<double> values({table.size()});
    std::copy(bias_d.table.begin(), bias_d.table.end(), values.data());
    const auto numeric = mha_test::central_differences(values, [&] {
      auto at = bias_d;
      at.table.assign(values.data(), values.data() + values.size());
      return mha::flex_attention(qd, kd, vd, at).output.flat().dot(gd.flat());
    });
    CHECK_TENSORS_CLOSE_TOL(grads_d.score_mod, numeric, 1e-6, 1e-7);
  }
  CHECK_THROWS_AS(mha::mods::t5_bias(std::vector<float>(6), 3, 10, true), std::invalid_argument);
  CHECK_THROWS_AS(mha::mods::t5_bias(std::vector<float>(64), 32, 8, true), std::invalid_argument);
  CHECK_THROWS_AS(mha::mods::t5_bias(std::vector<float>(33), 32, 128, true), std::invalid_argument);
}

TEST_CASE("flex: block masks equal a brute-force evaluation, broadcast and count", "[flex]") {
  const Index query_len = 100, key_len = 150;
  const auto mask_mod = [](Index b, Index h, Index i, Index j) { return j <= i + 10 * b + h; };
  const auto block_mask = mha::create_block_mask(mask_mod, 2, 3, query_len, key_len, 16, 32);
  Index counted[3] = {0, 0, 0};
  for (Index b = 0; b < 2; ++b) {
    for (Index h = 0; h < 3; ++h) {
      for (Index qb = 0; qb * 16 < query_len; ++qb) {
        for (Index kb = 0; kb * 32 < key_len; ++kb) {
          Index visible = 0, pairs = 0;
          for (Index i = qb * 16; i < std::min(query_len, qb * 16 + 16); ++i) {
            for (Index j = kb * 32; j < std::min(key_len, kb * 32 + 32); ++j) {
              visible += j <= i + 10 * b + h ? 1 : 0;
              ++pairs;
            }
          }
          const auto expected = visible == 0       ? mha::BlockCover::empty
                                : visible == pairs ? mha::BlockCover::full
                                                   : mha::BlockCover::partial;
          CHECK(block_mask.block(b, h, qb, kb) == expected);
          ++counted[static_cast<int>(expected)];
        }
      }
    }
  }
  CHECK(block_mask.count(mha::BlockCover::empty) == counted[0]);
  CHECK(block_mask.count(mha::BlockCover::partial) == counted[1]);
  CHECK(block_mask.count(mha::BlockCover::full) == counted[2]);
  CHECK(block_mask.memory_bytes() == 2 * 3 * 7 * 5);
  // A broadcast mask answers for every batch element and head with its own.
  const auto shared = mha::create_block_mask(mha::mods::causal(), 1, 1, query_len, key_len, 16, 32);
  CHECK(shared.block(1, 2, 3, 0) == shared.block(0, 0, 3, 0));
  CHECK(shared.memory_bytes() == 7 * 5);
}

TEST_CASE("flex: the kernel visits only the key blocks a band needs, and masks partial blocks only",
          "[flex]") {
  const Shape4 s{1, 1, 700, 700};
  const Inputs<float> in(s, 51);
  std::atomic<long> mask_calls{0}, score_calls{0};
  const auto mask_mod = [&mask_calls](Index, Index, Index i, Index j) {
    ++mask_calls;
    return j <= i && i - j < 100;
  };
  const auto score_mod = [&score_calls](auto score, Index, Index, Index, Index) {
    ++score_calls;
    return score;
  };
  const auto block_mask = mha::create_block_mask(mask_mod, 1, 1, s.query_len, s.key_len);
  mask_calls = 0;
  mha::flex_attention(in.q, in.k, in.v, score_mod, block_mask);
  // The forward visits, for each block of 96 queries (detail::FlashBlocks), the runs of the
  // block mask's 64-key blocks that some of its rows see. Written out from the band itself:
  // whether a query range sees a key range at all, and whether some but not all of its pairs.
  const auto in_band = [](Index i, Index j) { return j <= i && i - j < 100; };
  const auto pairs_seen = [&](Index i0, Index i1, Index j0, Index j1) {
    Index seen = 0;
    for (Index i = i0; i < i1; ++i) {
      for (Index j = j0; j < j1; ++j) seen += in_band(i, j) ? 1 : 0;
    }
    return seen;
  };
  const mha::detail::FlashBlocks tiles;
  long expected_mask_calls = 0, expected_score_calls = 0, visited_pairs = 0;
  for (Index i0 = 0; i0 < s.query_len; i0 += tiles.query) {
    const Index i1 = std::min(s.query_len, i0 + tiles.query);
    for (Index j0 = 0; j0 < s.key_len; j0 += 64) {
      const Index j1 = std::min(s.key_len, j0 + 64);
      if (pairs_seen(i0, i1, j0, j1) == 0) continue;  // never visited
      expected_score_calls += (i1 - i0) * (j1 - j0);
      visited_pairs += (i1 - i0) * (j1 - j0);
      // The mask_mod runs in the 32-query blocks of it that see some but not all of their keys.
      for (Index r0 = i0; r0 < i1; r0 += 32) {
        const Index r1 = std::min(i1, r0 + 32), seen = pairs_seen(r0, r1, j0, j1);
        if (seen > 0 && seen < (r1 - r0) * (j1 - j0)) expected_mask_calls += (r1 - r0) * (j1 - j0);
      }
    }
  }
  CHECK(mask_calls == expected_mask_calls);
  CHECK(score_calls == expected_score_calls);  // every pair visited, hidden or not
  CHECK(visited_pairs < s.query_len * (100 + tiles.query + 2 * 64));  // the band, not L x S
}

TEST_CASE("flex: grouped-query attention and sinks pass through", "[flex][gqa]") {
  const Index batch = 2, heads = 4, kv_heads = 2, length = 200, head_dim = 8;
  const auto q = mha_test::random_tensor<double>({batch, heads, length, head_dim}, 61);
  const auto k = mha_test::random_tensor<double>({batch, kv_heads, length, head_dim}, 62);
  const auto v = mha_test::random_tensor<double>({batch, kv_heads, length, head_dim}, 63);
  mha::AttentionOptions<double> options;
  options.enable_gqa = true;
  options.sinks = {0.5, -1.0, 2.0, 0.0};
  auto builtin = options;
  builtin.window = mha::Window{40, 0};
  const auto expected = mha::scaled_dot_product_attention(q, k, v, builtin);
  const auto block_mask =
      mha::create_block_mask(mha::mods::SlidingWindow{40, 0, 0}, 1, 1, length, length);
  const auto result = mha::flex_attention(q, k, v, mha::no_score_mod, block_mask, options);
  CHECK_TENSORS_CLOSE(result.output, expected.output);
}

TEST_CASE("flex: a mod that throws makes the call throw, threads or not", "[flex][errors]") {
  const auto q = mha_test::random_tensor<float>({1, 8, 300, 16}, 81);
  const auto throwing_mask = [](Index, Index h, Index i, Index j) {
    if (h == 5 && i == 250 && j == 3) throw std::out_of_range("mask_mod: no such document");
    return j <= i;
  };
  CHECK(mha_test::message_of<std::out_of_range>([&] {
          mha::create_block_mask(throwing_mask, 1, 8, 300, 300);
        }) == "mask_mod: no such document");
  // Built on the other heads' mask, then called for head 5's pairs in a partial block.
  const auto causal = mha::create_block_mask(mha::mods::causal(), 1, 1, 300, 300);
  const auto throwing_score = [](auto score, Index, Index h, Index i, Index j) {
    if (h == 5 && i == 250 && j == 3) throw std::runtime_error("score_mod: table too small");
    return score;
  };
  CHECK(mha_test::message_of<std::runtime_error>([&] {
          mha::flex_attention(q, q, q, throwing_score, causal);
        }) == "score_mod: table too small");
  const auto result = mha::flex_attention(q, q, q, mha::no_score_mod, causal);
  CHECK(mha_test::message_of<std::runtime_error>([&] {
          mha::flex_attention_backward(q, q, q, result, q, throwing_score, causal);
        }) == "score_mod: table too small");
}

TEST_CASE("flex: refusals name the argument", "[flex][errors]") {
  const auto q = mha_test::random_tensor<float>({2, 4, 10, 8}, 71);
  const auto block_mask = mha::create_block_mask(mha::mods::causal(), 1, 1, 10, 12);
  const auto wrong_shape = mha_test::message_of<mha::ShapeError>(
      [&] { mha::flex_attention(q, q, q, mha::no_score_mod, block_mask); });
  CHECK(mha_test::contains(wrong_shape, "block_mask"));
  CHECK(mha_test::contains(wrong_shape, "[1, 1, 10, 12]"));
  const auto per_head = mha::create_block_mask(mha::mods::causal(), 1, 3, 10, 10);
  CHECK(mha_test::contains(mha_test::message_of<mha::ShapeError>(
                               [&] { mha::flex_attention(q, q, q, mha::no_score_mod, per_head); }),
                           "block_mask"));
  mha::AttentionOptions<float> weights;
  weights.need_weights = true;
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>(
                               [&] { mha::flex_attention(q, q, q, mha::no_score_mod, weights); }),
                           "need_weights"));
  mha::AttentionOptions<float> reference;
  reference.kernel = mha::Kernel::reference;
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>(
                               [&] { mha::flex_attention(q, q, q, mha::no_score_mod, reference); }),
                           "options.kernel"));
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>([] {
                             mha::create_block_mask(mha::mods::causal(), 1, 1, 10, 10, 0, 16);
                           }),
                           "query_block"));
  CHECK(mha_test::contains(
      mha_test::message_of<std::invalid_argument>([] { mha::mods::neighbourhood_2d(4, 4, 5, 3); }),
      "kernel_height"));
  // A divisor of zero, refused when the block mask first calls the mask_mod.
  const auto divisor_refused = [](const auto& mask_mod) {
    return mha_test::message_of<std::invalid_argument>(
        [&] { mha::create_block_mask(mask_mod, 1, 1, 10, 10); });
  };
  CHECK(mha_test::contains(divisor_refused(mha::mods::Chunked{0, 0}),
                           "Chunked::size: must be at least 1, got 0"));
  CHECK(mha_test::contains(divisor_refused(mha::mods::Strided{0, 0}), "Strided::stride"));
  CHECK(mha_test::contains(divisor_refused(mha::mods::Dilated{3, 0, 0}), "Dilated::dilation"));
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>([] {
                             mha::mods::document({0, 5, 3});
                           }),
                           "cu_seqlens"));
}
