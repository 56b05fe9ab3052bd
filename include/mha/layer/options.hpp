// What one call of the layer takes and gives besides the tensors: ForwardOptions (masks, causal
// masking, windows, sparse patterns, position biases, gates, the kernel), ForwardResult (output
// and weights), and the Workspace whose buffers repeated calls reuse.
#pragma once

#include <optional>
#include <vector>

#include "mha/attention.hpp"
#include "mha/kernels/bf16_projection.hpp"
#include "mha/kernels/common.hpp"
#include "mha/kernels/fp16_products.hpp"
#include "mha/kernels/int8_gemm.hpp"
#include "mha/mask.hpp"
#include "mha/rotary.hpp"
#include "mha/tensor.hpp"

namespace mha {

// Masks, slopes, the cap and gates are in the type the layer computes in: float for a 16-bit
// layer (ForwardOptions<Eigen::half> holds Mask<float>), T otherwise.
template <class T>
struct ForwardOptions {
  using Compute = detail::compute_t<T>;
  // [B, S] ([S] unbatched). PyTorch MHA passes booleans with true = ignore this key:
  // Mask<T>::blocked_where_true. A float one is added to the scores (PyTorch 2.x).
  Mask<Compute> key_padding_mask;
  // [L, S] for every batch and head, or [B*H, L, S] indexed by b*H + h ([H, L, S] unbatched).
  Mask<Compute> attn_mask;
  bool need_weights = true;
  // Weights averaged over heads [B, L, S'] when true, per head [B, H, L, S'] when false.
  bool average_attn_weights = true;
  // Applies the top-left causal mask (query i sees input keys j <= i) itself, on top of
  // attn_mask. Unlike PyTorch 2.x, where is_causal is only a hint about attn_mask.
  bool is_causal = false;
  // bottom_right aligns is_causal's diagonal with the last key (query i sees j <= i + S - L), as
  // FlashAttention and a decoding step with cached keys need.
  Alignment causal_alignment = Alignment::top_left;
  // Local (sliding-window) attention over the S input keys, see Window in mask.hpp.
  Window window;
  // Global tokens and block-sparse layouts over the S input keys, see SparsePattern in mask.hpp.
  SparsePattern pattern;
  // ALiBi (BLOOM, MPT): empty, or one slope per head (alibi_slopes<T>(H) gives the paper's);
  // adds -slope_h * |c - j| to head h's scores of the input keys, c = i or i + S - L
  // (causal_alignment). bias_k and the zero key get no position bias.
  std::vector<Compute> alibi_slopes;
  // Logit soft-capping (Gemma 2): each head's scores become c tanh(q kᵀ / sqrt(D) / c) before
  // masks and biases; 0 = none.
  Compute softcap = Compute(0);
  // Rotary embeddings (see rotary.hpp) of the projected queries and keys, after the biases: input
  // key j is at position j, query i at c (i, or i + S - L bottom-right, as for ALiBi), both plus
  // rope->position_offset. bias_k and the zero key are not rotated.
  std::optional<Rope> rope;
  // Head gating (Michel et al. 2019; Hugging Face's head_mask): empty, or one gate per head that
  // multiplies head h's weights and so its output (0 removes the head, fractions scale it). The
  // returned weights are the gated ones, averaged over all H heads. backward also returns the
  // gates' gradient, from which head importance is computed (diagnostics.hpp).
  std::vector<Compute> head_gate;
  // A packed variable-length batch (FlashAttention's varlen functions, PyTorch's jagged tensors):
  // empty, or the cumulative lengths 0, L_0, L_0 + L_1, ..., T of the sequences packed one after
  // another in an unbatched query [T, E]. Each sequence attends to its own keys only and nothing
  // is padded: the projections run over the T rows at once, the heads over each sequence's.
  // Causal masking, windows, patterns, ALiBi, RoPE positions and dropout apply per sequence, as
  // if each were a call of its own. cu_seqlens_k gives the keys' (key [T_k, kdim], value
  // [T_k, vdim]) where they differ (cross-attention); empty means cu_seqlens. Refused with masks
  // (a packed batch needs no padding mask), need_weights, add_bias_kv, add_zero_attn and talking
  // heads. decode takes cu_seqlens too (a packed step: x [T, E], one count per sequence).
  std::vector<Index> cu_seqlens, cu_seqlens_k;
  // Which kernel computes the heads; automatic picks flash unless weights are requested.
  Kernel kernel = Kernel::automatic;
  // The products' arithmetic (see Precision in attention.hpp): bf16 rounds the operands of the
  // projections and of the flash kernel's products (float and 16-bit layers alike; the reference
  // kernel, which returns weights, and the small-head kernel, D <= 16, keep fp32); int8 runs the
  // projections of a frozen layer with int8 weights as int8 × int8 products. forward_train
  // refuses both, a MultiHeadAttention's decode too (a frozen layer's takes them).
  Precision precision = Precision::fp32;
  // Refuse NaN and Inf in the inputs (query, key, value; decode's x) and NaN and +inf in additive
  // masks, with a NonFiniteError naming the tensor and the first bad element, before anything is
  // computed. It reads every input element once, which costs little beside the projections. Off,
  // as in PyTorch: a NaN or Inf then spreads only within its batch element. In query row i it
  // reaches output row i only. In key or value row j it reaches every output row of that batch
  // element that attends to key j, and may reach rows that mask it (a masked score is the score
  // plus -inf, and a weight of 0 times a NaN value is NaN); which ones depends on the kernel, as
  // the flash kernel never reads key blocks a mask hides wholly. A row that reads a NaN never
  // comes out finite. Other batch elements' outputs are unchanged, bit for bit.
  bool check_inputs = false;
};

template <class T>
struct ForwardResult {
  Tensor<T> output;        // [B, L, E] ([L, E] unbatched)
  Tensor<T> attn_weights;  // see ForwardOptions::average_attn_weights; empty unless need_weights
};

// Buffers a forward call needs besides its result. Pass the same Workspace (and result) to
// repeated forward calls with the same shapes and they allocate no tensor memory. A Workspace
// belongs to one calling thread at a time; the layer itself may be shared.
template <class T>
struct Workspace {
  using Compute = detail::compute_t<T>;
  Matrix<Compute> qkv, q, k, v;  // projections: fused [B*L, 3E], or q [B*L, E], k and v [B*S', E]
  Matrix<Compute> attended;      // the heads' outputs side by side, [B*L, E]
  Matrix<Compute> gated;         // attended with head_gate applied (only with a gate)
  Tensor<Compute> per_head_weights;
  // 16-bit layers only: the inputs, the output and the averaged weights in float.
  Matrix<Compute> query, key, value, output;
  Tensor<Compute> weights;
  detail::RopeTable<Compute> rope_queries, rope_keys;
  std::vector<detail::KernelScratch<Compute>> kernel;  // one per thread
  // Precision::bf16: a weight packed for this call, and the rows being projected; int8: the rows
  // quantized; fp16: a weight and rows rounded.
  detail::Bf16Scratch bf16;
  detail::Int8Scratch int8;
  detail::Fp16Scratch fp16;
};

}  // namespace mha
