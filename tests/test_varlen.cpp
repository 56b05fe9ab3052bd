// Packed variable-length batches (ForwardOptions::cu_seqlens): forward, forward_train and
// backward over [T, E] equal one call per sequence, for self- and cross-attention, in both
// kernels and with the options that act per sequence (causal masking, windows, ALiBi, RoPE,
// softcap, sinks, grouped-query heads); and the refusals.
#include <algorithm>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::Tensor;

namespace {

// Rows [begin, begin + count) of a [T, width] tensor.
template <class T>
Tensor<T> rows_of(const Tensor<T>& packed, Index begin, Index count) {
  Tensor<T> part({count, packed.dim(1)});
  if (count > 0) part.matrix() = packed.matrix().middleRows(begin, count);
  return part;
}

std::vector<Index> cumulative(const std::vector<Index>& lengths) {
  std::vector<Index> result{0};
  for (const Index length : lengths) result.push_back(result.back() + length);
  return result;
}

struct Setup {
  std::string name;
  bool causal = false, window = false, alibi = false, rope = false, softcap = false;
  bool sinks = false, cross = false;
  Index kv_heads = 4;
};

std::vector<Setup> setups() {
  std::vector<Setup> all;
  all.push_back({"plain"});
  all.push_back({"causal, RoPE, grouped-query", true, false, false, true});
  all.back().kv_heads = 2;
  all.push_back({"causal, window, ALiBi, softcap", true, true, true, false, true});
  all.push_back({"sinks, causal", true, false, false, false, false, true});
  all.push_back({"cross-attention, RoPE, causal bottom-right", true, false, false, true});
  all.back().cross = true;
  return all;
}

template <class T>
mha::ForwardOptions<T> options_for(const Setup& setup, mha::Kernel kernel) {
  mha::ForwardOptions<T> options;
  options.need_weights = false;
  options.kernel = kernel;
  options.is_causal = setup.causal;
  options.causal_alignment = setup.cross ? mha::Alignment::bottom_right : mha::Alignment::top_left;
  if (setup.window) {
    options.window.left = 3;
    options.window.right = 0;
  }
  if (setup.alibi) options.alibi_slopes = mha::alibi_slopes<T>(4);
  if (setup.rope) options.rope = mha::Rope{};
  if (setup.softcap) options.softcap = T(5);
  return options;
}

template <class T>
mha::MultiHeadAttention<T> layer_for(const Setup& setup) {
  mha::MultiHeadAttentionConfig config(32, 4);
  config.num_kv_heads = setup.kv_heads;
  config.learnable_sinks = setup.sinks;
  mha::MultiHeadAttention<T> layer(config);
  mha_test::randomise(layer, 21);
  return layer;
}

}  // namespace

TEMPLATE_TEST_CASE("a packed batch's forward equals one forward per sequence", "[varlen]", float,
                   double) {
  using T = TestType;
  // Lengths with an empty sequence, one token, and several flash blocks.
  const std::vector<Index> lengths{5, 0, 1, 70, 17};
  const std::vector<Index> key_lengths{9, 3, 4, 66, 17};
  for (const Setup& setup : setups()) {
    for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
      INFO(setup.name << ", " << mha::kernel_name(kernel));
      const auto layer = layer_for<T>(setup);
      const auto& key_counts = setup.cross ? key_lengths : lengths;
      const auto starts = cumulative(lengths), key_starts = cumulative(key_counts);
      const auto x = mha_test::random_tensor<T>({starts.back(), 32}, 3);
      const auto memory = mha_test::random_tensor<T>({key_starts.back(), 32}, 4);
      auto options = options_for<T>(setup, kernel);
      options.cu_seqlens = starts;
      if (setup.cross) options.cu_seqlens_k = key_starts;
      const auto packed =
          setup.cross ? layer.forward(x, memory, memory, options) : layer.forward(x, options);
      REQUIRE(packed.output.shape() == x.shape());
      auto single = options_for<T>(setup, kernel);
      for (std::size_t s = 0; s < lengths.size(); ++s) {
        INFO("sequence " << s);
        const auto query = rows_of(x, starts[s], lengths[s]);
        const auto keys = rows_of(memory, key_starts[s], key_counts[s]);
        const auto alone =
            setup.cross ? layer.forward(query, keys, keys, single) : layer.forward(query, single);
        // A sequence's projections alone and among the packed rows may take different products
        // (a few rows take dot products), so float's bound is relative to the largest output, as
        // test_decode's; double's stays elementwise.
        const auto actual = rows_of(packed.output, starts[s], lengths[s]);
        if constexpr (std::is_same_v<T, float>) {
          const double largest =
              alone.output.size() > 0
                  ? static_cast<double>(alone.output.flat().cwiseAbs().maxCoeff())
                  : 0.0;
          CHECK_TENSORS_CLOSE_TOL(actual, alone.output, 0.0, 1e-5 * std::max(largest, 1.0));
        } else {
          CHECK_TENSORS_CLOSE(actual, alone.output);
        }
      }
    }
  }
}

TEST_CASE("a packed batch's gradients equal the sums of one backward per sequence", "[varlen]") {
  const std::vector<Index> lengths{6, 0, 33, 1};
  const std::vector<Index> key_lengths{4, 2, 30, 5};
  for (const Setup& setup : setups()) {
    for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
      INFO(setup.name << ", " << mha::kernel_name(kernel));
      auto layer = layer_for<double>(setup);
      const auto& key_counts = setup.cross ? key_lengths : lengths;
      const auto starts = cumulative(lengths), key_starts = cumulative(key_counts);
      const auto x = mha_test::random_tensor<double>({starts.back(), 32}, 5);
      const auto memory = mha_test::random_tensor<double>({key_starts.back(), 32}, 6);
      const auto grad_out = mha_test::random_tensor<double>(x.shape(), 7);
      auto options = options_for<double>(setup, kernel);
      options.cu_seqlens = starts;
      if (setup.cross) options.cu_seqlens_k = key_starts;
      layer.zero_grad();
      mha::SavedForward<double> saved;
      if (setup.cross) {
        layer.forward_train(x, memory, memory, options, saved);
      } else {
        layer.forward_train(x, options, saved);
      }
      const auto packed = layer.backward(saved, grad_out.view());
      std::map<std::string, Tensor<double>> packed_grads;
      for (const auto& name : layer.parameter_names())
        packed_grads[name] = Tensor<double>(layer.gradient(name));

      layer.zero_grad();
      auto single = options_for<double>(setup, kernel);
      Tensor<double> grad_x(x.shape()), grad_memory(memory.shape());
      for (std::size_t s = 0; s < lengths.size(); ++s) {
        if (lengths[s] == 0) continue;  // a call of no queries: nothing to differentiate
        const auto query = rows_of(x, starts[s], lengths[s]);
        const auto keys = rows_of(memory, key_starts[s], key_counts[s]);
        mha::SavedForward<double> one;
        if (setup.cross) {
          layer.forward_train(query, keys, keys, single, one);
        } else {
          layer.forward_train(query, single, one);
        }
        const auto grads = layer.backward(one, rows_of(grad_out, starts[s], lengths[s]).view());
        if (setup.cross) {
          grad_x.matrix().middleRows(starts[s], lengths[s]) = grads.query.matrix();
          grad_memory.matrix().middleRows(key_starts[s], key_counts[s]) =
              grads.key.matrix() + grads.value.matrix();
        } else {
          grad_x.matrix().middleRows(starts[s], lengths[s]) =
              grads.query.matrix() + grads.key.matrix() + grads.value.matrix();
        }
      }
      if (setup.cross) {
        CHECK_TENSORS_CLOSE(packed.query, grad_x);
        Tensor<double> packed_memory(memory.shape());
        packed_memory.matrix() = packed.key.matrix() + packed.value.matrix();
        CHECK_TENSORS_CLOSE(packed_memory, grad_memory);
      } else {
        Tensor<double> packed_x(x.shape());
        packed_x.matrix() = packed.query.matrix() + packed.key.matrix() + packed.value.matrix();
        CHECK_TENSORS_CLOSE(packed_x, grad_x);
      }
      for (const auto& name : layer.parameter_names()) {
        INFO(name);
        CHECK_TENSORS_CLOSE(packed_grads[name], Tensor<double>(layer.gradient(name)));
      }
    }
  }
}

TEST_CASE("a packed batch refuses bad cumulative lengths and what it cannot have", "[varlen]") {
  const auto layer = layer_for<float>(setups().front());
  const auto x = mha_test::random_tensor<float>({10, 32}, 1);
  mha::ForwardOptions<float> options;
  options.need_weights = false;
  const auto refusal = [&](const mha::ForwardOptions<float>& given) {
    return mha_test::message_of<mha::ShapeError>([&] { layer.forward(x, given); });
  };
  for (const std::vector<Index>& bad :
       {std::vector<Index>{1, 10}, std::vector<Index>{0, 6, 4, 10}, std::vector<Index>{0, 9}}) {
    options.cu_seqlens = bad;
    const std::string message = refusal(options);
    CHECK(mha_test::contains(message, "cu_seqlens"));
    CHECK(mha_test::contains(message, "10 rows"));
  }
  options.cu_seqlens = {0, 4, 10};
  options.cu_seqlens_k = {0, 10};
  CHECK(mha_test::contains(refusal(options), "cu_seqlens_k"));
  options.cu_seqlens_k.clear();
  options.need_weights = true;
  CHECK(mha_test::contains(refusal(options), "need_weights"));
  options.need_weights = false;
  options.attn_mask = mha::Mask<float>::additive(Tensor<float>({10, 10}));
  CHECK(mha_test::contains(refusal(options), "attn_mask"));
  options.attn_mask = {};
  const auto batched = mha_test::random_tensor<float>({1, 10, 32}, 2);
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { layer.forward(batched, options); }),
      "total_tokens"));
}

TEST_CASE("a packed decoding step equals the padded one, over a paged and a contiguous cache",
          "[varlen]") {
  // Three sequences: prompts of 20, 5 and 0 tokens, then 1, 1 and 7. Packed, x holds only their
  // tokens ([T, E] with cu_seqlens); padded, x is [3, n, E] with new_tokens.
  mha::MultiHeadAttentionConfig config(64, 4);
  config.num_kv_heads = 2;
  config.seed = 12;
  const mha::MultiHeadAttention<float> layer(config);
  const std::vector<std::vector<Index>> steps{{20, 5, 0}, {1, 1, 7}};
  auto packed_pool = layer.make_paged_kv_cache(48, 6);
  auto padded_pool = layer.make_paged_kv_cache(48, 6);
  auto packed_cache = layer.make_kv_cache(3, 40);
  std::vector<Index> ids;
  for (int s = 0; s < 3; ++s) {
    ids.push_back(packed_pool.add_sequence());
    padded_pool.add_sequence();
  }
  std::uint64_t seed = 30;
  for (const auto& counts : steps) {
    const Index n = *std::max_element(counts.begin(), counts.end());
    const auto padded = mha_test::random_tensor<float>({3, n, 64}, ++seed);
    const auto starts = cumulative(counts);
    Tensor<float> packed({starts.back(), 64});
    for (std::size_t i = 0; i < 3; ++i) {
      packed.matrix().middleRows(starts[i], counts[i]) =
          padded[static_cast<Index>(i)].matrix().topRows(counts[i]);
    }
    auto options = mha::MultiHeadAttention<float>::decode_options();
    const auto from_padded = layer.decode(padded, padded_pool, ids, options, counts);
    options.cu_seqlens = starts;
    const auto from_packed = layer.decode(packed, packed_pool, ids, options);
    const auto from_cache = layer.decode(packed, packed_cache, options);
    REQUIRE(from_packed.output.shape() == packed.shape());
    // The projections of 9 packed rows and of 21 padded ones may take different products (a
    // few rows take dot products), so the bound is float rounding's, as test_decode's.
    const double largest = static_cast<double>(from_padded.output.flat().cwiseAbs().maxCoeff());
    for (std::size_t i = 0; i < 3; ++i) {
      INFO("sequence " << i << ", " << counts[i] << " tokens");
      Tensor<float> expected({counts[i], 64});
      expected.matrix() = from_padded.output[static_cast<Index>(i)].matrix().topRows(counts[i]);
      CHECK_TENSORS_CLOSE_TOL(rows_of(from_packed.output, starts[i], counts[i]), expected, 0.0,
                              1e-5 * largest);
      CHECK_TENSORS_CLOSE_TOL(rows_of(from_cache.output, starts[i], counts[i]),
                              rows_of(from_packed.output, starts[i], counts[i]), 0.0, 0.0);
    }
  }
  // Refused before anything changes: counts that do not end at x's rows, new_tokens with them.
  auto options = mha::MultiHeadAttention<float>::decode_options();
  options.cu_seqlens = {0, 1, 2, 4};
  const auto x = mha_test::random_tensor<float>({3, 64}, 1);
  const Index before = packed_pool.length(ids[0]);
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { layer.decode(x, packed_pool, ids, options); }),
      "cu_seqlens"));
  options.cu_seqlens = {0, 1, 2, 3};
  CHECK(mha_test::contains(mha_test::message_of<mha::ShapeError>([&] {
                             layer.decode(x, packed_pool, ids, options, {1, 1, 1});
                           }),
                           "new_tokens"));
  CHECK(packed_pool.length(ids[0]) == before);
}
