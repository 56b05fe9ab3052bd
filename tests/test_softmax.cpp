// The row softmax: normalised, shift-invariant, stable for large scores, 0 for blocked rows.
#include <limits>

#include "helpers.hpp"

using mha::Index;
using mha::Matrix;

TEMPLATE_TEST_CASE("softmax rows sum to 1 and are positive", "[softmax]", float, double) {
  const auto scores = mha_test::random_tensor<TestType>({7, 13}, 5, 3.0);
  const Matrix<TestType> p = mha::softmax_rows(scores.matrix());
  for (Index r = 0; r < p.rows(); ++r) {
    CHECK(std::abs(p.row(r).sum() - TestType(1)) <
          TestType(10) * std::numeric_limits<TestType>::epsilon());
    CHECK(p.row(r).minCoeff() > TestType(0));
  }
}

TEMPLATE_TEST_CASE("softmax does not change when a constant is added to a row", "[softmax]", float,
                   double) {
  const auto scores = mha_test::random_tensor<TestType>({4, 9}, 6);
  const Matrix<TestType> p = mha::softmax_rows(scores.matrix());
  for (const TestType shift : {TestType(-50), TestType(3), TestType(1000)}) {
    const Matrix<TestType> shifted = (scores.matrix().array() + shift).matrix();
    const Matrix<TestType> q = mha::softmax_rows(shifted);
    CHECK((p - q).cwiseAbs().maxCoeff() < TestType(100) * std::numeric_limits<TestType>::epsilon());
  }
}

TEMPLATE_TEST_CASE("softmax is stable for scores whose exp would overflow", "[softmax]", float,
                   double) {
  Matrix<TestType> scores(1, 3);
  scores << TestType(1e4), TestType(1e4) - TestType(1), TestType(-1e4);
  mha::softmax_rows_inplace(scores);
  const double e = std::exp(-1.0);
  CHECK(std::abs(static_cast<double>(scores(0, 0)) - 1.0 / (1.0 + e)) < 1e-6);
  CHECK(std::abs(static_cast<double>(scores(0, 1)) - e / (1.0 + e)) < 1e-6);
  CHECK(scores(0, 2) == TestType(0));
}

TEMPLATE_TEST_CASE("a row with every score -inf becomes zeros, not NaN", "[softmax]", float,
                   double) {
  constexpr TestType inf = std::numeric_limits<TestType>::infinity();
  Matrix<TestType> scores(2, 3);
  scores << -inf, -inf, -inf, TestType(0), -inf, TestType(0);
  mha::softmax_rows_inplace(scores);
  CHECK(scores.row(0).isZero());
  CHECK(scores(1, 0) == TestType(0.5));
  CHECK(scores(1, 1) == TestType(0));
  CHECK(scores(1, 2) == TestType(0.5));
}

TEST_CASE("softmax works on a strided view in place", "[softmax]") {
  Matrix<double> wide = Matrix<double>::Zero(2, 6);
  wide.rightCols(3).setOnes();
  mha::softmax_rows_inplace(wide.rightCols(3));
  CHECK(wide.leftCols(3).isZero());
  CHECK((wide.rightCols(3).array() - 1.0 / 3.0).abs().maxCoeff() < 1e-15);
}

TEMPLATE_TEST_CASE("softmax with some keys blocked equals the softmax over the visible ones",
                   "[softmax]", float, double) {
  constexpr TestType inf = std::numeric_limits<TestType>::infinity();
  mha::Random random(8);
  for (const Index cols : {Index(1), Index(7), Index(33), Index(300)}) {
    Matrix<TestType> scores = mha_test::random_tensor<TestType>({5, cols}, 9, 4.0).matrix();
    for (Index r = 0; r < scores.rows(); ++r)
      for (Index c = 1; c < cols; ++c)
        if (random.uniform() < 0.5) scores(r, c) = -inf;
    Matrix<TestType> p = scores;
    mha::softmax_rows_inplace(p);
    for (Index r = 0; r < scores.rows(); ++r) {
      double max = -1e300, sum = 0;
      for (Index c = 0; c < cols; ++c)
        if (scores(r, c) != -inf) max = std::max(max, double(scores(r, c)));
      for (Index c = 0; c < cols; ++c)
        if (scores(r, c) != -inf) sum += std::exp(double(scores(r, c)) - max);
      for (Index c = 0; c < cols; ++c) {
        const double expected =
            scores(r, c) == -inf ? 0.0 : std::exp(double(scores(r, c)) - max) / sum;
        if (expected == 0.0) {
          CHECK(p(r, c) == TestType(0));
        } else {
          CHECK(std::abs(double(p(r, c)) - expected) <= 1e-6 * expected + 1e-7);
        }
      }
    }
  }
}
