// Mixed-precision training: a float layer's forward_train and backward with Precision::bf16 run
// its projections' products, forward and backward, in bf16 with fp32 sums
// (kernels/bf16_matrix_product.hpp for the backward's), its attention core in fp32, and keep its
// parameters, gradients and an optimiser's state in fp32. Checked here: the backward's bf16
// product against double on the same rounded operands, for both layouts of its left operand,
// and the same bits whatever the thread count; the output and every gradient of a training step
// within a stated bound of float64's; and a bf16 training run's loss falling as fp32's does.
#include <cmath>
#include <string>
#include <vector>

#include "helpers.hpp"
#include "mha/kernels/bf16_matrix_product.hpp"
#include "mha/optim.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

using mha::ForwardOptions;
using mha::Index;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::Precision;
using mha::Tensor;
using mha_test::converted;

namespace {

// x as the bf16 the products read (to nearest, ties to even; the test's values are normal).
double bf16_value(float x) {
  return static_cast<double>(mha::detail::from_bf16_bits(mha::detail::to_bf16_bits(x)));
}

}  // namespace

TEST_CASE("bf16 backward products equal double's on the rounded operands, within fp32 sums",
          "[mixed][precision]") {
  if (!mha::detail::bf16_dot_available()) {
    WARN("this CPU lacks AVX512_BF16: the bf16 products are not run");
    return;
  }
  using mha::detail::Accumulate;
  using mha::detail::Operand;
  const double u = std::ldexp(1.0, -24);
  for (const Operand lhs_op : {Operand::as_stored, Operand::transposed}) {
    for (const Index rows : {1, 6, 17, 40}) {
      for (const Index cols : {1, 16, 33, 70}) {
        // Depths across a slice of 256 pairs, odd and even.
        for (const Index depth : {1, 2, 31, 600}) {
          INFO("lhs " << (lhs_op == Operand::transposed ? "transposed" : "as stored") << ", rows "
                      << rows << ", cols " << cols << ", depth " << depth);
          const bool transposed = lhs_op == Operand::transposed;
          const Index lhs_rows = transposed ? depth : rows, lhs_cols = transposed ? rows : depth;
          // Blocks of wider matrices: strides past the blocks' widths.
          const auto lhs = mha_test::random_tensor<float>({lhs_rows, lhs_cols + 3}, 91);
          const auto rhs = mha_test::random_tensor<float>({depth, cols + 5}, 92);
          for (const Accumulate accumulate : {Accumulate::no, Accumulate::yes}) {
            const Index ld = cols + 2;
            std::vector<float> dst(static_cast<std::size_t>(rows * ld), 0.5F);
            const auto product = [&](std::vector<float>& out) {
              mha::detail::Bf16ProductScratch scratch;
              mha::detail::bf16_matrix_product(
                  mha::StridedMap<float>(out.data(), rows, cols, Eigen::OuterStride<>(ld)),
                  mha::ConstStridedMap<float>(lhs.data(), lhs_rows, lhs_cols,
                                              Eigen::OuterStride<>(lhs_cols + 3)),
                  lhs_op,
                  mha::ConstStridedMap<float>(rhs.data(), depth, cols,
                                              Eigen::OuterStride<>(cols + 5)),
                  accumulate, scratch);
            };
            product(dst);
            bool close = true, untouched = true;
            for (Index i = 0; i < rows; ++i) {
              for (Index j = 0; j < ld; ++j) {
                const double actual = dst[static_cast<std::size_t>(i * ld + j)];
                if (j >= cols) {
                  untouched = untouched && actual == 0.5;
                  continue;
                }
                double sum = accumulate == Accumulate::yes ? 0.5 : 0.0, magnitude = std::abs(sum);
                for (Index k = 0; k < depth; ++k) {
                  const float a = transposed ? lhs.data()[k * (lhs_cols + 3) + i]
                                             : lhs.data()[i * (lhs_cols + 3) + k];
                  const double term = bf16_value(a) * bf16_value(rhs.data()[k * (cols + 5) + j]);
                  sum += term;
                  magnitude += std::abs(term);
                }
                // A (depth + 1)-term fp32 sum: within γ(depth + 1) of the terms' magnitudes.
                const double terms = static_cast<double>(depth + 1);
                close = close && std::abs(actual - sum) <= terms * u / (1 - terms * u) * magnitude;
              }
            }
            CHECK(close);
            CHECK(untouched);
#ifdef _OPENMP
            const int threads_before = omp_get_max_threads();
            std::vector<float> three(dst.size(), 0.5F);
            omp_set_num_threads(3);
            product(three);
            omp_set_num_threads(threads_before);
            CHECK(three == dst);
#endif
          }
        }
      }
    }
  }
}

namespace {

struct Step {
  Tensor<double> output;
  mha::InputGradients<double> inputs;
  std::vector<std::pair<std::string, Tensor<double>>> parameters;  // gradients, by name
};

// One forward_train and backward of loss = sum(output ∘ g) on the layer, as double.
template <class T>
Step training_step(MultiHeadAttention<T> layer, const Tensor<float>& query,
                   const Tensor<float>& key, const ForwardOptions<T>& options,
                   const Tensor<float>& g) {
  mha::SavedForward<T> saved;
  const auto q = mha::tensor_cast<T>(query), k = mha::tensor_cast<T>(key);
  const auto result = layer.forward_train(q, k, k, options, saved);
  const auto grads = layer.backward(saved, mha::tensor_cast<T>(g));
  Step step{mha::tensor_cast<double>(result.output),
            {mha::tensor_cast<double>(grads.query), mha::tensor_cast<double>(grads.key),
             mha::tensor_cast<double>(grads.value), {}},
            {}};
  for (const auto& name : layer.parameter_names())
    step.parameters.emplace_back(name, mha::tensor_cast<double>(layer.gradient(name)));
  return step;
}

}  // namespace

TEST_CASE("a mixed-precision training step's output and gradients stay within their bounds",
          "[mixed][precision]") {
  const bool available = mha::detail::bf16_dot_available();
  if (!available) WARN("this CPU lacks AVX512_BF16: Precision::bf16 trains in fp32 here");
  using mha::detail::FlashPath;
  struct Case {
    const char* name;
    Index embed_dim, heads, batch, query_len, key_len;
    bool causal, cross;
    FlashPath path;  // of the flash kernel in bf16, which the training forward runs
  };
  // The bf16 panels (whose operands the backward reads rounded), the small-head kernel and the
  // tiles, both fp32.
  const Case cases[] = {
      {"self-attention, causal", 64, 4, 2, 37, 37, true, false, FlashPath::small_head},
      {"self-attention", 96, 3, 1, 70, 70, false, false, FlashPath::bf16_panels},
      {"cross-attention", 64, 2, 2, 40, 50, false, true, FlashPath::bf16_panels},
      {"cross-attention, few queries", 64, 2, 3, 9, 21, false, true, FlashPath::tiles}};
  // Against float64, relative to each result's largest magnitude: bf16 (8 significant bits)
  // within issue 18's 1e-2, 1.9-5.3e-3 measured; fp16 (11 bits, emulated) within 2e-3, its
  // operands' rounding 8 times finer, 2.2-6.6e-4 measured.
  struct Arithmetic {
    Precision precision;
    double bound;
    bool runs;  // computes in its own arithmetic here (else in fp32)
  };
  const Arithmetic arithmetics[] = {{Precision::bf16, 1e-2, available},
                                    {Precision::fp16, 2e-3, true}};
  for (const Case& c : cases) {
    INFO(c.name);
    mha::detail::CoreOptions<float> core;
    core.bf16_products = available;
    const Index head_dim = c.embed_dim / c.heads;
    const FlashPath path = mha::detail::flash_path<float>(head_dim, head_dim, c.query_len, core, {});
    if (available) CHECK(path == c.path);
    MultiHeadAttentionConfig config(c.embed_dim, c.heads);
    config.bias = true;
    MultiHeadAttention<double> wide(config);
    const MultiHeadAttention<float> layer = converted<float>(wide);
    wide = converted<double>(layer);
    const auto query = mha_test::random_tensor<float>({c.batch, c.query_len, c.embed_dim}, 93);
    const auto key =
        c.cross ? mha_test::random_tensor<float>({c.batch, c.key_len, c.embed_dim}, 94) : query;
    const auto g = mha_test::random_tensor<float>({c.batch, c.query_len, c.embed_dim}, 95);
    ForwardOptions<double> wide_options;
    wide_options.need_weights = false;
    wide_options.is_causal = c.causal;
    ForwardOptions<float> options;
    options.need_weights = false;
    options.is_causal = c.causal;
    const Step exact = training_step(wide, query, key, wide_options, g);
    const Step fp32 = training_step(layer, query, key, options, g);
    for (const Arithmetic& arithmetic : arithmetics) {
      INFO(mha::precision_name(arithmetic.precision));
      options.precision = arithmetic.precision;
      const Step reduced = training_step(layer, query, key, options, g);
      const auto check = [&](const std::string& what, const Tensor<double>& reduced_value,
                             const Tensor<double>& fp32_value, const Tensor<double>& expected) {
        INFO(what);
        const double error = mha_test::error_of_largest(reduced_value, expected);
        const double fp32_error = mha_test::error_of_largest(fp32_value, expected);
        INFO("error " << error << ", fp32 error " << fp32_error);
        CHECK(error <= arithmetic.bound);
        if (what == "grad out_proj.bias" || !arithmetic.runs) {
          // No product: the column sums of g. (Or no bf16 here: fp32's arithmetic.)
          CHECK(reduced_value.flat() == fp32_value.flat());
        } else {
          // The reduced arithmetic ran: its operands' rounding is far above fp32's.
          CHECK(error > 30 * fp32_error);
        }
      };
      check("output", reduced.output, fp32.output, exact.output);
      check("grad query", reduced.inputs.query, fp32.inputs.query, exact.inputs.query);
      check("grad key", reduced.inputs.key, fp32.inputs.key, exact.inputs.key);
      check("grad value", reduced.inputs.value, fp32.inputs.value, exact.inputs.value);
      for (std::size_t i = 0; i < exact.parameters.size(); ++i) {
        check("grad " + exact.parameters[i].first, reduced.parameters[i].second,
              fp32.parameters[i].second, exact.parameters[i].second);
      }
    }
  }
}
