// MultiHeadAttentionConfig: the constructor arguments of torch.nn.MultiheadAttention and what this
// library adds to them (grouped-query heads, a head width of its own, talking heads), and the
// checks that turn a config with defaults (0 = "as PyTorch derives it") into a complete one.
#pragma once

#include <cstdint>
#include <string>

#include "mha/attention.hpp"
#include "mha/errors.hpp"

namespace mha {

// The constructor arguments of torch.nn.MultiheadAttention; kdim and vdim of 0 mean embed_dim.
// dropout is the probability of dropping an attention weight in forward_train (never in
// forward, PyTorch's eval mode). seed drives the default initialisation and the dropout draws.
// num_kv_heads (H_kv, 0 = num_heads) makes it grouped-query attention (multi-query for 1), as in
// Llama: key and value are projected to H_kv·D features, and query head h reads key/value head
// h / (H / H_kv); the parameters are then q_proj_weight [E, E], k_proj_weight [H_kv·D, kdim],
// v_proj_weight [H_kv·D, vdim], in_proj_bias [E + 2·H_kv·D], bias_k/bias_v [1, 1, H_kv·D].
struct MultiHeadAttentionConfig {
  Index embed_dim = 0;
  Index num_heads = 0;
  bool bias = true;
  bool add_bias_kv = false;
  bool add_zero_attn = false;
  Index kdim = 0;
  Index vdim = 0;
  Index num_kv_heads = 0;
  // D, the width of each head; 0 means embed_dim / num_heads (PyTorch's only choice). Another D
  // decouples the heads' total width H·D from E: q_proj_weight is then [H·D, E] and
  // out_proj.weight [E, H·D], as a layer after prune_heads has them.
  Index head_dim = 0;
  // Talking-heads attention (Shazeer et al. 2020): learned [H, H] mixes of the heads' logits
  // before the softmax (talking_heads_pre) and of their weights after it (talking_heads_post),
  // each initialised to the identity, so that a new layer computes plain attention. Every head
  // then reads every other, so the reference kernel computes it (Kernel::flash is refused) and
  // prune_heads is refused.
  bool talking_heads_pre = false;
  bool talking_heads_post = false;
  // Learnable attention sinks (gpt-oss; kernels/sinks.hpp): a parameter "sinks" [H], one logit
  // per query head that joins each row's softmax as a column whose value is zero, so a head may
  // attend to nothing. Initialised to 0. Not with talking heads, nor in a 16-bit layer.
  bool learnable_sinks = false;
  double dropout = 0;
  std::uint64_t seed = 0;

  MultiHeadAttentionConfig() = default;
  MultiHeadAttentionConfig(Index embed_dim_, Index num_heads_)
      : embed_dim(embed_dim_), num_heads(num_heads_) {}
};

namespace detail {

// The config with its defaults made explicit (head_dim, num_kv_heads, kdim and vdim), after
// checking every argument; throws ShapeError naming the first bad one.
inline MultiHeadAttentionConfig completed_config(MultiHeadAttentionConfig config) {
  const Index embed = config.embed_dim;
  if (embed <= 0) throw_argument("embed_dim", "must be positive, got " + std::to_string(embed));
  if (config.num_heads <= 0) {
    throw_argument("num_heads", "must be positive, got " + std::to_string(config.num_heads));
  }
  if (config.head_dim < 0) {
    throw_argument("head_dim", "must be positive (or 0 for embed_dim / num_heads), got " +
                                   std::to_string(config.head_dim));
  }
  if (config.head_dim == 0 && embed % config.num_heads != 0) {
    throw_argument("num_heads", "embed_dim " + std::to_string(embed) +
                                    " is not divisible by num_heads " +
                                    std::to_string(config.num_heads));
  }
  if (config.head_dim == 0) config.head_dim = embed / config.num_heads;
  if (config.kdim < 0 || config.vdim < 0) {
    throw_argument("kdim/vdim", "must be positive (or 0 for embed_dim), got " +
                                    std::to_string(config.kdim) + "/" +
                                    std::to_string(config.vdim));
  }
  check_dropout(config.dropout);
  if (config.num_kv_heads < 0 ||
      (config.num_kv_heads > 0 && config.num_heads % config.num_kv_heads != 0)) {
    throw_argument("num_kv_heads", "must divide num_heads " + std::to_string(config.num_heads) +
                                       " (or be 0 for num_heads), got " +
                                       std::to_string(config.num_kv_heads));
  }
  if (config.num_kv_heads == 0) config.num_kv_heads = config.num_heads;
  if (config.learnable_sinks && (config.talking_heads_pre || config.talking_heads_post)) {
    throw_argument("learnable_sinks",
                   "do not combine with talking heads (the talking-heads "
                   "kernel has no sink column)");
  }
  if (config.kdim == 0) config.kdim = embed;
  if (config.vdim == 0) config.vdim = embed;
  return config;
}

}  // namespace detail
}  // namespace mha
