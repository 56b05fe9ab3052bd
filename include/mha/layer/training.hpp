// Training the layer: forward_train keeps what backward needs in a SavedForward the caller owns
// (copies of the inputs and options, the projections, the heads' outputs, the flash kernel's
// log-sum-exp, the dropout seed), and applies dropout; backward returns the inputs' gradients
// (InputGradients, with the inputs' shapes) and adds the parameters' into the layer's gradients.
// float and double only: the 16-bit layers serve inference. A float layer trains in mixed
// precision with Precision::bf16 or fp16 (its products in 16 bits, its parameters, gradients and
// softmax in fp32; docs/precision.md, "Mixed-precision training").
//
// backward runs the forward's steps in reverse, each with the forward line it differentiates:
//   output = attended W_oᵀ + b_o           -> grad W_o, grad b_o, grad attended
//   gated_h = gate_h attended_h            -> grad gate, grad attended_h
//   attended = heads(q, k, v)              -> the kernel's backward: grad q, k, v (and the mixes)
//   q, k = rope(q, k)                      -> the inverse rotation of their gradients
//   q, k, v = x Wᵀ + b (+ bias_k, zero)    -> grad W, grad b (grad bias_k/v), grad x
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/layer/forward.hpp"
#include "mha/layer/parameters.hpp"
#include "mha/layer/projections.hpp"

namespace mha {

template <class T>
class MultiHeadAttention;

// d loss / d query, key and value, with the inputs' shapes.
template <class T>
struct InputGradients {
  Tensor<T> query, key, value;
  Tensor<T> head_gate;  // [H] with ForwardOptions::head_gate, else empty
};

namespace detail {

// What a SavedForward holds; buffers that repeated forward_train / backward pairs reuse.
template <class T>
struct SavedState {
  const void* layer = nullptr;  // the layer whose forward_train filled it; null until one did
  ForwardPlan plan;
  ForwardOptions<T> options;
  Dropout<T> dropout;
  Tensor<T> query, key, value;  // key and value stay empty when fused (they were query)
  Workspace<T> workspace;       // projections and the heads' outputs, from the forward
  Tensor<T> logsumexp;          // (B, H, L), flash kernel only
  Matrix<T> grad_attended, grad_qkv, grad_q, grad_k, grad_v;
  ReducedProducts products;     // the arithmetic of the backward's projection products
  bool bf16_attention = false;  // the flash kernel's products ran in bf16, forward and backward
};

}  // namespace detail

// What backward needs from a forward_train. It belongs to one layer and one thread; reusing it
// for the next forward_train reuses its buffers.
template <class T>
class SavedForward {
 public:
  // True once a forward_train has filled it.
  bool filled() const { return state_.layer != nullptr; }

 private:
  friend class MultiHeadAttention<T>;
  detail::SavedState<T> state_;
};

namespace detail {

// forward_train of `layer` (its address marks `saved` as its own) into `result`, whose buffers
// it reuses: the forward pass with dropout drawn from `dropout_random`, keeping copies of the
// inputs and options in `saved`.
template <class T>
void forward_train(LayerParameters<T>& parameters, const void* layer, Random& dropout_random,
                   const TensorView<const T>& query, const TensorView<const T>& key,
                   const TensorView<const T>& value, const ForwardOptions<T>& options,
                   SavedState<T>& saved, ForwardResult<T>& result) {
  const MultiHeadAttentionConfig& config = parameters.config();
  saved.layer = nullptr;  // unusable until this call succeeds
  const bool bf16 = options.precision == Precision::bf16;
  const bool fp16 = options.precision == Precision::fp16;
  if (options.precision == Precision::int8 || ((bf16 || fp16) && !std::is_same_v<T, float>)) {
    throw_argument("precision", std::string("forward_train computes in fp32, or in bf16 or fp16 "
                                            "on a float layer; got ") +
                                    precision_name(options.precision) +
                                    (bf16 || fp16 ? " on a double layer" : ""));
  }
  const ForwardPlan plan = plan_forward(parameters, query, key, value, options, true);
  saved.options = options;  // the masks too: core's layouts point into this copy
  CoreOptions<T> core = core_options(parameters, plan, saved.options);
  if (config.dropout > 0) {
    core.dropout = {config.dropout, dropout_random.next_u64(), config.num_heads, plan.query_len,
                    plan.total_keys};
  }
  // Copies into the saved tensors' own storage: the same shapes as last time allocate nothing.
  const auto keep = [](Tensor<T>& kept, const TensorView<const T>& input) {
    kept.resize(input.shape());
    if (input.size() > 0) std::copy(input.data(), input.data() + input.size(), kept.data());
  };
  keep(saved.query, query);
  if (!plan.fused) {
    keep(saved.key, key);
    keep(saved.value, value);
  }
  if (plan.kernel == Kernel::flash) {
    saved.logsumexp.resize({plan.batch, config.num_heads, plan.query_len});
  }
  const TensorView<const T> saved_query = saved.query.view();
  run_forward(parameters, plan, core, saved_query, plan.fused ? saved_query : saved.key.view(),
              plan.fused ? saved_query : saved.value.view(), saved.options, saved.workspace, result,
              plan.kernel == Kernel::flash ? saved.logsumexp.data() : nullptr, nullptr);
  // Mixed precision: the projections' products in bf16 or fp16 (the forward's by run_forward,
  // the backward's by gradient_product); in bf16, the flash kernel's products too where its bf16
  // panels ran, and then its backward's (which recomputes the probabilities from q, k and the
  // log-sum-exp, rounding q and k as the forward did: it recomputes the forward's scores, to
  // fp32's rounding, and differentiates the products the forward computed).
  const Index head_dim = parameters.head_dim();
  saved.bf16_attention =
      plan.kernel == Kernel::flash &&
      flash_path<T>(head_dim, head_dim, plan.query_len, core, {}) == FlashPath::bf16_panels;
  parameters.ensure_gradients();
  saved.plan = plan;
  saved.products.precision = bf16 && bf16_dot_available() ? Precision::bf16
                             : fp16                       ? Precision::fp16
                                                          : Precision::fp32;
  saved.dropout = core.dropout;
  saved.layer = layer;
}

// The gradients of loss = sum(output ∘ grad_output) for the forward_train of `layer` that filled
// `saved`: written into `input_grads` for the inputs, its tensors resized (reused where their
// shapes stay: every element is overwritten), for query, key and value separately even when they
// were one tensor (the shared tensor's gradient is their sum), and added into the parameters'
// gradients.
template <class T>
void backward(LayerParameters<T>& parameters, const void* layer, SavedState<T>& saved,
              const TensorView<const T>& grad_output, InputGradients<T>& input_grads) {
  if (saved.layer != layer) {
    throw_argument("saved", saved.layer == nullptr ? "holds no successful forward_train"
                                                   : "was filled by another layer's forward_train");
  }
  const MultiHeadAttentionConfig& config = parameters.config();
  const ParameterSet<T>& values = parameters.values();
  ParameterSet<T>& grads = parameters.grads();
  const ForwardPlan& plan = saved.plan;
  check_shape("grad_output", plan.query_shape, grad_output.shape());
  CoreOptions<T> core = core_options(parameters, plan, saved.options);
  // The flash backward's products in bf16 where the forward's ran in bf16 (q, k and v rounded as
  // the forward rounded them), else fp32.
  core.bf16_products = saved.bf16_attention;
  core.dropout = saved.dropout;
  ReducedProducts* const reduced = &saved.products;
  const Index heads = config.num_heads, head_dim = config.head_dim;
  const Index rows = plan.batch * plan.query_len;
  const Index inner = parameters.inner_dim(), kv_width = parameters.kv_dim();
  const Workspace<T>& forward = saved.workspace;

  // output = attended W_oᵀ + b_o
  const std::vector<T>& gate = saved.options.head_gate;
  const auto grad_out = grad_output.matrix();
  gradient_product<T>(
      strided(grads.out_proj_weight.matrix()), const_strided(grad_out), Operand::transposed,
      const_strided(gate.empty() ? forward.attended : forward.gated), Accumulate::yes, reduced);
  // Column sums of no rows (B or L = 0) are skipped: Eigen's reduction of an empty matrix
  // offsets its null data pointer, which is undefined.
  if (config.bias && rows > 0) grads.out_proj_bias.flat() += grad_out.colwise().sum().transpose();
  Matrix<T>& grad_attended = saved.grad_attended;
  grad_attended.resize(rows, inner);
  gradient_product<T>(strided(grad_attended), const_strided(grad_out), Operand::as_stored,
                      const_strided(values.out_proj_weight.matrix()), Accumulate::no, reduced);
  // gated_h = gate_h attended_h: the gate's gradient is sum(grad_gated_h ∘ attended_h), and the
  // heads' own gradient is gate_h grad_gated_h.
  Tensor<T> grad_gate;
  if (!gate.empty()) {
    grad_gate.resize({heads});
    grad_gate.flat().setZero();
    // No rows (B or L = 0): sums of nothing, and the column blocks would offset null data.
    for (Index h = 0; h < (rows > 0 ? heads : 0); ++h) {
      auto grad_head = grad_attended.middleCols(h * head_dim, head_dim);
      grad_gate.data()[h] =
          grad_head.cwiseProduct(forward.attended.middleCols(h * head_dim, head_dim)).sum();
      grad_head *= gate[static_cast<std::size_t>(h)];
    }
  }

  // the heads: gradients of q, k and v in buffers laid out as the forward's projections
  const T* q_data;
  const T* k_data;
  const T* v_data;
  T* grad_q_data;
  T* grad_k_data;
  T* grad_v_data;
  Index q_stride = inner, kv_stride = kv_width;
  if (plan.fused) {
    saved.grad_qkv.resize(rows, inner + 2 * kv_width);
    q_data = forward.qkv.data();
    grad_q_data = saved.grad_qkv.data();
    k_data = offset_pointer(q_data, parameters.bias_offset(1));
    v_data = offset_pointer(q_data, parameters.bias_offset(2));
    grad_k_data = offset_pointer(grad_q_data, parameters.bias_offset(1));
    grad_v_data = offset_pointer(grad_q_data, parameters.bias_offset(2));
    q_stride = kv_stride = inner + 2 * kv_width;
  } else {
    saved.grad_q.resize(rows, inner);
    saved.grad_k.resize(plan.batch * plan.total_keys, kv_width);
    saved.grad_v.resize(plan.batch * plan.total_keys, kv_width);
    q_data = forward.q.data();
    k_data = forward.k.data();
    v_data = forward.v.data();
    grad_q_data = saved.grad_q.data();
    grad_k_data = saved.grad_k.data();
    grad_v_data = saved.grad_v.data();
  }
  const Index query_len = plan.query_len, total_keys = plan.total_keys;
  Tensor<T> grad_pre, grad_post;  // [H, H] with talking heads, else empty (null)
  if (config.talking_heads_pre) grad_pre.resize({heads, heads});
  if (config.talking_heads_post) grad_post.resize({heads, heads});
  T* const grad_sinks = config.learnable_sinks ? grads.sinks.data() : nullptr;
  if (plan.sequences.empty()) {
    attention_backward<T>(
        plan.kernel, plan.batch, heads, parameters.head_layout(q_data, query_len, q_stride),
        parameters.kv_head_layout(k_data, total_keys, kv_stride),
        parameters.kv_head_layout(v_data, total_keys, kv_stride),
        parameters.head_layout(forward.attended.data(), query_len, inner),
        parameters.template head_layout<const T>(grad_attended.data(), query_len, inner),
        saved.logsumexp.data(), parameters.head_layout(grad_q_data, query_len, q_stride),
        parameters.kv_head_layout(grad_k_data, total_keys, kv_stride),
        parameters.kv_head_layout(grad_v_data, total_keys, kv_stride), core, saved.workspace.kernel,
        grad_pre.data(), grad_post.data(), grad_sinks);
  } else {
    // A packed batch: each sequence's heads, as the forward ran them (run_forward); a key row
    // no query reads (a sequence without queries) gets a zero gradient.
    if (!plan.fused) {
      saved.grad_k.setZero();
      saved.grad_v.setZero();
    } else {
      saved.grad_qkv.setZero();
    }
  }
  for (std::size_t s = 0; s < plan.sequences.size(); ++s) {
    const PackedSequence& sequence = plan.sequences[s];
    if (sequence.query_len == 0) continue;
    const Index rows_q = sequence.query_begin, rows_k = sequence.key_begin;
    const Index length = sequence.query_len, keys = sequence.key_len;
    attention_backward<T>(
        plan.kernel, 1, heads, parameters.head_layout(q_data + rows_q * q_stride, length, q_stride),
        parameters.kv_head_layout(k_data + rows_k * kv_stride, keys, kv_stride),
        parameters.kv_head_layout(v_data + rows_k * kv_stride, keys, kv_stride),
        parameters.head_layout(forward.attended.data() + rows_q * inner, length, inner),
        parameters.template head_layout<const T>(grad_attended.data() + rows_q * inner, length,
                                                 inner),
        saved.logsumexp.data() + (plan.kernel == Kernel::flash ? heads * rows_q : 0),
        parameters.head_layout(grad_q_data + rows_q * q_stride, length, q_stride),
        parameters.kv_head_layout(grad_k_data + rows_k * kv_stride, keys, kv_stride),
        parameters.kv_head_layout(grad_v_data + rows_k * kv_stride, keys, kv_stride),
        sequence_core(core, saved.options.pattern, heads, sequence, s), saved.workspace.kernel,
        nullptr, nullptr, grad_sinks);
  }
  // The kernel overwrites the mixes' gradients; parameters' gradients accumulate.
  if (config.talking_heads_pre) grads.talking_heads_pre.flat() += grad_pre.flat();
  if (config.talking_heads_post) grads.talking_heads_post.flat() += grad_post.flat();
  if (saved.options.rope) {
    rotate_queries_and_keys(parameters, plan, saved.options, saved.workspace, grad_q_data, q_stride,
                            grad_k_data, kv_stride, true);
  }

  // the projections y = x Wᵀ + b
  input_grads.head_gate = std::move(grad_gate);
  input_grads.query.resize(saved.query.shape());
  input_grads.key.resize(plan.fused ? saved.query.shape() : saved.key.shape());
  input_grads.value.resize(plan.fused ? saved.query.shape() : saved.value.shape());
  if (plan.fused) {
    // No rows (B or L = 0): nothing to add, and the column blocks below would offset null data.
    if (rows == 0) return;
    const auto input = saved.query.matrix();
    gradient_product<T>(strided(grads.in_proj_weight.matrix()), const_strided(saved.grad_qkv),
                        Operand::transposed, const_strided(input), Accumulate::yes, reduced);
    if (config.bias) grads.in_proj_bias.flat() += saved.grad_qkv.colwise().sum().transpose();
    Tensor<T>* inputs[] = {&input_grads.query, &input_grads.key, &input_grads.value};
    for (int which = 0; which < 3; ++which) {
      gradient_product<T>(strided(inputs[which]->matrix()),
                          const_strided(saved.grad_qkv.middleCols(
                              parameters.bias_offset(which), parameters.projection_width(which))),
                          Operand::as_stored, const_strided(parameters.weight_rows(which)),
                          Accumulate::no, reduced);
    }
    return;
  }
  backward_projection(parameters, saved.grad_q, saved.query, 0, plan.batch, query_len, query_len,
                      input_grads.query, reduced);
  backward_projection(parameters, saved.grad_k, saved.key, 1, plan.batch, plan.key_len, total_keys,
                      input_grads.key, reduced);
  backward_projection(parameters, saved.grad_v, saved.value, 2, plan.batch, plan.key_len,
                      total_keys, input_grads.value, reduced);
}

// The instantiations mha::compiled holds (src/layer_training.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_LAYER_TRAINING_TEMPLATES(PREFIX, T)                                                 \
  PREFIX template void forward_train<T>(LayerParameters<T>&, const void*, Random&,              \
                                        const TensorView<const T>&, const TensorView<const T>&, \
                                        const TensorView<const T>&, const ForwardOptions<T>&,   \
                                        SavedState<T>&, ForwardResult<T>&);                     \
  PREFIX template void backward<T>(LayerParameters<T>&, const void*, SavedState<T>&,            \
                                   const TensorView<const T>&, InputGradients<T>&);
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_TRAINABLE_TYPES, MHA_LAYER_TRAINING_TEMPLATES)

}  // namespace detail
}  // namespace mha
