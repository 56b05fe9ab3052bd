// An outside program using mha: built against mha::mha (header-only) by tests/consumer
// (find_package) and, as consumer_compiled with MHA_CONSUMER_COMPILED defined, against
// mha::compiled by it and by tests/consumer/subproject (add_subdirectory, FetchContent).
#include <mha/mha.hpp>

#include <cmath>
#include <cstdio>

#ifndef MHA_VERSION_STRING
#error "MHA_VERSION_STRING is not defined by <mha/mha.hpp>"
#endif
// Each target carries its mode: mha::compiled defines MHA_COMPILED, mha::mha does not.
#if defined(MHA_CONSUMER_COMPILED) && !defined(MHA_COMPILED)
#error "linked to mha::compiled, but MHA_COMPILED is not defined"
#endif
#if !defined(MHA_CONSUMER_COMPILED) && defined(MHA_COMPILED)
#error "linked to mha::mha (header-only), but MHA_COMPILED is defined"
#endif
#ifdef MHA_COMPILED
#define MHA_CONSUMER_MODE "compiled"
#else
#define MHA_CONSUMER_MODE "header-only"
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
  std::printf("consumer: OK (mha %s, %s)\n", MHA_VERSION_STRING, MHA_CONSUMER_MODE);
  return 0;
}
