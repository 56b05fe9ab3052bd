// Decoding with user mods: a MultiHeadAttention's decode step (layer/decode.hpp) whose attention
// applies a score_mod and a mask (flex.hpp) to every score, in the decoding kernel's pass over the
// whole batch and in the flash kernel that takes a longer step (a prompt).
//
// What the mods see: sequence b of the step as batch element b (for a paged cache, the b-th id of
// `sequences`), query head h, and positions as rows of the sequence's cache: the step's new token
// i of n is q_idx = length - n + i (length counting the new tokens), and kv_idx = 0 .. length - 1.
// For a cache of a whole sequence (KVCache, PagedKVCache) these are the tokens' positions in the
// sequence, so that a mod written for flex_attention over the whole sequence (q_idx and kv_idx
// from 0) gives the same attention token by token; in a streaming cache they are its rows.
//
// The mask: a mask_mod, or a BlockMask built once for the longest sequence (as FlexAttention's
// decoding slices one). The decoding kernel reads no chunk of 256 cached keys that no query of the
// step sees, which it learns from the block mask's blocks or by calling the mask_mod for the
// chunk's keys; the flash kernel (a prompt) skips the block mask's empty blocks, and calls a
// mask_mod given alone for every pair. AllVisible (the default)
// masks nothing. The built-in options (causal masking, windows, ALiBi, softcap, sinks, RoPE) apply
// as decode applies them, before the mask (flex.hpp gives the order).
#pragma once

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
  static void check_decoding(Index /*batch*/, Index /*heads*/, Index /*positions*/) {}
};

template <class Mask>
struct IsBlockMask : std::false_type {};
template <class MaskMod>
struct IsBlockMask<BlockMask<MaskMod>> : std::true_type {};

// The flash kernels' form of a mask argument: a BlockMask as it is, a mask_mod unblocked, and
// AllVisible as no mask at all.
template <class Mask>
struct DecodingMask {
  static_assert(IsBlockMask<Mask>::value ||
                    std::is_invocable_r_v<bool, const Mask&, Index, Index, Index, Index>,
                "the mask of flex_decode is a BlockMask or a mask_mod(b, h, q_idx, kv_idx) -> "
                "bool (pass AllVisible{} before options for none)");
  using Type = std::conditional_t<IsBlockMask<Mask>::value, Mask, UnblockedMask<Mask>>;

  explicit DecodingMask(const Mask& mask) {
    if constexpr (IsBlockMask<Mask>::value) {
      pointer = &mask;
    } else if constexpr (!std::is_same_v<Mask, AllVisible>) {
      unblocked.mask_mod_ = &mask;
      pointer = &unblocked;
    }
  }
  DecodingMask(const DecodingMask&) = delete;  // (pointer may point into it)
  DecodingMask& operator=(const DecodingMask&) = delete;

  UnblockedMask<Mask> unblocked;
  const Type* pointer = nullptr;  // null: every pair visible
};

template <class T>
struct FlexDecoding {
  template <class ScoreMod, class Mask, class Cache, class... Sequences>
  static ForwardResult<T> step(const MultiHeadAttention<T>& layer, const TensorView<const T>& x,
                               Cache& cache, const ScoreMod& score_mod, const Mask& mask,
                               const ForwardOptions<T>& options,
                               const std::vector<Index>& new_tokens,
                               const Sequences&... sequences) {
    const DecodingMask<Mask> decoding_mask(mask);
    using Flex = FlexTile<compute_t<T>, ScoreMod, typename DecodingMask<Mask>::Type>;
    const Flex flex{&score_mod, decoding_mask.pointer};
    return Decoding<T>::flex_step(layer.parameters_, x, cache, sequences..., options, new_tokens,
                                  flex);
  }
};

}  // namespace detail

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
  return detail::FlexDecoding<T>::step(layer, x, cache, score_mod, mask, options, new_tokens);
}

template <class T, class ScoreMod, class Mask = AllVisible>
ForwardResult<T> flex_decode(
    const MultiHeadAttention<T>& layer, const Tensor<T>& x, KVCache<T>& cache,
    const ScoreMod& score_mod, const Mask& mask = {},
    const ForwardOptions<T>& options = MultiHeadAttention<T>::decode_options(),
    const std::vector<Index>& new_tokens = {}) {
  return detail::FlexDecoding<T>::step(layer, x.view(), cache, score_mod, mask, options,
                                       new_tokens);
}

// The same over a paged cache's `sequences`, as layer.decode(x, cache, sequences, ...): the mods'
// b is a sequence's place in `sequences`.
template <class T, class ScoreMod, class Mask = AllVisible>
ForwardResult<T> flex_decode(
    const MultiHeadAttention<T>& layer, TensorView<const T> x, PagedKVCache<T>& cache,
    const std::vector<Index>& sequences, const ScoreMod& score_mod, const Mask& mask = {},
    const ForwardOptions<T>& options = MultiHeadAttention<T>::decode_options(),
    const std::vector<Index>& new_tokens = {}) {
  return detail::FlexDecoding<T>::step(layer, x, cache, score_mod, mask, options, new_tokens,
                                       sequences);
}

template <class T, class ScoreMod, class Mask = AllVisible>
ForwardResult<T> flex_decode(
    const MultiHeadAttention<T>& layer, const Tensor<T>& x, PagedKVCache<T>& cache,
    const std::vector<Index>& sequences, const ScoreMod& score_mod, const Mask& mask = {},
    const ForwardOptions<T>& options = MultiHeadAttention<T>::decode_options(),
    const std::vector<Index>& new_tokens = {}) {
  return detail::FlexDecoding<T>::step(layer, x.view(), cache, score_mod, mask, options, new_tokens,
                                       sequences);
}

}  // namespace mha
