// MultiHeadAttention<T>: torch.nn.MultiheadAttention (batch_first=True) for T = float, double,
// Eigen::half and Eigen::bfloat16.
//
// The 16-bit layers store their parameters, take and return tensors, and keep their KV cache in
// 16 bits, and compute in float: projections widen the weights as they multiply them (see
// product_transposed in kernels/gemm.hpp), the kernels see float queries, keys and values (a
// 16-bit cache is converted block by block as the flash kernel reads it), and the scores,
// softmax and sums are float, as the tutorial's §4.3 advises. Each result is rounded to 16 bits
// once. They serve inference (forward and decode); training runs in float or double (forward_train
// does not compile for them), and talking heads are refused.
//
// Parameters are stored under their PyTorch state_dict names and shapes, so a layer exported
// from PyTorch loads without renaming or transposing (the list is in layer/parameters.hpp):
// in_proj_weight [3E, E] (or q_proj_weight, k_proj_weight, v_proj_weight when kdim or vdim is not
// E), in_proj_bias [3E], out_proj.weight [E, E], out_proj.bias [E], bias_k and bias_v [1, 1, E],
// talking_heads_pre / _post [H, H], which no PyTorch module has, and sinks [H] (gpt-oss's learnable
// attention sinks, config.learnable_sinks). Every projection is y = x Wᵀ + b. The forward pass:
//   q, k, v = projections of query [B, L, E], key [B, S, kdim], value [B, S, vdim]
//   k, v   += bias_k, bias_v as one more key/value row        (add_bias_kv)
//   k, v   += one zero row                                     (add_zero_attn)
//   per head h (feature columns h*D .. (h+1)*D): softmax(q_h k_hᵀ / sqrt(D) + masks) v_h
//     (with talking heads, the logits are mixed across heads before the softmax and the weights
//     after it: see kernels/talking_heads.hpp)
//   output = concat(heads) W_oᵀ + b_o
//
// Masks follow PyTorch MHA, with polarity named (see mask.hpp): wrap a boolean PyTorch MHA mask
// with Mask<T>::blocked_where_true, an SDPA one with allowed_where_true, a float one with
// additive. Where every key of a query row is blocked in a head, that head's output row and
// weights are 0. PyTorch MHA returns NaN there (pytorch#41508); SDPA, FlashAttention and ggml
// return 0, and so does this library.
//
// Training (see "Training" in the class): forward_train keeps what backward needs in a
// SavedForward the caller owns, and applies dropout; backward returns the inputs' gradients and
// adds the parameters' into the layer's own gradient tensors, reachable by PyTorch name
// (gradient(name), parameters()) until zero_grad.
//
// Threads. What may be shared by threads calling at the same time:
//   - a MultiHeadAttention, for its const members: forward, decode (each with its own cache),
//     state_dict, parameter(name) const. They keep no state between calls (tests/test_threads.cpp
//     runs them concurrently under ThreadSanitizer).
//   - ForwardOptions, and the input tensors, which these calls only read.
// What belongs to one thread at a time:
//   - a Workspace, a ForwardResult written into, a KVCache, a SavedForward;
//   - the layer itself during forward_train, backward, zero_grad, set_parameter,
//     load_state_dict, prune_heads and an optimiser's step, which change it: no other call on
//     the layer may run meanwhile.
//
// The class composes the layer's rooms, each a header of its own under mha/layer/:
//   config.hpp        MultiHeadAttentionConfig, the constructor's arguments, and their checks
//   parameters.hpp    the parameters and gradients, their names, shapes and layouts, state_dict
//   options.hpp       ForwardOptions, ForwardResult, Workspace
//   forward.hpp       the forward plan and pass; projections.hpp the projections and their backward
//   training.hpp      SavedForward, forward_train, backward, InputGradients
//   decode.hpp        decoding with a KVCache
//   head_surgery.hpp  prune_heads
// With the CMake target mha::compiled, their heavy templates are compiled once, into a library
// (mha/compiled.hpp); with mha::mha, every file that uses them instantiates them.
//
// Failures. Every check runs before anything changes: a forward, decode, forward_train or
// load_state_dict that throws leaves the layer, its Workspace and a KVCache as they were (a
// SavedForward is left empty). NaN and Inf inputs: see ForwardOptions::check_inputs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/init.hpp"
#include "mha/kv_cache.hpp"
#include "mha/layer/config.hpp"
#include "mha/layer/decode.hpp"
#include "mha/layer/forward.hpp"
#include "mha/layer/head_surgery.hpp"
#include "mha/layer/options.hpp"
#include "mha/layer/parameters.hpp"
#include "mha/layer/training.hpp"
#include "mha/paged_kv_cache.hpp"
#include "mha/parameters.hpp"
#include "mha/tensor.hpp"

namespace mha {

template <class T>
class FrozenMultiHeadAttention;
namespace detail {
template <class T>
struct FlexLayer;
}  // namespace detail

template <class T>
class MultiHeadAttention {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> ||
                    std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>,
                "MultiHeadAttention<T> is for float, double, Eigen::half and Eigen::bfloat16");

 public:
  // Parameters, inputs, outputs and the KV cache are stored as T; products, scores, the softmax
  // and every sum run in Compute: float for the 16-bit types, T otherwise.
  using Scalar = T;
  using Compute = detail::compute_t<T>;
  static constexpr bool kTrainable = !detail::is_16bit_v<T>;

  MultiHeadAttention(Index embed_dim, Index num_heads)
      : MultiHeadAttention(MultiHeadAttentionConfig(embed_dim, num_heads)) {}

  // Checks the config (see MultiHeadAttentionConfig) and initialises the parameters as PyTorch
  // does, from config.seed, which also seeds the dropout draws.
  explicit MultiHeadAttention(const MultiHeadAttentionConfig& config) : parameters_(config) {
    parameters_.reset(config.seed);
    seed_dropout(config.seed);
  }

  // Builds a layer from PyTorch state_dict tensors. Which tensors are present decides bias,
  // add_bias_kv and kdim/vdim, and k_proj_weight's rows num_kv_heads; num_heads and add_zero_attn
  // are not in a state_dict.
  static MultiHeadAttention from_state_dict(const std::map<std::string, Tensor<T>>& state,
                                            Index num_heads, bool add_zero_attn = false) {
    MultiHeadAttention layer(
        detail::LayerParameters<T>::config_of_state_dict(state, num_heads, add_zero_attn));
    layer.load_state_dict(state);
    return layer;
  }

  // PyTorch's _reset_parameters: xavier-uniform over the whole in_proj_weight (or each of the
  // q/k/v weights), zero biases, out_proj.weight as nn.Linear, xavier-normal bias_k/bias_v; and
  // identity talking-heads mixes.
  void reset_parameters(std::uint64_t seed) { parameters_.reset(seed); }

  // The completed config: head_dim, num_kv_heads, kdim and vdim are never 0 here.
  const MultiHeadAttentionConfig& config() const { return parameters_.config(); }
  Index embed_dim() const { return parameters_.embed_dim(); }
  Index num_heads() const { return parameters_.num_heads(); }
  Index head_dim() const { return parameters_.head_dim(); }
  // H·D, the heads' total width: E unless config.head_dim (or prune_heads) made it another.
  Index inner_dim() const { return parameters_.inner_dim(); }
  // H_kv, the key/value heads (num_heads unless grouped-query attention), and their width H_kv·D.
  Index num_kv_heads() const { return parameters_.num_kv_heads(); }
  Index kv_dim() const { return parameters_.kv_dim(); }
  Index kdim() const { return parameters_.kdim(); }
  Index vdim() const { return parameters_.vdim(); }
  // PyTorch's _qkv_same_embed_dim: one packed in_proj_weight instead of three (never with
  // grouped-query attention, whose K and V projections are narrower).
  bool packed_projection() const { return parameters_.packed_projection(); }

  // ---- Parameters under their PyTorch names (layer/parameters.hpp) ----
  // The state_dict names of this layer's parameters, in PyTorch's order.
  std::vector<std::string> parameter_names() const { return parameters_.names(); }
  bool has_parameter(const std::string& name) const { return parameters_.has(name); }
  // A view of one parameter with its PyTorch shape; writing through it changes the layer.
  TensorView<T> parameter(const std::string& name) { return parameters_.find(name).view(); }
  TensorView<const T> parameter(const std::string& name) const {
    return parameters_.find(name).view();
  }
  void set_parameter(const std::string& name, TensorView<const T> value) {
    parameters_.set(name, value);
  }
  std::map<std::string, Tensor<T>> state_dict() const { return parameters_.state_dict(); }
  // Strict, as PyTorch's default: every parameter present with its shape, nothing unknown.
  // Checks everything before changing anything.
  void load_state_dict(const std::map<std::string, Tensor<T>>& state) {
    parameters_.load_state_dict(state);
  }

  // ---- Forward (layer/forward.hpp) ----
  // query [B, L, E], key [B, S, kdim], value [B, S, vdim]; or unbatched [L, E], [S, kdim],
  // [S, vdim]. See ForwardOptions for the masks and what is returned. Evaluation mode: no dropout.
  ForwardResult<T> forward(TensorView<const T> query, TensorView<const T> key,
                           TensorView<const T> value, const ForwardOptions<T>& options = {}) const;

  // The same, writing into `result` and using `workspace` for its buffers: with the same shapes
  // as the previous call, neither allocates.
  void forward(TensorView<const T> query, TensorView<const T> key, TensorView<const T> value,
               const ForwardOptions<T>& options, Workspace<T>& workspace,
               ForwardResult<T>& result) const;

  // Self-attention: query, key and value are all x.
  ForwardResult<T> forward(TensorView<const T> x, const ForwardOptions<T>& options = {}) const {
    return forward(x, x, x, options);
  }

  // ---- Training (layer/training.hpp) ----
  //
  //   SavedForward<T> saved;                                   // owned by the caller
  //   auto result = layer.forward_train(q, k, v, options, saved);  // training mode: dropout
  //   auto grads = layer.backward(saved, grad_output);         // d loss / d (q, k, v), and
  //                                                            // d loss / d parameters added up
  //   layer.gradient("in_proj_weight"); layer.parameters(); layer.zero_grad();
  //
  // forward_train copies its inputs and options into `saved`, so they may go away; `saved` must
  // not outlive the layer, and the parameters must not change between the two calls (backward
  // uses the saved activations and the current weights). Gradients accumulate over backward
  // calls until zero_grad, as in PyTorch. One saved object serves any number of forward_train /
  // backward pairs, reusing its buffers.

  ForwardResult<T> forward_train(TensorView<const T> query, TensorView<const T> key,
                                 TensorView<const T> value, const ForwardOptions<T>& options,
                                 SavedForward<T>& saved) {
    ForwardResult<T> result;
    forward_train(query, key, value, options, saved, result);
    return result;
  }

  ForwardResult<T> forward_train(TensorView<const T> x, const ForwardOptions<T>& options,
                                 SavedForward<T>& saved) {
    return forward_train(x, x, x, options, saved);
  }

  // The same into a result kept from step to step, as forward's with a Workspace: its buffers
  // are reused, so a training loop's steps of one shape take no new memory. (Fresh tensors at
  // every step cost 15-20 % of a step at L = 4096, in page faults: bench/RESULTS.md, 2026-12-04.)
  void forward_train(TensorView<const T> query, TensorView<const T> key, TensorView<const T> value,
                     const ForwardOptions<T>& options, SavedForward<T>& saved,
                     ForwardResult<T>& result) {
    static_assert(kTrainable,
                  "training runs in float or double: train a MultiHeadAttention<float> "
                  "and load its state_dict into the 16-bit layer");
    detail::forward_train(parameters_, this, dropout_random_, query, key, value, options,
                          saved.state_, result);
  }

  // The gradients of loss = sum(output ∘ grad_output) for the forward_train that filled `saved`:
  // returned for the inputs (reported separately for query, key and value even when they were
  // one tensor; the shared tensor's gradient is their sum), and added into gradient(name) for
  // every parameter.
  InputGradients<T> backward(SavedForward<T>& saved, TensorView<const T> grad_output) {
    InputGradients<T> grads;
    backward(saved, grad_output, grads);
    return grads;
  }

  // The same into gradients kept from step to step, their tensors reused (every element is
  // overwritten).
  void backward(SavedForward<T>& saved, TensorView<const T> grad_output, InputGradients<T>& grads) {
    static_assert(kTrainable, "training runs in float or double");
    detail::backward(parameters_, this, saved.state_, grad_output, grads);
  }

  // The accumulated gradient of one parameter, with its shape. Throws until a forward_train,
  // zero_grad or parameters() call has allocated the gradients (PyTorch's grad is None then).
  TensorView<const T> gradient(const std::string& name) const { return parameters_.gradient(name); }

  void zero_grad() { parameters_.zero_grad(); }

  // Each parameter with its gradient, under PyTorch's names and order: what optimisers, gradient
  // clipping and diagnostics take. The views stay valid as long as the layer.
  ParameterList<T> parameters() {
    static_assert(kTrainable, "training runs in float or double");
    return parameters_.parameter_list();
  }

  // Restarts the dropout generator: the same seed gives the same dropout masks for the same
  // sequence of forward_train calls. (Construction seeds it from config.seed.)
  void seed_dropout(std::uint64_t seed) { dropout_random_ = Random(seed ^ kDropoutSeedSalt); }

  // ---- Head surgery (layer/head_surgery.hpp) ----
  // Removes heads from the parameters ("Are Sixteen Heads Really Better than One?"): their rows
  // of W_q, W_k, W_v, of the in-projection bias and of bias_k/bias_v, and their columns of
  // out_proj.weight. `heads` are indices in [0, H), in any order, each once; at least one head
  // must stay. The layer then computes what it computed with those heads gated to 0
  // (ForwardOptions::head_gate), with H' heads of the same D: q_proj_weight becomes [H'·D, E] and
  // out_proj.weight [E, H'·D] (in_proj_weight [3·H'·D, E] if packed), under the same names, so a
  // pruned layer's state_dict loads back with from_state_dict. The kept heads' per-head weights
  // are unchanged; averaged weights now average over H' heads. Gradients are dropped (the next
  // forward_train, zero_grad or parameters() allocates them in the new shapes), and ParameterRefs
  // taken before (an optimiser's) point to the old shapes: take them again. Refused for
  // grouped-query layers, whose query heads share key/value heads, and with talking heads, where
  // a head gated to 0 still feeds the others' mixes.
  void prune_heads(const std::vector<Index>& heads) { detail::prune_heads(parameters_, heads); }

  // ---- Decoding with a KV cache (layer/decode.hpp, kv_cache.hpp) ----

  // A cache for this layer's keys and values: `batch` sequences of at most `capacity` tokens, or
  // with window >= 0 a sliding-window cache keeping each sequence's last `window` keys; stored
  // in the layer's type or quantized (KVCacheFormat, kv_cache.hpp).
  KVCache<T> make_kv_cache(Index batch, Index capacity, Index window = -1,
                           KVCacheFormat format = KVCacheFormat::as_layer) const {
    return KVCache<T>(batch, num_kv_heads(), head_dim(), capacity, window, format);
  }

  // A streaming cache (StreamingLLM; kv_cache.hpp): each sequence keeps its first sink_tokens
  // tokens and its last `window`, at positions inside the cache, so a model decodes a stream of
  // any length in fixed memory; capacity >= sink_tokens + window + the most tokens of a step.
  KVCache<T> make_streaming_cache(Index batch, Index sink_tokens, Index window, Index capacity,
                                  KVCacheFormat format = KVCacheFormat::as_layer) const {
    return KVCache<T>::streaming(batch, num_kv_heads(), head_dim(), sink_tokens, window, capacity,
                                 format);
  }

  // A paged cache for this layer's keys and values (paged_kv_cache.hpp): a pool of num_pages
  // pages of page_size tokens (a multiple of 48) that any number of sequences share.
  PagedKVCache<T> make_paged_kv_cache(Index page_size, Index num_pages,
                                      KVCacheFormat format = KVCacheFormat::as_layer) const {
    return PagedKVCache<T>(num_kv_heads(), head_dim(), page_size, num_pages, format);
  }

  // Cross-attention (an encoder-decoder's): memory [B, S, kdim] ([S, kdim] for one sequence), an
  // encoder's output, projected into keys and values once, into a KVCache of B sequences and
  // capacity S whose sequence b holds its first lengths[b] rows (all S without lengths: shorter
  // encoder outputs padded to S). Every later cross_attend reads it. key and value are both the
  // memory, so kdim must equal vdim; add_bias_kv and add_zero_attn are refused.
  KVCache<T> encode_memory(TensorView<const T> memory, const std::vector<Index>& lengths = {},
                           KVCacheFormat format = KVCacheFormat::as_layer) const {
    const MultiHeadAttentionConfig& config = parameters_.config();
    if (config.kdim != config.vdim) {
      detail::throw_argument("memory", "is both key and value, so kdim (" +
                                           std::to_string(config.kdim) + ") must equal vdim (" +
                                           std::to_string(config.vdim) + ")");
    }
    if (config.add_bias_kv || config.add_zero_attn) {
      detail::throw_argument("encode_memory",
                             "a layer with add_bias_kv or add_zero_attn: its extra key is not "
                             "part of the memory");
    }
    if (memory.rank() != 2 && memory.rank() != 3) {
      detail::throw_shape(
          "memory",
          "[B, S, " + std::to_string(config.kdim) + "] or [S, " + std::to_string(config.kdim) + "]",
          memory.shape());
    }
    const Index batch = memory.rank() == 3 ? memory.dim(0) : 1;
    const Index rows = memory.dim(memory.rank() - 2);
    detail::check_shape(
        "memory", memory.rank() == 3 ? Shape{batch, rows, config.kdim} : Shape{rows, config.kdim},
        memory.shape());
    if (!lengths.empty() && static_cast<Index>(lengths.size()) != batch) {
      detail::throw_argument("lengths", "expected one length per sequence (" +
                                            std::to_string(batch) + "), got " +
                                            std::to_string(lengths.size()));
    }
    for (const Index length : lengths) {
      if (length < 0 || length > rows) {
        detail::throw_argument("lengths", "expected lengths in [0, S = " + std::to_string(rows) +
                                              "], got " + std::to_string(length));
      }
    }
    KVCache<T> cache = make_kv_cache(batch, rows, -1, format);
    detail::Decoding<T>::encode(parameters_, memory, cache, lengths);
    return cache;
  }

  // What cross_attend needs by default: no causal masking, no weights.
  static ForwardOptions<T> cross_attention_options() {
    ForwardOptions<T> options;
    options.need_weights = false;
    return options;
  }

  // x [B, n, E] ([n, E] for one sequence; or packed with options.cu_seqlens, as decode) attends to
  // every row that encode_memory put in `memory` for its sequence: the output is forward's with
  // query x and key = value = the memory (its first lengths[b] rows), without projecting the
  // memory again. The memory does not change (its buffers serve the step). Refused: is_causal,
  // RoPE, windows, patterns and ALiBi (no positions are shared between x and the memory), masks
  // and need_weights (as decode).
  ForwardResult<T> cross_attend(TensorView<const T> x, KVCache<T>& memory,
                                const ForwardOptions<T>& options = cross_attention_options(),
                                const std::vector<Index>& new_tokens = {}) const {
    return detail::Decoding<T>::cross_step(parameters_, x, memory, options, new_tokens);
  }

  // What decode needs by default: causal, no weights.
  static ForwardOptions<T> decode_options() {
    ForwardOptions<T> options;
    options.need_weights = false;
    options.is_causal = true;
    return options;
  }

  // One decoding step of self-attention. x [B, n, E] ([n, E] for a cache of one sequence) holds
  // each sequence's next n tokens, or with new_tokens only the first new_tokens[b] of row b (the
  // rest is padding, and its output rows are 0): sequences of different lengths advance together.
  // The new tokens' keys and values are projected (and rotated) into the cache, and each new
  // token attends to its sequence's cache: the output is that of forward over the whole sequence
  // (with the same options), for those tokens.
  //
  // Token i of the step is at position cache.position(b) + i. The alignment is therefore always
  // bottom-right (the new tokens come after the cached ones): is_causal, the window, the pattern
  // and ALiBi use it whatever causal_alignment, window.alignment and pattern.alignment say, and
  // rope rotates by that position plus rope->position_offset. is_causal = false lets a step's
  // tokens see each other (a prompt with bidirectional attention). Refused, before anything
  // changes: masks (the cache decides what a token sees), need_weights, add_bias_kv and
  // add_zero_attn (their key would follow every step's keys), kdim or vdim other than E, a window
  // wider than a sliding cache keeps, a pattern with a sliding cache, and a step that overflows
  // the cache's capacity. Const: a layer serves any number of caches, one thread each.
  ForwardResult<T> decode(TensorView<const T> x, KVCache<T>& cache,
                          const ForwardOptions<T>& options = decode_options(),
                          const std::vector<Index>& new_tokens = {}) const;
  // The same over a paged cache: row b of x [B, n, E] ([n, E] for one sequence) continues the
  // cache's sequence sequences[b] (distinct ids from add_sequence or fork), whose pages hold its
  // new keys and values; any set of the cache's sequences may step together, each with its own
  // count (new_tokens). Also refused, before anything changes: an id the cache does not hold, an
  // id twice, and a step that needs more pages than are free. Either cache also takes a packed
  // step: with options.cu_seqlens (B + 1 cumulative counts), x is [T, E] holding only the
  // sequences' new tokens one sequence after another, and the output is [T, E]; no padding row
  // is projected (a continuous-batching step of prompt chunks and single tokens).
  ForwardResult<T> decode(TensorView<const T> x, PagedKVCache<T>& cache,
                          const std::vector<Index>& sequences,
                          const ForwardOptions<T>& options = decode_options(),
                          const std::vector<Index>& new_tokens = {}) const;

 private:
  friend class FrozenMultiHeadAttention<T>;  // forwards with its packed weights (mha/frozen.hpp)
  friend struct detail::FlexLayer<T>;  // forwards and decodes with user mods (mha/flex_layer.hpp)
  static constexpr std::uint64_t kDropoutSeedSalt = 0xD409A7E5EEDull;

  detail::LayerParameters<T> parameters_;
  Random dropout_random_{0};
};

// Out of the class, so that they are not inline: with mha::compiled a caller's file then compiles
// only the call, not the Workspace and the result they build (see MHA_LAYER_TEMPLATES below).
template <class T>
ForwardResult<T> MultiHeadAttention<T>::forward(TensorView<const T> query, TensorView<const T> key,
                                                TensorView<const T> value,
                                                const ForwardOptions<T>& options) const {
  Workspace<T> workspace;
  ForwardResult<T> result;
  forward(query, key, value, options, workspace, result);
  return result;
}

template <class T>
void MultiHeadAttention<T>::forward(TensorView<const T> query, TensorView<const T> key,
                                    TensorView<const T> value, const ForwardOptions<T>& options,
                                    Workspace<T>& workspace, ForwardResult<T>& result) const {
  const detail::ForwardPlan plan = detail::plan_forward(parameters_, query, key, value, options);
  const auto core = detail::core_options(parameters_, plan, options);
  detail::run_forward(parameters_, plan, core, query, key, value, options, workspace, result,
                      nullptr, nullptr);
}

template <class T>
ForwardResult<T> MultiHeadAttention<T>::decode(TensorView<const T> x, KVCache<T>& cache,
                                               const ForwardOptions<T>& options,
                                               const std::vector<Index>& new_tokens) const {
  return detail::Decoding<T>::step(parameters_, x, cache, options, new_tokens);
}

template <class T>
ForwardResult<T> MultiHeadAttention<T>::decode(TensorView<const T> x, PagedKVCache<T>& cache,
                                               const std::vector<Index>& sequences,
                                               const ForwardOptions<T>& options,
                                               const std::vector<Index>& new_tokens) const {
  return detail::Decoding<T>::step(parameters_, x, cache, sequences, options, new_tokens);
}

// The instantiations mha::compiled holds (src/layer_forward.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_LAYER_TEMPLATES(PREFIX, T)                                                            \
  PREFIX template ForwardResult<T> MultiHeadAttention<T>::forward(                                \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, const ForwardOptions<T>&)    \
      const;                                                                                      \
  PREFIX template void MultiHeadAttention<T>::forward(                                            \
      TensorView<const T>, TensorView<const T>, TensorView<const T>, const ForwardOptions<T>&,    \
      Workspace<T>&, ForwardResult<T>&) const;                                                    \
  PREFIX template ForwardResult<T> MultiHeadAttention<T>::decode(                                 \
      TensorView<const T>, KVCache<T>&, const ForwardOptions<T>&, const std::vector<Index>&)      \
      const;                                                                                      \
  PREFIX template ForwardResult<T> MultiHeadAttention<T>::decode(                                 \
      TensorView<const T>, PagedKVCache<T>&, const std::vector<Index>&, const ForwardOptions<T>&, \
      const std::vector<Index>&) const;
// NOLINTEND(bugprone-macro-parentheses)

MHA_EXTERN_TEMPLATES(MHA_LAYER_TYPES, MHA_LAYER_TEMPLATES)

}  // namespace mha
