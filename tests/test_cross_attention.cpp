// Cross-attention caches (MultiHeadAttention::encode_memory, cross_attend): an encoder's output
// projected once, then read by every step, against forward with the memory as key and value;
// encoder outputs of different lengths; packed steps; quantized memories; and the refusals.
#include <string>
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::Tensor;

namespace {

// forward with query x [n, E] and key = value = memory's first `length` rows of sequence b.
Tensor<float> forward_over_memory(const mha::MultiHeadAttention<float>& layer,
                                  const Tensor<float>& x, const Tensor<float>& memory, Index b,
                                  Index length) {
  Tensor<float> keys({length, memory.dim(2)});
  keys.matrix() = memory[b].matrix().topRows(length);
  mha::ForwardOptions<float> options;
  options.need_weights = false;
  return layer.forward(x, keys, keys, options).output;
}

}  // namespace

TEST_CASE("cross-attention over an encoded memory equals forward with the memory as key and value",
          "[cross]") {
  // Two sequences whose encoder outputs hold 37 and 20 rows (padded to S = 37); steps of 1 token
  // (the decoding kernel) and of 18 (the flash kernel), with grouped-query heads and kdim != E.
  for (const Index kv_heads : {Index{1}, Index{4}}) {
    INFO("H_kv = " << kv_heads);
    mha::MultiHeadAttentionConfig config(64, 4);
    config.num_kv_heads = kv_heads;
    config.kdim = config.vdim = 48;
    config.seed = 5;
    mha::MultiHeadAttention<float> layer(config);
    mha_test::randomise(layer, 9);
    const auto memory = mha_test::random_tensor<float>({2, 37, 48}, 1);
    const std::vector<Index> lengths{37, 20};
    auto encoded = layer.encode_memory(memory, lengths);
    REQUIRE(encoded.length(0) == 37);
    REQUIRE(encoded.length(1) == 20);
    for (const Index n : {Index{1}, Index{18}, Index{1}}) {
      INFO(n << " tokens");
      const auto x = mha_test::random_tensor<float>({2, n, 64}, static_cast<std::uint64_t>(n) + 3);
      const auto out = layer.cross_attend(x, encoded);
      for (Index b = 0; b < 2; ++b) {
        Tensor<float> query({n, 64});
        query.matrix() = x[b].matrix();
        const auto expected =
            forward_over_memory(layer, query, memory, b, lengths[static_cast<std::size_t>(b)]);
        Tensor<float> actual({n, 64});
        actual.matrix() = out.output[b].matrix();
        const double largest = static_cast<double>(expected.flat().cwiseAbs().maxCoeff());
        CHECK_TENSORS_CLOSE_TOL(actual, expected, 0.0, 1e-5 * largest);
      }
      // Reading the memory does not change it.
      CHECK(encoded.length(0) == 37);
      CHECK(encoded.length(1) == 20);
    }
    // A packed step of 3 and 1 tokens gives the rows a padded step gives.
    const auto x = mha_test::random_tensor<float>({2, 3, 64}, 40);
    const auto padded = layer.cross_attend(x, encoded, layer.cross_attention_options(), {3, 1});
    Tensor<float> packed_x({4, 64});
    packed_x.matrix().topRows(3) = x[0].matrix();
    packed_x.matrix().row(3) = x[1].matrix().row(0);
    auto options = layer.cross_attention_options();
    options.cu_seqlens = {0, 3, 4};
    const auto packed = layer.cross_attend(packed_x, encoded, options);
    const double largest = static_cast<double>(padded.output.flat().cwiseAbs().maxCoeff());
    Tensor<float> expected({4, 64});
    expected.matrix().topRows(3) = padded.output[0].matrix();
    expected.matrix().row(3) = padded.output[1].matrix().row(0);
    CHECK_TENSORS_CLOSE_TOL(packed.output, expected, 0.0, 1e-5 * largest);
  }
}

TEST_CASE("a quantized memory stays within the quantized cache's bound", "[cross]") {
  mha::MultiHeadAttentionConfig config(64, 2);
  config.seed = 2;
  mha::MultiHeadAttention<float> layer(config);
  const auto memory = mha_test::random_tensor<float>({1, 50, 64}, 3);
  const auto x = mha_test::random_tensor<float>({1, 2, 64}, 4);
  auto exact = layer.encode_memory(memory);
  auto q8 = layer.encode_memory(memory, {}, mha::KVCacheFormat::q8);
  const auto expected = layer.cross_attend(x, exact).output;
  const auto actual = layer.cross_attend(x, q8).output;
  // test_quantized_cache's bound for q8: 2e-2 of the largest output.
  const double largest = static_cast<double>(expected.flat().cwiseAbs().maxCoeff());
  CHECK_TENSORS_CLOSE_TOL(actual, expected, 0.0, 2e-2 * largest);
  CHECK_FALSE(mha_test::compare(actual, expected).ok);  // q8 did round
}

TEST_CASE("cross-attention refuses positions, causal masking and bad memories", "[cross]") {
  mha::MultiHeadAttentionConfig config(32, 2);
  mha::MultiHeadAttention<float> layer(config);
  const auto memory = mha_test::random_tensor<float>({2, 5, 32}, 1);
  auto encoded = layer.encode_memory(memory);
  const auto x = mha_test::random_tensor<float>({2, 1, 32}, 2);
  const auto refusal = [&](const mha::ForwardOptions<float>& options) {
    return mha_test::message_of<mha::ShapeError>([&] { layer.cross_attend(x, encoded, options); });
  };
  auto options = layer.cross_attention_options();
  options.is_causal = true;
  CHECK(mha_test::contains(refusal(options), "is_causal"));
  options.is_causal = false;
  options.rope = mha::Rope{};
  CHECK(mha_test::contains(refusal(options), "rope"));
  options.rope.reset();
  options.window.left = 2;
  CHECK(mha_test::contains(refusal(options), "window"));
  CHECK(encoded.length(0) == 5);

  CHECK(mha_test::contains(mha_test::message_of<mha::ShapeError>([&] {
                             layer.encode_memory(memory, {5, 6});
                           }),
                           "lengths"));
  const auto wrong_width = mha_test::random_tensor<float>({2, 5, 16}, 3);
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { layer.encode_memory(wrong_width); }), "memory"));
  config.add_bias_kv = true;
  const mha::MultiHeadAttention<float> with_bias(config);
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { with_bias.encode_memory(memory); }),
      "add_bias_kv"));
}

TEST_CASE("a frozen layer attends to an encoded memory as the layer, and in int8 within its bound",
          "[cross][frozen]") {
  // E = 256, H = 4 at PyTorch's initialisation, kdim = vdim = 96: test_precision's int8 setting.
  mha::MultiHeadAttentionConfig config(256, 4);
  config.kdim = config.vdim = 96;
  config.seed = 15;
  const mha::MultiHeadAttention<float> layer(config);
  const auto memory = mha_test::random_tensor<float>({2, 30, 96}, 16);
  const std::vector<Index> lengths{30, 11};
  const auto x = mha_test::random_tensor<float>({2, 20, 256}, 17);
  auto encoded = layer.encode_memory(memory, lengths);
  const auto expected = layer.cross_attend(x, encoded);
  // fp32 weights: the packed weights give the layer's bits (as test_frozen's forward and decode).
  const mha::FrozenMultiHeadAttention<float> frozen(layer);
  auto frozen_encoded = frozen.encode_memory(memory, lengths);
  REQUIRE(frozen_encoded.length(1) == 11);
  CHECK(frozen_encoded.keys(0).matrix() == encoded.keys(0).matrix());
  CHECK(frozen.cross_attend(x, frozen_encoded).output.flat() == expected.output.flat());
  // int8 weights and Precision::int8 (the queries' and the output's products in int8): within
  // test_precision's 2e-2 of the float64 layer.
  const mha::FrozenMultiHeadAttention<float> int8_frozen(layer, mha::FrozenWeights::int8);
  auto int8_encoded = int8_frozen.encode_memory(memory, lengths);
  const auto wide = mha_test::converted<double>(layer);
  auto wide_encoded = wide.encode_memory(mha::tensor_cast<double>(memory), lengths);
  const auto exact = wide.cross_attend(mha::tensor_cast<double>(x), wide_encoded).output;
  auto options = layer.cross_attention_options();
  options.precision = mha::Precision::int8;
  const auto int8 = int8_frozen.cross_attend(x, int8_encoded, options).output;
  CHECK(mha_test::error_of_largest(int8, exact) <= 2e-2);
  const auto weight_only = int8_frozen.cross_attend(x, int8_encoded).output;
  CHECK((int8.flat() != weight_only.flat()) == mha::detail::int8_dot_available());
  // The layer itself keeps no packed weights for it.
  CHECK(mha_test::contains(
      mha_test::message_of<std::invalid_argument>([&] { layer.cross_attend(x, encoded, options); }),
      "precision"));
}
