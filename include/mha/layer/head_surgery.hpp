// Head surgery ("Are Sixteen Heads Really Better than One?", Michel et al. 2019): removing heads
// from a layer's parameters. Head h owns rows h·D .. h·D + D - 1 of W_q, W_k, W_v, of their
// biases and of bias_k/bias_v, and the same columns of out_proj.weight [E, H·D]; removing H - H'
// heads leaves those of the H' others, in order, and the layer computes what it computed with
// the removed heads gated to 0.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/layer/parameters.hpp"

namespace mha::detail {

// Removes `heads` (indices in [0, H), each once, at least one head left) from `parameters`, whose
// gradients are dropped. Refused for grouped-query layers and with talking heads (see
// MultiHeadAttention::prune_heads).
template <class T>
void prune_heads(LayerParameters<T>& parameters, const std::vector<Index>& heads) {
  const MultiHeadAttentionConfig& config = parameters.config();
  const Index count = config.num_heads, width = config.head_dim;
  if (config.talking_heads_pre || config.talking_heads_post) {
    throw_argument("prune_heads",
                   "with talking heads every head reads every other head's logits or weights, so "
                   "removing a head is not gating it: gate it instead (ForwardOptions::head_gate)");
  }
  if (config.num_kv_heads != count) {
    throw_argument("prune_heads", "a grouped-query layer (" + std::to_string(config.num_kv_heads) +
                                      " key/value heads for " + std::to_string(count) +
                                      " query heads) shares key/value heads between query heads: "
                                      "gate its heads instead (ForwardOptions::head_gate)");
  }
  std::vector<bool> removed(static_cast<std::size_t>(count), false);
  for (const Index h : heads) {
    if (h < 0 || h >= count) {
      throw_argument("heads", "expected head indices in [0, " + std::to_string(count) + "), got " +
                                  std::to_string(h));
    }
    if (removed[static_cast<std::size_t>(h)]) {
      throw_argument("heads", "head " + std::to_string(h) + " is listed twice");
    }
    removed[static_cast<std::size_t>(h)] = true;
  }
  std::vector<Index> kept;
  for (Index h = 0; h < count; ++h) {
    if (!removed[static_cast<std::size_t>(h)]) kept.push_back(h);
  }
  if (kept.empty()) {
    throw_argument("heads",
                   "would remove all " + std::to_string(count) + " heads: at least one must stay");
  }
  if (heads.empty()) return;

  MultiHeadAttentionConfig pruned = config;
  pruned.num_heads = pruned.num_kv_heads = static_cast<Index>(kept.size());
  pruned.head_dim = width;
  LayerParameters<T> next(pruned);  // the new shapes; every element is copied below
  const ParameterSet<T>& from = parameters.values();
  ParameterSet<T>& to = next.values();
  for (std::size_t i = 0; i < kept.size(); ++i) {
    const Index source = kept[i] * width, target = static_cast<Index>(i) * width;
    for (int which = 0; which < 3; ++which) {
      next.projection(to, which).middleRows(target, width) =
          parameters.weight_rows(which).middleRows(source, width);
      if (config.bias) {
        to.in_proj_bias.flat().segment(next.bias_offset(which) + target, width) =
            from.in_proj_bias.flat().segment(parameters.bias_offset(which) + source, width);
      }
    }
    if (config.add_bias_kv) {
      to.bias_k.flat().segment(target, width) = from.bias_k.flat().segment(source, width);
      to.bias_v.flat().segment(target, width) = from.bias_v.flat().segment(source, width);
    }
    to.out_proj_weight.matrix().middleCols(target, width) =
        from.out_proj_weight.matrix().middleCols(source, width);
    if (config.learnable_sinks) to.sinks.data()[i] = from.sinks.data()[kept[i]];
  }
  if (config.bias) to.out_proj_bias = from.out_proj_bias;
  parameters = std::move(next);
}

// The instantiations mha::compiled holds (src/layer_forward.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_HEAD_SURGERY_TEMPLATES(PREFIX, T) \
  PREFIX template void prune_heads<T>(LayerParameters<T>&, const std::vector<Index>&);
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_LAYER_TYPES, MHA_HEAD_SURGERY_TEMPLATES)

}  // namespace mha::detail
