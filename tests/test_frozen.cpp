// FrozenMultiHeadAttention: its weights packed once, it returns the layer's results bit for bit
// (every projection path: fused self-attention, separate q/k/v weights, extra key rows, grouped
// heads, a few rows, no bias), keeps the weights it was frozen with, and checks its inputs as
// the layer does. The prepacked product itself is compared with product_transposed at shapes
// that cut its panels and slices unevenly.
#include <string>
#include <vector>

#include "helpers.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

using mha::FrozenMultiHeadAttention;
using mha::Index;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::Tensor;

namespace {

// Forward of layer and of its frozen copy on the same inputs, compared bit for bit.
void check_same_forward(const MultiHeadAttention<float>& layer, const Tensor<float>& query,
                        const Tensor<float>& key, const Tensor<float>& value,
                        const mha::ForwardOptions<float>& options) {
  const FrozenMultiHeadAttention<float> frozen(layer);
  CHECK(frozen.weights_packed() == mha::detail::packed_gemm_available());
  const auto expected = layer.forward(query.view(), key.view(), value.view(), options);
  const auto actual = frozen.forward(query.view(), key.view(), value.view(), options);
  CHECK(actual.output.shape() == expected.output.shape());
  CHECK(actual.output.flat() == expected.output.flat());
  CHECK(actual.attn_weights.shape() == expected.attn_weights.shape());
  if (expected.attn_weights.size() > 0) {
    CHECK(actual.attn_weights.flat() == expected.attn_weights.flat());
  }
}

}  // namespace

TEST_CASE("multiply_prepacked equals product_transposed bit for bit", "[frozen][gemm]") {
  if (!mha::detail::packed_gemm_available()) {
    WARN("the packed GEMM does not run on this CPU: nothing is packed");
    return;
  }
  // N not a multiple of the panels' 16 columns, K over two slices of 256 and not a multiple of
  // them, rows from just above the dot products' 16 to several slabs and ragged micro-tiles.
  for (const Index K : {40, 256, 600}) {
    for (const Index N : {17, 300}) {
      const auto w = mha_test::random_tensor<float>({N, K}, 2);
      const Eigen::Map<const mha::Matrix<float>> weight(w.data(), N, K);
      const auto packed = mha::detail::PackedWeight::pack(weight);
      for (const Index M : {17, 23, 128, 301}) {
        INFO("M " << M << ", N " << N << ", K " << K);
        REQUIRE(mha::detail::runs_prepacked(packed, M));
        const auto x = mha_test::random_tensor<float>({M, K}, 1);
        Tensor<float> expected({M, N}), actual({M, N}, 1.0F);
        std::vector<mha::detail::KernelScratch<float>> scratch;
        mha::detail::product_transposed<float, float>(mha::detail::strided(expected.matrix()),
                                                      mha::detail::const_strided(x.matrix()),
                                                      weight, mha::detail::Accumulate::no, scratch);
        mha::detail::multiply_prepacked(mha::detail::strided(actual.matrix()),
                                        mha::detail::const_strided(x.matrix()), packed);
        CHECK(actual.flat() == expected.flat());
      }
    }
  }
  // A few rows are left to product_transposed's dot products.
  const auto w = mha_test::random_tensor<float>({64, 32}, 3);
  const auto packed =
      mha::detail::PackedWeight::pack(Eigen::Map<const mha::Matrix<float>>(w.data(), 64, 32));
  CHECK_FALSE(mha::detail::runs_prepacked(packed, 16));
  CHECK(mha::detail::runs_prepacked(packed, 17));
}

TEST_CASE("a frozen layer's forward is the layer's, bit for bit", "[frozen]") {
  mha::ForwardOptions<float> options;
  SECTION("self-attention, the fused projection, over lengths around the few-rows limit") {
    MultiHeadAttention<float> layer(64, 4);
    mha_test::randomise(layer, 11);
    for (const Index L : {1, 16, 17, 40, 130}) {
      INFO("L " << L);
      const auto x = mha_test::random_tensor<float>({2, L, 64}, 5);
      options.need_weights = false;
      check_same_forward(layer, x, x, x, options);
      options.need_weights = true;
      options.is_causal = true;
      check_same_forward(layer, x, x, x, options);
      options.is_causal = false;
    }
  }
  SECTION("cross-attention with kdim and vdim, no bias, unbatched") {
    MultiHeadAttentionConfig config(48, 3);
    config.kdim = 20;
    config.vdim = 36;
    config.bias = false;
    MultiHeadAttention<float> layer(config);
    mha_test::randomise(layer, 21);
    const auto q = mha_test::random_tensor<float>({33, 48}, 1);
    const auto k = mha_test::random_tensor<float>({29, 20}, 2);
    const auto v = mha_test::random_tensor<float>({29, 36}, 3);
    check_same_forward(layer, q, k, v, options);
  }
  SECTION("add_bias_kv and add_zero_attn: the keys' extra rows") {
    MultiHeadAttentionConfig config(32, 4);
    config.add_bias_kv = true;
    config.add_zero_attn = true;
    MultiHeadAttention<float> layer(config);
    mha_test::randomise(layer, 31);
    const auto x = mha_test::random_tensor<float>({3, 24, 32}, 4);
    check_same_forward(layer, x, x, x, options);
  }
  SECTION("grouped-query attention") {
    MultiHeadAttentionConfig config(64, 8);
    config.num_kv_heads = 2;
    MultiHeadAttention<float> layer(config);
    mha_test::randomise(layer, 41);
    const auto x = mha_test::random_tensor<float>({2, 37, 64}, 6);
    options.need_weights = false;
    check_same_forward(layer, x, x, x, options);
  }
}

#if defined(_OPENMP)
TEST_CASE("a frozen layer's forward does not depend on the thread count", "[frozen][threads]") {
  MultiHeadAttention<float> layer(96, 6);
  mha_test::randomise(layer, 51);
  const FrozenMultiHeadAttention<float> frozen(layer);
  const auto x = mha_test::random_tensor<float>({1, 130, 96}, 7);
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = frozen.forward(x.view());
  omp_set_num_threads(3);
  const auto three = frozen.forward(x.view());
  omp_set_num_threads(threads_before);
  CHECK(one.output.flat() == three.output.flat());
}
#endif

TEST_CASE("a frozen layer keeps the weights it was frozen with", "[frozen]") {
  MultiHeadAttention<float> layer(32, 2);
  mha_test::randomise(layer, 61);
  const auto x = mha_test::random_tensor<float>({1, 20, 32}, 8);
  const auto before = layer.forward(x.view());
  const FrozenMultiHeadAttention<float> frozen(layer);
  // Writing through the layer's views (as an optimiser does) changes the layer only.
  auto weight = layer.parameter("in_proj_weight");
  for (Index i = 0; i < weight.size(); ++i) weight.data()[i] *= 2.0F;
  CHECK(layer.forward(x.view()).output.flat() != before.output.flat());
  CHECK(frozen.forward(x.view()).output.flat() == before.output.flat());
  CHECK(frozen.layer().state_dict().at("in_proj_weight").flat() !=
        layer.state_dict().at("in_proj_weight").flat());
  // Refreezing takes the new weights.
  const FrozenMultiHeadAttention<float> refrozen(layer);
  CHECK(refrozen.forward(x.view()).output.flat() == layer.forward(x.view()).output.flat());
}

TEST_CASE("a frozen layer checks its inputs and decodes as the layer", "[frozen]") {
  MultiHeadAttention<float> layer(32, 4);
  mha_test::randomise(layer, 71);
  const auto frozen = FrozenMultiHeadAttention<float>::from_state_dict(layer.state_dict(), 4);
  const auto wrong = mha_test::random_tensor<float>({1, 5, 31}, 9);
  const auto message = [&](const auto& attention) {
    try {
      attention.forward(wrong.view());
    } catch (const mha::ShapeError& error) {
      return std::string(error.what());
    }
    return std::string("no ShapeError");
  };
  CHECK(message(frozen) == message(layer));
  CHECK(mha_test::contains(message(frozen), "query"));
  auto cache = layer.make_kv_cache(1, 16), frozen_cache = layer.make_kv_cache(1, 16);
  const auto step = mha_test::random_tensor<float>({1, 3, 32}, 10);
  const auto expected = layer.decode(step.view(), cache);
  const auto actual = frozen.decode(step.view(), frozen_cache);
  CHECK(actual.output.flat() == expected.output.flat());
}

TEST_CASE("a frozen double layer computes as the layer, unpacked", "[frozen]") {
  MultiHeadAttention<double> layer(32, 4);
  mha_test::randomise(layer, 81);
  const FrozenMultiHeadAttention<double> frozen(layer);
  CHECK_FALSE(frozen.weights_packed());
  const auto x = mha_test::random_tensor<double>({2, 19, 32}, 11);
  CHECK(frozen.forward(x.view()).output.flat() == layer.forward(x.view()).output.flat());
}
