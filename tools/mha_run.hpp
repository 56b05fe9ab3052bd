// What mha_run does, as a function: one safetensors file in (a PyTorch nn.MultiheadAttention's
// state_dict, its inputs, masks and options, optionally an upstream gradient), one out (its
// output and attention weights, and then the gradients).
// Kept apart from main() so the tests and the fuzz target run the same code in-process; compiled
// once (run_multihead_attention.cpp, library mha_run_logic) for the tool, its tests and its fuzz
// target.
#pragma once

#include <set>
#include <string>

#include "mha/io/safetensors.hpp"

namespace mha::tools {

inline const char* const kMhaRunHelp = R"(usage: mha_run IN.safetensors OUT.safetensors

Runs torch.nn.MultiheadAttention(batch_first=True) forward (and, given grad_output, backward) in
C++ with the mha library, so that an attention layer exported from PyTorch can be checked to give
the same numbers.

IN holds:
  parameters under their state_dict names: in_proj_weight [3E, E] (or q_proj_weight [E, E],
    k_proj_weight [E, kdim], v_proj_weight [E, vdim]), in_proj_bias [3E], out_proj.weight [E, E],
    out_proj.bias [E], bias_k and bias_v [1, 1, E]. Which are present decides bias, add_bias_kv,
    kdim and vdim.
  grouped-query attention (H_kv key/value heads, a divisor of H; 1 = multi-query; query head h
    reads key/value head h / (H / H_kv)): always q_proj_weight [E, E], k_proj_weight
    [H_kv*D, kdim], v_proj_weight [H_kv*D, vdim] (D = E / H), in_proj_bias [E + 2*H_kv*D] (q, k,
    then v entries), bias_k and bias_v [1, 1, H_kv*D]. H_kv is the rows of k_proj_weight / D.
  talking heads (Shazeer et al. 2020; no PyTorch module has them): talking_heads_pre [H, H], which
    mixes the heads' logits before the masks and the softmax (head g's logits become
    sum_h pre[g, h] * logits_h), and/or talking_heads_post [H, H], which mixes their weights after
    it; each present one is used (and gets a grad.* with grad_output). They need the reference
    kernel: kernel auto picks it, flash is refused.
  a layer whose heads were pruned (MultiHeadAttention::prune_heads): H*D != E, the heads' rows
    of the projections and the columns of out_proj.weight [E, H*D] shrink; D is read from
    out_proj.weight's columns / num_heads.
  query [B, L, E], key [B, S, kdim], value [B, S, vdim]  (or unbatched [L, E], [S, kdim], [S, vdim])
  key_padding_mask [B, S] ([S] unbatched), optional
  attn_mask [L, S] or [B*H, L, S] ([H, L, S] unbatched), optional
    masks are BOOL with true = blocked (PyTorch MHA's convention), or float, added to the scores.
  grad_output, the shape of output ([B, L, E] or [L, E]), optional: the upstream gradient.
  __metadata__: num_heads (required); num_kv_heads (optional, a positive integer: when present it
    must be the H_kv that k_proj_weight gives, num_heads with in_proj_weight); and each "0" or
    "1": add_zero_attn (default 0),
    need_weights (default 1), average_attn_weights (default 1), is_causal (default 0: when 1, the
    top-left causal mask, key j > query i blocked, is applied on top of any attn_mask);
    kernel: auto (default: flash without weights, reference with), reference or flash
    (flash cannot return weights, so it needs need_weights "0");
    precision: fp32 (default), bf16, int8 or fp16: bf16 runs the projections and the flash
    kernel's products with operands rounded to bf16 and fp32 sums, softmax in fp32 (within about
    1e-2 of the largest output; fp32 where the CPU lacks AVX512_BF16), with grad_output the
    backward's projection products too (mixed-precision training); int8 (with weights int8) the
    projections as int8 x int8 products, the inputs' rows quantized per row (fp32 on the
    quantized weights where the CPU lacks AVX512_VNNI), without grad_output only; fp16 (with
    grad_output only: training) the projections' products, forward and backward, on operands
    rounded to fp16 with fp32 sums, the attention in fp32;
    weights: as_given (default) or int8: the projection weights quantized to int8, one scale per
    output row (FrozenWeights::int8: the layer runs on the quantized weights; F32 files without
    grad_output only).
  Modern attention options in __metadata__, each optional; c below is the position key j is
  compared with: c = i (query i) with causal_alignment top_left, c = i + S - L with bottom_right.
  They apply to the S input keys only: the bias_k and zero-attention columns are never blocked by
  is_causal or the window and get no ALiBi bias.
    causal_alignment: top_left (default; is_causal blocks key j > i, as PyTorch SDPA) or
      bottom_right (blocks j > i + S - L, as FlashAttention >= 2.1 and a KV-cache step). It also
      aligns the window, the sparse pattern and ALiBi.
    window_left, window_right: integers >= -1 (default -1 = unbounded on that side): local
      attention with FlashAttention's inclusive convention, query i sees key j only where
      c - window_left <= j <= c + window_right (window_left w - 1 with window_right 0 is a causal
      sliding window of w keys). Combines with is_causal and the masks: a key is visible only
      where all of them allow it.
    window_dilation: a positive integer d (default 1): a dilated window, where only keys at a
      distance |c - j| that is a multiple of d are visible, within window_left and window_right.
    global_tokens: comma-separated positions in increasing order, e.g. "0,1,64" (default none):
      global tokens (Longformer, BigBird), which see every key and which every query sees, over
      the window and the block layout; is_causal and the masks still apply to them. The query at
      c is global when c is listed, key j when j is.
    block_size: a positive integer b, with the block_layout tensor (and only with it).
    block_layout [R, C] or [H, R, C] (tensor, BOOL, true = computed), optional: block-sparse
      attention; the query at c sees key j only where block_layout[(h,) c / b, j / b] is true
      (and the window allows). R * b must exceed the last query's c and C * b be at least S.
    alibi: "0" (default) or "1": ALiBi with the paper's slopes for H heads (2^(-8 (h + 1) / H)
      for H a power of two, else BLOOM's rule), adding -slope_h * |c - j| to head h's scores.
    alibi_slopes [H] (tensor, query's dtype), optional: ALiBi with these slopes instead. With it
      the alibi key must be absent: "1" (the paper's slopes) or "0" (none) would contradict it.
    softcap: a finite number >= 0 (default 0 = none), e.g. "50": logit soft-capping (Gemma 2),
      each scaled score s = q k / sqrt(D) becomes softcap * tanh(s / softcap) before the masks,
      is_causal, the window and ALiBi apply, on every column including bias_k and zero attention.
    rope_base: a finite number > 0, e.g. "10000": rotary position embeddings of the projected
      queries and keys (after the in-projection biases; bias_k and the zero key are not rotated),
      input key j at position j and query i at c. Absent (the default) means none.
    rope_interleaved: "0" (default: rotate-half pairs (k, k + R/2), as Hugging Face's Llama and
      GPT-NeoX) or "1" (pairs (2k, 2k + 1), as GPT-J and Meta's Llama). Needs rope_base.
    rope_dim: an even positive integer R <= D (default D): only the first R features of each head
      rotate (partial rotary, GPT-NeoX's rotary_pct). Needs rope_base.
  head_mask [H] (tensor, query's dtype), optional: per-head gates, as Hugging Face's head_mask:
    head h's weights, so its output, are multiplied by head_mask[h] (0 removes the head); the
    weights written are the gated ones. With grad_output, OUT also holds grad.head_mask, the
    gradient from which head importance is scored (Michel et al. 2019).
The dtype of query decides the arithmetic: F32 computes in float, F64 in double. key, value and
float masks and grad_output must have that dtype too; parameters may be F32, F64, F16 or BF16
(converted).

OUT holds output (the rank of query) and, when need_weights is 1, attn_weights: [B, L, S'] averaged
over heads or [B, H, L, S'] per head (no B axis when unbatched), S' = S + add_bias_kv + add_zero_attn.
Where every key of a query row is blocked in a head, its weights and output are 0 (PyTorch: NaN).
With grad_output, OUT also holds the gradients of loss = sum(output * grad_output), as PyTorch's
autograd gives them with dropout 0: grad.query, grad.key and grad.value (the shapes of query, key
and value; reported apart even when the three hold the same values, their sum is then the gradient
of the shared tensor), and grad.<name> for every parameter in IN (in_proj_weight, in_proj_bias,
out_proj.weight, ...), in the parameter's shape and in query's dtype. Masks get no gradient.

Exit status 0 on success; 1 with one line on stderr for any bad input or file.
)";

// Throws mha::ShapeError or mha::io::FileError for bad input.
io::SafetensorsFile run_multihead_attention(const io::SafetensorsFile& in);

namespace detail {

// The tensor names of IN that are not parameters: inputs, masks, option tensors, grad_output.
const std::set<std::string>& input_names();

}  // namespace detail
}  // namespace mha::tools
