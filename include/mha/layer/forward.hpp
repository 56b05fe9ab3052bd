// The layer's forward pass, in three steps that forward, forward_train and their tests share:
//   plan_forward   checks query [B, L, E], key [B, S, kdim], value [B, S, vdim] (or unbatched
//                  [L, E], [S, kdim], [S, vdim]) and the options, and decides batched/fused/kernel
//   core_options   the kernels' view of the options (masks' layouts, causal, window, pattern, ...)
//   run_forward    projections (one [B*L, E] x [E, H·D + 2·H_kv·D] GEMM for self-attention),
//                  rotary embeddings, the heads' kernel, head gates, the output projection and
//                  the returned weights
// Everything is checked in plan_forward and core_options, before anything is computed or
// changed.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "mha/attention.hpp"
#include "mha/compiled.hpp"
#include "mha/finite.hpp"
#include "mha/layer/options.hpp"
#include "mha/layer/parameters.hpp"
#include "mha/layer/projections.hpp"
#include "mha/rotary.hpp"

namespace mha::detail {

// Sequence s of a packed batch (ForwardOptions::cu_seqlens): rows [query_begin, query_begin +
// query_len) of the packed query and [key_begin, key_begin + key_len) of key and value.
struct PackedSequence {
  Index query_begin = 0, query_len = 0, key_begin = 0, key_len = 0;
};

// The checked shapes of one forward call, and what they decide.
struct ForwardPlan {
  bool batched = true;
  bool fused = false;  // self-attention through one [E, H·D + 2·H_kv·D] projection
  Index batch = 1, query_len = 0, key_len = 0, total_keys = 0;
  Kernel kernel = Kernel::automatic;
  Shape query_shape;  // also the output's
  // A packed batch's sequences; empty for a padded [B, L, E] (or one [L, E]) call.
  std::vector<PackedSequence> sequences;
};

// cu_seqlens (or cu_seqlens_k) against the `rows` rows of `tensor`: 0 first, never decreasing,
// `rows` last.
inline void check_cumulative_lengths(const char* name, const std::vector<Index>& cumulative,
                                     Index rows, const char* tensor) {
  bool ok = !cumulative.empty() && cumulative.front() == 0 && cumulative.back() == rows;
  for (std::size_t s = 1; ok && s < cumulative.size(); ++s) {
    ok = cumulative[s] >= cumulative[s - 1];
  }
  if (!ok) {
    std::string given;
    for (const Index length : cumulative)
      given += (given.empty() ? "" : ", ") + std::to_string(length);
    throw_argument(name, std::string("expected cumulative lengths from 0, never decreasing, to ") +
                             tensor + "'s " + std::to_string(rows) + " rows; got [" + given + "]");
  }
}

// The sequences of a packed batch, after checking cu_seqlens and cu_seqlens_k against the
// inputs and refusing what a packed batch cannot have (plan holds the shapes).
template <class T>
std::vector<PackedSequence> packed_sequences(const LayerParameters<T>& parameters,
                                             const ForwardPlan& plan,
                                             const ForwardOptions<T>& options) {
  const MultiHeadAttentionConfig& config = parameters.config();
  if (options.cu_seqlens.empty()) {
    throw_argument("cu_seqlens", "cu_seqlens_k needs cu_seqlens, the queries' cumulative lengths");
  }
  if (plan.batched) {
    throw_shape("query",
                "[total_tokens, " + std::to_string(config.embed_dim) +
                    "]: a packed batch (cu_seqlens) is unbatched",
                plan.query_shape);
  }
  const bool own_keys = !options.cu_seqlens_k.empty();
  const std::vector<Index>& key_lengths = own_keys ? options.cu_seqlens_k : options.cu_seqlens;
  check_cumulative_lengths("cu_seqlens", options.cu_seqlens, plan.query_len, "query");
  if (key_lengths.size() != options.cu_seqlens.size()) {
    throw_argument("cu_seqlens_k", "expected " + std::to_string(options.cu_seqlens.size()) +
                                       " entries, as cu_seqlens; got " +
                                       std::to_string(key_lengths.size()));
  }
  check_cumulative_lengths(own_keys ? "cu_seqlens_k" : "cu_seqlens (for key: or give cu_seqlens_k)",
                           key_lengths, plan.key_len, "key");
  const auto refuse = [](bool given, const char* name, const char* why) {
    if (given) throw_argument(name, std::string("not with a packed batch (cu_seqlens): ") + why);
  };
  refuse(options.need_weights, "need_weights",
         "its sequences' weights have shapes of their own; set it false");
  refuse(!options.attn_mask.empty() || !options.key_padding_mask.empty(),
         "attn_mask/key_padding_mask",
         "a packed batch has no padding, and each sequence sees only its own keys");
  refuse(config.add_bias_kv || config.add_zero_attn, "add_bias_kv/add_zero_attn",
         "their key would follow every sequence's keys");
  refuse(parameters.talking_heads().active(), "talking heads",
         "not implemented for packed batches");
  std::vector<PackedSequence> sequences;
  for (std::size_t s = 0; s + 1 < options.cu_seqlens.size(); ++s) {
    PackedSequence sequence;
    sequence.query_begin = options.cu_seqlens[s];
    sequence.query_len = options.cu_seqlens[s + 1] - sequence.query_begin;
    sequence.key_begin = key_lengths[s];
    sequence.key_len = key_lengths[s + 1] - sequence.key_begin;
    // Each sequence's pattern checked now, before anything is computed.
    checked_pattern(options.pattern, config.num_heads, sequence.query_len, sequence.key_len,
                    options.pattern.alignment);
    sequences.push_back(sequence);
  }
  return sequences;
}

// The kernel options of sequence s of a packed batch: the call's, with the sequence's own key
// count, pattern and dropout draws (a seed of its own, so sequences of one length do not drop
// the same weights).
template <class Compute>
CoreOptions<Compute> sequence_core(const CoreOptions<Compute>& core, const SparsePattern& pattern,
                                   Index heads, const PackedSequence& sequence, std::size_t s) {
  CoreOptions<Compute> result = core;
  result.causal_cols = sequence.key_len;
  result.pattern =
      checked_pattern(pattern, heads, sequence.query_len, sequence.key_len, pattern.alignment);
  result.dropout.rows = sequence.query_len;
  result.dropout.cols = sequence.key_len;
  result.dropout.seed = core.dropout.seed + 0x9E3779B97F4A7C15ULL * (s + 1);
  return result;
}

// The kernel a call runs: talking heads mix heads, which only the reference kernel can.
template <class T>
Kernel layer_kernel(const LayerParameters<T>& parameters, Kernel requested, bool need_weights) {
  if (!parameters.talking_heads().active()) return resolve_kernel(requested, need_weights);
  if (requested == Kernel::flash) {
    throw_argument("kernel",
                   "flash cannot mix heads: talking heads run on Kernel::reference (which "
                   "Kernel::automatic picks)");
  }
  return Kernel::reference;
}

// A head gate is empty, or one finite gate per head.
template <class Compute>
void check_head_gate(const std::vector<Compute>& gate, Index heads) {
  if (gate.empty()) return;
  if (static_cast<Index>(gate.size()) != heads) {
    throw_argument("head_gate", "expected one gate per head (" + std::to_string(heads) + "), got " +
                                    std::to_string(gate.size()));
  }
  for (std::size_t h = 0; h < gate.size(); ++h) {
    if (!std::isfinite(gate[h])) {
      throw_argument("head_gate", "gate " + std::to_string(h) + " is not finite");
    }
  }
}

// Head h's columns of the heads' outputs [rows, H·D] times gate[h] (nothing for no gate).
template <class Compute>
void scale_heads(Matrix<Compute>& heads_output, const std::vector<Compute>& gate, Index head_dim) {
  // No rows (L = 0, or a decoding step of no tokens): the data pointer is null, and Eigen's
  // middleCols would offset it, which is undefined.
  if (heads_output.rows() == 0) return;
  for (std::size_t h = 0; h < gate.size(); ++h) {
    heads_output.middleCols(static_cast<Index>(h) * head_dim, head_dim) *= gate[h];
  }
}

// ForwardOptions::check_inputs: the inputs finite, additive masks free of NaN and +inf. In
// self-attention the three are one tensor, which is then named query.
template <class T>
void check_input_values(const TensorView<const T>& query, const TensorView<const T>& key,
                        const TensorView<const T>& value, const ForwardOptions<T>& options) {
  check_finite(query, "query");
  check_finite(key, "key");
  check_finite(value, "value");
  if (options.attn_mask.kind() == MaskKind::additive) {
    check_additive_mask(options.attn_mask.values().view(), "attn_mask");
  }
  if (options.key_padding_mask.kind() == MaskKind::additive) {
    check_additive_mask(options.key_padding_mask.values().view(), "key_padding_mask");
  }
}

// Checks the inputs and options of a forward call (forward_train's where `training`), before
// anything is computed.
template <class T>
ForwardPlan plan_forward(const LayerParameters<T>& parameters, const TensorView<const T>& query,
                         const TensorView<const T>& key, const TensorView<const T>& value,
                         const ForwardOptions<T>& options, bool training = false) {
  const MultiHeadAttentionConfig& config = parameters.config();
  const Index embed = config.embed_dim;
  ForwardPlan plan;
  plan.batched = query.rank() == 3;
  if (!plan.batched && query.rank() != 2) {
    throw_shape("query",
                "[B, L, " + std::to_string(embed) + "] or [L, " + std::to_string(embed) + "]",
                query.shape());
  }
  plan.batch = plan.batched ? query.dim(0) : 1;
  plan.query_len = query.dim(query.rank() - 2);
  plan.key_len = key.rank() == query.rank() ? key.dim(key.rank() - 2) : 0;
  plan.query_shape =
      plan.batched ? Shape{plan.batch, plan.query_len, embed} : Shape{plan.query_len, embed};
  check_shape("query", plan.query_shape, query.shape());
  const auto input_shape = [&](Index length, Index width) {
    return plan.batched ? Shape{plan.batch, length, width} : Shape{length, width};
  };
  check_shape("key", input_shape(kAnyDim, config.kdim), key.shape());
  check_shape("value", input_shape(plan.key_len, config.vdim), value.shape());
  if (options.check_inputs) check_input_values(query, key, value, options);
  // S' keys: the inputs', then bias_k, then the zero key.
  plan.total_keys = plan.key_len + (config.add_bias_kv ? 1 : 0) + (config.add_zero_attn ? 1 : 0);
  plan.kernel = layer_kernel(parameters, options.kernel, options.need_weights);
  if (options.rope) checked_rotary_dim(*options.rope, parameters.head_dim());
  check_head_gate(options.head_gate, config.num_heads);
  check_window(options.window);
  check_precision<compute_t<T>>(options.precision);
  if (!training) check_inference_precision(options.precision);
  if (!options.cu_seqlens.empty() || !options.cu_seqlens_k.empty()) {
    plan.sequences = packed_sequences(parameters, plan, options);
  }
  // Self-attention without extra key rows projects q, k and v in one [B*L, E] x [E, 3E] GEMM.
  plan.fused = parameters.packed_projection() && !config.add_bias_kv && !config.add_zero_attn &&
               query.data() == key.data() && key.data() == value.data() &&
               query.shape() == key.shape() && key.shape() == value.shape();
  return plan;
}

// attn_mask [L, S] shared, or [B*H, L, S] ([H, L, S] unbatched) indexed by b*H + h.
template <class Compute>
MaskLayout<Compute> attn_mask_layout(const Mask<Compute>& mask, Index heads,
                                     const ForwardPlan& plan) {
  if (mask.empty()) return {};
  const Index query_len = plan.query_len, key_len = plan.key_len;
  const Index stacked = plan.batched ? plan.batch * heads : heads;
  const Shape& shape = mask.shape();
  if (shape == Shape{query_len, key_len}) return make_mask_layout(mask, 0, 0, key_len, key_len);
  if (shape == Shape{stacked, query_len, key_len}) {
    return make_mask_layout(mask, heads * query_len * key_len, query_len * key_len, key_len,
                            key_len);
  }
  throw_shape("attn_mask",
              format_shape({query_len, key_len}) + " or " +
                  format_shape({stacked, query_len, key_len}) +
                  (plan.batched ? " ([L, S] or [B*H, L, S])" : " ([L, S] or [H, L, S])"),
              shape);
}

// key_padding_mask [B, S] ([S] unbatched), the same for every head and query.
template <class Compute>
MaskLayout<Compute> key_padding_layout(const Mask<Compute>& mask, const ForwardPlan& plan) {
  if (mask.empty()) return {};
  const Shape expected = plan.batched ? Shape{plan.batch, plan.key_len} : Shape{plan.key_len};
  check_shape("key_padding_mask", expected, mask.shape());
  return make_mask_layout(mask, plan.key_len, 0, 0, plan.key_len);
}

// The kernel options of a call, pointing into options' masks (which must outlive them). Checks
// the masks' shapes.
template <class T>
CoreOptions<compute_t<T>> core_options(const LayerParameters<T>& parameters,
                                       const ForwardPlan& plan, const ForwardOptions<T>& options) {
  using Compute = compute_t<T>;
  const Index heads = parameters.num_heads();
  CoreOptions<Compute> core;
  core.scale = Compute(1) / std::sqrt(static_cast<Compute>(parameters.head_dim()));
  core.attn_mask = attn_mask_layout(options.attn_mask, heads, plan);
  core.key_padding_mask = key_padding_layout(options.key_padding_mask, plan);
  core.causal = !options.is_causal                                    ? Causal::none
                : options.causal_alignment == Alignment::bottom_right ? Causal::bottom_right
                                                                      : Causal::top_left;
  core.causal_cols = plan.key_len;
  core.window = options.window;
  // (A packed batch's patterns are checked per sequence, by packed_sequences.)
  if (plan.sequences.empty()) {
    core.pattern = checked_pattern(options.pattern, heads, plan.query_len, plan.key_len,
                                   options.pattern.alignment);
  }
  core.alibi_slopes = checked_alibi_slopes(options.alibi_slopes, heads);
  core.alibi_alignment = options.causal_alignment;
  core.softcap = checked_softcap(options.softcap);
  core.talking_heads = parameters.talking_heads();
  core.sinks = parameters.sinks();
  core.bf16_products = options.precision == Precision::bf16 && bf16_arithmetic_available();
  return core;
}

// Applies options.rope, in place, to the projected queries (rows of `q`, query_len per batch) and
// the input keys' rows of `k` (the first key_len of each batch's S'); inverse turns gradients
// with respect to the rotated rows into gradients with respect to the unrotated ones.
template <class T>
void rotate_queries_and_keys(const LayerParameters<T>& parameters, const ForwardPlan& plan,
                             const ForwardOptions<T>& options, Workspace<T>& workspace,
                             compute_t<T>* q, Index q_stride, compute_t<T>* k, Index kv_stride,
                             bool inverse) {
  const Rope& rope = *options.rope;
  const Index head_dim = parameters.head_dim();
  const Index rotary_dim = checked_rotary_dim(rope, head_dim);
  const bool bottom_right = options.causal_alignment == Alignment::bottom_right;
  if (!plan.sequences.empty()) {
    // Each sequence's positions from 0, as in a call of its own; the tables are filled again for
    // the inverse, as they end up holding the last sequence's.
    for (const PackedSequence& sequence : plan.sequences) {
      workspace.rope_queries.fill(rope, rotary_dim,
                                  bottom_right ? sequence.key_len - sequence.query_len : 0,
                                  sequence.query_len);
      workspace.rope_keys.fill(rope, rotary_dim, 0, sequence.key_len);
      rotate_heads(q + sequence.query_begin * q_stride, sequence.query_len, q_stride,
                   parameters.num_heads(), head_dim, workspace.rope_queries, inverse);
      rotate_heads(k + sequence.key_begin * kv_stride, sequence.key_len, kv_stride,
                   parameters.num_kv_heads(), head_dim, workspace.rope_keys, inverse);
    }
    return;
  }
  const Index query_shift = bottom_right ? plan.key_len - plan.query_len : 0;
  // backward (inverse) runs on the saved workspace whose tables forward_train filled for the
  // same plan and options: only the forward computes the angles.
  if (!inverse) {
    workspace.rope_queries.fill(rope, rotary_dim, query_shift, plan.query_len);
    workspace.rope_keys.fill(rope, rotary_dim, 0, plan.key_len);
  }
  for (Index b = 0; b < plan.batch; ++b) {
    rotate_heads(q + b * plan.query_len * q_stride, plan.query_len, q_stride,
                 parameters.num_heads(), head_dim, workspace.rope_queries, inverse);
    rotate_heads(k + b * plan.total_keys * kv_stride, plan.key_len, kv_stride,
                 parameters.num_kv_heads(), head_dim, workspace.rope_keys, inverse);
  }
}

// [B, H, L, S'] -> [B, L, S'], the mean over heads.
template <class Compute>
void average_over_heads(const Tensor<Compute>& per_head, Tensor<Compute>& averaged) {
  const Index batch = per_head.dim(0), heads = per_head.dim(1);
  const Index rows = per_head.dim(2), cols = per_head.dim(3);
  averaged.resize({batch, rows, cols});
  for (Index b = 0; b < batch; ++b) {
    auto sum = averaged[b].matrix();
    sum.setZero();
    for (Index h = 0; h < heads; ++h) sum += per_head[b][h].matrix();
    sum /= static_cast<Compute>(heads);
  }
}

// The forward pass proper, after plan_forward and core_options: into result, with workspace's
// buffers; logsumexp is null or (B, H, L) for the flash kernel's backward; packed is null or a
// frozen layer's packed weights (the same results, bit for bit); flex: a user's mods
// (flex_layer.hpp's flex_forward), which the flash kernel takes, seeing a packed batch's sequence
// s as batch element s.
template <class T, class Flex = NoFlex>
void run_forward(const LayerParameters<T>& parameters, const ForwardPlan& plan,
                 const CoreOptions<compute_t<T>>& core, const TensorView<const T>& query,
                 const TensorView<const T>& key, const TensorView<const T>& value,
                 const ForwardOptions<T>& options, Workspace<T>& workspace,
                 ForwardResult<T>& result, compute_t<T>* logsumexp, const PackedProjections* packed,
                 const Flex& flex = {}) {
  using Compute = compute_t<T>;
  const ParameterSet<T>& values = parameters.values();
  const Index heads = parameters.num_heads(), inner = parameters.inner_dim();
  const Index kv_width = parameters.kv_dim();
  const Index batch = plan.batch, query_len = plan.query_len, total_keys = plan.total_keys;
  Compute* q_data;
  Compute* k_data;
  Compute* v_data;
  Index q_stride = inner, kv_stride = kv_width;
  // The projections' arithmetic (refusing Precision::int8 without int8 weights, before anything
  // is computed): projection `which` (3 = the output's) in bf16 by a frozen layer's bf16 panels
  // or by its weight packed at this call; in int8 by a frozen layer's int8 panels; else in fp32,
  // on a frozen float layer's fp32 panels where it has them (and its int8 values,
  // FrozenWeights::int8, for a product of a few rows).
  const ProjectionArithmetic arithmetic = projection_arithmetic(options.precision, packed);
  const bool bf16 = arithmetic == ProjectionArithmetic::bf16;
  Fp16Scratch* const fp16 = arithmetic == ProjectionArithmetic::fp16 ? &workspace.fp16 : nullptr;
  workspace.bf16.forget();
  workspace.fp16.forget();
  const auto route = [&](int which) {
    ProjectionRoute chosen =
        projection_route(packed, arithmetic, workspace.bf16, workspace.int8, which);
    chosen.fp16 = fp16;
    return chosen;
  };
  if (plan.fused) {
    // [B*L, H·D + 2·H_kv·D]: heads read q, k and v at their column offsets.
    Matrix<Compute>& qkv = workspace.qkv;
    qkv.resize(batch * query_len, inner + 2 * kv_width);
    const ConstStridedMap<Compute> input = const_strided(as_compute(query, workspace.query));
    // A frozen layer's packings serve each projection apart.
    const bool per_projection =
        packed != nullptr &&
        (bf16 ? !packed->bf16_query.empty()
              : runs_prepacked(packed->query, qkv.rows()) ||
                    (!packed->int8_query.empty() && few_rows_product(qkv.rows(), inner)) ||
                    arithmetic == ProjectionArithmetic::int8);
    if (per_projection) {
      // Three products into qkv's column blocks: an element's sums are the same wherever the
      // columns are cut.
      for (int which = 0; which < 3; ++which) {
        project_rows<Compute>(strided(qkv.middleCols(parameters.bias_offset(which),
                                                     parameters.projection_width(which))),
                              input, parameters.weight_rows(which), route(which), workspace.kernel);
      }
    } else {
      // One product: W_q, W_k and W_v are in_proj_weight's row blocks.
      project_rows<Compute>(strided(qkv), input, values.in_proj_weight.matrix(),
                            ProjectionRoute{nullptr, bf16 ? &workspace.bf16 : nullptr, fp16},
                            workspace.kernel);
    }
    if (parameters.config().bias) {
      qkv.rowwise() += values.in_proj_bias.flat().transpose().template cast<Compute>();
    }
    q_data = qkv.data();
    k_data = offset_pointer(q_data, parameters.bias_offset(1));
    v_data = offset_pointer(q_data, parameters.bias_offset(2));
    q_stride = kv_stride = inner + 2 * kv_width;
  } else {
    // q [B*L, H·D]; k, v [B*S', H_kv·D] with the extra rows after each batch's S projected rows.
    workspace.q.resize(batch * query_len, inner);
    project_rows<Compute>(strided(workspace.q), const_strided(as_compute(query, workspace.query)),
                          parameters.weight_rows(0), route(0), workspace.kernel);
    add_bias(parameters, workspace.q, 0);
    project_keys(parameters, as_compute(key, workspace.key), 1, batch, plan.key_len, total_keys,
                 values.bias_k, workspace.k, workspace.kernel, route(1));
    project_keys(parameters, as_compute(value, workspace.value), 2, batch, plan.key_len, total_keys,
                 values.bias_v, workspace.v, workspace.kernel, route(2));
    q_data = workspace.q.data();
    k_data = workspace.k.data();
    v_data = workspace.v.data();
  }

  if (options.rope) {
    rotate_queries_and_keys(parameters, plan, options, workspace, q_data, q_stride, k_data,
                            kv_stride, false);
  }

  // Per-head weights go straight into the result unless they are to be averaged (or converted
  // to 16 bits).
  Tensor<Compute>* per_head_weights = &workspace.per_head_weights;
  if constexpr (!is_16bit_v<T>) {
    if (options.need_weights && !options.average_attn_weights) {
      per_head_weights = &result.attn_weights;
    }
  }
  if (options.need_weights) per_head_weights->resize({batch, heads, query_len, total_keys});
  workspace.attended.resize(batch * query_len, inner);
  // count batch elements' heads (sequence s of a packed batch: count 1) by the planned kernel, or
  // with mods by the flash kernel.
  const auto attend = [&](Index count, Index sequence, const HeadLayout<const Compute>& q,
                          const HeadLayout<const Compute>& k, const HeadLayout<const Compute>& v,
                          const HeadLayout<Compute>& out, const CoreOptions<Compute>& options_here,
                          Compute* weights, Compute* sequence_logsumexp) {
    if constexpr (Flex::kActive) {
      Flex sequence_flex = flex;
      sequence_flex.batch_offset = sequence;
      attention_flash_with_sinks<Compute, Compute>(count, heads, q, k, v, out, options_here,
                                                   workspace.kernel, sequence_logsumexp,
                                                   sequence_flex);
      arguments_unused(weights);
    } else {
      arguments_unused(sequence);
      attention<Compute>(plan.kernel, count, heads, q, k, v, out, options_here, weights,
                         workspace.kernel, sequence_logsumexp);
    }
  };
  if (plan.sequences.empty()) {
    attend(batch, 0, parameters.template head_layout<const Compute>(q_data, query_len, q_stride),
           parameters.template kv_head_layout<const Compute>(k_data, total_keys, kv_stride),
           parameters.template kv_head_layout<const Compute>(v_data, total_keys, kv_stride),
           parameters.head_layout(workspace.attended.data(), query_len, inner), core,
           options.need_weights ? per_head_weights->data() : nullptr, logsumexp);
  }
  // A packed batch: each sequence's rows, and its log-sum-exp (H, L_s) at H·query_begin.
  for (std::size_t s = 0; s < plan.sequences.size(); ++s) {
    const PackedSequence& sequence = plan.sequences[s];
    if (sequence.query_len == 0) continue;
    attend(1, static_cast<Index>(s),
           parameters.template head_layout<const Compute>(q_data + sequence.query_begin * q_stride,
                                                          sequence.query_len, q_stride),
           parameters.template kv_head_layout<const Compute>(
               k_data + sequence.key_begin * kv_stride, sequence.key_len, kv_stride),
           parameters.template kv_head_layout<const Compute>(
               v_data + sequence.key_begin * kv_stride, sequence.key_len, kv_stride),
           parameters.head_layout(workspace.attended.data() + sequence.query_begin * inner,
                                  sequence.query_len, inner),
           sequence_core(core, options.pattern, heads, sequence, s), nullptr,
           logsumexp != nullptr ? logsumexp + heads * sequence.query_begin : nullptr);
  }

  // With a gate, the output projection reads a gated copy: attended itself stays ungated, as
  // backward needs it for the gates' gradient.
  const Matrix<Compute>* heads_output = &workspace.attended;
  if (!options.head_gate.empty()) {
    workspace.gated = workspace.attended;
    scale_heads(workspace.gated, options.head_gate, parameters.head_dim());
    heads_output = &workspace.gated;
  }
  result.output.resize(plan.query_shape);
  project_output(parameters, *heads_output, result.output, workspace.output, workspace.kernel,
                 route(3));

  if (!options.need_weights) {
    result.attn_weights = Tensor<T>();
    return;
  }
  for (Index h = 0; h < static_cast<Index>(options.head_gate.size()); ++h) {
    for (Index b = 0; b < batch; ++b) {
      (*per_head_weights)[b][h].matrix() *= options.head_gate[static_cast<std::size_t>(h)];
    }
  }
  if constexpr (is_16bit_v<T>) {
    const Tensor<Compute>* weights = per_head_weights;
    if (options.average_attn_weights) {
      average_over_heads(*per_head_weights, workspace.weights);
      weights = &workspace.weights;
    }
    result.attn_weights.resize(weights->shape());
    narrow(weights->data(), weights->size(), result.attn_weights.data());
  } else if (options.average_attn_weights) {
    average_over_heads(*per_head_weights, result.attn_weights);
  }
  if (!plan.batched) {
    // Drop the batch axis of size 1: [1, ...] -> [...].
    Shape unbatched(result.attn_weights.shape().begin() + 1, result.attn_weights.shape().end());
    result.attn_weights.reshape(std::move(unbatched));
  }
}

// The instantiations mha::compiled holds (src/layer_forward.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_LAYER_FORWARD_TEMPLATES(PREFIX, T)                                            \
  PREFIX template ForwardPlan plan_forward<T>(                                            \
      const LayerParameters<T>&, const TensorView<const T>&, const TensorView<const T>&,  \
      const TensorView<const T>&, const ForwardOptions<T>&, bool);                        \
  PREFIX template CoreOptions<compute_t<T>> core_options<T>(                              \
      const LayerParameters<T>&, const ForwardPlan&, const ForwardOptions<T>&);           \
  PREFIX template void run_forward<T>(                                                    \
      const LayerParameters<T>&, const ForwardPlan&, const CoreOptions<compute_t<T>>&,    \
      const TensorView<const T>&, const TensorView<const T>&, const TensorView<const T>&, \
      const ForwardOptions<T>&, Workspace<T>&, ForwardResult<T>&, compute_t<T>*,          \
      const PackedProjections*, const NoFlex&);
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_LAYER_TYPES, MHA_LAYER_FORWARD_TEMPLATES)

}  // namespace mha::detail
