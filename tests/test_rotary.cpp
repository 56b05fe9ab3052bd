// Rotary embeddings (mha/rotary.hpp) on their own: the defining property (scores depend on
// positions only through their difference), which features each layout pairs, partial rotation,
// the position offset, the backward as the inverse, and refusals. Through the layer they are
// checked against PyTorch (the rope_* fixtures) and finite differences (test_backward.cpp).
#include <cmath>
#include <string>

#include "helpers.hpp"

using mha::Index;
using mha::Rope;
using mha::RopeLayout;
using mha::Tensor;

namespace {

// q · k of rows i and j of two [L, D] tensors.
double row_dot(const Tensor<double>& q, Index i, const Tensor<double>& k, Index j) {
  return q.matrix().row(i).dot(k.matrix().row(j));
}

}  // namespace

TEST_CASE("rotated scores depend on positions only through their difference", "[rope]") {
  for (const auto layout : {RopeLayout::rotate_half, RopeLayout::interleaved}) {
    INFO("interleaved " << (layout == RopeLayout::interleaved));
    // Every row holds the same vector, so row i of the rotated tensor is that vector at position
    // i: q_i · k_j must then depend on i - j alone.
    Tensor<double> q({12, 8}), k({12, 8});
    const auto q_row = mha_test::random_tensor<double>({1, 8}, 1);
    const auto k_row = mha_test::random_tensor<double>({1, 8}, 2);
    for (Index i = 0; i < 12; ++i) {
      q.matrix().row(i) = q_row.matrix().row(0);
      k.matrix().row(i) = k_row.matrix().row(0);
    }
    const Rope rope{10000, layout, 0, 0};
    mha::apply_rope<double>(q.view(), rope);
    mha::apply_rope<double>(k.view(), rope);
    for (Index shift = -3; shift <= 3; ++shift) {
      const double first = row_dot(q, 5, k, 5 - shift);
      for (Index i = 3; i < 9; ++i) CHECK(std::abs(row_dot(q, i, k, i - shift) - first) < 1e-12);
    }
    // and it does depend on it (a rotation that did nothing would pass the loop above)
    CHECK(std::abs(row_dot(q, 5, k, 5) - row_dot(q, 5, k, 4)) > 1e-3);
  }
}

TEST_CASE("each layout rotates the pairs it names, by position times base^(-2k/R)", "[rope]") {
  const Index D = 6;
  const double base = 100;
  for (const auto layout : {RopeLayout::rotate_half, RopeLayout::interleaved}) {
    for (const Index rotary_dim : {Index{6}, Index{4}}) {
      INFO("interleaved " << (layout == RopeLayout::interleaved) << " R " << rotary_dim);
      const Index pairs = rotary_dim / 2;
      for (Index k = 0; k < pairs; ++k) {
        // x = e_a at position 3 (row 3, offset 0): comes out as cos on a and sin on b.
        const Index a = layout == RopeLayout::interleaved ? 2 * k : k;
        const Index b = layout == RopeLayout::interleaved ? 2 * k + 1 : k + pairs;
        Tensor<double> x({4, D});
        x.matrix().row(3)(a) = 1;
        mha::apply_rope<double>(x.view(), Rope{base, layout, rotary_dim, 0});
        const double angle =
            3 * std::pow(base, -2.0 * static_cast<double>(k) / static_cast<double>(rotary_dim));
        for (Index f = 0; f < D; ++f) {
          const double expected = f == a ? std::cos(angle) : f == b ? std::sin(angle) : 0.0;
          CHECK(std::abs(x.matrix()(3, f) - expected) < 1e-15);
        }
        // Row 0 is at position 0: unchanged whatever it holds.
        CHECK(x.matrix().row(0).isZero());
      }
      // Features from R on pass through.
      auto x = mha_test::random_tensor<double>({4, D}, 9);
      const Tensor<double> before = x;
      mha::apply_rope<double>(x.view(), Rope{base, layout, rotary_dim, 0});
      CHECK(x.matrix().rightCols(D - rotary_dim) == before.matrix().rightCols(D - rotary_dim));
      CHECK(!(x.matrix().leftCols(rotary_dim) == before.matrix().leftCols(rotary_dim)));
    }
  }
}

TEST_CASE("the position offset and first_position shift every row", "[rope]") {
  // Rows 5.. of a rotated [9, D] tensor are a [4, D] tensor rotated from position 5, given
  // either as first_position or as rope.position_offset; leading axes (B, H) rotate alike.
  const auto x = mha_test::random_tensor<double>({2, 3, 9, 8}, 4);
  Tensor<double> whole = x;
  mha::apply_rope<double>(whole.view(), Rope{});
  for (const bool by_offset : {false, true}) {
    Tensor<double> tail({2, 3, 4, 8});
    for (Index b = 0; b < 2; ++b) {
      for (Index h = 0; h < 3; ++h) {
        tail[b][h].matrix() = x[b][h].matrix().bottomRows(4);
      }
    }
    Rope rope;
    rope.position_offset = by_offset ? 5 : 0;
    mha::apply_rope<double>(tail.view(), rope, by_offset ? 0 : 5);
    for (Index b = 0; b < 2; ++b) {
      for (Index h = 0; h < 3; ++h) {
        CHECK((tail[b][h].matrix() - whole[b][h].matrix().bottomRows(4)).cwiseAbs().maxCoeff() <
              1e-15);
      }
    }
  }
}

TEMPLATE_TEST_CASE("apply_rope_backward undoes apply_rope", "[rope]", float, double) {
  using T = TestType;
  for (const auto layout : {RopeLayout::rotate_half, RopeLayout::interleaved}) {
    const auto x = mha_test::random_tensor<T>({3, 50, 16}, 7);
    Tensor<T> y = x;
    const Rope rope{500, layout, 12, 1000};
    mha::apply_rope<T>(y.view(), rope, 7);
    CHECK(!(y.matrix() == x.matrix()));
    mha::apply_rope_backward<T>(y.view(), rope, 7);
    // a rotation and its transpose: the round trip is the identity to rounding
    CHECK((y.matrix() - x.matrix()).cwiseAbs().maxCoeff() <
          (std::is_same_v<T, float> ? 1e-5 : 1e-13));
  }
}

TEST_CASE("rotary embeddings refuse what they cannot do", "[rope][errors]") {
  Tensor<double> x({4, 6});
  const auto error = [&](const Rope& rope) {
    return mha_test::message_of<mha::ShapeError>([&] { mha::apply_rope<double>(x.view(), rope); });
  };
  CHECK(mha_test::contains(error(Rope{0, RopeLayout::rotate_half, 0, 0}), "rope.base"));
  CHECK(mha_test::contains(error(Rope{-1, RopeLayout::rotate_half, 0, 0}), "rope.base"));
  CHECK(mha_test::contains(error(Rope{INFINITY, RopeLayout::rotate_half, 0, 0}), "rope.base"));
  CHECK(mha_test::contains(error(Rope{100, RopeLayout::rotate_half, 3, 0}),
                           "rope.rotary_dim: must be even and in [0, D = 6] (0 = D), got 3"));
  CHECK(mha_test::contains(error(Rope{100, RopeLayout::rotate_half, 8, 0}), "got 8"));
  Tensor<double> odd({4, 5});
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { mha::apply_rope<double>(odd.view(), Rope{}); }),
      "D = 5"));
  Tensor<double> flat({6});
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { mha::apply_rope<double>(flat.view(), Rope{}); }),
      "x: expected [..., L, D], got [6]"));

  // The layer checks before it computes anything.
  mha::MultiHeadAttention<double> layer(mha::MultiHeadAttentionConfig(12, 2));
  const auto input = mha_test::random_tensor<double>({1, 3, 12}, 1);
  mha::ForwardOptions<double> options;
  options.rope = Rope{10000, RopeLayout::rotate_half, 8, 0};
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { layer.forward(input, options); }),
      "rope.rotary_dim"));
}
