// scaled_dot_product_attention against a direct double-precision evaluation of its definition,
// and the mask conventions: three kinds, two causal alignments, fully masked rows.
#include <limits>
#include <vector>

#include "helpers.hpp"

using mha::Causal;
using mha::Index;
using mha::Mask;
using mha::Tensor;

namespace {

// softmax(scale * q kᵀ + bias) v for one head, straight from the definition, in double.
// bias[i][j] is 0 (visible), a float, or -inf (blocked); a row with no visible key gives 0.
template <class T>
Tensor<double> naive_head(const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, double scale,
                          const std::vector<std::vector<double>>& bias, Tensor<double>* weights) {
  const Index L = q.dim(0), S = k.dim(0), D = q.dim(1), Dv = v.dim(1);
  Tensor<double> out({L, Dv});
  if (weights) *weights = Tensor<double>({L, S});
  for (Index i = 0; i < L; ++i) {
    std::vector<double> s(static_cast<std::size_t>(S));
    double max = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < S; ++j) {
      double dot = 0;
      for (Index d = 0; d < D; ++d) dot += double(q(i, d)) * double(k(j, d));
      s[std::size_t(j)] = scale * dot + bias[std::size_t(i)][std::size_t(j)];
      max = std::max(max, s[std::size_t(j)]);
    }
    if (max == -std::numeric_limits<double>::infinity()) continue;
    double sum = 0;
    for (auto& x : s) sum += (x = std::exp(x - max));
    for (Index j = 0; j < S; ++j) {
      const double p = s[std::size_t(j)] / sum;
      if (weights) (*weights)(i, j) = p;
      for (Index d = 0; d < Dv; ++d) out(i, d) += p * double(v(j, d));
    }
  }
  return out;
}

std::vector<std::vector<double>> zeros(Index L, Index S) {
  return std::vector<std::vector<double>>(std::size_t(L), std::vector<double>(std::size_t(S), 0.0));
}

template <class T>
Tensor<T> slice2(const Tensor<T>& x, Index b, Index h) {
  return Tensor<T>(x[b][h]);
}

}  // namespace

TEMPLATE_TEST_CASE("sdpa equals the definition, per head, with a per-head additive mask",
                   "[attention]", float, double) {
  const Index B = 2, H = 3, L = 4, S = 6, D = 5, Dv = 3;
  const auto q = mha_test::random_tensor<TestType>({B, H, L, D}, 1);
  const auto k = mha_test::random_tensor<TestType>({B, H, S, D}, 2);
  const auto v = mha_test::random_tensor<TestType>({B, H, S, Dv}, 3);
  const auto m = mha_test::random_tensor<TestType>({B, H, L, S}, 4);
  mha::AttentionOptions<TestType> options;
  options.mask = Mask<TestType>::additive(m);
  options.need_weights = true;
  const auto result = mha::scaled_dot_product_attention(q, k, v, options);
  REQUIRE(result.output.shape() == mha::Shape{B, H, L, Dv});
  REQUIRE(result.weights.shape() == mha::Shape{B, H, L, S});
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < H; ++h) {
      auto bias = zeros(L, S);
      for (Index i = 0; i < L; ++i)
        for (Index j = 0; j < S; ++j) bias[size_t(i)][size_t(j)] = double(m(b, h, i, j));
      Tensor<double> weights;
      const auto expected = naive_head(slice2(q, b, h), slice2(k, b, h), slice2(v, b, h),
                                       1.0 / std::sqrt(double(D)), bias, &weights);
      CHECK_TENSORS_CLOSE(Tensor<TestType>(result.output[b][h]), expected);
      CHECK_TENSORS_CLOSE(Tensor<TestType>(result.weights[b][h]), weights);
    }
  }
}

TEMPLATE_TEST_CASE("the three mask kinds agree when they say the same thing", "[attention][mask]",
                   float, double) {
  const Index L = 5, S = 7;
  const auto q = mha_test::random_tensor<TestType>({2, L, 4}, 7);
  const auto k = mha_test::random_tensor<TestType>({2, S, 4}, 8);
  const auto v = mha_test::random_tensor<TestType>({2, S, 4}, 9);
  Tensor<bool> blocked({L, S}), allowed({L, S});
  Tensor<TestType> additive({L, S});
  mha::Random random(10);
  for (Index i = 0; i < L; ++i) {
    for (Index j = 0; j < S; ++j) {
      const bool block = j != i && random.uniform() < 0.5;  // never a fully blocked row
      blocked(i, j) = block;
      allowed(i, j) = !block;
      additive(i, j) = block ? -std::numeric_limits<TestType>::infinity() : TestType(0);
    }
  }
  mha::AttentionOptions<TestType> options;
  options.need_weights = true;
  options.mask = Mask<TestType>::blocked_where_true(blocked);
  const auto by_blocked = mha::scaled_dot_product_attention(q, k, v, options);
  options.mask = Mask<TestType>::allowed_where_true(allowed);
  const auto by_allowed = mha::scaled_dot_product_attention(q, k, v, options);
  options.mask = Mask<TestType>::additive(additive);
  const auto by_additive = mha::scaled_dot_product_attention(q, k, v, options);
  CHECK(by_blocked.output.flat() == by_allowed.output.flat());
  CHECK(by_blocked.output.flat() == by_additive.output.flat());
  CHECK(by_blocked.weights.flat() == by_additive.weights.flat());
  for (Index h = 0; h < 2; ++h)
    for (Index i = 0; i < L; ++i)
      for (Index j = 0; j < S; ++j)
        if (blocked(i, j)) CHECK(by_blocked.weights(h, i, j) == TestType(0));
}

TEMPLATE_TEST_CASE("causal alignments: top-left sees j <= i, bottom-right j <= i + S - L",
                   "[attention][causal]", float, double) {
  for (const auto& lengths : {std::pair<Index, Index>{4, 7}, {7, 4}, {5, 5}, {1, 6}}) {
    const Index L = lengths.first, S = lengths.second;
    const auto q = mha_test::random_tensor<TestType>({L, 3}, 21);
    const auto k = mha_test::random_tensor<TestType>({S, 3}, 22);
    const auto v = mha_test::random_tensor<TestType>({S, 2}, 23);
    for (const Causal causal : {Causal::top_left, Causal::bottom_right}) {
      const Index shift = causal == Causal::bottom_right ? S - L : 0;
      auto bias = zeros(L, S);
      for (Index i = 0; i < L; ++i)
        for (Index j = 0; j < S; ++j)
          if (j > i + shift) bias[size_t(i)][size_t(j)] = -std::numeric_limits<double>::infinity();
      Tensor<double> weights;
      const auto expected = naive_head(q, k, v, 1.0 / std::sqrt(3.0), bias, &weights);
      mha::AttentionOptions<TestType> options;
      options.causal = causal;
      options.need_weights = true;
      const auto result = mha::scaled_dot_product_attention(q, k, v, options);
      INFO("L = " << L << ", S = " << S << ", bottom_right = " << (causal == Causal::bottom_right));
      CHECK_TENSORS_CLOSE(result.output, expected);
      CHECK_TENSORS_CLOSE(result.weights, weights);
    }
  }
}

TEMPLATE_TEST_CASE("bottom-right causal with L > S leaves the first rows fully masked, as zeros",
                   "[attention][causal]", float, double) {
  const auto q = mha_test::random_tensor<TestType>({6, 2}, 31);
  const auto k = mha_test::random_tensor<TestType>({3, 2}, 32);
  const auto v = mha_test::random_tensor<TestType>({3, 2}, 33);
  mha::AttentionOptions<TestType> options;
  options.causal = Causal::bottom_right;
  options.need_weights = true;
  const auto result = mha::scaled_dot_product_attention(q, k, v, options);
  // Query i sees keys j <= i - 3: rows 0..2 see nothing.
  for (Index i = 0; i < 3; ++i) {
    CHECK(result.output[i].matrix().isZero());
    CHECK(result.weights[i].matrix().isZero());
  }
  CHECK(result.weights(3, 0) == TestType(1));
  CHECK(result.output.flat().allFinite());
}

TEMPLATE_TEST_CASE("scale override replaces 1/sqrt(D)", "[attention]", float, double) {
  const auto q = mha_test::random_tensor<TestType>({3, 4}, 41);
  const auto k = mha_test::random_tensor<TestType>({5, 4}, 42);
  const auto v = mha_test::random_tensor<TestType>({5, 4}, 43);
  mha::AttentionOptions<TestType> options;
  options.scale = TestType(0.3);
  const auto result = mha::scaled_dot_product_attention(q, k, v, options);
  const auto expected = naive_head(q, k, v, double(TestType(0.3)), zeros(3, 5), nullptr);
  CHECK_TENSORS_CLOSE(result.output, expected);
  CHECK(result.weights.size() == 0);
}

TEST_CASE("a mask shared by heads broadcasts like PyTorch's", "[attention][mask]") {
  const auto q = mha_test::random_tensor<double>({2, 3, 4, 2}, 51);
  const auto k = mha_test::random_tensor<double>({2, 3, 5, 2}, 52);
  const auto v = mha_test::random_tensor<double>({2, 3, 5, 2}, 53);
  const auto shared = mha_test::random_tensor<double>({4, 5}, 54);
  Tensor<double> expanded({2, 3, 4, 5});
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 3; ++h) expanded[b][h].matrix() = shared.matrix();
  mha::AttentionOptions<double> options;
  options.mask = Mask<double>::additive(shared);
  const auto a = mha::scaled_dot_product_attention(q, k, v, options);
  options.mask = Mask<double>::additive(expanded);
  const auto b = mha::scaled_dot_product_attention(q, k, v, options);
  CHECK(a.output.flat() == b.output.flat());
  Tensor<double> per_head({1, 3, 4, 5});
  for (Index h = 0; h < 3; ++h) per_head[0][h].matrix() = shared.matrix();
  options.mask = Mask<double>::additive(per_head);
  CHECK(mha::scaled_dot_product_attention(q, k, v, options).output.flat() == a.output.flat());
}

TEST_CASE("sdpa refuses inconsistent shapes, naming the argument", "[attention][errors]") {
  const Tensor<float> q({2, 4, 3}), k({2, 5, 3}), v({2, 5, 6});
  CHECK_NOTHROW(mha::scaled_dot_product_attention(q, k, v));
  CHECK_THROWS_WITH(mha::scaled_dot_product_attention(q, Tensor<float>({2, 5, 2}), v),
                    "key: expected [2, *, 3], got [2, 5, 2]");
  CHECK_THROWS_WITH(mha::scaled_dot_product_attention(q, k, Tensor<float>({2, 4, 6})),
                    "value: expected [2, 5, *], got [2, 4, 6]");
  CHECK_THROWS_AS(mha::scaled_dot_product_attention(Tensor<float>({4}), k, v), mha::ShapeError);
  CHECK_THROWS_AS(
      mha::scaled_dot_product_attention(Tensor<float>({2, 4, 0}), Tensor<float>({2, 5, 0}), v),
      mha::ShapeError);
  mha::AttentionOptions<float> options;
  options.mask = Mask<float>::blocked_where_true(Tensor<bool>({4, 4}));
  CHECK_THROWS_WITH(
      mha::scaled_dot_product_attention(q, k, v, options),
      "mask: expected [L, S], [H, L, S] or [B, H, L, S] with L = 4, S = 5, got [4, 4]");
  options.mask = Mask<float>::additive(Tensor<float>({3, 4, 5}));
  CHECK_THROWS_AS(mha::scaled_dot_product_attention(q, k, v, options), mha::ShapeError);
  options.mask = Mask<float>();
  options.scale = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(mha::scaled_dot_product_attention(q, k, v, options), mha::ShapeError);
}

TEST_CASE("alibi_slopes are the ALiBi paper's", "[attention][alibi]") {
  // Expected values printed by BLOOM's get_slopes (the reference implementation of Press et al.,
  // transformers' build_alibi_tensor uses the same rule) with python3 for n = 1, 6, 8 and 12.
  const std::vector<double> one = {0.00390625};
  const std::vector<double> six = {0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125};
  const std::vector<double> eight = {0.5,     0.25,     0.125,     0.0625,
                                     0.03125, 0.015625, 0.0078125, 0.00390625};
  const std::vector<double> twelve = {0.5,
                                      0.25,
                                      0.125,
                                      0.0625,
                                      0.03125,
                                      0.015625,
                                      0.0078125,
                                      0.00390625,
                                      0.7071067811865476,
                                      0.35355339059327384,
                                      0.17677669529663692,
                                      0.08838834764831849};
  CHECK(mha::alibi_slopes<double>(1) == one);
  CHECK(mha::alibi_slopes<double>(6) == six);
  CHECK(mha::alibi_slopes<double>(8) == eight);
  const auto slopes = mha::alibi_slopes<double>(12);
  REQUIRE(slopes.size() == twelve.size());
  for (std::size_t h = 0; h < twelve.size(); ++h)
    CHECK(slopes[h] == Approx(twelve[h]).epsilon(1e-15));
  CHECK(mha::alibi_slopes<double>(0).empty());
}
