// The layer's projections y = x Wᵀ + b, each with its backward beside it:
//   queries  [B*L, E]    -> [B*L, H·D]
//   keys     [B*S, kdim] -> [B*S', H_kv·D], and values [B*S, vdim] likewise: after each batch's S
//            projected rows come bias_k / bias_v (add_bias_kv), then a zero row (add_zero_attn)
//   output   [B*L, H·D]  -> [B*L, E]
// A 16-bit layer projects in float: its inputs are widened once, its weights as they are
// multiplied (product_transposed in kernels/gemm.hpp), and its output is rounded once. A frozen
// float layer (mha/frozen.hpp) multiplies by weights packed once (PackedProjections), with the
// same rounding. With Precision::bf16 (on a CPU with AVX512_BF16) every layer projects in bf16
// with fp32 sums (kernels/bf16_projection.hpp), on weights packed at the call or, frozen, once;
// a float layer's backward after a bf16 forward_train likewise (kernels/bf16_matrix_product.hpp).
#pragma once

#include <type_traits>

#include "mha/attention.hpp"
#include "mha/kernels/bf16_matrix_product.hpp"
#include "mha/kernels/bf16_projection.hpp"
#include "mha/kernels/convert.hpp"
#include "mha/kernels/fp16_products.hpp"
#include "mha/kernels/gemm.hpp"
#include "mha/kernels/int8_weights.hpp"
#include "mha/kernels/prepacked_gemm.hpp"
#include "mha/layer/parameters.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {

// An input [.., width] as [rows, width] in Compute: the tensor itself, or (16-bit layers) its
// conversion into `buffer`.
template <class T>
Eigen::Map<const Matrix<compute_t<T>>> as_compute(const TensorView<const T>& input,
                                                  Matrix<compute_t<T>>& buffer) {
  if constexpr (is_16bit_v<T>) {
    const auto rows = input.matrix();
    buffer.resize(rows.rows(), rows.cols());
    widen(input.data(), input.size(), buffer.data());
    return {buffer.data(), buffer.rows(), buffer.cols()};
  } else {
    return input.matrix();
  }
}

// The four projections' weights packed once: W_q, W_k, W_v (the row blocks of in_proj_weight,
// or q/k/v_proj_weight) and W_o, as the fp32 packed GEMM's panels (kernels/prepacked_gemm.hpp;
// float layers, on CPUs it serves) and as bf16 panels (kernels/bf16_projection.hpp; every type,
// on CPUs with AVX512_BF16). Empty where not served: the frozen layer then projects as the
// layer does.
struct PackedProjections {
  PackedWeight query, key, value, output;
  Bf16PackedWeight bf16_query, bf16_key, bf16_value, bf16_output;
  // A frozen layer with int8 weights (FrozenWeights::int8): the int8 values and scales whose Ŵ
  // the weights above were packed from, for the products of a few rows, and (where the CPU has
  // AVX512_VNNI) as panels for Precision::int8's products. Empty otherwise.
  Int8Weight int8_query, int8_key, int8_value, int8_output;
  Int8PackedWeight int8_panels_query, int8_panels_key, int8_panels_value, int8_panels_output;

  const PackedWeight& input(int which) const {
    return which == 0 ? query : which == 1 ? key : value;
  }
  const Bf16PackedWeight& bf16_input(int which) const {
    return which == 0 ? bf16_query : which == 1 ? bf16_key : bf16_value;
  }
  const Int8Weight& int8_weight(int which) const {
    return which == 0 ? int8_query : which == 1 ? int8_key : which == 2 ? int8_value : int8_output;
  }
  const Int8PackedWeight& int8_panels(int which) const {
    return which == 0   ? int8_panels_query
           : which == 1 ? int8_panels_key
           : which == 2 ? int8_panels_value
                        : int8_panels_output;
  }

  template <class T>
  static PackedProjections pack(const LayerParameters<T>& parameters) {
    PackedProjections packed;
    const auto& out_proj = parameters.values().out_proj_weight;
    if constexpr (std::is_same_v<T, float>) {
      packed.query = PackedWeight::pack(parameters.weight_rows(0));
      packed.key = PackedWeight::pack(parameters.weight_rows(1));
      packed.value = PackedWeight::pack(parameters.weight_rows(2));
      packed.output = PackedWeight::pack(out_proj.matrix());
    }
    if (bf16_dot_available()) {
      Bf16Lanes rounded;
      const auto pack_bf16 = [&](const auto& weight, Bf16PackedWeight& into) {
        pack_bf16_weight(weight.data(), weight.rows(), weight.cols(), weight.cols(), into, rounded);
      };
      pack_bf16(parameters.weight_rows(0), packed.bf16_query);
      pack_bf16(parameters.weight_rows(1), packed.bf16_key);
      pack_bf16(parameters.weight_rows(2), packed.bf16_value);
      pack_bf16(out_proj.matrix(), packed.bf16_output);
    }
    return packed;
  }
};

// The arithmetic one call's projections run in, after what the CPU offers: fp32; bf16
// (Precision::bf16 with AVX512_BF16); int8 (Precision::int8 on a frozen layer's int8 panels,
// with AVX512_VNNI; without it the layer's quantized weights in fp32); fp16 (Precision::fp16, a
// float layer's forward_train: operands rounded to fp16, kernels/fp16_products.hpp).
enum class ProjectionArithmetic { fp32, bf16, int8, fp16 };

// The arithmetic of a call with `precision` on `packed` (null: a layer's own weights). Refuses
// Precision::int8 where there are no int8 weights, and fp16 on a frozen layer's (inference).
inline ProjectionArithmetic projection_arithmetic(Precision precision,
                                                  const PackedProjections* packed) {
  if (precision == Precision::fp16) {
    if (packed != nullptr) check_inference_precision(precision);
    return ProjectionArithmetic::fp16;
  }
  if (precision == Precision::int8) {
    if (packed == nullptr || packed->int8_output.empty()) {
      throw_argument("precision",
                     "int8 products need int8 weights: a FrozenMultiHeadAttention made with "
                     "FrozenWeights::int8");
    }
    return int8_dot_available() ? ProjectionArithmetic::int8 : ProjectionArithmetic::fp32;
  }
  if (precision == Precision::bf16 && bf16_dot_available()) return ProjectionArithmetic::bf16;
  return ProjectionArithmetic::fp32;
}

// How one call's projections multiply: in fp32 by W or its packed panels (`packed`, a frozen
// float layer's), or by its int8 values for a few rows (`int8`, FrozenWeights::int8); with `bf16`
// set, in bf16 by W's bf16 panels: a frozen layer's (`bf16_packed`), else packed at the call into
// *bf16; with `int8_panels` set, int8 × int8 (rows of a few: the int8 values, as `int8`); with
// `fp16` set, on operands rounded to fp16 into *fp16.
struct ProjectionRoute {
  const PackedWeight* packed = nullptr;
  Bf16Scratch* bf16 = nullptr;
  Fp16Scratch* fp16 = nullptr;
  const Bf16PackedWeight* bf16_packed = nullptr;
  const Int8Weight* int8 = nullptr;
  const Int8PackedWeight* int8_panels = nullptr;
  Int8Scratch* int8_scratch = nullptr;
};

// The route of projection `which` (0, 1, 2 for q, k, v; 3 for the output) in one call, on the
// call's scratch (a Workspace's, or a cache's for decode): bf16 by a frozen layer's bf16 panels
// where `packed` has them, else by W packed at the call; int8 by its int8 panels; fp32 by its fp32
// panels where `packed` has them; and for a few rows, outside bf16, its int8 values where it has
// them.
inline ProjectionRoute projection_route(const PackedProjections* packed,
                                        ProjectionArithmetic arithmetic, Bf16Scratch& bf16,
                                        Int8Scratch& int8, int which) {
  ProjectionRoute route;
  if (arithmetic == ProjectionArithmetic::bf16) route.bf16 = &bf16;
  if (packed == nullptr) return route;
  if (arithmetic == ProjectionArithmetic::bf16) {
    const Bf16PackedWeight& weight = which == 3 ? packed->bf16_output : packed->bf16_input(which);
    if (!weight.empty()) route.bf16_packed = &weight;
    return route;
  }
  route.packed = which == 3 ? &packed->output : &packed->input(which);
  if (!packed->int8_weight(which).empty()) route.int8 = &packed->int8_weight(which);
  if (arithmetic == ProjectionArithmetic::int8 && !packed->int8_panels(which).empty()) {
    route.int8_panels = &packed->int8_panels(which);
    route.int8_scratch = &int8;
  }
  return route;
}

// dst [rows, N] = lhs [rows, K] · Wᵀ as `route` says (else as product_transposed multiplies; on
// fp32 panels only where the product is not one of a few rows).
template <class Compute, class Stored>
void project_rows(StridedMap<Compute> dst, ConstStridedMap<Compute> lhs,
                  const Eigen::Map<const Matrix<Stored>>& weight, const ProjectionRoute& route,
                  std::vector<KernelScratch<Compute>>& scratch) {
  if constexpr (std::is_same_v<Compute, float>) {
    if (route.bf16 != nullptr) {
      const Bf16PackedWeight& packed =
          route.bf16_packed != nullptr
              ? *route.bf16_packed
              : route.bf16->packed(weight.data(), weight.rows(), weight.cols());
      bf16_projection(lhs.data(), lhs.rows(), lhs.outerStride(), packed, dst.data(),
                      dst.outerStride(), false, route.bf16->rows);
      return;
    }
  }
  if constexpr (std::is_same_v<Compute, float> && std::is_same_v<Stored, float>) {
    if (route.fp16 != nullptr) return route.fp16->project(dst, lhs, weight, scratch);
    if (route.int8 != nullptr && few_rows_product(dst.rows(), dst.cols())) {
      int8_product(lhs.data(), lhs.rows(), lhs.outerStride(), *route.int8, dst.data(),
                   dst.outerStride());
      return;
    }
    if (route.int8_panels != nullptr) {
      int8_gemm(lhs.data(), lhs.rows(), lhs.outerStride(), *route.int8_panels, dst.data(),
                dst.outerStride(), *route.int8_scratch);
      return;
    }
    if (route.packed != nullptr && runs_prepacked(*route.packed, dst.rows())) {
      multiply_prepacked(dst, lhs, *route.packed);
      return;
    }
  }
  product_transposed<Compute>(dst, lhs, weight, Accumulate::no, scratch);
}

// rows [n, width of projection `which`] += the projection's bias (nothing without bias).
template <class T, class Rows>
void add_bias(const LayerParameters<T>& parameters, Rows& rows, int which) {
  if (!parameters.config().bias) return;
  rows.rowwise() += Eigen::Map<const RowVector<T>>(
                        parameters.values().in_proj_bias.data() + parameters.bias_offset(which),
                        parameters.projection_width(which))
                        .template cast<compute_t<T>>();
}

// input [B*S, width] projected by W_k or W_v (which = 1, 2) into projected [B*S', H_kv·D]: for
// each batch its S rows, then extra_row (bias_k or bias_v, with add_bias_kv), then a zero row
// (add_zero_attn).
template <class T>
void project_keys(const LayerParameters<T>& parameters,
                  const Eigen::Map<const Matrix<compute_t<T>>>& input, int which, Index batch,
                  Index key_len, Index total_keys, const Tensor<T>& extra_row,
                  Matrix<compute_t<T>>& projected,
                  std::vector<KernelScratch<compute_t<T>>>& scratch, const ProjectionRoute& route) {
  using Compute = compute_t<T>;
  const MultiHeadAttentionConfig& config = parameters.config();
  const Index width = input.cols();
  projected.resize(batch * total_keys, parameters.kv_dim());
  const auto weight = parameters.weight_rows(which);
  if (total_keys == key_len) {  // no extra rows: one GEMM over every batch
    project_rows<Compute>(strided(projected), const_strided(input), weight, route, scratch);
    add_bias(parameters, projected, which);
    return;
  }
  for (Index b = 0; b < batch; ++b) {
    auto rows = projected.middleRows(b * total_keys, key_len);
    const Eigen::Map<const Matrix<Compute>> input_rows(input.data() + b * key_len * width, key_len,
                                                       width);
    project_rows<Compute>(strided(rows), const_strided(input_rows), weight, route, scratch);
    add_bias(parameters, rows, which);
    Index next = b * total_keys + key_len;
    if (config.add_bias_kv) {
      projected.row(next++) = extra_row.flat().transpose().template cast<Compute>();
    }
    if (config.add_zero_attn) projected.row(next).setZero();
  }
}

// The arithmetic of a float layer's backward products after a mixed-precision forward_train:
// bf16 (where the CPU has it) or fp16 on rounded operands, each with its scratch; fp32 otherwise.
struct ReducedProducts {
  Precision precision = Precision::fp32;
  Bf16ProductScratch bf16;
  Fp16ProductScratch fp16;
};

// A backward's product dst = (or +=) op(lhs) rhs: in `reduced`'s arithmetic where it is given,
// else in the layer's type.
template <class T>
void gradient_product(StridedMap<T> dst, ConstStridedMap<T> lhs, Operand lhs_op,
                      ConstStridedMap<T> rhs, Accumulate accumulate, ReducedProducts* reduced) {
  if constexpr (std::is_same_v<T, float>) {
    if (reduced != nullptr && reduced->precision == Precision::bf16) {
      return bf16_matrix_product(dst, lhs, lhs_op, rhs, accumulate, reduced->bf16);
    }
    if (reduced != nullptr && reduced->precision == Precision::fp16) {
      return fp16_matrix_product(dst, lhs, lhs_op, rhs, accumulate, reduced->fp16);
    }
  }
  matrix_product<T>(dst, lhs, lhs_op, rhs, accumulate);
}

// The backward of one projection y = x Wᵀ + b (which = 0, 1, 2 for q, k, v), where grad_y is
// [B*rows', E or H_kv·D] with rows' = total_rows per batch: the first `rows` of each batch came
// from input [B, rows, width]; a bias_k/bias_v row follows (add_bias_kv), then the zero row.
//   grad W += grad_yᵀ x,  grad b += colsum(grad_y),  grad x = grad_y W
// (the products by gradient_product, in `reduced`'s arithmetic where it is given).
template <class T>
void backward_projection(LayerParameters<T>& parameters, const Matrix<T>& grad_y,
                         const Tensor<T>& input, int which, Index batch, Index rows,
                         Index total_rows, Tensor<T>& grad_input, ReducedProducts* reduced) {
  ParameterSet<T>& grads = parameters.grads();
  const MultiHeadAttentionConfig& config = parameters.config();
  auto grad_weight = parameters.projection(grads, which);
  const auto weight = parameters.weight_rows(which);
  const Index width = weight.cols();
  const auto accumulate_bias = [&](const auto& grad_rows) {
    if (!config.bias || grad_rows.rows() == 0) return;
    Eigen::Map<RowVector<T>>(grads.in_proj_bias.data() + parameters.bias_offset(which),
                             parameters.projection_width(which)) += grad_rows.colwise().sum();
  };
  if (total_rows == rows) {  // no extra rows: one GEMM over every batch
    gradient_product<T>(strided(grad_weight), const_strided(grad_y), Operand::transposed,
                        const_strided(input.matrix()), Accumulate::yes, reduced);
    accumulate_bias(grad_y);
    gradient_product<T>(strided(grad_input.matrix()), const_strided(grad_y), Operand::as_stored,
                        const_strided(weight), Accumulate::no, reduced);
    return;
  }
  Tensor<T>& grad_extra = which == 1 ? grads.bias_k : grads.bias_v;
  for (Index b = 0; b < batch; ++b) {
    const auto grad_rows = grad_y.middleRows(b * total_rows, rows);
    const Eigen::Map<const Matrix<T>> input_rows(input.data() + b * rows * width, rows, width);
    gradient_product<T>(strided(grad_weight), const_strided(grad_rows), Operand::transposed,
                        const_strided(input_rows), Accumulate::yes, reduced);
    accumulate_bias(grad_rows);
    gradient_product<T>(
        strided(Eigen::Map<Matrix<T>>(grad_input.data() + b * rows * width, rows, width)),
        const_strided(grad_rows), Operand::as_stored, const_strided(weight), Accumulate::no,
        reduced);
    // The zero row is a constant: its gradient goes nowhere.
    if (config.add_bias_kv && which > 0) {
      grad_extra.flat() += grad_y.row(b * total_rows + rows).transpose();
    }
  }
}

// output (shape [.., E]) = heads_output [rows, H·D] W_oᵀ + b_o; a 16-bit layer computes it in
// `buffer` and rounds it once into output.
template <class T>
void project_output(const LayerParameters<T>& parameters, const Matrix<compute_t<T>>& heads_output,
                    Tensor<T>& output, Matrix<compute_t<T>>& buffer,
                    std::vector<KernelScratch<compute_t<T>>>& scratch,
                    const ProjectionRoute& route = {}) {
  using Compute = compute_t<T>;
  const ParameterSet<T>& values = parameters.values();
  const auto project = [&](auto&& rows) {
    project_rows<Compute>(strided(rows), const_strided(heads_output),
                          values.out_proj_weight.matrix(), route, scratch);
    if (parameters.config().bias) {
      rows.rowwise() += values.out_proj_bias.flat().transpose().template cast<Compute>();
    }
  };
  if constexpr (is_16bit_v<T>) {
    buffer.resize(heads_output.rows(), parameters.embed_dim());
    project(buffer);
    narrow(buffer.data(), buffer.size(), output.data());
  } else {
    project(output.matrix());
  }
}

}  // namespace mha::detail
