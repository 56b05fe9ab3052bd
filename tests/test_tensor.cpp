// Tensor, views, and splitting/merging heads.
#include <limits>
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::Tensor;

TEMPLATE_TEST_CASE("split_heads and merge_heads are exact inverses", "[heads]", float, double) {
  for (const auto& shape : {mha::Shape{2, 5, 12}, mha::Shape{1, 1, 4}, mha::Shape{3, 7, 6}}) {
    for (const Index heads : {Index(1), Index(2), shape[2]}) {
      const auto x = mha_test::random_tensor<TestType>(shape, 11);
      const auto split = mha::split_heads(x, heads);
      REQUIRE(split.shape() == mha::Shape{shape[0], heads, shape[1], shape[2] / heads});
      const auto merged = mha::merge_heads(split);
      REQUIRE(merged.shape() == x.shape());
      // Exact: both only move elements.
      CHECK(merged.flat() == x.flat());
    }
  }
}

TEMPLATE_TEST_CASE("split_heads puts feature h*D+d of head h at d", "[heads]", float, double) {
  const auto x = mha_test::random_tensor<TestType>({2, 3, 8}, 3);
  const auto split = mha::split_heads(x, 4);
  for (Index b = 0; b < 2; ++b) {
    for (Index h = 0; h < 4; ++h) {
      const auto view = mha::head_view<TestType>(x.view(), 4, b, h);
      REQUIRE(view.rows() == 3);
      REQUIRE(view.cols() == 2);
      for (Index l = 0; l < 3; ++l) {
        for (Index d = 0; d < 2; ++d) {
          CHECK(split(b, h, l, d) == x(b, l, h * 2 + d));
          CHECK(view(l, d) == x(b, l, h * 2 + d));
        }
      }
    }
  }
}

TEST_CASE("head_view writes through to the tensor", "[heads]") {
  Tensor<float> x({1, 2, 4});
  auto view = mha::head_view<float>(x.view(), 2, 0, 1);
  view.setConstant(7.0f);
  CHECK(x(0, 0, 1) == 0.0f);
  CHECK(x(0, 0, 2) == 7.0f);
  CHECK(x(0, 1, 3) == 7.0f);
}

TEST_CASE("split_heads refuses bad shapes and head counts", "[heads][errors]") {
  const Tensor<float> x({2, 3, 6});
  CHECK_THROWS_AS(mha::split_heads(x, 4), mha::ShapeError);
  CHECK_THROWS_AS(mha::split_heads(x, 0), mha::ShapeError);
  CHECK_THROWS_AS(mha::split_heads(Tensor<float>({3, 6}), 2), mha::ShapeError);
  CHECK_THROWS_AS(mha::merge_heads(x), mha::ShapeError);
  CHECK_THROWS_AS(mha::head_view<float>(x.view(), 2, 2, 0), mha::ShapeError);
  CHECK_THROWS_WITH(mha::split_heads(x, 4), "x: embed_dim 6 is not divisible by num_heads 4");
}

TEST_CASE("Tensor keeps PyTorch's row-major layout", "[tensor]") {
  Tensor<double> t({2, 3, 4});
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<double>(i);
  CHECK(t(1, 2, 3) == 23.0);
  CHECK(t(0, 1, 0) == 4.0);
  CHECK(t[1].shape() == mha::Shape{3, 4});
  CHECK(t[1](0, 0) == 12.0);
  CHECK(t.matrix().rows() == 6);
  CHECK(t.matrix().cols() == 4);
  CHECK(t.matrix()(5, 3) == 23.0);
  t.reshape({6, 4});
  CHECK(t(5, 3) == 23.0);
  CHECK_THROWS_AS(t.reshape({5, 4}), mha::ShapeError);
  CHECK_THROWS_AS(Tensor<float>({2, -1}), mha::ShapeError);
  CHECK_THROWS_WITH((Tensor<float>({2}, {1.0f, 2.0f, 3.0f})),
                    "Tensor values: expected 2 elements, got [3]");
}

TEST_CASE("empty tensors are valid", "[tensor]") {
  const Tensor<float> empty({2, 0, 4});
  CHECK(empty.size() == 0);
  CHECK(empty.matrix().rows() == 0);
  CHECK(mha::split_heads(empty, 2).shape() == mha::Shape{2, 2, 0, 2});
  CHECK(mha::merge_heads(mha::split_heads(empty, 2)).shape() == empty.shape());
}

TEST_CASE("element access checks the index count and range in every build", "[tensor][errors]") {
  Tensor<float> t({2, 3, 4});
  CHECK_NOTHROW(t(1, 2, 3));
  CHECK_THROWS_WITH(t(0, 1), "tensor index: expected an index within [2, 3, 4], got [0, 1]");
  CHECK_THROWS_AS(t(0, 0, 0, 0), mha::ShapeError);
  CHECK_THROWS_AS(t(2, 0, 0), mha::ShapeError);
  CHECK_THROWS_AS(t(0, -1, 0), mha::ShapeError);
  CHECK_THROWS_AS(t[2], mha::ShapeError);
  CHECK_THROWS_AS(t[1][1][4], mha::ShapeError);
}

// ---- Printing (mha/print.hpp): PyTorch's own str(tensor), from generate_print.py ----

namespace {

struct PrintCase {
  const char* name;
  const char* dtype;
  mha::Shape shape;
  std::vector<double> values;
  const char* expected;
};

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

const std::vector<PrintCase>& print_cases() {
  static const std::vector<PrintCase> cases = {
#include "reference/data/print_cases.inc"
  };
  return cases;
}

template <class T>
std::string printed(const PrintCase& c) {
  Tensor<T> tensor(c.shape);
  REQUIRE(static_cast<std::size_t>(tensor.size()) == c.values.size());
  for (std::size_t i = 0; i < c.values.size(); ++i) {
    tensor.data()[i] = static_cast<T>(c.values[i]);
  }
  std::ostringstream out;
  out << tensor;
  // A view prints the same as its tensor.
  std::ostringstream through_view;
  through_view << tensor.view();
  CHECK(through_view.str() == out.str());
  return out.str();
}

}  // namespace

TEST_CASE("std::cout << tensor prints what PyTorch's print(tensor) prints", "[print]") {
  REQUIRE(print_cases().size() >= 20);
  for (const PrintCase& c : print_cases()) {
    INFO("case " << c.name);
    const std::string dtype = c.dtype;
    std::string text;
    if (dtype == "float32") {
      text = printed<float>(c);
    } else if (dtype == "float64") {
      text = printed<double>(c);
    } else if (dtype == "float16") {
      text = printed<Eigen::half>(c);
    } else if (dtype == "bfloat16") {
      text = printed<Eigen::bfloat16>(c);
    } else {
      REQUIRE(dtype == "bool");
      text = printed<bool>(c);
    }
    CHECK(text == c.expected);
  }
}

// The expected string is torch.tensor([[0.5, 0.25], [0.125, 1.0]])[1] printed by torch 1.13.
TEST_CASE("printing a tensor sub-view prints its own elements", "[print]") {
  Tensor<float> x({2, 2}, {0.5f, 0.25f, 0.125f, 1.0f});
  std::ostringstream out;
  out << x[1];
  CHECK(out.str() == "tensor([0.1250, 1.0000])");
}
