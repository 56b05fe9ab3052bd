// Diagnostics: head entropy, head similarity, per-head gradient norms, uniform heads, finite
// checks. Expected values come from direct loops over the definitions, in double, or from
// std::log of the sizes involved.
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "helpers.hpp"
#include "mha/diagnostics.hpp"

using mha::Index;
using mha::Mask;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::Tensor;

namespace {

// Entropy sums a few terms per row in T; float keeps about 6 digits of it.
template <class T>
constexpr double kTol = std::is_same<T, float>::value ? 2e-5 : 1e-12;

using mha_test::contains;
using mha_test::message_of;

// weights [B, H, L, S] -> per head, the mean row entropy (or entropy / log n) over the rows with
// at least one nonzero weight, by the definition.
template <class T>
Tensor<double> reference_entropy(const Tensor<T>& w, bool normalised) {
  const Index B = w.dim(0), H = w.dim(1), L = w.dim(2), S = w.dim(3);
  Tensor<double> out({H});
  for (Index h = 0; h < H; ++h) {
    double sum = 0;
    Index rows = 0;
    for (Index b = 0; b < B; ++b) {
      for (Index l = 0; l < L; ++l) {
        double entropy = 0;
        Index n = 0;
        for (Index s = 0; s < S; ++s) {
          const double p = static_cast<double>(w(b, h, l, s));
          if (p > 0) {
            entropy -= p * std::log(p);
            ++n;
          }
        }
        if (n == 0) continue;
        ++rows;
        sum += normalised ? (n > 1 ? entropy / std::log(static_cast<double>(n)) : 0.0) : entropy;
      }
    }
    out(h) = rows > 0 ? sum / static_cast<double>(rows) : 0.0;
  }
  return out;
}

// Softmax rows of random scores (standard deviation `scale`); with masked_every = m, keys with
// (b + h + l + s) % m == 0 get weight 0, as a mask would give them.
template <class T>
Tensor<T> random_weights(Index B, Index H, Index L, Index S, std::uint64_t seed, double scale,
                         Index masked_every = 0) {
  mha::Random random(seed);
  Tensor<T> w({B, H, L, S});
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      for (Index l = 0; l < L; ++l) {
        std::vector<double> e(static_cast<std::size_t>(S));
        double total = 0;
        for (Index s = 0; s < S; ++s) {
          const bool masked = masked_every > 0 && (l + s + h + b) % masked_every == 0;
          e[size_t(s)] = masked ? 0.0 : std::exp(scale * random.normal());
          total += e[size_t(s)];
        }
        for (Index s = 0; s < S; ++s) {
          w(b, h, l, s) = static_cast<T>(total > 0 ? e[size_t(s)] / total : 0.0);
        }
      }
    }
  }
  return w;
}

template <class T>
Tensor<double> as_double(const Tensor<T>& x) {
  Tensor<double> out(x.shape());
  out.matrix() = x.matrix().template cast<double>();
  return out;
}

template <class T>
MultiHeadAttention<T> random_layer(MultiHeadAttentionConfig config, std::uint64_t seed) {
  MultiHeadAttention<T> layer(config);
  for (const auto& name : layer.parameter_names()) {
    layer.set_parameter(name,
                        mha_test::random_tensor<T>(layer.parameter(name).shape(), seed++, 0.5));
  }
  return layer;
}

// Owns values and gradients for a hand-made parameter list (map nodes do not move).
template <class T>
struct OwnedParameters {
  std::map<std::string, Tensor<T>> values, grads;
  mha::ParameterList<T> list;

  void add(const std::string& name, const mha::Shape& shape, std::uint64_t seed) {
    values[name] = mha_test::random_tensor<T>(shape, seed);
    grads[name] = mha_test::random_tensor<T>(shape, seed + 1000);
    list.push_back(mha::make_parameter(name, values[name], grads[name]));
  }
};

// Per head, the gradient norm by visiting every element and deciding which head owns it.
template <class T>
Tensor<double> reference_gradient_norms(const OwnedParameters<T>& owned, Index E, Index H) {
  const Index D = E / H;
  std::vector<double> squares(static_cast<std::size_t>(H), 0.0);
  const auto add = [&](Index head, T g) {
    squares[size_t(head)] += static_cast<double>(g) * static_cast<double>(g);
  };
  for (const auto& entry : owned.grads) {
    const std::string& name = entry.first;
    const Tensor<T>& g = entry.second;
    if (name == "in_proj_weight" || name == "q_proj_weight" || name == "k_proj_weight" ||
        name == "v_proj_weight") {
      for (Index r = 0; r < g.dim(0); ++r)
        for (Index c = 0; c < g.dim(1); ++c) add((r % E) / D, g(r, c));
    } else if (name == "in_proj_bias") {
      for (Index i = 0; i < g.dim(0); ++i) add((i % E) / D, g(i));
    } else if (name == "out_proj.weight") {
      for (Index r = 0; r < g.dim(0); ++r)
        for (Index c = 0; c < g.dim(1); ++c) add(c / D, g(r, c));
    } else if (name == "bias_k" || name == "bias_v") {
      for (Index i = 0; i < E; ++i) add(i / D, g(0, 0, i));
    }
  }
  Tensor<double> out({H});
  for (Index h = 0; h < H; ++h) out(h) = std::sqrt(squares[size_t(h)]);
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("head entropy: uniform rows give log S, one-hot rows 0", "[diagnostics]", float,
                   double) {
  using T = TestType;
  const Index B = 2, H = 3, L = 4, S = 5;
  Tensor<T> w({B, H, L, S});
  for (Index b = 0; b < B; ++b) {
    for (Index l = 0; l < L; ++l) {
      for (Index s = 0; s < S; ++s) w(b, 0, l, s) = T(1) / T(S);  // uniform over S keys
      w(b, 1, l, (l + b) % S) = T(1);                             // one-hot
      w(b, 2, l, 0) = w(b, 2, l, 3) = T(0.5);                     // uniform over 2 of S keys
    }
  }
  const Tensor<double> entropy({H}, {std::log(double(S)), 0.0, std::log(2.0)});
  const Tensor<double> normalised({H}, {1.0, 0.0, 1.0});
  CHECK_TENSORS_CLOSE_TOL(mha::head_entropy(w), entropy, kTol<T>, kTol<T>);
  CHECK_TENSORS_CLOSE_TOL(mha::head_entropy_normalised(w), normalised, kTol<T>, kTol<T>);

  // Unbatched [H, L, S] is one batch.
  CHECK_TENSORS_CLOSE_TOL(mha::head_entropy(w[1]), entropy, kTol<T>, kTol<T>);
  CHECK_TENSORS_CLOSE_TOL(mha::head_entropy_normalised(w[0]), normalised, kTol<T>, kTol<T>);
}

TEMPLATE_TEST_CASE("head entropy leaves fully masked rows out of the mean", "[diagnostics]", float,
                   double) {
  using T = TestType;
  const Index H = 2, L = 3, S = 4;
  Tensor<T> w({1, H, L, S});  // zeros: head 1 is masked everywhere
  for (Index s = 0; s < S; ++s) {
    w(0, 0, 0, s) = T(1) / T(S);  // row 0 uniform
    w(0, 0, 2, s) = T(1) / T(S);  // row 2 uniform, row 1 fully masked
  }
  // Averaging the masked row in as 0 would give 2/3 log S.
  const Tensor<double> entropy({H}, {std::log(double(S)), 0.0});
  const Tensor<double> normalised({H}, {1.0, 0.0});
  CHECK_TENSORS_CLOSE_TOL(mha::head_entropy(w), entropy, kTol<T>, kTol<T>);
  CHECK_TENSORS_CLOSE_TOL(mha::head_entropy_normalised(w), normalised, kTol<T>, kTol<T>);

  // Empty sequences: nothing to average, 0.
  CHECK_TENSORS_CLOSE(mha::head_entropy(Tensor<T>({2, H, 0, S})), Tensor<double>({H}));
  CHECK_TENSORS_CLOSE(mha::head_entropy_normalised(Tensor<T>({2, H, L, 0})), Tensor<double>({H}));
  CHECK(mha::head_entropy(Tensor<T>({2, 0, L, S})).shape() == mha::Shape{0});
}

TEMPLATE_TEST_CASE("normalised entropy divides by the log of the visible keys", "[diagnostics]",
                   float, double) {
  using T = TestType;
  const Index S = 6;
  Tensor<T> w({3, 1, S});  // unbatched [H, L, S]
  // Head 0: uniform over 3 visible keys. Head 1: one visible key. Head 2: (1/4, 3/4) on 2 keys.
  for (Index s : {1, 2, 5}) w(0, 0, s) = T(1) / T(3);
  w(1, 0, 4) = T(1);
  w(2, 0, 0) = T(0.25);
  w(2, 0, 3) = T(0.75);
  const double two_keys = -(0.25 * std::log(0.25) + 0.75 * std::log(0.75));
  CHECK_TENSORS_CLOSE_TOL(mha::head_entropy(w), Tensor<double>({3}, {std::log(3.0), 0.0, two_keys}),
                          kTol<T>, kTol<T>);
  CHECK_TENSORS_CLOSE_TOL(mha::head_entropy_normalised(w),
                          Tensor<double>({3}, {1.0, 0.0, two_keys / std::log(2.0)}), kTol<T>,
                          kTol<T>);
}

TEMPLATE_TEST_CASE("head entropy agrees with the definition on random rows", "[diagnostics]", float,
                   double) {
  using T = TestType;
  // Every third (l + s + h + b) key masked, and some whole rows.
  Tensor<T> w = random_weights<T>(3, 4, 5, 7, 11, 1.5, 3);
  for (Index s = 0; s < 7; ++s) w(1, 2, 3, s) = w(2, 0, 0, s) = T(0);
  CHECK_TENSORS_CLOSE_TOL(mha::head_entropy(w), reference_entropy(w, false), kTol<T>, kTol<T>);
  CHECK_TENSORS_CLOSE_TOL(mha::head_entropy_normalised(w), reference_entropy(w, true), kTol<T>,
                          kTol<T>);
  const auto entropy = mha::head_entropy(w);
  for (Index h = 0; h < 4; ++h) {
    CHECK(entropy(h) >= T(0));
    CHECK(static_cast<double>(entropy(h)) <= std::log(7.0) + kTol<T>);
  }
}

TEMPLATE_TEST_CASE("head similarity is the cosine between flattened head patterns", "[diagnostics]",
                   float, double) {
  using T = TestType;
  const Index B = 2, H = 4, L = 3, S = 5;
  SECTION("identical heads: 1 everywhere") {
    Tensor<T> w = random_weights<T>(B, H, L, S, 21, 1.0);
    for (Index b = 0; b < B; ++b)
      for (Index h = 1; h < H; ++h) w[b][h].matrix() = w[b][0].matrix();
    CHECK_TENSORS_CLOSE_TOL(mha::head_similarity(w), Tensor<double>({H, H}, 1.0), kTol<T>, kTol<T>);
  }
  SECTION("one-hot patterns on different keys: 0 off the diagonal") {
    Tensor<T> w({B, H, L, S});
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h)
        for (Index l = 0; l < L; ++l) w(b, h, l, (l + h) % S) = T(1);
    Tensor<double> identity({H, H});
    identity.matrix().setIdentity();
    CHECK_TENSORS_CLOSE(mha::head_similarity(w), identity);
  }
  SECTION("random patterns: symmetric, equal to a direct computation") {
    const Tensor<T> w = random_weights<T>(B, H, L, S, 22, 1.0, 4);
    const Tensor<T> similarity = mha::head_similarity(w);
    Tensor<double> expected({H, H});
    for (Index h = 0; h < H; ++h) {
      for (Index g = 0; g < H; ++g) {
        double dot = 0, hh = 0, gg = 0;
        for (Index b = 0; b < B; ++b)
          for (Index l = 0; l < L; ++l)
            for (Index s = 0; s < S; ++s) {
              const double x = double(w(b, h, l, s)), y = double(w(b, g, l, s));
              dot += x * y;
              hh += x * x;
              gg += y * y;
            }
        expected(h, g) = dot / std::sqrt(hh * gg);
      }
    }
    CHECK_TENSORS_CLOSE_TOL(similarity, expected, kTol<T>, kTol<T>);
    const bool symmetric = similarity.matrix() == similarity.matrix().transpose();
    CHECK(symmetric);
    // Unbatched [H, L, S] is one batch.
    Tensor<T> one_batch(w[1]);
    one_batch.reshape({1, H, L, S});
    CHECK_TENSORS_CLOSE_TOL(mha::head_similarity(w[1]), as_double(mha::head_similarity(one_batch)),
                            0.0, 0.0);
  }
  SECTION("a head with no weight at all: 0 with the others, 1 with itself") {
    Tensor<T> w = random_weights<T>(B, H, L, S, 23, 1.0);
    for (Index b = 0; b < B; ++b) w[b][2].matrix().setZero();
    const Tensor<T> similarity = mha::head_similarity(w);
    for (Index h = 0; h < H; ++h) {
      CHECK(similarity(h, 2) == T(h == 2 ? 1 : 0));
      CHECK(similarity(2, h) == T(h == 2 ? 1 : 0));
    }
  }
}

TEMPLATE_TEST_CASE("head gradient norms split each parameter's gradient by head",
                   "[diagnostics][gradients]", float, double) {
  using T = TestType;
  const Index E = 8, H = 4;
  SECTION("packed in_proj_weight, biases, bias_k/bias_v; other names ignored") {
    OwnedParameters<T> owned;
    owned.add("embedding.weight", {10, E}, 1);  // not attention
    owned.add("in_proj_weight", {3 * E, E}, 2);
    owned.add("in_proj_bias", {3 * E}, 3);
    owned.add("bias_k", {1, 1, E}, 4);
    owned.add("bias_v", {1, 1, E}, 5);
    owned.add("out_proj.weight", {E, E}, 6);
    owned.add("out_proj.bias", {E}, 7);  // shared by all heads
    const Tensor<T> norms = mha::head_gradient_norms(owned.list, H);
    CHECK_TENSORS_CLOSE_TOL(norms, reference_gradient_norms(owned, E, H), kTol<T>, kTol<T>);

    // Neither the values nor the ignored gradients matter.
    owned.grads["embedding.weight"].flat().setConstant(T(100));
    owned.grads["out_proj.bias"].flat().setConstant(T(100));
    owned.values["in_proj_weight"].flat().setConstant(T(100));
    CHECK_TENSORS_CLOSE(mha::head_gradient_norms(owned.list, H), as_double(norms));
  }
  SECTION("separate q/k/v projections with kdim and vdim") {
    OwnedParameters<T> owned;
    owned.add("q_proj_weight", {E, E}, 10);
    owned.add("k_proj_weight", {E, 5}, 11);
    owned.add("v_proj_weight", {E, 3}, 12);
    owned.add("in_proj_bias", {3 * E}, 13);
    owned.add("out_proj.weight", {E, E}, 14);
    owned.add("readout", {E, 2}, 15);
    CHECK_TENSORS_CLOSE_TOL(mha::head_gradient_norms(owned.list, H),
                            reference_gradient_norms(owned, E, H), kTol<T>, kTol<T>);
    // One head: the whole gradient of the per-head parameters.
    CHECK_TENSORS_CLOSE_TOL(mha::head_gradient_norms(owned.list, 1),
                            reference_gradient_norms(owned, E, 1), kTol<T>, kTol<T>);
  }
  SECTION("the parameter names of a real layer") {
    MultiHeadAttentionConfig config(E, H);
    config.add_bias_kv = true;
    MultiHeadAttention<T> layer(config);
    OwnedParameters<T> owned;
    std::uint64_t seed = 30;
    for (const auto& name : layer.parameter_names())
      owned.add(name, layer.parameter(name).shape(), seed++);
    CHECK_TENSORS_CLOSE_TOL(mha::head_gradient_norms(owned.list, H),
                            reference_gradient_norms(owned, E, H), kTol<T>, kTol<T>);
  }
}

TEST_CASE("head gradient norms refuse lists they cannot split", "[diagnostics][gradients]") {
  using T = double;
  OwnedParameters<T> none;
  none.add("embedding.weight", {10, 8}, 1);
  none.add("out_proj.bias", {8}, 2);
  CHECK_THROWS_WITH(mha::head_gradient_norms(none.list, 2),
                    "parameters: no attention parameter among 2 (expected in_proj_weight or "
                    "q/k/v_proj_weight, in_proj_bias, out_proj.weight, bias_k, bias_v)");

  OwnedParameters<T> owned;
  owned.add("in_proj_weight", {24, 8}, 3);
  owned.add("out_proj.weight", {8, 8}, 4);
  CHECK_THROWS_WITH(mha::head_gradient_norms(owned.list, 3),
                    "num_heads: embed_dim 8 is not divisible by num_heads 3");
  CHECK_THROWS_AS(mha::head_gradient_norms(owned.list, 0), mha::ShapeError);

  OwnedParameters<T> mismatched;
  mismatched.add("in_proj_weight", {24, 8}, 5);
  mismatched.add("out_proj.weight", {6, 6}, 6);
  CHECK_THROWS_WITH(mha::head_gradient_norms(mismatched.list, 2),
                    "out_proj.weight: expected [E, E] = [8, 8] (E = 8 from in_proj_weight), got "
                    "[6, 6]");

  OwnedParameters<T> bad_first;
  bad_first.add("in_proj_bias", {7}, 7);
  CHECK_THROWS_WITH(mha::head_gradient_norms(bad_first.list, 1),
                    "in_proj_bias: expected [3E], got [7]");

  OwnedParameters<T> both;
  both.add("in_proj_weight", {24, 8}, 8);
  both.add("q_proj_weight", {8, 8}, 9);
  CHECK_THROWS_AS(mha::head_gradient_norms(both.list, 2), mha::ShapeError);

  OwnedParameters<T> twice;
  twice.add("out_proj.weight", {8, 8}, 10);
  twice.list.push_back(twice.list.back());
  CHECK_THROWS_WITH(mha::head_gradient_norms(twice.list, 2),
                    "parameters: 'out_proj.weight' appears twice: pass one layer's parameters");

  // A gradient of another shape than its value.
  Tensor<T> value({8, 8}), grad({8, 4});
  mha::ParameterList<T> odd = {{"out_proj.weight", value.view(), grad.view()}};
  CHECK_THROWS_WITH(mha::head_gradient_norms(odd, 2),
                    "gradient of out_proj.weight: expected [8, 8], got [8, 4]");
}

TEMPLATE_TEST_CASE("entropy of a real layer's heads lies in [0, log S]", "[diagnostics][mha]",
                   float, double) {
  using T = TestType;
  const Index E = 8, H = 4, B = 2, L = 5, S = 6;
  const auto layer = random_layer<T>(MultiHeadAttentionConfig(E, H), 40);
  const auto query = mha_test::random_tensor<T>({B, L, E}, 41);
  const auto key = mha_test::random_tensor<T>({B, S, E}, 42);
  mha::ForwardOptions<T> options;
  options.average_attn_weights = false;
  Tensor<bool> padding({B, S}, false);
  padding(1, 5) = padding(1, 4) = true;
  options.key_padding_mask = Mask<T>::blocked_where_true(padding);
  options.is_causal = true;  // query 0 sees one key: a row with no choice
  const auto result = layer.forward(query, key, key, options);
  REQUIRE(result.attn_weights.shape() == mha::Shape{B, H, L, S});

  const Tensor<T> entropy = mha::head_entropy(result.attn_weights);
  const Tensor<T> normalised = mha::head_entropy_normalised(result.attn_weights);
  CHECK_TENSORS_CLOSE_TOL(entropy, reference_entropy(result.attn_weights, false), kTol<T>, kTol<T>);
  CHECK_TENSORS_CLOSE_TOL(normalised, reference_entropy(result.attn_weights, true), kTol<T>,
                          kTol<T>);
  for (Index h = 0; h < H; ++h) {
    CHECK(entropy(h) >= T(0));
    CHECK(static_cast<double>(entropy(h)) <= std::log(double(S)) + kTol<T>);
    CHECK(normalised(h) >= T(0));
    CHECK(static_cast<double>(normalised(h)) <= 1.0 + kTol<T>);
  }
  CHECK(mha::all_finite(result.attn_weights));
  const Tensor<T> similarity = mha::head_similarity(result.attn_weights);
  CHECK(similarity.shape() == mha::Shape{H, H});
  CHECK(mha::all_finite(similarity));
}

TEMPLATE_TEST_CASE("zeroed q/k projections make every head uniform", "[diagnostics][mha]", float,
                   double) {
  using T = TestType;
  const Index E = 8, H = 4, B = 2, L = 3, S = 5;
  SECTION("packed in_proj_weight") {
    auto layer = random_layer<T>(MultiHeadAttentionConfig(E, H), 50);
    // W_q = W_k = 0: every key projects to the same b_k, so every score of a row is equal.
    Tensor<T> w(layer.parameter("in_proj_weight"));
    w.matrix().topRows(2 * E).setZero();
    layer.set_parameter("in_proj_weight", w);
    const auto x = mha_test::random_tensor<T>({B, S, E}, 51);
    const auto q = mha_test::random_tensor<T>({B, L, E}, 52);
    mha::ForwardOptions<T> options;
    options.average_attn_weights = false;
    Tensor<bool> padding({B, S}, false);
    padding(1, 0) = padding(1, 3) = true;  // batch 1 sees S - 2 keys
    options.key_padding_mask = Mask<T>::blocked_where_true(padding);
    const auto weights = layer.forward(q, x, x, options).attn_weights;

    const double expected_entropy = (std::log(double(S)) + std::log(double(S - 2))) / 2;
    const auto reports = mha::head_reports(weights);
    REQUIRE(reports.size() == size_t(H));
    for (Index h = 0; h < H; ++h) {
      const auto& report = reports[size_t(h)];
      CHECK(report.head == h);
      CHECK(report.uniform);
      CHECK(std::abs(double(report.normalised_entropy) - 1.0) <= kTol<T>);
      CHECK(std::abs(double(report.entropy) - expected_entropy) <= kTol<T>);
    }
    CHECK(mha::uniform_heads(weights) == std::vector<Index>{0, 1, 2, 3});
    CHECK(mha::uniform_heads(weights, 1.0 - 1e-3) == std::vector<Index>{0, 1, 2, 3});
  }
  SECTION("separate q/k/v projections (kdim != E)") {
    MultiHeadAttentionConfig config(E, H);
    config.kdim = 3;
    auto layer = random_layer<T>(config, 60);
    layer.set_parameter("q_proj_weight", Tensor<T>({E, E}));
    layer.set_parameter("k_proj_weight", Tensor<T>({E, 3}));
    const auto q = mha_test::random_tensor<T>({B, L, E}, 61);
    const auto k = mha_test::random_tensor<T>({B, S, 3}, 62);
    const auto v = mha_test::random_tensor<T>({B, S, E}, 63);
    mha::ForwardOptions<T> options;
    options.average_attn_weights = false;
    const auto weights = layer.forward(q, k, v, options).attn_weights;
    CHECK(mha::uniform_heads(weights) == std::vector<Index>{0, 1, 2, 3});
    CHECK_TENSORS_CLOSE_TOL(mha::head_entropy(weights), Tensor<double>({H}, std::log(double(S))),
                            kTol<T>, kTol<T>);
  }
}

TEMPLATE_TEST_CASE("only flat heads are flagged uniform", "[diagnostics]", float, double) {
  using T = TestType;
  const Index H = 3, L = 4, S = 6;
  // Head 0 uniform, head 1 peaked softmax rows, head 2 one-hot.
  Tensor<T> w = random_weights<T>(1, H, L, S, 70, 4.0);
  w[0][0].matrix().setConstant(T(1) / T(S));
  w[0][2].matrix().setZero();
  for (Index l = 0; l < L; ++l) w(0, 2, l, l) = T(1);
  const Tensor<double> normalised = reference_entropy(w, true);
  REQUIRE(normalised(1) < mha::kUniformAttentionThreshold);

  const auto reports = mha::head_reports(w);
  for (Index h = 0; h < H; ++h) {
    CHECK(std::abs(double(reports[size_t(h)].normalised_entropy) - normalised(h)) <= kTol<T>);
    CHECK(reports[size_t(h)].uniform == (h == 0));
  }
  CHECK(mha::uniform_heads(w) == std::vector<Index>{0});
  CHECK(mha::uniform_heads(w[0]) == std::vector<Index>{0});
  // A threshold below head 1's normalised entropy flags it as well.
  CHECK(mha::uniform_heads(w, normalised(1) / 2) == std::vector<Index>{0, 1});
  CHECK_THROWS_WITH(mha::uniform_heads(w, 0.0), "threshold: must be in (0, 1], got 0");
  CHECK_THROWS_AS(mha::head_reports(w, 1.5), mha::ShapeError);
  CHECK_THROWS_AS(mha::uniform_heads(w, std::nan("")), mha::ShapeError);
}

TEMPLATE_TEST_CASE("finite checks catch NaN and Inf and name them", "[diagnostics][finite]", float,
                   double) {
  using T = TestType;
  Tensor<T> x = mha_test::random_tensor<T>({2, 3}, 80);
  CHECK(mha::all_finite(x));
  CHECK(mha::all_finite(x.view()));
  CHECK_NOTHROW(mha::check_finite(x, "activations"));
  CHECK(mha::all_finite(Tensor<T>({0, 3})));

  x(1, 2) = std::numeric_limits<T>::quiet_NaN();
  CHECK_FALSE(mha::all_finite(x));
  CHECK_THROWS_AS(mha::check_finite(x, "activations"), mha::NonFiniteError);
  CHECK_THROWS_AS(mha::check_finite(x.view(), "activations"), std::domain_error);
  const std::string nan_message =
      message_of<std::domain_error>([&] { mha::check_finite(x, "activations"); });
  INFO(nan_message);
  CHECK(contains(nan_message, "activations: non-finite value"));
  CHECK(contains(nan_message, "nan at [1, 2] (1 of 6 elements)"));

  x(0, 1) = -std::numeric_limits<T>::infinity();
  const std::string inf_message = message_of<std::domain_error>(
      [&] { mha::check_finite(mha::TensorView<const T>(x.view()), "scores"); });
  INFO(inf_message);
  CHECK(inf_message == "scores: non-finite value -inf at [0, 1] (2 of 6 elements)");

  x(1, 2) = T(0);
  x(0, 1) = std::numeric_limits<T>::infinity();
  CHECK_FALSE(mha::all_finite(x));
  CHECK(contains(message_of<mha::NonFiniteError>([&] { mha::check_finite(x, "x"); }),
                 "inf at [0, 1]"));
}

TEMPLATE_TEST_CASE("non_finite_parameters names bad values and gradients", "[diagnostics][finite]",
                   float, double) {
  using T = TestType;
  OwnedParameters<T> owned;
  owned.add("in_proj_weight", {12, 4}, 1);
  owned.add("out_proj.weight", {4, 4}, 2);
  owned.add("embedding.weight", {5, 4}, 3);
  CHECK(mha::non_finite_parameters(owned.list).empty());

  owned.values["in_proj_weight"](3, 1) = std::numeric_limits<T>::quiet_NaN();
  owned.grads["out_proj.weight"](0, 0) = std::numeric_limits<T>::infinity();
  owned.grads["embedding.weight"](4, 3) = -std::numeric_limits<T>::infinity();
  CHECK(
      mha::non_finite_parameters(owned.list) ==
      std::vector<std::string>{"in_proj_weight", "out_proj.weight.grad", "embedding.weight.grad"});
  owned.grads["in_proj_weight"](0, 0) = std::numeric_limits<T>::quiet_NaN();
  CHECK(mha::non_finite_parameters(owned.list) ==
        std::vector<std::string>{"in_proj_weight", "in_proj_weight.grad", "out_proj.weight.grad",
                                 "embedding.weight.grad"});
  // The parameter views themselves (TensorView<T>) can be checked by name.
  CHECK_THROWS_WITH(mha::check_finite(owned.list[1].grad, "out_proj.weight.grad"),
                    "out_proj.weight.grad: non-finite value inf at [0, 0] (1 of 16 elements)");
}

TEST_CASE("diagnostics refuse weights that are not per-head [B, H, L, S]", "[diagnostics]") {
  const std::string expected =
      "weights: expected per-head attention weights [B, H, L, S] or "
      "[H, L, S], got ";
  CHECK_THROWS_WITH(mha::head_entropy(Tensor<float>({4, 5})), expected + "[4, 5]");
  CHECK_THROWS_WITH(mha::head_entropy_normalised(Tensor<double>({1, 2, 3, 4, 5})),
                    expected + "[1, 2, 3, 4, 5]");
  CHECK_THROWS_WITH(mha::head_similarity(Tensor<float>({6})), expected + "[6]");
  CHECK_THROWS_AS(mha::head_reports(Tensor<double>({2, 2})), mha::ShapeError);
  CHECK_THROWS_AS(mha::uniform_heads(Tensor<float>()), mha::ShapeError);
}

TEMPLATE_TEST_CASE("head gates scale heads: ones change nothing, a zero removes the head",
                   "[gating]", float, double) {
  using T = TestType;
  MultiHeadAttention<T> layer(MultiHeadAttentionConfig(16, 4));
  mha_test::randomise(layer, 3);
  const auto x = mha_test::random_tensor<T>({2, 5, 16}, 4);
  mha::ForwardOptions<T> options;
  options.average_attn_weights = false;
  const auto plain = layer.forward(x, options);
  options.head_gate = {T(1), T(1), T(1), T(1)};
  const auto ones = layer.forward(x, options);
  CHECK(ones.output.flat() == plain.output.flat());
  CHECK(ones.attn_weights.flat() == plain.attn_weights.flat());

  // Gate 0 on head 2 = head 2's columns of out_proj.weight zeroed; its weights come out 0, the
  // others' unchanged; a gate of 0.5 halves head 1's weights.
  options.head_gate = {T(1), T(0.5), T(0), T(1)};
  const auto gated = layer.forward(x, options);
  MultiHeadAttention<T> surgery = layer;
  Tensor<T> out_weight(layer.parameter("out_proj.weight"));
  out_weight.matrix().middleCols(8, 4).setZero();
  out_weight.matrix().middleCols(4, 4) *= T(0.5);
  surgery.set_parameter("out_proj.weight", out_weight.view());
  mha::ForwardOptions<T> no_gate;
  no_gate.average_attn_weights = false;
  CHECK_TENSORS_CLOSE(gated.output, surgery.forward(x, no_gate).output);
  for (Index b = 0; b < 2; ++b) {
    CHECK(gated.attn_weights[b][2].matrix().isZero());
    CHECK(gated.attn_weights[b][0].matrix() == plain.attn_weights[b][0].matrix());
    CHECK((gated.attn_weights[b][1].matrix() - T(0.5) * plain.attn_weights[b][1].matrix())
              .cwiseAbs()
              .maxCoeff() == T(0));
  }

  const auto message = [&](std::vector<T> gate) {
    options.head_gate = std::move(gate);
    return message_of<mha::ShapeError>([&] { layer.forward(x, options); });
  };
  CHECK(message({T(1)}) == "head_gate: expected one gate per head (4), got 1");
  CHECK(message({T(1), T(1), std::numeric_limits<T>::quiet_NaN(), T(1)}) ==
        "head_gate: gate 2 is not finite");
}

TEST_CASE("head importance ranks a head whose output is discarded last", "[gating][importance]") {
  using T = double;
  MultiHeadAttention<T> layer(MultiHeadAttentionConfig(16, 4));
  mha_test::randomise(layer, 7);
  // Head 1's output never reaches the layer's output, and head 3's only at a tenth: their gates'
  // gradients are 0 and small, whatever the data.
  Tensor<T> out_weight(layer.parameter("out_proj.weight"));
  out_weight.matrix().middleCols(4, 4).setZero();
  out_weight.matrix().middleCols(12, 4) *= T(0.1);
  layer.set_parameter("out_proj.weight", out_weight.view());
  mha::HeadImportance importance(4);
  mha::ForwardOptions<T> options;
  options.need_weights = false;
  options.head_gate.assign(4, T(1));
  mha::SavedForward<T> saved;
  for (std::uint64_t batch = 0; batch < 3; ++batch) {
    const auto x = mha_test::random_tensor<T>({2, 6, 16}, 10 + batch);
    const auto target = mha_test::random_tensor<T>({2, 6, 16}, 20 + batch);
    const auto y = layer.forward_train(x, options, saved);
    // loss = 0.5 |y - target|²: grad_output = y - target
    Tensor<T> grad_output(y.output.shape());
    grad_output.flat() = y.output.flat() - target.flat();
    importance.add(layer.backward(saved, grad_output).head_gate);
  }
  CHECK(importance.batches() == 3);
  const auto scores = importance.scores();
  double norm = 0;
  for (const double s : scores) norm += s * s;
  CHECK(std::abs(norm - 1.0) < 1e-12);
  CHECK(scores[1] == 0.0);
  CHECK(importance.least_important(2) == std::vector<Index>{1, 3});
  CHECK(scores[3] < scores[0]);
  CHECK(scores[3] < scores[2]);

  CHECK(message_of<mha::ShapeError>([&] { importance.add(Tensor<T>({3})); }) ==
        "gate_gradient: expected [4], got [3]");
  CHECK(contains(message_of<mha::ShapeError>([&] { importance.least_important(5); }),
                 "count: expected 0 .. 4, got 5"));
}
