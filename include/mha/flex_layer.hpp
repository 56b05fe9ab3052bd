// A layer's forward and decoding with user mods (flex.hpp): MultiHeadAttention's forward
// (layer/forward.hpp) and decode step (layer/decode.hpp) whose attention applies a score_mod and
// a mask to every score, in the flash kernel (a forward, a prompt) and in the decoding kernel's
// pass over the whole batch (a step of a few tokens).
//
// flex_forward: the mods see batch element b (of a packed batch, ForwardOptions::cu_seqlens: its
// sequence b), query head h, and q_idx, kv_idx counting from 0 in the (sequence's) queries and
// keys, as flex_attention over the layer's projected heads. A BlockMask must cover the longest
// sequence: built for at least its L and S, and a batch and heads of 1 or the call's.
//
// flex_decode: the mods see sequence b of the step as batch element b (for a paged cache, the b-th
// id of `sequences`), query head h, and positions as rows of the sequence's cache: the step's new
// token i of n is q_idx = length - n + i (length counting the new tokens), and kv_idx = 0 .. length
// - 1. For a cache of a whole sequence (KVCache, PagedKVCache) these are the tokens' positions in
// the sequence, so that a mod written for flex_attention over the whole sequence (q_idx and kv_idx
// from 0) gives the same attention token by token; in a streaming cache they are its rows.
//
// The mask: a mask_mod, or a BlockMask built once for the longest sequence (as FlexAttention's
// decoding slices one). The decoding kernel reads no chunk of 240 cached keys that no query of the
// step sees, which it learns from the block mask's blocks or by calling the mask_mod for the
// chunk's keys; the flash kernel (a forward, a prompt) skips the block mask's empty blocks, and
// calls a mask_mod given alone for every pair. AllVisible (the default) masks nothing. The
// built-in options (causal masking, windows, ALiBi, softcap, sinks, RoPE) apply as forward and
// decode apply them, before the mask (flex.hpp gives the order).
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include "mha/flex.hpp"
#include "mha/kv_cache.hpp"
#include "mha/multihead_attention.hpp"
#include "mha/paged_kv_cache.hpp"

namespace mha {

namespace detail {

// A mask_mod without a block mask: every block partial, so that the flash kernel calls the
// mask_mod for every pair it computes; the decoding kernel evaluates it over a chunk of a query's
// keys first (row_cover), so that it reads no chunk that the step's queries do not see and masks
// none that they see whole.
template <class MaskMod>
struct UnblockedMask {
  static constexpr Index kWhole = Index(1) << 40;  // one block for any length
  const MaskMod* mask_mod_ = nullptr;

  const MaskMod& mask_mod() const { return *mask_mod_; }
  static Index query_block() { return kWhole; }
  static Index key_block() { return kWhole; }
  static BlockCover block(Index /*b*/, Index /*h*/, Index /*qb*/, Index /*kb*/) {
    return BlockCover::partial;
  }
  static BlockCover cover(Index /*b*/, Index /*h*/, Index /*i0*/, Index /*rows*/, Index /*j0*/,
                          Index /*cols*/) {
    return BlockCover::partial;
  }
  BlockCover row_cover(Index b, Index h, Index i, Index j0, Index cols) const {
    bool any_visible = false, any_hidden = false;
    for (Index j = j0; j < j0 + cols; ++j) {
      if ((*mask_mod_)(b, h, i, j)) {
        any_visible = true;
      } else {
        any_hidden = true;
      }
      if (any_visible && any_hidden) return BlockCover::partial;
    }
    return any_visible ? BlockCover::full : BlockCover::empty;
  }
  static void check_covers(Index /*batch*/, Index /*heads*/, Index /*queries*/, Index /*keys*/) {}
};

template <class Mask>
struct IsBlockMask : std::false_type {};
template <class MaskMod>
struct IsBlockMask<BlockMask<MaskMod>> : std::true_type {};

// The flash kernels' form of a mask argument: a BlockMask as it is, a mask_mod unblocked, and
// AllVisible as no mask at all.
template <class Mask>
struct LayerMask {
  static_assert(IsBlockMask<Mask>::value ||
                    std::is_invocable_r_v<bool, const Mask&, Index, Index, Index, Index>,
                "the mask of flex_forward and flex_decode is a BlockMask or a mask_mod(b, h, "
                "q_idx, kv_idx) -> bool (pass AllVisible{} before options for none)");
  using Type = std::conditional_t<IsBlockMask<Mask>::value, Mask, UnblockedMask<Mask>>;

  explicit LayerMask(const Mask& mask) {
    if constexpr (IsBlockMask<Mask>::value) {
      pointer = &mask;
    } else if constexpr (!std::is_same_v<Mask, AllVisible>) {
      unblocked.mask_mod_ = &mask;
      pointer = &unblocked;
    }
  }
  LayerMask(const LayerMask&) = delete;  // (pointer may point into it)
  LayerMask& operator=(const LayerMask&) = delete;

  UnblockedMask<Mask> unblocked;
  const Type* pointer = nullptr;  // null: every pair visible
};

template <class T>
struct FlexLayer {
  template <class ScoreMod, class Mask>
  static ForwardResult<T> forward(const MultiHeadAttention<T>& layer,
                                  const TensorView<const T>& query, const TensorView<const T>& key,
                                  const TensorView<const T>& value, const ScoreMod& score_mod,
                                  const Mask& mask, const ForwardOptions<T>& options) {
    const LayerParameters<T>& parameters = layer.parameters_;
    if (options.need_weights) {
      throw_argument("options.need_weights",
                     "flex_forward runs the flash kernel, which never forms the weights: set it "
                     "false");
    }
    if (options.kernel == Kernel::reference || parameters.talking_heads().active()) {
      throw_argument("options.kernel",
                     "user mods run in the flash kernel, which this layer (talking heads) or "
                     "these options (Kernel::reference) do not use");
    }
    const MultiHeadAttentionConfig& config = parameters.config();
    if (config.add_bias_kv || config.add_zero_attn) {
      throw_argument("flex_forward",
                     "a layer with add_bias_kv or add_zero_attn takes no mods: its extra keys "
                     "have no kv_idx among the key tensor's");
    }
    const ForwardPlan plan = plan_forward(parameters, query, key, value, options);
    const auto core = core_options(parameters, plan, options);
    const LayerMask<Mask> flex_mask(mask);
    using Flex = FlexTile<compute_t<T>, ScoreMod, typename LayerMask<Mask>::Type>;
    const Flex flex{&score_mod, flex_mask.pointer};
    Index sequences = plan.batch, longest_query = plan.query_len, longest_key = plan.key_len;
    if (!plan.sequences.empty()) {
      sequences = static_cast<Index>(plan.sequences.size());
      longest_query = longest_key = 0;
      for (const PackedSequence& sequence : plan.sequences) {
        longest_query = std::max(longest_query, sequence.query_len);
        longest_key = std::max(longest_key, sequence.key_len);
      }
    }
    flex.check_covers(sequences, parameters.num_heads(), longest_query, longest_key);
    Workspace<T> workspace;
    ForwardResult<T> result;
    run_forward(parameters, plan, core, query, key, value, options, workspace, result, nullptr,
                nullptr, flex);
    return result;
  }

  template <class ScoreMod, class Mask, class Cache, class... Sequences>
  static ForwardResult<T> step(const MultiHeadAttention<T>& layer, const TensorView<const T>& x,
                               Cache& cache, const ScoreMod& score_mod, const Mask& mask,
                               const ForwardOptions<T>& options,
                               const std::vector<Index>& new_tokens,
                               const Sequences&... sequences) {
    const LayerMask<Mask> layer_mask(mask);
    using Flex = FlexTile<compute_t<T>, ScoreMod, typename LayerMask<Mask>::Type>;
    const Flex flex{&score_mod, layer_mask.pointer};
    return Decoding<T>::flex_step(layer.parameters_, x, cache, sequences..., options, new_tokens,
                                  flex);
  }
};

}  // namespace detail

// What flex_forward needs by default: no weights (the flash kernel forms none).
template <class T>
ForwardOptions<T> flex_forward_options() {
  ForwardOptions<T> options;
  options.need_weights = false;
  return options;
}

// layer.forward(query, key, value, options) with score_mod applied to every score and `mask` (a
// mask_mod, or a BlockMask; AllVisible for none) hiding pairs; the options' built-in masks and
// biases apply too (flex.hpp gives the order). Refused, besides what forward refuses:
// need_weights, the reference kernel, a layer with talking heads, add_bias_kv or add_zero_attn,
// and a BlockMask that does not cover the call.
template <class T, class ScoreMod, class Mask = AllVisible>
ForwardResult<T> flex_forward(const MultiHeadAttention<T>& layer, const Tensor<T>& query,
                              const Tensor<T>& key, const Tensor<T>& value,
                              const ScoreMod& score_mod, const Mask& mask = {},
                              const ForwardOptions<T>& options = flex_forward_options<T>()) {
  return detail::FlexLayer<T>::forward(layer, query.view(), key.view(), value.view(), score_mod,
                                       mask, options);
}

// Self-attention: x as query, key and value.
template <class T, class ScoreMod, class Mask = AllVisible>
ForwardResult<T> flex_forward(const MultiHeadAttention<T>& layer, const Tensor<T>& x,
                              const ScoreMod& score_mod, const Mask& mask = {},
                              const ForwardOptions<T>& options = flex_forward_options<T>()) {
  return detail::FlexLayer<T>::forward(layer, x.view(), x.view(), x.view(), score_mod, mask,
                                       options);
}

// One decoding step of `layer` over `cache`, as layer.decode(x, cache, options, new_tokens), with
// score_mod applied to every score and `mask` (a mask_mod, or a BlockMask for the longest
// sequence; AllVisible for none) hiding pairs. Refused besides what decode refuses: the reference
// kernel (options.kernel) and a layer with talking heads, whose kernels take no mods, and a
// BlockMask that does not reach the step's longest sequence, or built for another batch or head
// count than the step's (or 1); each before the cache changes.
template <class T, class ScoreMod, class Mask = AllVisible>
ForwardResult<T> flex_decode(
    const MultiHeadAttention<T>& layer, TensorView<const T> x, KVCache<T>& cache,
    const ScoreMod& score_mod, const Mask& mask = {},
    const ForwardOptions<T>& options = MultiHeadAttention<T>::decode_options(),
    const std::vector<Index>& new_tokens = {}) {
  return detail::FlexLayer<T>::step(layer, x, cache, score_mod, mask, options, new_tokens);
}

template <class T, class ScoreMod, class Mask = AllVisible>
ForwardResult<T> flex_decode(
    const MultiHeadAttention<T>& layer, const Tensor<T>& x, KVCache<T>& cache,
    const ScoreMod& score_mod, const Mask& mask = {},
    const ForwardOptions<T>& options = MultiHeadAttention<T>::decode_options(),
    const std::vector<Index>& new_tokens = {}) {
  return detail::FlexLayer<T>::step(layer, x.view(), cache, score_mod, mask, options, new_tokens);
}

// The same over a paged cache's `sequences`, as layer.decode(x, cache, sequences, ...): the mods'
// b is a sequence's place in `sequences`.
template <class T, class ScoreMod, class Mask = AllVisible>
ForwardResult<T> flex_decode(
    const MultiHeadAttention<T>& layer, TensorView<const T> x, PagedKVCache<T>& cache,
    const std::vector<Index>& sequences, const ScoreMod& score_mod, const Mask& mask = {},
    const ForwardOptions<T>& options = MultiHeadAttention<T>::decode_options(),
    const std::vector<Index>& new_tokens = {}) {
  return detail::FlexLayer<T>::step(layer, x, cache, score_mod, mask, options, new_tokens,
                                    sequences);
}

template <class T, class ScoreMod, class Mask = AllVisible>
ForwardResult<T> flex_decode(
    const MultiHeadAttention<T>& layer, const Tensor<T>& x, PagedKVCache<T>& cache,
    const std::vector<Index>& sequences, const ScoreMod& score_mod, const Mask& mask = {},
    const ForwardOptions<T>& options = MultiHeadAttention<T>::decode_options(),
    const std::vector<Index>& new_tokens = {}) {
  return detail::FlexLayer<T>::step(layer, x.view(), cache, score_mod, mask, options, new_tokens,
                                    sequences);
}

}  // namespace mha
