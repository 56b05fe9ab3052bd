// Numerical edge cases and failure behaviour of the layer: inputs large enough to overflow a
// naive exp, scores that are all equal, -inf mask entries among finite ones, NaN and Inf in the
// inputs (refused on request, otherwise confined to their batch element), empty sequences, long
// sequences through the flash kernel, and exceptions that leave the layer, its workspace and a
// KV cache usable.
//
// The oracles are independent of the kernel under test wherever one exists: a float64 layer
// with the same weights, exact answers (uniform weights, the mean of the values, the output
// bias), or the same computation without the edge (a finite -1e30 for -inf).
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::Kernel;
using mha::Mask;
using mha::MultiHeadAttention;
using mha::Tensor;

namespace {

constexpr Kernel kKernels[] = {Kernel::reference, Kernel::flash};

template <class To, class From>
MultiHeadAttention<To> converted(const MultiHeadAttention<From>& layer,
                                 const mha::MultiHeadAttentionConfig& config) {
  MultiHeadAttention<To> result(config);
  for (const auto& entry : layer.state_dict()) {
    result.set_parameter(entry.first, mha::tensor_cast<To>(entry.second).view());
  }
  return result;
}

// The largest |element|, for errors measured against a tensor's scale.
template <class T>
double max_magnitude(const Tensor<T>& tensor) {
  double largest = 0.0;
  for (Index i = 0; i < tensor.size(); ++i) {
    largest = std::max(largest, std::abs(static_cast<double>(tensor.data()[i])));
  }
  return largest;
}

// |actual - expected| <= rtol * max|expected| for every element.
template <class T, class U>
mha_test::Comparison close_to_scale(const Tensor<T>& actual, const Tensor<U>& expected,
                                    double rtol) {
  return mha_test::compare(actual, expected, 0.0, rtol * max_magnitude(expected));
}

mha::ForwardOptions<float> with_kernel(Kernel kernel) {
  mha::ForwardOptions<float> options;
  options.need_weights = false;
  options.kernel = kernel;
  return options;
}

}  // namespace

// Float heads of D = 4 take the small-head flash kernel (with at least 16 queries), D = 5 the GEMM
// tiles (kernels/flash.hpp).
const Index kEmbedsBothFlashPaths[] = {16, 20};

TEST_CASE("inputs of magnitude 1e4 give finite results equal to float64's", "[edge]") {
  // Scores far beyond 88 (float's exp overflows above it) unless the row maximum is subtracted.
  for (const Index embed : kEmbedsBothFlashPaths) {
    const mha::MultiHeadAttentionConfig config(embed, 4);
    MultiHeadAttention<float> layer(config);
    mha_test::randomise(layer, 11);
    const auto exact_layer = converted<double>(layer, config);
    const auto x = mha_test::random_tensor<float>({2, 17, embed}, 12, 1e4);
    const auto exact = exact_layer.forward(mha::tensor_cast<double>(x).view());
    REQUIRE(mha::all_finite(exact.output));
    for (const Kernel kernel : kKernels) {
      INFO(mha::kernel_name(kernel) << ", E " << embed);
      const auto result = layer.forward(x.view(), with_kernel(kernel));
      CHECK(mha::all_finite(result.output));
      const auto comparison = close_to_scale(result.output, exact.output, 1e-5);
      INFO(comparison.message);
      CHECK(comparison.ok);
    }
  }
}

TEST_CASE("all-equal scores give uniform weights and the mean of the values", "[edge]") {
  // Zero query weights and bias make every score 0; the output before out_proj is then the mean
  // of the value rows, which the test computes in double from the layer's own value projection.
  const Index embed = 8, heads = 2, batch = 2, length = 5, keys = 7;
  const mha::MultiHeadAttentionConfig config(embed, heads);
  MultiHeadAttention<double> layer(config);
  mha_test::randomise(layer, 21);
  auto weight = layer.parameter("in_proj_weight");
  auto bias = layer.parameter("in_proj_bias");
  for (Index i = 0; i < embed; ++i) {
    bias.data()[i] = 0;
    for (Index j = 0; j < embed; ++j) weight.data()[i * embed + j] = 0;
  }
  const auto query = mha_test::random_tensor<double>({batch, length, embed}, 22);
  const auto key = mha_test::random_tensor<double>({batch, keys, embed}, 23);
  const auto value = mha_test::random_tensor<double>({batch, keys, embed}, 24);

  // mean over keys of value · W_vᵀ + b_v, then the output projection.
  Tensor<double> expected({batch, length, embed});
  const auto w = layer.parameter("in_proj_weight");
  const auto b = layer.parameter("in_proj_bias");
  const auto w_out = layer.parameter("out_proj.weight");
  const auto b_out = layer.parameter("out_proj.bias");
  for (Index n = 0; n < batch; ++n) {
    std::vector<double> mean(static_cast<std::size_t>(embed), 0.0);
    for (Index j = 0; j < keys; ++j) {
      for (Index f = 0; f < embed; ++f) {
        double projected = b.data()[2 * embed + f];
        for (Index g = 0; g < embed; ++g) {
          projected +=
              w.data()[(2 * embed + f) * embed + g] * value.data()[(n * keys + j) * embed + g];
        }
        mean[static_cast<std::size_t>(f)] += projected / static_cast<double>(keys);
      }
    }
    for (Index i = 0; i < length; ++i) {
      for (Index f = 0; f < embed; ++f) {
        double out = b_out.data()[f];
        for (Index g = 0; g < embed; ++g) {
          out += w_out.data()[f * embed + g] * mean[static_cast<std::size_t>(g)];
        }
        expected.data()[(n * length + i) * embed + f] = out;
      }
    }
  }

  mha::ForwardOptions<double> options;
  options.average_attn_weights = false;
  const auto weighted = layer.forward(query.view(), key.view(), value.view(), options);
  for (Index i = 0; i < weighted.attn_weights.size(); ++i) {
    REQUIRE(weighted.attn_weights.data()[i] == Approx(1.0 / keys).epsilon(1e-14));
  }
  for (const Kernel kernel : kKernels) {
    INFO(mha::kernel_name(kernel));
    options.need_weights = false;
    options.kernel = kernel;
    const auto result = layer.forward(query.view(), key.view(), value.view(), options);
    CHECK_TENSORS_CLOSE(result.output, expected);
  }
}

TEST_CASE("-inf mask entries among finite ones act as a finite -1e30 would", "[edge]") {
  // An additive mask with -inf in some places and finite values (positive and negative) in the
  // others, plus key padding. exp(-1e30 - max) is exactly 0 in float, so replacing -inf by -1e30
  // must not change any row that keeps at least one key, by a single bit; rows that -inf masks
  // wholly give 0 before the output projection, i.e. the output bias.
  const Index embed = 16, heads = 4, batch = 2, length = 37, keys = 300;
  const mha::MultiHeadAttentionConfig config(embed, heads);
  MultiHeadAttention<float> layer(config);
  mha_test::randomise(layer, 31);
  const auto query = mha_test::random_tensor<float>({batch, length, embed}, 32);
  const auto key = mha_test::random_tensor<float>({batch, keys, embed}, 33);
  const auto value = mha_test::random_tensor<float>({batch, keys, embed}, 34);
  constexpr float kInf = std::numeric_limits<float>::infinity();

  auto with_inf = mha_test::random_tensor<float>({length, keys}, 35, 3.0);
  mha::Random random(36);
  for (Index i = 0; i < with_inf.size(); ++i) {
    if (random.uniform() < 0.4) with_inf.data()[i] = -kInf;
  }
  const Index fully_masked_row = 5;
  for (Index j = 0; j < keys; ++j) with_inf.data()[fully_masked_row * keys + j] = -kInf;
  auto finite = with_inf;
  for (Index i = 0; i < finite.size(); ++i) {
    if (std::isinf(finite.data()[i])) finite.data()[i] = -1e30f;
  }
  Tensor<bool> padding({batch, keys});
  for (Index i = 0; i < padding.size(); ++i) padding.data()[i] = random.uniform() < 0.2;

  const auto exact_layer = converted<double>(layer, config);
  mha::ForwardOptions<double> exact_options;
  exact_options.need_weights = false;
  exact_options.attn_mask = Mask<double>::additive(mha::tensor_cast<double>(with_inf));
  exact_options.key_padding_mask = Mask<double>::blocked_where_true(padding);
  const auto exact = exact_layer.forward(mha::tensor_cast<double>(query).view(),
                                         mha::tensor_cast<double>(key).view(),
                                         mha::tensor_cast<double>(value).view(), exact_options);
  REQUIRE(mha::all_finite(exact.output));

  for (const Kernel kernel : kKernels) {
    INFO(mha::kernel_name(kernel));
    auto options = with_kernel(kernel);
    options.key_padding_mask = Mask<float>::blocked_where_true(padding);
    options.attn_mask = Mask<float>::additive(with_inf);
    const auto result = layer.forward(query.view(), key.view(), value.view(), options);
    CHECK(mha::all_finite(result.output));
    const auto against_exact = close_to_scale(result.output, exact.output, 1e-5);
    INFO(against_exact.message);
    CHECK(against_exact.ok);

    options.attn_mask = Mask<float>::additive(finite);
    const auto finite_result = layer.forward(query.view(), key.view(), value.view(), options);
    const auto bias = layer.parameter("out_proj.bias");
    for (Index n = 0; n < batch; ++n) {
      for (Index i = 0; i < length; ++i) {
        for (Index f = 0; f < embed; ++f) {
          const Index at = (n * length + i) * embed + f;
          if (i == fully_masked_row) {
            REQUIRE(result.output.data()[at] == bias.data()[f]);
          } else {
            REQUIRE(result.output.data()[at] == finite_result.output.data()[at]);
          }
        }
      }
    }
  }
}

TEST_CASE("empty sequences give PyTorch's shapes and values", "[edge]") {
  // PyTorch 1.13 (torch.nn.MultiheadAttention, batch_first): L = 0 gives [B, 0, E] and weights
  // [B, 0, S]; S = 0 gives the output bias in every row (the softmax over no keys is empty, its
  // product with no values 0) and weights [B, L, 0]; B = 0 gives [0, L, E].
  const Index embed = 8;
  MultiHeadAttention<float> layer(embed, 2);
  mha_test::randomise(layer, 41);
  const auto bias = layer.parameter("out_proj.bias");
  struct Sizes {
    Index batch, length, keys;
  };
  for (const Sizes sizes : {Sizes{2, 0, 3}, Sizes{2, 3, 0}, Sizes{0, 3, 3}, Sizes{2, 0, 0}}) {
    const auto query = mha_test::random_tensor<float>({sizes.batch, sizes.length, embed}, 42);
    const auto key = mha_test::random_tensor<float>({sizes.batch, sizes.keys, embed}, 43);
    for (const bool need_weights : {true, false}) {
      for (const Kernel kernel : {Kernel::automatic, Kernel::reference, Kernel::flash}) {
        if (need_weights && kernel == Kernel::flash) continue;
        INFO("B " << sizes.batch << " L " << sizes.length << " S " << sizes.keys << " need_weights "
                  << need_weights << " kernel " << static_cast<int>(kernel));
        mha::ForwardOptions<float> options;
        options.need_weights = need_weights;
        options.kernel = kernel;
        const auto result = layer.forward(query.view(), key.view(), key.view(), options);
        CHECK(result.output.shape() == mha::Shape{sizes.batch, sizes.length, embed});
        if (need_weights) {
          CHECK(result.attn_weights.shape() == mha::Shape{sizes.batch, sizes.length, sizes.keys});
        }
        for (Index i = 0; i < result.output.size(); ++i) {
          REQUIRE(result.output.data()[i] == bias.data()[i % embed]);
        }
      }
    }
  }
}

namespace {

// Bit-for-bit equality of rows [first, last) of dimension 1 in batch element n of two [B, L, E]
// tensors.
bool same_rows(const Tensor<float>& a, const Tensor<float>& b, Index n, Index first, Index last) {
  const Index length = a.dim(1), embed = a.dim(2);
  for (Index i = first; i < last; ++i) {
    for (Index f = 0; f < embed; ++f) {
      const Index at = (n * length + i) * embed + f;
      if (!(a.data()[at] == b.data()[at])) return false;
    }
  }
  return true;
}

bool row_finite(const Tensor<float>& a, Index n, Index i) {
  const Index length = a.dim(1), embed = a.dim(2);
  for (Index f = 0; f < embed; ++f) {
    if (!std::isfinite(a.data()[(n * length + i) * embed + f])) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("NaN and Inf inputs spread only within their batch element, as documented", "[edge]") {
  // ForwardOptions::check_inputs's comment: a bad query row reaches its own output row only; a bad
  // key or value row stays in its batch element, and reaches the rows that read it; other batch
  // elements are unchanged bit for bit.
  for (const Index embed : kEmbedsBothFlashPaths) {
    const Index batch = 3, length = 16, keys = 9;  // 16 queries: the small-head kernel's least
    const Index bad_batch = 1, bad_query_row = 2, bad_key_row = 4;
    MultiHeadAttention<float> layer(embed, 4);
    mha_test::randomise(layer, 51);
    const auto query = mha_test::random_tensor<float>({batch, length, embed}, 52);
    const auto key = mha_test::random_tensor<float>({batch, keys, embed}, 53);
    const auto value = mha_test::random_tensor<float>({batch, keys, embed}, 54);
    // Key bad_key_row is padding in every batch element: masking does not contain the NaN.
    Tensor<bool> padding({batch, keys});
    for (Index i = 0; i < padding.size(); ++i) padding.data()[i] = i % keys == bad_key_row;

    for (const float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      for (const Kernel kernel : kKernels) {
        for (const bool masked : {false, true}) {
          INFO(mha::kernel_name(kernel)
               << ", E " << embed << ", bad value " << bad << ", key masked " << masked);
          auto options = with_kernel(kernel);
          if (masked) options.key_padding_mask = Mask<float>::blocked_where_true(padding);
          const auto clean = layer.forward(query.view(), key.view(), value.view(), options);
          REQUIRE(mha::all_finite(clean.output));

          auto bad_query = query;
          bad_query.data()[(bad_batch * length + bad_query_row) * embed + 3] = bad;
          const auto from_query =
              layer.forward(bad_query.view(), key.view(), value.view(), options);
          CHECK_FALSE(row_finite(from_query.output, bad_batch, bad_query_row));
          CHECK(same_rows(from_query.output, clean.output, bad_batch, 0, bad_query_row));
          CHECK(same_rows(from_query.output, clean.output, bad_batch, bad_query_row + 1, length));

          auto bad_key = key;
          bad_key.data()[(bad_batch * keys + bad_key_row) * embed + 5] = bad;
          auto bad_value = value;
          bad_value.data()[(bad_batch * keys + bad_key_row) * embed + 7] = bad;
          const auto from_key = layer.forward(query.view(), bad_key.view(), value.view(), options);
          const auto from_value =
              layer.forward(query.view(), key.view(), bad_value.view(), options);
          for (const auto* spoiled : {&from_query, &from_key, &from_value}) {
            for (const Index n : {Index{0}, Index{2}}) {
              CHECK(same_rows(spoiled->output, clean.output, n, 0, length));
            }
          }
          // Every row reads value row bad_key_row here, even when key padding masks it: its tile is
          // not wholly masked, so its weight 0 multiplies the NaN.
          for (Index i = 0; i < length; ++i) {
            CHECK_FALSE(row_finite(from_value.output, bad_batch, i));
          }
          if (masked) continue;
          // A row that sees only the bad key: its scores are NaN and -inf, which must not read
          // as a fully masked row (whose output would be the finite output bias).
          auto only_bad_key = options;
          Tensor<bool> blocked({length, keys});
          for (Index i = 0; i < blocked.size(); ++i) blocked.data()[i] = i % keys != bad_key_row;
          only_bad_key.attn_mask = Mask<float>::blocked_where_true(blocked);
          const auto lone = layer.forward(query.view(), bad_key.view(), value.view(), only_bad_key);
          for (Index i = 0; i < length; ++i) CHECK_FALSE(row_finite(lone.output, bad_batch, i));
        }
      }
    }
  }
}

TEST_CASE("check_inputs refuses NaN and Inf, naming the tensor and the element", "[edge]") {
  const Index embed = 8, batch = 2, length = 3, keys = 4;
  MultiHeadAttention<float> layer(embed, 2);
  const auto query = mha_test::random_tensor<float>({batch, length, embed}, 61);
  const auto key = mha_test::random_tensor<float>({batch, keys, embed}, 62);
  const auto value = mha_test::random_tensor<float>({batch, keys, embed}, 63);
  mha::ForwardOptions<float> options;
  options.check_inputs = true;
  const auto message = [&](const Tensor<float>& q, const Tensor<float>& k, const Tensor<float>& v) {
    return mha_test::message_of<mha::NonFiniteError>(
        [&] { layer.forward(q.view(), k.view(), v.view(), options); });
  };
  CHECK(message(query, key, value) == "(nothing thrown)");

  auto bad = query;
  bad.data()[(1 * length + 2) * embed + 5] = std::numeric_limits<float>::quiet_NaN();
  CHECK(message(bad, key, value) == "query: non-finite value nan at [1, 2, 5] (1 of 48 elements)");
  bad = key;
  bad.data()[3] = std::numeric_limits<float>::infinity();
  CHECK(message(query, bad, value) == "key: non-finite value inf at [0, 0, 3] (1 of 64 elements)");
  bad = value;
  bad.data()[value.size() - 1] = -std::numeric_limits<float>::infinity();
  CHECK(message(query, key, bad) == "value: non-finite value -inf at [1, 3, 7] (1 of 64 elements)");

  // Additive masks may block with -inf; NaN and +inf are refused.
  auto mask = mha_test::random_tensor<float>({length, keys}, 64);
  mask.data()[1] = -std::numeric_limits<float>::infinity();
  options.attn_mask = Mask<float>::additive(mask);
  CHECK(message(query, key, value) == "(nothing thrown)");
  mask.data()[6] = std::numeric_limits<float>::infinity();
  options.attn_mask = Mask<float>::additive(mask);
  CHECK(message(query, key, value) ==
        "attn_mask: expected finite values or -inf, got inf at [1, 2] (1 of 12 elements)");
  options.attn_mask = {};
  auto padding = Tensor<float>({batch, keys});
  padding.data()[2] = std::numeric_limits<float>::quiet_NaN();
  options.key_padding_mask = Mask<float>::additive(padding);
  CHECK(message(query, key, value) ==
        "key_padding_mask: expected finite values or -inf, got nan at [0, 2] (1 of 8 elements)");

  // Off (the default), nothing is checked: the NaN reaches the output.
  options = {};
  bad = query;
  bad.data()[0] = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(mha::all_finite(layer.forward(bad.view(), key.view(), value.view(), options).output));

  // decode checks its x before the cache changes.
  auto cache = layer.make_kv_cache(1, 8);
  auto step_options = MultiHeadAttention<float>::decode_options();
  step_options.check_inputs = true;
  Tensor<float> x({1, 2, embed});
  x.data()[9] = std::numeric_limits<float>::quiet_NaN();
  CHECK(mha_test::message_of<mha::NonFiniteError>([&] {
          layer.decode(x.view(), cache, step_options);
        }) == "x: non-finite value nan at [0, 1, 1] (1 of 16 elements)");
  CHECK(cache.length(0) == 0);

  // The 16-bit layers check their own inputs.
  MultiHeadAttention<Eigen::half> half_layer(embed, 2);
  mha::ForwardOptions<Eigen::half> half_options;
  half_options.check_inputs = true;
  auto half_query = mha::tensor_cast<Eigen::half>(query);
  half_query.data()[4] = Eigen::half(std::numeric_limits<float>::infinity());
  CHECK(mha_test::message_of<mha::NonFiniteError>([&] {
          half_layer.forward(half_query.view(), half_options);
        }) == "query: non-finite value inf at [0, 0, 4] (1 of 48 elements)");
}

TEST_CASE("a forward that throws leaves the layer and its workspace usable", "[edge]") {
  const Index embed = 16, batch = 2, length = 5;
  MultiHeadAttention<float> layer(embed, 4);
  mha_test::randomise(layer, 71);
  const auto state = layer.state_dict();
  const auto x = mha_test::random_tensor<float>({batch, length, embed}, 72);
  for (const Kernel kernel : kKernels) {
    INFO(mha::kernel_name(kernel));
    const auto options = with_kernel(kernel);
    mha::Workspace<float> workspace;
    mha::ForwardResult<float> result;
    layer.forward(x.view(), x.view(), x.view(), options, workspace, result);
    const Tensor<float> before = result.output;

    auto bad_mask = options;
    bad_mask.attn_mask = Mask<float>::additive(Tensor<float>({length, length + 1}));
    CHECK_THROWS_AS(layer.forward(x.view(), x.view(), x.view(), bad_mask, workspace, result),
                    mha::ShapeError);
    auto checked = options;
    checked.check_inputs = true;
    auto bad_x = x;
    bad_x.data()[7] = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS_AS(
        layer.forward(bad_x.view(), bad_x.view(), bad_x.view(), checked, workspace, result),
        mha::NonFiniteError);
    const auto other = mha_test::random_tensor<float>({1, 3, embed}, 73);
    CHECK_THROWS_AS(layer.forward(x.view(), other.view(), other.view(), options, workspace, result),
                    mha::ShapeError);

    layer.forward(x.view(), x.view(), x.view(), options, workspace, result);
    CHECK(result.output.shape() == before.shape());
    CHECK(mha_test::compare(result.output, before, 0.0, 0.0).ok);
  }
  for (const auto& entry : layer.state_dict()) {
    CHECK(mha_test::compare(entry.second, state.at(entry.first), 0.0, 0.0).ok);
  }

  // load_state_dict checks everything before it changes anything.
  auto wrong = state;
  wrong["out_proj.bias"] = Tensor<float>({embed + 1});
  wrong["in_proj_weight"] = mha_test::random_tensor<float>({3 * embed, embed}, 74);
  CHECK_THROWS_AS(layer.load_state_dict(wrong), mha::ShapeError);
  for (const auto& entry : layer.state_dict()) {
    CHECK(mha_test::compare(entry.second, state.at(entry.first), 0.0, 0.0).ok);
  }

  // A forward_train that throws leaves `saved` refusing backward, and the layer trainable.
  mha::SavedForward<float> saved;
  auto train_options = with_kernel(Kernel::automatic);
  layer.forward_train(x.view(), train_options, saved);
  train_options.attn_mask = Mask<float>::additive(Tensor<float>({length, length + 1}));
  CHECK_THROWS_AS(layer.forward_train(x.view(), train_options, saved), mha::ShapeError);
  CHECK_FALSE(saved.filled());
  const Tensor<float> grad_output = mha_test::random_tensor<float>({batch, length, embed}, 75);
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { layer.backward(saved, grad_output.view()); }),
      "holds no successful forward_train"));
  train_options.attn_mask = {};
  layer.forward_train(x.view(), train_options, saved);
  const auto gradients = layer.backward(saved, grad_output.view());
  CHECK(mha::all_finite(gradients.query));
}

TEST_CASE("a decode step that throws leaves every cached sequence as it was", "[edge]") {
  // Two sequences of 2 and 8 cached tokens; a block layout [1, 1] of 4-token blocks covers the
  // first sequence's next step (3 keys) but not the second's (9 keys). The step must throw before
  // the first sequence advances.
  const Index embed = 8;
  MultiHeadAttention<float> layer(embed, 2);
  mha_test::randomise(layer, 81);
  auto cache = layer.make_kv_cache(2, 16);
  const auto prompt = mha_test::random_tensor<float>({2, 8, embed}, 82);
  layer.decode(prompt.view(), cache, MultiHeadAttention<float>::decode_options(), {2, 8});
  const auto kept = cache;

  const auto step = mha_test::random_tensor<float>({2, 1, embed}, 83);
  auto options = MultiHeadAttention<float>::decode_options();
  options.pattern.block_size = 4;
  options.pattern.block_layout = Tensor<bool>({1, 1});
  options.pattern.block_layout.data()[0] = true;
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { layer.decode(step.view(), cache, options); }),
      "pattern.block_layout"));
  CHECK(cache.length(0) == 2);
  CHECK(cache.length(1) == 8);

  auto fresh = kept;
  const auto expected = layer.decode(step.view(), fresh);
  const auto actual = layer.decode(step.view(), cache);
  CHECK(mha_test::compare(actual.output, expected.output, 0.0, 0.0).ok);
}

TEST_CASE("long sequences through the flash kernel keep float accuracy", "[edge]") {
  // 32768 keys are 128 key blocks of online softmax, each rescaling the running sums; scaled
  // keys make the scores spread (|score| up to ~30), so the running max moves often.
  const Index keys = 32768, length = 48;
  for (const Index embed : kEmbedsBothFlashPaths) {
    const mha::MultiHeadAttentionConfig config(embed, 4);
    MultiHeadAttention<float> layer(config);
    mha_test::randomise(layer, 91);
    const auto exact_layer = converted<double>(layer, config);
    const auto query = mha_test::random_tensor<float>({1, length, embed}, 92);
    const auto key = mha_test::random_tensor<float>({1, keys, embed}, 93, 3.0);
    const auto value = mha_test::random_tensor<float>({1, keys, embed}, 94);
    for (const bool causal : {false, true}) {
      INFO("causal (bottom-right) " << causal << ", E " << embed);
      auto options = with_kernel(Kernel::flash);
      options.is_causal = causal;
      options.causal_alignment = mha::Alignment::bottom_right;
      mha::ForwardOptions<double> exact_options;
      exact_options.need_weights = false;
      exact_options.kernel = Kernel::reference;
      exact_options.is_causal = causal;
      exact_options.causal_alignment = mha::Alignment::bottom_right;
      const auto exact = exact_layer.forward(mha::tensor_cast<double>(query).view(),
                                             mha::tensor_cast<double>(key).view(),
                                             mha::tensor_cast<double>(value).view(), exact_options);
      const auto result = layer.forward(query.view(), key.view(), value.view(), options);
      const auto comparison = close_to_scale(result.output, exact.output, 1e-5);
      INFO(comparison.message);
      CHECK(comparison.ok);
    }
  }

  // Causal self-attention over 8192 tokens with all scores equal: row i is the mean of the first
  // i + 1 projected values (before out_proj), a float sum over up to 8192 terms.
  const Index long_length = 8192, width = 8;
  MultiHeadAttention<float> uniform(width, 2);
  mha_test::randomise(uniform, 95);
  auto weight = uniform.parameter("in_proj_weight");
  auto bias = uniform.parameter("in_proj_bias");
  for (Index i = 0; i < width * width; ++i) weight.data()[i] = 0;  // W_q = 0, b_q = 0
  for (Index i = 0; i < width; ++i) bias.data()[i] = 0;
  const auto x = mha_test::random_tensor<float>({1, long_length, width}, 96);
  auto options = with_kernel(Kernel::flash);
  options.is_causal = true;
  const auto result = uniform.forward(x.view(), options);

  const auto w = uniform.parameter("in_proj_weight");
  const auto b = uniform.parameter("in_proj_bias");
  const auto w_out = uniform.parameter("out_proj.weight");
  const auto b_out = uniform.parameter("out_proj.bias");
  Tensor<double> expected({1, long_length, width});
  std::vector<double> running(static_cast<std::size_t>(width), 0.0);
  for (Index i = 0; i < long_length; ++i) {
    for (Index f = 0; f < width; ++f) {
      double projected = b.data()[2 * width + f];
      for (Index g = 0; g < width; ++g) {
        projected += static_cast<double>(w.data()[(2 * width + f) * width + g]) *
                     static_cast<double>(x.data()[i * width + g]);
      }
      running[static_cast<std::size_t>(f)] += projected;
    }
    for (Index f = 0; f < width; ++f) {
      double out = b_out.data()[f];
      for (Index g = 0; g < width; ++g) {
        out += static_cast<double>(w_out.data()[f * width + g]) *
               running[static_cast<std::size_t>(g)] / static_cast<double>(i + 1);
      }
      expected.data()[i * width + f] = out;
    }
  }
  const auto comparison = close_to_scale(result.output, expected, 1e-5);
  INFO(comparison.message);
  CHECK(comparison.ok);
}

TEST_CASE("empty sequences train: backward gives gradients of the inputs' shapes", "[edge]") {
  // With S = 0 only the output bias reaches the output, so its gradient is the sum of
  // grad_output and every other gradient is 0; with L = 0 or B = 0 all are 0.
  const Index embed = 8;
  struct Sizes {
    Index batch, length, keys;
  };
  for (const Sizes sizes : {Sizes{2, 0, 3}, Sizes{2, 3, 0}, Sizes{0, 3, 3}}) {
    for (const Kernel kernel : kKernels) {
      INFO("B " << sizes.batch << " L " << sizes.length << " S " << sizes.keys << " "
                << mha::kernel_name(kernel));
      MultiHeadAttention<double> layer(embed, 2);
      mha_test::randomise(layer, 101);
      const auto query = mha_test::random_tensor<double>({sizes.batch, sizes.length, embed}, 102);
      const auto key = mha_test::random_tensor<double>({sizes.batch, sizes.keys, embed}, 103);
      mha::ForwardOptions<double> options;
      options.need_weights = false;
      options.kernel = kernel;
      mha::SavedForward<double> saved;
      layer.forward_train(query.view(), key.view(), key.view(), options, saved);
      const auto grad_output =
          mha_test::random_tensor<double>({sizes.batch, sizes.length, embed}, 104);
      const auto gradients = layer.backward(saved, grad_output.view());
      CHECK(gradients.query.shape() == query.shape());
      CHECK(gradients.key.shape() == key.shape());
      CHECK(gradients.value.shape() == key.shape());
      for (const auto* gradient : {&gradients.query, &gradients.key, &gradients.value}) {
        for (Index i = 0; i < gradient->size(); ++i) REQUIRE(gradient->data()[i] == 0.0);
      }
      for (const auto& name : layer.parameter_names()) {
        const auto gradient = layer.gradient(name);
        for (Index i = 0; i < gradient.size(); ++i) {
          double expected = 0.0;
          if (name == "out_proj.bias") {
            for (Index r = 0; r < sizes.batch * sizes.length; ++r) {
              expected += grad_output.data()[r * embed + i];
            }
          }
          INFO(name << " element " << i);
          REQUIRE(gradient.data()[i] == Approx(expected).margin(1e-12));
        }
      }
    }
  }
}

TEST_CASE("sizes no layer can have are refused before anything is allocated", "[edge]") {
  // From the fuzzers: an empty out_proj.weight [E, 0] let a file of a few hundred bytes ask for
  // any E, which the layer allocated ([3E, E]) before load_state_dict compared shapes.
  std::map<std::string, Tensor<float>> state;
  state["out_proj.weight"] = Tensor<float>({Index{1} << 20, 0});
  state["in_proj_weight"] = Tensor<float>({6, 2});
  CHECK(mha_test::message_of<mha::ShapeError>([&] {
          MultiHeadAttention<float>::from_state_dict(state, 1);
        }) == "out_proj.weight: expected a tensor with at least one element, got [1048576, 0]");
  // A shape whose element count overflows Index.
  CHECK(mha_test::contains(mha_test::message_of<mha::ShapeError>([&] {
                             Tensor<float>({Index{1} << 40, Index{1} << 40});
                           }),
                           "tensor shape [1099511627776, 1099511627776] has more elements than"));
}
