// Scaled dot-product attention, per head: out = softmax(scale * q kᵀ + mask) v, and the choice
// between the two kernels that compute it:
//   Kernel::reference  stores each head's [L, S] scores; the only one that returns weights
//   Kernel::flash      tiles queries × keys with an online softmax; memory O(block² + block·D)
//   Kernel::automatic  flash unless weights are requested
// Both give the same results within float rounding, and each has its backward pass
// (scaled_dot_product_attention_backward). The layer class composes them with the projections.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/kernels/flash.hpp"
#include "mha/kernels/reference.hpp"
#include "mha/kernels/sinks.hpp"
#include "mha/kernels/talking_heads.hpp"
#include "mha/mask.hpp"
#include "mha/tensor.hpp"

namespace mha {

enum class Kernel { automatic, reference, flash };

inline const char* kernel_name(Kernel kernel) {
  switch (kernel) {
    case Kernel::automatic:
      return "auto";
    case Kernel::reference:
      return "reference";
    case Kernel::flash:
      return "flash";
  }
  return "unknown";
}

// The arithmetic of a forward call's products (ForwardOptions::precision):
//   Precision::fp32  float products, the default: the arithmetic every other is measured against
//   Precision::bf16  the projections' and the flash kernel's products with operands rounded to
//                    bf16 and sums in fp32 (`vdpbf16ps`, twice the fp32 rate where the CPU has
//                    AVX512_BF16); scores, softmax, running max and sums, biases and the output
//                    in fp32, rounded once to the layer's type. Where the CPU lacks the
//                    instruction (bf16_arithmetic_available()), the call computes in fp32.
//   Precision::int8  the projections as int8 × int8 products (`vpdpbusd`, AVX512_VNNI) of the
//                    weights' int8 values and the inputs' rows quantized at the call, one scale
//                    per row (dynamic quantization, as ONNX Runtime's); only for a
//                    FrozenMultiHeadAttention made with FrozenWeights::int8 (others refuse it);
//                    the attention in fp32. Where the CPU lacks the instruction, the projections
//                    run on the quantized weights in fp32.
//   Precision::fp16  for mixed-precision training only (forward_train of a float layer): the
//                    projections' products, forward and backward, on operands rounded to fp16
//                    with fp32 sums, emulated (kernels/fp16_products.hpp: fp16's range, which
//                    needs loss scaling, mha/loss_scaling.hpp, at fp32's speed); the attention in
//                    fp32. Inference refuses it.
// bf16 keeps 8 significant bits: outputs within about 1e-2 of the largest output (tested against
// float64), as PyTorch's bf16 autocast on CPU; int8 within 2e-2.
enum class Precision { fp32, bf16, int8, fp16 };

inline const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::bf16:
      return "bf16";
    case Precision::int8:
      return "int8";
    case Precision::fp16:
      return "fp16";
    default:
      return "fp32";
  }
}

// Whether Precision::bf16 computes in bf16 on this CPU (else in fp32).
inline bool bf16_arithmetic_available() {
  return detail::bf16_dot_available();
}

namespace detail {

// Precision::bf16 and int8 are for float computations (float and 16-bit layers, float
// attention): a double computation refuses them rather than compute in double what was asked
// in less.
template <class Compute>
void check_precision(Precision precision) {
  if (std::is_same_v<Compute, double> && precision != Precision::fp32) {
    throw_argument("precision", std::string("reduced precision is for float computations; this "
                                            "one is in double, got ") +
                                    precision_name(precision));
  }
}

// Precision::fp16 is for mixed-precision training: inference refuses it rather than compute in
// fp32 what was asked in fp16.
inline void check_inference_precision(Precision precision) {
  if (precision == Precision::fp16) {
    throw_argument("precision",
                   "fp16 products are for mixed-precision training (forward_train of a float "
                   "layer); inference computes in fp32, bf16 or int8");
  }
}

// The kernel that runs: the flash kernel cannot return weights, so asking for both is refused.
inline Kernel resolve_kernel(Kernel requested, bool need_weights) {
  if (requested == Kernel::flash && need_weights) {
    throw_argument("kernel",
                   "flash does not return attention weights: use Kernel::reference or "
                   "Kernel::automatic with need_weights, or need_weights = false");
  }
  if (requested == Kernel::automatic) return need_weights ? Kernel::reference : Kernel::flash;
  return requested;
}

// Runs the chosen kernel over (B, H) heads; weights as in attention_reference, logsumexp (for
// the flash backward) as in attention_flash. With talking heads, the talking-heads kernel (a
// reference kernel that mixes heads), whatever `kernel` says: callers refuse flash before.
// The flash kernel, then the sinks' correction of its rows (kernels/sinks.hpp), which needs
// their log-sum-exp: the caller's buffer, or one of this call's.
template <class T, class Stored, class Flex = NoFlex>
void attention_flash_with_sinks(Index batch, Index heads, const HeadLayout<const T>& q,
                                const HeadLayout<const Stored>& k,
                                const HeadLayout<const Stored>& v, const HeadLayout<T>& out,
                                const CoreOptions<T>& options,
                                std::vector<KernelScratch<T>>& scratch, T* logsumexp,
                                const Flex& flex = {}) {
  std::vector<T> own_logsumexp;
  if (options.sinks != nullptr && logsumexp == nullptr) {
    own_logsumexp.resize(static_cast<std::size_t>(batch * heads * q.rows));
    logsumexp = own_logsumexp.data();
  }
  attention_flash<T, Stored>(batch, heads, q, k, v, out, options, scratch, logsumexp, FlashBlocks{},
                             flex);
  if (options.sinks != nullptr) apply_sinks(batch, heads, out, logsumexp, options.sinks);
}

inline void check_no_sinks_with_talking_heads(bool sinks, bool talking_heads) {
  if (sinks && talking_heads) {
    throw_argument("sinks",
                   "learnable sinks and talking heads do not combine (the talking-heads "
                   "kernel has no sink column)");
  }
}

template <class T>
void attention(Kernel kernel, Index batch, Index heads, const HeadLayout<const T>& q,
               const HeadLayout<const T>& k, const HeadLayout<const T>& v, const HeadLayout<T>& out,
               const CoreOptions<T>& options, T* weights, std::vector<KernelScratch<T>>& scratch,
               T* logsumexp = nullptr) {
  if (options.talking_heads.active()) {
    check_no_sinks_with_talking_heads(options.sinks != nullptr, true);
    attention_talking_heads<T>(batch, heads, q, k, v, out, options, options.talking_heads, weights,
                               scratch);
  } else if (kernel == Kernel::flash) {
    attention_flash_with_sinks<T, T>(batch, heads, q, k, v, out, options, scratch, logsumexp);
  } else {
    attention_reference<T>(batch, heads, q, k, v, out, options, weights, scratch);
  }
}

// The same with keys and values stored in a 16-bit type (Stored, a half or bfloat16 KV cache):
// the flash kernel converts each key block as it visits it; the reference and talking-heads
// kernels, which read every key of a head several times, read a converted copy.
template <class T, class Stored, class = std::enable_if_t<!std::is_same_v<T, Stored>>>
void attention(Kernel kernel, Index batch, Index heads, const HeadLayout<const T>& q,
               const HeadLayout<const Stored>& k, const HeadLayout<const Stored>& v,
               const HeadLayout<T>& out, const CoreOptions<T>& options, T* weights,
               std::vector<KernelScratch<T>>& scratch, T* logsumexp = nullptr) {
  if (kernel == Kernel::flash && !options.talking_heads.active()) {
    attention_flash_with_sinks<T, Stored>(batch, heads, q, k, v, out, options, scratch, logsumexp);
    return;
  }
  // Each batch's span, from its first stored element to its last, keeps its strides in the copy.
  const auto converted = [batch, heads](const HeadLayout<const Stored>& stored, Matrix<T>& copy) {
    const Index stored_heads = heads / stored.group;
    const Index extent = stored.rows == 0 ? 0
                                          : (stored_heads - 1) * stored.head_stride +
                                                (stored.rows - 1) * stored.row_stride + stored.cols;
    copy.resize(batch, extent);
    for (Index b = 0; b < batch && extent > 0; ++b) {
      widen(stored.data + b * stored.batch_stride, extent, copy.data() + b * extent);
    }
    HeadLayout<const T> layout{copy.data(),       extent,      stored.head_stride,
                               stored.row_stride, stored.rows, stored.cols};
    layout.group = stored.group;
    return layout;
  };
  Matrix<T> keys, values;
  attention<T>(kernel, batch, heads, q, converted(k, keys), converted(v, values), out, options,
               weights, scratch, logsumexp);
}

// The backward of the kernel that ran forward; the flash one needs its logsumexp (with sinks,
// the corrected one the forward left). With talking heads, grad_pre and grad_post (null, or
// [H, H]) receive the mixes' gradients; with sinks, grad_sinks [H] is added the sinks'.
template <class T>
void attention_backward(Kernel kernel, Index batch, Index heads, const HeadLayout<const T>& q,
                        const HeadLayout<const T>& k, const HeadLayout<const T>& v,
                        const HeadLayout<const T>& out, const HeadLayout<const T>& grad_out,
                        const T* logsumexp, const HeadLayout<T>& grad_q,
                        const HeadLayout<T>& grad_k, const HeadLayout<T>& grad_v,
                        const CoreOptions<T>& options, std::vector<KernelScratch<T>>& scratch,
                        T* grad_pre = nullptr, T* grad_post = nullptr, T* grad_sinks = nullptr) {
  if (options.talking_heads.active()) {
    check_no_sinks_with_talking_heads(options.sinks != nullptr, true);
    attention_talking_heads_backward<T>(batch, heads, q, k, v, grad_out, grad_q, grad_k, grad_v,
                                        options, options.talking_heads, grad_pre, grad_post,
                                        scratch);
  } else if (kernel == Kernel::flash) {
    attention_flash_backward<T>(batch, heads, q, k, v, out, grad_out, logsumexp, grad_q, grad_k,
                                grad_v, options, scratch);
    if (options.sinks != nullptr && grad_sinks != nullptr) {
      accumulate_sink_gradients(batch, heads, out, grad_out, logsumexp, options.sinks, grad_sinks);
    }
  } else {
    // Each task's sink gradients apart (tasks of one head run on different threads), then summed
    // over the batch in order.
    std::vector<T> per_task;
    if (options.sinks != nullptr && grad_sinks != nullptr) {
      per_task.resize(static_cast<std::size_t>(batch * heads));
    }
    attention_reference_backward<T>(batch, heads, q, k, v, grad_out, grad_q, grad_k, grad_v,
                                    options, scratch, per_task.empty() ? nullptr : per_task.data());
    for (Index b = 0; b < batch && !per_task.empty(); ++b) {
      for (Index h = 0; h < heads; ++h)
        grad_sinks[h] += per_task[static_cast<std::size_t>(b * heads + h)];
    }
  }
}

// The instantiations mha::compiled holds (src/kernels_*.cpp; see mha/compiled.hpp): the
// kernels, through the two functions every caller reaches them by.
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_KERNEL_TEMPLATES(PREFIX, T)                                                     \
  PREFIX template void attention<T>(Kernel, Index, Index, const HeadLayout<const T>&,       \
                                    const HeadLayout<const T>&, const HeadLayout<const T>&, \
                                    const HeadLayout<T>&, const CoreOptions<T>&, T*,        \
                                    std::vector<KernelScratch<T>>&, T*);                    \
  PREFIX template void attention_backward<T>(                                               \
      Kernel, Index, Index, const HeadLayout<const T>&, const HeadLayout<const T>&,         \
      const HeadLayout<const T>&, const HeadLayout<const T>&, const HeadLayout<const T>&,   \
      const T*, const HeadLayout<T>&, const HeadLayout<T>&, const HeadLayout<T>&,           \
      const CoreOptions<T>&, std::vector<KernelScratch<T>>&, T*, T*, T*);
// NOLINTEND(bugprone-macro-parentheses)
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_STORED_KERNEL_TEMPLATES(PREFIX, Stored)                                          \
  PREFIX template void attention<float, Stored>(                                             \
      Kernel, Index, Index, const HeadLayout<const float>&, const HeadLayout<const Stored>&, \
      const HeadLayout<const Stored>&, const HeadLayout<float>&, const CoreOptions<float>&,  \
      float*, std::vector<KernelScratch<float>>&, float*);
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_COMPUTE_TYPES, MHA_KERNEL_TEMPLATES)
MHA_EXTERN_TEMPLATES(MHA_STORED_16BIT_TYPES, MHA_STORED_KERNEL_TEMPLATES)

inline void check_dropout(double p) {
  if (!(p >= 0 && p <= 1)) {
    throw_argument("dropout", "must be in [0, 1], got " + std::to_string(p));
  }
}

template <class T>
T checked_softcap(T softcap) {
  if (!(softcap >= T(0) && std::isfinite(softcap))) {
    throw_argument("softcap", "must be finite and >= 0 (0 = none), got " + std::to_string(softcap));
  }
  return softcap;
}

// ALiBi slopes are either absent or one finite slope per query head.
template <class T>
const T* checked_alibi_slopes(const std::vector<T>& slopes, Index heads) {
  if (slopes.empty()) return nullptr;
  if (static_cast<Index>(slopes.size()) != heads) {
    throw_shape("alibi_slopes", "one slope per query head, [" + std::to_string(heads) + "]",
                {static_cast<Index>(slopes.size())});
  }
  for (const T slope : slopes) {
    if (!std::isfinite(slope)) {
      throw_argument("alibi_slopes", "must be finite, got " + std::to_string(slope));
    }
  }
  return slopes.data();
}

}  // namespace detail

// The ALiBi paper's slopes for H heads (Press et al. 2022, as BLOOM and MPT use them): for H a
// power of two, 2^(-8 (h + 1) / H); otherwise those of the largest power of two below H, then
// every other slope of twice that many.
template <class T>
std::vector<T> alibi_slopes(Index heads) {
  const auto power_of_two_slopes = [](Index n) {
    std::vector<T> slopes;
    for (Index h = 0; h < n; ++h) {
      slopes.push_back(
          static_cast<T>(std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(n))));
    }
    return slopes;
  };
  if (heads <= 0) return {};
  Index closest = 1;
  while (closest * 2 <= heads) closest *= 2;
  std::vector<T> slopes = power_of_two_slopes(closest);
  const std::vector<T> doubled = power_of_two_slopes(2 * closest);
  for (Index h = 0; static_cast<Index>(slopes.size()) < heads; h += 2) {
    slopes.push_back(doubled[static_cast<std::size_t>(h)]);
  }
  return slopes;
}

template <class T>
struct AttentionOptions {
  // [L, S], [H, L, S] or [B, H, L, S] (a leading axis may be 1 to broadcast); any MaskKind.
  Mask<T> mask;
  Causal causal = Causal::none;
  // Local attention: keys outside the window are blocked, and the flash kernel skips them.
  Window window;
  // Global tokens and block-sparse layouts (see SparsePattern in mask.hpp).
  SparsePattern pattern;
  // ALiBi: empty, or one slope per query head (alibi_slopes<T>(H) gives the paper's); adds
  // -slope_h * |c - j| to the scaled scores, c = i or i + S - L (alibi_alignment).
  std::vector<T> alibi_slopes;
  Alignment alibi_alignment = Alignment::top_left;
  // Logit soft-capping, as Gemma 2 and FlashAttention's softcap: scores become
  // c tanh(scale q kᵀ / c) before masks and biases; 0 = none.
  T softcap = T(0);
  // Learnable attention sinks, as gpt-oss and FlashAttention's learnable_sink: empty, or one
  // finite logit per query head [H] that joins each row's softmax as a column whose value is zero
  // (kernels/sinks.hpp). Rows then sum to less than 1; a row that sees no key gives 0. The
  // backward returns their gradient (AttentionGradients::sinks).
  std::vector<T> sinks;
  // Multiplies q kᵀ; 1/sqrt(D) when not given.
  std::optional<T> scale;
  bool need_weights = false;
  Kernel kernel = Kernel::automatic;
  // The flash kernel's products in bf16 with fp32 sums (see Precision; the reference kernel and
  // the small-head kernel, D <= 16, keep fp32). The backward refuses bf16.
  Precision precision = Precision::fp32;
  // SDPA's dropout_p, applied to the weights whenever it is > 0; the same seed drops the same
  // weights in both kernels and in the backward.
  double dropout = 0;
  std::uint64_t dropout_seed = 0;
  // Grouped-query attention, as SDPA's enable_gqa: key and value may have H_kv heads, any divisor
  // of query's H; query head h reads key/value head h / (H / H_kv), never copied per query head.
  bool enable_gqa = false;
};

template <class T>
struct AttentionResult {
  Tensor<T> output;     // [..., L, Dv], the leading axes of query
  Tensor<T> weights;    // [..., L, S] when need_weights, else empty
  Tensor<T> logsumexp;  // [..., L] from the flash kernel (what its backward needs), else empty
};

template <class T>
struct AttentionGradients {
  Tensor<T> query, key, value;  // the shapes of the inputs
  Tensor<T> sinks;              // [H] with AttentionOptions::sinks, else empty
  // [P]: the gradient of a flex_attention score_mod's learned parameters (flex.hpp), else empty
  Tensor<T> score_mod;
};

namespace detail {

// The checked shapes of a scaled_dot_product_attention call and the kernel options they imply.
template <class T>
struct AttentionProblem {
  Shape leading;     // zero, one (H) or two (B, H) axes of query and the output
  Shape kv_leading;  // the same for key and value: H_kv instead of H under grouped-query attention
  Index batch = 1, heads = 1, kv_heads = 1, query_len = 0, key_len = 0, head_dim = 0, value_dim = 0;
  Kernel kernel = Kernel::automatic;
  CoreOptions<T> core;

  Shape shape(Index rows, Index cols) const { return with_rows(leading, rows, cols); }
  Shape kv_shape(Index rows, Index cols) const { return with_rows(kv_leading, rows, cols); }
  static Shape with_rows(Shape result, Index rows, Index cols) {
    result.push_back(rows);
    result.push_back(cols);
    return result;
  }
  Shape logsumexp_shape() const {
    Shape result = leading;
    result.push_back(query_len);
    return result;
  }
  HeadLayout<const T> heads_of(const T* data, Index rows, Index cols) const {
    return contiguous_heads(data, heads, rows, cols);
  }
  HeadLayout<T> heads_of(T* data, Index rows, Index cols) const {
    return contiguous_heads(data, heads, rows, cols);
  }
  // Keys and values (or their gradients): H_kv stored heads, each read by H / H_kv query heads.
  template <class Element>
  HeadLayout<Element> kv_heads_of(Element* data, Index rows, Index cols) const {
    HeadLayout<Element> layout = contiguous_heads(data, kv_heads, rows, cols);
    layout.group = kv_heads > 0 ? heads / kv_heads : 1;
    return layout;
  }
};

template <class T>
AttentionProblem<T> attention_problem(const TensorView<const T>& query,
                                      const TensorView<const T>& key,
                                      const TensorView<const T>& value,
                                      const AttentionOptions<T>& options) {
  AttentionProblem<T> problem;
  const Index rank = query.rank();
  if (rank < 2 || rank > 4)
    throw_shape("query", "[L, D], [H, L, D] or [B, H, L, D]", query.shape());
  problem.leading.assign(query.shape().begin(), query.shape().end() - 2);
  problem.query_len = query.dim(rank - 2);
  problem.head_dim = query.dim(rank - 1);
  if (problem.head_dim == 0) throw_shape("query", "a head dimension D >= 1", query.shape());
  problem.batch = rank == 4 ? query.dim(0) : 1;
  problem.heads = rank >= 3 ? query.dim(rank - 3) : 1;
  // With enable_gqa, key and value may have H_kv heads, any divisor of H (checked below).
  problem.kv_leading = problem.leading;
  const auto heads_axis = static_cast<std::size_t>(rank - 3);  // when rank >= 3
  if (options.enable_gqa && rank >= 3) problem.kv_leading[heads_axis] = kAnyDim;
  check_shape("key", problem.kv_shape(kAnyDim, problem.head_dim), key.shape());
  problem.key_len = key.dim(rank - 2);
  problem.kv_heads = rank >= 3 ? key.dim(rank - 3) : 1;
  if (problem.kv_heads == 0 ? problem.heads != 0 : problem.heads % problem.kv_heads != 0) {
    throw_shape("key", "a number of heads dividing query's " + std::to_string(problem.heads),
                key.shape());
  }
  if (rank >= 3) problem.kv_leading[heads_axis] = problem.kv_heads;
  check_shape("value", problem.kv_shape(problem.key_len, kAnyDim), value.shape());
  problem.value_dim = value.dim(rank - 1);

  problem.kernel = resolve_kernel(options.kernel, options.need_weights);
  check_dropout(options.dropout);
  check_precision<T>(options.precision);
  if (options.precision == Precision::int8) {
    throw_argument("precision",
                   "int8 products are for the projections of a layer with int8 "
                   "weights; attention alone computes in fp32 or bf16");
  }
  check_inference_precision(options.precision);
  CoreOptions<T>& core = problem.core;
  core.scale = options.scale ? *options.scale : T(1) / std::sqrt(static_cast<T>(problem.head_dim));
  if (!std::isfinite(core.scale)) {
    throw_argument("scale", "must be finite, got " + std::to_string(core.scale));
  }
  const std::string accepted =
      "[L, S], [H, L, S] or [B, H, L, S] with L = " + std::to_string(problem.query_len) +
      ", S = " + std::to_string(problem.key_len);
  core.attn_mask = broadcast_mask_layout(options.mask, "mask", problem.batch, problem.heads,
                                         problem.query_len, problem.key_len, accepted);
  core.causal = options.causal;
  core.causal_cols = problem.key_len;
  check_window(options.window);
  core.window = options.window;
  core.pattern = checked_pattern(options.pattern, problem.heads, problem.query_len, problem.key_len,
                                 options.pattern.alignment);
  core.alibi_slopes = checked_alibi_slopes(options.alibi_slopes, problem.heads);
  core.alibi_alignment = options.alibi_alignment;
  core.softcap = checked_softcap(options.softcap);
  core.sinks = checked_sinks(options.sinks, problem.heads, "sinks");
  core.dropout = {options.dropout, options.dropout_seed, problem.heads, problem.query_len,
                  problem.key_len};
  core.bf16_products = options.precision == Precision::bf16 && bf16_arithmetic_available();
  return problem;
}

}  // namespace detail

// query is [..., L, D], key [..., S, D], value [..., S, Dv], where "..." is the same zero, one
// (H) or two (B, H) leading axes for all three (H_kv for key and value with enable_gqa). Every
// head is computed independently.
template <class T>
AttentionResult<T> scaled_dot_product_attention(TensorView<const T> query, TensorView<const T> key,
                                                TensorView<const T> value,
                                                const AttentionOptions<T>& options = {}) {
  const auto problem = detail::attention_problem(query, key, value, options);
  const Index query_len = problem.query_len, key_len = problem.key_len;
  AttentionResult<T> result;
  result.output = Tensor<T>(problem.shape(query_len, problem.value_dim));
  if (options.need_weights) result.weights = Tensor<T>(problem.shape(query_len, key_len));
  if (problem.kernel == Kernel::flash) {
    result.logsumexp = Tensor<T>(problem.logsumexp_shape());
  }
  std::vector<detail::KernelScratch<T>> scratch;
  detail::attention<T>(problem.kernel, problem.batch, problem.heads,
                       problem.heads_of(query.data(), query_len, problem.head_dim),
                       problem.kv_heads_of(key.data(), key_len, problem.head_dim),
                       problem.kv_heads_of(value.data(), key_len, problem.value_dim),
                       problem.heads_of(result.output.data(), query_len, problem.value_dim),
                       problem.core, options.need_weights ? result.weights.data() : nullptr,
                       scratch, result.logsumexp.data());
  return result;
}

template <class T>
AttentionResult<T> scaled_dot_product_attention(const Tensor<T>& query, const Tensor<T>& key,
                                                const Tensor<T>& value,
                                                const AttentionOptions<T>& options = {}) {
  return scaled_dot_product_attention(query.view(), key.view(), value.view(), options);
}

// The gradients of loss = sum(result.output ∘ grad_output) with respect to query, key and value,
// where result is what scaled_dot_product_attention returned for the same inputs and options
// (the flash backward recomputes the weights from its logsumexp; the reference one from q and k).
template <class T>
AttentionGradients<T> scaled_dot_product_attention_backward(
    TensorView<const T> query, TensorView<const T> key, TensorView<const T> value,
    const AttentionResult<T>& result, TensorView<const T> grad_output,
    const AttentionOptions<T>& options = {}) {
  if (options.precision != Precision::fp32) {
    detail::throw_argument("precision", std::string("the backward computes in fp32; got ") +
                                            precision_name(options.precision));
  }
  const auto problem = detail::attention_problem(query, key, value, options);
  const Index query_len = problem.query_len, key_len = problem.key_len;
  const Shape output_shape = problem.shape(query_len, problem.value_dim);
  detail::check_shape("result.output", output_shape, result.output.shape());
  detail::check_shape("grad_output", output_shape, grad_output.shape());
  if (problem.kernel == Kernel::flash) {
    detail::check_shape("result.logsumexp (from a flash forward)", problem.logsumexp_shape(),
                        result.logsumexp.shape());
  }
  AttentionGradients<T> grads;
  grads.query = Tensor<T>(query.shape());
  grads.key = Tensor<T>(key.shape());
  grads.value = Tensor<T>(value.shape());
  if (!options.sinks.empty()) {
    grads.sinks = Tensor<T>({problem.heads});
  }
  std::vector<detail::KernelScratch<T>> scratch;
  detail::attention_backward<T>(
      problem.kernel, problem.batch, problem.heads,
      problem.heads_of(query.data(), query_len, problem.head_dim),
      problem.kv_heads_of(key.data(), key_len, problem.head_dim),
      problem.kv_heads_of(value.data(), key_len, problem.value_dim),
      problem.heads_of(result.output.data(), query_len, problem.value_dim),
      problem.heads_of(grad_output.data(), query_len, problem.value_dim), result.logsumexp.data(),
      problem.heads_of(grads.query.data(), query_len, problem.head_dim),
      problem.kv_heads_of(grads.key.data(), key_len, problem.head_dim),
      problem.kv_heads_of(grads.value.data(), key_len, problem.value_dim), problem.core, scratch,
      nullptr, nullptr, options.sinks.empty() ? nullptr : grads.sinks.data());
  return grads;
}

// The instantiations mha::compiled holds (src/attention.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_SDPA_TEMPLATES(PREFIX, T)                                                             \
  PREFIX template AttentionResult<T> scaled_dot_product_attention<T>(                             \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, const AttentionOptions<T>&); \
  PREFIX template AttentionGradients<T> scaled_dot_product_attention_backward<T>(                 \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, const AttentionResult<T>&,   \
      TensorView<const T>, const AttentionOptions<T>&);
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_COMPUTE_TYPES, MHA_SDPA_TEMPLATES)

}  // namespace mha
