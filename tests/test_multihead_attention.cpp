// MultiHeadAttention<T>: properties that hold whatever the weights, and every refusal.
// (Agreement with PyTorch itself is in test_reference.cpp.)
#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::Mask;
using mha::Matrix;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::Tensor;

namespace {

using mha_test::randomise;

template <class T>
MultiHeadAttention<T> random_layer(MultiHeadAttentionConfig config, std::uint64_t seed) {
  MultiHeadAttention<T> layer(config);
  randomise(layer, seed);
  return layer;
}

}  // namespace

TEMPLATE_TEST_CASE("with one head, MHA is plain single-head attention", "[mha]", float, double) {
  using T = TestType;
  const Index E = 6, L = 4, S = 5;
  const auto layer = random_layer<T>(MultiHeadAttentionConfig(E, 1), 100);
  const auto query = mha_test::random_tensor<T>({1, L, E}, 1);
  const auto key = mha_test::random_tensor<T>({1, S, E}, 2);
  const auto value = mha_test::random_tensor<T>({1, S, E}, 3);
  const auto result = layer.forward(query, key, value);

  const Matrix<double> w =
      Tensor<T>(layer.parameter("in_proj_weight")).matrix().template cast<double>();
  const Matrix<double> bias =
      Tensor<T>(layer.parameter("in_proj_bias")).matrix().template cast<double>();
  const auto project = [&](const Tensor<T>& x, Index which) {
    Matrix<double> y = x.matrix().template cast<double>() * w.middleRows(which * E, E).transpose();
    y.rowwise() += bias.row(0).segment(which * E, E);
    return y;
  };
  Matrix<double> scores = project(query, 0) * project(key, 1).transpose() / std::sqrt(double(E));
  mha::softmax_rows_inplace(scores);
  Matrix<double> out =
      scores * project(value, 2) *
      Tensor<T>(layer.parameter("out_proj.weight")).matrix().template cast<double>().transpose();
  out.rowwise() +=
      Tensor<T>(layer.parameter("out_proj.bias")).matrix().template cast<double>().row(0);
  Tensor<double> expected({1, L, E});
  expected.matrix() = out;
  Tensor<double> expected_weights({1, L, S});
  expected_weights.matrix() = scores;
  CHECK_TENSORS_CLOSE(result.output, expected);
  CHECK_TENSORS_CLOSE(result.attn_weights, expected_weights);
}

TEMPLATE_TEST_CASE("each head attends in its own feature columns", "[mha][heads]", float, double) {
  using T = TestType;
  const Index E = 8, H = 4, L = 3;
  const auto layer = random_layer<T>(MultiHeadAttentionConfig(E, H), 200);
  const auto x = mha_test::random_tensor<T>({2, L, E}, 5);
  mha::ForwardOptions<T> options;
  options.average_attn_weights = false;
  const auto result = layer.forward(x, options);
  // Recompute with split_heads + sdpa + merge_heads from the layer's own projections.
  const auto w = Tensor<T>(layer.parameter("in_proj_weight"));
  const auto b = Tensor<T>(layer.parameter("in_proj_bias"));
  Tensor<T> q({2, L, E}), k({2, L, E}), v({2, L, E});
  for (Index which = 0; which < 3; ++which) {
    Tensor<T>& target = which == 0 ? q : which == 1 ? k : v;
    target.matrix() = x.matrix() * w.matrix().middleRows(which * E, E).transpose();
    target.matrix().rowwise() += b.matrix().row(0).segment(which * E, E);
  }
  mha::AttentionOptions<T> sdpa;
  sdpa.need_weights = true;
  const auto heads = mha::scaled_dot_product_attention(
      mha::split_heads(q, H), mha::split_heads(k, H), mha::split_heads(v, H), sdpa);
  Tensor<T> expected = mha::merge_heads(heads.output);
  const auto wo = Tensor<T>(layer.parameter("out_proj.weight"));
  const auto bo = Tensor<T>(layer.parameter("out_proj.bias"));
  Tensor<T> projected({2, L, E});
  projected.matrix() = expected.matrix() * wo.matrix().transpose();
  projected.matrix().rowwise() += bo.matrix().row(0);
  CHECK_TENSORS_CLOSE(result.output, projected);
  CHECK_TENSORS_CLOSE(result.attn_weights, heads.weights);
}

TEMPLATE_TEST_CASE("unmasked self-attention is equivariant to permuting the sequence", "[mha]",
                   float, double) {
  using T = TestType;
  const Index E = 8, L = 6;
  const auto layer = random_layer<T>(MultiHeadAttentionConfig(E, 2), 300);
  const auto x = mha_test::random_tensor<T>({1, L, E}, 7);
  const std::vector<Index> perm = {3, 0, 5, 1, 4, 2};
  Tensor<T> permuted({1, L, E});
  for (Index i = 0; i < L; ++i) permuted[0].matrix().row(i) = x[0].matrix().row(perm[size_t(i)]);
  const auto a = layer.forward(x);
  const auto b = layer.forward(permuted);
  Tensor<T> expected({1, L, E}), expected_weights({1, L, L});
  for (Index i = 0; i < L; ++i) {
    expected[0].matrix().row(i) = a.output[0].matrix().row(perm[size_t(i)]);
    for (Index j = 0; j < L; ++j)
      expected_weights(0, i, j) = a.attn_weights(0, perm[size_t(i)], perm[size_t(j)]);
  }
  CHECK_TENSORS_CLOSE(b.output, expected);
  CHECK_TENSORS_CLOSE(b.attn_weights, expected_weights);
}

TEMPLATE_TEST_CASE("with is_causal, position t does not depend on inputs after t", "[mha][causal]",
                   float, double) {
  using T = TestType;
  const Index E = 8, L = 7;
  MultiHeadAttentionConfig config(E, 4);
  config.add_bias_kv = true;  // the extra key column stays visible to every query
  const auto layer = random_layer<T>(config, 400);
  const auto x = mha_test::random_tensor<T>({2, L, E}, 9);
  mha::ForwardOptions<T> options;
  options.is_causal = true;
  const auto base = layer.forward(x, options);
  for (Index t = 0; t < L - 1; ++t) {
    Tensor<T> changed = x;
    for (Index later = t + 1; later < L; ++later)
      for (Index b = 0; b < 2; ++b) changed[b].matrix().row(later) *= T(-3);
    const auto result = layer.forward(changed, options);
    for (Index b = 0; b < 2; ++b) {
      const auto before = base.output[b].matrix().topRows(t + 1);
      const auto after = result.output[b].matrix().topRows(t + 1);
      CHECK((before - after).cwiseAbs().maxCoeff() == T(0));
      // and the future did change the future: the test can fail
      CHECK((base.output[b].matrix().row(L - 1) - result.output[b].matrix().row(L - 1)).norm() >
            T(0));
    }
  }
}

TEMPLATE_TEST_CASE("fully masked rows give zero weights and a zero head output, never NaN",
                   "[mha][mask]", float, double) {
  using T = TestType;
  const Index E = 6, L = 3, S = 4;
  const auto layer = random_layer<T>(MultiHeadAttentionConfig(E, 2), 500);
  const auto q = mha_test::random_tensor<T>({2, L, E}, 11);
  const auto kv = mha_test::random_tensor<T>({2, S, E}, 12);
  Tensor<bool> padding({2, S}, false);
  for (Index j = 0; j < S; ++j) padding(0, j) = true;  // batch 0 sees no key at all
  Tensor<bool> attn({L, S}, false);
  for (Index j = 0; j < S; ++j) attn(1, j) = true;  // query 1 sees no key in any batch
  mha::ForwardOptions<T> options;
  options.key_padding_mask = Mask<T>::blocked_where_true(padding);
  options.attn_mask = Mask<T>::blocked_where_true(attn);
  options.average_attn_weights = false;
  const auto result = layer.forward(q, kv, kv, options);
  REQUIRE(result.output.flat().allFinite());
  REQUIRE(result.attn_weights.flat().allFinite());
  // With every head's output 0, the layer's output is out_proj.bias.
  const auto bias = Tensor<T>(layer.parameter("out_proj.bias"));
  for (Index i = 0; i < L; ++i) CHECK(result.output[0].matrix().row(i) == bias.matrix().row(0));
  CHECK(result.output[1].matrix().row(1) == bias.matrix().row(0));
  CHECK(result.output[1].matrix().row(0) != bias.matrix().row(0));
  CHECK(result.attn_weights[0].matrix().isZero());
  for (Index h = 0; h < 2; ++h) {
    CHECK(result.attn_weights[1][h].matrix().row(1).isZero());
    CHECK(std::abs(result.attn_weights[1][h].matrix().row(0).sum() - T(1)) < T(1e-6));
  }
}

TEMPLATE_TEST_CASE("unbatched input equals a batch of one", "[mha]", float, double) {
  using T = TestType;
  MultiHeadAttentionConfig config(8, 2);
  config.kdim = 5;
  config.vdim = 3;
  config.add_zero_attn = true;
  const auto layer = random_layer<T>(config, 600);
  const auto q = mha_test::random_tensor<T>({1, 4, 8}, 13);
  const auto k = mha_test::random_tensor<T>({1, 6, 5}, 14);
  const auto v = mha_test::random_tensor<T>({1, 6, 3}, 15);
  auto padding = Tensor<bool>({1, 6}, false);
  padding(0, 2) = true;
  mha::ForwardOptions<T> options;
  options.key_padding_mask = Mask<T>::blocked_where_true(padding);
  options.average_attn_weights = false;
  const auto batched = layer.forward(q, k, v, options);
  options.key_padding_mask = Mask<T>::blocked_where_true(padding[0]);
  const auto unbatched = layer.forward(q[0], k[0], v[0], options);
  REQUIRE(unbatched.output.shape() == mha::Shape{4, 8});
  REQUIRE(unbatched.attn_weights.shape() == mha::Shape{2, 4, 7});
  CHECK(unbatched.output.flat() == batched.output.flat());
  CHECK(unbatched.attn_weights.flat() == batched.attn_weights.flat());
}

TEST_CASE("default initialisation follows PyTorch's formulas and the seed", "[mha][init]") {
  MultiHeadAttentionConfig config(64, 4);
  config.add_bias_kv = true;
  config.seed = 42;
  const MultiHeadAttention<double> a(config), b(config);
  config.seed = 43;
  const MultiHeadAttention<double> c(config);
  for (const auto& name : a.parameter_names()) {
    CHECK(Tensor<double>(a.parameter(name)).flat() == Tensor<double>(b.parameter(name)).flat());
  }
  const Tensor<double> in_proj_tensor(a.parameter("in_proj_weight"));
  const auto in_proj = in_proj_tensor.flat();
  CHECK(in_proj != Tensor<double>(c.parameter("in_proj_weight")).flat());
  // xavier_uniform over [3E, E]: U(-a, a), a = sqrt(6 / 4E); variance a^2 / 3.
  const double bound = std::sqrt(6.0 / (4.0 * 64));
  CHECK(in_proj.cwiseAbs().maxCoeff() <= bound);
  const double variance = in_proj.squaredNorm() / double(in_proj.size());
  CHECK(std::abs(variance - bound * bound / 3.0) < 0.05 * bound * bound / 3.0);
  CHECK(Tensor<double>(a.parameter("in_proj_bias")).flat().isZero());
  CHECK(Tensor<double>(a.parameter("out_proj.bias")).flat().isZero());
  CHECK(Tensor<double>(a.parameter("out_proj.weight")).flat().cwiseAbs().maxCoeff() <= 1.0 / 8.0);
  // xavier_normal on [1, 1, E]: std sqrt(1 / E).
  const Tensor<double> bias_k_tensor(a.parameter("bias_k"));
  const auto bias_k = bias_k_tensor.flat();
  CHECK(bias_k.size() == 64);
  CHECK(std::abs(std::sqrt(bias_k.squaredNorm() / 64.0) - 0.125) < 0.04);
}

TEST_CASE("parameters carry PyTorch's state_dict names and shapes", "[mha][params]") {
  MultiHeadAttentionConfig config(6, 3);
  CHECK(MultiHeadAttention<float>(config).parameter_names() ==
        std::vector<std::string>{"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                 "out_proj.bias"});
  config.kdim = 4;
  config.add_bias_kv = true;
  config.bias = false;
  const MultiHeadAttention<float> separate(config);
  CHECK(separate.parameter_names() == std::vector<std::string>{"q_proj_weight", "k_proj_weight",
                                                               "v_proj_weight", "bias_k", "bias_v",
                                                               "out_proj.weight"});
  CHECK(separate.parameter("k_proj_weight").shape() == mha::Shape{6, 4});
  CHECK(separate.parameter("v_proj_weight").shape() == mha::Shape{6, 6});
  CHECK(separate.parameter("bias_v").shape() == mha::Shape{1, 1, 6});
  const auto rebuilt = MultiHeadAttention<float>::from_state_dict(separate.state_dict(), 3);
  CHECK(rebuilt.kdim() == 4);
  CHECK(rebuilt.vdim() == 6);
  CHECK(!rebuilt.config().bias);
  CHECK(rebuilt.config().add_bias_kv);
  for (const auto& name : separate.parameter_names())
    CHECK(Tensor<float>(rebuilt.parameter(name)).flat() ==
          Tensor<float>(separate.parameter(name)).flat());
}

TEST_CASE("the layer refuses bad configurations", "[mha][errors]") {
  CHECK_THROWS_WITH(MultiHeadAttention<float>(8, 0), "num_heads: must be positive, got 0");
  CHECK_THROWS_WITH(MultiHeadAttention<float>(8, 3),
                    "num_heads: embed_dim 8 is not divisible by num_heads 3");
  CHECK_THROWS_AS(MultiHeadAttention<float>(0, 1), mha::ShapeError);
  MultiHeadAttentionConfig config(8, 2);
  config.kdim = -1;
  CHECK_THROWS_AS(MultiHeadAttention<float>(config), std::invalid_argument);
}

TEST_CASE("forward refuses inputs of the wrong shape, naming them", "[mha][errors]") {
  MultiHeadAttentionConfig config(8, 2);
  config.kdim = 5;
  const MultiHeadAttention<float> layer(config);
  const Tensor<float> q({2, 3, 8}), k({2, 4, 5}), v({2, 4, 8});
  CHECK_NOTHROW(layer.forward(q, k, v));
  CHECK_THROWS_WITH(layer.forward(Tensor<float>({2, 3, 7}), k, v),
                    "query: expected [2, 3, 8], got [2, 3, 7]");
  CHECK_THROWS_WITH(layer.forward(q, Tensor<float>({2, 4, 8}), v),
                    "key: expected [2, *, 5], got [2, 4, 8]");
  CHECK_THROWS_WITH(layer.forward(q, Tensor<float>({3, 4, 5}), v),
                    "key: expected [2, *, 5], got [3, 4, 5]");
  CHECK_THROWS_WITH(layer.forward(q, k, Tensor<float>({2, 5, 8})),
                    "value: expected [2, 4, 8], got [2, 5, 8]");
  CHECK_THROWS_WITH(layer.forward(q, k, Tensor<float>({4, 8})),
                    "value: expected [2, 4, 8], got [4, 8]");
  CHECK_THROWS_AS(layer.forward(Tensor<float>({8}), k, v), mha::ShapeError);
  CHECK_THROWS_AS(layer.forward(Tensor<float>({1, 2, 3, 8}), k, v), mha::ShapeError);

  mha::ForwardOptions<float> options;
  options.key_padding_mask = Mask<float>::blocked_where_true(Tensor<bool>({2, 5}));
  CHECK_THROWS_WITH(layer.forward(q, k, v, options),
                    "key_padding_mask: expected [2, 4], got [2, 5]");
  options.key_padding_mask = Mask<float>::additive(Tensor<float>({4}));
  CHECK_THROWS_WITH(layer.forward(q, k, v, options), "key_padding_mask: expected [2, 4], got [4]");
  options.key_padding_mask = Mask<float>();
  options.attn_mask = Mask<float>::blocked_where_true(Tensor<bool>({3, 5}));
  CHECK_THROWS_WITH(layer.forward(q, k, v, options),
                    "attn_mask: expected [3, 4] or [4, 3, 4] ([L, S] or [B*H, L, S]), got [3, 5]");
  options.attn_mask = Mask<float>::additive(Tensor<float>({2, 3, 4}));
  CHECK_THROWS_AS(layer.forward(q, k, v, options), mha::ShapeError);
  options.attn_mask = Mask<float>::additive(Tensor<float>({4, 3, 4}));
  CHECK_NOTHROW(layer.forward(q, k, v, options));
}

TEST_CASE("parameters and state dicts are checked before anything changes", "[mha][errors]") {
  MultiHeadAttention<double> layer(4, 2);
  CHECK_THROWS_WITH(layer.set_parameter("in_proj_weight", Tensor<double>({4, 4})),
                    "in_proj_weight: expected [12, 4], got [4, 4]");
  CHECK_THROWS_AS(layer.parameter("bias_k"), mha::ShapeError);
  auto state = layer.state_dict();
  const auto before = Tensor<double>(layer.parameter("in_proj_weight"));
  state["in_proj_weight"] = Tensor<double>({12, 4}, 1.0);
  state.erase("out_proj.bias");
  CHECK_THROWS_WITH(layer.load_state_dict(state), "state_dict: missing tensor 'out_proj.bias'");
  CHECK(Tensor<double>(layer.parameter("in_proj_weight")).flat() == before.flat());
  state = layer.state_dict();
  state["bias_k"] = Tensor<double>({1, 1, 4});
  CHECK_THROWS_AS(layer.load_state_dict(state), mha::ShapeError);
  state = layer.state_dict();
  state["out_proj.weight"] = Tensor<double>({4, 5});
  CHECK_THROWS_WITH(layer.load_state_dict(state), "out_proj.weight: expected [4, 4], got [4, 5]");
  auto bad = layer.state_dict();
  bad.erase("in_proj_weight");
  CHECK_THROWS_AS(MultiHeadAttention<double>::from_state_dict(bad, 2), mha::ShapeError);
  CHECK_THROWS_AS(MultiHeadAttention<double>::from_state_dict(layer.state_dict(), 3),
                  mha::ShapeError);
}

TEMPLATE_TEST_CASE("self-attention's fused QKV projection equals separate projections",
                   "[mha][fused]", float, double) {
  using T = TestType;
  for (const bool bias : {true, false}) {
    MultiHeadAttentionConfig config(24, 4);
    config.bias = bias;
    // PyTorch's initialisation (random_layer's larger weights make scores of ~15, where float
    // rounding of the two GEMM orders alone differs by 1e-5); biases made non-zero.
    MultiHeadAttention<T> layer(config);
    if (bias) {
      layer.set_parameter("in_proj_bias", mha_test::random_tensor<T>({72}, 801, 0.1));
      layer.set_parameter("out_proj.bias", mha_test::random_tensor<T>({24}, 802, 0.1));
    }
    const auto x = mha_test::random_tensor<T>({3, 70, 24}, 17);
    const Tensor<T> key_copy = x, value_copy = x;  // other buffers: the unfused path
    mha::ForwardOptions<T> options;
    options.average_attn_weights = false;
    const auto fused = layer.forward(x, x, x, options);
    const auto separate = layer.forward(x, key_copy, value_copy, options);
    CHECK_TENSORS_CLOSE(fused.output, separate.output);
    CHECK_TENSORS_CLOSE(fused.attn_weights, separate.attn_weights);
  }
}

TEMPLATE_TEST_CASE("a reused workspace gives the same results and keeps its buffers",
                   "[mha][workspace]", float, double) {
  using T = TestType;
  MultiHeadAttentionConfig config(16, 4);
  config.add_zero_attn = true;
  const auto layer = random_layer<T>(config, 900);
  mha::Workspace<T> workspace;
  mha::ForwardResult<T> result;
  // Shapes, kernels and options change from call to call; each result must equal a fresh call.
  for (int call = 0; call < 12; ++call) {
    const Index L = call % 3 == 2 ? 9 : 20;
    const bool batched = call % 4 != 3;
    auto x = mha_test::random_tensor<T>({2, L, 16}, 40 + static_cast<std::uint64_t>(call));
    mha::ForwardOptions<T> options;
    options.need_weights = call % 2 == 0;
    options.average_attn_weights = call % 4 == 0;
    options.is_causal = call % 3 == 0;
    const mha::TensorView<const T> input = batched ? x.view() : mha::TensorView<const T>(x[0]);
    layer.forward(input, input, input, options, workspace, result);
    const auto fresh = layer.forward(input, input, input, options);
    INFO("call " << call);
    CHECK(result.output.shape() == fresh.output.shape());
    CHECK(result.output.flat() == fresh.output.flat());
    CHECK(result.attn_weights.shape() == fresh.attn_weights.shape());
    CHECK(result.attn_weights.flat() == fresh.attn_weights.flat());
  }
  // The same shapes again: the buffers stay where they are (nothing was reallocated).
  const auto x = mha_test::random_tensor<T>({2, 20, 16}, 99);
  mha::ForwardOptions<T> options;
  options.need_weights = false;
  layer.forward(x, x, x, options, workspace, result);
  const T* output = result.output.data();
  const T* projected = workspace.q.data();  // add_zero_attn: q, k, v projected separately
  const T* attended = workspace.attended.data();
  layer.forward(x, x, x, options, workspace, result);
  CHECK(result.output.data() == output);
  CHECK(workspace.q.data() == projected);
  CHECK(workspace.attended.data() == attended);
}

TEMPLATE_TEST_CASE("grouped-query attention equals MHA with each K/V head's projection repeated",
                   "[mha][gqa]", float, double) {
  using T = TestType;
  const Index E = 12, H = 6, L = 4, S = 5;
  for (const Index kv_heads : {1, 2, 3}) {
    MultiHeadAttentionConfig config(E, H);
    config.num_kv_heads = kv_heads;
    config.add_bias_kv = kv_heads == 2;
    config.add_zero_attn = kv_heads == 3;
    const auto gqa = random_layer<T>(config, 40 + static_cast<std::uint64_t>(kv_heads));
    const Index D = E / H, group = H / kv_heads;
    CHECK(gqa.num_kv_heads() == kv_heads);
    CHECK(gqa.kv_dim() == kv_heads * D);
    CHECK(gqa.parameter("k_proj_weight").shape() == mha::Shape{kv_heads * D, E});
    CHECK(gqa.parameter("in_proj_bias").shape() == mha::Shape{E + 2 * kv_heads * D});
    // The same layer as plain MHA: key/value head g's rows (and bias entries) copied to every
    // query head of its group, as torch's repeat_interleave on the projected heads.
    MultiHeadAttentionConfig plain_config(E, H);
    plain_config.add_bias_kv = config.add_bias_kv;
    plain_config.add_zero_attn = config.add_zero_attn;
    plain_config.kdim = E + 1;  // separate q/k/v weights, as the GQA layer has
    plain_config.vdim = E + 1;
    MultiHeadAttention<T> plain(plain_config);
    const auto repeat_rows = [&](const Tensor<T>& rows_of_kv_heads, Index width) {
      Tensor<T> repeated({E, width});
      for (Index h = 0; h < H; ++h) {
        repeated.matrix().middleRows(h * D, D) =
            rows_of_kv_heads.matrix().middleRows((h / group) * D, D);
      }
      return repeated;
    };
    // kdim/vdim E + 1 in `plain`: a zero last column keeps the products equal.
    const auto widen = [&](const Tensor<T>& weight) {
      Tensor<T> wide({weight.dim(0), E + 1});
      wide.matrix().leftCols(E) = weight.matrix();
      return wide;
    };
    plain.set_parameter("q_proj_weight", gqa.parameter("q_proj_weight"));
    plain.set_parameter("k_proj_weight",
                        widen(repeat_rows(Tensor<T>(gqa.parameter("k_proj_weight")), E)));
    plain.set_parameter("v_proj_weight",
                        widen(repeat_rows(Tensor<T>(gqa.parameter("v_proj_weight")), E)));
    const Tensor<T> gqa_bias(gqa.parameter("in_proj_bias"));
    Tensor<T> bias({3 * E});
    for (Index h = 0; h < H; ++h) {
      const Index g = h / group;
      bias.flat().segment(h * D, D) = gqa_bias.flat().segment(h * D, D);
      bias.flat().segment(E + h * D, D) = gqa_bias.flat().segment(E + g * D, D);
      bias.flat().segment(2 * E + h * D, D) = gqa_bias.flat().segment(E + kv_heads * D + g * D, D);
    }
    plain.set_parameter("in_proj_bias", bias);
    if (config.add_bias_kv) {
      for (const char* name : {"bias_k", "bias_v"}) {
        const Tensor<T> extra(gqa.parameter(name));
        Tensor<T> repeated({1, 1, E});
        for (Index h = 0; h < H; ++h) {
          repeated.flat().segment(h * D, D) = extra.flat().segment((h / group) * D, D);
        }
        plain.set_parameter(name, repeated);
      }
    }
    plain.set_parameter("out_proj.weight", gqa.parameter("out_proj.weight"));
    plain.set_parameter("out_proj.bias", gqa.parameter("out_proj.bias"));
    const auto q = mha_test::random_tensor<T>({2, L, E}, 1);
    const auto kv = mha_test::random_tensor<T>({2, S, E}, 2);
    Tensor<T> kv_wide({2, S, E + 1});
    for (Index b = 0; b < 2; ++b) kv_wide[b].matrix().leftCols(E) = kv[b].matrix();
    for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
      mha::ForwardOptions<T> options;
      options.need_weights = kernel == mha::Kernel::reference;
      options.average_attn_weights = false;
      options.kernel = kernel;
      options.is_causal = true;
      const auto expected = plain.forward(q, kv_wide, kv_wide, options);
      const auto actual = gqa.forward(q, kv, kv, options);
      INFO("H_kv " << kv_heads << " " << mha::kernel_name(kernel));
      CHECK_TENSORS_CLOSE(actual.output, expected.output);
      if (options.need_weights) CHECK_TENSORS_CLOSE(actual.attn_weights, expected.attn_weights);
    }
  }
  MultiHeadAttentionConfig bad(E, H);
  bad.num_kv_heads = 4;
  CHECK_THROWS_WITH(MultiHeadAttention<float>(bad),
                    "num_kv_heads: must divide num_heads 6 (or be 0 for num_heads), got 4");
}

TEMPLATE_TEST_CASE("prune_heads removes heads: the outputs of gating them to 0, smaller matrices",
                   "[prune]", float, double) {
  using T = TestType;
  struct Case {
    const char* name;
    MultiHeadAttentionConfig config;
    bool self_attention;
  };
  MultiHeadAttentionConfig packed(24, 4);
  MultiHeadAttentionConfig separate(24, 4);
  separate.kdim = 5;
  separate.vdim = 7;
  separate.add_bias_kv = true;
  separate.add_zero_attn = true;
  MultiHeadAttentionConfig no_bias(24, 4);
  no_bias.bias = false;
  for (const Case& c :
       {Case{"packed self-attention", packed, true},
        Case{"kdim/vdim, bias_kv, zero_attn", separate, false}, Case{"no bias", no_bias, true}}) {
    INFO(c.name);
    MultiHeadAttention<T> layer(c.config);
    randomise(layer, 9);
    const auto x = mha_test::random_tensor<T>({2, 5, 24}, 10);
    const auto key = mha_test::random_tensor<T>({2, 6, layer.kdim()}, 11);
    const auto value = mha_test::random_tensor<T>({2, 6, layer.vdim()}, 12);
    const auto run = [&](const MultiHeadAttention<T>& l, const mha::ForwardOptions<T>& options) {
      return c.self_attention ? l.forward(x, options) : l.forward(x, key, value, options);
    };
    mha::ForwardOptions<T> options;
    options.average_attn_weights = false;
    options.is_causal = true;
    options.rope = mha::Rope{};
    mha::ForwardOptions<T> gated = options;
    gated.head_gate = {T(0), T(1), T(1), T(0)};
    const auto expected = run(layer, gated);
    const auto before = run(layer, options);

    MultiHeadAttention<T> pruned = layer;
    pruned.prune_heads({3, 0});
    CHECK(pruned.num_heads() == 2);
    CHECK(pruned.head_dim() == 6);
    CHECK(pruned.inner_dim() == 12);
    CHECK(pruned.embed_dim() == 24);
    CHECK(pruned.parameter("out_proj.weight").shape() == mha::Shape{24, 12});
    CHECK(pruned.parameter(c.self_attention ? "in_proj_weight" : "q_proj_weight").dim(0) ==
          (c.self_attention ? 36 : 12));
    const auto after = run(pruned, options);
    CHECK_TENSORS_CLOSE(after.output, expected.output);
    // The kept heads, 1 and 2, attend exactly as before.
    for (Index b = 0; b < 2; ++b) {
      for (Index h = 0; h < 2; ++h) {
        CHECK(after.attn_weights[b][h].matrix() == before.attn_weights[b][h + 1].matrix());
      }
    }
    // A pruned layer's state_dict loads back into a layer of the same shapes.
    std::map<std::string, Tensor<T>> state;
    for (const auto& name : pruned.parameter_names()) {
      state.emplace(name, Tensor<T>(pruned.parameter(name)));
    }
    const auto loaded = MultiHeadAttention<T>::from_state_dict(state, 2, c.config.add_zero_attn);
    CHECK(loaded.head_dim() == 6);
    CHECK(run(loaded, options).output.flat() == after.output.flat());
    // and decodes (self-attention layers without extra keys)
    if (c.self_attention) {
      auto cache = pruned.make_kv_cache(2, 5);
      auto decode_options = mha::MultiHeadAttention<T>::decode_options();
      decode_options.rope = mha::Rope{};
      const auto decoded = pruned.decode(x, cache, decode_options).output;
      mha::ForwardOptions<T> causal = decode_options;
      const auto full = pruned.forward(x, causal).output;
      const double scale = static_cast<double>(full.flat().cwiseAbs().maxCoeff());
      CHECK_TENSORS_CLOSE_TOL(decoded, full, 0.0,
                              (std::is_same_v<T, float> ? 1e-5 : 1e-12) * scale);
    }
  }
}

TEST_CASE("prune_heads refuses what it cannot remove", "[prune][errors]") {
  MultiHeadAttention<double> layer(MultiHeadAttentionConfig(16, 4));
  const auto message = [&](const std::vector<Index>& heads) {
    return mha_test::message_of<mha::ShapeError>([&] { layer.prune_heads(heads); });
  };
  CHECK(message({4}) == "heads: expected head indices in [0, 4), got 4");
  CHECK(message({-1}) == "heads: expected head indices in [0, 4), got -1");
  CHECK(message({1, 1}) == "heads: head 1 is listed twice");
  CHECK(message({0, 1, 2, 3}) == "heads: would remove all 4 heads: at least one must stay");
  CHECK(layer.num_heads() == 4);  // nothing changed
  layer.prune_heads({});
  CHECK(layer.num_heads() == 4);
  MultiHeadAttentionConfig grouped(16, 4);
  grouped.num_kv_heads = 2;
  MultiHeadAttention<double> gqa(grouped);
  CHECK(mha_test::contains(mha_test::message_of<mha::ShapeError>([&] { gqa.prune_heads({1}); }),
                           "prune_heads: a grouped-query layer (2 key/value heads for 4 query "
                           "heads) shares key/value heads"));
  MultiHeadAttentionConfig bad(16, 3);
  bad.head_dim = -2;
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { MultiHeadAttention<double> l(bad); }),
      "head_dim: must be positive"));
  bad.head_dim = 5;  // 3 heads of 5 in a 16-wide layer: allowed, H·D need not be E
  CHECK(MultiHeadAttention<double>(bad).inner_dim() == 15);
}

TEMPLATE_TEST_CASE("talking heads: identity mixes are plain attention, and mixing is per position",
                   "[mha][talking]", float, double) {
  using T = TestType;
  MultiHeadAttentionConfig config(12, 3);
  config.num_kv_heads = 1;
  const auto plain = random_layer<T>(config, 3);
  config.talking_heads_pre = config.talking_heads_post = true;
  MultiHeadAttention<T> talking(config);
  CHECK(talking.parameter_names() ==
        std::vector<std::string>{"q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                                 "out_proj.weight", "out_proj.bias", "talking_heads_pre",
                                 "talking_heads_post"});
  CHECK(talking.parameter("talking_heads_pre").matrix().isIdentity());
  for (const auto& name : plain.parameter_names()) {
    talking.set_parameter(name, plain.parameter(name));
  }
  const auto x = mha_test::random_tensor<T>({2, 7, 12}, 4);
  mha::ForwardOptions<T> options;
  options.is_causal = true;
  options.average_attn_weights = false;
  options.kernel = mha::Kernel::reference;
  const auto expected = plain.forward(x, options);
  const auto actual = talking.forward(x, options);
  CHECK_TENSORS_CLOSE(actual.output, expected.output);
  CHECK_TENSORS_CLOSE(actual.attn_weights, expected.attn_weights);

  // A post mix that swaps heads 0 and 1 swaps their weights; causal masking stays per position.
  Tensor<T> swap({3, 3}, T(0));
  swap(0, 1) = swap(1, 0) = swap(2, 2) = T(1);
  talking.set_parameter("talking_heads_post", swap);
  const auto swapped = talking.forward(x, options);
  for (Index b = 0; b < 2; ++b) {
    CHECK_TENSORS_CLOSE(Tensor<T>(swapped.attn_weights[b][0]),
                        Tensor<T>(expected.attn_weights[b][1]));
    CHECK_TENSORS_CLOSE(Tensor<T>(swapped.attn_weights[b][2]),
                        Tensor<T>(expected.attn_weights[b][2]));
  }

  // A state_dict with the mixes builds a talking-heads layer.
  const auto rebuilt = MultiHeadAttention<T>::from_state_dict(talking.state_dict(), 3);
  CHECK(rebuilt.config().talking_heads_pre);
  CHECK(rebuilt.config().talking_heads_post);
  CHECK(rebuilt.forward(x, options).output.flat() == swapped.output.flat());

  // What cannot mix heads is refused.
  options.kernel = mha::Kernel::flash;
  options.need_weights = false;
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { talking.forward(x, options); }),
      "kernel: flash cannot mix heads"));
  MultiHeadAttentionConfig full(12, 3);
  full.talking_heads_pre = true;
  MultiHeadAttention<T> unpruned(full);
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { unpruned.prune_heads({1}); }),
      "prune_heads: with talking heads every head reads every other head's logits"));
}
