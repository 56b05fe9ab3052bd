// Uses an installed mha through find_package(mha CONFIG REQUIRED) and mha::mha.
#include <mha/mha.hpp>

#include <cmath>
#include <cstdio>

#ifndef MHA_VERSION_STRING
#error "MHA_VERSION_STRING is not defined by <mha/mha.hpp>"
#endif

int main() {
  int failures = 0;
  const auto check = [&failures](bool ok, const char* what) {
    if (!ok) {
      std::fprintf(stderr, "consumer: FAILED: %s\n", what);
      ++failures;
    }
  };

  mha::MultiHeadAttention<float> layer(8, 2);
  mha::Tensor<float> x({1, 3, 8});
  for (mha::Index i = 0; i < x.size(); ++i) {
    x.data()[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
  }

  auto result = layer.forward(x.view(), x.view(), x.view());

  check(result.output.shape() == mha::Shape{1, 3, 8}, "output shape is {1, 3, 8}");
  check(result.attn_weights.shape() == mha::Shape{1, 3, 3}, "attn_weights shape is {1, 3, 3}");
  if (result.attn_weights.shape() == mha::Shape{1, 3, 3}) {
    for (mha::Index row = 0; row < 3; ++row) {
      float sum = 0.0f;
      for (mha::Index col = 0; col < 3; ++col) sum += result.attn_weights(0, row, col);
      if (!(std::fabs(sum - 1.0f) <= 1e-5f)) {
        std::fprintf(stderr, "consumer: FAILED: attention weight row %d sums to %.9g, not 1\n",
                     static_cast<int>(row), static_cast<double>(sum));
        ++failures;
      }
    }
  }
  for (mha::Index i = 0; i < result.output.size(); ++i) {
    if (!std::isfinite(result.output.data()[i])) {
      check(false, "output is finite");
      break;
    }
  }

  if (failures != 0) return 1;
  std::printf("consumer: OK (mha %s)\n", MHA_VERSION_STRING);
  return 0;
}
