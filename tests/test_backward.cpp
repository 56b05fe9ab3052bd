// The backward pass of MultiHeadAttention<T> and of scaled_dot_product_attention: gradients
// against central finite differences in double for random small configurations of every option,
// the two kernels' backward against each other, fully masked rows, accumulation, dropout, and
// refusals. (Agreement with torch.autograd is in test_reference.cpp.)
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::Mask;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::Tensor;

namespace {

using mha_test::randomise;

// One random configuration: the layer's options, the inputs and the forward options.
struct Trial {
  MultiHeadAttentionConfig config;
  bool batched = true, self_attention = false, need_weights = false;
  Index batch = 2, query_len = 3, key_len = 4;
  mha::Kernel kernel = mha::Kernel::automatic;
  std::string description;
};

Trial random_trial(mha::Random& random, int index) {
  const auto chance = [&](double p) { return random.uniform() < p; };
  const auto pick = [&](Index low, Index high) {
    return low + static_cast<Index>(random.uniform() * static_cast<double>(high - low + 1));
  };
  Trial trial;
  const Index heads = pick(1, 3);
  trial.config = MultiHeadAttentionConfig(heads * pick(1, 3), heads);
  trial.config.bias = chance(0.7);
  trial.config.add_bias_kv = chance(0.3);
  trial.config.add_zero_attn = chance(0.3);
  trial.self_attention = chance(0.3);
  if (!trial.self_attention && chance(0.3)) {
    trial.config.kdim = pick(1, 5);
    trial.config.vdim = pick(1, 5);
  }
  // Grouped-query attention in a third of the trials: H_kv any divisor of H.
  if (chance(1.0 / 3)) {
    do {
      trial.config.num_kv_heads = pick(1, heads);
    } while (heads % trial.config.num_kv_heads != 0);
  }
  trial.config.dropout = chance(0.25) ? 0.3 : 0.0;
  trial.config.seed = static_cast<std::uint64_t>(index);
  trial.batched = chance(0.7);
  trial.batch = trial.batched ? pick(1, 2) : 1;
  trial.query_len = pick(1, 5);
  trial.key_len = trial.self_attention ? trial.query_len : pick(1, 5);
  trial.need_weights = chance(0.3);
  trial.kernel = trial.need_weights ? mha::Kernel::reference
                                    : (chance(0.5) ? mha::Kernel::flash : mha::Kernel::reference);
  // Talking heads in a fifth of the trials: pre, post or both; reference kernel or automatic.
  if (chance(0.2)) {
    trial.config.talking_heads_pre = chance(0.7);
    trial.config.talking_heads_post = !trial.config.talking_heads_pre || chance(0.5);
    if (trial.kernel == mha::Kernel::flash) trial.kernel = mha::Kernel::automatic;
  }
  trial.description =
      "trial " + std::to_string(index) + ": E " + std::to_string(trial.config.embed_dim) + " H " +
      std::to_string(heads) + " H_kv " + std::to_string(trial.config.num_kv_heads) + " bias " +
      std::to_string(trial.config.bias) + " bias_kv " + std::to_string(trial.config.add_bias_kv) +
      " zero_attn " + std::to_string(trial.config.add_zero_attn) + " kdim/vdim " +
      std::to_string(trial.config.kdim) + "/" + std::to_string(trial.config.vdim) + " self " +
      std::to_string(trial.self_attention) + " batched " + std::to_string(trial.batched) + " B " +
      std::to_string(trial.batch) + " L " + std::to_string(trial.query_len) + " S " +
      std::to_string(trial.key_len) + " dropout " + std::to_string(trial.config.dropout) +
      " kernel " + mha::kernel_name(trial.kernel) + " talking heads " +
      std::to_string(trial.config.talking_heads_pre) + "/" +
      std::to_string(trial.config.talking_heads_post);
  return trial;
}

mha::Shape batched_shape(const Trial& trial, Index rows, Index cols) {
  return trial.batched ? mha::Shape{trial.batch, rows, cols} : mha::Shape{rows, cols};
}

// Random masks of every kind and shape the layer accepts; some rows end up fully blocked.
template <class T>
void random_masks(const Trial& trial, Index heads, mha::Random& random,
                  mha::ForwardOptions<T>& options, std::string& description) {
  const Index L = trial.query_len, S = trial.key_len;
  const auto flags = [&](const mha::Shape& shape, double blocked) {
    Tensor<bool> mask(shape);
    for (Index i = 0; i < mask.size(); ++i) mask.data()[i] = random.uniform() < blocked;
    return mask;
  };
  const auto values = [&](const mha::Shape& shape, double blocked) {
    Tensor<T> mask(shape);
    for (Index i = 0; i < mask.size(); ++i) {
      mask.data()[i] = random.uniform() < blocked ? -std::numeric_limits<T>::infinity()
                                                  : static_cast<T>(random.normal());
    }
    return mask;
  };
  const double blocked = random.uniform() < 0.5 ? 0.3 : 0.7;
  const Index stacked = trial.batched ? trial.batch * heads : heads;
  const mha::Shape attn_shape =
      random.uniform() < 0.5 ? mha::Shape{L, S} : mha::Shape{stacked, L, S};
  const double attn_draw = random.uniform();
  if (attn_draw < 0.25) {
    options.attn_mask = Mask<T>::blocked_where_true(flags(attn_shape, blocked));
    description += " attn_mask blocked_where_true " + mha::to_string(attn_shape);
  } else if (attn_draw < 0.4) {
    // allowed_where_true: true keeps a key, so "blocked" is drawn for the opposite value
    Tensor<bool> allowed = flags(attn_shape, 1 - blocked);
    options.attn_mask = Mask<T>::allowed_where_true(allowed);
    description += " attn_mask allowed_where_true " + mha::to_string(attn_shape);
  } else if (attn_draw < 0.7) {
    options.attn_mask = Mask<T>::additive(values(attn_shape, blocked));
    description += " attn_mask additive " + mha::to_string(attn_shape);
  }
  const mha::Shape padding_shape = trial.batched ? mha::Shape{trial.batch, S} : mha::Shape{S};
  const double padding_draw = random.uniform();
  if (padding_draw < 0.3) {
    options.key_padding_mask = Mask<T>::blocked_where_true(flags(padding_shape, blocked / 2));
    description += " key_padding bool";
  } else if (padding_draw < 0.5) {
    options.key_padding_mask = Mask<T>::additive(values(padding_shape, blocked / 2));
    description += " key_padding float";
  }
  options.is_causal = random.uniform() < 0.3;
  options.causal_alignment =
      random.uniform() < 0.5 ? mha::Alignment::top_left : mha::Alignment::bottom_right;
  if (options.is_causal) {
    description +=
        options.causal_alignment == mha::Alignment::top_left ? " causal" : " causal bottom-right";
  }
  if (random.uniform() < 0.3) {
    options.alibi_slopes = mha::alibi_slopes<T>(heads);
    description += " alibi";
  }
  if (random.uniform() < 0.3) {
    options.softcap = T(0.5) + static_cast<T>(random.uniform()) * T(2);
    description += " softcap " + std::to_string(options.softcap);
  }
  if (random.uniform() < 0.3) {
    options.window.left = static_cast<Index>(random.uniform() * 4) - 1;
    options.window.right = static_cast<Index>(random.uniform() * 4) - 1;
    options.window.alignment = options.causal_alignment;
    options.window.dilation = 1 + static_cast<Index>(random.uniform() * 3);
    description += " window " + std::to_string(options.window.left) + "/" +
                   std::to_string(options.window.right) + " dilation " +
                   std::to_string(options.window.dilation);
  }
  if (random.uniform() < 0.3) {
    options.pattern.alignment = options.causal_alignment;
    for (Index position = 0; position < std::max(L, S); ++position) {
      if (random.uniform() < 0.2) options.pattern.global_tokens.push_back(position);
    }
    description += " global tokens " + std::to_string(options.pattern.global_tokens.size());
    // (No block layout for bottom-right queries at negative positions, which it refuses.)
    if (random.uniform() < 0.6 &&
        !(options.pattern.alignment == mha::Alignment::bottom_right && L > S)) {
      const Index block = 1 + static_cast<Index>(random.uniform() * 3);
      const Index last = options.pattern.alignment == mha::Alignment::bottom_right ? S - 1 : L - 1;
      const mha::Shape shape = {last / block + 1, (S + block - 1) / block};
      options.pattern.block_size = block;
      options.pattern.block_layout =
          flags(random.uniform() < 0.5 ? shape : mha::Shape{heads, shape[0], shape[1]}, 0.5);
      description += " block layout " + mha::to_string(options.pattern.block_layout.shape());
    }
  }
}

// ||a - b|| / ||b||, or ||a|| when b is 0 (a gradient that must vanish).
template <class T>
double relative_error(const mha::TensorView<const T>& actual,
                      const mha::TensorView<const T>& expected) {
  const double difference = (actual.matrix() - expected.matrix()).norm();
  const double scale = expected.matrix().norm();
  return scale > 0 ? difference / scale : difference;
}

// Checks every input and parameter gradient of loss = sum(output ∘ g), g random, against
// five-point central differences: within 1e-6 relative (norm). With self_attention, query is
// passed as query, key and value, and its gradient is the sum of the three.
void check_finite_differences(MultiHeadAttention<double>& layer, Tensor<double>& query,
                              Tensor<double>& key, Tensor<double>& value,
                              const mha::ForwardOptions<double>& given_options, bool self_attention,
                              std::uint64_t seed) {
  using T = double;
  mha::ForwardOptions<T> options = given_options;  // its head_gate is differenced too
  // loss = sum(output ∘ g). With dropout, forward_train draws a seed per call: reseeding
  // before each call replays the same mask, so the loss is a smooth function to difference.
  const auto g = mha_test::random_tensor<T>(query.shape(), 7 + seed);
  mha::SavedForward<T> saved;
  const auto forward = [&](auto&& input_query) {
    layer.seed_dropout(99);
    return self_attention ? layer.forward_train(input_query, options, saved)
                          : layer.forward_train(input_query, key, value, options, saved);
  };
  forward(query);
  layer.zero_grad();
  const auto grads = layer.backward(saved, g);
  REQUIRE(grads.query.flat().allFinite());
  REQUIRE(grads.key.flat().allFinite());
  REQUIRE(grads.value.flat().allFinite());
  const auto loss = [&]() { return forward(query).output.flat().dot(g.flat()); };

  // d loss / d x for each element of x by the five-point central difference
  //   (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h,
  // whose truncation error is of order h^4 = 1e-16 at h = 1e-4, and rounding error of order
  // 1e-16 / h = 1e-12 relative to the loss. (The three-point rule at h = 1e-6 leaves 1e-10 of
  // the loss, too much where masks leave a gradient 1e4 times smaller than the loss.)
  const auto numeric = [&](mha::TensorView<T> x) {
    Tensor<T> gradient(x.shape());
    const T h = 1e-4;
    const auto at = [&](Index i, T shifted) {
      const T saved_value = x.data()[i];
      x.data()[i] = shifted;
      const T result = loss();
      x.data()[i] = saved_value;
      return result;
    };
    for (Index i = 0; i < x.size(); ++i) {
      const T x0 = x.data()[i];
      gradient.data()[i] =
          (8 * (at(i, x0 + h) - at(i, x0 - h)) - (at(i, x0 + 2 * h) - at(i, x0 - 2 * h))) /
          (12 * h);
    }
    return gradient;
  };
  // 1e-6 relative, the bound.
  constexpr double kBound = 1e-6;
  if (self_attention) {
    // One tensor as query, key and value: its gradient is the sum of the three.
    Tensor<T> total(query.shape());
    total.flat() = grads.query.flat() + grads.key.flat() + grads.value.flat();
    CHECK(relative_error<T>(total.view(), numeric(query.view()).view()) < kBound);
  } else {
    CHECK(relative_error<T>(grads.query.view(), numeric(query.view()).view()) < kBound);
    CHECK(relative_error<T>(grads.key.view(), numeric(key.view()).view()) < kBound);
    CHECK(relative_error<T>(grads.value.view(), numeric(value.view()).view()) < kBound);
  }
  for (auto& parameter : layer.parameters()) {
    INFO(parameter.name);
    const Tensor<T> analytic(mha::TensorView<const T>(parameter.grad));
    CHECK(relative_error<T>(analytic.view(), numeric(parameter.value).view()) < kBound);
  }
  if (!options.head_gate.empty()) {
    INFO("head_gate");
    REQUIRE(grads.head_gate.shape() == mha::Shape{layer.num_heads()});
    const auto gate = mha::make_view(options.head_gate.data(), {layer.num_heads()});
    CHECK(relative_error<T>(grads.head_gate.view(), numeric(gate).view()) < kBound);
  } else {
    CHECK(grads.head_gate.size() == 0);
  }
}

}  // namespace

TEST_CASE("gradients equal central finite differences for every option", "[backward]") {
  using T = double;
  mha::Random random(4242);
  int talking = 0, patterns = 0;  // how many trials drew these, so that a change of draws shows
  for (int index = 0; index < 80; ++index) {
    const Trial trial = random_trial(random, index);
    talking += trial.config.talking_heads_pre || trial.config.talking_heads_post ? 1 : 0;
    const auto seed = static_cast<std::uint64_t>(index);
    MultiHeadAttention<T> layer(trial.config);
    randomise(layer, 100 + seed * 10);
    const Index E = layer.embed_dim();
    auto query = mha_test::random_tensor<T>(batched_shape(trial, trial.query_len, E), 1 + seed);
    auto key =
        mha_test::random_tensor<T>(batched_shape(trial, trial.key_len, layer.kdim()), 2 + seed);
    auto value =
        mha_test::random_tensor<T>(batched_shape(trial, trial.key_len, layer.vdim()), 3 + seed);
    mha::ForwardOptions<T> options;
    options.need_weights = trial.need_weights;
    options.kernel = trial.kernel;
    std::string description = trial.description;
    random_masks(trial, layer.num_heads(), random, options, description);
    if (layer.head_dim() >= 2 && random.uniform() < 0.3) {
      mha::Rope rope;
      rope.base = 10 + 1000 * random.uniform();
      rope.layout =
          random.uniform() < 0.5 ? mha::RopeLayout::rotate_half : mha::RopeLayout::interleaved;
      rope.rotary_dim =
          2 *
          (1 + static_cast<Index>(random.uniform() * static_cast<double>(layer.head_dim() / 2)));
      rope.position_offset = static_cast<Index>(random.uniform() * 5);
      options.rope = rope;
      description +=
          " rope " +
          std::string(rope.layout == mha::RopeLayout::interleaved ? "interleaved" : "rotate-half") +
          " R " + std::to_string(rope.rotary_dim) + " offset " +
          std::to_string(rope.position_offset);
    }
    if (random.uniform() < 0.25) {
      // gates of 0 (a removed head), 1 and fractions
      for (Index h = 0; h < layer.num_heads(); ++h) {
        const double draw = random.uniform();
        options.head_gate.push_back(draw < 0.25 ? 0.0 : draw < 0.5 ? 1.0 : 1.5 * random.uniform());
      }
      description += " head_gate";
    }
    INFO(description);
    patterns += options.pattern.active() ? 1 : 0;

    check_finite_differences(layer, query, key, value, options, trial.self_attention, seed);
  }
  CHECK(talking >= 8);
  CHECK(patterns >= 12);
}

// The random trials' heads are at most 3 wide, where both layouts rotate the one pair (0, 1):
// here D = 6, so rotate-half (0, 3), (1, 4), (2, 5) and interleaved (0, 1), (2, 3), (4, 5)
// differ, in full and partial (R = 4) rotation, through the packed self-attention path (rotated
// in the fused buffer) and the separate one, with GQA, bias_k and both alignments.
TEST_CASE("rotary embeddings' gradients equal finite differences in both layouts",
          "[backward][rope]") {
  using T = double;
  std::uint64_t seed = 500;
  for (const auto layout : {mha::RopeLayout::rotate_half, mha::RopeLayout::interleaved}) {
    for (const Index rotary_dim : {0, 4}) {
      for (const bool self_attention : {true, false}) {
        MultiHeadAttentionConfig config(12, 2);
        if (!self_attention) {
          config = MultiHeadAttentionConfig(24, 4);
          config.num_kv_heads = 2;
          config.add_bias_kv = true;
        }
        MultiHeadAttention<T> layer(config);
        randomise(layer, ++seed);
        const Index L = 4, S = self_attention ? 4 : 6;
        auto query = mha_test::random_tensor<T>({2, L, layer.embed_dim()}, ++seed);
        auto key = mha_test::random_tensor<T>({2, S, layer.kdim()}, ++seed);
        auto value = mha_test::random_tensor<T>({2, S, layer.vdim()}, ++seed);
        mha::ForwardOptions<T> options;
        options.need_weights = false;
        options.is_causal = true;
        options.causal_alignment =
            self_attention ? mha::Alignment::top_left : mha::Alignment::bottom_right;
        options.rope = mha::Rope{100, layout, rotary_dim, 3};
        INFO("layout " << (layout == mha::RopeLayout::interleaved ? "interleaved" : "rotate-half")
                       << " R " << rotary_dim << " self " << self_attention);
        check_finite_differences(layer, query, key, value, options, self_attention, seed);
      }
    }
  }
}

// A pruned layer (H·D = 12 < E = 16) trains: its gradients in the new shapes, packed and not.
TEST_CASE("a pruned layer's gradients equal finite differences", "[backward][prune]") {
  std::uint64_t seed = 700;
  for (const bool self_attention : {true, false}) {
    MultiHeadAttentionConfig config(16, 4);
    config.add_bias_kv = !self_attention;
    config.kdim = self_attention ? 0 : 5;
    MultiHeadAttention<double> layer(config);
    randomise(layer, ++seed);
    layer.prune_heads({2});
    REQUIRE(layer.inner_dim() == 12);
    auto query = mha_test::random_tensor<double>({2, 4, 16}, ++seed);
    auto key = mha_test::random_tensor<double>({2, 5, layer.kdim()}, ++seed);
    auto value = mha_test::random_tensor<double>({2, 5, layer.vdim()}, ++seed);
    if (self_attention) key = value = query;
    mha::ForwardOptions<double> options;
    options.need_weights = false;
    options.head_gate = {0.5, 1.0, 2.0};
    INFO("self " << self_attention);
    check_finite_differences(layer, query, key, value, options, self_attention, seed);
  }
}

TEMPLATE_TEST_CASE("flash and reference backward agree in the layer, across blocks",
                   "[backward][flash]", float, double) {
  using T = TestType;
  for (const bool causal : {false, true}) {
    MultiHeadAttentionConfig config(16, 4);
    config.add_bias_kv = true;
    config.add_zero_attn = causal;
    config.dropout = causal ? 0.2 : 0.0;
    MultiHeadAttention<T> layer(config);
    randomise(layer, 5);
    // L and S' span several of the backward's 64 x 128 blocks, partial ones included.
    const auto query = mha_test::random_tensor<T>({2, 150, 16}, 1);
    const auto key = mha_test::random_tensor<T>({2, 300, 16}, 2);
    const auto value = mha_test::random_tensor<T>({2, 300, 16}, 3);
    const auto g = mha_test::random_tensor<T>({2, 150, 16}, 4);
    mha::ForwardOptions<T> options;
    options.need_weights = false;
    options.is_causal = causal;
    options.key_padding_mask = Mask<T>::additive(mha_test::random_tensor<T>({2, 300}, 6));
    std::vector<mha::InputGradients<T>> inputs;
    std::vector<std::map<std::string, Tensor<T>>> parameters;
    for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
      options.kernel = kernel;
      mha::SavedForward<T> saved;
      layer.seed_dropout(11);
      layer.forward_train(query, key, value, options, saved);
      layer.zero_grad();
      inputs.push_back(layer.backward(saved, g));
      std::map<std::string, Tensor<T>> grads;
      for (const auto& name : layer.parameter_names()) grads.emplace(name, layer.gradient(name));
      parameters.push_back(std::move(grads));
    }
    INFO("causal " << causal);
    CHECK_GRADIENTS_CLOSE(inputs[1].query, inputs[0].query);
    CHECK_GRADIENTS_CLOSE(inputs[1].key, inputs[0].key);
    CHECK_GRADIENTS_CLOSE(inputs[1].value, inputs[0].value);
    for (const auto& name : layer.parameter_names()) {
      INFO(name);
      CHECK_PARAMETER_GRADIENTS_CLOSE(name, parameters[1].at(name), parameters[0].at(name),
                                      layer.embed_dim(), mha_test::GradientTolerance<T>::rtol);
    }
  }
}

TEMPLATE_TEST_CASE("sdpa backward equals finite differences and agrees across kernels",
                   "[backward][sdpa]", double) {
  using T = TestType;
  auto q = mha_test::random_tensor<T>({2, 2, 5, 3}, 1);
  auto k = mha_test::random_tensor<T>({2, 2, 7, 3}, 2);
  auto v = mha_test::random_tensor<T>({2, 2, 7, 4}, 3);
  const auto g = mha_test::random_tensor<T>({2, 2, 5, 4}, 4);
  mha::AttentionOptions<T> options;
  options.causal = mha::Causal::bottom_right;
  options.dropout = 0.25;
  options.dropout_seed = 8;
  options.mask = Mask<T>::additive(mha_test::random_tensor<T>({5, 7}, 5));
  std::vector<mha::AttentionGradients<T>> per_kernel;
  for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
    options.kernel = kernel;
    const auto result = mha::scaled_dot_product_attention(q, k, v, options);
    per_kernel.push_back(
        mha::scaled_dot_product_attention_backward<T>(q, k, v, result, g, options));
  }
  CHECK_GRADIENTS_CLOSE(per_kernel[1].query, per_kernel[0].query);
  CHECK_GRADIENTS_CLOSE(per_kernel[1].key, per_kernel[0].key);
  CHECK_GRADIENTS_CLOSE(per_kernel[1].value, per_kernel[0].value);
  const auto numeric = [&](Tensor<T>& x) {
    Tensor<T> gradient(x.shape());
    for (Index i = 0; i < x.size(); ++i) {
      const T original = x.data()[i];
      x.data()[i] = original + T(1e-6);
      const T up = mha::scaled_dot_product_attention(q, k, v, options).output.flat().dot(g.flat());
      x.data()[i] = original - T(1e-6);
      const T down =
          mha::scaled_dot_product_attention(q, k, v, options).output.flat().dot(g.flat());
      x.data()[i] = original;
      gradient.data()[i] = (up - down) / T(2e-6);
    }
    return gradient;
  };
  CHECK(relative_error<T>(per_kernel[1].query.view(), numeric(q).view()) < 1e-6);
  CHECK(relative_error<T>(per_kernel[1].key.view(), numeric(k).view()) < 1e-6);
  CHECK(relative_error<T>(per_kernel[1].value.view(), numeric(v).view()) < 1e-6);
}

TEMPLATE_TEST_CASE("fully masked rows get zero gradients, never NaN", "[backward][masks]", float,
                   double) {
  using T = TestType;
  MultiHeadAttention<T> layer(8, 2);
  randomise(layer, 3);
  const auto query = mha_test::random_tensor<T>({1, 3, 8}, 1);
  const auto key = mha_test::random_tensor<T>({1, 4, 8}, 2);
  const auto g = mha_test::random_tensor<T>({1, 3, 8}, 3);
  // Query row 1 sees no key; the others see keys 0 and 2 only.
  Tensor<bool> blocked({3, 4}, false);
  for (Index j = 0; j < 4; ++j) blocked(1, j) = true;
  blocked(0, 1) = blocked(0, 3) = blocked(2, 1) = blocked(2, 3) = true;
  for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
    mha::ForwardOptions<T> options;
    options.need_weights = false;
    options.kernel = kernel;
    options.attn_mask = Mask<T>::blocked_where_true(blocked);
    mha::SavedForward<T> saved;
    layer.forward_train(query, key, key, options, saved);
    layer.zero_grad();
    const auto grads = layer.backward(saved, g);
    INFO(mha::kernel_name(kernel));
    for (const auto& parameter : layer.parameters()) {
      INFO(parameter.name);
      CHECK(parameter.grad.matrix().allFinite());
    }
    REQUIRE(grads.query.flat().allFinite());
    REQUIRE(grads.key.flat().allFinite());
    // The fully masked row's output is the constant out_proj.bias: no gradient reaches its query.
    CHECK(grads.query[0][1].matrix().isZero(0));
    // Keys 1 and 3 are blocked for every query: they get no gradient through k or v.
    CHECK(grads.key[0][1].matrix().isZero(0));
    CHECK(grads.key[0][3].matrix().isZero(0));
  }
}

TEST_CASE("gradients accumulate until zero_grad, as in PyTorch", "[backward]") {
  MultiHeadAttention<double> layer(6, 2);
  randomise(layer, 8);
  const auto x = mha_test::random_tensor<double>({2, 3, 6}, 1);
  const auto g = mha_test::random_tensor<double>({2, 3, 6}, 2);
  mha::ForwardOptions<double> options;
  options.need_weights = false;
  mha::SavedForward<double> saved;
  // PyTorch's grad is None before any backward; here gradient() refuses.
  CHECK_THROWS_AS(MultiHeadAttention<double>(6, 2).gradient("in_proj_weight"), mha::ShapeError);
  layer.forward_train(x, options, saved);
  CHECK(layer.gradient("in_proj_weight").matrix().isZero(0));
  layer.backward(saved, g);
  const Tensor<double> once(layer.gradient("in_proj_weight"));
  CHECK_FALSE(once.matrix().isZero(0));
  layer.backward(saved, g);  // the same saved forward may be differentiated again
  const Tensor<double> twice(layer.gradient("in_proj_weight"));
  CHECK(twice.matrix().isApprox(2 * once.matrix(), 1e-14));
  layer.zero_grad();
  for (const auto& parameter : layer.parameters()) CHECK(parameter.grad.matrix().isZero(0));
  CHECK(layer.parameters().size() == layer.parameter_names().size());
}

// forward_train and backward into a kept result and kept gradients (their buffers reused, the
// training loop's form) give what the returning calls give, bit for bit, over steps whose shapes
// change and come back, self-attention (one fused projection) and cross-attention with bias_k.
TEST_CASE("training into kept results equals the returning calls", "[backward]") {
  for (const bool cross : {false, true}) {
    MultiHeadAttentionConfig config(8, 2);
    config.add_bias_kv = cross;
    if (cross) config.kdim = config.vdim = 5;
    MultiHeadAttention<double> returning(config), kept(config);
    randomise(returning, 3);
    randomise(kept, 3);
    mha::ForwardOptions<double> options;
    options.need_weights = false;
    mha::SavedForward<double> saved_returning, saved_kept;
    mha::ForwardResult<double> result;
    mha::InputGradients<double> grads;
    const Index lengths[] = {5, 9, 5};
    for (int step = 0; step < 3; ++step) {
      const Index L = lengths[step], S = L + 2;
      const auto seed = static_cast<std::uint64_t>(10 * step);
      const auto query = mha_test::random_tensor<double>({2, L, 8}, seed + 1);
      const auto key = cross ? mha_test::random_tensor<double>({2, S, 5}, seed + 2) : query;
      const auto value = cross ? mha_test::random_tensor<double>({2, S, 5}, seed + 3) : query;
      const auto g = mha_test::random_tensor<double>({2, L, 8}, seed + 4);
      INFO((cross ? "cross" : "self") << "-attention, step " << step);
      const auto expected = returning.forward_train(query, key, value, options, saved_returning);
      kept.forward_train(query, key, value, options, saved_kept, result);
      CHECK(result.output.shape() == expected.output.shape());
      CHECK(result.output.flat() == expected.output.flat());
      const auto expected_grads = returning.backward(saved_returning, g);
      kept.backward(saved_kept, g, grads);
      CHECK(grads.query.flat() == expected_grads.query.flat());
      CHECK(grads.key.flat() == expected_grads.key.flat());
      CHECK(grads.value.flat() == expected_grads.value.flat());
      for (const auto& name : kept.parameter_names()) {
        INFO(name);
        CHECK(Tensor<double>(kept.gradient(name)).flat() ==
              Tensor<double>(returning.gradient(name)).flat());
      }
    }
  }
}

TEST_CASE("backward refuses what it cannot differentiate", "[backward][errors]") {
  MultiHeadAttention<float> layer(8, 2), other(8, 2);
  const auto x = mha_test::random_tensor<float>({2, 3, 8}, 1);
  mha::ForwardOptions<float> options;
  options.need_weights = false;
  mha::SavedForward<float> saved;
  CHECK_FALSE(saved.filled());
  CHECK_THROWS_WITH(layer.backward(saved, x), "saved: holds no successful forward_train");
  layer.forward_train(x, options, saved);
  CHECK(saved.filled());
  CHECK_THROWS_WITH(other.backward(saved, x), "saved: was filled by another layer's forward_train");
  const auto wrong = mha_test::random_tensor<float>({2, 4, 8}, 2);
  CHECK_THROWS_WITH(layer.backward(saved, wrong), "grad_output: expected [2, 3, 8], got [2, 4, 8]");
  // A forward_train that throws leaves `saved` unusable rather than stale.
  const auto narrow = mha_test::random_tensor<float>({2, 3, 5}, 3);
  CHECK_THROWS_AS(layer.forward_train(x, narrow, x, options, saved), mha::ShapeError);
  CHECK_FALSE(saved.filled());
  MultiHeadAttentionConfig config(8, 2);
  config.dropout = 1.5;
  CHECK_THROWS_WITH(MultiHeadAttention<float>(config), "dropout: must be in [0, 1], got 1.500000");
  CHECK_THROWS_WITH(layer.gradient("no_such"),
                    "parameter: no parameter named 'no_such' in this layer (it has "
                    "in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias)");
}

TEMPLATE_TEST_CASE("dropout: p = 0 is evaluation, a seed replays, the mean is the expectation",
                   "[backward][dropout]", float, double) {
  using T = TestType;
  const auto x = mha_test::random_tensor<T>({1, 6, 8}, 1);
  mha::ForwardOptions<T> options;
  options.need_weights = true;
  options.average_attn_weights = false;
  mha::SavedForward<T> saved;

  MultiHeadAttention<T> plain(8, 2);
  randomise(plain, 2);
  const auto evaluation = plain.forward(x, options);
  const auto no_dropout = plain.forward_train(x, options, saved);
  CHECK(no_dropout.output.flat() == evaluation.output.flat());

  MultiHeadAttentionConfig config(8, 2);
  const double p = 0.4;
  config.dropout = p;
  MultiHeadAttention<T> layer(config);
  layer.load_state_dict(plain.state_dict());
  // Evaluation mode never drops.
  CHECK(layer.forward(x, options).output.flat() == evaluation.output.flat());
  layer.seed_dropout(5);
  const auto first = layer.forward_train(x, options, saved);
  const auto second = layer.forward_train(x, options, saved);
  layer.seed_dropout(5);
  const auto replay = layer.forward_train(x, options, saved);
  CHECK(replay.output.flat() == first.output.flat());
  CHECK(first.output.flat() != second.output.flat());

  // The returned weights are the dropped-out ones: each is 0 or the evaluation weight / (1 - p).
  Index dropped = 0;
  const T scale = static_cast<T>(1 / (1 - p));
  for (Index i = 0; i < first.attn_weights.size(); ++i) {
    const T w = first.attn_weights.data()[i];
    if (w == 0) {
      ++dropped;
    } else {
      CHECK(std::abs(w - evaluation.attn_weights.data()[i] * scale) <= 1e-6 * scale);
    }
  }
  const double n = static_cast<double>(first.attn_weights.size());
  // 72 weights: the dropped count is Binomial(72, 0.4), mean 28.8, sd 4.2; 5 sd either side.
  CHECK(std::abs(static_cast<double>(dropped) - p * n) < 5 * std::sqrt(n * p * (1 - p)));

  // Dropout is unbiased: the mean output over many draws approaches the evaluation output. Each
  // element's standard error is estimated from the same draws; allow 5 of them.
  const int draws = 4000;
  Eigen::ArrayXd sum = Eigen::ArrayXd::Zero(x.size()), squares = sum;
  options.need_weights = false;
  for (int d = 0; d < draws; ++d) {
    const auto result = layer.forward_train(x, options, saved);
    const Eigen::ArrayXd out = result.output.flat().template cast<double>().array();
    sum += out;
    squares += out * out;
  }
  const Eigen::ArrayXd mean = sum / draws;
  const Eigen::ArrayXd standard_error = ((squares / draws - mean * mean).max(0.0) / draws).sqrt();
  const Eigen::ArrayXd expected = evaluation.output.flat().template cast<double>().array();
  CHECK(((mean - expected).abs() <= 5 * standard_error + 1e-6).all());
}

#ifdef _OPENMP
#include <omp.h>

TEMPLATE_TEST_CASE("backward results do not depend on the number of threads", "[backward][threads]",
                   float, double) {
  using T = TestType;
  MultiHeadAttentionConfig config(32, 4);
  config.dropout = 0.1;
  MultiHeadAttention<T> layer(config);
  const auto x = mha_test::random_tensor<T>({3, 200, 32}, 5);
  const auto g = mha_test::random_tensor<T>({3, 200, 32}, 6);
  const int threads_before = omp_get_max_threads();
  for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
    mha::ForwardOptions<T> options;
    options.need_weights = false;
    options.is_causal = true;
    options.kernel = kernel;
    std::vector<Tensor<T>> query_grads, weight_grads;
    for (const int threads : {1, 3}) {
      omp_set_num_threads(threads);
      mha::SavedForward<T> saved;
      layer.seed_dropout(1);
      layer.forward_train(x, options, saved);
      layer.zero_grad();
      query_grads.push_back(layer.backward(saved, g).query);
      weight_grads.emplace_back(layer.gradient("in_proj_weight"));
    }
    INFO(mha::kernel_name(kernel));
    CHECK(query_grads[0].flat() == query_grads[1].flat());
    CHECK(weight_grads[0].flat() == weight_grads[1].flat());
  }
  omp_set_num_threads(threads_before);
}
#endif

TEMPLATE_TEST_CASE("sdpa with enable_gqa equals repeated key/value heads, forward and backward",
                   "[backward][sdpa][gqa]", float, double) {
  using T = TestType;
  const Index B = 2, H = 6, L = 5, S = 7, D = 3, Dv = 4;
  for (const Index kv_heads : {1, 2, 3}) {
    const Index group = H / kv_heads;
    const auto q = mha_test::random_tensor<T>({B, H, L, D}, 1);
    const auto k = mha_test::random_tensor<T>({B, kv_heads, S, D}, 2);
    const auto v = mha_test::random_tensor<T>({B, kv_heads, S, Dv}, 3);
    const auto g = mha_test::random_tensor<T>({B, H, L, Dv}, 4);
    // torch.repeat_interleave(k, group, dim=1): query head h gets key/value head h / group
    Tensor<T> k_repeated({B, H, S, D}), v_repeated({B, H, S, Dv});
    for (Index b = 0; b < B; ++b) {
      for (Index h = 0; h < H; ++h) {
        k_repeated[b][h].matrix() = k[b][h / group].matrix();
        v_repeated[b][h].matrix() = v[b][h / group].matrix();
      }
    }
    for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
      mha::AttentionOptions<T> options;
      options.kernel = kernel;
      options.causal = mha::Causal::bottom_right;
      options.dropout = 0.2;
      options.dropout_seed = 3;
      const auto full = mha::scaled_dot_product_attention(q, k_repeated, v_repeated, options);
      const auto full_grads = mha::scaled_dot_product_attention_backward<T>(
          q, k_repeated, v_repeated, full, g, options);
      options.enable_gqa = true;
      const auto grouped = mha::scaled_dot_product_attention(q, k, v, options);
      const auto grouped_grads =
          mha::scaled_dot_product_attention_backward<T>(q, k, v, grouped, g, options);
      // The repeated heads' key/value gradients summed back onto the head they copy.
      Tensor<T> key_grads({B, kv_heads, S, D}), value_grads({B, kv_heads, S, Dv});
      for (Index b = 0; b < B; ++b) {
        for (Index h = 0; h < H; ++h) {
          key_grads[b][h / group].matrix() += full_grads.key[b][h].matrix();
          value_grads[b][h / group].matrix() += full_grads.value[b][h].matrix();
        }
      }
      INFO("H_kv " << kv_heads << " " << mha::kernel_name(kernel));
      CHECK_TENSORS_CLOSE(grouped.output, full.output);
      CHECK_GRADIENTS_CLOSE(grouped_grads.query, full_grads.query);
      CHECK_GRADIENTS_CLOSE(grouped_grads.key, key_grads);
      CHECK_GRADIENTS_CLOSE(grouped_grads.value, value_grads);
    }
  }
  const auto q = mha_test::random_tensor<float>({2, 6, 5, 3}, 1);
  const auto k = mha_test::random_tensor<float>({2, 4, 7, 3}, 2);
  mha::AttentionOptions<float> options;
  CHECK_THROWS_WITH(mha::scaled_dot_product_attention(q, k, k, options),
                    "key: expected [2, 6, *, 3], got [2, 4, 7, 3]");
  options.enable_gqa = true;
  CHECK_THROWS_WITH(mha::scaled_dot_product_attention(q, k, k, options),
                    "key: expected a number of heads dividing query's 6, got [2, 4, 7, 3]");
}
